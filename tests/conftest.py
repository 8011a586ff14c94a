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

import qops  # noqa: F401  (registers the ops)

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
