// Probe: the decode GEMV (csrc/gemm/w8a8_gemv.cu) timed directly, without torch, as the benchmarks
// time (a CUDA graph of calls rotating over weight sets that spill L2, median per call), to take
// its time apart (docs/w8a8_gemm.md, "M = 16 against M = 1"). Per Llama layer, in us and as a
// fraction of the 1 GiB device copy (read + write):
//   M1, M8, M16     its own shape choice at M = 1, 8, 16;
//   M1_ovl, ...     the same under overlap_prologue (the previous call does not write the
//                   weights: it is the GEMV of another weight set), with its own choice of
//                   weight batches requested before the PDL wait;
//   M1_ovl_e1, ...  the same with that forced to 1 batch at M <= 8 and 0 at M = 16 (the choice
//                   before early_batches counted waves; at M = 16 also the choice before the
//                   16-row build's early batch, which a forced count turns off), to A/B in one run;
//   M16_alias       M = 16 with all 16 activation rows at one address (lda = 0): the same
//                   instructions, but the activation loads hit one 64-byte line per chunk, so
//                   the difference to M16 is what the activations' traffic costs;
//   M16_rRwWcC      M = 16 with each built shape forced (kGemvShapes: rows of N per CTA, warps,
//                   chunks per load batch). Each is checked bit-identical to M16 first.
//
// Standalone (CUDA runtime only, sm_90; compiles the GEMV in, with the generator's plain-data
// header w8a8_gemv_shapes.h), from the repository root:
//   python -m cutlass_kernels.gen_w8a8 --out /tmp/qops_gen --headers-only
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I csrc -I /tmp/qops_gen \
//        -I tools/probes tools/probes/probe_gemv.cu -o /tmp/probe_gemv && /tmp/probe_gemv
// On the lent GPU it needs no qops build: run those lines in the device call.
#include "gemm/w8a8_gemv.cu"

#include <cstring>
#include <string>
#include <vector>

#include "probe_common.cuh"  // CK, probe_copy_gbps, probe_graph_us

using namespace qops::w8a8_sm90;

// Deterministic int8 in [-30, 30] (a hash of the index), and positive float32 scales.
__global__ void fill_i8(int8_t* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = static_cast<unsigned>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = static_cast<int8_t>(static_cast<int>(x % 61) - 30);
  }
}
__global__ void fill_f32(float* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = 1e-3f * (1 + i % 7);
}

int main() {
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const double copy_gbps = probe_copy_gbps(st);
  printf("%s, %d SMs, copy %.0f GB/s\n", prop.name, sms, copy_gbps);

  struct Layer {
    const char* name;
    int n, k;
  };
  const Layer layers[] = {{"7B/8B.o", 4096, 4096},      {"8B.qkv", 6144, 4096},
                          {"70B-tp8.down", 8192, 3584}, {"7B.down", 4096, 11008},
                          {"8B.down", 4096, 14336},     {"70B-tp8.gate_up", 7168, 8192}};
  struct Variant {
    std::string name;
    int m;
    bool alias;
    GemvShape shape;  // {0, 0, 0}: the GEMV's own choice
    bool overlap = false;
    int early = -1;  // LaunchOptions::gemv.early_batches (-1: the GEMV's own choice)
  };
  std::vector<Variant> variants;
  for (const int m : {1, 8, 16}) {
    const std::string name = "M" + std::to_string(m);
    variants.push_back({name, m, false, {0, 0, 0}});
    variants.push_back(
        {name + "_ovl_e" + (m > 8 ? "0" : "1"), m, false, {0, 0, 0}, true, m > 8 ? 0 : 1});
    variants.push_back({name + "_ovl", m, false, {0, 0, 0}, true, -1});
  }
  variants.push_back({"M16_alias", 16, true, {0, 0, 0}});
  for (const GemvShape s : kGemvShapes) {
    variants.push_back({"M16_r" + std::to_string(s.rows_per_cta) + "w" + std::to_string(s.warps) +
                            "c" + std::to_string(s.chunks),
                        16, false, s});
  }
  printf("%-16s", "layer");
  for (const auto& v : variants) printf(" %14s", v.name.c_str());
  printf("\n");

  for (const Layer& L : layers) {
    const size_t wbytes = static_cast<size_t>(L.n) * L.k;
    const int sets = std::max(2, static_cast<int>((200ull << 20) / wbytes) + 1);  // > 4x L2
    std::vector<int8_t*> w(sets), a(sets);
    std::vector<float*> sa(sets), sb(sets);
    std::vector<void*> d(sets);
    for (int i = 0; i < sets; ++i) {
      CK(cudaMalloc(&w[i], wbytes));
      CK(cudaMalloc(&a[i], 16 * static_cast<size_t>(L.k)));
      CK(cudaMalloc(&sa[i], 16 * sizeof(float)));
      CK(cudaMalloc(&sb[i], L.n * sizeof(float)));
      CK(cudaMalloc(&d[i], 16 * static_cast<size_t>(L.n) * 2));
      fill_i8<<<1024, 256, 0, st>>>(w[i], wbytes, 17 + i);
      fill_i8<<<64, 256, 0, st>>>(a[i], 16 * static_cast<size_t>(L.k), 99 + i);
      fill_f32<<<1, 256, 0, st>>>(sa[i], 16);
      fill_f32<<<64, 256, 0, st>>>(sb[i], L.n);
      CK(cudaGetLastError());
    }
    CK(cudaStreamSynchronize(st));
    const size_t out_bytes = 16 * static_cast<size_t>(L.n) * 2;
    std::vector<char> ref(out_bytes), got(out_bytes), ref_m(out_bytes);
    printf("%-16s", L.name);
    for (const auto& v : variants) {
      const auto problem = [&](int i) {
        Problem p{};
        p.a = a[i];
        p.lda = v.alias ? 0 : L.k;
        p.b = w[i];
        p.ldb = L.k;
        p.a_scale = sa[i];
        p.b_scale = sb[i];
        p.d = d[i];
        p.ldd = L.n;
        p.m = v.m;
        p.n = L.n;
        p.k = L.k;
        p.out_dtype = OutDtype::kBFloat16;
        p.scale_mode = ScaleMode::kPerTokenPerChannel;
        return p;
      };
      LaunchOptions options;  // with programmatic dependent launch (pdl = true), as the op launches
      options.overlap_prologue = v.overlap;
      options.gemv.rows_per_cta = v.shape.rows_per_cta;
      options.gemv.warps = v.shape.warps;
      options.gemv.chunks = v.shape.chunks;
      options.gemv.early_batches = v.early;
      // Poisoned output, one call on set 0; M16 is the reference of the forced shapes.
      CK(cudaMemsetAsync(d[0], 0xff, out_bytes, st));
      CK(gemv(problem(0), options, sms, st, nullptr));
      CK(cudaMemcpyAsync(got.data(), d[0], out_bytes, cudaMemcpyDeviceToHost, st));
      CK(cudaStreamSynchronize(st));
      if (v.name == "M16") ref = got;
      if (!v.overlap && v.shape.rows_per_cta == 0 && !v.alias) ref_m = got;  // M1, M8, M16
      const size_t cmp = static_cast<size_t>(v.m) * L.n * 2;                 // bf16 rows written
      const bool same =
          v.overlap ? memcmp(ref_m.data(), got.data(), cmp) == 0
                    : !(v.m == 16 && !v.alias) || memcmp(ref.data(), got.data(), out_bytes) == 0;
      if (!same) {
        printf("\n%s at %s: output differs from M%d\n", v.name.c_str(), L.name, v.m);
        return 1;
      }
      const int calls = std::max(sets, 200 / sets * sets);
      const double us = probe_graph_us(
          st, calls, 22, [&](int c) { CK(gemv(problem(c % sets), options, sms, st, nullptr)); });
      printf(" %7.2f (%.2f)", us, wbytes / (us * 1e-6) / 1e9 / copy_gbps);
      fflush(stdout);
    }
    printf("\n");
    for (int i = 0; i < sets; ++i) {
      CK(cudaFree(w[i]));
      CK(cudaFree(a[i]));
      CK(cudaFree(sa[i]));
      CK(cudaFree(sb[i]));
      CK(cudaFree(d[i]));
    }
  }
  CK(cudaGetLastError());
  return 0;
}
