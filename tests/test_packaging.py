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


# ---- set-up in two README commands (issue 43) ------------------------------------------------------------
def test_readme_install_is_two_commands():
    """The README's install block (what CI runs) is at most two commands: the build requirements,
    then qops with one extra that brings the test, demo, benchmark and compressed-tensors extras
    (the SmolLM2 GGUF is fetched on first use, so no ``pip install --no-deps`` step)."""
    cmds = [c for c in readme_block("install").splitlines() if c.strip() and not c.lstrip().startswith("#")]
    assert len(cmds) <= 2, cmds
    m = re.search(r"""-e "?\.\[([\w-]+)\]"?""", cmds[-1])
    assert m, f"the last install command installs no extra: {cmds[-1]}"
    if tomllib is None:
        return
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[m.group(1)] == ["qops[test,llama,bench,compressed]"], extras[m.group(1)]


# ---- the benchmarks on a machine without CUDA --------------------------------------------------------
# Runs each benchmark as `python -m bench.X` would (runpy, run_name="__main__"), all in one child
# process so that torch and qops are imported once; reports each exit status and what it wrote to
# stderr (an escaping exception is printed there as the interpreter would, traceback included).
_BENCH_DRIVER = r"""
import contextlib, importlib, io, json, runpy, sys, traceback, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for imported benches
runs, results = json.loads(sys.argv[1]), {}
for name in runs:
    importlib.import_module(name)  # importing a benchmark needs no CUDA
for name, argv in runs.items():
    err = io.StringIO()
    sys.argv = [name, *argv]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = {"code": code, "stderr": err.getvalue()}
print(json.dumps(results))
"""

# Benchmarks that also run on the CPU (the Llama's reference ops) need CUDA only when asked for it.
_BENCH_CUDA_ARGS = {
    "bench.bench_llama_decode": ["--device", "cuda"],
    "bench.bench_serving": ["--device", "cuda"],
    "bench.eval_quality": ["--device", "cuda"],
}


def bench_modules() -> list[str]:
    names = sorted(f"bench.{p.stem}" for p in (ROOT / "bench").glob("bench_*.py"))
    return [*names, "bench.eval_quality"]


def test_readme_build_settings_are_read_from_the_environment():
    """Every build setting the README's table names as an environment variable is mapped to its
    CMake option in pyproject.toml (scikit-build-core reads only the mapped ones: an unmapped
    variable would be silently ignored)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("Build settings (environment variables") :]
    table = table[: table.index("\n\n", table.index("|"))]
    names = re.findall(r"^\| `(QOPS_[A-Z0-9_]+)` \|", table, re.M)
    assert len(names) >= 5, names
    if tomllib is None:
        return
    defines = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["cmake"]["define"]
    for name in names:
        assert name in defines and defines[name].get("env") == name, f"{name} is not read from the environment"


def test_benchmarks_without_cuda_exit_with_one_line(tmp_path):
    """Every benchmark (and ``python -m qops.llama --device cuda``), on a machine where torch sees no
    GPU: status 1 and one line on stderr saying it needs a CUDA device, never a traceback."""
    import json
    import os
    import subprocess
    import sys

    names = bench_modules()
    assert len(names) >= 8, names
    for name in names:  # every benchmark has a main (what `python -m` runs)
        assert re.search(r"^def main\(", (ROOT / (name.replace(".", "/") + ".py")).read_text(), re.M) or (
            name == "bench.eval_quality"
        ), name
    runs = {n: ["--out", str(tmp_path), *_BENCH_CUDA_ARGS.get(n, [])] for n in names}
    runs["qops.llama"] = ["--device", "cuda"]  # the demo, also a CPU program, asked for CUDA
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _BENCH_DRIVER, json.dumps(runs)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {}
    for name in runs:
        r = results[name]
        err = r["stderr"].strip()
        if r["code"] == 0 or "Traceback" in err or "needs a CUDA device" not in err or len(err.splitlines()) != 1:
            bad[name] = r
    assert not bad, json.dumps(bad, indent=1)[-6000:]
    assert not list(tmp_path.iterdir()), "a benchmark wrote output before finding it has no GPU"


# ---- the build's torch is the running torch ------------------------------------------------------------
def test_build_records_its_torch():
    """The build wrote the torch it compiled against beside qops._C: the torch running these tests."""
    import torch

    from qops._torch_check import built_torch_version, release

    built = built_torch_version()
    assert built is not None, "no qops/_build_info.py next to qops._C: CMakeLists.txt must install it"
    assert release(built) == release(torch.__version__), (built, torch.__version__)


def test_import_check_refuses_another_torch_release(monkeypatch):
    """``import qops`` raises a clear ImportError when torch's major.minor is not the build's; a
    different patch release or local tag (``+cu130``) of the same minor is accepted."""
    import pytest
    import torch

    from qops._torch_check import built_torch_version, check_torch, release

    built = built_torch_version()
    assert built is not None
    major, minor = release(built)
    for other in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.3+cu121", f"{major + 1}.0.0"):
        monkeypatch.setattr(torch, "__version__", other)
        with pytest.raises(ImportError, match=rf"built against torch {re.escape(built)}, but torch {re.escape(other)}"):
            check_torch()
    for same in (f"{major}.{minor}.9", f"{major}.{minor}.0+cu130", f"{major}.{minor}.0a0+git1234"):
        monkeypatch.setattr(torch, "__version__", same)
        check_torch()


def test_import_qops_under_another_torch_fails_cleanly():
    """The whole import, in a fresh interpreter whose torch claims another release: an ImportError
    naming both versions, raised before qops._C is loaded."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "torch.__version__ = '1.99.0'\n"
        "try:\n"
        "    import qops\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e); print('C loaded:', 'qops._C' in sys.modules); sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "built against torch" in proc.stdout and "1.99.0" in proc.stdout, proc.stdout
    assert "C loaded: False" in proc.stdout
