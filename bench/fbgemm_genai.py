"""FBGEMM gen_ai (the ``fbgemm-gpu-genai`` wheel), the peer kernel library the benchmarks time as an
anchor: its ops library is loaded on its own, without the ``fbgemm_gpu`` package's ``__init__``
(which needs the separate fbgemm-gpu package), and registers ``torch.ops.fbgemm.*``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_why_not: str | None = None  # None: not tried yet; "": loaded; else why it is not


def load_fbgemm_genai() -> str:
    """Load ``fbgemm_gpu/experimental/gen_ai/fbgemm_gpu_experimental_gen_ai.so`` once.

    Returns "" when it is loaded, else one line saying why not (not installed, or the load
    failed). Whether a given op is there is ``hasattr(torch.ops.fbgemm, name)`` afterwards."""
    global _why_not
    if _why_not is not None:
        return _why_not
    spec = importlib.util.find_spec("fbgemm_gpu")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        _why_not = "fbgemm_gpu not installed (fbgemm-gpu-genai)"
        return _why_not
    so = os.path.join(
        list(spec.submodule_search_locations)[0], "experimental", "gen_ai", "fbgemm_gpu_experimental_gen_ai.so"
    )
    if not os.path.exists(so):
        _why_not = f"no gen_ai ops library at {so}"
        return _why_not
    try:
        torch.ops.load_library(so)
    except OSError as e:
        _why_not = f"loading {so} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        return _why_not
    _why_not = ""
    return _why_not
