"""Packaging and entry points: build requirements, the README's install line, the benchmarks' CPU
behaviour and the import-time check of the torch the extension was built against."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def readme_block(marker: str) -> str:
    """The first fenced block after ``<!-- ci:<marker> -->`` (what .ci/run executes)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- ci:{marker} -->\n```\w*\n(.*?)```", text, re.S)
    assert m, f"README has no <!-- ci:{marker} --> block"
    return m.group(1)


# ---- pybind11 is not a build dependency -----------------------------------------------------------
def test_no_pybind11():
    """The extension is a plain ``PyInit__C`` plus TORCH_LIBRARY registrations: nothing includes
    pybind11, so neither the build requirements nor the README's install line name it."""
    sources = [p for d in ("csrc", "ops") for p in (ROOT / d).rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp")]
    sources.append(ROOT / "CMakeLists.txt")
    assert len(sources) > 1
    users = [str(p.relative_to(ROOT)) for p in sources if re.search(r"pybind11|torch/extension\.h", p.read_text())]
    assert not users, f"these sources use pybind11: {users}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        requires = tomllib.loads(pyproject)["build-system"]["requires"]
    else:
        requires = re.search(r"^requires = \[(.*)\]$", pyproject, re.M).group(1).split(",")  # type: ignore[union-attr]
    assert not [r for r in requires if "pybind11" in r], requires
    assert "pybind11" not in readme_block("install")
