// Shared helpers of the torch-op glue layer (ops/*.cpp). No kernel math here.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

// Argument checks that name the op and the argument. All raise c10::Error subclasses, which
// Python sees as RuntimeError / ValueError / TypeError.
//
// The message is formatted by qops_glue::format_message, never by streaming numbers into a
// std::ostream inside _C.so: on the GPU machine's toolchain (GCC 13.3 under /opt/gcc) the
// extension ended up with its own copy of libstdc++'s stream code whose locale facets were never
// initialized, and `ss << int64_t` crashed with SIGSEGV instead of raising. Strings stream
// safely (no num_put facet), so the finished message is handed to TORCH_CHECK as one string.
#define QOPS_CHECK(cond, op, ...) \
  TORCH_CHECK(cond, ::qops_glue::format_message("qops.", op, ": ", __VA_ARGS__))
#define QOPS_CHECK_VALUE(cond, op, ...) \
  TORCH_CHECK_VALUE(cond, ::qops_glue::format_message("qops.", op, ": ", __VA_ARGS__))
#define QOPS_CHECK_TYPE(cond, op, ...) \
  TORCH_CHECK_TYPE(cond, ::qops_glue::format_message("qops.", op, ": ", __VA_ARGS__))

namespace qops_glue {

inline void append(std::string& s, const char* v) {
  s += v;
}
inline void append(std::string& s, const std::string& v) {
  s += v;
}
inline void append(std::string& s, char v) {
  s += v;
}
inline void append(std::string& s, bool v) {
  s += v ? "true" : "false";
}
template <typename T,
          std::enable_if_t<std::is_integral_v<T> || std::is_floating_point_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
// Python's name of a dtype ("float32", "int8"), as the references' messages say it.
inline void append(std::string& s, c10::ScalarType v) {
  s += c10::getDtypeNames(v).first;
}
inline void append(std::string& s, const c10::Device& v) {
  s += v.str();
}

template <typename... Args>
std::string format_message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace qops_glue

namespace qops_glue {

inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  QOPS_CHECK_VALUE(t.is_cuda(), op, name, " must be a CUDA tensor, got device ", t.device());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* name) {
  QOPS_CHECK_VALUE(t.device() == ref.device(), op, name, " must be on ", ref.device(), ", got ",
                   t.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dt, const char* op, const char* name) {
  QOPS_CHECK_TYPE(t.scalar_type() == dt, op, name, " must be ", dt, ", got ", t.scalar_type());
}

inline void check_half(const at::Tensor& t, const char* op, const char* name) {
  QOPS_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, name,
                  " must be float16 or bfloat16, got ", t.scalar_type());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  QOPS_CHECK_VALUE(t.is_contiguous(), op, name, " must be contiguous (got strides ", t.strides(),
                   ")");
}

// RoPE's inputs: positions int64 [T], cos and sin float32 [max_pos, D], contiguous, on ref's device.
inline void check_rope_tables(const at::Tensor& positions, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t T, int64_t D, const at::Tensor& ref,
                              const char* op) {
  check_dtype(positions, at::kLong, op, "positions");
  QOPS_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == T, op,
                   "positions must be int64 [T] with T = ", T, ", got shape ", positions.sizes());
  check_contiguous(positions, op, "positions");
  check_same_device(positions, ref, op, "positions");
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cos, "cos"},
                                std::pair<const at::Tensor&, const char*>{sin, "sin"}}) {
    check_dtype(t, at::kFloat, op, name);
    QOPS_CHECK_VALUE(t.dim() == 2 && t.size(1) == D && t.size(0) >= 1, op, name,
                     " must be float32 [max_pos, D] with D = ", D, ", got shape ", t.sizes());
    check_contiguous(t, op, name);
    check_same_device(t, ref, op, name);
  }
  QOPS_CHECK_VALUE(sin.sizes() == cos.sizes(), op, "sin must have cos's shape ", cos.sizes(),
                   ", got ", sin.sizes());
}

// Row stride (in elements) of `t` [..., H] seen as rows of H contiguous elements: the last dim
// must have stride 1 and the leading dims must collapse into one row dimension (sizes-1 dims are
// ignored). A clear error otherwise.
inline int64_t row_stride(const at::Tensor& t, const char* op, const char* name) {
  QOPS_CHECK_VALUE(t.dim() >= 1 && t.size(-1) > 0, op, name,
                   " must have a non-empty last dimension, got shape ", t.sizes());
  const int64_t H = t.size(-1);
  if (t.numel() == 0) return H;  // no rows: nothing is read, any strides will do
  QOPS_CHECK_VALUE(H == 1 || t.stride(-1) == 1, op, name,
                   "'s last dimension must be contiguous (stride 1), got strides ", t.strides());
  int64_t stride = -1, expect = -1;
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
      expect = stride * t.size(d);
      continue;
    }
    QOPS_CHECK_VALUE(t.stride(d) == expect, op, name,
                     "'s leading dimensions must collapse into rows one stride apart (got shape ",
                     t.sizes(), ", strides ", t.strides(), "); pass a .contiguous() tensor");
    expect *= t.size(d);
  }
  return stride < 0 ? H : stride;
}

// Converts a kernel's cudaError_t into a Python exception naming the op.
inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "qops.", op, ": CUDA kernel failed: ", cudaGetErrorString(err));
}

}  // namespace qops_glue

// Headers allowed in ops/: ATen, c10/cuda (CUDAGuard, CUDAStream) and csrc/ kernel headers.
// Not ATen/cuda/CUDAContext.h: it pulls in cuBLAS/cuSPARSE headers, which a CPU machine's CUDA
// toolkit may lack, and the compile-only check in CI must work there.
namespace qops_glue {
inline cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream();
}

// ---- split counters ------------------------------------------------------------------------------
// Split-K kernels that merge their own splits (the decode attention's fused merge, the W4A16
// GEMV) find the last CTA of a group with an int32 counter per group. The counters must be 0 on
// entry; the kernels leave them 0, so one buffer serves every op in turn (a kernel touches them
// only after its PDL wait, when the previous kernel has finished). The decode attention merges with
// them when num_splits > 1 (csrc/attention/paged_decode_int8.h): a call is one launch instead of
// two. Where they live (docs/kv_cache.md, "The fused split merge"):
//
// - Normally in one small buffer per device, zeroed once (at::zeros, then a stream synchronize so
//   that a launch on any stream sees the zeros) and never freed. Never freeing it is what makes it
//   safe: a captured CUDA graph keeps its address forever, and there is no growth (a fixed size
//   covers every split count the heuristic picks by far: num_splits > 1 only when the grid has
//   fewer CTAs than half the SMs' slots, i.e. a few hundred groups) and so no old buffer that a
//   kernel in flight on another stream or a graph could still use. It is not made while the
//   current stream is capturing a graph (at::zeros would only be a node of that graph, run at
//   replay, and the memory would come from the graph's private pool).
// - Otherwise -- a call with more groups than the buffer holds (only a forced num_splits with a
//   large batch), or the very first fused call on a device made during a graph capture -- in the
//   per-call workspace, zeroed by a cudaMemsetAsync on the call's stream (a memset node when
//   captured, so every replay re-zeroes). Correct everywhere, one extra memset.
//
// The shared buffer means that fused calls on one device must be ordered with each other (one
// stream, or streams/graph replays synchronized with each other): two calls that can run at the
// same time, e.g. concurrently replayed graphs or unsynchronized streams, would count into the
// same counters and merge partial results. Such callers pass merge="separate". (A buffer
// per stream would not help graphs: torch.cuda.graph captures on its own stream, never used
// eagerly, so every capture would take the memset path.)
inline constexpr int64_t kSharedSplitCounters = 4096;  // 16 KiB per device
inline constexpr int kMaxDevices = 256;

// The zeroed per-device counter buffer, or nullptr when `needed` counters do not fit or when it
// does not exist yet and `stream` is capturing.
inline int32_t* shared_split_counters(int device, cudaStream_t stream, int64_t needed,
                                      const char* op) {
  static std::atomic<int32_t*> buffers[kMaxDevices];  // static storage: all nullptr
  static std::mutex mutex;
  if (needed > kSharedSplitCounters || device < 0 || device >= kMaxDevices) return nullptr;
  int32_t* ptr = buffers[device].load(std::memory_order_acquire);
  if (ptr != nullptr) return ptr;
  const std::lock_guard<std::mutex> lock(mutex);
  ptr = buffers[device].load(std::memory_order_acquire);
  if (ptr != nullptr) return ptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_launch(cudaStreamIsCapturing(stream, &capture), op);
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  // The caller's CUDAGuard made `device` current, so at::zeros runs on `stream`. The tensor is
  // deliberately leaked: never freed, not even at exit (when CUDA may be torn down already).
  const at::Device dev(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  auto* keep = new at::Tensor(
      at::zeros({kSharedSplitCounters}, at::TensorOptions().dtype(at::kInt).device(dev)));
  check_launch(cudaStreamSynchronize(stream), op);  // the zeros are in memory for every stream
  ptr = keep->data_ptr<int32_t>();
  buffers[device].store(ptr, std::memory_order_release);
  return ptr;
}

}  // namespace qops_glue
