"""The torch that imports qops must be the torch that qops was built against.

``qops._C`` is compiled against one torch's C++ headers and linked to its libraries, and torch
keeps no ABI between minor releases, so another torch either fails to load it (undefined symbols)
or, worse, loads it and misbehaves. The build records its torch (CMake writes
``qops/_build_info.py``, installed beside ``_C``); ``import qops`` compares the major.minor release
with the running torch before loading ``_C`` and raises an ``ImportError`` that says what to do.
"""

from __future__ import annotations

import importlib
import re

import torch


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def built_torch_version() -> str | None:
    """The torch version this build of qops was compiled against (None without build info, as in
    a source tree that was never built)."""
    try:
        info = importlib.import_module(f"{__package__}._build_info")
    except ImportError:
        return None
    return getattr(info, "TORCH_VERSION", None)


def check_torch(built: str | None = None, running: str | None = None) -> None:
    """Raise ``ImportError`` when the running torch's major.minor differs from the build's."""
    built = built if built is not None else built_torch_version()
    running = running if running is not None else torch.__version__
    if built is None or release(built) == release(running):
        return
    b, r = release(built), release(running)
    raise ImportError(
        f"qops was built against torch {built}, but torch {running} is installed: its compiled "
        f"extension (qops._C) works only with torch {b[0]}.{b[1]}.x. Rebuild qops against this torch "
        f'(pip install --no-build-isolation -e ".[test]" in the qops checkout, or reinstall the wheel '
        f"with --no-build-isolation), or install torch {b[0]}.{b[1]} (running: {r[0]}.{r[1]})."
    )


check_torch()  # at `import qops`, which imports this module before qops._C
