// int8 x int8 -> fp16/bf16 GEMM with a dequantizing epilogue, Hopper (sm_90a) only. Torch-free.
//
//   d[m, n] = out_dtype( (float(acc[m, n]) * a_scale[m or 0]) * b_scale[n or 0] + float(bias[n]) )
//   acc[m, n] = sum_k int32(a[m, k]) * int32(b[n, k])          (exact int32 accumulation)
//
// The kernels and this API's implementation are generated at build time by
// cutlass_kernels/gen_w8a8.py from the table in cutlass_kernels/w8a8_configs.py (CUTLASS Python
// interface, one kernel per tile config x output dtype x scale mode; docs/w8a8_gemm.md); the
// table's hand-written decode GEMV (gemm/w8a8_gemv.h) is dispatched through it too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qops {
namespace w8a8_sm90 {

enum class OutDtype : int { kFloat16 = 0, kBFloat16 = 1 };

// kPerTensor: a_scale and b_scale each hold one float (read on the device).
// kPerTokenPerChannel: a_scale holds m floats (one per row), b_scale n floats (one per column).
enum class ScaleMode : int { kPerTensor = 0, kPerTokenPerChannel = 1 };

struct Problem {
  const int8_t* a;  // [m, k], row r at a + r * lda; 16-byte aligned, lda % 16 == 0
  int64_t lda;
  const int8_t* b;  // [n, k] (K-major, the nn.Linear weight), row stride ldb; as a
  int64_t ldb;
  const float* a_scale;  // see ScaleMode; 16-byte aligned
  const float* b_scale;
  const void* bias;  // [n] in the output dtype, or nullptr (no bias)
  void* d;           // [m, n], row stride ldd; 16-byte aligned, ldd % 8 == 0
  int64_t ldd;
  int m, n, k;  // k % 16 == 0, n % 8 == 0
  OutDtype out_dtype;
  ScaleMode scale_mode;
  void* workspace;         // device scratch of at least workspace_size() bytes (stream-K configs)
  size_t workspace_bytes;  // its size; nullptr / 0 when workspace_size() is 0
};

// How a call launches (not what it computes): the w8a8_gemm op's keyword-only options. Only the
// hand-written decode GEMV reads them; the CUTLASS configs ignore them.
struct GemvTuning {
  // A launch shape of kGemvShapes (gemm/w8a8_gemv.h: rows of N per CTA, warps per CTA, K chunks
  // per load batch) for tests and sweeps; 0, 0, 0 = the GEMV's own choice.
  int rows_per_cta = 0;
  int warps = 0;
  int chunks = 0;
  // Under overlap_prologue: the weight batches requested before the PDL wait (clamped to what the
  // build holds); -1 = the GEMV's own choice.
  int early_batches = -1;
};

struct LaunchOptions {
  // Launch with programmatic dependent launch (sm_90; common/launch.cuh).
  bool pdl = true;
  // The previous kernel in the stream does not write `b`: with PDL the GEMV requests its first
  // weight batches before it waits for that kernel (w8a8_gemm's overlap_prologue), as many as
  // its build has and its grid affords (gemm/w8a8_gemv.cu early_batches).
  bool overlap_prologue = false;
  GemvTuning gemv;
};

// The configs, by name (w8a8_configs.config_names(): the generated tile configs, then the
// hand-written kernels of w8a8_configs.HAND_WRITTEN, in table order).
int num_configs();
const char* config_name(int config);

// The largest M that config `config` serves; 0 = any (the CUTLASS tile configs).
int config_max_m(int config);

// The config the table's SELECTION rules pick for a problem on a GPU with `num_sms` SMs
// (w8a8_configs.select_config).
int select_config(int m, int n, int k, int num_sms);

// The device scratch, in bytes, that `gemm` needs for this problem with tile config `config`
// (-1: select_config): the stream-K configs keep partial accumulators and their flags there; 0 for
// the others. Errors as for gemm.
cudaError_t workspace_size(const Problem& problem, int config, size_t* bytes);

// Runs the GEMM on `stream` with tile config `config` (-1: select_config). No allocation, no host
// synchronization (CUDA-graph safe); the workspace, if any, is the caller's and is re-initialized
// on the stream by every call. cudaErrorNoKernelImageForDevice on a device other than sm_90;
// cudaErrorInvalidValue when the config index is out of range, the workspace is too small or
// CUTLASS cannot implement the problem (alignment); launch errors otherwise.
cudaError_t gemm(const Problem& problem, int config, const LaunchOptions& options,
                 cudaStream_t stream);

// The launch signature every config's kernel has (the generated CUTLASS launchers and the
// hand-written kernels of w8a8_configs.HAND_WRITTEN): with `workspace_bytes` set it stores the
// workspace the problem needs and launches nothing.
using LaunchFn = cudaError_t (*)(const Problem& problem, const LaunchOptions& options, int sm_count,
                                 cudaStream_t stream, size_t* workspace_bytes);

}  // namespace w8a8_sm90
}  // namespace qops
