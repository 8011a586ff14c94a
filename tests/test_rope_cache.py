"""rope_and_cache_int8: RoPE on q and k fused with the paged int8 cache write (python/qops/rope.py,
csrc/kv_cache/rope_and_cache_int8.cu). The contract is the two ops in sequence, bit for bit: the
CPU reference against rotary_embedding + reshape_and_cache_int8, the interleaved layout against
rotate-half on permuted head dimensions, and CUDA against the CPU reference on awkward sizes."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.rope import rotate, rotate_interleaved
from qops.testing import poison_cuda_allocator

HALF = (torch.float16, torch.bfloat16)
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().contiguous(), emb.sin().contiguous()


def problem(t, hq, hk, d, dtype, static, block_size=16, num_blocks=None, seed=0, device="cpu"):
    """A fused qkv output with q/k/v as strided views, positions, a shuffled slot mapping with
    padding (-1), and an empty (poisoned) cache."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    pos = torch.randint(0, 300, (t,), generator=g)
    num_blocks = num_blocks or (t // block_size + 3)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1
    kc = torch.full((num_blocks, hk, block_size, d), 77, dtype=torch.int8)
    vc = kc.clone()
    if static:
        ks, vs = torch.tensor([0.03]), torch.tensor([0.05])
    else:
        ks = torch.full((num_blocks, hk, block_size), -1.0)
        vs = ks.clone()
    cos, sin = tables(512, d)
    st = [x.to(device) for x in (qkv, pos, kc, vc, ks, vs, slots, cos, sin)]
    return st


def views(qkv, t, hq, hk, d):
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    return q, k, v


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("static", [False, True])
def test_reference_is_rope_then_cache_write(dtype, static):
    t, hq, hk, d = 21, 6, 2, 64
    qkv, pos, kc, vc, ks, vs, slots, cos, sin = problem(t, hq, hk, d, dtype, static, seed=1)
    qkv2, kc2, vc2, ks2, vs2 = qkv.clone(), kc.clone(), vc.clone(), ks.clone(), vs.clone()
    q, k, v = views(qkv, t, hq, hk, d)
    qops.rope_and_cache_int8(pos, q, k, v, cos, sin, kc, vc, ks, vs, slots)
    q2, k2, v2 = views(qkv2, t, hq, hk, d)
    qops.rotary_embedding(pos, q2, k2, cos, sin)
    qops.reshape_and_cache_int8(k2, v2, kc2, vc2, ks2, vs2, slots)
    for a, b in ((qkv, qkv2), (kc, kc2), (vc, vc2), (ks, ks2), (vs, vs2)):
        assert torch.equal(a, b)


def test_interleaved_is_rotate_half_on_permuted_dims():
    """Pairs (2j, 2j+1) at angle j == rotate-half's pairs (j, j + D/2) after moving even dims to
    the first half and odd dims to the second (the tables are cat(f, f))."""
    d = 32
    x = torch.randn(5, 3, d).to(torch.bfloat16)
    cos, sin = tables(64, d)
    p = torch.randint(0, 64, (5,))
    c, s = cos[p], sin[p]
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    inv = torch.argsort(perm)
    assert torch.equal(rotate_interleaved(x, c, s), rotate(x[..., perm], c, s)[..., inv])


def test_reference_errors():
    qkv, pos, kc, vc, ks, vs, slots, cos, sin = problem(4, 2, 1, 64, torch.float16, False)
    q, k, v = views(qkv, 4, 2, 1, 64)
    with pytest.raises(ValueError, match="positions must be in"):
        qops.rope_and_cache_int8(pos + 1000, q, k, v, cos, sin, kc, vc, ks, vs, slots)
    with pytest.raises(ValueError):
        qops.rope_and_cache_int8(pos, q, k, v, cos[:, :32], sin[:, :32], kc, vc, ks, vs, slots)


SIZES = [  # t, hq, hk, d, block_size
    (1, 32, 8, 128, 16),
    (7, 9, 3, 64, 32),
    (130, 8, 1, 128, 64),
    (33, 4, 4, 256, 16),
    (5, 6, 2, 48, 16),  # D / 16 = 3 lanes of a 4-lane group
    (300, 2, 2, 16, 128),
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("t,hq,hk,d,bs", SIZES)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_cuda_matches_reference(t, hq, hk, d, bs, neox, static, dtype, device):
    cpu = problem(t, hq, hk, d, dtype, static, block_size=bs, seed=t + d)
    poison_cuda_allocator()
    dev = [x.to(device) for x in cpu]
    for st in (cpu, dev):
        qkv, pos, kc, vc, ks, vs, slots, cos, sin = st
        q, k, v = views(qkv, t, hq, hk, d)
        qops.rope_and_cache_int8(pos, q, k, v, cos, sin, kc, vc, ks, vs, slots, is_neox=neox)
    for a, b in zip(cpu, dev):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_cuda_bad_position_and_unaligned(device):
    """A position past the table: NaN in that token's q/k heads, never a read out of bounds; an
    unaligned (odd-offset) view takes the scalar path with the same bits."""
    t, hq, hk, d = 6, 3, 1, 64
    qkv, pos, kc, vc, ks, vs, slots, cos, sin = problem(t, hq, hk, d, torch.float16, False, device=device)
    pos[2] = 10_000
    q, k, v = views(qkv, t, hq, hk, d)
    qops.rope_and_cache_int8(pos, q, k, v, cos, sin, kc, vc, ks, vs, slots)
    assert torch.isnan(q[2]).all() and torch.isnan(k[2]).all()
    assert not torch.isnan(q[[0, 1, 3, 4, 5]]).any()
    # odd element offset: the unaligned path against the reference
    cpu = problem(t, hq, hk, d, torch.bfloat16, True, seed=9)
    wide = torch.cat((torch.zeros(t, 1, dtype=torch.bfloat16), cpu[0]), dim=1)
    outs = []
    for dev_ in ("cpu", device):
        # clone: on the CPU .to() returns the same tensor, and the op writes in place
        qkv_, pos_, kc_, vc_, ks_, vs_, slots_, cos_, sin_ = [x.clone().to(dev_) for x in (wide, *cpu[1:])]
        q_, k_, v_ = views(qkv_[:, 1:], t, hq, hk, d)
        qops.rope_and_cache_int8(pos_, q_, k_, v_, cos_, sin_, kc_, vc_, ks_, vs_, slots_)
        outs.append((qkv_.cpu(), kc_.cpu(), vc_.cpu()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
