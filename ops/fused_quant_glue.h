// Glue helpers shared by ops/norm.cpp and ops/activation.cpp (the fused "math + int8 quant" ops).
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "common.h"
#include "norm/fused_quant_tuning.h"

namespace fq_glue {

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
// normal use (the kernels choose). Also QOPS_PDL (qops_glue::pdl_enabled).
inline qops::FusedQuantTuning tuning() {
  qops::FusedQuantTuning t;
  t.pdl = qops_glue::pdl_enabled();
  if (const char* s = std::getenv("QOPS_FQ_TPR")) t.threads_per_row_target = std::atoi(s);
  if (const char* s = std::getenv("QOPS_FQ_CLUSTER")) t.cluster = std::atoi(s);
  return t;
}

}  // namespace fq_glue
