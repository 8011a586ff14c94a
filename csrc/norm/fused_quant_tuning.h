// Launch-shape override shared by the fused "math + int8 quant" kernels (norm/, activation/).
// Torch-free and CUDA-free: the glue includes it.
#pragma once

namespace qops {

// Zeros mean "choose" (the default everywhere); tests and the benchmark sweep set them.
struct FusedQuantTuning {
  int threads_per_row_target = 0;  // aim for about this many threads per CTA row slice
  int cluster = 0;                 // CTAs per row (1, 2, 4, 8; sm_90 clusters when > 1)
};

}  // namespace qops
