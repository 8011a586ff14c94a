// Probe: how fast the grid of a small-batch decode-attention call can *read* its KV chunks, with
// no math (docs/kv_cache.md, "The read floor of a small-batch grid"). Each case is a decode
// problem's grid (CTAs, one per SM when they fit) and bytes per CTA, read as chunks of C bytes at
// pseudo-random chunk-aligned places (a paged cache: one 16-token block of one head, 1 KB at
// head_dim 64, 2 KB at 128). Readers:
//   cp       8 warps, a per-warp ring of `st` stages filled with 16-byte cp.async.cg (the decode
//            kernel's pipeline);
//   ld       8 warps, u chunks per warp loaded into registers at once (ld.global.nc);
//   bulk     cp.async.bulk (the TMA engine, 1-D, no tensor map) into mbarrier rings, issued by one
//            thread or by lane 0 of 2-8 warps.
// Timing as the benchmarks time: a CUDA graph of 200 calls rotating over windows of a 1 GiB
// buffer (4x each call's bytes, so L2 holds no call's data), median per call over 15 replays.
//
// Standalone (CUDA runtime only, sm_90):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I tools/probes \
//        tools/probes/probe_kv_read_floor.cu -o /tmp/probe_kv_read_floor && /tmp/probe_kv_read_floor
#include <cstdint>

#include "probe_common.cuh"  // CK, probe_copy_gbps, probe_graph_us, smem_u32, bar_*, pdl_start

// the byte offset of chunk j (a CTA's chunks are first .. first + chunks_per_cta - 1): a
// pseudo-random chunk of the window that starts at chunk `base`
__device__ __forceinline__ long chunk_off(long j, long window_chunks, long base, int C) {
  const unsigned long long h = (unsigned long long)(j * 2654435761ULL + 12345) % window_chunks;
  return (base + (long)h) * C;
}

// per-warp ring of ST stages, each lane copies C/32 bytes per chunk (16 B each)
template <int C, int ST, int NW>
__global__ void __launch_bounds__(NW * 32)
    rd_cp(const char* buf, long window_chunks, long base, int chunks_per_cta, unsigned* out) {
  extern __shared__ __align__(128) unsigned char ring[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* my = ring + warp * ST * C;
  constexpr int kPer = C / 16 / 32;  // 16-byte copies per lane per chunk
  unsigned acc = 0;
  const long first = (long)blockIdx.x * chunks_per_cta;
  int issued = 0, done = 0;
  const int mine = (chunks_per_cta - warp + NW - 1) / NW;
  auto issue = [&](int i) {
    const long j = first + warp + (long)i * NW;
    const char* src = buf + chunk_off(j, window_chunks, base, C);
    unsigned char* dst = my + (i % ST) * C;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int o = (u * 32 + lane) * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst + o)),
                   "l"(src + o));
    }
  };
  for (; issued < ST - 1; ++issued) {
    if (issued < mine) issue(issued);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  for (; done < mine; ++done) {
    if (issued < mine) issue(issued);
    ++issued;
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 1));
    __syncwarp();
    acc ^= *reinterpret_cast<const unsigned*>(my + (done % ST) * C + lane * 4);
    __syncwarp();
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// plain loads: each warp loads U chunks' worth of 16-byte vectors into registers at once
template <int C, int U, int NW>
__global__ void __launch_bounds__(NW * 32)
    rd_ld(const char* buf, long window_chunks, long base, int chunks_per_cta, unsigned* out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kPer = C / 16 / 32;
  unsigned acc = 0;
  const long first = (long)blockIdx.x * chunks_per_cta;
  const int mine = (chunks_per_cta - warp + NW - 1) / NW;
  for (int i = 0; i < mine; i += U) {
    uint4 v[U][kPer];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ii = i + u < mine ? i + u : i;
      const char* src = buf + chunk_off(first + warp + (long)ii * NW, window_chunks, base, C);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[u][k].x), "=r"(v[u][k].y), "=r"(v[u][k].z), "=r"(v[u][k].w)
                     : "l"(src + (k * 32 + lane) * 16));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc ^= v[u][k].x ^ v[u][k].w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// bulk copies: lane 0 of each of NW warps issues its own chunks (round-robin) into its ring of ST
// stages and waits for them in order (NW = 1: one thread issues everything)
template <int C, int ST, int NW>
__global__ void rd_bulk(const char* buf, long window_chunks, long base, int chunks_per_cta,
                        unsigned* out) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bars[NW * ST];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  uint64_t* bar = bars + warp * ST;
  unsigned char* my = ring + warp * ST * C;
  for (int i = 0; i < ST; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[i])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const long first = (long)blockIdx.x * chunks_per_cta;
  const int mine = (chunks_per_cta - warp + NW - 1) / NW;
  unsigned acc = 0;
  for (int k = 0; k < mine + ST; ++k) {
    if (k >= ST) {
      const int j = k - ST;
      bar_wait(&bar[j % ST], (j / ST) & 1);
      acc ^= *reinterpret_cast<const unsigned*>(my + (j % ST) * C);
    }
    if (k < mine) {
      const int st = k % ST;
      asm volatile(
          "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bar[st])), "r"(C)
          : "memory");
      asm volatile(
          "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
              "r"(smem_u32(my + st * C)),
          "l"(buf + chunk_off(first + warp + (long)k * NW, window_chunks, base, C)), "r"(C),
          "r"(smem_u32(&bar[st]))
          : "memory");
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

typedef void (*Kern)(const char*, long, long, int, unsigned*);
struct Cfg {
  const char* name;
  Kern k;
  int threads;
  int smem;
  int C;
};
// A reader's launch shape follows from its template arguments: NW warps, ST stages of C bytes per
// warp in dynamic shared memory (the ld readers hold theirs in registers).
template <int C, int ST, int NW>
Cfg cp(const char* n) {
  return {n, rd_cp<C, ST, NW>, NW * 32, NW * ST * C, C};
}
template <int C, int U, int NW>
Cfg ld(const char* n) {
  return {n, rd_ld<C, U, NW>, NW * 32, 0, C};
}
template <int C, int ST, int NW>
Cfg bulk(const char* n) {
  return {n, rd_bulk<C, ST, NW>, NW * 32, NW * ST * C, C};
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("copy %.0f GB/s, %d SMs\n", probe_copy_gbps(s), sms);
  const size_t bytes = 1ull << 30;
  char* buf;
  CK(cudaMalloc(&buf, bytes));
  CK(cudaMemset(buf, 1, bytes));
  unsigned* out;
  CK(cudaMalloc(&out, 4));
  std::vector<Cfg> cfgs = {
      cp<2048, 4, 8>("cp 8w st4 C2K"),       cp<2048, 8, 8>("cp 8w st8 C2K"),
      cp<2048, 12, 8>("cp 8w st12 C2K"),     ld<2048, 2, 8>("ld 8w u2 C2K"),
      ld<2048, 4, 8>("ld 8w u4 C2K"),        bulk<2048, 16, 1>("bulk st16 C2K"),
      bulk<2048, 48, 1>("bulk st48 C2K"),    bulk<2048, 96, 1>("bulk st96 C2K"),
      bulk<2048, 8, 8>("bulk 8w st8 C2K"),   bulk<2048, 16, 4>("bulk 4w st16 C2K"),
      bulk<2048, 32, 2>("bulk 2w st32 C2K"), bulk<8192, 12, 1>("bulk st12 C8K"),
      bulk<8192, 4, 4>("bulk 4w st4 C8K"),   cp<8192, 3, 8>("cp 8w st3 C8K"),
      cp<1024, 6, 8>("cp 8w st6 C1K"),       cp<1024, 12, 8>("cp 8w st12 C1K"),
      ld<1024, 4, 8>("ld 8w u4 C1K"),        ld<1024, 8, 8>("ld 8w u8 C1K"),
      bulk<1024, 32, 1>("bulk st32 C1K"),    bulk<1024, 96, 1>("bulk st96 C1K"),
      bulk<1024, 192, 1>("bulk st192 C1K"),  bulk<1024, 12, 8>("bulk 8w st12 C1K"),
  };
  for (auto& c : cfgs)
    if (c.smem > 48 * 1024)
      CK(cudaFuncSetAttribute(c.k, cudaFuncAttributeMaxDynamicSharedMemorySize, c.smem));
  struct Case {
    const char* name;
    int ctas;
    long per_cta;
    int C;
  };
  std::vector<Case> cases = {
      {"SmolLM2 B1 T4096 (48 x 32K)", 48, 32 << 10, 1024},
      {"SmolLM2 B1 T16384 (48 x 128K)", 48, 128 << 10, 1024},
      {"SmolLM2 B8 T4096 (192 x 64K)", 192, 64 << 10, 1024},
      {"GQA B1 T4096 (72 x 114K)", 72, 114 << 10, 2048},
      {"GQA B1 T16384 (72 x 455K)", 72, 455 << 10, 2048},
      // the same bytes over more SMs: 16 and 12 splits (the cluster merge cannot take them on an
      // H100, so a decode call would pay a merge through memory)
      {"GQA B1 T16384, 16 splits (128 x 256K)", 128, 256 << 10, 2048},
      {"GQA B1 T16384, 12 splits (96 x 341K)", 96, 341 << 10, 2048},
      {"SmolLM2 B8 T16384 (96 x 512K)", 96, 512 << 10, 1024},
      {"MHA B1 T4096 (96 x 342K)", 96, 342 << 10, 2048},
      {"GQA B8 T4096 (128 x 512K)", 128, 512 << 10, 2048},
      {"GQA B1 T4096, 8K chunks (72 x 112K)", 72, 112 << 10, 8192},
  };
  for (const Case& cs : cases) {
    const int chunks = (int)(cs.per_cta / cs.C);
    const long total = (long)chunks * cs.C * cs.ctas;
    printf("%s: %.2f MB\n", cs.name, total / 1e6);
    for (const Cfg& c : cfgs) {
      if (c.C != cs.C) continue;
      const long window_chunks = (total * 4) / c.C;  // sets spill L2: windows of 4x the bytes
      const long nwin = (long)(bytes / c.C) / window_chunks;
      const double us = probe_graph_us(s, 200, 15, [&](int i) {
        const long base = (i % nwin) * window_chunks;
        c.k<<<cs.ctas, c.threads, c.smem, s>>>(buf, window_chunks, base, chunks, out);
        CK(cudaGetLastError());
      });
      printf("  %-16s %7.2f us  %6.0f GB/s  %5.1f GB/s per CTA\n", c.name, us, total / us / 1e3,
             total / us / 1e3 / cs.ctas);
    }
  }
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}
