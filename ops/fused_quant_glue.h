// Glue helpers shared by ops/norm.cpp and ops/activation.cpp (the fused "math + int8 quant" ops).
#pragma once

#include <optional>
#include <string>

#include "common.h"
#include "quant/fused_quant_tuning.h"

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

// The family's launch options (the ops' keyword-only arguments enable_pdl, threads_per_row and
// cluster; 0 = the kernel's choice), checked and packed into the kernels' typed struct.
inline qops::FusedQuantTuning tuning(bool enable_pdl, int64_t threads_per_row, int64_t cluster,
                                     const char* op) {
  QOPS_CHECK_VALUE(threads_per_row >= 0 && threads_per_row <= 1024, op,
                   "threads_per_row must be in [0, 1024] (0: the kernel's choice), got ",
                   threads_per_row);
  QOPS_CHECK_VALUE(cluster == 0 || cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8, op,
                   "cluster must be 0 (the kernel's choice), 1, 2, 4 or 8, got ", cluster);
  qops::FusedQuantTuning t;
  t.pdl = enable_pdl;
  t.threads_per_row_target = static_cast<int>(threads_per_row);
  t.cluster = static_cast<int>(cluster);
  return t;
}

}  // namespace fq_glue
