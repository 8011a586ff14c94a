// Probe: CUTLASS 4.2's stream-K tile scheduler in each of its decompositions (data-parallel,
// split-K with 2-4 splits, stream-K, its own heuristic; deterministic and nondeterministic
// reduction) against the table's data-parallel ping-pong config, at 70B-tp8 qkv (N = 1280,
// K = 8192) and M = 512-2048 (docs/w8a8_gemm.md, "CUTLASS's split-K at 70B-tp8 qkv"). Every
// variant is first checked bit-identical to the baseline, then timed as the benchmarks time:
// a CUDA graph of 20 calls per variant, the variants' graphs replayed in turn, 30 rounds, median
// per call.
//
// The kernels are emitted by tools/emit_probe_kernels.py (the library's generator code, no GPU),
// from the repository root:
//   python -m tools.emit_probe_kernels --out /tmp/probe_kernels
//   CUTLASS=$(python3 -c "import cutlass_library; print(cutlass_library.source_path)")
//   nvcc -std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I $CUTLASS/include -I $CUTLASS/tools/util/include -I /tmp/probe_kernels -I tools/probes \
//        tools/probes/probe_streamk.cu -o /tmp/probe_streamk && /tmp/probe_streamk [N K M1,M2,...]
// (-DNDEBUG as in the library's Release build: without it CUTLASS's device asserts make ptxas
// serialize the wgmma pipeline.) It needs no qops build; the binary runs on the lent GPU alone.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"
#include "k_dp128.h"
#include "k_sk128c2.h"
#include "k_sk256c1.h"
#include "k_sk256c2.h"
#include "probe_common.cuh"  // CK

namespace {

struct Problem {
  const int8_t* a;
  const int8_t* b;
  const float* a_scale;
  const float* b_scale;
  const void* bias;
  void* d;
  int m, n, k;
};

using SkParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams;
using Decomposition = SkParams::DecompositionMode;
using Reduction = SkParams::ReductionMode;

struct Variant {
  const char* name;
  int kernel;  // 0 dp128, 1 sk256c2, 2 sk256c1, 3 sk128c2
  int splits;
  Decomposition decomposition;
  Reduction reduction;
};

// One launch of kernel type Op; StreamK: set the stream-K scheduler's arguments. The workspace
// grows as needed (allocated outside any capture: the first call of each variant is uncaptured).
template <class Op, bool StreamK, class EvtArgs>
bool launch(const Problem& p, const Variant& v, EvtArgs evt_args, void** ws, size_t* ws_bytes,
            cudaStream_t s, int sms) {
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Op>;
  using Kernel = typename Device::GemmKernel;
  auto sa =
      cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(p.m, p.k, 1));
  auto sb =
      cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(p.n, p.k, 1));
  auto sd =
      cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(p.m, p.n, 1));
  cutlass::KernelHardwareInfo hw;
  hw.sm_count = sms;
  typename Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {p.m, p.n, p.k, 1},
      {p.a, sa, p.b, sb},
      {evt_args(p), nullptr, sd, static_cast<cutlass::bfloat16_t*>(p.d), sd},
      hw};
  if constexpr (StreamK) {
    args.scheduler.splits = v.splits;
    args.scheduler.decomposition_mode = v.decomposition;
    args.scheduler.reduction_mode = v.reduction;
  }
  Device gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  const size_t need = Device::get_workspace_size(args);
  if (need > *ws_bytes) {
    if (*ws != nullptr) CK(cudaFree(*ws));
    CK(cudaMalloc(ws, need));
    *ws_bytes = need;
  }
  return gemm.run(args, *ws, s) == cutlass::Status::kSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  int N = 1280, K = 8192;
  std::vector<int> Ms = {512, 700, 1024, 1100, 1536, 2048};
  if (argc > 3) {
    N = atoi(argv[1]);
    K = atoi(argv[2]);
    Ms.clear();
    for (char* t = strtok(argv[3], ","); t; t = strtok(nullptr, ",")) Ms.push_back(atoi(t));
  }
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int m_max = 0;
  for (int m : Ms) m_max = m > m_max ? m : m_max;
  int8_t *a, *b;
  float *a_scale, *b_scale;
  void *d, *d_ref;
  CK(cudaMalloc(&a, size_t(m_max) * K));
  CK(cudaMalloc(&b, size_t(N) * K));
  CK(cudaMalloc(&a_scale, m_max * sizeof(float)));
  CK(cudaMalloc(&b_scale, N * sizeof(float)));
  CK(cudaMalloc(&d, size_t(m_max) * N * 2));
  CK(cudaMalloc(&d_ref, size_t(m_max) * N * 2));
  {
    srand(1);
    std::vector<int8_t> h(size_t(m_max) * K > size_t(N) * K ? size_t(m_max) * K : size_t(N) * K);
    for (auto& x : h) x = static_cast<int8_t>(rand() % 255 - 127);
    CK(cudaMemcpy(a, h.data(), size_t(m_max) * K, cudaMemcpyHostToDevice));
    for (auto& x : h) x = static_cast<int8_t>(rand() % 255 - 127);
    CK(cudaMemcpy(b, h.data(), size_t(N) * K, cudaMemcpyHostToDevice));
    std::vector<float> f(m_max > N ? m_max : N);
    for (auto& x : f) x = 1e-4f * (1 + rand() % 100);
    CK(cudaMemcpy(a_scale, f.data(), m_max * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b_scale, f.data(), N * sizeof(float), cudaMemcpyHostToDevice));
  }
  const Reduction kDet = Reduction::Deterministic, kNondet = Reduction::Nondeterministic;
  const std::vector<Variant> variants = {
      {"dp128_pingpong_c2", 0, 1, Decomposition::Heuristic, kDet},
      {"sk256c2_heuristic", 1, 1, Decomposition::Heuristic, kDet},
      {"sk256c2_dataparallel", 1, 1, Decomposition::DataParallel, kDet},
      {"sk256c2_split2", 1, 2, Decomposition::SplitK, kDet},
      {"sk256c2_split3", 1, 3, Decomposition::SplitK, kDet},
      {"sk256c2_split3_nondet", 1, 3, Decomposition::SplitK, kNondet},
      {"sk256c2_split4", 1, 4, Decomposition::SplitK, kDet},
      {"sk256c2_streamk", 1, 1, Decomposition::StreamK, kDet},
      {"sk256c1_heuristic", 2, 1, Decomposition::Heuristic, kDet},
      {"sk256c1_split3", 2, 3, Decomposition::SplitK, kDet},
      {"sk256c1_split3_nondet", 2, 3, Decomposition::SplitK, kNondet},
      {"sk128c2_heuristic", 3, 1, Decomposition::Heuristic, kDet},
      {"sk128c2_split2", 3, 2, Decomposition::SplitK, kDet},
      {"sk128c2_split2_nondet", 3, 2, Decomposition::SplitK, kNondet},
  };
  const int nv = static_cast<int>(variants.size());
  std::vector<void*> ws(nv, nullptr);
  std::vector<size_t> ws_bytes(nv, 0);
  bool all_identical = true;
  for (const int M : Ms) {
    const Problem p{a, b, a_scale, b_scale, nullptr, d, M, N, K};
    auto run = [&](int i, void* out) -> bool {
      Problem q = p;
      q.d = out;
      const Variant& v = variants[i];
      switch (v.kernel) {
        case 0:
          return launch<k_dp128::Op, false>(q, v, k_dp128::evt_args<Problem>, &ws[i], &ws_bytes[i],
                                            s, sms);
        case 1:
          return launch<k_sk256c2::Op, true>(q, v, k_sk256c2::evt_args<Problem>, &ws[i],
                                             &ws_bytes[i], s, sms);
        case 2:
          return launch<k_sk256c1::Op, true>(q, v, k_sk256c1::evt_args<Problem>, &ws[i],
                                             &ws_bytes[i], s, sms);
        default:
          return launch<k_sk128c2::Op, true>(q, v, k_sk128c2::evt_args<Problem>, &ws[i],
                                             &ws_bytes[i], s, sms);
      }
    };
    // Bit-identical to the baseline (exact int32 sums, then the same epilogue), on poisoned output.
    std::vector<uint16_t> ref(size_t(M) * N), got(size_t(M) * N);
    std::vector<bool> ok(nv, true);
    for (int i = 0; i < nv; ++i) {
      void* out = i == 0 ? d_ref : d;
      CK(cudaMemsetAsync(out, 0xFF, ref.size() * 2, s));
      if (!run(i, out)) {
        printf("M=%d %s: CUTLASS cannot run it\n", M, variants[i].name);
        ok[i] = false;
        continue;
      }
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      std::vector<uint16_t>& host = i == 0 ? ref : got;
      CK(cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost));
      size_t bad = 0;
      for (size_t j = 0; i > 0 && j < got.size(); ++j) bad += got[j] != ref[j];
      if (bad != 0) {
        printf("M=%d %s: %zu outputs differ from the baseline\n", M, variants[i].name, bad);
        ok[i] = false;
        all_identical = false;
      }
    }
    const int calls = 20, rounds = 30;
    std::vector<cudaGraphExec_t> graphs(nv, nullptr);
    for (int i = 0; i < nv; ++i) {
      if (!ok[i]) continue;
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      bool captured = true;
      for (int c = 0; c < calls; ++c) captured = run(i, d) && captured;
      CK(cudaStreamEndCapture(s, &g));
      if (!captured) {
        printf("M=%d %s: a captured launch failed\n", M, variants[i].name);
        exit(1);
      }
      CK(cudaGraphInstantiate(&graphs[i], g, 0));
      CK(cudaGraphDestroy(g));
      CK(cudaGraphLaunch(graphs[i], s));  // warm-up
    }
    CK(cudaStreamSynchronize(s));
    std::vector<std::vector<float>> us(nv);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = 0; r < rounds; ++r) {
      for (int i = 0; i < nv; ++i) {
        if (graphs[i] == nullptr) continue;
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(graphs[i], s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        us[i].push_back(ms * 1000.0f / calls);
      }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    float base = 0;
    for (int i = 0; i < nv; ++i) {
      if (graphs[i] == nullptr) continue;
      std::sort(us[i].begin(), us[i].end());
      const float median = us[i][us[i].size() / 2];
      if (i == 0) base = median;
      printf("M=%5d N=%d K=%d %-22s %8.2f us  %.3f of dp128  workspace %zu KB\n", M, N, K,
             variants[i].name, median, median / base, ws_bytes[i] / 1024);
      CK(cudaGraphExecDestroy(graphs[i]));
    }
  }
  printf(all_identical ? "all variants bit-identical to the baseline\n" : "MISMATCHES (above)\n");
  return all_identical ? 0 : 1;
}
