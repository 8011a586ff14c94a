"""w4a16_gemm (int4 weights x bf16/fp16 activations, group-wise scales, optional zeros) against its
anchors, in one run, at the Llama layer shapes (Llama-2-7B, Llama-3-8B, Llama-2-70B at TP 8).

Columns per (layer N x K, M), all on the same int4 weights (one ``quantize_weight_int4`` per input
set, each anchor given them in its own layout):

- ``qops_us``: ``qops.w4a16_gemm`` with ``config="auto"``, weights ``w4a16_prepack``-ed and scales
  (zeros) stored N-major (``qops.w4a16.n_major``), as a model stores them at load time;
  ``qops_<config>_us``: the same with each ``--configs`` name forced (``"gemv"`` or a w4a16 tile
  config of ``cutlass_kernels/w8a8_configs.py``);
- ``cublas_us``: bf16 cuBLAS (fp16 with ``--dtype float16``), ``F.linear(a, W)`` on the dequantized
  weight ``W`` [N, K]: the half-precision model this replaces, and the reference the others are
  checked on;
- ``tinygemm_us``: ``torch.ops.aten._weight_int4pack_mm(a, B, group, scales_and_zeros)`` (torch's
  tinygemm; bf16 only): ``B = _convert_weight_to_int4pack(u, 8)``, ``u`` uint8 [N, K/2] of the
  unsigned values ``q + 8`` with even k in the HIGH nibble, ``scales_and_zeros`` [K/G, N, 2]
  (scale, zero) in bf16; it computes ``(u - 8) * scale + zero``;
- ``fbgemm_rowwise_us`` / ``fbgemm_shuffled_us``: FBGEMM gen_ai's (fbgemm-gpu-genai)
  ``torch.ops.fbgemm.bf16i4bf16_rowwise(x, w, scale, zero)`` and ``bf16i4bf16_shuffled`` (bf16 only):
  ``w`` int8 [N, K/2] in qops' reference nibble order (even k low, two's complement), scale and
  zero [K/G, N] (contiguous, bf16); it computes ``q * scale + zero`` (zeros of 0 in scale-only
  mode). The shuffled op's ``w`` is ``torch.ops.fbgemm.preshuffle_i4(w, scale)[0]`` (which
  reorders ``w`` in place, and returns bf16 scales unchanged).

An anchor that is missing or raises gets NaN in its column, the reason printed once and kept in
the CSV's ``skipped`` column; the run goes on. Every variant's output is also compared with the
cuBLAS one (``<variant>_err``: relative L2 error; above 2% is flagged: a layout mistake).

Metrics: microseconds per call (median of CUDA-graph replays, the variants timed interleaved;
enough weight copies rotated to flush L2 from one call to the next), ``w_of_copy``: the int4 weight
+ scale (+ zero) bytes per second over the measured device-to-device copy bandwidth, ``of_copy``:
the same with activations and output counted, and each anchor's time over ours (``vs_X`` > 1: we
are faster; ``vs_fbgemm`` is against the faster FBGEMM op, ``vs_best`` against the fastest anchor).
The summary checks the issue's targets and names the worst row of each.

Run from the repository root:

    python -m bench.bench_w4a16 --out bench/out [--quick] [--configs auto,gemv,...] [--zeros]
        [--group-size 128] [--dtype bfloat16] [--layers 7B.qkv,8B.down] [--tokens 1,16,64]
        [--anchors cublas,tinygemm,fbgemm_rowwise,fbgemm_shuffled]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import qops
from bench.fbgemm_genai import load_fbgemm_genai
from bench.shapes import MODELS
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
from qops.w4a16 import dequantize_weight_int4, n_major, quantize_weight_int4, unpack_int4

LAYERS: list[tuple[str, int, int]] = (
    MODELS["llama2-7b"].linear_layers() + MODELS["llama3-8b"].linear_layers() + MODELS["llama2-70b"].linear_layers(tp=8)
)
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
QUICK_TOKENS = [1, 16, 64, 1024]
QUICK_MODEL = "7B"  # --quick: the Llama-2-7B layers only
ANCHORS = ("cublas", "tinygemm", "fbgemm_rowwise", "fbgemm_shuffled")
TINYGEMM_INNER_K_TILES = 8  # _convert_weight_to_int4pack's innerKTiles (2, 4 or 8; 8: 16-byte loads)
ERR_LIMIT = 0.02  # relative L2 error vs cuBLAS above which a variant's layout is suspect


# ---- the weights, in every variant's layout --------------------------------------------------------
def _tinygemm_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None):
    """torch's tinygemm layout (pytorch test/test_linalg.py ``_int4_mm``, aten int4mm.cu): unsigned
    ``u = q + 8`` packed two per byte, even k in the HIGH nibble, uint8 [N, K/2] ->
    ``_convert_weight_to_int4pack`` (int32 [N/8, K/(16 * inner), 32, inner/2]); scales and zeros
    interleaved as [K/G, N, 2]. tinygemm computes ``(u - 8) * scale + zero`` = ``q * scale + zero``."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    packed = ((u[:, 0::2] << 4) | u[:, 1::2]).contiguous()
    b = torch.ops.aten._convert_weight_to_int4pack(packed, TINYGEMM_INNER_K_TILES)
    z = zeros if zeros is not None else torch.zeros_like(scales)
    sz = torch.stack([scales, z], dim=-1).transpose(0, 1).contiguous()
    return b, sz


def _fbgemm_weight(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, shuffled: bool):
    """FBGEMM gen_ai's layout (quantize_test.py ``int4_row_quantize`` + ``pack_int4``): int8
    [N, K/2] with qops' nibble order, scale and zero [K/G, N] contiguous; the shuffled op's weight
    goes through ``preshuffle_i4`` (in place, hence the clone)."""
    w = packed.view(torch.int8).clone()
    s = scales.t().contiguous()
    z = (zeros if zeros is not None else torch.zeros_like(scales)).t().contiguous()
    if shuffled:
        w, s = torch.ops.fbgemm.preshuffle_i4(w, s)
    return w, s, z


def anchor_unavailable(name: str, dtype: torch.dtype, group: int) -> str:
    """Why an anchor cannot run at all here ("" if it can)."""
    if name == "cublas":
        return ""
    if dtype != torch.bfloat16:
        return f"{name}: bf16 activations only"
    if name == "tinygemm":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return "tinygemm: torch.ops.aten._weight_int4pack_mm missing"
        return "" if group in (32, 64, 128, 256) else f"tinygemm: no group size {group}"
    why = load_fbgemm_genai()
    if why:
        return f"{name}: {why}"
    ops = ["bf16i4bf16_rowwise"] if name == "fbgemm_rowwise" else ["bf16i4bf16_shuffled", "preshuffle_i4"]
    missing = [op for op in ops if not hasattr(torch.ops.fbgemm, op)]
    return f"{name}: torch.ops.fbgemm.{missing[0]} missing" if missing else ""


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:120] if msg else ''}"


def build_sets(n, k, n_sets, group, zeros, dtype, anchors, notes) -> list[dict]:
    """``n_sets`` independent int4 weights of one layer, each in every variant's layout: the keys
    "qops", "ref" (the dequantized weight, cuBLAS's operand) and one per anchor that builds;
    an anchor whose layout fails to build is dropped with its reason in ``notes``."""
    sets: list[dict] = []
    for i in range(n_sets):
        w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        packed, scales, zs = quantize_weight_int4(w, group, zeros, dtype=dtype)
        del w
        s: dict = {
            "qops": (qops.w4a16_prepack(packed), n_major(scales), n_major(zs) if zs is not None else None),
            "ref": dequantize_weight_int4(packed, scales, zs, group),
        }
        for name in anchors:
            if name == "cublas" or (i > 0 and name not in sets[0]):
                continue
            try:
                if name == "tinygemm":
                    s[name] = _tinygemm_weight(unpack_int4(packed), scales, zs)
                else:
                    s[name] = _fbgemm_weight(packed, scales, zs, shuffled=name == "fbgemm_shuffled")
            except Exception as e:
                notes[name] = f"{name}: building its weight layout failed: {_short(e)}"
        sets.append(s)
    torch.cuda.synchronize()
    return sets


def variant_call(name: str, a: torch.Tensor, s: dict, group: int) -> Callable[[], torch.Tensor]:
    """The zero-argument call of variant ``name`` on activations ``a`` and weight set ``s``."""
    if name == "cublas":
        w = s["ref"]
        return lambda: F.linear(a, w)
    if name == "tinygemm":
        b, sz = s["tinygemm"]
        return lambda: torch.ops.aten._weight_int4pack_mm(a, b, group, sz)
    if name == "fbgemm_rowwise":
        w, sc, z = s["fbgemm_rowwise"]
        return lambda: torch.ops.fbgemm.bf16i4bf16_rowwise(a, w, sc, z)
    if name == "fbgemm_shuffled":
        w, sc, z = s["fbgemm_shuffled"]
        return lambda: torch.ops.fbgemm.bf16i4bf16_shuffled(a, w, sc, z)
    # "qops" (auto) or "qops_<config>"
    config = name[len("qops_") :] if name.startswith("qops_") else "auto"
    wp, sc, z = s["qops"]
    return lambda: qops.w4a16_gemm(a, wp, sc, z, group, config=config)


def time_variants(makers: dict, n_sets: int, notes: dict) -> dict[str, float]:
    """Microseconds per call of each variant, timed interleaved (they share the GPU's clock and
    temperature); if that fails, one at a time, a failing variant getting NaN and a note."""
    if not makers:
        return {}
    try:
        return bench_interleaved_us(makers, n_sets)
    except Exception as e:
        print(f"  interleaved timing failed ({_short(e)}); timing the variants one at a time", flush=True)
    times = {}
    for name, make in makers.items():
        try:
            times[name] = bench_us(make, n_sets)
        except Exception as e:
            times[name] = math.nan
            notes[name] = f"{name}: timing failed: {_short(e)}"
    return times


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _nanmin(d: dict[str, float]) -> tuple[str, float]:
    ok = {k: v for k, v in d.items() if not math.isnan(v)}
    if not ok:
        return "", math.nan
    best = min(ok, key=lambda k: ok[k])
    return best, ok[best]


def run_layer(layer, n, k, tokens, variants, anchors, group, zeros, dtype, copy_gbps, printed) -> list[dict]:
    """Every M of one layer: the rows of the CSV."""
    esize = torch.finfo(dtype).bits // 8
    scale_bytes = n * (k // group) * esize * (2 if zeros else 1)
    w_bytes = n * k // 2 + scale_bytes  # what a decode call must read: int4 weights + scales (+ zeros)
    n_sets = l2_rotation_sets(w_bytes)
    layer_notes: dict[str, str] = {a: why for a in anchors if (why := anchor_unavailable(a, dtype, group))}
    live_anchors = [a for a in anchors if a not in layer_notes]
    sets = build_sets(n, k, n_sets, group, zeros, dtype, live_anchors, layer_notes)
    live_anchors = [a for a in live_anchors if a not in layer_notes]
    rows = []
    for m in tokens:
        notes = dict(layer_notes)
        acts = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(n_sets)]
        ref = F.linear(acts[0], sets[0]["ref"])
        errs: dict[str, float] = {}
        makers = {}
        for name in variants + live_anchors:
            try:  # one eager call: does it run here, and does it compute the same product?
                out = variant_call(name, acts[0], sets[0], group)()
                errs[name] = _rel_err(out, ref)
                del out
            except Exception as e:
                notes[name] = f"{name}: {_short(e)}"
                continue
            makers[name] = lambda i, name=name, acts=acts: variant_call(name, acts[i], sets[i], group)
        # The read floor: a reduction that only reads the same prepacked weight bytes (for layers
        # too small to reach the copy bandwidth: launch, first round trip and drain).
        makers["floor"] = lambda i: lambda w=sets[i]["qops"][0]: w.view(torch.int32).sum(dtype=torch.int32)
        times = time_variants(makers, n_sets, notes)
        for name in variants + list(anchors):
            times.setdefault(name, math.nan)
        us = times["qops"]
        moved = w_bytes + m * k * esize + m * n * esize
        r: dict = {
            "layer": layer,
            "M": m,
            "N": n,
            "K": k,
            "dtype": str(dtype).replace("torch.", ""),
            "group": group,
            "zeros": int(zeros),
            "qops_us": us,
            "w_GBps": w_bytes / us * 1e-3,
            "w_of_copy": w_bytes / us * 1e-3 / copy_gbps,
            "floor_us": times.get("floor", math.nan),
            "of_floor": times.get("floor", math.nan) / us,
            "of_copy": moved / us * 1e-3 / copy_gbps,
            "TFLOPs": 2.0 * m * n * k / us * 1e-6,
        }
        for name in variants[1:]:
            r[f"{name}_us"] = times[name]
        for a in ANCHORS:
            r[f"{a}_us"] = times.get(a, math.nan)
        _, fb_us = _nanmin({a: times.get(a, math.nan) for a in ("fbgemm_rowwise", "fbgemm_shuffled")})
        best_name, best_us = _nanmin({a: times.get(a, math.nan) for a in ANCHORS})
        r["fbgemm_us"] = fb_us
        r["best_anchor"] = best_name
        r["best_anchor_us"] = best_us
        for a in ANCHORS:
            r[f"vs_{a}"] = r[f"{a}_us"] / us
        r["vs_fbgemm"] = fb_us / us
        r["vs_best"] = best_us / us
        for name in variants + list(ANCHORS):  # for the plot: bf16 cuBLAS time over each variant's
            r[f"{name}_x_cublas"] = r["cublas_us"] / times.get(name, math.nan)
        for name in variants + list(ANCHORS):
            if name != "cublas":
                r[f"{name}_err"] = errs.get(name, math.nan)
        r["skipped"] = "; ".join(notes[x] for x in sorted(notes))
        rows.append(r)
        for note in notes.values():
            if note not in printed:
                printed.add(note)
                print(f"  skipped {note}", flush=True)
        for name, err in errs.items():
            if err > ERR_LIMIT:
                print(f"  WARNING: {name} differs from bf16 cuBLAS by {err:.3g} (relative L2): layout?", flush=True)
        print(
            f"{layer:14s} M={m:5d}: qops {us:8.1f} us {r['w_GBps']:6.0f} GB/s ({r['w_of_copy']:.2f} of copy, "
            f"{r['of_floor']:.2f} of floor)  "
            + "  ".join(
                f"{a} {r[f'{a}_us']:7.1f} (x{r[f'vs_{a}']:.2f})" for a in ANCHORS if not math.isnan(r[f"{a}_us"])
            )
            + "".join(f"  {v[5:]} {times[v]:.1f}" for v in variants[1:]),
            flush=True,
        )
        acts.clear()
        del ref
    sets.clear()
    torch.cuda.empty_cache()
    return rows


# ---- the targets ----------------------------------------------------------------------------
TARGETS: list[tuple[str, Callable[[int], bool], str, float]] = [
    ("M <= 16: weight+scale bytes >= 0.8 of copy bandwidth", lambda m: m <= 16, "w_of_copy", 0.8),
    ("M <= 16: >= 3x bf16 cuBLAS", lambda m: m <= 16, "vs_cublas", 3.0),
    ("M <= 16: >= 2x FBGEMM (the faster of rowwise and shuffled)", lambda m: m <= 16, "vs_fbgemm", 2.0),
    ("M = 64: >= 2x bf16 cuBLAS", lambda m: m == 64, "vs_cublas", 2.0),
    (
        "32 <= M <= 256: never slower than the best of bf16 cuBLAS, tinygemm and FBGEMM",
        lambda m: 32 <= m <= 256,
        "vs_best",
        1.0,
    ),
    ("M >= 1024: >= 1.0x bf16 cuBLAS", lambda m: m >= 1024, "vs_cublas", 1.0),
]


def check_targets(rows: list[dict]) -> None:
    """One line per target: met / MISSED / not checked, with the worst row."""
    print("\n== targets (qops auto; vs_X = X's time / ours)")
    for text, in_range, key, limit in TARGETS:
        rs = [r for r in rows if in_range(r["M"])]
        vals = [r for r in rs if not math.isnan(r[key])]
        if not vals:
            why = "no rows with these M" if not rs else f"{key} unavailable (anchor or qops missing)"
            print(f"  not checked  {text}: {why}")
            continue
        worst = min(vals, key=lambda r: r[key])
        missed = sum(r[key] < limit for r in vals)
        status = "met   " if missed == 0 else "MISSED"
        extra = f", {len(rs) - len(vals)} rows without a value" if len(vals) < len(rs) else ""
        print(
            f"  {status}  {text}: worst {worst[key]:.2f} at {worst['layer']} M={worst['M']} "
            f"({missed}/{len(vals)} rows below {limit}{extra})"
        )
    timed = [a for a in ANCHORS if any(not math.isnan(r[f"{a}_us"]) for r in rows)]
    print(f"  anchors timed: {', '.join(timed) or 'none'}")


# ---- command line -----------------------------------------------------------------------------------
def known_configs() -> list[str] | None:
    """The w4a16 config names of the kernel table, if it lists them (else None: names are taken
    from the command line as given, and a wrong one shows as a skipped column)."""
    fn = getattr(table, "w4a16_config_names", None)
    if fn is None:
        return None
    try:
        return [str(c) for c in fn()]
    except Exception:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--quick", action="store_true", help=f"the {QUICK_MODEL} layers at M in {QUICK_TOKENS} only")
    p.add_argument(
        "--configs",
        default="auto",
        help='comma-separated qops configs to time besides "auto": "gemv", w4a16 tile config names, or "all"',
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--group-size", type=int, default=128, choices=[64, 128])
    p.add_argument("--zeros", action="store_true", help="scale+zero mode (default: scale-only)")
    p.add_argument("--layers", help="comma-separated layer names (default: all), e.g. 7B.qkv,70B-tp8.down")
    p.add_argument("--tokens", help="comma-separated M values (default: {})".format(",".join(map(str, TOKENS))))
    p.add_argument("--anchors", default=",".join(ANCHORS), help="comma-separated anchors to time")
    args = p.parse_args()

    layers = [l for l in LAYERS if not args.quick or l[0].split(".")[0] == QUICK_MODEL]
    if args.layers:
        known = {l[0] for l in LAYERS}
        wanted = args.layers.split(",")
        unknown = sorted(set(wanted) - known)
        if unknown:
            p.error(f"unknown layers {unknown}; known: {sorted(known)}")
        layers = [l for l in LAYERS if l[0] in wanted]
    tokens = QUICK_TOKENS if args.quick else TOKENS
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    anchors = [a for a in args.anchors.split(",") if a]
    if set(anchors) - set(ANCHORS):
        p.error(f"unknown anchors {sorted(set(anchors) - set(ANCHORS))}; known: {list(ANCHORS)}")
    configs = [c for c in args.configs.split(",") if c and c != "auto"]
    table_configs = known_configs()
    if "all" in configs:
        if table_configs is None:
            p.error("--configs all: cutlass_kernels/w8a8_configs.py has no w4a16_config_names() to list them")
        configs = [c for c in configs if c != "all"] + [c for c in table_configs if c not in configs]
    if table_configs is not None and set(configs) - set(table_configs):
        p.error(f"unknown w4a16 configs {sorted(set(configs) - set(table_configs))}; known: {table_configs}")
    variants = ["qops"] + [f"qops_{c}" for c in configs]
    dtype = getattr(torch, args.dtype)

    require_cuda("bench.bench_w4a16")
    os.makedirs(args.out, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"device: {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}, {args.dtype} activations, "
        f"group {args.group_size}, {'scale+zero' if args.zeros else 'scale-only'}, "
        f"qops w4a16_gemm CUDA kernel: {qops.has_cuda_kernel('w4a16_gemm')}"
    )
    for a in anchors:
        why = anchor_unavailable(a, dtype, args.group_size)
        print(f"anchor {a}: {'available' if not why else why}")
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth (1 GiB device-to-device): {copy_gbps:.0f} GB/s", flush=True)

    rows: list[dict] = []
    printed: set[str] = set()
    for layer, n, k in layers:
        rows += run_layer(
            layer, n, k, tokens, variants, anchors, args.group_size, args.zeros, dtype, copy_gbps, printed
        )

    suffix = ("_zeros" if args.zeros else "") + (f"_g{args.group_size}" if args.group_size != 128 else "")
    suffix += "_fp16" if dtype == torch.float16 else ""
    write_csv(rows, os.path.join(args.out, f"bench_w4a16{suffix}.csv"))
    line_grid_plot(
        rows,
        "layer",
        "M",
        [f"{v}_x_cublas" for v in variants + list(ANCHORS)],
        f"w4a16_gemm ({args.dtype}, group {args.group_size}{', zeros' if args.zeros else ''}) and anchors, "
        f"{torch.cuda.get_device_name()}",
        "bf16 cuBLAS time / time (> 1: faster)",
        os.path.join(args.out, f"bench_w4a16{suffix}.png"),
    )
    print(f"\n== w4a16_gemm vs anchors (us per call; vs_X = X's time / ours; copy {copy_gbps:.0f} GB/s)")
    print_table(
        rows,
        [
            "layer",
            "M",
            "qops_us",
            *[f"{v}_us" for v in variants[1:]],
            "w_of_copy",
            "floor_us",
            "of_floor",
            *[f"{a}_us" for a in ANCHORS],
            "vs_cublas",
            "vs_tinygemm",
            "vs_fbgemm_shuffled",
            "vs_best",
        ],
    )
    check_targets(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
