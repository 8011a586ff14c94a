"""Check that a source change left the hand-written kernels' device code unchanged: compile every
``csrc/**/*.cu`` of a git revision and of the working tree to PTX (no GPU needed), and compare the
kernels (``.entry``) and device functions by name, whatever file they now live in. Identical PTX
means identical SASS from the same ptxas, so timings cannot move.

    python -m tools.ptx_identity --base HEAD [--arch 90 --arch 80] [--jobs 2]

Prints one line per differing function and a summary; exits 1 when any differ or are missing.
Anonymous-namespace hashes, branch-label numbers (a function's index in its file) and debug line
info are normalized away; everything else must match.
Needs nvcc and git; the generated plain-data headers come from ``cutlass_kernels.gen_w8a8
--headers-only`` of each tree (when the tree has that option).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generated_headers(tree: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for cmd in (
        [sys.executable, "-m", "cutlass_kernels.gen_w8a8", "--headers-only", "--out", str(out)],
        [sys.executable, str(tree / "cutlass_kernels" / "gen_w8a8.py"), "--out", str(out)],
    ):
        if subprocess.run(cmd, cwd=tree, capture_output=True).returncode == 0:
            return


def _ptx(src: Path, tree: Path, gen: Path, arch: str, out: Path) -> str:
    cmd = [
        "nvcc",
        "-ptx",
        "-O3",
        "-DNDEBUG",
        "-std=c++17",
        "--expt-relaxed-constexpr",
        f"-arch=compute_{arch}",
        "-I",
        str(tree / "csrc"),
        "-I",
        str(gen),
        str(src),
        "-o",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src}:\n{r.stderr[-2000:]}")
    return out.read_text()


_BLOCK = re.compile(r"^(?:\.visible |\.weak |\.extern )?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\S+?)\(", re.M)


def _anonymous_namespaces(ptx: str) -> str:
    """Replace each mangled anonymous namespace or internal-linkage prefix (``<len>_GLOBAL__N__...``,
    ``<len>_INTERNAL_...``: path and content hashes, which differ between trees) by one name."""
    out, pos = [], 0
    for m in re.finditer(r"(\d+)(?:_GLOBAL__N__|_INTERNAL_)", ptx):
        if m.start() < pos:
            continue
        length = int(m.group(1))
        out.append(ptx[pos : m.start()])
        out.append("4ANON")
        pos = m.start(1) + len(m.group(1)) + length
    out.append(ptx[pos:])
    return "".join(out)


def _functions(ptx: str) -> dict[str, str]:
    ptx = re.sub(r"^\s*\.(file|loc)\b.*$", "", ptx, flags=re.M)
    ptx = _anonymous_namespaces(ptx)
    # Branch labels are numbered by the function's index in its file: a kernel moved to another
    # file keeps its code but not its label names.
    ptx = re.sub(r"\$L__BB\d+_", "$L__BB_", ptx)
    starts = [(m.start(), m.group(1)) for m in _BLOCK.finditer(ptx)]
    funcs = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        body = ptx[pos:end].strip()
        if body.startswith(".extern") or body.rstrip().endswith(";") and "{" not in body:
            continue  # a declaration
        funcs[name] = body
    return funcs


def _compile_tree(tree: Path, archs: list[str], work: Path, jobs: int) -> dict[tuple[str, str], str]:
    gen = work / "generated"
    _generated_headers(tree, gen)
    sources = sorted(p for p in (tree / "csrc").rglob("*.cu") if "/sm90/" not in str(p))
    tasks = [(src, arch) for src in sources for arch in archs]
    funcs: dict[tuple[str, str], str] = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {
            pool.submit(_ptx, src, tree, gen, arch, work / f"{i}.ptx"): (src, arch)
            for i, (src, arch) in enumerate(tasks)
        }
        for f in concurrent.futures.as_completed(futures):
            _, arch = futures[f]
            for name, body in _functions(f.result()).items():
                funcs[(arch, name)] = body
    return funcs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree with")
    ap.add_argument("--arch", action="append", help="compute capability (repeatable; default 90 and 80)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    archs = args.arch or ["90", "80"]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True, capture_output=True
        )
        try:
            old = _compile_tree(base, archs, Path(tmp) / "w_old", args.jobs)
            new = _compile_tree(ROOT, archs, Path(tmp) / "w_new", args.jobs)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    bad = 0
    for key in sorted(set(old) | set(new)):
        arch, name = key
        if key not in new:
            print(f"compute_{arch}: missing now: {name}")
        elif key not in old:
            print(f"compute_{arch}: new: {name}")
        elif old[key] != new[key]:
            print(f"compute_{arch}: DIFFERS: {name}")
        else:
            continue
        bad += 1
    kernels = sum(1 for b in new.values() if ".entry" in b.split("(", 1)[0])
    print(
        f"{len(new)} functions ({kernels} kernels) over {len(archs)} archs; "
        f"{bad} differ or are missing against {args.base}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
