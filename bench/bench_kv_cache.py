"""Benchmark: the quantizing paged cache write (qops.reshape_and_cache_int8).

Anchor, in the same run: the eager PyTorch paged write of the same K/V into a bf16 cache of the
same layout (``k_cache[blk, :, off] = key``), which moves more bytes and does no quantization.
Bandwidth counts bytes actually moved: K/V read (bf16), int8 K/V written, f32 scales written
(dynamic mode), slot mapping read. The copy bandwidth is measured in the same run, on 1 GiB (the
ceiling), and per row as a copy that moves the same bytes as the write (half read, half written),
with the same timing: at a few MB a call's fixed latency dominates any kernel, and
``frac_same_size_copy`` (that copy's time over the write's) says how close the write comes to the
cheapest kernel of its size.

Run from the repository root:

    python -m bench.bench_kv_cache [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import qops
from bench.shapes import MODELS
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
# label: (H_kv, D), e.g. "llama3-8b (8 kv heads)": (8, 128), from bench/shapes.py.
SHAPES = {
    f"{name} ({m.kv_heads} {'kv heads' if m.kv_heads < m.heads else 'heads'})": (m.kv_heads, m.head_dim)
    for name, m in ((n, MODELS[n]) for n in ("llama3-8b", "llama2-7b", "smollm2"))
}


def make_set(T, H, D, block_size, static, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = -(-T // block_size) + 8
    key = torch.randn(T, H, D, device="cuda", dtype=DTYPE, generator=g)
    value = torch.randn(T, H, D, device="cuda", dtype=DTYPE, generator=g)
    # prefill-like: contiguous runs of slots within shuffled blocks
    blocks = torch.randperm(num_blocks, device="cuda", generator=g)
    pos = torch.arange(T, device="cuda")
    slots = blocks[pos // block_size] * block_size + pos % block_size
    k_cache = torch.empty(num_blocks, H, block_size, D, dtype=torch.int8, device="cuda")
    v_cache = torch.empty_like(k_cache)
    if static:
        k_scales = torch.full((1,), 0.02, device="cuda")
        v_scales = torch.full((1,), 0.02, device="cuda")
    else:
        k_scales = torch.empty(num_blocks, H, block_size, device="cuda")
        v_scales = torch.empty_like(k_scales)
    return key, value, k_cache, v_cache, k_scales, v_scales, slots.to(torch.int64)


def moved_bytes(T, H, D, static):
    return 2 * T * H * D * 2 + 2 * T * H * D + (0 if static else 2 * T * H * 4) + T * 8


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    require_cuda("bench.bench_kv_cache")
    copy_bw = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_bw:.0f} GB/s (read + write)")
    rows = []
    for name, (H, D) in SHAPES.items():
        for T in (1, 64, 512, 4096, 16384, 65536):
            for static in (False, True):
                nb = moved_bytes(T, H, D, static)
                n = l2_rotation_sets(nb)
                sets = [make_set(T, H, D, 16, static, i) for i in range(n)]
                us = bench_us(lambda i: lambda: qops.reshape_and_cache_int8(*sets[i]), n)
                # anchor: eager bf16 paged write (index_put) of the same tokens
                anchors = []
                for key, value, k_cache, _, _, _, slots in sets:
                    kc16 = torch.empty(k_cache.shape, dtype=DTYPE, device="cuda")
                    vc16 = torch.empty_like(kc16)
                    blk, off = slots // 16, slots % 16
                    anchors.append((key, value, kc16, vc16, blk, off))

                def make_anchor(i):
                    key, value, kc16, vc16, blk, off = anchors[i]

                    def call():
                        kc16[blk, :, off] = key
                        vc16[blk, :, off] = value

                    return call

                a_us = bench_us(make_anchor, n)
                # the same bytes moved by a plain copy (nb / 2 read, nb / 2 written)
                copies = [
                    (
                        torch.empty(nb // 2, dtype=torch.uint8, device="cuda"),
                        torch.empty(nb // 2, dtype=torch.uint8, device="cuda"),
                    )
                    for _ in range(n)
                ]
                c_us = bench_us(lambda i: lambda: copies[i][1].copy_(copies[i][0]), n)
                bw = gbps(nb, us)
                rows.append(
                    {
                        "shape": name,
                        "T": T,
                        "scales": "static" if static else "dynamic",
                        "us": us,
                        "GBps": bw,
                        "frac_copy_bw": bw / copy_bw,
                        "same_size_copy_us": c_us,
                        "frac_same_size_copy": c_us / us,
                        "torch_bf16_write_us": a_us,
                        "speedup": a_us / us,
                    }
                )
                print(
                    f"{name:24s} T={T:6d} {rows[-1]['scales']:7s}: {us:8.2f} us {bw:6.0f} GB/s "
                    f"({100 * bw / copy_bw:.0f}% copy); same-size copy {c_us:7.2f} us "
                    f"({100 * c_us / us:.0f}%); torch bf16 write {a_us:8.2f} us",
                    flush=True,
                )
                sets.clear()  # drop the tensors (the closures above hold the list)
                anchors.clear()
                copies.clear()
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    write_csv(rows, os.path.join(args.out, "kv_cache_write.csv"))
    for r in rows:
        r["label"] = f"{r['shape'].split()[0]} T{r['T']} {r['scales'][0]}"
    bar_plot(
        rows,
        "label",
        ["frac_copy_bw"],
        "reshape_and_cache_int8: fraction of copy bandwidth",
        "fraction",
        os.path.join(args.out, "kv_cache_write.png"),
    )
    print("\n== reshape_and_cache_int8")
    print_table(
        rows,
        [
            "shape",
            "T",
            "scales",
            "us",
            "GBps",
            "frac_copy_bw",
            "same_size_copy_us",
            "frac_same_size_copy",
            "torch_bf16_write_us",
            "speedup",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
