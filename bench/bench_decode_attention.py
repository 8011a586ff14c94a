"""Benchmark: paged int8 KV decode attention (qops.paged_decode_attention_int8) vs SDPA on fp16/bf16 K/V.

For each (model, B, T): the int8 paged decode (blocks shuffled over the cache, all sequences of
length T) and, in the same run, torch SDPA on the same problem with contiguous bf16 K/V
([B, H_kv, T, D], enable_gqa), each backend tried (cuDNN, flash, efficient), the fastest reported.
Effective bandwidth counts the bytes the int8 kernel actually reads (int8 K and V, their scales,
q, block tables) and writes (out); SDPA's counts its bf16 K/V. Times are medians of CUDA-graph
replays over several input sets (L2 does not hold the previous call's cache).

`overlap_us` times the same calls with ``overlap_prologue=True``, as the quantized Llama makes
them (right after the cache write): with programmatic dependent launch the prologue's reads
(sequence length, block ids, query, the first K/V chunks but the last token's) overlap the
previous kernel's tail. `overlap_frac_copy_bw` is that call's effective bandwidth over the copy
bandwidth (`frac_copy_bw` is the default call's).

`write_us`, `step_us` and `step_overlap_us` time the decode step's pair as the Llama runs it: the
cache write of each sequence's new token (``reshape_and_cache_int8`` into position L - 1) alone,
then followed by the attention, default and overlapped. `step_overlap_us - write_us` is what the
attention adds to a step.

At the small-batch rows (B = 1 and 8) the int8 kernel is also timed on each split-merge path
(``tuning=qops.DecodeTuning(merge=...)``): the cluster merge ("cluster", through distributed shared
memory, one launch -- the default where the splits fit a cluster), the merge fused into the split
kernel through a workspace and counters ("fused", one launch), and the split kernel + reduce kernel
("separate", the `unfused_us` column); the ratios cluster / unfused and fused / unfused are printed
(< 1: faster than two kernels). `int8_us` (and the overlap, step and split-sweep times) are always
the path ``--merge`` selects (default "auto", the glue's rule), named in the `merge` column.

Run from the repository root:

    python -m bench.bench_decode_attention [--out DIR] [--quick] [--no-merge-compare] [--no-sweep]
        [--models smollm2-135m,...] [--batches 1,8] [--contexts 4096] [--merge auto]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F

import qops
from bench.shapes import ATTENTION_MODELS
from qops.attention import MERGES
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

MODELS = ATTENTION_MODELS  # name: (HQ, HKV, D)
DTYPE = torch.bfloat16
BLOCK = 16
MEM_LIMIT = 56 << 30  # bytes of input sets alive at once (the int8 sets are freed before SDPA's)
MERGE_COMPARE_BATCHES = (1, 8)
# The split-merge paths compared at MERGE_COMPARE_BATCHES: column prefix -> DecodeTuning.merge.
COMPARED_PATHS = {"cluster": "cluster", "fused": "fused", "unfused": "separate"}


def merge_policy(merge: str = "auto") -> str:
    """What the split merge ``merge`` (a DecodeTuning.merge) does, in words."""
    base = {"fused": "fused (forced)", "separate": "two kernels (forced)"}.get(
        merge, "fused for head_dim 128 and contexts >= 4096, else two kernels" if merge == "auto" else "two kernels"
    )
    if merge in ("fused", "separate"):
        return base
    return f"cluster merge where the splits fit a cluster (<= 16), else {base}"


def merge_path(path: str) -> qops.DecodeTuning:
    """The launch options that select a split-merge path: a DecodeTuning.merge ("auto", "cluster",
    "fused", "separate") or "unfused" (= "separate", this benchmark's column name)."""
    return qops.DecodeTuning(merge=COMPARED_PATHS.get(path, path))


def int8_problem(B, HQ, HKV, D, lens, seed, block_size=BLOCK):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-L // block_size) for L in lens]
    num_blocks = max(1, sum(nblk))
    k_cache = torch.randint(-127, 128, (num_blocks, HKV, block_size, D), dtype=torch.int8, device="cuda", generator=g)
    v_cache = torch.randint(-127, 128, k_cache.shape, dtype=torch.int8, device="cuda", generator=g)
    k_scales = torch.rand(num_blocks, HKV, block_size, device="cuda", generator=g) * 0.02 + 1e-3
    v_scales = torch.rand(num_blocks, HKV, block_size, device="cuda", generator=g) * 0.02 + 1e-3
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    max_blocks = max(nblk + [1])
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[off : off + n]
        off += n
    q = torch.randn(B, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, k_scales, v_scales, bt, sl


def new_token_write(problem):
    """The decode step's cache write for ``problem`` (an ``int8_problem``): each sequence's new
    token, fresh bf16 K/V, quantized into position ``seq_lens[b] - 1``. Returns the call."""
    q, k_cache, v_cache, k_scales, v_scales, bt, sl = problem
    B, HKV, bs, D = q.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    pos = sl.long() - 1
    slots = bt[torch.arange(B, device="cuda"), pos // bs].long() * bs + pos % bs
    k = torch.randn(B, HKV, D, device="cuda", dtype=DTYPE)
    v = torch.randn(B, HKV, D, device="cuda", dtype=DTYPE)
    return lambda: qops.reshape_and_cache_int8(k, v, k_cache, v_cache, k_scales, v_scales, slots)


def int8_bytes(B, HQ, HKV, D, lens):
    toks = sum(lens)
    return 2 * toks * HKV * D + 2 * toks * HKV * 4 + 2 * B * HQ * D * 2 + B * 4 + sum(-(-L // BLOCK) for L in lens) * 4


def sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]


def bench_sdpa(B, HQ, HKV, D, T, n_sets):
    """Fastest SDPA backend on bf16 K/V [B, HKV, T, D]; returns (us, backend name)."""
    from torch.nn.attention import sdpa_kernel

    # a backend that cannot run the problem raises (reported below) after warning why, per call
    warnings.filterwarnings(
        "ignore",
        message=r".*(kernel not used because|has been runtime "
        r"disabled|require query, key and value to have the same num_heads)",
    )
    sets = []
    for _i in range(n_sets):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=DTYPE)
        k = torch.randn(B, HKV, T, D, device="cuda", dtype=DTYPE)
        v = torch.randn(B, HKV, T, D, device="cuda", dtype=DTYPE)
        sets.append((q, k, v))
    best = (float("inf"), "none")
    for name, backend in sdpa_backends():

        def make(i, backend=backend):
            q, k, v = sets[i]

            def call():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=HQ != HKV)

            return call

        try:
            us = bench_us(make, n_sets)
        except Exception as e:  # backend does not support this problem
            print(f"  sdpa {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
            continue
        if us < best[0]:
            best = (us, name)
    sets.clear()  # drop the tensors (the closures above hold the list)
    torch.cuda.empty_cache()
    return best


def run_config(model, B, T, copy_bw, splits_sweep=(), merge_compare=False, merge="auto"):
    """One (model, B, T) row; ``splits_sweep``: split counts to time as well (forced); ``merge``:
    the split merge (DecodeTuning.merge) of every time but the merge comparison's."""
    HQ, HKV, D = MODELS[model]
    lens = [T] * B
    set_bytes_i8 = 2 * B * HKV * T * D
    set_bytes_16 = 2 * B * HKV * T * D * 2
    n_i8 = l2_rotation_sets(set_bytes_i8)
    n_16 = l2_rotation_sets(set_bytes_16)
    n_i8 = max(1, min(n_i8, MEM_LIMIT // set_bytes_i8))
    n_16 = max(1, min(n_16, MEM_LIMIT // set_bytes_16))
    if set_bytes_16 > MEM_LIMIT:
        print(f"skip {model} B={B} T={T}: {set_bytes_16 / 2**30:.0f} GiB of bf16 K/V")
        return None, []
    sets = [int8_problem(B, HQ, HKV, D, lens, seed=i) for i in range(n_i8)]
    sm = D**-0.5

    merge_tuning = merge_path(merge)

    def make(i, ns=0, overlap=False, tuning=None):
        a = sets[i]
        t = tuning if tuning is not None else merge_tuning
        return lambda: qops.paged_decode_attention_int8(*a, sm, num_splits=ns, overlap_prologue=overlap, tuning=t)

    us = bench_us(make, n_i8)  # the path --merge selects (default: the glue's rule)
    # As the Llama calls it (after the cache write, which writes only the new tokens): the
    # prologue's reads overlap the previous kernel's tail. Here the previous kernel is the
    # previous call, which writes only its output, so the promise holds.
    overlap_us = bench_us(lambda i: make(i, overlap=True), n_i8)
    # The decode step's pair: write each sequence's new token (position L - 1), then attend.
    writes = [new_token_write(a) for a in sets]

    def step(i, overlap):
        write, attend = writes[i], make(i, overlap=overlap)
        return lambda: (write(), attend())

    write_us = bench_us(lambda i: writes[i], n_i8)
    step_us = bench_us(lambda i: step(i, False), n_i8)
    step_overlap_us = bench_us(lambda i: step(i, True), n_i8)
    cluster_us = fused_us = unfused_us = None
    if merge_compare:  # every merge path, same inputs
        cluster_us = bench_us(lambda i: make(i, tuning=merge_path("cluster")), n_i8)
        fused_us = bench_us(lambda i: make(i, tuning=merge_path("fused")), n_i8)
        unfused_us = bench_us(lambda i: make(i, tuning=merge_path("unfused")), n_i8)
    sweep = []
    if splits_sweep:
        for ns in splits_sweep:
            if ns * 16 > T:
                break
            sweep.append(
                {
                    "model": model,
                    "B": B,
                    "T": T,
                    "merge": merge,
                    "num_splits": ns,
                    "us": bench_us(lambda i, ns=ns: make(i, ns), n_i8),
                    "overlap_us": bench_us(lambda i, ns=ns: make(i, ns, True), n_i8),
                }
            )
    sets.clear()  # drop the tensors (the closures above hold the list)
    torch.cuda.empty_cache()
    s_us, s_name = bench_sdpa(B, HQ, HKV, D, T, n_16)
    nbytes = int8_bytes(B, HQ, HKV, D, lens)
    bw = gbps(nbytes, us)
    row = {
        "model": model,
        "B": B,
        "T": T,
        "HQ": HQ,
        "HKV": HKV,
        "D": D,
        "merge": merge,
        "int8_us": us,
        "int8_GBps": bw,
        "frac_copy_bw": bw / copy_bw,
        "sdpa_us": s_us,
        "sdpa_backend": s_name,
        "sdpa_GBps": gbps(set_bytes_16, s_us) if s_us < float("inf") else 0.0,
        "speedup_vs_sdpa": s_us / us,
        "overlap_us": overlap_us,
        "overlap_vs_sdpa": s_us / overlap_us,
        "overlap_frac_copy_bw": gbps(nbytes, overlap_us) / copy_bw,
        "write_us": write_us,
        "step_us": step_us,
        "step_overlap_us": step_overlap_us,
        "cluster_us": "",
        "fused_us": "",
        "unfused_us": "",
        "cluster_over_unfused": "",
        "fused_over_unfused": "",
    }
    if fused_us is not None:
        row.update(
            cluster_us=cluster_us,
            fused_us=fused_us,
            unfused_us=unfused_us,
            cluster_over_unfused=cluster_us / unfused_us,
            fused_over_unfused=fused_us / unfused_us,
        )
    return row, sweep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--quick", action="store_true", help="a few configs only")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of MODELS")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--no-sweep", action="store_true", help="skip the num_splits sweeps")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64,128", help="the split counts of the sweeps (ascending)")
    ap.add_argument(
        "--no-merge-compare",
        action="store_true",
        help=f"do not also time the other split-merge paths at B in {MERGE_COMPARE_BATCHES}",
    )
    ap.add_argument(
        "--merge",
        default="auto",
        choices=MERGES,
        help="the split merge (qops.DecodeTuning.merge) of int8_us and the other times "
        "(default: auto, the glue's rule)",
    )
    args = ap.parse_args()
    require_cuda("bench.bench_decode_attention")
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_bw = copy_bandwidth_gbps()
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"copy bandwidth {copy_bw:.0f} GB/s (read + write); split merge {args.merge!r}: "
        f"{merge_policy(args.merge)}"
    )
    Bs = tuple(int(x) for x in args.batches.split(","))
    Ts = tuple(int(x) for x in args.contexts.split(","))
    models = args.models.split(",")
    splits = sorted(int(x) for x in args.splits.split(","))
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.quick:
        Bs, Ts = (1, 32), (4096,)
    rows, sweeps = [], []
    for model in models:
        for B in Bs:
            for T in Ts:
                sweep = not args.no_sweep and (
                    (B in (1, 8) and T in (4096, 16384)) or (model == "smollm2-135m" and B == 32)
                )
                compare = B in MERGE_COMPARE_BATCHES and not args.no_merge_compare
                row, sw = run_config(
                    model, B, T, copy_bw, merge_compare=compare, splits_sweep=splits if sweep else (), merge=args.merge
                )
                if row is None:
                    continue
                rows.append(row)
                sweeps += sw
                merge = ""
                if row["fused_over_unfused"] != "":
                    merge = (
                        f"  cluster/fused/unfused {row['cluster_us']:.1f} / "
                        f"{row['fused_us']:.1f} / {row['unfused_us']:.1f} us"
                    )
                print(
                    f"{model:14s} B={B:4d} T={T:6d}: int8 {row['int8_us']:9.1f} us "
                    f"{row['int8_GBps']:6.0f} GB/s ({100 * row['frac_copy_bw']:.0f}% copy)  "
                    f"sdpa[{row['sdpa_backend']}] {row['sdpa_us']:9.1f} us  "
                    f"x{row['speedup_vs_sdpa']:.2f}  overlapped {row['overlap_us']:.1f} us "
                    f"({100 * row['overlap_frac_copy_bw']:.0f}% copy) "
                    f"x{row['overlap_vs_sdpa']:.2f}  step (write {row['write_us']:.1f}) "
                    f"{row['step_us']:.1f} / overlapped {row['step_overlap_us']:.1f} us{merge}",
                    flush=True,
                )
    # variable lengths in one batch
    HQ, HKV, D = MODELS["llama3-8b-gqa"]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 16384, (32,), generator=g).tolist()
    sets = [int8_problem(32, HQ, HKV, D, lens, seed=i) for i in range(2)]
    tuning = merge_path(args.merge)
    us = bench_us(lambda i: lambda: qops.paged_decode_attention_int8(*sets[i], D**-0.5, tuning=tuning), 2)
    bw = gbps(int8_bytes(32, HQ, HKV, D, lens), us)
    print(
        f"variable lengths (llama3-8b-gqa, B=32, lens 1..16383, mean {sum(lens) / 32:.0f}): "
        f"{us:.1f} us, {bw:.0f} GB/s ({100 * bw / copy_bw:.0f}% copy)"
    )
    sets.clear()  # drop the tensors (the closures above hold the list)

    os.makedirs(args.out, exist_ok=True)
    write_csv(rows, os.path.join(args.out, "decode_attention.csv"))
    if sweeps:
        write_csv(sweeps, os.path.join(args.out, "decode_attention_splits.csv"))
        print("\nnum_splits sweep (us):")
        print_table(sweeps)
    for r in rows:
        r["label"] = f"{r['model']} B{r['B']} T{r['T']}"
    bar_plot(
        rows,
        "label",
        ["int8_us", "sdpa_us"],
        "paged int8 decode vs SDPA (bf16)",
        "us",
        os.path.join(args.out, "decode_attention.png"),
    )
    print("\n== paged_decode_attention_int8 vs SDPA (bf16 K/V)")
    print_table(
        rows,
        [
            "model",
            "B",
            "T",
            "merge",
            "int8_us",
            "int8_GBps",
            "frac_copy_bw",
            "sdpa_us",
            "sdpa_backend",
            "speedup_vs_sdpa",
            "overlap_us",
            "overlap_frac_copy_bw",
            "overlap_vs_sdpa",
            "write_us",
            "step_us",
            "step_overlap_us",
        ],
    )
    merged = [r for r in rows if r["fused_over_unfused"] != ""]
    if merged:
        print(
            "\n== split merges: cluster (DSMEM) and fused (workspace + counters) vs split + reduce "
            "kernels (< 1: faster than two kernels; ~1 where the heuristic does not split)"
        )
        print_table(
            merged,
            [
                "model",
                "B",
                "T",
                "cluster_us",
                "fused_us",
                "unfused_us",
                "cluster_over_unfused",
                "fused_over_unfused",
                "frac_copy_bw",
                "speedup_vs_sdpa",
            ],
        )
        for key in ("cluster_over_unfused", "fused_over_unfused"):
            ratios = [r[key] for r in merged]
            print(
                f"{key}: geometric mean {math.prod(ratios) ** (1 / len(ratios)):.3f}, "
                f"min {min(ratios):.3f}, max {max(ratios):.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
