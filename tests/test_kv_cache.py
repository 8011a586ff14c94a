"""reshape_and_cache_int8 (the quantizing paged cache write) and the PagedKVCache manager.

The float64 reference at the top is written independently of qops.quantization (a plain loop over
tokens); the op's CPU kernel (the reference) and the CUDA kernel are compared with it.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.kv_cache import PagedKVCache
from qops.quantization import quantize_int8

SENTINEL = 77  # poison for untouched cache bytes
SCALE_SENTINEL = -3.0


# ---- float64 reference ---------------------------------------------------------------------------
def write_reference(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping):
    """Loop-over-tokens float64 model of the op; returns new (k_cache, v_cache, k_scales, v_scales)."""
    kc, vc, ks, vs = (t.clone().cpu() for t in (k_cache, v_cache, k_scales, v_scales))
    dynamic = ks.dim() == 3
    bs = kc.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        for x, cache, scales in ((key, kc, ks), (value, vc, vs)):
            for h in range(x.shape[1]):
                row = x[t, h].double().cpu()
                row = torch.where(torch.isnan(row), torch.zeros_like(row), row)  # NaN -> 0
                if dynamic:
                    s = max(float(row.abs().max()) / 127.0, 1e-10)
                    s = float(torch.tensor(s, dtype=torch.float32))  # stored as float32
                    scales[b, h, o] = s
                else:
                    s = float(scales[0])
                q = torch.round(row / s)
                q = torch.where(torch.isnan(q), torch.zeros_like(q), q)  # Inf / Inf scale -> 0
                cache[b, h, o] = q.clamp(-128, 127).to(torch.int8)
    return kc, vc, ks, vs


def make_problem(T, H, D, num_blocks, block_size, dtype, static=False, device="cpu", pad_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(T, H, D, generator=g) * 2).to(dtype)
    value = torch.randn(T, H, D, generator=g).to(dtype)
    perm = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots = perm.clone()
    if pad_every:
        slots[::pad_every] = -1
    k_cache = torch.full((num_blocks, H, block_size, D), SENTINEL, dtype=torch.int8)
    v_cache = k_cache.clone()
    if static:
        k_scales = torch.tensor([0.02], dtype=torch.float32)
        v_scales = torch.tensor([0.01], dtype=torch.float32)
    else:
        k_scales = torch.full((num_blocks, H, block_size), SCALE_SENTINEL, dtype=torch.float32)
        v_scales = k_scales.clone()
    args = [key, value, k_cache, v_cache, k_scales, v_scales, slots.to(torch.int64)]
    return [a.to(device) for a in args]


def check_against_reference(args, result_tensors):
    exp = write_reference(*args)
    for got, want, name in zip(result_tensors, exp, ("k_cache", "v_cache", "k_scales", "v_scales")):
        got = got.cpu()
        if got.dtype == torch.int8:
            torch.testing.assert_close(got.int(), want.int(), atol=1, rtol=0, msg=name)
        else:
            torch.testing.assert_close(got, want, atol=0, rtol=1e-6, msg=name)
    # untouched slots keep the poison
    kc = result_tensors[0].cpu()
    slots = args[6].cpu()
    bs = kc.shape[2]
    written = torch.zeros(kc.shape[0] * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.reshape(kc.shape[0], bs)
    assert bool((kc.permute(0, 2, 1, 3)[untouched] == SENTINEL).all())
    if result_tensors[2].dim() == 3:
        ks = result_tensors[2].cpu()
        assert bool((ks.permute(0, 2, 1)[untouched] == SCALE_SENTINEL).all())


# ---- CPU: the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,D,H", [(16, 128, 2), (32, 64, 3), (128, 64, 1)])
def test_reference_matches_float64(static, dtype, block_size, D, H):
    args = make_problem(17, H, D, 5, block_size, dtype, static=static, pad_every=4)
    torch.ops.qops.reshape_and_cache_int8(*args)
    check_against_reference(make_problem(17, H, D, 5, block_size, dtype, static=static, pad_every=4), args[2:6])


def test_reference_strided_key_and_special_rows():
    T, H, D = 9, 2, 64
    qkv = torch.randn(T, 5, D, dtype=torch.float16)  # fused [q q q k v]-like projection
    qkv[2, 3] = 0  # all-zero row: scale 1e-10, zeros
    qkv[4, 3, 5] = float("nan")  # NaN quantizes to 0 and is ignored by amax
    key, value = qkv[:, 2:4], qkv[:, 3:5]
    assert not key.is_contiguous()
    k_cache = torch.zeros(2, H, 16, D, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(2, H, 16)
    v_scales = torch.zeros(2, H, 16)
    slots = torch.arange(T, dtype=torch.int64) + 3
    qops.reshape_and_cache_int8(key, value, k_cache, v_cache, k_scales, v_scales, slots)
    exp = write_reference(
        key,
        value,
        torch.zeros_like(k_cache),
        torch.zeros_like(v_cache),
        torch.zeros_like(k_scales),
        torch.zeros_like(v_scales),
        slots,
    )
    torch.testing.assert_close(k_cache.int(), exp[0].int(), atol=1, rtol=0)
    torch.testing.assert_close(v_cache.int(), exp[1].int(), atol=1, rtol=0)
    # token 2's value row (head 1 of key = qkv[:, 3]) is all zero
    assert float(k_scales[0, 1, 5]) == pytest.approx(1e-10)
    assert bool((k_cache[0, 1, 5] == 0).all())
    assert int(v_cache[0, 0, 7, 5]) == 0  # the NaN (value head 0 = qkv[4, 3]) is slot 7
    assert torch.isfinite(v_scales[0, 0, 7])


def test_reference_saturates_with_static_scale():
    key = torch.tensor([[[1000.0, -1000.0, 0.5, -0.5, 1.5, 2.5, -2.5, 0.0] + [0.0] * 8]], dtype=torch.float16)
    k_cache = torch.zeros(1, 1, 16, 16, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    one = torch.ones(1)
    qops.reshape_and_cache_int8(key, key, k_cache, v_cache, one, one, torch.tensor([0]))
    assert k_cache[0, 0, 0, :8].tolist() == [127, -128, 0, 0, 2, 2, -2, 0]  # round half to even


def test_opcheck():
    for static in (False, True):
        args = make_problem(7, 2, 64, 3, 16, torch.float16, static=static, pad_every=3)
        torch.library.opcheck(torch.ops.qops.reshape_and_cache_int8.default, args)


def _bad(**over):
    args = dict(
        zip(
            ["key", "value", "k_cache", "v_cache", "k_scales", "v_scales", "slot_mapping"],
            make_problem(4, 2, 64, 2, 16, torch.float16),
        )
    )
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(key=torch.randn(4, 2, 64)), "key must be float16 or bfloat16"),
        (dict(value=torch.randn(4, 2, 64, dtype=torch.bfloat16)), "value must have key's dtype"),
        (
            dict(key=torch.randn(4, 3, 64, dtype=torch.float16), value=torch.randn(4, 3, 64, dtype=torch.float16)),
            "must match k_cache",
        ),
        (dict(k_cache=torch.zeros(2, 2, 16, 64, dtype=torch.uint8)), "k_cache must be int8"),
        (
            dict(
                k_cache=torch.zeros(2, 2, 8, 64, dtype=torch.int8), v_cache=torch.zeros(2, 2, 8, 64, dtype=torch.int8)
            ),
            "block_size",
        ),
        (dict(v_cache=torch.zeros(3, 2, 16, 64, dtype=torch.int8)), "v_cache must have k_cache's shape"),
        (dict(k_scales=torch.zeros(2, 2, 17)), "k_scales must be float32"),
        (dict(k_scales=torch.ones(1)), "must both be dynamic or both static"),
        (dict(k_scales=torch.ones(2, 2, 16, dtype=torch.float64)), "k_scales must be float32"),
        (dict(slot_mapping=torch.zeros(4, dtype=torch.int32)), "slot_mapping must be int64"),
        (dict(slot_mapping=torch.zeros(5, dtype=torch.int64)), "slot_mapping must be int64 \\[T\\]"),
        (dict(slot_mapping=torch.tensor([0, 1, 32, -1])), "outside"),
        (dict(slot_mapping=torch.tensor([0, 1, -2, -1])), "outside"),
    ],
)
def test_bad_inputs(over, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match="qops.reshape_and_cache_int8.*" + match):
        qops.reshape_and_cache_int8(*_bad(**over))


# ---- CPU: the cache manager -----------------------------------------------------------------------
def test_cache_manager_allocation_and_free():
    c = PagedKVCache(num_layers=2, num_kv_heads=3, head_dim=64, num_blocks=6, block_size=16)
    assert c.num_free_blocks == 6
    s = c.append_slots(["a", "b"], [20, 3])
    assert s.dtype == torch.int64 and s.shape == (23,)
    assert c.blocks("a") == [0, 1] and c.blocks("b") == [2]
    assert s[:20].tolist() == list(range(20))
    assert s[20:].tolist() == [32, 33, 34]
    s2 = c.append_slots(["b", "a"], [1, 13])  # a: 20 -> 33 needs a third block
    assert s2.tolist() == [35] + list(range(20, 32)) + [48]
    assert c.blocks("a") == [0, 1, 3]
    assert c.seq_lens(["a", "b"]).tolist() == [33, 4]
    bt = c.block_tables(["a", "b"])
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, 1, 3], [2, 0, 0]]
    assert c.block_tables(["b"], max_blocks=4).tolist() == [[2, 0, 0, 0]]
    assert not c.can_append(["c"], [16 * 3])
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        c.append_slots(["c"], [16 * 3])
    assert c.num_free_blocks == 2 and "c" not in c.sequences()
    c.free("a")
    assert c.num_free_blocks == 5
    c.append_slots(["c"], [16 * 5])
    assert sorted(c.blocks("c")) == [0, 1, 3, 4, 5]
    c.reset()
    assert c.num_free_blocks == 6 and c.sequences() == []


def test_cache_manager_write_then_decode_matches_fp():
    """End to end on the CPU: write through the manager, decode, compare with fp attention."""
    torch.manual_seed(0)
    c = PagedKVCache(1, 2, 64, num_blocks=12, block_size=16)
    lens = [5, 40, 17]
    ids = [10, 11, 12]
    k = torch.randn(sum(lens), 2, 64, dtype=torch.float16)
    v = torch.randn(sum(lens), 2, 64, dtype=torch.float16)
    slots = c.append_slots(ids, lens)
    c.write(0, k, v, slots)
    q = torch.randn(3, 8, 64, dtype=torch.float16)
    out = qops.paged_decode_attention_int8(q, *c.layer(0), c.block_tables(ids), c.seq_lens(ids))
    off = 0
    for b, L in enumerate(lens):
        kk = k[off : off + L].float().transpose(0, 1).repeat_interleave(4, 0)
        vv = v[off : off + L].float().transpose(0, 1).repeat_interleave(4, 0)
        off += L
        ref = torch.softmax(q[b].float()[:, None] @ kk.transpose(1, 2) / 8.0, -1) @ vv
        torch.testing.assert_close(out[b].float(), ref[:, 0], atol=3e-2, rtol=0)


def test_cache_manager_static_scales():
    c = PagedKVCache(3, 1, 64, 4, 32, k_scale=0.05, v_scale=[0.01, 0.02, 0.03])
    k_cache, v_cache, ks, vs = c.layer(2)
    assert ks.shape == (1,) and float(vs) == pytest.approx(0.03)
    assert k_cache.shape == (4, 1, 32, 64) and k_cache.is_contiguous()
    x = torch.full((1, 1, 64), 0.3, dtype=torch.bfloat16)
    c.write(2, x, x, c.append_slots([0], [1]))
    assert int(k_cache[0, 0, 0, 0]) == 6 and int(v_cache[0, 0, 0, 0]) == 10
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(1, 1, 64, 4, 24)


# ---- GPU: the CUDA kernel against the reference ---------------------------------------------------
def _run_gpu_case(T, H, D, num_blocks, block_size, dtype, static, pad_every=0, seed=0):
    args = make_problem(
        T, H, D, num_blocks, block_size, dtype, static=static, device="cuda", pad_every=pad_every, seed=seed
    )
    torch.ops.qops.reshape_and_cache_int8(*args)
    torch.cuda.synchronize()
    cpu_args = make_problem(T, H, D, num_blocks, block_size, dtype, static=static, pad_every=pad_every, seed=seed)
    torch.ops.qops.reshape_and_cache_int8(*cpu_args)  # the CPU reference
    for got, want in zip(args[2:6], cpu_args[2:6]):
        assert torch.equal(got.cpu(), want), "CUDA and reference differ"  # bit exact: same f32 math
    return args, cpu_args


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,D,H", [(16, 128, 8), (32, 64, 3), (64, 128, 1), (128, 64, 2)])
def test_gpu_small_matches_reference(static, dtype, block_size, D, H):
    _run_gpu_case(37, H, D, 7, block_size, dtype, static, pad_every=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 1025, 4097])
def test_gpu_sizes_and_float64_reference(T):
    args, _ = _run_gpu_case(T, 8, 128, (T + 15) // 16 + 3, 16, torch.float16, False, pad_every=7, seed=T)
    if T <= 1025:
        cpu_args = make_problem(T, 8, 128, (T + 15) // 16 + 3, 16, torch.float16, pad_every=7, seed=T)
        check_against_reference(cpu_args, args[2:6])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_small_strided_special_rows_and_unaligned():
    T, H, D = 33, 2, 64
    qkv = torch.randn(T, 5, D + 1, dtype=torch.bfloat16, device="cuda")[..., 1:]  # rows not 16B aligned
    qkv[2, 3] = 0
    qkv[4, 3, 5] = float("nan")
    qkv[6, 2, 1] = float("inf")
    for key, value in ((qkv[:, 2:4], qkv[:, 3:5]), (qkv[:, 2:4].contiguous(), qkv[:, 3:5].contiguous())):
        outs = []
        for dev in ("cuda", "cpu"):
            kc = torch.zeros(4, H, 16, D, dtype=torch.int8, device=dev)
            vc, ks, vs = torch.zeros_like(kc), torch.zeros(4, H, 16, device=dev), torch.zeros(4, H, 16, device=dev)
            slots = torch.arange(T, dtype=torch.int64, device=dev) * 2 - 1  # slot -1 first
            qops.reshape_and_cache_int8(key.to(dev), value.to(dev), kc, vc, ks, vs, slots)
            outs.append((kc.cpu(), vc.cpu(), ks.cpu(), vs.cpu()))
        for got, want in zip(*outs):
            assert torch.equal(got, want)


# Static scales across the quantizer's fast range (1e-30 <= |s| <= 1e30: one reciprocal, then two
# FMAs per element) and outside it (the IEEE division), with +-Inf and NaN elements: bit-identical
# to the reference either way.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scale", [0.02, 1e-30, 1e30, 3e-31, 2e31, 0.0, float("inf"), float("nan")])
def test_gpu_small_static_scales_at_and_past_the_fast_range(scale):
    T, H, D = 5, 2, 64
    key = torch.randn(T, H, D, dtype=torch.float16) * 100
    key[1, 0, 3], key[2, 1, 7], key[3, 0, 0] = float("inf"), float("-inf"), float("nan")
    value = -key
    kc = torch.zeros(2, H, 16, D, dtype=torch.int8, device="cuda")
    vc = torch.zeros_like(kc)
    s = torch.tensor([scale], device="cuda")
    slots = torch.arange(T, dtype=torch.int64) + 9
    qops.reshape_and_cache_int8(key.cuda(), value.cuda(), kc, vc, s, s.clone(), slots.cuda())
    # The convention's IEEE division, for valid and invalid scales alike (the reference rejects
    # scales that are not finite and > 0; the CUDA kernel reads the scale on the device unchecked).
    for cache, x in ((kc, key), (vc, value)):
        got = cache.cpu()[slots // 16, :, slots % 16]
        assert torch.equal(got, quantize_int8(x.float(), torch.tensor(scale)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_small_out_of_range_slot_never_writes():
    """Release builds skip an out-of-range slot (debug builds trap): nothing outside the cache moves.
    The CUDA glue does not read slot_mapping on the host (no sync), so the reference's error is not
    raised here."""
    big = torch.full((3, 2, 16, 64), SENTINEL, dtype=torch.int8, device="cuda")
    kc = big[1:2]  # a cache of one block inside a larger allocation
    vc = torch.full_like(kc, SENTINEL)
    ks = torch.ones(1, device="cuda")
    key = torch.randn(3, 2, 64, dtype=torch.float16, device="cuda")
    torch.ops.qops.reshape_and_cache_int8(key, key, kc, vc, ks, ks, torch.tensor([16, 5, -7], device="cuda"))
    torch.cuda.synchronize()
    assert bool((big[0] == SENTINEL).all()) and bool((big[2] == SENTINEL).all())
    assert not bool((kc[0, :, 5] == SENTINEL).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_small_bad_inputs():
    args = make_problem(4, 2, 64, 2, 16, torch.float16, device="cuda")
    with pytest.raises(ValueError, match="qops.reshape_and_cache_int8.*slot_mapping must be on"):
        qops.reshape_and_cache_int8(*args[:6], args[6].cpu())
    with pytest.raises(TypeError, match="qops.reshape_and_cache_int8.*key"):
        qops.reshape_and_cache_int8(args[0].float(), *args[1:])
