// Probe: the fastest a kernel can *read* S bytes on this GPU, timed as the benchmarks time (a
// CUDA graph of calls rotating over input sets that spill L2, median per call), at the weight
// sizes of the decode GEMMs (docs/w8a8_gemm.md, "How far the floor is") and at two decode-attention
// K/V sizes (docs/kv_cache.md). No math: each thread XORs its 16-byte loads, so the time is
// launch + the memory system. Reported: the best of
// several launch shapes (grid-stride or one contiguous slice per warp, 1-16 loads in flight per
// thread, 1-16 CTAs per SM; and bulk copies into shared memory -- cp.async.bulk, the TMA engine
// without a tensor map -- of one slice per CTA or of chunks dealt grid-stride), with and without
// programmatic dependent launch, as a fraction of the 1 GiB device copy (read + write), the
// ceiling the GEMM benchmark divides by. -v prints every shape. -w4 reads the W4A16 GEMV's bytes
// instead of the int8 weights': int4 weights plus one 2-byte scale per group of 128 (N*K/2 +
// N*K/64 bytes; docs/w4a16_gemm.md), the floor its "of copy" figures are held against.
//
// Standalone (CUDA runtime only, sm_90):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I tools/probes \
//        tools/probes/probe_read_floor.cu -o /tmp/probe_read_floor && /tmp/probe_read_floor [-v]
// On the lent GPU (needs no qops build): bash tools/device_run.sh -t none --no-build \
//   -x "nvcc ... && /tmp/probe_read_floor"
#include <cstdint>
#include <string>

#include "probe_common.cuh"  // CK, probe_copy_gbps, probe_graph_us, smem_u32, bar_*, pdl_start

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// grid-stride over 16-byte vectors, U loads per iteration, all issued (from a safe address when
// past the end, as the GEMV does), so a thread's loads are never serialized by a tail loop
template <int U>
__global__ void read_gs(const uint4* __restrict__ p, long n, unsigned* out, int pdl) {
  if (pdl) pdl_start();
  unsigned acc = 0;
  const long stride = (long)gridDim.x * blockDim.x;
  for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long j = i + u * stride;
      v[u] = ld_stream(p + (j < n ? j : 0));
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * stride < n) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
// contiguous slice per warp (like the GEMV: each warp streams its own range), U loads in flight
template <int U>
__global__ void read_slice(const uint4* __restrict__ p, long n, unsigned* out, int pdl) {
  if (pdl) pdl_start();
  const long warps = (long)gridDim.x * blockDim.x / 32;
  const long w = ((long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const long v0 = n * w / warps, v1 = n * (w + 1) / warps;
  unsigned acc = 0;
  for (long i = v0 + lane; i - lane < v1; i += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long j = i + 32 * u;
      v[u] = ld_stream(p + (j < v1 ? j : 0));
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + 32 * u < v1) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// Bulk copies (the TMA engine's cp.async.bulk, no tensor map) of one contiguous slice per CTA into
// a ring of ST shared-memory stages of C bytes: one thread issues everything, so the bytes in
// flight are bounded by shared memory, not by registers. The data is not used (the probe times the
// memory system), except one word, so the stages are really waited for.
// GS: chunk c goes to CTA c % gridDim.x (the grid-stride order; otherwise one slice per CTA).
template <int ST, int C, bool GS = false>
__global__ void read_bulk(const uint4* __restrict__ p, long n, unsigned* out, int pdl) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bar[ST];
  if (threadIdx.x != 0) return;
  if (pdl) pdl_start();
  const long bytes = n * 16, g = gridDim.x;
  const long b0 = GS ? blockIdx.x * static_cast<long>(C) : (bytes * blockIdx.x / g) & ~15L;
  const long b1 = GS || blockIdx.x + 1 == g ? bytes : (bytes * (blockIdx.x + 1) / g) & ~15L;
  const long step = GS ? g * C : C;
  for (int i = 0; i < ST; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[i])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const char* src = reinterpret_cast<const char*>(p);
  int k = 0;
  for (long off = b0; off < b1; off += step, ++k) {
    const int st = k % ST;
    if (k >= ST) bar_wait(&bar[st], ((k / ST) - 1) & 1);
    const unsigned sz = static_cast<unsigned>(b1 - off < C ? b1 - off : C);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[st])),
                 "r"(sz)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_u32(ring + st * C)),
        "l"(src + off), "r"(sz), "r"(smem_u32(&bar[st]))
        : "memory");
  }
  for (int j = k > ST ? k - ST : 0; j < k; ++j) bar_wait(&bar[j % ST], (j / ST) & 1);
  const unsigned acc = k ? *reinterpret_cast<const unsigned*>(ring) : 0u;
  if (acc == 0x9e3779b9u) out[0] = acc;
}

typedef void (*Kern)(const uint4*, long, unsigned*, int);

static void launch(Kern k, int grid, int block, int smem, const uint4* p, long n, unsigned* out,
                   bool pdl, cudaStream_t s) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.stream = s;
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, p, n, out, (int)pdl));
}

int main(int argc, char** argv) {
  bool verbose = false, w4 = false;
  for (int a = 1; a < argc; ++a) {
    verbose = verbose || std::string(argv[a]) == "-v";
    w4 = w4 || std::string(argv[a]) == "-w4";
  }
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double copy_gbps = probe_copy_gbps(s);
  printf("copy 1 GiB: %.0f GB/s, SMs %d\n", copy_gbps, sms);
  unsigned* out;
  CK(cudaMalloc(&out, 4));

  struct Sz {
    const char* name;
    long bytes;
  };
  // bench/shapes.py's GEMM_LAYERS: weight bytes N x K
  std::vector<Sz> sizes = {{"70B-tp8.o", 8192L * 1024},
                           {"70B-tp8.qkv", 1280L * 8192},
                           {"7B/8B.o", 4096L * 4096},
                           {"8B.qkv", 6144L * 4096},
                           {"70B-tp8.down", 8192L * 3584},
                           {"7B.down", 4096L * 11008},
                           {"7B.qkv", 12288L * 4096},
                           {"8B.down", 4096L * 14336},
                           {"70B-tp8.gate_up", 7168L * 8192},
                           {"7B.gate_up", 22016L * 4096},
                           {"8B.gate_up", 28672L * 4096},
                           // the int8 K/V of two decode-attention rows at T = 16384
                           // (bench/bench_decode_attention.py; docs/kv_cache.md): SmolLM2 B = 1
                           // (3 kv heads, D = 64) and Llama-3-8B B = 1 (8 kv heads, D = 128)
                           {"KV smollm2 B1 T16384", 2L * 3 * 16384 * 64},
                           {"KV llama3-8b B1 T16384", 2L * 8 * 16384 * 128}};
  if (w4) {  // the same layers as int4 weights + bf16 group-128 scales; no KV rows
    sizes.resize(sizes.size() - 2);
    for (Sz& z : sizes) z.bytes = z.bytes / 2 + z.bytes / 64;
  }
  struct Cfg {
    const char* name;
    Kern k;
    int per_sm;
    int block;
    int smem = 0;
  };
  std::vector<Cfg> cfgs = {{"gs4 x1 512", read_gs<4>, 1, 512},
                           {"gs4 x2 512", read_gs<4>, 2, 512},
                           {"gs4 x4 256", read_gs<4>, 4, 256},
                           {"gs8 x2 512", read_gs<8>, 2, 512},
                           {"gs8 x4 256", read_gs<8>, 4, 256},
                           {"gs4 x8 128", read_gs<4>, 8, 128},
                           {"sl4 x4 256", read_slice<4>, 4, 256},
                           {"sl8 x4 256", read_slice<8>, 4, 256},
                           {"sl8 x8 128", read_slice<8>, 8, 128},
                           {"sl8 x2 512", read_slice<8>, 2, 512},
                           {"sl16 x4 128", read_slice<16>, 4, 128},
                           {"gs16 x2 256", read_gs<16>, 2, 256},
                           {"gs2 x8 256", read_gs<2>, 8, 256},
                           {"gs1 x16 128", read_gs<1>, 16, 128},
                           // bulk: stages x bytes, CTAs per SM (shared memory: up to 227 KB per SM)
                           {"bulk 4x16K x3", read_bulk<4, 16384>, 3, 32, 4 * 16384},
                           {"bulk 2x32K x3", read_bulk<2, 32768>, 3, 32, 2 * 32768},
                           {"bulk 8x8K x2", read_bulk<8, 8192>, 2, 32, 8 * 8192},
                           {"bulk 4x8K x6", read_bulk<4, 8192>, 6, 32, 4 * 8192},
                           {"bulk 8x4K x6", read_bulk<8, 4096>, 6, 32, 8 * 4096},
                           {"bulk 4x4K x12", read_bulk<4, 4096>, 12, 32, 4 * 4096},
                           {"bulk 8x16K x1", read_bulk<8, 16384>, 1, 32, 8 * 16384},
                           {"bulk-gs 4x16K x3", read_bulk<4, 16384, true>, 3, 32, 4 * 16384},
                           {"bulk-gs 4x8K x6", read_bulk<4, 8192, true>, 6, 32, 4 * 8192},
                           {"bulk-gs 8x4K x6", read_bulk<8, 4096, true>, 6, 32, 8 * 4096},
                           {"bulk-gs 8x2K x8", read_bulk<8, 2048, true>, 8, 32, 8 * 2048},
                           {"bulk-gs 16x1K x8", read_bulk<16, 1024, true>, 8, 32, 16 * 1024}};
  for (const Cfg& c : cfgs) {
    if (c.smem > 48 * 1024) {
      CK(cudaFuncSetAttribute(c.k, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
    }
  }
  for (const Sz& z : sizes) {
    const int nsets = std::max(2L, (long)((200L << 20) / z.bytes) + 1);
    std::vector<uint4*> bufs(nsets);
    for (auto& b : bufs) {
      CK(cudaMalloc(&b, z.bytes));
      CK(cudaMemset(b, 3, z.bytes));
    }
    const long n = z.bytes / 16;
    double best = 1e30;
    const char* bestn = "";
    int best_pdl = 0;
    for (int pdl = 0; pdl < 2; ++pdl) {
      for (const Cfg& c : cfgs) {
        // graph: calls rotating over the sets, ~1 ms per replay
        const int calls = std::max(nsets, (int)(1000.0 / (z.bytes / copy_gbps / 1e3 + 2.0)));
        const double us = probe_graph_us(s, calls, 25, [&](int i) {
          launch(c.k, c.per_sm * sms, c.block, c.smem, bufs[i % nsets], n, out, pdl, s);
        });
        const double frac = z.bytes / (us * 1e-6) / 1e9 / copy_gbps;
        if (verbose) {
          printf("  %-15s %6.2f MB  %-12s pdl=%d  %7.2f us  %.3f of copy\n", z.name, z.bytes / 1e6,
                 c.name, pdl, us, frac);
        }
        if (us < best) {
          best = us;
          bestn = c.name;
          best_pdl = pdl;
        }
      }
    }
    printf("%-15s %7.2f MB  floor %7.2f us  %.3f of copy  (%s%s)\n", z.name, z.bytes / 1e6, best,
           z.bytes / (best * 1e-6) / 1e9 / copy_gbps, bestn, best_pdl ? ", pdl" : "");
    for (auto b : bufs) CK(cudaFree(b));
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
