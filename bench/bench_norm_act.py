"""Fused RMSNorm(+residual add)+int8 quant and SiLU-and-mul+int8 quant against torch.compile of the
reference (and, for the static-scale SiLU-and-mul, FBGEMM gen_ai's ``silu_mul_quantize_i8`` when
fbgemm-gpu-genai is installed), in one run, at real model sizes.

Reports the time per call (CUDA-graph replay, median, several input sets so that L2 does not
flatter), GB/s of the bytes that must move (each input read once, each output written once), the
fraction of the measured device-to-device copy bandwidth, and the ratio to torch.compile.

Run from the repository root:

    python -m bench.bench_norm_act --out bench/out            # the table, then the variants
    python -m bench.bench_norm_act --out bench/out --sweep    # plus launch-shape sweeps
    python -m bench.bench_norm_act --variants-only            # only the norm variant comparison
    python -m bench.bench_norm_act --float-ops                # only the activation-dtype ops

``--float-ops`` times the ops without the quantizer that the W4A16 layers (and every variant's
RoPE) use: ``fused_add_rms_norm``, ``silu_and_mul`` and ``rotary_embedding`` (q and k of a fused
qkv output, head_dim 128, 4 query heads per KV head), against the PyTorch eager code they replace
in qops.llama and torch.compile of the same reference; writes ``bench_float_ops.csv``.

The norm ops have two kernels (csrc/norm/norm_rowres.cu, norm_pipelined.cu): "rowres" (one row per CTA,
registers only) and
"pipelined" (persistent CTAs streaming rows through a cp.async shared-memory ring); the launcher
picks one by a rule, and ``tuning=qops.NormTuning(variant="rowres"|"pipelined")`` forces either
(per call, so a CUDA graph captures the variant of the calls it records). The variant table times
both (the pipelined kernel also with its ring forced 2 and 3 deep, ``NormTuning.pipe_stages``) at T
in {4096, 16384} and H in {4096, 8192, 576}, prints rowres / pipelined, and names the kernel the
rule picks ("auto"). The sweep forces the launch shapes (``threads_per_row``, ``cluster``) through
``qops.NormTuning`` / ``qops.FusedQuantTuning``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

import qops
from bench.fbgemm_genai import load_fbgemm_genai
from bench.shapes import NORM_ACT_MODELS
from qops.llama.layers import rms_norm_float
from qops.quantization import absmax_scale, quantize_int8
from qops.rope import rotate
from qops.testing import (
    bar_plot,
    bench_us,
    copy_bandwidth_gbps,
    gbps,
    l2_rotation_sets,
    print_table,
    require_cuda,
    write_csv,
)

TOKENS = [1, 16, 128, 4096, 16384]
MODELS = NORM_ACT_MODELS  # name: (hidden H, intermediate I)
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


def _tuning(op, variant="auto", tpr=0, cluster=0, stages=0):
    """The launch options of one op's calls: qops.FusedQuantTuning for SiLU-and-mul (one kernel),
    qops.NormTuning for the norms; "auto" / 0 = the kernel's own choice."""
    if op.startswith("silu"):
        return qops.FusedQuantTuning(threads_per_row=tpr, cluster=cluster)
    return qops.NormTuning(variant=variant, pipe_stages=stages, threads_per_row=tpr, cluster=cluster)


def bench_case(op, T, H, dtype, compiled=None, replays=50, tuning=None):
    """Returns (us, compile_us or None, bytes moved). ``tuning``: the qops calls' launch options
    (see _tuning; None: the defaults)."""
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
            return lambda: qops.silu_and_mul_quant(xs[i], s, tuning=tuning)
        if op.startswith("add"):
            return lambda: qops.fused_add_rms_norm_quant(xs[i], rs[i], w, EPS, s, tuning=tuning)
        return lambda: qops.rms_norm_quant(xs[i], w, EPS, s, tuning=tuning)

    us = bench_us(mk, n_sets, replays=replays)
    fus = math.nan
    if op == "silu_static" and not load_fbgemm_genai() and hasattr(torch.ops.fbgemm, "silu_mul_quantize_i8"):
        # FBGEMM gen_ai's static-scale SiLU-and-mul + int8 (gate and up as separate tensors)
        gs = [x[..., :H].contiguous() for x in xs]
        us_ = [x[..., H:].contiguous() for x in xs]
        fus = bench_us(
            lambda i: lambda: torch.ops.fbgemm.silu_mul_quantize_i8(gs[i], us_[i], 0.05), n_sets, replays=replays
        )
    cus = None
    if compiled is not None:
        if op.startswith("silu"):
            cus = bench_us(lambda i: lambda: compiled(xs[i]), n_sets, replays=replays)
        else:
            cus = bench_us(lambda i: lambda: compiled(xs[i], rs[i], w), n_sets, replays=replays)
    xs.clear()  # drop the tensors (the closures above hold the list)
    return us, cus, moved, fus


def table(args, dtype, copy):
    c_norm = torch.compile(_add_norm_dyn, dynamic=False)
    c_silu = torch.compile(_silu_dyn, dynamic=False)
    rows = []
    ops = [
        ("add_norm_dyn", c_norm),
        ("norm_dyn", None),
        ("add_norm_static", None),
        ("silu_dyn", c_silu),
        ("silu_static", None),
    ]
    for model, (H, I) in MODELS.items():
        for T in TOKENS:
            for op, comp in ops:
                if args.no_compile:
                    comp = None
                size = I if op.startswith("silu") else H
                us, cus, moved, fus = bench_case(op, T, size, dtype, comp)
                r = {
                    "op": op,
                    "model": model,
                    "T": T,
                    "size": size,
                    "us": us,
                    "GBps": gbps(moved, us),
                    "frac_copy": gbps(moved, us) / copy,
                    "compile_us": cus if cus is not None else float("nan"),
                    "compile_GBps": gbps(moved, cus) if cus else float("nan"),
                    "vs_compile": (cus / us) if cus else float("nan"),
                    "fbgemm_us": fus,
                    "vs_fbgemm": fus / us,
                    "MB_moved": moved / 1e6,
                }
                rows.append(r)
                print(
                    f"{op:16s} {model:11s} T={T:6d} {size:6d}: {us:9.2f} us {r['GBps']:7.0f} GB/s "
                    f"({r['frac_copy']:.2f} of copy)  compile {r['compile_us']:9.2f} us  x{r['vs_compile']:.2f}",
                    flush=True,
                )
            torch._dynamo.reset()
    return rows


# ---- the activation-dtype ops (no quantizer) ------------------------------------------------------
def _eager_add_norm(x, r, w):
    r.add_(x)
    return rms_norm_float(r, w, EPS)


def _eager_silu(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


def _eager_rope(pos, q, k, cos, sin):
    c, s = cos[pos], sin[pos]
    q.copy_(rotate(q, c, s))
    k.copy_(rotate(k, c, s))


def float_ops_table(args, dtype, copy):
    """qops' activation-dtype ops against PyTorch eager (what qops.llama ran before them) and
    torch.compile of the eager code, at each model's sizes."""
    comp = {
        "add_norm_float": torch.compile(_eager_add_norm, dynamic=False),
        "silu_float": torch.compile(_eager_silu, dynamic=False),
        "rope": torch.compile(_eager_rope, dynamic=False),
    }
    e = dtype.itemsize
    rows = []
    for model, (H, I) in MODELS.items():
        hq = max(1, H // 128)
        hk = max(1, hq // 4)
        cos = torch.randn(8192, 128, device="cuda")
        sin = torch.randn(8192, 128, device="cuda")
        for T in TOKENS:
            for op in ("add_norm_float", "silu_float", "rope"):
                if op == "add_norm_float":
                    per_set, moved = 2 * T * H * e, 4 * T * H * e + H * e
                elif op == "silu_float":
                    per_set, moved = 2 * T * I * e, 3 * T * I * e
                else:
                    per_set = T * (hq + 2 * hk) * 128 * e
                    moved = 2 * T * (hq + hk) * 128 * e + 2 * T * 8 + 4 * T * 128 * 4
                n = l2_rotation_sets(per_set)
                if op == "add_norm_float":
                    xs = [torch.randn(T, H, device="cuda", dtype=dtype) for _ in range(n)]
                    rs = [torch.randn(T, H, device="cuda", dtype=dtype) for _ in range(n)]
                    w = torch.rand(H, device="cuda", dtype=dtype) + 0.5
                    calls = {
                        "qops": lambda i: lambda: qops.fused_add_rms_norm(xs[i], rs[i], w, EPS),
                        "eager": lambda i: lambda: _eager_add_norm(xs[i], rs[i], w),
                        "compile": lambda i: lambda: comp[op](xs[i], rs[i], w),
                    }
                elif op == "silu_float":
                    xs = [torch.randn(T, 2 * I, device="cuda", dtype=dtype) for _ in range(n)]
                    calls = {
                        "qops": lambda i: lambda: qops.silu_and_mul(xs[i]),
                        "eager": lambda i: lambda: _eager_silu(xs[i]),
                        "compile": lambda i: lambda: comp[op](xs[i]),
                    }
                else:
                    qkv = [torch.randn(T, (hq + 2 * hk) * 128, device="cuda", dtype=dtype) for _ in range(n)]
                    qs = [t[:, : hq * 128].view(T, hq, 128) for t in qkv]
                    ks = [t[:, hq * 128 : (hq + hk) * 128].view(T, hk, 128) for t in qkv]
                    pos = torch.randint(0, 8192, (T,), device="cuda")
                    calls = {
                        "qops": lambda i: lambda: qops.rotary_embedding(pos, qs[i], ks[i], cos, sin),
                        "eager": lambda i: lambda: _eager_rope(pos, qs[i], ks[i], cos, sin),
                        "compile": lambda i: lambda: comp[op](pos, qs[i], ks[i], cos, sin),
                    }
                us = {k: bench_us(f, n) for k, f in calls.items() if k != "compile" or not args.no_compile}
                r = {
                    "op": op,
                    "model": model,
                    "T": T,
                    "us": us["qops"],
                    "GBps": gbps(moved, us["qops"]),
                    "frac_copy": gbps(moved, us["qops"]) / copy,
                    "eager_us": us["eager"],
                    "vs_eager": us["eager"] / us["qops"],
                    "compile_us": us.get("compile", float("nan")),
                    "vs_compile": us.get("compile", float("nan")) / us["qops"],
                }
                rows.append(r)
                print(
                    f"{op:15s} {model:11s} T={T:6d}: {r['us']:8.2f} us ({r['frac_copy']:.2f} of copy)  "
                    f"eager {r['eager_us']:8.2f} x{r['vs_eager']:.2f}  compile {r['compile_us']:8.2f} "
                    f"x{r['vs_compile']:.2f}",
                    flush=True,
                )
            torch._dynamo.reset()
    return rows


def _shape_grid(op, T):
    """(variant, tpr, cluster, stages) launch options swept for one case; "auto" / 0 (the kernel's
    own choice) first."""
    grid = [("auto", 0, 0, 0)]
    rowres = "rowres" if not op.startswith("silu") else "auto"  # silu has one kernel
    for tpr in (0, 128, 256, 512, 1024):
        for cl in (0, 1, 2, 4, 8):
            if tpr and cl and T >= 4096 and cl > 2:
                continue
            if rowres == "auto" and tpr == 0 and cl == 0:
                continue  # already the auto entry
            grid.append((rowres, tpr, cl, 0))
    if not op.startswith("silu"):
        for tpr in (0, 64, 128, 256):
            for stages in (2, 3):
                grid.append(("pipelined", tpr, 0, stages))
    return grid


def sweep(args, dtype, copy):
    """Launch-shape sweep at the target shapes: threads_per_row / cluster (0 = auto) for the
    row-resident kernels, threads_per_row / pipe_stages for the pipelined norm kernel."""
    cases = [
        ("add_norm_dyn", 4096, 4096),
        ("norm_dyn", 4096, 4096),
        ("add_norm_dyn", 16384, 4096),
        ("add_norm_dyn", 4096, 8192),
        ("norm_dyn", 16384, 8192),
        ("add_norm_dyn", 16384, 576),
        ("silu_dyn", 4096, 14336),
        ("silu_dyn", 4096, 11008),
        ("silu_dyn", 4096, 28672),
        ("silu_dyn", 16384, 1536),
        ("silu_static", 4096, 14336),
        ("add_norm_dyn", 16, 4096),
        ("add_norm_dyn", 16, 8192),
        ("silu_dyn", 16, 14336),
        ("silu_dyn", 1, 28672),
        ("silu_dyn", 16, 28672),
    ]
    rows = []
    for op, T, size in cases:
        best = None
        auto = None
        for variant, tpr, cl, stages in _shape_grid(op, T):
            try:
                us, _, moved, _ = bench_case(
                    op, T, size, dtype, None, replays=20, tuning=_tuning(op, variant, tpr, cl, stages)
                )
            except (RuntimeError, ValueError) as e:  # a shape that does not fit
                print(
                    f"sweep {op} T={T} {size} {variant} tpr={tpr} cluster={cl} stages={stages}: "
                    f"{str(e).splitlines()[0][:80]}"
                )
                continue
            r = {
                "op": op,
                "T": T,
                "size": size,
                "variant": variant,
                "tpr": tpr,
                "cluster": cl,
                "stages": stages,
                "us": us,
                "GBps": gbps(moved, us),
                "frac_copy": gbps(moved, us) / copy,
            }
            rows.append(r)
            if variant == "auto" and tpr == 0 and cl == 0:
                auto = r
            if best is None or us < best["us"]:
                best = r
        if best is None:
            continue
        print(
            f"sweep best {op} T={T} {size}: {best['variant']} tpr={best['tpr']} cluster={best['cluster']} "
            f"stages={best['stages']} {best['us']:.2f} us {best['GBps']:.0f} GB/s; "
            f"auto {auto['us'] if auto else float('nan'):.2f} us",
            flush=True,
        )
    write_csv(rows, os.path.join(args.out, "bench_norm_act_sweep.csv"))
    return rows


# ---- the two norm kernels side by side ----------------------------------------------------------
VARIANT_TOKENS = [4096, 16384]
VARIANT_HIDDEN = [4096, 8192, 576]
VARIANT_OPS = ["norm_dyn", "add_norm_dyn", "norm_static", "add_norm_static"]


def _auto_kernel(op, T, H, dtype):
    """Which kernel the launcher's rule runs for this case ("pipelined" / "rowres"), from the kernel
    name torch.profiler records; "?" when it records none."""
    try:
        from torch.profiler import ProfilerActivity, profile

        x = torch.randn(T, H, device="cuda", dtype=dtype)
        r = torch.randn(T, H, device="cuda", dtype=dtype)
        w = torch.rand(H, device="cuda", dtype=dtype) + 0.5
        s = None if op.endswith("dyn") else torch.tensor([0.05], device="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if op.startswith("add"):
                qops.fused_add_rms_norm_quant(x, r, w, EPS, s)
            else:
                qops.rms_norm_quant(x, w, EPS, s)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "norm_quant" in e.name]
    except Exception:
        return "?"
    if not names:
        return "?"
    return "pipelined" if "pipe_kernel" in names[0] else "rowres"


def variants(args, dtype, copy):
    """Both norm kernels (forced with NormTuning.variant) at the many-row shapes; ratio = rowres time /
    pipelined time (> 1: pipelined is faster)."""
    rows = []
    for H in VARIANT_HIDDEN:
        for T in VARIANT_TOKENS:
            for op in VARIANT_OPS:
                r = {"op": op, "T": T, "H": H}
                for name, variant, stages in (
                    ("rowres", "rowres", 0),
                    ("pipelined", "pipelined", 0),
                    ("pipelined_s2", "pipelined", 2),
                    ("pipelined_s3", "pipelined", 3),
                ):
                    us, _, moved, _ = bench_case(op, T, H, dtype, None, tuning=_tuning(op, variant, stages=stages))
                    r[f"{name}_us"] = us
                    r[f"{name}_frac"] = gbps(moved, us) / copy
                r["ratio"] = r["rowres_us"] / r["pipelined_us"]
                r["auto"] = _auto_kernel(op, T, H, dtype)
                rows.append(r)
                print(
                    f"variants {op:16s} T={T:6d} H={H:5d}: rowres {r['rowres_us']:8.2f} us "
                    f"({r['rowres_frac']:.2f} of copy)  pipelined {r['pipelined_us']:8.2f} us "
                    f"({r['pipelined_frac']:.2f}; ring 2: {r['pipelined_s2_us']:.2f}, ring 3: "
                    f"{r['pipelined_s3_us']:.2f})  rowres/pipelined x{r['ratio']:.2f}  auto={r['auto']}",
                    flush=True,
                )
    write_csv(rows, os.path.join(args.out, "bench_norm_act_variants.csv"))
    print(f"norm kernel variants ({args.dtype}), copy bandwidth {copy:.0f} GB/s; ratio = rowres us / pipelined us")
    print_table(
        rows,
        [
            "op",
            "T",
            "H",
            "rowres_us",
            "rowres_frac",
            "pipelined_us",
            "pipelined_frac",
            "pipelined_s2_us",
            "pipelined_s3_us",
            "ratio",
            "auto",
        ],
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--sweep", action="store_true", help="also sweep the launch shapes")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile anchors")
    p.add_argument("--no-variants", action="store_true", help="skip the rowres / pipelined norm comparison")
    p.add_argument("--variants-only", action="store_true", help="run only the rowres / pipelined norm comparison")
    p.add_argument(
        "--float-ops", action="store_true", help="run only the activation-dtype ops (rms_norm, silu_and_mul, rope)"
    )
    args = p.parse_args()
    require_cuda("bench.bench_norm_act")
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy:.0f} GB/s", flush=True)
    if args.variants_only:
        variants(args, dtype, copy)
        return
    if args.float_ops:
        rows = float_ops_table(args, dtype, copy)
        write_csv(rows, os.path.join(args.out, "bench_float_ops.csv"))
        print_table(rows, ["op", "model", "T", "us", "frac_copy", "eager_us", "vs_eager", "compile_us", "vs_compile"])
        return
    if args.sweep:
        sweep(args, dtype, copy)
    rows = table(args, dtype, copy)
    write_csv(rows, os.path.join(args.out, "bench_norm_act.csv"))
    for r in rows:
        r["shape"] = f"{r['op']} {r['model']} T{r['T']}"
    big = [r for r in rows if r["T"] >= 4096 and r["op"] in ("add_norm_dyn", "silu_dyn")]
    bar_plot(
        big,
        "shape",
        ["GBps", "compile_GBps"],
        f"norm/act + int8 quant ({args.dtype}), copy = {copy:.0f} GB/s",
        "GB/s moved",
        os.path.join(args.out, "bench_norm_act.png"),
    )
    print(f"copy bandwidth {copy:.0f} GB/s; dtype {args.dtype}")
    print_table(
        rows,
        ["op", "model", "T", "size", "us", "GBps", "frac_copy", "compile_us", "vs_compile", "fbgemm_us", "vs_fbgemm"],
    )
    if not args.no_variants:
        variants(args, dtype, copy)


if __name__ == "__main__":
    sys.exit(main())
