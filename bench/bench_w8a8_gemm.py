"""w8a8_gemm (per-token x per-channel, bf16 out) against its anchors, in one run, at Llama layer shapes.

Anchors: bf16 ``F.linear`` (cuBLAS), ``torch._int_mm`` + eager dequant (cuBLASLt int8; M > 16 only),
fp8 ``torch._scaled_mm`` with row-wise scales (cuBLASLt), and FBGEMM gen_ai's ``i8i8bf16`` (the peer
library's int8 GEMM, one per-tensor scale; fbgemm-gpu-genai, skipped when absent). Reports TOP/s
(2MNK per call), GB/s of the bytes that must move (operands, scales, output) and each anchor's
time over ours (> 1: we are faster). ``--sweep`` also times every generated tile config, to tune ``SELECTION`` in
cutlass_kernels/w8a8_configs.py. ``--epilogues`` compares the epilogues against each other: per-tensor
vs per-token x per-channel vs per-token x per-channel + bias, and fp16 vs bf16 out (the per-token
epilogue's cost over per-tensor at large M is a target: <= 3%). Decode rows (M <= 16) also
report the moved bytes as a fraction of the measured copy bandwidth (target: >= 0.8), for the
plain call and for ``overlap_prologue=True`` (as the quantized Llama calls it: the GEMV requests its
first weights before its PDL wait), the two timed interleaved.
``--gemv-shapes`` times the decode GEMV at every launch shape it has (rows of N x warps per CTA x
K chunks per batch, forced with ``tuning=qops.GemvTuning(shape=...)``) and without programmatic
dependent launch (``enable_pdl=False``), beside its own choice and the best CUTLASS config, to tune
``gemv_shape``. The layer shapes are bench/shapes.py's ``GEMM_LAYERS``.

Run from the repository root:

    python -m bench.bench_w8a8_gemm --out bench/out [--sweep] [--epilogues] [--gemv-shapes] [--quick]
        [--layers 8B.o,70B-tp8.qkv] [--tokens 1,17,300,1000] [--no-anchors] [--uniform-int8]
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
from bench.shapes import GEMM_LAYERS
from cutlass_kernels import w8a8_configs as table
from qops.testing import (
    bench_interleaved_us,
    bench_us,
    copy_bandwidth_gbps,
    l2_rotation_sets,
    line_grid_plot,
    print_table,
    require_cuda,
    write_csv,
)

TOKENS = [1, 16, 64, 128, 256, 1024, 4096, 8192]
EPILOGUE_TOKENS = [16, 1024, 4096, 8192]
QUICK_LAYERS, QUICK_TOKENS = ["8B.o", "8B.gate_up", "8B.down"], [1, 16, 128, 4096]
OUT = torch.bfloat16


UNIFORM_INT8 = False  # --uniform-int8


def _int8(*shape):
    """int8 operands as a W8A8 model has them: Gaussian values quantized row-wise by absmax (the
    anchors get the same Gaussians). With --uniform-int8: uniform over [-128, 127], the worst case
    for power draw (tensor-core throughput on H100 depends on the operands' bit activity)."""
    if UNIFORM_INT8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")
    x = torch.randn(shape, device="cuda")
    return (x * (127.0 / x.abs().amax(-1, keepdim=True))).round_().to(torch.int8)


def time_ours(m, n, k, config="auto", *, enable_pdl=None, tuning=None):
    """Microseconds per call of one config (by default the one auto picks): `time_configs` with
    one variant (interleaving one graph with nothing is `bench_us`'s timing)."""
    return time_configs(m, n, k, [config], enable_pdl=enable_pdl, tuning=tuning)[config]


def time_configs(m, n, k, configs, *, enable_pdl=None, tuning=None) -> dict:
    """Microseconds per call of each config (or "auto") on the same inputs, timed interleaved
    (`bench_interleaved_us`): configs timed one after the other drift apart with the GPU's clock
    and power state, by 10-15% on the largest shapes (8B.gate_up at M = 5000: the same tile
    count timed 922 and 1056 us in two sequential sweeps), more than the differences a pick
    between configs is made on. ``enable_pdl``, ``tuning`` (a qops.GemvTuning): every call's
    launch options (None: the defaults)."""
    n_sets = l2_rotation_sets(m * k + n * k + 2 * m * n)
    sets = [
        (_int8(m, k), _int8(n, k), torch.rand(m, device="cuda") * 0.02, torch.rand(n, device="cuda") * 1e-3)
        for _ in range(n_sets)
    ]

    def maker(config):
        name, _, flag = config.partition("/")  # "auto/overlap": overlap_prologue=True

        def make(i):
            a, b, sa, sb = sets[i]
            return lambda: qops.w8a8_gemm(
                a, b, sa, sb, OUT, config=name, overlap_prologue=flag == "overlap", enable_pdl=enable_pdl, tuning=tuning
            )

        return make

    return bench_interleaved_us({c: maker(c) for c in configs}, n_sets)


EPILOGUES = {  # name -> (per-tensor scales, bias, out dtype)
    "tensor_bf16": (True, False, torch.bfloat16),
    "token_bf16": (False, False, torch.bfloat16),
    "token_bias_bf16": (False, True, torch.bfloat16),
    "token_fp16": (False, False, torch.float16),
    "tensor_bias_fp16": (True, True, torch.float16),
}


def time_epilogues(m, n, k) -> dict:
    """Every epilogue variant of w8a8_gemm (auto config) on the same int8 operands, timed
    interleaved (`bench_interleaved_us`): scales [1] x [1] or [M] x [N], optional bias."""
    n_sets = l2_rotation_sets(m * k + n * k + 2 * m * n)
    sets = []
    for _ in range(n_sets):
        sets.append(
            dict(
                a=_int8(m, k),
                b=_int8(n, k),
                sa={True: torch.rand(1, device="cuda") * 0.02, False: torch.rand(m, device="cuda") * 0.02},
                sb={True: torch.rand(1, device="cuda") * 1e-3, False: torch.rand(n, device="cuda") * 1e-3},
                bias={dt: torch.randn(n, device="cuda", dtype=dt) for dt in (torch.float16, torch.bfloat16)},
            )
        )

    def maker(per_tensor, bias, out_dtype):
        def make(i):
            s = sets[i]
            bb = s["bias"][out_dtype] if bias else None
            return lambda: qops.w8a8_gemm(s["a"], s["b"], s["sa"][per_tensor], s["sb"][per_tensor], out_dtype, bb)

        return make

    return bench_interleaved_us({name: maker(*v) for name, v in EPILOGUES.items()}, n_sets)


def run_epilogues(layers, tokens, out_dir) -> None:
    """Epilogue variants against each other; ratios are each variant's time over per-tensor's.
    The variants share their operands and are timed interleaved, replay by replay, so that the
    GPU's clock and temperature drift (a large int8 GEMM throttles within milliseconds) does not
    masquerade as an epilogue cost."""
    rows = []
    for layer, n, k in layers:
        for m in tokens:
            us = time_epilogues(m, n, k)
            r = {"layer": layer, "M": m, "N": n, "K": k}
            r.update({f"{name}_us": t for name, t in us.items()})
            r["token_over_tensor"] = us["token_bf16"] / us["tensor_bf16"]
            r["bias_over_token"] = us["token_bias_bf16"] / us["token_bf16"]
            r["fp16_over_bf16"] = us["token_fp16"] / us["token_bf16"]
            rows.append(r)
            print(
                f"{layer:16s} M={m:5d}: per-tensor {us['tensor_bf16']:8.1f} us, per-token x per-channel "
                f"{us['token_bf16']:8.1f} us ({r['token_over_tensor']:.3f}x)",
                flush=True,
            )
    write_csv(rows, os.path.join(out_dir, "bench_w8a8_epilogues.csv"))
    print("\n== epilogues (us per call; ratios > 1: the variant is slower)")
    print_table(
        rows, ["layer", "M", *[f"{n}_us" for n in EPILOGUES], "token_over_tensor", "bias_over_token", "fp16_over_bf16"]
    )


def time_linear(m, n, k):
    n_sets = l2_rotation_sets(2 * (m * k + n * k + m * n))

    def make(i):
        x, w = torch.randn(m, k, device="cuda", dtype=OUT), torch.randn(n, k, device="cuda", dtype=OUT)
        return lambda: F.linear(x, w)

    return bench_us(make, n_sets)


def time_int_mm(m, n, k):
    if m <= 16:  # torch._int_mm needs M > 16
        return math.nan
    n_sets = l2_rotation_sets(m * k + n * k + 6 * m * n)

    def make(i):
        a, b = _int8(m, k), _int8(n, k)
        sa, sb = torch.rand(m, 1, device="cuda") * 0.02, torch.rand(1, n, device="cuda") * 1e-3
        return lambda: (torch._int_mm(a, b.t()) * sa * sb).to(OUT)

    return bench_us(make, n_sets)


def time_fp8(m, n, k):
    n_sets = l2_rotation_sets(m * k + n * k + 2 * m * n)

    def make(i):
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        sa, sb = torch.rand(m, 1, device="cuda"), torch.rand(1, n, device="cuda")
        return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=OUT)

    try:
        return bench_us(make, n_sets)
    except RuntimeError as e:  # row-wise fp8 unsupported for this shape or build
        print(f"fp8 anchor skipped at {m}x{n}x{k}: {str(e).splitlines()[0]}")
        return math.nan


def time_fbgemm(m, n, k):
    """FBGEMM gen_ai's ``i8i8bf16`` (int8 x int8, one per-tensor scale, bf16 out): the peer library's
    W8A8 GEMM (a simpler epilogue than ours); NaN with a note when the library is not there."""
    why = load_fbgemm_genai() or ("" if hasattr(torch.ops.fbgemm, "i8i8bf16") else "no torch.ops.fbgemm.i8i8bf16")
    if why:
        print(f"fbgemm anchor skipped: {why}")
        return math.nan
    n_sets = l2_rotation_sets(m * k + n * k + 2 * m * n)

    def make(i):
        a, b = _int8(m, k), _int8(n, k)
        return lambda: torch.ops.fbgemm.i8i8bf16(a, b, 1e-4, 1)

    return bench_us(make, n_sets)


# The built launch shapes (w8a8_configs.GEMV_SHAPES): rows of N, warps, K chunks per batch.
GEMV_SHAPES = table.gemv_launch_shapes()
GEMV_SHAPE_NAMES = [f"r{r}w{w}c{c}" for r, w, c in GEMV_SHAPES]


def run_gemv_shapes(layers, tokens, out_dir, copy_gbps: float) -> None:
    """The decode GEMV at every launch shape (GemvTuning.shape), its own choice (also without PDL)
    and the best CUTLASS tile config, per layer and decode M."""
    rows = []
    cutlass = [c.name for c in table.CONFIGS]
    for layer, n, k in layers:
        for m in [t for t in tokens if t <= table.config_max_m("gemv")]:
            moved = m * k + n * k + 2 * m * n + 4 * (m + n)
            r = {"layer": layer, "M": m, "N": n, "K": k, "gemv_us": time_ours(m, n, k, "gemv")}
            r["no_pdl_us"] = time_ours(m, n, k, "gemv", enable_pdl=False)
            for shape, name in zip(GEMV_SHAPES, GEMV_SHAPE_NAMES):
                r[name] = time_ours(m, n, k, "gemv", tuning=qops.GemvTuning(shape=shape))
            shapes = {name: r[name] for name in GEMV_SHAPE_NAMES}
            r["best_shape"] = min(shapes, key=shapes.get)
            r["gemv_over_best_shape"] = r["gemv_us"] / shapes[r["best_shape"]]
            times = {c: time_ours(m, n, k, c) for c in cutlass}
            r["best_cutlass"] = min(times, key=times.get)
            r["best_cutlass_us"] = times[r["best_cutlass"]]
            r["vs_best_cutlass"] = r["best_cutlass_us"] / r["gemv_us"]
            r["of_copy"] = moved / r["gemv_us"] * 1e-3 / copy_gbps
            rows.append(r)
            print(
                f"{layer:16s} M={m:3d}: gemv {r['gemv_us']:6.1f} us ({r['of_copy']:.2f} of copy), best shape "
                f"{r['best_shape']} {shapes[r['best_shape']]:6.1f} us, best CUTLASS {r['best_cutlass_us']:6.1f} us",
                flush=True,
            )
    write_csv(rows, os.path.join(out_dir, "bench_w8a8_gemv_shapes.csv"))
    print(
        f"\n== decode GEMV launch shapes (us per call; rRwWcC = R rows of N and W warps per CTA, C chunks "
        f"per load batch; "
        f"copy {copy_gbps:.0f} GB/s)"
    )
    print_table(
        rows,
        [
            "layer",
            "M",
            "gemv_us",
            "no_pdl_us",
            *GEMV_SHAPE_NAMES,
            "best_shape",
            "gemv_over_best_shape",
            "best_cutlass_us",
            "vs_best_cutlass",
            "of_copy",
        ],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sweep", action="store_true", help="also time every generated tile config")
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--epilogues", action="store_true", help="also compare the epilogue variants")
    p.add_argument("--layers", help="comma-separated layer names (default: all; see bench/shapes.py GEMM_LAYERS)")
    p.add_argument("--tokens", help="comma-separated M values (default: {})".format(",".join(map(str, TOKENS))))
    p.add_argument("--no-anchors", action="store_true", help="time only our kernels (with --sweep: tuning)")
    p.add_argument("--uniform-int8", action="store_true", help="uniform random int8 operands (worst-case power)")
    p.add_argument("--gemv-shapes", action="store_true", help="also time the decode GEMV at every launch shape")
    args = p.parse_args()
    global UNIFORM_INT8
    UNIFORM_INT8 = args.uniform_int8
    layers = [l for l in GEMM_LAYERS if not args.quick or l[0] in QUICK_LAYERS]
    if args.layers:
        known = {l[0] for l in GEMM_LAYERS}
        wanted = args.layers.split(",")
        unknown = sorted(set(wanted) - known)
        if unknown:
            p.error(f"unknown layers {unknown}; known: {sorted(known)}")
        layers = [l for l in GEMM_LAYERS if l[0] in wanted]
    require_cuda("bench.bench_w8a8_gemm")
    os.makedirs(args.out, exist_ok=True)
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"device: {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, out dtype {OUT}, "
        f"int8 operands {'uniform' if UNIFORM_INT8 else 'quantized Gaussians'}"
    )
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth (1 GiB device-to-device): {copy_gbps:.0f} GB/s", flush=True)

    rows, sweep = [], []
    for layer, n, k in layers:
        for m in tokens:
            ops = 2.0 * m * n * k
            moved = m * k + n * k + 2 * m * n + 4 * (m + n)
            # decode: also as the Llama calls it (overlap_prologue: the previous kernel does not
            # write the weights; here that is the previous call, which writes only its output)
            ov = time_configs(m, n, k, ["auto", "auto/overlap"]) if m <= 16 else {}
            us = ov.get("auto") or time_ours(m, n, k)
            if args.no_anchors:
                base = dict.fromkeys(("linear_bf16", "int_mm_dequant", "fp8_rowwise", "fbgemm_i8i8bf16"), math.nan)
            else:
                base = {
                    "linear_bf16": time_linear(m, n, k),
                    "int_mm_dequant": time_int_mm(m, n, k),
                    "fp8_rowwise": time_fp8(m, n, k),
                    "fbgemm_i8i8bf16": time_fbgemm(m, n, k),
                }
            r = {
                "layer": layer,
                "M": m,
                "N": n,
                "K": k,
                "config": table.select_config(m, n, k, sms),
                "us": us,
                "TOPs": ops / us * 1e-6,
                "GBps": moved / us * 1e-3,
                "of_copy": moved / us * 1e-3 / copy_gbps if m <= 16 else math.nan,
                "overlap_us": ov.get("auto/overlap", math.nan),
                "overlap_of_copy": moved / ov["auto/overlap"] * 1e-3 / copy_gbps if ov else math.nan,
            }
            for name, t in base.items():
                r[f"{name}_us"] = t
                r[f"{name}_TOPs"] = ops / t * 1e-6
                r[f"vs_{name}"] = t / us
            rows.append(r)
            if args.sweep:
                times = time_configs(m, n, k, ["auto"] + table.config_names(m))  # auto beside them
                auto_us = times.pop("auto")
                best = min(times, key=times.get)
                sweep.append(
                    {
                        "layer": layer,
                        "M": m,
                        "N": n,
                        "K": k,
                        **{f"{c}_us": t for c, t in times.items()},
                        "best": best,
                        "best_us": times[best],
                        "auto": r["config"],
                        "auto_over_best": auto_us / times[best],
                    }
                )
            ov_txt = f"overlapped {r['overlap_us']:.1f} us ({r['overlap_of_copy']:.2f} of copy)  " if ov else ""
            print(
                f"{layer:16s} M={m:5d}: {us:8.1f} us {r['TOPs']:7.1f} TOP/s {r['GBps']:6.0f} GB/s  "
                + ov_txt
                + "  ".join(f"{k_}={v:.2f}" for k_, v in r.items() if k_.startswith("vs_")),
                flush=True,
            )

    write_csv(rows, os.path.join(args.out, "bench_w8a8_gemm.csv"))
    line_grid_plot(
        rows,
        "layer",
        "M",
        ["TOPs", "linear_bf16_TOPs", "int_mm_dequant_TOPs", "fp8_rowwise_TOPs", "fbgemm_i8i8bf16_TOPs"],
        f"w8a8_gemm (bf16 out) vs anchors, {torch.cuda.get_device_name()}",
        "TOP/s (2MNK / time)",
        os.path.join(args.out, "bench_w8a8_gemm.png"),
    )
    if sweep:
        write_csv(sweep, os.path.join(args.out, "bench_w8a8_sweep.csv"))
        print("\n== tile config sweep (us per call)")
        short = {c: c.split("_c")[0] + "/" + c.split("_")[-1][:4] if "_c" in c else c for c in table.config_names()}
        clash = {v for v in short.values() if list(short.values()).count(v) > 1}
        short = {c: c if v in clash else v for c, v in short.items()}  # configs that differ in the cluster only
        for s in sweep:
            for c in table.config_names():
                s[short[c]] = s.get(f"{c}_us", math.nan)
        print_table(sweep, ["layer", "M"] + list(short.values()) + ["best", "auto_over_best"])
        worst = max(sweep, key=lambda s: s["auto_over_best"])
        print(
            f"auto is within {100 * (worst['auto_over_best'] - 1):.1f}% of the best config at every shape "
            f"(worst: {worst['layer']} M={worst['M']}, auto {worst['auto']}, best {worst['best']})"
        )
    if args.gemv_shapes:
        run_gemv_shapes(layers, tokens, args.out, copy_gbps)
    if args.epilogues:
        run_epilogues(layers, [m for m in EPILOGUE_TOKENS if not args.quick or m in (16, 4096)], args.out)
    print("\n== w8a8_gemm vs anchors (vs_X = X's time / ours)")
    print_table(
        rows,
        [
            "layer",
            "M",
            "config",
            "us",
            "TOPs",
            "GBps",
            "of_copy",
            "overlap_us",
            "overlap_of_copy",
            "linear_bf16_us",
            "vs_linear_bf16",
            "vs_int_mm_dequant",
            "vs_fp8_rowwise",
            "vs_fbgemm_i8i8bf16",
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
