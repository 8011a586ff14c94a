"""Prefill and chunked-prefill attention over the paged int8 cache
(``qops.paged_prefill_attention_int8``) against fp16/bf16 SDPA (flash / cuDNN) on the same
problem, in the same run (interleaved CUDA graphs):

    python -m bench.bench_prefill_attention [--models llama3-8b,llama2-7b] [--dtype bfloat16]

Rows:
- ``prefill``: batches of prompts (one length, or mixed lengths) with no cached prefix. SDPA runs
  causal attention on each prompt's fresh fp16 K/V (one call per prompt, inside the graph: SDPA has
  no packed-varlen form); qops reads the same keys from the int8 cache (half the KV bytes).
- ``chunk``: a chunk of C new tokens over a cached prefix of P tokens (P >= 4 C). SDPA attends from
  the chunk to an fp16 cache of the P + C tokens (bottom-right causal mask); qops to the int8 cache.

``speedup`` is SDPA's time over qops' (issue 45 targets: >= 0.8 for prefill, >= 1.2 for chunks);
``tflops`` counts 4 D flops per (query, visible key, head). Writes ``prefill_attention.csv`` (and
``.png``) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch
import torch.nn.functional as F

import qops
from bench.shapes import MODELS
from qops.testing import bench_interleaved_us, require_cuda

PREFILL_BATCHES = ([512], [2048], [8192], [512, 1024, 2048, 4096], [8192, 512, 512, 512], [1000, 3000, 77, 513])
CHUNKS = ((512, 2048), (1024, 4096), (2048, 8192), (512, 8192))  # (C, P)


def _lower_right_mask(n: int, total: int):
    """SDPA's bottom-right causal bias for a chunk of n queries over total keys (flash-capable
    where torch has it), else a boolean mask."""
    try:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, total)
    except ImportError:  # older torch
        q_pos = total - n + torch.arange(n, device="cuda")
        return torch.arange(total, device="cuda")[None, :] <= q_pos[:, None]


def make_case(prefix: list[int], new: list[int], hq: int, hkv: int, d: int, dtype, n_sets: int, block_size=16):
    """n_sets independent problems: (qops args, SDPA inputs per sequence)."""
    sets = []
    lens = [p + n for p, n in zip(prefix, new)]
    nblk = [-(-L // block_size) for L in lens]
    for i in range(n_sets):
        g = torch.Generator(device="cuda").manual_seed(i)
        num_blocks = sum(nblk) + 1
        perm = torch.randperm(num_blocks, device="cuda", generator=g).int()
        bt = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device="cuda")
        start = 0
        for b, nb in enumerate(nblk):
            bt[b, :nb] = perm[start : start + nb]
            start += nb
        kc = torch.randint(-127, 128, (num_blocks, hkv, block_size, d), dtype=torch.int8, device="cuda", generator=g)
        vc = torch.randint(-127, 128, kc.shape, dtype=torch.int8, device="cuda", generator=g)
        ks = torch.rand(num_blocks, hkv, block_size, device="cuda", generator=g) * 0.02 + 0.005
        vs = torch.rand(num_blocks, hkv, block_size, device="cuda", generator=g) * 0.02 + 0.005
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype, generator=g)
        sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        # SDPA's operands: fp16 K/V of each sequence's whole context (the dequantized cache's values)
        sd = []
        for b, L in enumerate(lens):
            pos = torch.arange(L, device="cuda")
            rows = bt[b, pos // block_size].long()
            off = pos % block_size
            k = (kc[rows, :, off].float() * ks[rows, :, off, None]).to(dtype).transpose(0, 1)[None]
            v = (vc[rows, :, off].float() * vs[rows, :, off, None]).to(dtype).transpose(0, 1)[None]
            qb = q[int(cu[b]) : int(cu[b + 1])].transpose(0, 1)[None]
            sd.append((qb, k.contiguous(), v.contiguous()))
        sets.append(((q, kc, vc, ks, vs, bt, sl, cu, max(new)), sd))
    return sets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3-8b,llama2-7b")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--quick", action="store_true", help="the first prefill batch and chunk only")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    require_cuda("bench.bench_prefill_attention")
    dtype = getattr(torch, a.dtype)
    rows = []
    cases = [("prefill", [0] * len(b), list(b)) for b in PREFILL_BATCHES]
    cases += [("chunk", [pfx], [c]) for c, pfx in CHUNKS]
    if a.quick:
        cases = [cases[0], cases[len(PREFILL_BATCHES)]]
    for name in a.models.split(","):
        m = MODELS[name]
        hq, hkv, d = m.heads, m.kv_heads, m.head_dim
        for kind, prefix, new in cases:
            sets = make_case(prefix, new, hq, hkv, d, dtype, n_sets=2)
            masks = [None if p0 == 0 else _lower_right_mask(n, p0 + n) for p0, n in zip(prefix, new)]

            def ours(i, sets=sets):
                args = sets[i][0]
                return lambda: qops.paged_prefill_attention_int8(*args)

            def sdpa(i, sets=sets, masks=masks):
                def call():
                    for (qb, k, v), mask in zip(sets[i][1], masks):
                        if mask is None:
                            F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)
                        else:
                            F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)

                return call

            us = bench_interleaved_us({"qops": ours, "sdpa": sdpa}, 2, replays=20)
            visible = sum(n * p0 + n * (n + 1) // 2 for p0, n in zip(prefix, new))
            flops = 4 * visible * d * hq
            r = {
                "model": name,
                "kind": kind,
                "prefix": "+".join(map(str, prefix)),
                "new": "+".join(map(str, new)),
                "qops_us": us["qops"],
                "sdpa_us": us["sdpa"],
                "speedup": us["sdpa"] / us["qops"],
                "qops_tflops": flops / (us["qops"] * 1e-6) / 1e12,
                "sdpa_tflops": flops / (us["sdpa"] * 1e-6) / 1e12,
            }
            rows.append(r)
            print(
                f"{name:10s} {kind:7s} prefix {r['prefix']:>14s} new {r['new']:>20s}: qops {r['qops_us']:9.1f} us "
                f"({r['qops_tflops']:6.1f} TFLOP/s), SDPA {r['sdpa_us']:9.1f} us ({r['sdpa_tflops']:6.1f}) -> "
                f"{r['speedup']:.2f}x",
                flush=True,
            )
            del sets
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "prefill_attention.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        labels = [f"{r['model']}\n{r['kind']} {r['new']}" for r in rows]
        ax.bar(range(len(rows)), [r["speedup"] for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("SDPA time / qops time")
        ax.set_title(f"paged_prefill_attention_int8 vs SDPA ({a.dtype})")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "prefill_attention.png"), dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
