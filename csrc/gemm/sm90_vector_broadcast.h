// Row / column vector broadcast nodes for the sm_90 EVT epilogues of the generated w8a8 GEMMs
// (cutlass_kernels/gen_w8a8.py substitutes them for CUTLASS's Sm90RowBroadcast /
// Sm90ColBroadcast in the per-token x per-channel kernels). Torch-free.
//
// Why: CUTLASS 4.2's Sm90ColBroadcast loads a tile's rows of the per-token scale from global
// memory at the start of every output tile's epilogue (Sm90RowBroadcast: the tile's columns into
// shared memory, then a barrier), and neither has a pipelined variant (Stages must be 0). When the
// main loop is short (K = 1024) that L2 latency sits on the critical path of every tile: the
// per-token epilogue cost 4-7% over per-tensor there (docs/w8a8_gemm.md, "Epilogue cost").
//
// These nodes load the vectors the way the epilogue loads its C operand: the epilogue's
// producer-load warp, running ahead of the consumer warps, copies a tile's slice of the vector
// into shared memory (cp.async, zero-filled past the problem's edge) when it acquires the tile's
// first load-pipeline stage, and ties the copies' completion to that stage's full barrier
// (cp.async.mbarrier.arrive); the consumer warps read their fragment's values after the
// collective's consumer_wait. The load latency hides behind the previous tile's epilogue and, in
// the ping-pong and cooperative schedules, this tile's main loop.
//
// Requirements, checked in can_implement or at compile time:
//   - the pointer is 4-byte aligned (the glue passes 16-byte aligned scales and bias);
//   - 32-bit elements, or 16-bit elements for a row vector whose length N is even (the w8a8
//     kernels need N % 16 == 0): one cp.async moves 4 bytes;
//   - no batch mode (L == 1; the stride's L mode is static zero);
//   - CtaTileShapeMNK and EpilogueTile are the collective's CTA tile and epilogue subtile.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace qops {
namespace cutlass_ext {

namespace detail {

// 4-byte global -> shared copy, zero-filled when !valid (nothing is read then).
CUTLASS_DEVICE void cp_async_4_zfill(void* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t dst = cute::cast_smem_ptr_to_uint(smem);
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes)
               : "memory");
#endif
}

// Makes the mbarrier's current phase wait for this thread's cp.async copies issued so far: the
// pending-arrival count is raised by one now and lowered when the copies have landed.
CUTLASS_DEVICE void cp_async_mbarrier_arrive(uint64_t* mbarrier) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t bar = cute::cast_smem_ptr_to_uint(mbarrier);
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
#endif
}

}  // namespace detail

// IsRow: a row vector [N] broadcast over M (per-channel scale, bias; StrideMNL (_0, _1, _0)).
// Otherwise a column vector [M] broadcast over N (per-token scale; StrideMNL (_1, _0, _0)).
// The Arguments match CUTLASS's Sm90RowBroadcast / Sm90ColBroadcast: {ptr, null_default, stride};
// a null pointer reads null_default everywhere (and loads nothing).
template <class CtaTileShapeMNK, class EpilogueTile, class Element, class ElementCompute, class StrideMNL, bool IsRow>
struct Sm90VectorBroadcastPipelined {
  static constexpr int kCtaM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int kCtaN = cute::size<1>(CtaTileShapeMNK{});
  static constexpr int kEpiM = cute::size<0>(EpilogueTile{});
  static constexpr int kEpiN = cute::size<1>(EpilogueTile{});
  static constexpr int kSubtiles = (kCtaM / kEpiM) * (kCtaN / kEpiN);  // load-pipeline stages per tile
  static constexpr int kLen = IsRow ? kCtaN : kCtaM;                   // elements of the vector per tile
  static constexpr int kSlots = 2;                                     // tiles in flight (see step)
  static constexpr int kElemsPerCopy = 4 / static_cast<int>(sizeof(Element));
  static constexpr int kCopies = kLen / kElemsPerCopy;                 // 4-byte copies per tile

  static_assert(kCtaM % kEpiM == 0 && kCtaN % kEpiN == 0, "the epilogue subtile must divide the tile");
  static_assert(sizeof(Element) == 4 || (IsRow && sizeof(Element) == 2),
                "32-bit elements, or 16-bit ones in a row vector of even length");
  static_assert(kLen % kElemsPerCopy == 0, "the tile's slice is not a whole number of 4-byte copies");
  using ExpectedStride = cute::conditional_t<IsRow, cute::Stride<cute::_0, cute::_1, cute::_0>,
                                             cute::Stride<cute::_1, cute::_0, cute::_0>>;
  static_assert(cute::is_same_v<StrideMNL, ExpectedStride>, "only non-batched row / column vectors");

  // (CTA_M, CTA_N, SLOT): one tile's slice of the vector per slot, broadcast along the other mode.
  using SmemLayout = cute::Layout<
      cute::Shape<cute::Int<kCtaM>, cute::Int<kCtaN>, cute::Int<kSlots>>,
      cute::conditional_t<IsRow, cute::Stride<cute::_0, cute::_1, cute::Int<kLen>>,
                          cute::Stride<cute::_1, cute::_0, cute::Int<kLen>>>>;

  struct SharedStorage {
    cute::array_aligned<Element, kLen * kSlots, 16> smem;
  };

  struct Arguments {
    Element const* ptr = nullptr;
    Element null_default = Element(0);
    StrideMNL stride = {};
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    if (reinterpret_cast<uintptr_t>(args.ptr) % 4 != 0) return false;
    if constexpr (sizeof(Element) == 2) {
      auto problem_shape_mnkl = cute::append<4>(problem_shape, 1);
      if (cute::get<1>(problem_shape_mnkl) % 2 != 0) return false;
    }
    return true;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90VectorBroadcastPipelined() {}

  CUTLASS_HOST_DEVICE Sm90VectorBroadcastPipelined(Params const& params, SharedStorage const& shared_storage)
      : params_ptr(&params), smem(const_cast<Element*>(shared_storage.smem.data())) {}

  Params const* params_ptr = nullptr;
  Element* smem = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return params_ptr->ptr != nullptr; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_zero() const {
    return params_ptr->ptr == nullptr && params_ptr->null_default == Element(0);
  }

  template <class Shape>
  static constexpr void check_tiles() {
    static_assert(cute::size<0>(Shape{}) == kEpiM && cute::size<1>(Shape{}) == kEpiN,
                  "the EpilogueTile given to the node is not the collective's epilogue subtile");
  }

  // ---- producer-load warp ----------------------------------------------------------------------
  // The epilogue's load pipeline has one stage per subtile, at most 4 deep, so a tile's subtiles
  // cannot all be in flight; loading each subtile's slice with its stage would expose the L2
  // latency in the middle of every epilogue. Instead the whole tile's slice is loaded with the
  // tile's first subtile, into one of two slots (by tile parity), and its completion is tied to
  // that stage's full barrier; the consumers read the slot at every subtile of the tile.
  //
  // Slot reuse is safe: tile t + 2 is loaded after its first stage was acquired, i.e. after the
  // consumers released the stage kSubtiles + 1 - StagesC >= 1 iterations past tile t's last
  // subtile, whose values they read (previsit) before that release.
  // The tile ordinal is load_iteration / kSubtiles: every load() / store() call of CUTLASS 4.2's
  // sm90 TMA epilogue walks all the tile's subtiles (subtile_idx is only set by stream-K's separate
  // reduction, which that version disables), and the ping-pong consumers advance their pipeline
  // state by a whole tile for the tiles of the other warp group.
  struct ProducerLoadCallbacks : cutlass::epilogue::fusion::EmptyProducerLoadCallbacks {
    Element const* tile_ptr;  // the vector at this tile's first row (column); nullptr: no loads
    int extent;               // valid elements from tile_ptr (the problem's edge)
    Element* smem;

    CUTLASS_DEVICE ProducerLoadCallbacks(Element const* tile_ptr, int extent, Element* smem)
        : tile_ptr(tile_ptr), extent(extent), smem(smem) {}

    // Called by all 32 lanes of the producer warp after the stage was acquired and before the
    // collective's producer_commit arrives on its full barrier.
    CUTLASS_DEVICE void step(uint64_t* full_mbarrier_ptr, int epi_m, int epi_n, int load_iteration, bool) {
      if (tile_ptr == nullptr || epi_m != 0 || epi_n != 0) return;  // the tile's first subtile only
      const int lane = static_cast<int>(threadIdx.x % cutlass::NumThreadsPerWarp);
      Element* slot = smem + (static_cast<uint32_t>(load_iteration) / kSubtiles) % kSlots * kLen;
      CUTLASS_PRAGMA_UNROLL
      for (int c0 = 0; c0 < kCopies; c0 += cutlass::NumThreadsPerWarp) {
        const int c = c0 + lane;
        if (kCopies % cutlass::NumThreadsPerWarp == 0 || c < kCopies) {
          const int i = c * kElemsPerCopy;
          const bool valid = i < extent;  // a 4-byte copy never straddles the edge (N even)
          detail::cp_async_4_zfill(slot + i, valid ? tile_ptr + i : tile_ptr, valid);
        }
      }
      detail::cp_async_mbarrier_arrive(full_mbarrier_ptr);
    }
  };

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const& args) {
    check_tiles<decltype(args.epi_tile)>();
    static_assert(cute::size<0>(decltype(args.tile_shape_mnk){}) == kCtaM &&
                  cute::size<1>(decltype(args.tile_shape_mnk){}) == kCtaN, "not the collective's CTA tile");
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int first = IsRow ? static_cast<int>(n) * kCtaN : static_cast<int>(m) * kCtaM;
    const int extent = (IsRow ? static_cast<int>(N) : static_cast<int>(M)) - first;
    Element const* ptr = params_ptr->ptr == nullptr ? nullptr : params_ptr->ptr + first;
    return ProducerLoadCallbacks(ptr, extent, smem);
  }

  // ---- consumer warps: the fragment's values of each subtile, from the tile's slot -------------
  template <class STensor, class RTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    STensor tCsVec;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N, SLOT), zero strides along the broadcast
    RTensor tCrVec;  // (CPY, CPY_M, CPY_N), one register per distinct element
    Params const* params_ptr;

    CUTLASS_DEVICE ConsumerStoreCallbacks(STensor tCsVec, RTensor tCrVec, Params const* params_ptr)
        : tCsVec(tCsVec), tCrVec(tCrVec), params_ptr(params_ptr) {
      if (params_ptr->ptr == nullptr) cute::fill(tCrVec, ElementCompute(params_ptr->null_default));
    }

    // After the collective's consumer_wait on this subtile's stage (for the tile's first subtile:
    // the wait that covers the tile's copies), before its consumer_release.
    CUTLASS_DEVICE void previsit(int epi_m, int epi_n, int load_iteration, bool is_producer_load_needed) {
      if (params_ptr->ptr == nullptr) return;
      const int slot = static_cast<int>((static_cast<uint32_t>(load_iteration) / kSubtiles) % kSlots);
      // The distinct elements only (the broadcast mode filtered out), in vectors where they are
      // contiguous.
      cute::Tensor s = cute::filter_zeros(tCsVec(cute::_, cute::_, cute::_, epi_m, epi_n, slot));
      cute::Tensor r = cute::make_tensor_like<Element>(s);
      cute::copy_aligned(s, r);
      constexpr int kFrg = decltype(cute::size(r))::value;
      using Convert = cutlass::NumericArrayConverter<ElementCompute, Element, kFrg>;
      cute::recast<cutlass::Array<ElementCompute, kFrg>>(cute::filter(tCrVec))(cute::_0{}) =
          Convert{}(cute::recast<cutlass::Array<Element, kFrg>>(cute::coalesce(r))(cute::_0{}));
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementCompute, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int, int) {
      cutlass::Array<ElementCompute, FragmentSize> frg;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) frg[i] = tCrVec(epi_v * FragmentSize + i);
      return frg;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    check_tiles<decltype(args.epi_tile)>();
    cute::Tensor sVec = cute::make_tensor(cute::make_smem_ptr(smem), SmemLayout{});  // (CTA_M, CTA_N, SLOT)
    // (CPY, CPY_M, CPY_N, EPI_M, EPI_N, SLOT): partitioned as the accumulator fragments are
    cute::Tensor tCsVec = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        sVec, args.epi_tile, args.tiled_copy, args.thread_idx);
    cute::Tensor tCrVec = cute::make_tensor_like<ElementCompute>(
        tCsVec(cute::_, cute::_, cute::_, cute::_0{}, cute::_0{}, cute::_0{}));
    return ConsumerStoreCallbacks<decltype(tCsVec), decltype(tCrVec)>(tCsVec, tCrVec, params_ptr);
  }
};

template <class CtaTileShapeMNK, class EpilogueTile, class Element, class ElementCompute, class StrideMNL>
using Sm90RowBroadcastPipelined =
    Sm90VectorBroadcastPipelined<CtaTileShapeMNK, EpilogueTile, Element, ElementCompute, StrideMNL, true>;
template <class CtaTileShapeMNK, class EpilogueTile, class Element, class ElementCompute, class StrideMNL>
using Sm90ColBroadcastPipelined =
    Sm90VectorBroadcastPipelined<CtaTileShapeMNK, EpilogueTile, Element, ElementCompute, StrideMNL, false>;

}  // namespace cutlass_ext
}  // namespace qops
