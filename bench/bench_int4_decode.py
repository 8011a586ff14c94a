"""Benchmark: the paged int4 KV decode (qops.int4_gqa_decode, seed 002) beside its anchors, in the
same run: FBGEMM's gqa_attn_splitk (seed 002's kernel, contiguous int4 cache, one kv head), SDPA on
bf16 K/V (the fastest backend), and qops' own int8 decode (qops.paged_decode_attention_int8).

Rows: the seed's configuration (HQ 8, HKV 1, D 128, T 8192, B 32-512, row-wise and 4 groups) and
Llama-3-8B (32/8, D 128) and SmolLM2-135M (9/3, D 64) at T 4096 and 16384. Every sequence has T
tokens; the int4 cache is paged in shuffled blocks of 16. Bytes read by the int4 kernel: the K and
V rows (4 * groups + D / 2 bytes each), the query, block tables and lengths, plus the output
written. `frac_copy_bw` is its bandwidth over the 1 GiB device copy's (read + write);
`floor_us` is a read-only probe of the same cache bytes (one torch reduction over K and V), the
floor at sizes too small for the copy bandwidth (`frac_floor` = floor_us / int4_us).
`skvq_us`: the same call with SKVQ's window of 128 and 4 sinks read from the side buffers.
Times: medians of CUDA-graph replays over input sets rotated past L2.

    python -m bench.bench_int4_decode [--out DIR] [--quick] [--no-fbgemm] [--sweep 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import qops
from bench.bench_decode_attention import int8_bytes, int8_problem
from bench.fbgemm_genai import load_fbgemm_genai
from bench.shapes import ATTENTION_MODELS
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

DTYPE = torch.bfloat16
BLOCK = 16
MEM_LIMIT = 24 << 30
SEED_CFG = ("seed-mqa", 8, 1, 128)
SEED_BATCHES = (32, 64, 128, 256, 512)
FBGEMM_SPLITS = (8, 16, 32, 64)


def load_fbgemm() -> bool:
    """Loads FBGEMM gen_ai's ops library (fbgemm-gpu-genai) without its package __init__."""
    why = load_fbgemm_genai()
    if why:
        print(f"fbgemm: {why}")
    return not why and hasattr(torch.ops.fbgemm, "gqa_attn_splitk")


def int4_problem(B, HQ, HKV, D, T, groups, seed, window=0, sinks=0):
    """A paged int4 cache of B sequences of T tokens (valid rows: quantized random K/V)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rb = 4 * groups + D // 2
    nblk = -(-T // BLOCK)
    num_blocks = B * nblk
    kv = torch.empty(2, num_blocks, HKV, BLOCK, rb, dtype=torch.uint8, device="cuda")
    for i in range(2):  # quantize in slices (bounded temporary memory)
        for b0 in range(0, num_blocks, 4096):
            b1 = min(num_blocks, b0 + 4096)
            x = torch.randn(b1 - b0, HKV, BLOCK, D, device="cuda", dtype=DTYPE, generator=g)
            kv[i, b0:b1] = qops.quantize_kv_int4(x, groups)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    bt = perm.view(B, nblk).contiguous()
    q = torch.randn(B, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    sl = torch.full((B,), T, dtype=torch.int32, device="cuda")
    side = {}
    if window + sinks > 0:
        ks = torch.randn(B, HKV, sinks + window, D, device="cuda", dtype=DTYPE, generator=g)
        side = dict(
            k_side=ks, v_side=torch.randn_like(ks), side_slots=torch.arange(B, dtype=torch.int32, device="cuda"),
            sinks=sinks, window=window,
        )  # fmt: skip
    return (q, kv[0], kv[1], bt, sl), kv, side


def int4_bytes(B, HQ, HKV, D, T, groups):
    rb = 4 * groups + D // 2
    return 2 * B * T * HKV * rb + 2 * B * HQ * D * 2 + B * 4 + B * (-(-T // BLOCK)) * 4


def bench_sdpa(B, HQ, HKV, D, T, n_sets):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    warnings.filterwarnings("ignore", message=r".*(kernel not used because|has been runtime disabled|same num_heads)")
    sets = [
        (
            torch.randn(B, HQ, 1, D, device="cuda", dtype=DTYPE),
            torch.randn(B, HKV, T, D, device="cuda", dtype=DTYPE),
            torch.randn(B, HKV, T, D, device="cuda", dtype=DTYPE),
        )
        for _ in range(n_sets)
    ]
    best = float("inf")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):

        def make(i, backend=backend):
            q, k, v = sets[i]

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=HQ != HKV)

            return call

        try:
            best = min(best, bench_us(make, n_sets))
        except Exception:
            continue
    sets.clear()
    torch.cuda.empty_cache()
    return best


def bench_fbgemm(B, HQ, D, T, groups, n_sets):
    """gqa_attn_splitk (one kv head, D 128) on a contiguous int4 cache [B, T, 1, rb]: best split."""
    rb = 4 * groups + D // 2
    sets = []
    for _ in range(n_sets):
        x = torch.randn(2, B, T, 1, D, device="cuda", dtype=DTYPE)
        cache = qops.quantize_kv_int4(x, groups)  # seed 002's row format
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=DTYPE)
        pos = torch.full((B,), T - 1, dtype=torch.int32, device="cuda")
        sets.append((q, cache[0], cache[1], pos))
        del x
    assert sets[0][1].shape[-1] == rb
    best = (float("inf"), 0)
    for ns in FBGEMM_SPLITS:

        def make(i, ns=ns):
            q, k, v, pos = sets[i]
            return lambda: torch.ops.fbgemm.gqa_attn_splitk(
                q, k, v, pos, D**-0.5, ns, kv_cache_quant_num_groups=groups, use_tensor_cores=True,
                cache_logical_dtype_int=2,
            )  # fmt: skip

        try:
            us = bench_us(make, n_sets)
        except Exception as e:
            print(f"  fbgemm split {ns}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        if us < best[0]:
            best = (us, ns)
    sets.clear()
    torch.cuda.empty_cache()
    return best


def run_row(model, HQ, HKV, D, B, T, groups, copy_bw, fbgemm, skvq, sweep_splits=()):
    nbytes = int4_bytes(B, HQ, HKV, D, T, groups)
    n = max(1, min(l2_rotation_sets(nbytes), MEM_LIMIT // max(nbytes, 1)))
    probs = [
        int4_problem(B, HQ, HKV, D, T, groups, seed=i, window=128 if skvq else 0, sinks=4 if skvq else 0)
        for i in range(n)
    ]
    sm = D**-0.5
    us = bench_us(lambda i: lambda a=probs[i][0]: qops.int4_gqa_decode(*a, sm, groups), n)
    sweep = {}
    if sweep_splits:  # forced split counts (the heuristic's choice is int4_us)
        for ns in sweep_splits:
            if ns * 64 <= T:
                sweep[f"s{ns}_us"] = bench_us(
                    lambda i, ns=ns: lambda a=probs[i][0]: qops.int4_gqa_decode(*a, sm, groups, num_splits=ns), n
                )
    skvq_us = ""
    if skvq:
        skvq_us = bench_us(lambda i: lambda a=probs[i][0], s=probs[i][2]: qops.int4_gqa_decode(*a, sm, groups, **s), n)
    floor_us = bench_us(lambda i: lambda kv=probs[i][1]: kv.view(torch.int32).sum(dtype=torch.int32), n)
    probs.clear()
    torch.cuda.empty_cache()
    # qops int8 decode, same shape
    i8_bytes = int8_bytes(B, HQ, HKV, D, [T] * B)
    n8 = max(1, min(l2_rotation_sets(i8_bytes), MEM_LIMIT // i8_bytes))
    sets8 = [int8_problem(B, HQ, HKV, D, [T] * B, seed=i) for i in range(n8)]
    int8_us = bench_us(lambda i: lambda a=sets8[i]: qops.paged_decode_attention_int8(*a, sm), n8)
    sets8.clear()
    torch.cuda.empty_cache()
    sdpa_us = bench_sdpa(B, HQ, HKV, D, T, max(1, min(l2_rotation_sets(4 * B * HKV * T * D), 4)))
    fb_us, fb_split = (float("nan"), 0)
    if fbgemm and HKV == 1 and D == 128:
        fb_us, fb_split = bench_fbgemm(B, HQ, D, T, groups, max(1, min(l2_rotation_sets(nbytes), 4)))
    bw = gbps(nbytes, us)
    return {
        "model": model, "HQ": HQ, "HKV": HKV, "D": D, "B": B, "T": T, "groups": groups,
        "int4_us": us, "int4_GBps": bw, "frac_copy_bw": bw / copy_bw,
        "floor_us": floor_us, "frac_floor": floor_us / us,
        "skvq_us": skvq_us,
        "int8_us": int8_us, "speedup_vs_int8": int8_us / us,
        "sdpa_us": sdpa_us, "speedup_vs_sdpa": sdpa_us / us,
        "fbgemm_us": fb_us, "fbgemm_split": fb_split,
        "speedup_vs_fbgemm": fb_us / us if fb_us == fb_us else "",
        **sweep,
    }  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--quick", action="store_true", help="a few rows only")
    ap.add_argument("--no-fbgemm", action="store_true")
    ap.add_argument("--sweep", default="", help="also time these forced split counts, e.g. 1,2,4,8,16")
    args = ap.parse_args()
    require_cuda("bench.bench_int4_decode")
    fbgemm = not args.no_fbgemm and load_fbgemm()
    copy_bw = copy_bandwidth_gbps()
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy_bw:.0f} GB/s, FBGEMM: {fbgemm}"
    )
    configs = []
    name, hq, hkv, d = SEED_CFG
    for g in (1, 4):
        for B in (32, 512) if args.quick else SEED_BATCHES:
            configs.append((name, hq, hkv, d, B, 8192, g, B in (32, 512)))
    for model in ("llama3-8b-gqa", "smollm2-135m"):
        hq, hkv, d = ATTENTION_MODELS[model]
        for T in (4096,) if args.quick else (4096, 16384):
            for B in (1, 8) if args.quick else (1, 8, 32):
                configs.append((model, hq, hkv, d, B, T, 1, B == 8))
    rows = []
    for model, hq, hkv, d, B, T, g, skvq in configs:
        sweep = tuple(int(x) for x in args.sweep.split(",") if x)
        row = run_row(model, hq, hkv, d, B, T, g, copy_bw, fbgemm, skvq, sweep)
        rows.append(row)
        fb = (
            f" fbgemm {row['fbgemm_us']:.1f} ({row['speedup_vs_fbgemm']:.2f}x)"
            if row["speedup_vs_fbgemm"] != ""
            else ""
        )
        print(
            f"{model:14s} B={B:4d} T={T:6d} g={g}: int4 {row['int4_us']:8.1f} us {row['int4_GBps']:6.0f} GB/s "
            f"({100 * row['frac_copy_bw']:.0f}% copy, floor {row['frac_floor']:.2f})  int8 {row['int8_us']:.1f} "
            f"({row['speedup_vs_int8']:.2f}x)  sdpa {row['sdpa_us']:.1f} ({row['speedup_vs_sdpa']:.2f}x){fb}"
            + (f"  skvq {row['skvq_us']:.1f}" if row["skvq_us"] != "" else "")
            + "".join(f"  {k[:-3]} {v:.1f}" for k, v in row.items() if k.startswith("s") and k[1:-3].isdigit()),
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    keys = {k for r in rows for k in r}
    for r in rows:  # the sweep columns exist only where the context is long enough
        r.update({k: "" for k in keys if k not in r})
    write_csv(rows, os.path.join(args.out, "bench_int4_decode.csv"))
    print_table(
        rows,
        [
            "model",
            "B",
            "T",
            "groups",
            "int4_us",
            "frac_copy_bw",
            "frac_floor",
            "int8_us",
            "sdpa_us",
            "fbgemm_us",
            "skvq_us",
        ],
    )
    for r in rows:
        r["label"] = f"{r['model'][:8]} B{r['B']} T{r['T'] // 1024}k g{r['groups']}"
        r["fbgemm_plot_us"] = r["fbgemm_us"] if r["fbgemm_us"] == r["fbgemm_us"] else 0.0
    keys = ["int4_us", "int8_us", "sdpa_us"] + (["fbgemm_plot_us"] if fbgemm else [])
    bar_plot(rows, "label", keys, "int4 KV decode (qops) and its anchors", "us (lower is better)",
             os.path.join(args.out, "bench_int4_decode.png"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
