"""Shared test fixtures and markers.

- ``@pytest.mark.gpu`` tests need CUDA: they are skipped (with the reason shown under -rs) when
  torch sees no GPU, and they are run on the lent H100 by tools/device_run.sh.
- ``QOPS_TEST_COMPILE=1`` reruns the op tests through ``torch.compile`` (wrappers are compiled
  with fullgraph=True), in the spirit of FlashInfer's conftest.
"""
from __future__ import annotations

import os

import pytest
import torch

import qops  # registers the ops

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: tools/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def maybe_compile(fn):
    """``torch.compile(fn, fullgraph=True)`` when QOPS_TEST_COMPILE=1, else ``fn``."""
    if os.environ.get("QOPS_TEST_COMPILE") == "1":
        return torch.compile(fn, fullgraph=True, dynamic=False)
    return fn


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no correct kernel writes (NaN for floats, a sentinel for ints)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.int8:
        return t.fill_(-77)
    return t.fill_(-7777)


def poison_cuda_allocator(nbytes: int = 64 << 20) -> None:
    """Fill a large block of the CUDA caching allocator with 0xA5 bytes and return it to the cache,
    so outputs the next ops allocate start as garbage rather than as zeros left by an earlier op:
    an element a kernel forgets to write then shows up as a mismatch."""
    if HAS_CUDA:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xA5)


def needs_w8a8_gemm() -> None:
    """Skip unless the w8a8_gemm CUDA kernels can run here: a CUDA device, a build with the
    sm_90a CUTLASS kernels (QOPS_ENABLE_SM90, the default) and a Hopper (sm_90) GPU. Elsewhere
    w8a8_gemm raises a clear NotImplementedError on CUDA tensors, which the callers do not test."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if not qops.has_cuda_kernel("w8a8_gemm"):
        pytest.skip("this build has no w8a8_gemm CUDA kernel (built without sm_90a)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the w8a8_gemm kernels are sm_90a (Hopper) only")


def cuda_kernel_names(fn, contains: str):
    """Names of the CUDA kernels `fn` launches whose name contains `contains` (torch.profiler);
    None when the profiler records no such kernels here (no CUPTI): the caller skips."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if contains in e.name]
    except Exception:  # noqa: BLE001 - no usable profiler: the caller skips
        return None
    return names or None
