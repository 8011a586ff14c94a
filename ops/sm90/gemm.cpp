// CUDA implementation of qops::w8a8_gemm: argument checks, output allocation, stream and device
// guard, then one of the generated CUTLASS families: sm_90a (csrc/gemm/w8a8_sm90.h, with the
// hand-written decode GEMV) on Hopper, sm_80 (csrc/gemm/w8a8_sm80.h: CUTLASS 2.x, compute_80
// PTX for later GPUs) on compute capability 8.x or when `config` names one of its configs. Built
// with QOPS_HAVE_W8A8_SM90 and / or QOPS_HAVE_W8A8_SM80 (cutlass_kernels/CMakeLists.txt). No
// kernel math here; docs/w8a8_gemm.md has the design.
#include <string>

#include "common.h"
#include "common/device_cache.h"
#include "gemm/w8a8_gemv.h"
#include "gemm/w8a8_sm90.h"
#if QOPS_HAVE_W8A8_SM80
#include "gemm/w8a8_sm80.h"
#endif

#if !QOPS_HAVE_W8A8_SM90 && !QOPS_HAVE_W8A8_SM80
#error "the w8a8_gemm glue needs one of the CUTLASS families (QOPS_HAVE_W8A8_SM90, _SM80)"
#endif

namespace {

using namespace qops_glue;
namespace w8a8 = qops::w8a8_sm90;  // Problem, LaunchOptions: shared by both families

// A generated family's API (gemm/w8a8_sm90.h, gemm/w8a8_sm80.h).
struct Family {
  const char* arch;  // what its kernels are built for, for messages
  bool sm80;  // the sm_80 family: auto on compute capability 8.x; bias read in 16-byte vectors
  int (*num_configs)();
  const char* (*config_name)(int);
  int (*config_max_m)(int);
  cudaError_t (*workspace_size)(const w8a8::Problem&, int, size_t*);
  cudaError_t (*gemm)(const w8a8::Problem&, int, const w8a8::LaunchOptions&, cudaStream_t);
};

// In config= listing order: the sm_90a family first.
constexpr Family kFamilies[] = {
#if QOPS_HAVE_W8A8_SM90
    {"sm_90a (Hopper)", false, &qops::w8a8_sm90::num_configs, &qops::w8a8_sm90::config_name,
     &qops::w8a8_sm90::config_max_m, &qops::w8a8_sm90::workspace_size, &qops::w8a8_sm90::gemm},
#endif
#if QOPS_HAVE_W8A8_SM80
    {"sm_80 (Ampere and Ada; PTX for later GPUs)", true, &qops::w8a8_sm80::num_configs,
     &qops::w8a8_sm80::config_name, &qops::w8a8_sm80::config_max_m,
     &qops::w8a8_sm80::workspace_size, &qops::w8a8_sm80::gemm},
#endif
};

constexpr const char* kOp = "w8a8_gemm";
// The int32 accumulator cannot overflow: |a * b| <= 128 * 128 and K * 2^14 < 2^31.
constexpr int64_t kMaxK = 131071;

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// An int8 [rows, K] operand the kernels read with TMA: unit stride along K, a row stride and a
// base address that are multiples of 16 bytes (slices of a wider row-major tensor qualify).
void check_operand(const at::Tensor& t, const char* name, const char* shape) {
  check_dtype(t, at::kChar, kOp, name);
  QOPS_CHECK_VALUE(t.dim() == 2, kOp, name, " must be 2-D ", shape, ", got shape ", t.sizes());
  if (t.numel() == 0) return;  // nothing is read
  QOPS_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, kOp, name,
                   " must be row-major (stride 1 along K), got strides ", t.strides());
  QOPS_CHECK_VALUE(t.size(0) <= 1 || (t.stride(0) >= t.size(1) && t.stride(0) % 16 == 0), kOp, name,
                   "'s rows must not overlap and their stride must be a multiple of 16 "
                   "elements, got shape ",
                   t.sizes(), " and strides ", t.strides());
  QOPS_CHECK_VALUE(aligned16(t.data_ptr()), kOp, name,
                   " must start at a 16-byte aligned address (slice a wider tensor at a "
                   "multiple of 16 columns, or pass a contiguous copy)");
}

// A float32 scale with one element or `len`, flattened; copied when it is not contiguous or not
// 16-byte aligned (the kernels read vectors of scales).
at::Tensor checked_scale(const at::Tensor& s, int64_t len, const at::Tensor& a, const char* name,
                         const char* len_name) {
  check_same_device(s, a, kOp, name);
  check_dtype(s, at::kFloat, kOp, name);
  QOPS_CHECK_VALUE(s.numel() == 1 || s.numel() == len, kOp, name, " must hold 1 or ", len_name,
                   " = ", len, " elements, got shape ", s.sizes());
  at::Tensor flat = s.reshape({s.numel()});
  if (!flat.is_contiguous() || !aligned16(flat.data_ptr())) flat = flat.clone();
  return flat;
}

// The family and config index `config` names (-1: the family's own choice). "auto" takes the
// sm_80 family on GPUs of compute capability 8.x and the sm_90a family elsewhere (which refuses
// GPUs other than sm_90 with cudaErrorNoKernelImageForDevice); a config name takes its family.
struct Choice {
  const Family* family;
  int config;
};

Choice choose(c10::string_view config, int cc_major) {
  if (config == "auto") {
    // The sm_80 family on 8.x; elsewhere the first built (sm_90a when built).
    for (const Family& f : kFamilies) {
      if (f.sm80 == (cc_major == 8)) return {&f, -1};
    }
    return {&kFamilies[0], -1};
  }
  std::string names;
  for (const Family& f : kFamilies) {
    for (int i = 0; i < f.num_configs(); ++i) {
      if (config == f.config_name(i)) return {&f, i};
      names += std::string(names.empty() ? "" : ", ") + f.config_name(i);
    }
  }
  QOPS_CHECK_VALUE(false, kOp, "unknown config '", std::string(config), "'; this build has: auto, ",
                   names);
  return {nullptr, -1};
}

// The op's keyword-only launch options (qops.GemvTuning below the wrapper): gemv_shape = [] (the
// GEMV's own choice) or [ROWS, WARPS, CHUNKS], one of the built kGemvShapes (tests and sweeps
// cover every shape this way); gemv_early = -1 (its own choice) or 0, 1, 2: the weight batches it
// requests before the PDL wait under overlap_prologue (clamped to what the build has:
// max_early_batches in gemm/w8a8_gemv.cu). Only the decode GEMV reads them.
w8a8::LaunchOptions launch_options(bool enable_pdl, bool overlap_prologue,
                                   c10::IntArrayRef gemv_shape, int64_t gemv_early) {
  QOPS_CHECK_VALUE(gemv_early >= -1 && gemv_early <= 2, kOp,
                   "gemv_early must be -1 (the GEMV's choice), 0, 1 or 2, got ", gemv_early);
  w8a8::LaunchOptions o;
  o.pdl = enable_pdl;
  o.overlap_prologue = overlap_prologue;
  o.gemv.early_batches = static_cast<int>(gemv_early);
  if (gemv_shape.empty()) return o;
  bool built_shape = false;
  std::string built;
  for (const w8a8::GemvShape& s : w8a8::kGemvShapes) {
    built_shape = built_shape || (gemv_shape.size() == 3 && s.rows_per_cta == gemv_shape[0] &&
                                  s.warps == gemv_shape[1] && s.chunks == gemv_shape[2]);
    built += format_message(" (", s.rows_per_cta, ", ", s.warps, ", ", s.chunks, ")");
  }
  QOPS_CHECK_VALUE(built_shape, kOp, "gemv_shape must be (rows, warps, chunks), one of", built,
                   "; got ", gemv_shape);
  o.gemv.rows_per_cta = static_cast<int>(gemv_shape[0]);
  o.gemv.warps = static_cast<int>(gemv_shape[1]);
  o.gemv.chunks = static_cast<int>(gemv_shape[2]);
  return o;
}

at::Tensor w8a8_gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale,
                          const at::Tensor& b_scale, at::ScalarType out_dtype,
                          const std::optional<at::Tensor>& bias, c10::string_view config,
                          bool overlap_prologue, bool enable_pdl, c10::IntArrayRef gemv_shape,
                          int64_t gemv_early) {
  check_cuda(a, kOp, "a");
  check_same_device(b, a, kOp, "b");
  check_operand(a, "a", "[M, K]");
  check_operand(b, "b", "[N, K]");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  QOPS_CHECK_VALUE(b.size(1) == K, kOp, "b must be [N, K] with K = ", K,
                   " (the nn.Linear weight layout), got shape ", b.sizes());
  QOPS_CHECK_VALUE(K % 16 == 0 && N % 16 == 0, kOp, "K and N must be multiples of 16, got K = ", K,
                   ", N = ", N);
  QOPS_CHECK_VALUE(K <= kMaxK, kOp, "K must be at most ", kMaxK,
                   " (beyond it the int32 accumulator can overflow), got ", K);
  QOPS_CHECK_VALUE(M <= INT32_MAX, kOp, "M must fit in int32, got ", M);
  QOPS_CHECK_TYPE(out_dtype == at::kHalf || out_dtype == at::kBFloat16, kOp,
                  "out_dtype must be float16 or bfloat16, got ", out_dtype);
  at::Tensor sa = checked_scale(a_scale, M, a, "a_scale", "M");
  at::Tensor sb = checked_scale(b_scale, N, a, "b_scale", "N");
  if (bias.has_value()) {
    check_same_device(*bias, a, kOp, "bias");
    QOPS_CHECK_TYPE(bias->scalar_type() == out_dtype, kOp, "bias must have the output dtype ",
                    out_dtype, ", got ", bias->scalar_type());
    QOPS_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, kOp, "bias must be [N] = [", N,
                     "], got shape ", bias->sizes());
    check_contiguous(*bias, kOp, "bias");
  }
  const c10::cuda::CUDAGuard guard(a.device());
  qops::DeviceProps device;
  check_launch(qops::current_device_props(&device), kOp);
  const Choice choice = choose(config, device.cc_major);
  const Family& family = *choice.family;
  const int cfg = choice.config;
  const w8a8::LaunchOptions options =
      launch_options(enable_pdl, overlap_prologue, gemv_shape, gemv_early);
  if (cfg >= 0 && family.config_max_m(cfg) > 0) {
    QOPS_CHECK_VALUE(M <= family.config_max_m(cfg), kOp, "config '", std::string(config),
                     "' serves M <= ", family.config_max_m(cfg), ", got M = ", M);
  }

  at::Tensor d = at::empty({M, N}, a.options().dtype(out_dtype));
  if (M == 0 || N == 0) return d;
  if (K == 0) {  // acc = 0: d = bias (or 0), no kernel needed
    return bias.has_value() ? d.copy_(bias->expand({M, N})) : d.zero_();
  }
  // Per-tensor x per-tensor is its own epilogue; any per-token or per-channel scale runs the
  // per-token x per-channel kernels, with the other scale broadcast to a vector first.
  const bool per_tensor = sa.numel() == 1 && sb.numel() == 1;
  if (!per_tensor) {
    if (sa.numel() != M) sa = sa.expand({M}).contiguous();
    if (sb.numel() != N) sb = sb.expand({N}).contiguous();
  }
  w8a8::Problem p{};
  p.a = a.data_ptr<int8_t>();
  p.lda = M > 1 ? a.stride(0) : K;
  p.b = b.data_ptr<int8_t>();
  p.ldb = N > 1 ? b.stride(0) : K;
  p.a_scale = sa.data_ptr<float>();
  p.b_scale = sb.data_ptr<float>();
  // The sm_80 kernels read the bias in 16-byte vectors: an unaligned one (a slice) is copied.
  at::Tensor bias_copy;
  if (bias.has_value() && family.sm80 && !aligned16(bias->data_ptr())) {
    bias_copy = bias->clone();
  }
  p.bias = bias_copy.defined() ? bias_copy.data_ptr()
           : bias.has_value()  ? bias->data_ptr()
                               : nullptr;
  p.d = d.data_ptr();
  p.ldd = N;
  p.m = static_cast<int>(M);
  p.n = static_cast<int>(N);
  p.k = static_cast<int>(K);
  p.out_dtype = out_dtype == at::kHalf ? w8a8::OutDtype::kFloat16 : w8a8::OutDtype::kBFloat16;
  p.scale_mode = per_tensor ? w8a8::ScaleMode::kPerTensor : w8a8::ScaleMode::kPerTokenPerChannel;
  // Stream-K configs need scratch for partial accumulators; it comes from the caching allocator
  // (inside CUDA-graph capture: the graph's pool), as vLLM does, and the kernel re-initializes it.
  size_t workspace_bytes = 0;
  cudaError_t err = family.workspace_size(p, cfg, &workspace_bytes);
  at::Tensor workspace;
  if (err == cudaSuccess && workspace_bytes != 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, a.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = workspace_bytes;
  }
  if (err == cudaSuccess) err = family.gemm(p, cfg, options, current_stream());
  if (err == cudaErrorNoKernelImageForDevice) {
    std::string built;
    for (const Family& f : kFamilies) built += std::string(built.empty() ? "" : ", ") + f.arch;
    TORCH_CHECK_NOT_IMPLEMENTED(
        false,
        format_message("qops.", kOp, ": config '", std::string(config), "' runs kernels built for ",
                       family.arch, "; ", a.device(), " (compute capability ", device.cc_major, ".",
                       device.cc_minor, ") is another architecture (this build has: ", built, ")"));
  }
  check_launch(err, kOp);
  return d;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("w8a8_gemm", &w8a8_gemm_cuda);
}
