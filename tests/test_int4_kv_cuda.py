"""The int4 KV cache on CUDA against the CPU references (python/qops/int4_kv.py): the quantizing
writes bit-exact (quantize_kv_int4, reshape_and_cache_int4, skvq_cache_write), the split-K decode
(int4_gqa_decode, with and without SKVQ's sinks and window) within fp16 rounding of a float64
evaluation of the same dequantized cache."""

from __future__ import annotations

import math
import random

import pytest
import torch

import qops
from qops.int4_kv import int4_decode_reference, kv_int4_row_bytes
from qops.testing import poison_, poison_cuda_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = (torch.float16, torch.bfloat16)


def _kv(shape, dtype, seed, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + torch.randn(shape[-1:], generator=g)
    if outliers:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] *= 40
    return x.to(dtype)


# ---- the writes: bit-exact ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("g", (1, 4))
@pytest.mark.parametrize("clip", (1.0, 0.9))
def test_quantize_kv_int4_bit_exact(dtype, d, g, clip):
    x = _kv((37, 3, d), dtype, seed=d + g, outliers=True)
    x[0, 0, 5] = float("nan")
    x[1, 1, :] = float("nan")  # a row of NaN
    x[2, 2, :] = 3.0  # constant
    if dtype == torch.bfloat16:
        x[3, 0, 7] = 1e30  # past fp16: saturates
        x[4, 0, 9] = -float("inf")
    want = qops.quantize_kv_int4(x, g, clip_ratio=clip)
    got = qops.quantize_kv_int4(x.cuda(), g, clip_ratio=clip)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, g", [(64, 1), (64, 4), (128, 1), (128, 4)])
@pytest.mark.parametrize("block_size", (16, 32))
def test_reshape_and_cache_int4_bit_exact(dtype, d, g, block_size):
    hkv, nb, t = 3, 9, 50
    qkv = _kv((t, 2 + 2 * hkv, d), dtype, seed=d * g + block_size)  # strided K/V slices
    key, value = qkv[:, 2 : 2 + hkv], qkv[:, 2 + hkv :]
    slots = torch.randperm(nb * block_size)[:t]
    slots[::7] = -1
    rb = kv_int4_row_bytes(d, g)
    kc = poison_(torch.empty(nb, hkv, block_size, rb, dtype=torch.uint8))
    vc = poison_(torch.empty_like(kc))
    dk, dv = kc.cuda(), vc.cuda()
    qops.reshape_and_cache_int4(key, value, kc, vc, slots, g)
    qops.reshape_and_cache_int4(key.cuda(), value.cuda(), dk, dv, slots.cuda(), g)
    torch.cuda.synchronize()
    assert torch.equal(dk.cpu(), kc) and torch.equal(dv.cpu(), vc)


def _skvq_state(b, hkv, d, g, bs, max_len, sinks, window, dtype, seed):
    """Empty caches for b sequences (random block tables) on the CPU, poisoned."""
    rng = random.Random(seed)
    nblk = -(-max_len // bs)
    nb = b * nblk + 3
    ids = list(range(nb))
    rng.shuffle(ids)
    tables = torch.tensor([ids[i * nblk : (i + 1) * nblk] for i in range(b)], dtype=torch.int32)
    rb = kv_int4_row_bytes(d, g)
    kc = poison_(torch.empty(nb, hkv, bs, rb, dtype=torch.uint8))
    vc = poison_(torch.empty_like(kc))
    nside = b + 2
    ks = poison_(torch.empty(nside, hkv, sinks + window, d, dtype=dtype))
    vs = poison_(torch.empty_like(ks))
    slots = torch.tensor(rng.sample(range(nside), b), dtype=torch.int32)
    return [kc, vc, ks, vs, tables, slots]


def _write_steps(state, steps, hkv, d, g, sinks, window, dtype, seed, *, cuda_state=None):
    """Applies skvq_cache_write for each step (a list of new-token counts per sequence) to the CPU
    state and, if given, the CUDA copy; returns the final lengths."""
    kc, vc, ks, vs, tables, slots = state
    b = len(steps[0])
    lens = [0] * b
    for i, news in enumerate(steps):
        lens = [n + m for n, m in zip(lens, news)]
        cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
        x = _kv((int(cu[-1]), 2, hkv, d), dtype, seed=seed * 100 + i)
        key, value = x[:, 0], x[:, 1]
        sl = torch.tensor(lens, dtype=torch.int32)
        qops.skvq_cache_write(key, value, kc, vc, ks, vs, tables, slots, sl, cu, g, sinks, window)
        if cuda_state is not None:
            dkc, dvc, dks, dvs, dt, ds = cuda_state
            qops.skvq_cache_write(
                key.cuda(), value.cuda(), dkc, dvc, dks, dvs, dt, ds, sl.cuda(), cu.cuda(), g, sinks, window
            )
    return lens


@pytest.mark.parametrize("d, g", [(64, 4), (128, 1)])
@pytest.mark.parametrize("sinks, window", [(4, 16), (0, 24), (3, 0), (4, 128)])
def test_skvq_cache_write_bit_exact(d, g, sinks, window):
    dtype = torch.float16 if d == 64 else torch.bfloat16
    hkv, bs, b = 2, 16, 4
    steps = [[40, 3, 0, 200], [5, 1, 17, 1], [1, 1, 1, 1], [1, 0, 1, 1], [30, 1, 1, 1]]
    max_len = sum(max(s[i] for s in steps) for i in range(b)) + sum(sum(s) for s in steps)
    state = _skvq_state(b, hkv, d, g, bs, max_len, sinks, window, dtype, seed=d + sinks)
    cuda_state = [t.cuda() for t in state]
    _write_steps(state, steps, hkv, d, g, sinks, window, dtype, seed=1, cuda_state=cuda_state)
    torch.cuda.synchronize()
    for cpu, dev in zip(state[:4], cuda_state[:4]):
        assert torch.equal(dev.cpu().view(torch.uint8), cpu.view(torch.uint8))


# ---- the decode ---------------------------------------------------------------------------------
def _decode_case(lens, hq, hkv, d, g, bs, dtype, *, sinks=0, window=0, num_splits=0, merge="auto", seed=0):
    """Random int4 cache through the CPU writes; the CUDA decode against a float64 evaluation."""
    b = len(lens)
    max_len = max(max(lens), 1)
    state = _skvq_state(b, hkv, d, g, bs, max_len, sinks, window, dtype, seed)
    if sinks + window > 0:
        # one prefill per sequence, then up to 2 decode steps
        steps = [[], [1 if n >= 2 else 0 for n in lens], [1 if n >= 1 else 0 for n in lens]]
        steps[0] = [n - a - c for n, a, c in zip(lens, steps[1], steps[2])]
        _write_steps(state, steps, hkv, d, g, sinks, window, dtype, seed)
    else:
        kc, vc, _, _, tables, _ = state
        for i, n in enumerate(lens):
            pos = torch.arange(n)
            slot = tables[i, pos // bs].long() * bs + pos % bs
            x = _kv((n, 2, hkv, d), dtype, seed=seed + i)
            qops.reshape_and_cache_int4(x[:, 0], x[:, 1], kc, vc, slot, g)
    kc, vc, ks, vs, tables, slots = state
    sl = torch.tensor(lens, dtype=torch.int32)
    q = _kv((b, hq, d), dtype, seed=seed + 99)
    sm = 1.0 / math.sqrt(d)
    side = (ks, vs, slots) if sinks + window > 0 else (None, None, None)
    want = int4_decode_reference(q, kc, vc, tables, sl, sm, g, *side, sinks, window, dtype=torch.float64)
    dside = tuple(None if t is None else t.cuda() for t in side)
    got = qops.int4_gqa_decode(
        q.cuda(), kc.cuda(), vc.cuda(), tables.cuda(), sl.cuda(), sm, g,
        k_side=dside[0], v_side=dside[1], side_slots=dside[2], sinks=sinks, window=window,
        num_splits=num_splits, tuning=qops.DecodeTuning(merge=merge),
    )  # fmt: skip
    got = got.cpu().double()
    eps = torch.finfo(dtype).eps
    err = (got - want).abs()
    tol = 2 * eps * (1 + want.abs())
    assert torch.isfinite(got).all()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g} (tol {2 * eps:.3g}), at {(err - tol).argmax()}"
    return got


@pytest.fixture(autouse=True)
def _poisoned_allocator():
    poison_cuda_allocator()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("g", (1, 4))
@pytest.mark.parametrize("hq, hkv", [(8, 1), (4, 4), (12, 4), (7, 1), (32, 8), (32, 1), (40, 2)])
def test_int4_decode_gqa_ratios(dtype, d, g, hq, hkv):
    _decode_case([1, 17, 0, 300, 33, 1000], hq, hkv, d, g, 16, dtype, seed=hq + d + g)


@pytest.mark.parametrize("bs", (16, 32, 64, 128))
@pytest.mark.parametrize("num_splits", (0, 1, 3, 8))
def test_int4_decode_block_sizes_splits(bs, num_splits):
    _decode_case([700, 15, 16, 2049, 1, 0], 8, 2, 128, 1, bs, torch.float16, num_splits=num_splits, seed=bs)


@pytest.mark.parametrize("merge", ("cluster", "fused", "separate"))
@pytest.mark.parametrize("num_splits", (2, 5, 16))
def test_int4_decode_merges(merge, num_splits):
    _decode_case([3000, 100, 0], 8, 1, 128, 4, 16, torch.bfloat16, num_splits=num_splits, merge=merge)


@pytest.mark.parametrize("sinks, window", [(4, 128), (0, 32), (4, 0), (5, 17)])
@pytest.mark.parametrize("d, g, dtype", [(128, 1, torch.bfloat16), (64, 4, torch.float16)])
@pytest.mark.parametrize("num_splits", (0, 1, 4))
def test_int4_decode_skvq(sinks, window, d, g, dtype, num_splits):
    # lengths 0, 1, inside the sinks, inside sinks + window, exactly it, past it, long
    lens = [0, 1, 3, sinks + window - 1, sinks + window, sinks + window + 1, 600, 2500]
    lens = [max(0, n) for n in lens]
    _decode_case(lens, 8, 2, d, g, 16, dtype, sinks=sinks, window=window, num_splits=num_splits, seed=sinks + window)


@pytest.mark.parametrize("merge", ("cluster", "fused", "separate"))
def test_int4_decode_skvq_merges(merge):
    _decode_case([4000, 140, 10], 8, 1, 128, 1, 16, torch.float16, sinks=4, window=128, num_splits=6, merge=merge)


def test_int4_decode_long_context():
    _decode_case([131072, 70000], 8, 1, 128, 1, 64, torch.bfloat16, seed=5)


def test_int4_decode_cuda_graph():
    """Captured once, replayed with new lengths and a new token: the same as eager calls."""
    d, g, hq, hkv, bs, b = 128, 1, 8, 2, 16, 3
    state = [t.cuda() for t in _skvq_state(b, hkv, d, g, bs, 512, 4, 32, torch.float16, seed=3)]
    kc, vc, ks, vs, tables, slots = state
    lens = torch.tensor([100, 7, 300], dtype=torch.int32, device="cuda")
    x = _kv((int(lens.sum()), 2, hkv, d), torch.float16, seed=4).cuda()
    cu = torch.tensor([0, 100, 107, 407], dtype=torch.int32, device="cuda")
    qops.skvq_cache_write(x[:, 0], x[:, 1], kc, vc, ks, vs, tables, slots, lens, cu, g, 4, 32)
    q = _kv((b, hq, d), torch.float16, seed=6).cuda()
    new = _kv((b, 2, hkv, d), torch.float16, seed=7).cuda()
    step_cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")

    def step():
        lens.add_(1)
        qops.skvq_cache_write(new[:, 0], new[:, 1], kc, vc, ks, vs, tables, slots, lens, step_cu, g, 4, 32)
        return qops.int4_gqa_decode(
            q, kc, vc, tables, lens, 0.1, g, k_side=ks, v_side=vs, side_slots=slots, sinks=4, window=32
        )

    saved = [t.clone() for t in (kc, vc, ks, vs, lens)]
    eager = [step().clone() for _ in range(3)]
    for t, s in zip((kc, vc, ks, vs, lens), saved):
        t.copy_(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # warm-up (one step), then undo it
        for t, s in zip((kc, vc, ks, vs, lens), saved):
            t.copy_(s)
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.synchronize()
    for t, s in zip((kc, vc, ks, vs, lens), saved):
        t.copy_(s)
    for e in eager:
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, e)


def test_int4_decode_splits_agree():
    """num_splits and the merge path change the result only by float32 rounding."""
    outs = [
        _decode_case([5000, 64, 1], 8, 1, 128, 1, 16, torch.float16, num_splits=s, merge=m, seed=9)
        for s, m in ((1, "auto"), (7, "cluster"), (7, "fused"), (7, "separate"), (30, "auto"))
    ]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() <= 2 * torch.finfo(torch.float16).eps
