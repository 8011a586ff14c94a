// Launch options of the fused "math + int8 quant" kernels (norm/, activation/): the ops' keyword-only
// arguments enable_pdl and tuning (qops.NormTuning / qops.FusedQuantTuning), packed by the glue.
// Torch-free and CUDA-free: the glue includes it.
#pragma once

namespace qops {

// RMSNorm kernel variant (FusedQuantTuning::norm_variant; the norm ops' `variant` argument).
constexpr int kNormVariantAuto = 0;         // the launcher's rule (csrc/norm/norm.cu)
constexpr int kNormVariantRowResident = 1;  // one row per CTA (slice), registers only ("rowres")
constexpr int kNormVariantPipelined = 2;    // persistent CTAs, cp.async row ring ("pipelined")

// Zeros mean "choose" (the default everywhere); tests and the benchmark sweep set them.
struct FusedQuantTuning {
  int threads_per_row_target = 0;  // aim for about this many threads per CTA row slice
  int cluster = 0;                 // CTAs per row (1, 2, 4, 8; sm_90 clusters when > 1)
  // Norm only (the activation kernels ignore them):
  int norm_variant = kNormVariantAuto;  // a forced variant that does not fit falls back to rowres
  int pipe_stages = 0;                  // pipelined ring depth (2 or 3); 0 = choose
  // Launch with programmatic dependent launch (common/launch.cuh; the glue clears it for
  // QOPS_PDL=0).
  bool pdl = true;
};

}  // namespace qops
