"""The one place that makes the CUTLASS Python interface (cutlass_cppgen 4.2) usable without a GPU.

Out of the box, building a ``Gemm`` or tracing an epilogue queries the current device for its
compute capability, and the first query runs a CUDA-version check that fails under cuda-python
13. The generator runs at build time on machines without a GPU, so it instead names the target
explicitly: the option registry is built for sm_90 and the nvcc version is given, never probed.
Every later call must then pass ``cc=90`` (``Gemm(..., cc=90, kernel_cc=90)``,
``epilogue.trace(..., cc=90)``).
"""

from __future__ import annotations

TARGET_CC = 90


def cutlass_cppgen_for_sm90(nvcc_version: str):
    """Import ``cutlass_cppgen`` set up for device-free SM90 generation and return the module."""
    import cutlass_cppgen
    from cutlass_cppgen.library_defaults import OptionRegistry

    # The registry's kernel lists depend on the CUDA version; `_nvcc_version` is what
    # `check_cuda_versions()` would have filled in from `nvcc --version` and cuda-python.
    cutlass_cppgen._nvcc_version = nvcc_version
    if cutlass_cppgen._option_registry is None:
        cutlass_cppgen._option_registry = OptionRegistry(TARGET_CC)
    return cutlass_cppgen
