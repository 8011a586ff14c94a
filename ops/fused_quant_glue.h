// Glue helpers shared by ops/norm.cpp and ops/activation.cpp (the fused "math + int8 quant" ops).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "common.h"
#include "norm/fused_quant_tuning.h"

namespace fq_glue {

// Row stride (in elements) of `t` [..., H] seen as rows of H contiguous elements: the last dim
// must have stride 1 and the leading dims must collapse into one row dimension (sizes-1 dims are
// ignored). A clear error otherwise.
inline int64_t row_stride(const at::Tensor& t, const char* op, const char* name) {
  const int64_t H = t.size(-1);
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
                     t.sizes(), ", strides ", t.strides(),
                     "); pass a .contiguous() tensor");
    expect *= t.size(d);
  }
  return stride < 0 ? H : stride;
}

// Whether `t`'s rows qualify for the 16-byte vector path (pointer, row stride, H multiple of vec).
inline bool vector_ok(const at::Tensor& t, int vec) {
  if (t.size(-1) % vec != 0) return false;
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % 16 != 0) return false;
  return true;
}

inline void check_scale(const std::optional<at::Tensor>& scale, const at::Tensor& input,
                        const char* op) {
  if (!scale) return;
  qops_glue::check_same_device(*scale, input, op, "scale");
  qops_glue::check_dtype(*scale, at::kFloat, op, "scale");
  QOPS_CHECK_VALUE(scale->numel() == 1, op,
                   "scale must hold one element (a static per-tensor scale), got shape ",
                   scale->sizes());
}

// Launch-shape override for tuning (benchmark sweeps): QOPS_FQ_TPR (threads per row to aim for)
// and QOPS_FQ_CLUSTER (CTAs per row). Read on every call so a sweep can change them; unset in
// normal use (the kernels choose).
inline qops::FusedQuantTuning tuning() {
  qops::FusedQuantTuning t;
  if (const char* s = std::getenv("QOPS_FQ_TPR")) t.threads_per_row_target = std::atoi(s);
  if (const char* s = std::getenv("QOPS_FQ_CLUSTER")) t.cluster = std::atoi(s);
  return t;
}

}  // namespace fq_glue
