"""Fused RMSNorm(+residual add)+int8 quant and SiLU-and-mul+int8 quant against torch.compile of the
reference, in one run, at real model sizes.

Reports the time per call (CUDA-graph replay, median, several input sets so that L2 does not
flatter), GB/s of the bytes that must move (each input read once, each output written once), the
fraction of the measured device-to-device copy bandwidth, and the ratio to torch.compile.

    python bench/bench_norm_act.py --out bench/out            # the table
    python bench/bench_norm_act.py --out bench/out --sweep    # plus launch-shape sweeps
"""
from __future__ import annotations

import argparse
import os

import torch

import qops
from qops.bench_utils import bar_plot, bench_us, copy_bandwidth_gbps, gbps, l2_rotation_sets, print_table, write_csv
from qops.quantization import absmax_scale, quantize_int8

TOKENS = [1, 16, 128, 4096, 16384]
MODELS = {  # name: (hidden H, intermediate I)
    "llama2-7b": (4096, 11008),
    "llama3-8b": (4096, 14336),
    "llama2-70b": (8192, 28672),
    "smollm2": (576, 1536),
}
EPS = 1e-5


# ---- the anchors: torch.compile of the reference math ---------------------------------------
def _add_norm_dyn(x, r, w):
    z = (x.float() + r.float()).to(x.dtype)
    r.copy_(z)
    zf = z.float()
    y = zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
    s = absmax_scale(y, -1)
    return quantize_int8(y, s.unsqueeze(-1)), s


def _silu_dyn(x):
    i = x.shape[-1] // 2
    g, u = x[..., :i].float(), x[..., i:].float()
    y = g / (1.0 + torch.exp(-g)) * u
    s = absmax_scale(y, -1)
    return quantize_int8(y, s.unsqueeze(-1)), s


def _env(tpr=None, cluster=None):
    for k, v in (("QOPS_FQ_TPR", tpr), ("QOPS_FQ_CLUSTER", cluster)):
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)


def bench_case(op, T, H, dtype, compiled=None, replays=50):
    """Returns (us, compile_us or None, bytes moved)."""
    e = dtype.itemsize
    if op.startswith("silu"):
        per_set = T * 2 * H * e
        moved = T * 2 * H * e + T * H + (4 * T if op.endswith("dyn") else 4)
    else:
        res = op.startswith("add")
        per_set = T * H * e * (2 if res else 1)
        moved = T * H * e * (3 if res else 1) + T * H + H * e + (4 * T if op.endswith("dyn") else 4)
    n_sets = l2_rotation_sets(per_set)
    if op.startswith("silu"):
        xs = [torch.randn(T, 2 * H, device="cuda", dtype=dtype) * 2 for _ in range(n_sets)]
    else:
        xs = [torch.randn(T, H, device="cuda", dtype=dtype) for _ in range(n_sets)]
        rs = [torch.randn(T, H, device="cuda", dtype=dtype) for _ in range(n_sets)]
        w = torch.rand(H, device="cuda", dtype=dtype) + 0.5
    scale = torch.tensor([0.05], device="cuda")
    s = None if op.endswith("dyn") else scale

    def mk(i):
        if op.startswith("silu"):
            return lambda: qops.silu_and_mul_quant(xs[i], s)
        if op.startswith("add"):
            return lambda: qops.fused_add_rms_norm_quant(xs[i], rs[i], w, EPS, s)
        return lambda: qops.rms_norm_quant(xs[i], w, EPS, s)

    us = bench_us(mk, n_sets, replays=replays)
    cus = None
    if compiled is not None:
        if op.startswith("silu"):
            cus = bench_us(lambda i: (lambda: compiled(xs[i])), n_sets, replays=replays)
        else:
            cus = bench_us(lambda i: (lambda: compiled(xs[i], rs[i], w)), n_sets, replays=replays)
    del xs
    return us, cus, moved


def table(args, dtype, copy):
    c_norm = torch.compile(_add_norm_dyn, dynamic=False)
    c_silu = torch.compile(_silu_dyn, dynamic=False)
    rows = []
    ops = [("add_norm_dyn", c_norm), ("norm_dyn", None), ("add_norm_static", None),
           ("silu_dyn", c_silu), ("silu_static", None)]
    for model, (H, I) in MODELS.items():
        for T in TOKENS:
            for op, comp in ops:
                if args.no_compile:
                    comp = None
                size = I if op.startswith("silu") else H
                us, cus, moved = bench_case(op, T, size, dtype, comp)
                r = {"op": op, "model": model, "T": T, "size": size, "us": us, "GBps": gbps(moved, us),
                     "frac_copy": gbps(moved, us) / copy,
                     "compile_us": cus if cus is not None else float("nan"),
                     "compile_GBps": gbps(moved, cus) if cus else float("nan"),
                     "vs_compile": (cus / us) if cus else float("nan"), "MB_moved": moved / 1e6}
                rows.append(r)
                print(f"{op:16s} {model:11s} T={T:6d} {size:6d}: {us:9.2f} us {r['GBps']:7.0f} GB/s "
                      f"({r['frac_copy']:.2f} of copy)  compile {r['compile_us']:9.2f} us  x{r['vs_compile']:.2f}",
                      flush=True)
            torch._dynamo.reset()
    return rows


def sweep(args, dtype, copy):
    """Launch-shape sweep at the target shapes (QOPS_FQ_TPR / QOPS_FQ_CLUSTER; 0 = auto)."""
    cases = [("add_norm_dyn", 4096, 4096), ("norm_dyn", 4096, 4096), ("add_norm_dyn", 16384, 4096),
             ("add_norm_dyn", 4096, 8192), ("norm_dyn", 16384, 8192), ("add_norm_dyn", 16384, 576),
             ("silu_dyn", 4096, 14336), ("silu_dyn", 4096, 11008), ("silu_dyn", 4096, 28672),
             ("silu_dyn", 16384, 1536), ("silu_static", 4096, 14336),
             ("add_norm_dyn", 16, 4096), ("add_norm_dyn", 16, 8192), ("silu_dyn", 16, 14336),
             ("silu_dyn", 1, 28672), ("silu_dyn", 16, 28672)]
    rows = []
    for op, T, size in cases:
        best = None
        for tpr in (0, 128, 256, 512, 1024):
            for cl in (0, 1, 2, 4, 8):
                if tpr and cl and T >= 4096 and cl > 2:
                    continue
                _env(tpr or None, cl or None)
                try:
                    us, _, moved = bench_case(op, T, size, dtype, None, replays=20)
                except (RuntimeError, ValueError) as e:  # a shape that does not fit
                    print(f"sweep {op} T={T} {size} tpr={tpr} cluster={cl}: {str(e).splitlines()[0][:80]}")
                    continue
                r = {"op": op, "T": T, "size": size, "tpr": tpr, "cluster": cl, "us": us,
                     "GBps": gbps(moved, us), "frac_copy": gbps(moved, us) / copy}
                rows.append(r)
                if best is None or us < best["us"]:
                    best = r
        _env()
        print(f"sweep best {op} T={T} {size}: tpr={best['tpr']} cluster={best['cluster']} {best['us']:.2f} us "
              f"{best['GBps']:.0f} GB/s; auto {[r for r in rows if r['op'] == op and r['T'] == T and r['size'] == size and r['tpr'] == 0 and r['cluster'] == 0][0]['us']:.2f} us",
              flush=True)
    write_csv(rows, os.path.join(args.out, "bench_norm_act_sweep.csv"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--sweep", action="store_true", help="also sweep the launch shapes")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchors")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy:.0f} GB/s", flush=True)
    if args.sweep:
        sweep(args, dtype, copy)
    rows = table(args, dtype, copy)
    write_csv(rows, os.path.join(args.out, "bench_norm_act.csv"))
    for r in rows:
        r["shape"] = f"{r['op']} {r['model']} T{r['T']}"
    big = [r for r in rows if r["T"] >= 4096 and r["op"] in ("add_norm_dyn", "silu_dyn")]
    bar_plot(big, "shape", ["GBps", "compile_GBps"], f"norm/act + int8 quant ({args.dtype}), copy = {copy:.0f} GB/s",
             "GB/s moved", os.path.join(args.out, "bench_norm_act.png"))
    print(f"copy bandwidth {copy:.0f} GB/s; dtype {args.dtype}")
    print_table(rows, ["op", "model", "T", "size", "us", "GBps", "frac_copy", "compile_us", "vs_compile"])


if __name__ == "__main__":
    main()
