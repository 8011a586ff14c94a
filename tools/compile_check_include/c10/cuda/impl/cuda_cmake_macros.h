// Shim for the compile-only CUDA check on a CPU-only torch (QOPS_CUDA_COMPILE_CHECK=ON).
// A CUDA build of torch generates this header; the CPU wheel ships the other c10/cuda headers but
// not this one. Its real content is this one macro. Never used in a real CUDA build.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
