// CUDA implementation of qops::w4a16_prepack and qops::w4a16_gemm (torch glue only: checks, the
// scales' layout, workspace and split counters, config choice, stream). The kernels: the prepack
// and the decode GEMV in csrc/gemm/w4a16_gemv.cu (any arch the portable kernels are built for),
// and, in sm_90a builds, the CUTLASS mixed-input GEMMs that cutlass_kernels/gen_w8a8.py emits from
// the config table (csrc/gemm/w4a16_sm90.h). docs/w4a16_gemm.md has the design.
#include <string>

#include "common.h"
#include "common/device_cache.h"
#include "gemm/w4a16.h"
#ifdef QOPS_HAVE_W4A16_SM90
#include "gemm/w4a16_sm90.h"
#endif

namespace {

using namespace qops_glue;
namespace w4 = qops::w4a16;

// ---- the config table: the generated one (sm_90a builds) or the GEMV alone -----------------------
#ifdef QOPS_HAVE_W4A16_SM90
int num_configs() {
  return qops::w4a16_sm90::num_configs();
}
const char* config_name(int c) {
  return qops::w4a16_sm90::config_name(c);
}
int config_max_m(int c) {
  return qops::w4a16_sm90::config_max_m(c);
}
#else
int num_configs() {
  return 1;
}
const char* config_name(int c) {
  return c == 0 ? "gemv" : nullptr;
}
int config_max_m(int) {
  return 0;
}  // the GEMV serves any M where it is the only kernel
#endif

int config_index(c10::string_view config, const char* op) {
  if (config == "auto") return -1;
  std::string names;
  for (int i = 0; i < num_configs(); ++i) {
    if (config == config_name(i)) return i;
    names += std::string(i ? ", " : "") + config_name(i);
  }
  QOPS_CHECK_VALUE(false, op, "unknown config '", std::string(config), "'; this build has: auto, ",
                   names);
  return -1;
}

// [N, K/G] scales or zeros -> the N-major memory the kernels read ([K/G][N]): a view when the
// tensor already is N-major (strides (1, N)), else a transposed copy.
at::Tensor n_major(const at::Tensor& t, const at::Tensor& a, int64_t n, int64_t groups,
                   const char* name, const char* op) {
  check_same_device(t, a, op, name);
  QOPS_CHECK_TYPE(t.scalar_type() == a.scalar_type(), op, name, " (a's dtype) must be ",
                  a.scalar_type(), ", got ", t.scalar_type());
  QOPS_CHECK_VALUE(t.dim() == 2 && t.size(0) == n && t.size(1) == groups, op, name,
                   " must be [N, K/group_size] = [", n, ", ", groups, "], got shape ", t.sizes());
  const bool is_n_major = (n <= 1 || t.stride(0) == 1) && (groups <= 1 || t.stride(1) == n);
  const bool is_row_major = t.is_contiguous();
  QOPS_CHECK_VALUE(is_n_major || is_row_major, op, name,
                   " must be contiguous or N-major (strides (1, N): qops.w4a16.n_major), got "
                   "strides ",
                   t.strides());
  at::Tensor out = is_n_major ? t : t.t().contiguous().t();  // [N, K/G] view of [K/G][N] memory
  // The CUTLASS kernels read them with TMA: a 16-byte aligned base.
  if (reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 != 0) out = out.t().contiguous().t();
  return out;
}

at::Tensor w4a16_prepack_cuda(const at::Tensor& weight) {
  constexpr const char* op = "w4a16_prepack";
  check_cuda(weight, op, "weight");
  check_dtype(weight, at::kByte, op, "weight");
  QOPS_CHECK_VALUE(weight.dim() == 2, op, "weight must be 2-D uint8 [N, K/2], got shape ",
                   weight.sizes());
  const int64_t n = weight.size(0), k = 2 * weight.size(1);
  QOPS_CHECK_VALUE(n % 16 == 0, op, "N = weight.shape[0] must be a multiple of 16, got shape ",
                   weight.sizes());
  QOPS_CHECK_VALUE(k > 0 && k % 64 == 0, op,
                   "K = 2 * weight.shape[1] must be a positive multiple of 64 (the smallest group "
                   "size), got weight shape ",
                   weight.sizes());
  QOPS_CHECK_VALUE(n <= INT32_MAX && k <= INT32_MAX && n * k / 2 < (int64_t{1} << 40), op,
                   "weight is too large");
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor in = weight.contiguous();
  at::Tensor out = at::empty({k / 16, n / 16, 128}, weight.options());
  if (n == 0) return out;
  check_launch(w4::prepack(in.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), static_cast<int>(n),
                           static_cast<int>(k), current_stream()),
               op);
  return out;
}

at::Tensor w4a16_gemm_cuda(const at::Tensor& a_in, const at::Tensor& weight_packed,
                           const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                           int64_t group_size, c10::string_view config, bool enable_pdl) {
  constexpr const char* op = "w4a16_gemm";
  check_cuda(a_in, op, "a");
  QOPS_CHECK_TYPE(a_in.scalar_type() == at::kHalf || a_in.scalar_type() == at::kBFloat16, op,
                  "a must be float16 or bfloat16, got ", a_in.scalar_type());
  QOPS_CHECK_VALUE(a_in.dim() == 2, op, "a must be 2-D [M, K], got shape ", a_in.sizes());
  QOPS_CHECK_VALUE(a_in.size(1) <= 1 || a_in.stride(1) == 1, op,
                   "a's last dimension must be contiguous (stride 1)");
  QOPS_CHECK_VALUE(group_size == 64 || group_size == 128, op, "group_size must be 64 or 128, got ",
                   group_size);
  const int64_t M = a_in.size(0), K = a_in.size(1);
  QOPS_CHECK_VALUE(K > 0 && K % group_size == 0, op, "K (a.shape[1] = ", K,
                   ") must be a positive multiple of group_size (", group_size, ")");
  check_same_device(weight_packed, a_in, op, "weight_packed");
  check_dtype(weight_packed, at::kByte, op, "weight_packed");
  QOPS_CHECK_VALUE(weight_packed.dim() == 3 && weight_packed.size(2) == 128, op,
                   "weight_packed must be qops.w4a16_prepack's output on this device (uint8 "
                   "[K/16, N/16, 128]), got shape ",
                   weight_packed.sizes(),
                   (weight_packed.dim() == 2 ? ": a weight in the reference layout [N, K/2]; call "
                                               "qops.w4a16_prepack(weight) once at load time"
                                             : ""));
  const int64_t N = weight_packed.size(1) * 16;
  QOPS_CHECK_VALUE(weight_packed.size(0) * 16 == K, op,
                   "weight_packed [K/16, N/16, 128] must have K = ", K, " (a.shape[1]), got shape ",
                   weight_packed.sizes());
  check_contiguous(weight_packed, op, "weight_packed");
  QOPS_CHECK_VALUE(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX, op,
                   "a problem dimension exceeds int32");
  const int64_t groups = K / group_size;
  const at::Tensor s = n_major(scales, a_in, N, groups, "scales", op);
  std::optional<at::Tensor> z;
  if (zeros.has_value()) z = n_major(*zeros, a_in, N, groups, "zeros", op);
  const int cfg = config_index(config, op);
  if (cfg >= 0 && config_max_m(cfg) > 0) {
    QOPS_CHECK_VALUE(M <= config_max_m(cfg), op, "config '", std::string(config),
                     "' serves M <= ", config_max_m(cfg), ", got M = ", M);
  }

  const c10::cuda::CUDAGuard guard(a_in.device());
  at::Tensor d = at::empty({M, N}, a_in.options());
  if (M == 0) return d;
  // TMA (CUTLASS) and the GEMV's 32-bit loads: rows of a multiple of 8 elements, 16-byte base.
  at::Tensor a = a_in;
  if ((M > 1 && a.stride(0) % 8 != 0) || reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 != 0) {
    a = a.contiguous();
    if (reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 != 0) a = a.clone();
  }
  w4::Problem p;
  p.a = a.data_ptr();
  p.lda = M > 1 ? a.stride(0) : K;
  p.w = weight_packed.data_ptr<uint8_t>();
  p.scales = s.data_ptr();
  p.zeros = z.has_value() ? z->data_ptr() : nullptr;
  p.d = d.data_ptr();
  p.m = static_cast<int>(M);
  p.n = static_cast<int>(N);
  p.k = static_cast<int>(K);
  p.group_size = static_cast<int>(group_size);
  p.dtype = a.scalar_type() == at::kHalf ? w4::Dtype::kFloat16 : w4::Dtype::kBFloat16;
  w4::LaunchOptions options;
  options.pdl = enable_pdl;

  qops::DeviceProps device;
  check_launch(qops::current_device_props(&device), op);
  const cudaStream_t stream = current_stream();
#ifdef QOPS_HAVE_W4A16_SM90
  const bool sm90 = device.cc_major == 9 && device.cc_minor == 0;
  const int chosen =
      cfg >= 0 ? cfg : (sm90 ? qops::w4a16_sm90::select_config(p.m, p.n, p.k, device.sms) : -1);
  const bool use_gemv = chosen < 0 || std::string(config_name(chosen)) == "gemv";
  TORCH_CHECK_NOT_IMPLEMENTED(use_gemv || sm90, "qops.", op, ": config '", std::string(config),
                              "' is an sm_90a (Hopper) kernel; ", a.device(),
                              " is another architecture");
#else
  const bool use_gemv = true;
#endif
  size_t ws_bytes = 0;
  at::Tensor workspace;
  if (use_gemv) {
    check_launch(w4::gemv(p, options, device.sms, stream, &ws_bytes), op);
    const int counters = w4::gemv_num_counters(p, device.sms);
    if (counters > 0) {
      p.counters = shared_split_counters(a.device().index(), stream, counters, op);
      if (p.counters == nullptr) {  // zeroed per call (see shared_split_counters)
        ws_bytes = (ws_bytes + 15) / 16 * 16;
        workspace = at::empty({static_cast<int64_t>(ws_bytes + counters * sizeof(int32_t))},
                              a.options().dtype(at::kByte));
        p.counters = reinterpret_cast<int*>(workspace.data_ptr<uint8_t>() + ws_bytes);
        check_launch(cudaMemsetAsync(p.counters, 0, counters * sizeof(int32_t), stream), op);
      }
      p.num_counters = counters;
    }
    if (ws_bytes > 0 && !workspace.defined()) {
      workspace = at::empty({static_cast<int64_t>(ws_bytes)}, a.options().dtype(at::kByte));
    }
    p.workspace = ws_bytes > 0 ? workspace.data_ptr() : nullptr;
    p.workspace_bytes = ws_bytes;
    check_launch(w4::gemv(p, options, device.sms, stream, nullptr), op);
    return d;
  }
#ifdef QOPS_HAVE_W4A16_SM90
  check_launch(qops::w4a16_sm90::workspace_size(p, chosen, &ws_bytes), op);
  if (ws_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(ws_bytes)}, a.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = ws_bytes;
  }
  check_launch(qops::w4a16_sm90::gemm(p, chosen, options, stream), op);
#endif
  return d;
}

}  // namespace

TORCH_LIBRARY_IMPL(qops, CUDA, m) {
  m.impl("w4a16_prepack", &w4a16_prepack_cuda);
  m.impl("w4a16_gemm", &w4a16_gemm_cuda);
}
