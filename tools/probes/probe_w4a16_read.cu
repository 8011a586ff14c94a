// Probe: how fast the W4A16 decode GEMV's *access pattern* can read its weights, no math. The
// shuffled int4 layout (docs/int4.md) is contiguous along N only within one 16-wide K slice: a
// (row tile of RB x 16 rows, K slice) piece is RB x 128 contiguous bytes, and the next slice of the
// same tile is N / 16 x 128 bytes further. Three ways to stream (tile, slices) units, each timed as
// the benchmarks time (a CUDA graph of calls rotating over weight copies that spill L2, median):
//  - ldg:   the register GEMV's own loads (csrc/gemm/w4a16_gemv.cu): 8 warps per CTA on a tile of 4
//           row blocks, one 32-bit load per lane per (slice, row block), D groups of 8 slices
//           loaded before they are used, K split over CTAs by the GEMV's one-wave rule;
//  - bulk:  one producer thread, a ring of ST shared-memory stages, one cp.async.bulk per
//           (slice, RB row blocks) piece (the TMA engine without a tensor map), units dealt in
//           even contiguous ranges over P = CTAs per SM x SMs CTAs;
//  - tmap:  the same ring, one cp.async.bulk.tensor.2d box of SPU slices x RB x 128 bytes per unit
//           (a tensor map over [K/16][N/16 x 128 B]).
// What it answers: the bytes per copy (and copies in flight) the TMA engine needs on this layout,
// and whether the GEMV's loads alone (no math) already stop short of the read floor
// (tools/probes/probe_read_floor.cu -w4).
//
// Standalone (CUDA runtime only; the driver's cuTensorMapEncodeTiled through
// cudaGetDriverEntryPointByVersion, so no -lcuda):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I tools/probes \
//        tools/probes/probe_w4a16_read.cu -o /tmp/probe_w4a16_read && /tmp/probe_w4a16_read [-v]
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "probe_common.cuh"  // CK, probe_copy_gbps, probe_graph_us, smem_u32, bar_*, pdl_start

struct Shape {
  int slices;     // K / 16
  int rowblocks;  // N / 16
  int group_kb;   // slices per group (8: group 128)
};

// ---- ldg: the register GEMV's pattern ------------------------------------------------------------
template <int D>
__global__ void __launch_bounds__(256, 2)
    read_ldg(const uint32_t* __restrict__ w, Shape s, int splits, unsigned* out, int pdl) {
  if (pdl) pdl_start();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nb0 = blockIdx.x * 4, split = blockIdx.y;
  const int groups = s.slices / s.group_kb;
  const int g0 = groups * split / splits, g1 = groups * (split + 1) / splits;
  unsigned acc = 0;
  for (int gi = g0 + warp * D; gi < g1; gi += 8 * D) {
    uint32_t v[D][8][4];
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int g = min(gi + d, g1 - 1), nb = min(nb0 + r, s.rowblocks - 1);
          const int64_t slice = static_cast<int64_t>(g) * s.group_kb + (j % s.group_kb);
          v[d][j][r] = __ldg(w + (slice * s.rowblocks + nb) * 32 + lane);
        }
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc ^= v[d][j][r];
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// ---- bulk / tmap: a producer thread and a ring of stages ----------------------------------------
// Units: (tile of RB row blocks, SPU slices), tile-major, CTA c takes [c U / P, (c + 1) U / P).
template <int ST, int RB, int SPU, bool kTmap>
__global__ void read_ring(const unsigned char* __restrict__ w,
                          const __grid_constant__ CUtensorMap tm, Shape s, unsigned* out, int pdl) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bar[ST];
  if (threadIdx.x != 0) return;
  if (pdl) pdl_start();
  constexpr int kUnitBytes = RB * 128 * SPU;
  const int tiles = s.rowblocks / RB, per_tile = s.slices / SPU;
  const int64_t units = static_cast<int64_t>(tiles) * per_tile;
  const int64_t u0 = units * blockIdx.x / gridDim.x, u1 = units * (blockIdx.x + 1) / gridDim.x;
  for (int i = 0; i < ST; ++i) bar_init(&bar[i]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  int k = 0;
  for (int64_t u = u0; u < u1; ++u, ++k) {
    const int st = k % ST;
    if (k >= ST) bar_wait(&bar[st], ((k / ST) - 1) & 1);
    const int tile = static_cast<int>(u / per_tile), sl0 = static_cast<int>(u % per_tile) * SPU;
    bar_expect(&bar[st], kUnitBytes);
    unsigned char* dst = ring + st * kUnitBytes;
    if constexpr (kTmap) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_u32(dst)),
          "l"(reinterpret_cast<uint64_t>(&tm)), "r"(tile * RB * 32), "r"(sl0),
          "r"(smem_u32(&bar[st]))
          : "memory");
    } else {
      for (int j = 0; j < SPU; ++j) {
        const unsigned char* src =
            w + ((static_cast<int64_t>(sl0) + j) * s.rowblocks + tile * RB) * 128;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_u32(dst + j * RB * 128)),
            "l"(src), "r"(RB * 128), "r"(smem_u32(&bar[st]))
            : "memory");
      }
    }
  }
  for (int j = k > ST ? k - ST : 0; j < k; ++j) bar_wait(&bar[j % ST], (j / ST) & 1);
  const unsigned acc = k ? *reinterpret_cast<const unsigned*>(ring) : 0u;
  if (acc == 0x9e3779b9u) out[0] = acc;
}

typedef void (*RingKernel)(const unsigned char*, const __grid_constant__ CUtensorMap, Shape,
                           unsigned*, int);
struct RingCfg {
  const char* name;
  RingKernel k;
  int st, rb, spu, per_sm;
  bool tmap;
};

static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    printf("cuTensorMapEncodeTiled not available\n");
    exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

static CUtensorMap make_map(void* base, const Shape& s, int rb, int spu) {
  static PFN_cuTensorMapEncodeTiled_v12000 enc = encode_tiled();
  CUtensorMap m;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(s.rowblocks) * 32,
                              static_cast<cuuint64_t>(s.slices)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(s.rowblocks) * 128};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(rb * 32), static_cast<cuuint32_t>(spu)};
  const cuuint32_t es[2] = {1, 1};
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, base, dims, strides, box, es,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    printf("cuTensorMapEncodeTiled failed (%d) for box %d x %d\n", static_cast<int>(r), rb, spu);
    exit(1);
  }
  return m;
}

int main(int argc, char** argv) {
  bool verbose = false;
  for (int a = 1; a < argc; ++a) verbose = verbose || std::string(argv[a]) == "-v";
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const double copy_gbps = probe_copy_gbps(st);
  printf("copy 1 GiB: %.0f GB/s, SMs %d\n", copy_gbps, sms);
  unsigned* out;
  CK(cudaMalloc(&out, 4));

  struct Layer {
    const char* name;
    int n, k;
  };
  const Layer layers[] = {{"70B-tp8.o", 8192, 1024},
                          {"7B.o", 4096, 4096},
                          {"7B.down", 4096, 11008},
                          {"7B.qkv", 12288, 4096},
                          {"8B.gate_up", 28672, 4096}};
  // ring configs: stages x (RB row blocks x SPU slices), CTAs per SM (shared memory <= ~220 KB/SM)
  const RingCfg rings[] = {
      {"bulk 512B x8/unit st24 x2", read_ring<24, 4, 8, false>, 24, 4, 8, 2, false},
      {"bulk 1K x8/unit st12 x2", read_ring<12, 8, 8, false>, 12, 8, 8, 2, false},
      {"bulk 2K x8/unit st6 x2", read_ring<6, 16, 8, false>, 6, 16, 8, 2, false},
      {"bulk 4K x8/unit st3 x2", read_ring<3, 32, 8, false>, 3, 32, 8, 2, false},
      {"tmap 4KB (4rb x 8sl) st24 x2", read_ring<24, 4, 8, true>, 24, 4, 8, 2, true},
      {"tmap 8KB (4rb x 16sl) st12 x2", read_ring<12, 4, 16, true>, 12, 4, 16, 2, true},
      {"tmap 8KB (8rb x 8sl) st12 x2", read_ring<12, 8, 8, true>, 12, 8, 8, 2, true},
      {"tmap 16KB (8rb x 16sl) st6 x2", read_ring<6, 8, 16, true>, 6, 8, 16, 2, true},
      {"tmap 4KB (4rb x 8sl) st12 x4", read_ring<12, 4, 8, true>, 12, 4, 8, 4, true},
      {"tmap 8KB (4rb x 16sl) st6 x4", read_ring<6, 4, 16, true>, 6, 4, 16, 4, true},
  };
  for (const RingCfg& c : rings) {
    CK(cudaFuncSetAttribute(c.k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            c.st * c.rb * 128 * c.spu));
  }
  for (const Layer& L : layers) {
    const Shape s{L.k / 16, L.n / 16, 8};
    const size_t bytes = static_cast<size_t>(L.n) * L.k / 2;
    const int nsets = static_cast<int>(std::max<size_t>(2, (200ull << 20) / bytes + 1));
    std::vector<unsigned char*> bufs(nsets);
    for (auto& b : bufs) {
      CK(cudaMalloc(&b, bytes));
      CK(cudaMemset(b, 3, bytes));
    }
    const int calls = std::max(nsets, static_cast<int>(1000.0 / (bytes / copy_gbps / 1e3 + 2.0)));
    auto report = [&](const char* name, double us) {
      printf("  %-16s %6.2f MB  %-32s %7.2f us  %.3f of copy\n", L.name, bytes / 1e6, name, us,
             bytes / (us * 1e-6) / 1e9 / copy_gbps);
    };
    printf("%s (N %d, K %d):\n", L.name, L.n, L.k);
    // ldg, as the GEMV splits K: as many splits as fit in one wave (two CTAs per SM)
    const int tiles = (s.rowblocks + 3) / 4, groups = s.slices / 8;
    const int splits = std::max(1, std::min(2 * sms / tiles, std::max(1, groups / 8)));
    for (int pdl = 0; pdl < 2; ++pdl) {
      const double u1 = probe_graph_us(st, calls, 25, [&](int i) {
        read_ldg<1><<<dim3(tiles, splits), 256, 0, st>>>(
            reinterpret_cast<const uint32_t*>(bufs[i % nsets]), s, splits, out, pdl);
      });
      const double u2 = probe_graph_us(st, calls, 25, [&](int i) {
        read_ldg<2><<<dim3(tiles, splits), 256, 0, st>>>(
            reinterpret_cast<const uint32_t*>(bufs[i % nsets]), s, splits, out, pdl);
      });
      if (pdl == 0 || verbose) {
        report(pdl ? "ldg D=1 (pdl arg)" : "ldg D=1 (the GEMV's loads)", u1);
        report(pdl ? "ldg D=2 (pdl arg)" : "ldg D=2 (two groups ahead)", u2);
      }
    }
    for (const RingCfg& c : rings) {
      if (s.rowblocks % c.rb != 0 || s.slices % c.spu != 0) continue;
      std::vector<CUtensorMap> maps(nsets);
      for (int i = 0; i < nsets; ++i) maps[i] = make_map(bufs[i], s, c.tmap ? c.rb : 4, c.spu);
      const int smem = c.st * c.rb * 128 * c.spu;
      const double us = probe_graph_us(st, calls, 25, [&](int i) {
        c.k<<<c.per_sm * sms, 32, smem, st>>>(bufs[i % nsets], maps[i % nsets], s, out, 0);
      });
      report(c.name, us);
    }
    for (auto b : bufs) CK(cudaFree(b));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
