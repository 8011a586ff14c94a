"""RoPE + paged int8 cache write fused (``qops.rope_and_cache_int8``) against the unfused pair
(``qops.rotary_embedding`` then ``qops.reshape_and_cache_int8``) and against PyTorch RoPE + the
write, in the same run (interleaved CUDA graphs rotating over input sets that spill L2):

    python -m bench.bench_rope_cache [--models llama3-8b,llama2-7b] [--tokens 1,16,256,4096,16384]

"moved" counts the bytes each token must move: q and k read and written, v read, the int8 K/V rows
and their scales written (the cos/sin rows are L2-resident and not counted); ``of_copy`` is that
over the 1 GiB device copy's bandwidth. Targets (issue 45): >= 0.85 of copy at T >= 4096, <= 5 us
at T <= 16, >= 1.5x PyTorch RoPE + the write. Writes ``rope_cache.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch

import qops
from bench.shapes import MODELS
from qops.rope import rotate
from qops.testing import bench_interleaved_us, copy_bandwidth_gbps, require_cuda


def make_sets(t: int, hq: int, hk: int, d: int, n_sets: int, block_size: int = 16):
    sets = []
    for i in range(n_sets):
        g = torch.Generator(device="cuda").manual_seed(i)
        qkv = torch.randn(t, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16, generator=g)
        nb = t // block_size + 2
        kc = torch.empty(nb, hk, block_size, d, dtype=torch.int8, device="cuda")
        ks = torch.empty(nb, hk, block_size, dtype=torch.float32, device="cuda")
        slots = torch.randperm(nb * block_size, device="cuda", generator=g)[:t]
        pos = torch.randint(0, 8192, (t,), device="cuda", generator=g)
        sets.append((qkv, pos, kc, kc.clone(), ks, ks.clone(), slots))
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device="cuda") / d))
    f = torch.outer(torch.arange(8192, dtype=torch.float32, device="cuda"), inv)
    emb = torch.cat((f, f), dim=-1)
    return sets, emb.cos().contiguous(), emb.sin().contiguous()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3-8b,llama2-7b")
    p.add_argument("--tokens", default="1,16,256,4096,16384")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    require_cuda("bench.bench_rope_cache")
    copy = copy_bandwidth_gbps()
    print(f"copy bandwidth (1 GiB device-to-device): {copy:.0f} GB/s", flush=True)
    rows = []
    for name in a.models.split(","):
        m = MODELS[name]
        hq, hk, d = m.heads, m.kv_heads, m.head_dim
        for t in (int(x) for x in a.tokens.split(",")):
            moved = t * (2 * hq * d * 2 + 2 * hk * d * 2 + hk * d * 2 + 2 * hk * d + 2 * hk * 4)
            n_sets = max(2, int((200 << 20) // max(moved, 1)) + 1) if moved < (200 << 20) else 2
            n_sets = min(n_sets, 64)
            sets, cos, sin = make_sets(t, hq, hk, d, n_sets)

            def split(qkv):
                q = qkv[:, : hq * d].view(t, hq, d)
                k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
                v = qkv[:, (hq + hk) * d :].view(t, hk, d)
                return q, k, v

            def fused(i):
                qkv, pos, kc, vc, ks, vs, slots = sets[i]
                q, k, v = split(qkv)
                return lambda: qops.rope_and_cache_int8(pos, q, k, v, cos, sin, kc, vc, ks, vs, slots)

            def unfused(i):
                qkv, pos, kc, vc, ks, vs, slots = sets[i]
                q, k, v = split(qkv)

                def call():
                    qops.rotary_embedding(pos, q, k, cos, sin)
                    qops.reshape_and_cache_int8(k, v, kc, vc, ks, vs, slots)

                return call

            def torch_rope(i):
                qkv, pos, kc, vc, ks, vs, slots = sets[i]
                q, k, v = split(qkv)

                def call():
                    c, s = cos[pos], sin[pos]
                    q.copy_(rotate(q, c, s))
                    k.copy_(rotate(k, c, s))
                    qops.reshape_and_cache_int8(k, v, kc, vc, ks, vs, slots)

                return call

            us = bench_interleaved_us({"fused": fused, "unfused": unfused, "torch_rope": torch_rope}, n_sets)
            r = {
                "model": name,
                "T": t,
                "fused_us": us["fused"],
                "unfused_us": us["unfused"],
                "torch_rope_us": us["torch_rope"],
                "of_copy": moved / (us["fused"] * 1e-6) / 1e9 / copy,
                "vs_unfused": us["unfused"] / us["fused"],
                "vs_torch_rope": us["torch_rope"] / us["fused"],
            }
            rows.append(r)
            print(
                f"{name:10s} T={t:6d}: fused {r['fused_us']:8.2f} us ({r['of_copy']:.2f} of copy), "
                f"unfused {r['unfused_us']:8.2f} ({r['vs_unfused']:.2f}x), "
                f"torch RoPE + write {r['torch_rope_us']:8.2f} ({r['vs_torch_rope']:.2f}x)",
                flush=True,
            )
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "rope_cache.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
