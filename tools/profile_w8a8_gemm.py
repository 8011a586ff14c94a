"""Run one w8a8_gemm problem once per tile config (and the bf16 / fp8 anchors), each launch alone
between cudaProfilerStart and cudaProfilerStop, for Nsight Compute: the profiler then sees exactly
these kernels, in the printed order. A diagnostic companion to bench/bench_w8a8_gemm.py (its tables
are the reported numbers; this says where a config's time goes: grid, SM active cycles, stalls).
From the repository root:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \\
        --section Occupancy --section WarpStateStats --section SchedulerStats \\
        python -m tools.profile_w8a8_gemm --layer 70B-tp8.qkv --m 1024 [--configs a,b] [--no-anchors]

Without ncu it just runs (and checks every config against the first). docs/w8a8_gemm.md, "What the
profiler says about 70B-tp8 qkv at M = 1024", was made with it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import qops
from bench.bench_w8a8_gemm import _int8
from bench.shapes import GEMM_LAYERS as LAYERS
from cutlass_kernels import w8a8_configs as table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", default="70B-tp8.qkv", help=f"one of {', '.join(l for l, _, _ in LAYERS)}")
    ap.add_argument("--m", type=int, default=1024, help="tokens (rows of the activations)")
    ap.add_argument(
        "--configs", default=None, help="comma-separated config names (default: every tile config, and gemv at M <= 16)"
    )
    ap.add_argument("--no-anchors", action="store_true", help="skip bf16 F.linear and fp8 row-wise _scaled_mm")
    args = ap.parse_args()
    shapes = {l: (n, k) for l, n, k in LAYERS}
    if args.layer not in shapes:
        raise SystemExit(f"unknown --layer {args.layer!r}; one of {', '.join(shapes)}")
    n, k = shapes[args.layer]
    m = args.m
    if args.configs:
        configs = args.configs.split(",")
    else:
        configs = table.config_names(m)
    unknown = set(configs) - set(table.config_names())
    if unknown:
        raise SystemExit(f"unknown config(s) {sorted(unknown)}; known: {table.config_names()}")
    if not torch.cuda.is_available():
        raise SystemExit("tools.profile_w8a8_gemm: needs a CUDA device")

    a, b = _int8(m, k), _int8(n, k)
    sa, sb = torch.rand(m, device="cuda") * 0.02, torch.rand(n, device="cuda") * 1e-3
    calls = {c: (lambda c=c: qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, config=c)) for c in configs}
    if not args.no_anchors:
        x, w = (
            torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
        )
        a8, b8 = (
            torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn),
            torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn),
        )
        s8a, s8b = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
        calls["bf16 F.linear"] = lambda: F.linear(x, w)
        calls["fp8 row-wise _scaled_mm"] = lambda: torch._scaled_mm(
            a8, b8.t(), scale_a=s8a, scale_b=s8b, out_dtype=torch.bfloat16
        )
    ref = None
    for name, f in calls.items():  # warm up (module load, workspace, cuBLAS handles), check ours
        out = f()
        if name in configs:
            if ref is None:
                ref = out
            elif not torch.equal(out, ref):
                raise SystemExit(f"{name} disagrees with {configs[0]}")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in calls.values():
        f()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{args.layer} M={m} N={n} K={k}: profiled, in order:", ", ".join(calls))


if __name__ == "__main__":
    main()
