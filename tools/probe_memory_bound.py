"""Probes for the memory-bound kernels: what the memory system gives at *these* sizes, and where
the norm and decode-attention kernels lose time. A diagnostic companion to bench/bench_norm_act.py
and bench/bench_decode_attention.py (their tables are the reported numbers; this explains them).

Stream probes (CUDA-graph replay over L2-rotated sets, median, as the benchmarks time):
  - a device copy moving the same bytes as the norm (read + write), and the 1 GiB copy ceiling;
  - a bf16 -> int8 cast (out.copy_(x)): the norm's exact traffic pattern (2 bytes read, 1 written
    per element) with no reduction, i.e. the best a "read row, write int8" kernel can expect;
  - the norm kernels (auto, row-resident, pipelined: qops.NormTuning.variant) and the fused add.
Decode probes: Llama-3-8B GQA paged int8 decode (B = 1 by default, --decode-batch B) at forced
split counts, merges and warps per CTA (qops.DecodeTuning), beside the heuristic's choice.

From the repository root:

    python -m tools.probe_memory_bound [--out DIR] [--skip-stream] [--decode-batch 8 --decode-T 4096]
    python -m tools.probe_memory_bound --ncu norm|add_norm|decode [--T T] [--variant V]
        [--splits S] [--merge M] [--warps W] [--model M --B B]
        (runs one case a few times eagerly, for `ncu -k ... --launch-skip 2 --launch-count 1`)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import qops
from bench.bench_decode_attention import int8_problem
from bench.shapes import ATTENTION_MODELS as MODELS
from qops.attention import MERGES
from qops.norm import NORM_VARIANTS
from qops.testing import bench_us, copy_bandwidth_gbps, gbps, l2_rotation_sets, print_table, write_csv

EPS = 1e-5
GQA = MODELS["llama3-8b-gqa"]  # Llama-3-8B: HQ, HKV, D


def _sets(n, make):
    return [make() for _ in range(n)]


def stream_rows(copy_bw):
    rows = []
    dt = torch.bfloat16
    for T, H in ((4096, 4096), (16384, 4096), (4096, 8192)):
        n = l2_rotation_sets(T * H * 2)
        xs = _sets(n, lambda: torch.randn(T, H, device="cuda", dtype=dt))
        rs = _sets(n, lambda: torch.randn(T, H, device="cuda", dtype=dt))
        w = torch.rand(H, device="cuda", dtype=dt) + 0.5
        outs = _sets(n, lambda: torch.empty(T, H, device="cuda", dtype=torch.int8))
        norm_bytes = T * H * 3 + H * 2 + T * 4
        add_bytes = T * H * 7 + H * 2 + T * 4
        # copies moving the same total bytes (half read, half write)
        cp_n = norm_bytes // 2
        srcs = _sets(
            l2_rotation_sets(cp_n), lambda: torch.empty(cp_n, dtype=torch.uint8, device="cuda").random_(0, 255)
        )
        dsts = [torch.empty_like(s) for s in srcs]
        copy_us = bench_us(lambda i: lambda: dsts[i].copy_(srcs[i]), len(srcs))
        srcs.clear()  # drop the tensors (the closures above hold the list)
        dsts.clear()
        cast_us = bench_us(lambda i: lambda: outs[i].copy_(xs[i]), n)

        def norm(variant):
            tuning = qops.NormTuning(variant=variant)
            return bench_us(lambda i: lambda: qops.rms_norm_quant(xs[i], w, EPS, tuning=tuning), n)

        n_auto, n_rr, n_pipe = norm("auto"), norm("rowres"), norm("pipelined")
        add_us = bench_us(lambda i: lambda: qops.fused_add_rms_norm_quant(xs[i], rs[i], w, EPS), n)
        cp2_n = add_bytes // 2
        srcs = _sets(
            l2_rotation_sets(cp2_n), lambda: torch.empty(cp2_n, dtype=torch.uint8, device="cuda").random_(0, 255)
        )
        dsts = [torch.empty_like(s) for s in srcs]
        copy2_us = bench_us(lambda i: lambda: dsts[i].copy_(srcs[i]), len(srcs))
        srcs.clear()  # drop the tensors (the closures above hold the list)
        dsts.clear()
        xs.clear()
        rs.clear()
        outs.clear()
        torch.cuda.empty_cache()
        for name, us, nb, ref in (
            ("copy (norm bytes)", copy_us, norm_bytes, copy_us),
            ("cast bf16->int8", cast_us, T * H * 3, copy_us),
            ("norm auto", n_auto, norm_bytes, copy_us),
            ("norm rowres", n_rr, norm_bytes, copy_us),
            ("norm pipelined", n_pipe, norm_bytes, copy_us),
            ("copy (add bytes)", copy2_us, add_bytes, copy2_us),
            ("add+norm auto", add_us, add_bytes, copy2_us),
        ):
            bw = gbps(nb, us)
            rows.append(
                {
                    "case": name,
                    "T": T,
                    "H": H,
                    "us": us,
                    "GBps": bw,
                    "of_copy_1GiB": bw / copy_bw,
                    "of_same_size_copy": bw / gbps(nb, ref),
                }
            )
            print(
                f"{name:20s} {T:6d}x{H:<5d} {us:8.2f} us {bw:6.0f} GB/s  {bw / copy_bw:.3f} of 1 GiB copy"
                f"  {rows[-1]['of_same_size_copy']:.3f} of the same-size copy",
                flush=True,
            )
    return rows


def decode_problem(B, T, seed):
    """Llama-3-8B GQA, B sequences of T tokens, blocks shuffled over the cache (the benchmark's)."""
    return int8_problem(B, *GQA, [T] * B, seed)


def decode_rows(copy_bw, batch=1, contexts=(1024, 4096, 16384)):
    rows = []
    HQ, HKV, D = GQA
    for T in contexts:
        per = 2 * batch * T * HKV * D
        n = l2_rotation_sets(per)
        sets = [decode_problem(batch, T, i) for i in range(n)]
        nbytes = batch * (2 * T * HKV * D + 2 * T * HKV * 4)
        configs = [(0, "auto", 0)]
        for ns in (4, 8, 16, 32) if batch == 1 else (1, 2, 3, 4, 6, 8):
            for merge in ("cluster", "fused"):
                for warps in (4, 8):
                    if (ns > 8 and merge == "cluster") or (ns == 1 and merge == "cluster"):
                        continue
                    configs.append((ns, merge, warps))
        for ns, merge, warps in configs:
            if ns * 16 > T:
                continue
            tuning = qops.DecodeTuning(merge=merge, warps=warps)  # warps 0: the kernel's choice
            us = bench_us(
                lambda i, ns=ns, tuning=tuning: (
                    lambda: qops.paged_decode_attention_int8(*sets[i], D**-0.5, num_splits=ns, tuning=tuning)
                ),
                n,
            )
            rows.append(
                {
                    "case": f"decode B={batch} gqa",
                    "T": T,
                    "num_splits": ns or "auto",
                    "merge": merge,
                    "warps": warps or "auto",
                    "us": us,
                    "GBps": gbps(nbytes, us),
                    "of_copy_1GiB": gbps(nbytes, us) / copy_bw,
                }
            )
            print(
                f"decode B={batch} T={T:6d} splits={ns or 'auto':>4} {merge:8s} warps={warps or 'auto':>4}: "
                f"{us:7.2f} us {gbps(nbytes, us):6.0f} GB/s",
                flush=True,
            )
        sets.clear()  # drop the tensors (the closures above hold the list)
        torch.cuda.empty_cache()
    return rows


def ncu_case(args):
    torch.manual_seed(0)
    T = args.T
    if args.ncu in ("norm", "add_norm"):
        x = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
        tuning = qops.NormTuning(variant=args.variant)
        for _ in range(5):
            if args.ncu == "norm":
                qops.rms_norm_quant(x, w, EPS, tuning=tuning)
            else:
                qops.fused_add_rms_norm_quant(x, r, w, EPS, tuning=tuning)
    elif args.ncu == "decode":
        HQ, HKV, D = MODELS[args.model]
        a = int8_problem(args.B, HQ, HKV, D, [T] * args.B, 0)
        tuning = qops.DecodeTuning(merge=args.merge, warps=args.warps)
        for _ in range(5):
            qops.paged_decode_attention_int8(*a, D**-0.5, num_splits=args.splits, tuning=tuning)
    else:
        raise SystemExit(f"unknown --ncu case {args.ncu!r}")
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--ncu", default=None, help="run one case eagerly for a profiler: norm, add_norm, decode")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--variant", default="auto", choices=NORM_VARIANTS, help="norm kernel of --ncu norm|add_norm")
    ap.add_argument("--splits", type=int, default=0, help="num_splits of --ncu decode (0: the heuristic's)")
    ap.add_argument("--merge", default="auto", choices=MERGES, help="split merge of --ncu decode")
    ap.add_argument("--warps", type=int, default=0, choices=(0, 4, 8), help="warps per CTA of --ncu decode (0: auto)")
    ap.add_argument("--model", default="llama3-8b-gqa", choices=sorted(MODELS), help="decode shape of --ncu decode")
    ap.add_argument("--B", type=int, default=1, help="batch of --ncu decode")
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--decode-batch", type=int, default=1, help="batch of the decode sweep (default 1)")
    ap.add_argument("--decode-T", default="1024,4096,16384", help="contexts of the decode sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tools.probe_memory_bound: needs a CUDA device", file=sys.stderr)
        return 1
    if args.ncu:
        ncu_case(args)
        return 0
    copy_bw = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth (1 GiB) {copy_bw:.0f} GB/s")
    contexts = tuple(int(t) for t in args.decode_T.split(","))
    for name, skip, fn in (
        ("stream", args.skip_stream, stream_rows),
        ("decode", args.skip_decode, lambda bw: decode_rows(bw, args.decode_batch, contexts)),
    ):
        if skip:
            continue
        rows = fn(copy_bw)
        write_csv(rows, os.path.join(args.out, f"probe_{name}.csv"))
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
