"""qops: quantized LLM inference ops (W8A8 GEMMs, fused norm/activation + int8 quant, int8 and int4
KV-cache decode attention) for NVIDIA GPUs, with a reference CPU implementation of every op.

All ops live under ``torch.ops.qops.*``; ``qops.<op>`` are their typed wrappers with docstrings.
``docs/ops.md`` states each op's numerical contract.

Every public module of this package is imported here; the family modules register their ops'
reference and fake implementations and mark their public objects with ``@export``
(``qops._registry``), which this module re-exports. Adding an op or a family edits no list here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch  # noqa: F401  (loads libtorch before our extension)

# Before loading _C, which works only with the torch (major.minor) it was built against: raises a
# clear ImportError under another torch.
from . import _torch_check  # noqa: F401

# isort: split
# _C: the op schemas, and the CUDA kernels when built with CUDA. A compiled extension without a
# stub, so mypy cannot see it as a submodule of this package.
from . import _C as _C  # type: ignore[attr-defined]
from . import _registry
from ._registry import has_cuda_kernel as has_cuda_kernel
from ._registry import install_missing_cuda_stubs
from ._registry import op_names as op_names

for _module in pkgutil.iter_modules(__path__):
    if not _module.ispkg and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
install_missing_cuda_stubs()

globals().update(_registry.exports())

__version__ = "0.1.0"
__all__ = sorted(["has_cuda_kernel", "op_names", *_registry.exports()])


def __getattr__(name: str) -> Any:  # for type checkers: the exports are set above at import
    raise AttributeError(f"module 'qops' has no attribute {name!r}")
