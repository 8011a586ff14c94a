"""The int4 KV cache: quantize_kv_int4 and dequantize_kv_int4 (the seed-002 rows), the paged cache
write reshape_and_cache_int4, SKVQ's skvq_cache_write (full-precision sinks and window beside the
int4 cache) and the paged int4_gqa_decode (docs/ops.md "int4 KV rows", docs/int4.md)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import qops
from qops.int4_kv import dequantize_kv_int4, kv_int4_row_bytes

OPS = ("quantize_kv_int4", "reshape_and_cache_int4", "skvq_cache_write", "int4_gqa_decode")
HALF = (torch.float16, torch.bfloat16)


# ---- references, independent of qops: numpy float32 scalars, struct, explicit loops --------------
def ref_quantize_row(x: list[float], num_groups: int, clip: float = 1.0) -> bytes:
    """One row, the contract step by step: f32 arithmetic (the clipped range as f32 products),
    fp16 scale/shift, RNE, clamp."""
    d = len(x)
    gs = d // num_groups
    header, q = b"", []
    for g in range(num_groups):
        xs = [np.float32(v) for v in x[g * gs : (g + 1) * gs]]
        lo, hi = min(xs), max(xs)
        if clip != 1.0:
            lo, hi = lo * np.float32(clip), hi * np.float32(clip)
        shift = np.float16(lo)
        scale = np.float16((hi - lo) / np.float32(15))
        header += struct.pack("<ee", float(scale), float(shift))
        for v in xs:
            if scale == 0:
                q.append(0)
            else:
                r = np.rint((v - np.float32(shift)) / np.float32(scale))  # round half to even
                q.append(int(min(max(r, 0), 15)))
    data = bytes(q[2 * j] | (q[2 * j + 1] << 4) for j in range(d // 2))
    return header + data


def ref_quantize(kv: torch.Tensor, num_groups: int, clip: float = 1.0) -> torch.Tensor:
    flat = kv.float().reshape(-1, kv.shape[-1]).tolist()
    rows = [list(ref_quantize_row(r, num_groups, clip)) for r in flat]
    return torch.tensor(rows, dtype=torch.uint8).reshape(*kv.shape[:-1], -1)


def ref_dequantize_row(row: bytes, num_groups: int, d: int) -> list[float]:
    """float32 ``q * scale + shift`` of one row (q * scale is exact in float32)."""
    gs = d // num_groups
    out = []
    for j in range(d):
        g = j // gs
        scale, shift = struct.unpack_from("<ee", row, 4 * g)
        byte = row[4 * num_groups + j // 2]
        q = byte % 16 if j % 2 == 0 else byte // 16
        out.append(float(np.float32(q) * np.float32(scale) + np.float32(shift)))
    return out


def ref_dequantize(rows: torch.Tensor, num_groups: int, d: int) -> torch.Tensor:
    """The same, vectorized in float64 (any size): header read as little-endian fp16."""
    lead = rows.shape[:-1]
    r = rows.reshape(-1, rows.shape[-1]).numpy()
    hdr = np.frombuffer(np.ascontiguousarray(r[:, : 4 * num_groups]).tobytes(), dtype="<f2")
    hdr = hdr.astype(np.float64).reshape(-1, num_groups, 2)
    data = r[:, 4 * num_groups :].astype(np.int64)
    q = np.empty((r.shape[0], d), dtype=np.float64)
    q[:, 0::2], q[:, 1::2] = data % 16, data // 16
    x = q.reshape(-1, num_groups, d // num_groups) * hdr[..., :1] + hdr[..., 1:]
    return torch.from_numpy(x.reshape(*lead, d))


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rand_kv(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # per-head offsets and magnitudes, so the groups' ranges differ
    x = torch.randn(shape, generator=gen) * (torch.rand(shape[:-1], generator=gen) * 3 + 0.1).unsqueeze(-1)
    return (x + torch.randn(shape[:-1], generator=gen).unsqueeze(-1)).to(dtype)


# ---- the row layout ------------------------------------------------------------------------------
@pytest.mark.parametrize("d,g,row_bytes", [(128, 1, 68), (128, 4, 80), (64, 1, 36), (64, 4, 48)])
def test_row_bytes(d, g, row_bytes):
    assert kv_int4_row_bytes(d, g) == row_bytes
    assert qops.quantize_kv_int4(torch.zeros(2, d, dtype=torch.float16), g).shape == (2, row_bytes)


def test_reference_row_loops_agree():
    rows = torch.randint(0, 256, (5, 80), dtype=torch.uint8)
    rows[:, :16] = torch.randn(5, 8).to(torch.float16).view(torch.uint8).reshape(5, 16)
    loops = torch.tensor([ref_dequantize_row(bytes(r.tolist()), 4, 128) for r in rows], dtype=torch.float64)
    torch.testing.assert_close(ref_dequantize(rows, 4, 128), loops, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_quantize_bytes_match_reference(d, g, dtype):
    kv = rand_kv((3, 2, d), dtype, seed=d + g)
    kv[0, 0, : d // 4] = 0.75  # a constant group (the whole row when g = 1 is not constant)
    kv[1, 1] = -2.0  # a constant row: scale 0, q = 0
    rows = qops.quantize_kv_int4(kv, g)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 2, kv_int4_row_bytes(d, g))
    assert rows.is_contiguous()
    assert torch.equal(rows, ref_quantize(kv, g))
    # the constant row: every scale is 0, every shift is -2, all data nibbles are 0
    hdr = rows[1, 1, : 4 * g].view(torch.float16).reshape(g, 2)
    assert (hdr[:, 0] == 0).all() and (hdr[:, 1] == -2).all() and (rows[1, 1, 4 * g :] == 0).all()


def test_quantize_byte_layout_by_hand():
    # One group, min 0, max 15: scale 1, shift 0; ties round to even (2.5 -> 2, 3.5 -> 4, 0.5 -> 0).
    x = torch.zeros(64, dtype=torch.float16)
    x[:6] = torch.tensor([0.0, 15.0, 2.5, 3.5, 0.5, 7.0])
    row = qops.quantize_kv_int4(x, 1)
    assert row.shape == (36,)
    assert bytes(row[:4].tolist()) == struct.pack("<ee", 1.0, 0.0)
    assert row[4:7].tolist() == [0x0 | 0xF << 4, 0x2 | 0x4 << 4, 0x0 | 0x7 << 4]
    assert (row[7:] == 0).all()


@pytest.mark.parametrize("dtype", HALF)
def test_quantize_scale_underflow_stores_zero(dtype):
    # Range 2^-24 (the smallest fp16 subnormal): (max - min) / 15 rounds to an fp16 scale of 0, so
    # every q is 0 (not (x - shift) / 0 = inf -> 15) and the group dequantizes to its shift.
    x = torch.zeros(64, dtype=dtype)
    x[1::2] = 2.0**-24
    row = qops.quantize_kv_int4(x, 1)
    assert struct.unpack("<ee", bytes(row[:4].tolist())) == (0.0, 0.0)
    assert (row[4:] == 0).all()
    assert torch.equal(row, ref_quantize(x, 1))


def test_quantize_group_order():
    # g = 4, D = 64: group i covers channels [16 i, 16 i + 16) and its pair is bytes [4 i, 4 i + 4).
    x = torch.cat([torch.linspace(0, 15, 16) * (i + 1) + 100 * i for i in range(4)]).to(torch.float16)
    row = qops.quantize_kv_int4(x, 4)
    hdr = struct.unpack("<8e", bytes(row[:16].tolist()))
    assert hdr == (1.0, 0.0, 2.0, 100.0, 3.0, 200.0, 4.0, 300.0)
    q = [row[16 + j // 2].item() >> (4 * (j % 2)) & 0xF for j in range(64)]
    assert q == list(range(16)) * 4


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_quantize_dequantize_round_trip(d, g, dtype):
    kv = rand_kv((4, 3, 5, d), dtype, seed=7 * d + g)
    rows = qops.quantize_kv_int4(kv, g)
    x = dequantize_kv_int4(rows, g, d)
    assert x.dtype == torch.float32 and x.shape == kv.shape
    assert torch.equal(x.double(), ref_dequantize(rows, g, d))  # q * scale + shift is exact here
    scale = rows[..., : 4 * g].contiguous().view(torch.float16).reshape(*kv.shape[:-1], g, 2)[..., 0]
    err = (x - kv.float()).reshape(*kv.shape[:-1], g, d // g).abs()
    assert (err <= scale.float().unsqueeze(-1) / 2 * (1 + 1e-3) + 1e-6).all()
    assert torch.equal(dequantize_kv_int4(rows, g, d, dtype), x.to(dtype))


def test_quantize_leading_shapes_and_strides():
    kv = rand_kv((6, 128), torch.bfloat16, seed=11)
    rows = qops.quantize_kv_int4(kv, 4)
    assert torch.equal(qops.quantize_kv_int4(kv[2], 4), rows[2])  # 1-D input
    wide = rand_kv((6, 3, 128), torch.bfloat16, seed=12)
    view = wide[:, 1]  # strided leading dimension
    assert torch.equal(qops.quantize_kv_int4(view, 1), qops.quantize_kv_int4(view.contiguous(), 1))
    assert qops.quantize_kv_int4(torch.empty(0, 4, 64, dtype=torch.float16), 1).shape == (0, 4, 36)
    before = kv.clone()
    qops.quantize_kv_int4(kv, 1)
    assert torch.equal(kv, before)


@pytest.mark.parametrize(
    "kv,g,exc,pattern",
    [
        (torch.randn(2, 128), 1, TypeError, r"kv must be float16 or bfloat16, got float32"),
        (
            torch.randn(2, 96, dtype=torch.float16),
            1,
            ValueError,
            r"kv's last dimension \(the head dim D\) must be 64 or 128, got 96",
        ),
        (torch.randn(2, 128, dtype=torch.float16), 2, ValueError, r"num_groups must be 1 or 4, got 2"),
        (torch.randn(128, 2, dtype=torch.float16).T, 1, ValueError, r"kv's last dimension must be contiguous"),
    ],
)
def test_quantize_bad_input(kv, g, exc, pattern):
    with pytest.raises(exc, match=r"qops\.quantize_kv_int4: " + pattern):
        qops.quantize_kv_int4(kv, g)


def test_dequantize_bad_input():
    rows = torch.zeros(2, 68, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"qops\.dequantize_kv_int4: rows' last dimension must be 80"):
        dequantize_kv_int4(rows, 4, 128)
    with pytest.raises(TypeError, match=r"qops\.dequantize_kv_int4: rows must be uint8"):
        dequantize_kv_int4(rows.to(torch.int8), 1, 128)
    with pytest.raises(ValueError, match=r"qops\.dequantize_kv_int4: head_dim"):
        dequantize_kv_int4(rows, 1, 96)
    with pytest.raises(TypeError, match=r"qops\.dequantize_kv_int4: dtype"):
        dequantize_kv_int4(rows, 1, 128, torch.float64)


@pytest.mark.parametrize("clip", [0.9, 0.5, 0.999])
@pytest.mark.parametrize("g", [1, 4])
def test_quantize_clip_ratio(g, clip):
    kv = rand_kv((4, 2, 128), torch.float16, seed=13 + g)
    rows = qops.quantize_kv_int4(kv, g, clip_ratio=clip)
    assert torch.equal(rows, ref_quantize(kv, g, clip))
    assert not torch.equal(rows, qops.quantize_kv_int4(kv, g))  # the clipped range changes the rows
    assert torch.equal(qops.quantize_kv_int4(kv, g, clip_ratio=1.0), qops.quantize_kv_int4(kv, g))


@pytest.mark.parametrize("clip", [0.0, -0.5, 1.5, float("nan"), float("inf")])
def test_quantize_clip_ratio_out_of_range(clip):
    with pytest.raises(ValueError, match=r"qops\.quantize_kv_int4: clip_ratio must be in \(0, 1\]"):
        qops.quantize_kv_int4(torch.zeros(2, 64, dtype=torch.float16), 1, clip_ratio=clip)


# ---- the paged int4 cache: reshape_and_cache_int4 ------------------------------------------------
def int4_cache(num_blocks, h_kv, bs, d, g, fill=0x11):
    """A pair of paged int4 caches ``[num_blocks, H_kv, bs, row_bytes]`` holding ``fill`` bytes."""
    shape = (num_blocks, h_kv, bs, kv_int4_row_bytes(d, g))
    return torch.full(shape, fill, dtype=torch.uint8), torch.full(shape, fill, dtype=torch.uint8)


def cache_rows(cache: torch.Tensor, slots) -> torch.Tensor:
    """``cache`` at ``slots`` -> ``[len(slots), H_kv, row_bytes]``."""
    bs = cache.shape[2]
    slots = torch.as_tensor(slots, dtype=torch.long)
    return cache[slots // bs, :, slots % bs]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("bs", [16, 32])
def test_cache_write_stores_quantized_rows(bs, g, d, dtype):
    nb, hkv, t = 5, 2, 23
    gen = torch.Generator().manual_seed(bs + g + d)
    key = rand_kv((t, hkv, d), dtype, seed=bs + d)
    value = rand_kv((t, hkv, d), dtype, seed=bs + d + 1)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[3, 11, 17]] = -1  # padding tokens: skipped
    k_cache, v_cache = int4_cache(nb, hkv, bs, d, g)
    qops.reshape_and_cache_int4(key, value, k_cache, v_cache, slots, g)
    keep = slots >= 0
    assert torch.equal(cache_rows(k_cache, slots[keep]), ref_quantize(key[keep], g))
    assert torch.equal(cache_rows(v_cache, slots[keep]), ref_quantize(value[keep], g))
    assert torch.equal(cache_rows(k_cache, slots[keep]), qops.quantize_kv_int4(key[keep], g))
    # every other slot is untouched
    others = torch.ones(nb * bs, dtype=torch.bool)
    others[slots[keep]] = False
    for c in (k_cache, v_cache):
        assert (cache_rows(c, others.nonzero()[:, 0]) == 0x11).all()


def test_cache_write_strided_key_and_empty():
    # key and value as slices of a fused QKV projection: token stride wider than H_kv * D
    qkv = rand_kv((6, 3 * 2 * 64), torch.bfloat16, seed=21)
    key, value = qkv[:, 128:256].view(6, 2, 64), qkv[:, 256:].view(6, 2, 64)
    slots = torch.tensor([5, 0, 31, 7, -1, 16])
    k_cache, v_cache = int4_cache(2, 2, 16, 64, 4)
    qops.reshape_and_cache_int4(key, value, k_cache, v_cache, slots, 4)
    keep = slots >= 0
    assert torch.equal(cache_rows(k_cache, slots[keep]), qops.quantize_kv_int4(key.contiguous()[keep], 4))
    assert torch.equal(cache_rows(v_cache, slots[keep]), qops.quantize_kv_int4(value.contiguous()[keep], 4))
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64, dtype=torch.bfloat16)
    qops.reshape_and_cache_int4(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64), 4)
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("clip", [0.95, 0.7])
def test_cache_write_clip_ratio(clip):
    key = rand_kv((9, 2, 128), torch.float16, seed=31)
    slots = torch.arange(9) * 3
    plain, clipped = int4_cache(2, 2, 16, 128, 1), int4_cache(2, 2, 16, 128, 1)
    qops.reshape_and_cache_int4(key, key, *plain, slots, 1)
    qops.reshape_and_cache_int4(key, key, *clipped, slots, 1, clip_ratio=clip)
    assert torch.equal(cache_rows(clipped[0], slots), ref_quantize(key, 1, clip))
    assert torch.equal(cache_rows(clipped[1], slots), qops.quantize_kv_int4(key, 1, clip_ratio=clip))
    assert not torch.equal(cache_rows(clipped[0], slots), cache_rows(plain[0], slots))


def _write_args(t=3, hkv=2, d=64, g=1, bs=16, nb=4, key_dtype=torch.float16, slots=None, **over):
    key = rand_kv((t, hkv, d), key_dtype, seed=41)
    k_cache, v_cache = int4_cache(nb, hkv, bs, d, g)
    args = dict(
        key=key,
        value=key.clone(),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=torch.tensor(slots if slots is not None else list(range(t))),
        num_groups=g,
    )
    args.update(over)
    return args


_C36 = torch.zeros(4, 2, 16, 36, dtype=torch.uint8)


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(key_dtype=torch.float32), TypeError, r"key must be float16 or bfloat16, got float32"),
        (
            dict(value=torch.zeros(3, 2, 64, dtype=torch.bfloat16)),
            ValueError,
            r"value must have key's dtype torch.float16, got torch.bfloat16",
        ),
        (dict(value=torch.zeros(2, 2, 64, dtype=torch.float16)), ValueError, r"value must have key's shape"),
        (dict(key=torch.zeros(3, 128, dtype=torch.float16)), ValueError, r"key must be \[T, H_kv, D\]"),
        (dict(k_cache=_C36.to(torch.int8)), TypeError, r"k_cache must be uint8, got int8"),
        (dict(v_cache=_C36[:, :1].contiguous()), ValueError, r"v_cache must have k_cache's shape"),
        (dict(k_cache=_C36[0], v_cache=_C36[0]), ValueError, r"k_cache must be uint8 \[num_blocks, H_kv, block_size"),
        (dict(k_cache=_C36.transpose(1, 2), v_cache=_C36.transpose(1, 2)), ValueError, r"k_cache must be contiguous"),
        (dict(num_groups=2), ValueError, r"num_groups must be 1 or 4, got 2"),
        (
            dict(bs=8, slots=[0, 1, 2]),
            ValueError,
            r"block_size \(k_cache.shape\[2\]\) must be one of \(16, 32, 64, 128\), got 8",
        ),
        (dict(g=4, num_groups=1), ValueError, r"k_cache's row bytes \(48\) must be 4 \* num_groups \+ D / 2"),
        (
            dict(hkv=2, k_cache=_C36[:, :1].contiguous(), v_cache=_C36[:, :1].contiguous()),
            ValueError,
            r"key's \[H_kv, D\]",
        ),
        (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), TypeError, r"slot_mapping must be int64"),
        (dict(slot_mapping=torch.tensor([0, 1])), ValueError, r"slot_mapping must be int64 \[T\] with T = 3"),
        (dict(clip_ratio=0.0), ValueError, r"clip_ratio must be in \(0, 1\], got 0.0"),
        (dict(clip_ratio=1.25), ValueError, r"clip_ratio must be in \(0, 1\], got 1.25"),
        (dict(slots=[0, 1, 64]), ValueError, r"slot_mapping holds slots outside \[-1, num_blocks \* block_size = 64\)"),
        (dict(slots=[0, -2, 1]), ValueError, r"slot_mapping holds slots outside .*\[-2\]"),
        (dict(slots=[5, 7, 5]), ValueError, r"slot_mapping maps several tokens to one slot: \[5\]"),
    ],
)
def test_cache_write_bad_input(over, exc, pattern):
    shape_opts = ("t", "hkv", "d", "g", "bs", "nb", "key_dtype", "slots")
    args = _write_args(**{k: over.pop(k) for k in list(over) if k in shape_opts})
    args.update(over)
    clip = args.pop("clip_ratio", 1.0)
    before = args["k_cache"].clone()
    with pytest.raises(exc, match=r"qops\.reshape_and_cache_int4: " + pattern):
        qops.reshape_and_cache_int4(**args, clip_ratio=clip)
    assert torch.equal(args["k_cache"], before)  # nothing written


# ---- the paged int4 decode -----------------------------------------------------------------------
def ref_decode(query, keys, values, sm_scale) -> torch.Tensor:
    """float64 ``softmax(sm_scale q K^T) V`` per (b, h), kv head ``h // (HQ / H_kv)``, over each
    sequence's own ``keys[b]``, ``values[b]`` (float ``[L_b, H_kv, D]``); zeros for ``L_b = 0``."""
    b_, hq, d = query.shape
    out = torch.zeros(b_, hq, d, dtype=torch.float64)
    for b in range(b_):
        kk, vv = keys[b].double(), values[b].double()
        if kk.shape[0] == 0:
            continue
        rep = hq // kk.shape[1]
        for h in range(hq):
            s = sm_scale * (kk[:, h // rep] @ query[b, h].double())
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vv[:, h // rep]
    return out


def paged_tables(lens, bs, extra_blocks=3, seed=0):
    """Block tables int32 ``[B, max_blocks]`` of shuffled distinct block ids for sequences of
    ``lens`` tokens (entries past a sequence's blocks hold an out-of-range id: never read), and the
    number of blocks."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    width = max([*need, 1])
    num_blocks = sum(need) + extra_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), width), num_blocks + 1000, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return table, num_blocks


def slots_of(table, b, positions, bs) -> torch.Tensor:
    pos = torch.as_tensor(positions, dtype=torch.long)
    return table[b, pos // bs].long() * bs + pos % bs


def make_paged(lens, h_kv, hq, d, g, dtype, bs=16, seed=0):
    """Query, paged int4 caches (garbage bytes, NaN headers, in every slot no token owns), block
    tables, seq_lens, and each sequence's K/V rows ``[L, H_kv, row_bytes]``."""
    gen = torch.Generator().manual_seed(seed)
    table, nb = paged_tables(lens, bs, seed=seed)
    query = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    k_cache, v_cache = int4_cache(nb, h_kv, bs, d, g, fill=0x7C)  # 0x7C7C: an fp16 NaN header
    k_rows, v_rows = [], []
    for b, n in enumerate(lens):
        kr = qops.quantize_kv_int4(rand_kv((n, h_kv, d), dtype, seed=seed + 10 * b + 1), g)
        vr = qops.quantize_kv_int4(rand_kv((n, h_kv, d), dtype, seed=seed + 10 * b + 2), g)
        s = slots_of(table, b, range(n), bs)
        k_cache[s // bs, :, s % bs] = kr
        v_cache[s // bs, :, s % bs] = vr
        k_rows.append(kr)
        v_rows.append(vr)
    return query, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), k_rows, v_rows


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("hq,h_kv", [(2, 2), (8, 2), (7, 1), (6, 3)])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_matches_float64(bs, d, g, hq, h_kv, dtype):
    lens = [37, 0, 1, 16, 64]  # several blocks, empty, one token, one block exactly, aligned
    query, kc, vc, table, seq_lens, k_rows, v_rows = make_paged(lens, h_kv, hq, d, g, dtype, bs, seed=d + g + hq)
    sm_scale = d**-0.5
    out = qops.int4_gqa_decode(query, kc, vc, table, seq_lens, sm_scale, g)
    assert out.shape == query.shape and out.dtype == dtype
    assert (out[1] == 0).all()  # seq_len 0 gives zeros

    # The contract on exactly dequantized rows, f32 softmax and accumulation, one rounding.
    keys = [ref_dequantize(r, g, d) for r in k_rows]
    values = [ref_dequantize(r, g, d) for r in v_rows]
    ref = ref_decode(query, keys, values, sm_scale)
    torch.testing.assert_close(out.double(), ref, rtol=2 * eps(dtype), atol=2 * eps(dtype))


def test_decode_reads_only_its_blocks_and_num_splits():
    lens = [5, 40, 0]
    query, kc, vc, table, seq_lens, _, _ = make_paged(lens, 2, 8, 128, 4, torch.bfloat16, 16, seed=3)
    out = qops.int4_gqa_decode(query, kc, vc, table, seq_lens, 0.1, 4)
    assert torch.isfinite(out.float()).all()  # the NaN-header slots of no token were never read
    # garbage in sequence 0's block past its 5 tokens, and a table padded with other ids
    kc2, vc2 = kc.clone(), vc.clone()
    blk = int(table[0, 0])
    kc2[blk, :, 5:] = torch.randint(0, 256, kc2[blk, :, 5:].shape, dtype=torch.uint8)
    vc2[blk, :, 5:] = 0xFF
    table2 = table.clone()
    table2[2] = -7  # sequence 2 is empty: its table is never read
    for splits in (0, 1, 3, 64):
        assert torch.equal(qops.int4_gqa_decode(query, kc2, vc2, table2, seq_lens, 0.1, 4, num_splits=splits), out)
    before = [t.clone() for t in (query, kc, vc, table, seq_lens)]
    qops.int4_gqa_decode(query, kc, vc, table, seq_lens, 0.1, 4)
    assert all(torch.equal(x, y) for x, y in zip(before, (query, kc, vc, table, seq_lens)))


def test_decode_single_token_returns_its_value():
    # L = 1: softmax is 1, out = V[0] (dequantized exactly, rounded to the query dtype) for every head.
    query, kc, vc, table, seq_lens, _, v_rows = make_paged([1], 2, 6, 64, 1, torch.float16, seed=4)
    out = qops.int4_gqa_decode(query, kc, vc, table, seq_lens, 1.0, 1)
    v0 = dequantize_kv_int4(v_rows[0][0], 1, 64, torch.float16)  # [H_kv, D]
    assert torch.equal(out[0], v0.repeat_interleave(3, dim=0))


def test_decode_with_uniform_scores_averages_values():
    # sm_scale 0: uniform attention over the first L tokens.
    query, kc, vc, table, seq_lens, _, v_rows = make_paged([9, 4], 1, 2, 128, 4, torch.bfloat16, seed=5)
    out = qops.int4_gqa_decode(query, kc, vc, table, seq_lens, 0.0, 4)
    vd = ref_dequantize(v_rows[1], 4, 128)
    torch.testing.assert_close(out[1, 0].double(), vd[:, 0].mean(0), rtol=eps(torch.bfloat16), atol=1e-5)


# ---- SKVQ: skvq_cache_write + int4_gqa_decode with sinks and a window ----------------------------
def schedule(length: int, window: int) -> list[int]:
    """How a sequence of ``length`` tokens is written: a prefill chunk (longer than the window
    where the length allows), chunks shorter than the window, then single decode tokens (the last
    four)."""
    tail = min(4, max(0, length - 1))
    body = length - tail
    out = [min(body, 2 * window + 3)] if body else []
    left = body - sum(out)
    short = max(1, window // 2 - 1) if window else 5
    while left > 0:
        out.append(min(short, left))
        left -= out[-1]
    return out + [1] * tail


def skvq_expected(query, hist_k, hist_v, lens, sinks, window, g, clip, sm_scale):
    """The independent float64 check: position ``p`` of a sequence of ``L`` tokens attends with
    its exact fp K/V when ``p < sinks`` or ``p >= L - window``, else with its int4 round trip."""
    keys, values = [], []
    for b, n in enumerate(lens):
        fp = torch.zeros(n, dtype=torch.bool)
        fp[: min(sinks, n)] = True
        fp[max(0, n - window) :] = True
        ks, vs = [], []
        for x, out in ((hist_k[b][:n], ks), (hist_v[b][:n], vs)):
            deq = dequantize_kv_int4(qops.quantize_kv_int4(x, g, clip_ratio=clip), g, x.shape[-1]).double()
            out.append(torch.where(fp[:, None, None], x.double(), deq))
        keys.append(ks[0])
        values.append(vs[0])
    return ref_decode(query, keys, values, sm_scale)


SKVQ_CASES = [
    # (HQ, H_kv, D, num_groups, sinks, window, block_size, clip)
    (2, 2, 64, 1, 4, 16, 16, 1.0),  # MHA (ratio 1)
    (8, 2, 128, 4, 4, 16, 32, 1.0),  # GQA 4
    (7, 1, 64, 4, 2, 5, 16, 1.0),  # HQ 7, one kv head: MQA, an odd window
    (4, 1, 128, 1, 0, 16, 16, 1.0),  # MQA, window only
    (6, 2, 64, 1, 4, 0, 16, 1.0),  # sinks only
    (8, 2, 64, 1, 4, 8, 16, 0.9),  # SKVQ's clipped int4 outside the window
    (8, 2, 128, 1, 1, 32, 32, 1.0),  # window of a whole block
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", SKVQ_CASES, ids=lambda c: "hq{}-hkv{}-d{}-g{}-s{}-w{}-bs{}-c{}".format(*c))
def test_skvq_write_and_decode_match_float64(case, dtype):
    hq, hkv, d, g, sinks, window, bs, clip = case
    side_len = sinks + window
    # lengths: 0, 1, shorter than sinks + window, equal, a little and much longer
    lens = [0, 1, max(2, side_len - 3), side_len, side_len + 2, 3 * side_len + 41]
    b = len(lens)
    gen = torch.Generator().manual_seed(hq + d + sinks + window)
    hist_k = [rand_kv((n, hkv, d), dtype, seed=100 * i + d) for i, n in enumerate(lens)]
    hist_v = [rand_kv((n, hkv, d), dtype, seed=100 * i + d + 1) for i, n in enumerate(lens)]
    table, nb = paged_tables(lens, bs, seed=window)
    k_cache, v_cache = int4_cache(nb, hkv, bs, d, g, fill=0x7C)
    num_side = b + 2
    k_side = torch.full((num_side, hkv, side_len, d), float("nan"), dtype=dtype)
    v_side = k_side.clone()
    side_slots = torch.randperm(num_side, generator=gen)[:b].int()
    query = torch.randn(b, hq, d, generator=gen).to(dtype)
    sm_scale = d**-0.5
    plans = [schedule(n, window) for n in lens]
    written = [0] * b
    for r in range(max(len(p) for p in plans)):
        new = [p[r] if r < len(p) else 0 for p in plans]
        key = torch.cat([hist_k[i][written[i] : written[i] + n] for i, n in enumerate(new)])
        value = torch.cat([hist_v[i][written[i] : written[i] + n] for i, n in enumerate(new)])
        written = [w + n for w, n in zip(written, new)]
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(written, dtype=torch.int32)
        qops.skvq_cache_write(
            key, value, k_cache, v_cache, k_side, v_side, table, side_slots, seq_lens, cu, g, sinks, window,
            clip_ratio=clip,
        )  # fmt: skip
        out = qops.int4_gqa_decode(
            query, k_cache, v_cache, table, seq_lens, sm_scale, g,
            k_side=k_side, v_side=v_side, side_slots=side_slots, sinks=sinks, window=window,
        )  # fmt: skip
        ref = skvq_expected(query, hist_k, hist_v, written, sinks, window, g, clip, sm_scale)
        torch.testing.assert_close(out.double(), ref, rtol=2 * eps(dtype), atol=2 * eps(dtype), msg=f"round {r}")
        assert (out[0] == 0).all()
    assert written == lens
    # the int4 rows of every position outside the sinks and the window are the quantized tokens
    for i, n in enumerate(lens):
        lo, hi = min(sinks, n), max(min(sinks, n), n - window)
        s = slots_of(table, i, range(lo, hi), bs)
        want = qops.quantize_kv_int4(hist_k[i][lo:hi], g, clip_ratio=clip)
        assert torch.equal(cache_rows(k_cache, s), want)
        # and the sinks are in the side buffer, exactly
        assert torch.equal(k_side[side_slots[i], :, :lo], hist_k[i][:lo].transpose(0, 1))
    # side slots that no sequence owns are untouched
    unused = sorted(set(range(num_side)) - set(side_slots.tolist()))
    assert torch.isnan(k_side[unused].float()).all()


@pytest.mark.parametrize("window", [0, 1])
def test_skvq_small_windows_and_the_plain_int4_cache(window):
    """sinks = window = 0 (empty side buffers): skvq_cache_write writes what reshape_and_cache_int4
    writes, bit for bit, in any pieces. window = 1: the same rows for every token but each
    sequence's newest, which sits in the side buffer."""
    lens = [30, 17]
    hist = [rand_kv((n, 2, 64), torch.float16, seed=50 + n) for n in lens]
    table, nb = paged_tables(lens, 16)
    kc, vc = int4_cache(nb, 2, 16, 64, 1)
    ks = torch.zeros(2, 2, window, 64, dtype=torch.float16)
    vs = ks.clone()
    side = torch.tensor([1, 0], dtype=torch.int32)
    written = [0, 0]
    for new in ([20, 3], [5, 10], [1, 1], [4, 3]):  # a prefill, chunks, decode tokens
        key = torch.cat([hist[i][written[i] : written[i] + n] for i, n in enumerate(new)])
        written = [w + n for w, n in zip(written, new)]
        cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
        qops.skvq_cache_write(
            key, key, kc, vc, ks, vs, table, side, torch.tensor(written, dtype=torch.int32), cu, 1, 0, window
        )
    assert written == lens
    plain_k, plain_v = int4_cache(nb, 2, 16, 64, 1)
    slots = torch.cat([slots_of(table, b, range(n), 16) for b, n in enumerate(lens)])
    key = torch.cat(hist)
    qops.reshape_and_cache_int4(key, key, plain_k, plain_v, slots, 1)
    newest = torch.tensor([29, 30 + 16])
    older = torch.ones(47, dtype=torch.bool)
    if window:
        older[newest] = False
        assert torch.equal(ks[side.long(), :, 0], key[newest])
    assert torch.equal(cache_rows(kc, slots[older]), cache_rows(plain_k, slots[older]))
    assert torch.equal(cache_rows(vc, slots[older]), cache_rows(plain_v, slots[older]))


def _skvq_args(**over):
    lens = over.pop("lens", [5, 3])
    new = over.pop("new", lens)
    d, hkv, bs, sinks, window = 64, 2, 16, 2, 4
    table, nb = paged_tables(lens, bs)
    kc, vc = int4_cache(nb, hkv, bs, d, 1)
    side = torch.zeros(3, hkv, sinks + window, d, dtype=torch.float16)
    key = rand_kv((sum(new), hkv, d), torch.float16, seed=61)
    args = dict(
        key=key,
        value=key.clone(),
        k_cache=kc,
        v_cache=vc,
        k_side=side,
        v_side=side.clone(),
        block_tables=table,
        side_slots=torch.tensor([2, 0], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        num_groups=1,
        sinks=sinks,
        window=window,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(key=torch.zeros(8, 2, 64)), TypeError, r"key must be float16 or bfloat16, got float32"),
        (
            dict(k_side=torch.zeros(3, 2, 6, 64, dtype=torch.bfloat16)),
            TypeError,
            r"k_side must be float16, got bfloat16",
        ),
        (
            dict(k_side=torch.zeros(3, 2, 7, 64, dtype=torch.float16)),
            ValueError,
            r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\] = \[\*, 2, 6, 64\]",
        ),
        (dict(v_side=torch.zeros(4, 2, 6, 64, dtype=torch.float16)), ValueError, r"v_side must have k_side's shape"),
        (dict(side_slots=torch.tensor([2, 0])), TypeError, r"side_slots must be int32, got int64"),
        (dict(side_slots=torch.tensor([2], dtype=torch.int32)), ValueError, r"side_slots must be int32 \[B\] = \[2\]"),
        (dict(sinks=-1), ValueError, r"sinks and window must be >= 0, got -1 and 4"),
        (
            dict(sinks=0, window=0),  # then the side buffers hold no token: [*, H_kv, 0, D]
            ValueError,
            r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\] = \[\*, 2, 0, 64\], "
            r"got shape \(3, 2, 6, 64\)",
        ),
        (dict(block_tables=torch.zeros(2, 1)), TypeError, r"block_tables must be int32, got float32"),
        (
            dict(block_tables=torch.zeros(3, 1, dtype=torch.int32)),
            ValueError,
            r"block_tables must be int32 \[B, max_blocks\] with B = 2",
        ),
        (dict(seq_lens=torch.tensor([5, 3])), TypeError, r"seq_lens must be int32, got int64"),
        (dict(cu_seqlens=torch.tensor([0, 5, 8])), TypeError, r"cu_seqlens must be int32, got int64"),
        (
            dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens must be int32 \[B \+ 1\] = \[3\]",
        ),
        (dict(clip_ratio=2.0), ValueError, r"clip_ratio must be in \(0, 1\]"),
        (dict(num_groups=4), ValueError, r"k_cache's row bytes \(36\) must be 4 \* num_groups \+ D / 2"),
        # values (checked by the reference on the host; the CUDA kernel does not read them there)
        (
            dict(cu_seqlens=torch.tensor([0, 6, 8], dtype=torch.int32)),
            ValueError,
            r"sequence 0 gets 6 new tokens but seq_lens\[0\] = 5",
        ),
        (
            dict(cu_seqlens=torch.tensor([0, 5, 7], dtype=torch.int32)),
            ValueError,
            r"cu_seqlens must rise from 0 to T = 8",
        ),
        (
            dict(seq_lens=torch.tensor([17, 3], dtype=torch.int32)),
            ValueError,
            r"seq_lens must be in \[0, max_blocks \* block_size = 16\]",
        ),
        (
            dict(side_slots=torch.tensor([3, 0], dtype=torch.int32)),
            ValueError,
            r"side_slots must lie in \[0, 3\), got \[3\]",
        ),
        (
            dict(block_tables=torch.tensor([[9], [0]], dtype=torch.int32)),
            ValueError,
            r"block_tables hold block ids outside \[0, num_blocks = 5\)",
        ),
    ],
)
def test_skvq_write_bad_input(over, exc, pattern):
    clip = over.pop("clip_ratio", 1.0)
    args = _skvq_args(**over)
    with pytest.raises(exc, match=r"qops\.skvq_cache_write: " + pattern):
        qops.skvq_cache_write(**args, clip_ratio=clip)


def _decode_args(**over):
    query, kc, vc, table, seq_lens, _, _ = make_paged([8, 3], 2, 6, 128, 4, torch.float16, seed=7)
    args = dict(query=query, k_cache=kc, v_cache=vc, block_tables=table, seq_lens=seq_lens, sm_scale=0.1, num_groups=4)
    args.update(over)
    return args


_K80 = torch.zeros(2, 2, 16, 80, dtype=torch.uint8)
_SIDE = torch.zeros(3, 2, 6, 128, dtype=torch.float16)
_SKVQ = dict(k_side=_SIDE, v_side=_SIDE, side_slots=torch.tensor([0, 2], dtype=torch.int32), sinks=2, window=4)


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(query=torch.randn(2, 6, 128)), TypeError, r"query must be float16 or bfloat16, got float32"),
        (dict(query=torch.randn(6, 128, dtype=torch.float16)), ValueError, r"query must be \[B, HQ, D\]"),
        (
            dict(query=torch.randn(2, 6, 64, dtype=torch.float16)),
            ValueError,
            r"query's D = 64 must match the cache's D = 128 \(row bytes 80\)",
        ),
        (dict(num_groups=2), ValueError, r"num_groups must be 1 or 4, got 2"),
        (dict(k_cache=_K80.to(torch.int8)), TypeError, r"k_cache must be uint8, got int8"),
        (dict(v_cache=_K80.float()), TypeError, r"v_cache must be uint8, got float32"),
        (dict(v_cache=_K80[:1]), ValueError, r"v_cache must have k_cache's shape"),
        (
            dict(k_cache=_K80[:, :, :, None]),
            ValueError,
            r"k_cache must be uint8 \[num_blocks, H_kv, block_size, row_bytes\]",
        ),
        (
            dict(
                k_cache=torch.zeros(2, 2, 16, 68, dtype=torch.uint8),
                v_cache=torch.zeros(2, 2, 16, 68, dtype=torch.uint8),
            ),
            ValueError,
            r"k_cache's row bytes \(68\) must be 4 \* num_groups \+ D / 2 for D in \(64, 128\) "
            r"\(\[48, 80\] with num_groups = 4\)",
        ),
        (
            dict(
                k_cache=torch.zeros(2, 2, 24, 80, dtype=torch.uint8),
                v_cache=torch.zeros(2, 2, 24, 80, dtype=torch.uint8),
            ),
            ValueError,
            r"block_size \(k_cache.shape\[2\]\) must be one of \(16, 32, 64, 128\), got 24",
        ),
        (
            dict(
                k_cache=torch.zeros(2, 4, 16, 80, dtype=torch.uint8),
                v_cache=torch.zeros(2, 4, 16, 80, dtype=torch.uint8),
            ),
            ValueError,
            r"the number of query heads \(6\) must be a multiple of the number of kv heads \(4\)",
        ),
        (dict(block_tables=torch.zeros(2, 1, dtype=torch.int64)), TypeError, r"block_tables must be int32, got int64"),
        (
            dict(block_tables=torch.zeros(2, 0, dtype=torch.int32)),
            ValueError,
            r"block_tables must be int32 \[B, max_blocks\]",
        ),
        (dict(seq_lens=torch.tensor([8, 3])), TypeError, r"seq_lens must be int32, got int64"),
        (dict(seq_lens=torch.tensor([8], dtype=torch.int32)), ValueError, r"seq_lens must be int32 \[B\] = \[2\]"),
        (dict(num_splits=-1), ValueError, r"num_splits must be >= 0"),
        (dict(sinks=2), ValueError, r"sinks and window need the side buffers k_side, v_side and side_slots"),
        (dict(_SKVQ, v_side=None), ValueError, r"k_side, v_side and side_slots go together"),
        (dict(_SKVQ, sinks=0, window=0), ValueError, r"side buffers were given with sinks = window = 0"),
        (
            dict(_SKVQ, window=5),
            ValueError,
            r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\] = \[\*, 2, 7, 128\]",
        ),
        (
            dict(_SKVQ, k_side=_SIDE.bfloat16(), v_side=_SIDE.bfloat16()),
            TypeError,
            r"k_side must be float16, got bfloat16",
        ),
        (dict(_SKVQ, side_slots=torch.tensor([0, 2])), TypeError, r"side_slots must be int32, got int64"),
        # values (checked by the reference on the host)
        (
            dict(seq_lens=torch.tensor([33, 3], dtype=torch.int32)),
            ValueError,
            r"seq_lens must be in \[0, max_blocks \* block_size = 16\]",
        ),
        (dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, r"seq_lens must be in"),
        (
            dict(_SKVQ, side_slots=torch.tensor([0, 3], dtype=torch.int32)),
            ValueError,
            r"side_slots must lie in \[0, 3\), got \[3\]",
        ),
    ],
)
def test_decode_bad_input(over, exc, pattern):
    args = _decode_args(**over)
    num_splits = args.pop("num_splits", 0)
    with pytest.raises(exc, match=r"qops\.int4_gqa_decode: " + pattern):
        qops.int4_gqa_decode(**args, num_splits=num_splits)


def test_decode_bad_block_id():
    args = _decode_args()
    args["block_tables"] = args["block_tables"].clone()
    args["block_tables"][1, 0] = args["k_cache"].shape[0]
    with pytest.raises(ValueError, match=r"qops\.int4_gqa_decode: block_tables hold block ids outside"):
        qops.int4_gqa_decode(**args)


# ---- op registration -----------------------------------------------------------------------------
# torch.library.opcheck's tests but test_aot_dispatch_dynamic, which runs below on its own
STATIC_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


def _opcheck_cases():
    query, kc, vc, table, seq_lens, _, _ = make_paged([6, 2], 2, 6, 64, 4, torch.float16)
    side = torch.randn(2, 2, 5, 64).half()
    skvq = (side, side.clone(), torch.tensor([1, 0], dtype=torch.int32), 1, 4, 0)
    return {
        "quantize_kv_int4": [
            ((rand_kv((3, 2, 64), torch.bfloat16), 1), {}),
            ((rand_kv((3, 2, 64), torch.bfloat16), 4), {"clip_ratio": 0.9}),
        ],
        "reshape_and_cache_int4": [
            (tuple(_write_args(g=1, slots=[4, -1, 17]).values()), {"clip_ratio": 0.8}),
            (tuple(_write_args(g=4, slots=[0, 9, 63]).values()), {}),
        ],
        "skvq_cache_write": [(tuple(_skvq_args().values()), {})],
        "int4_gqa_decode": [
            ((query, kc, vc, table, seq_lens, 0.125, 4), {}),
            ((query, kc, vc, table, seq_lens, 0.125, 4, *skvq), {}),
        ],
    }


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    for args, kwargs in _opcheck_cases()[name]:
        torch.library.opcheck(getattr(torch.ops.qops, name).default, args, kwargs, test_utils=STATIC_CHECKS)


@pytest.mark.parametrize("name", OPS)
def test_opcheck_dynamic_shapes(name):
    for args, kwargs in _opcheck_cases()[name]:
        torch.library.opcheck(
            getattr(torch.ops.qops, name).default, args, kwargs, test_utils=("test_aot_dispatch_dynamic",)
        )


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only torch build")
@pytest.mark.parametrize("name", OPS)
def test_no_cuda_kernel_in_cpu_build(name):
    assert name in qops.op_names()
    assert not qops.has_cuda_kernel(name)


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
@pytest.mark.parametrize("name", OPS)
def test_cuda_without_kernel_raises(name):
    if qops.has_cuda_kernel(name):
        pytest.skip(f"this build has a CUDA kernel for {name}")
    query, kc, vc, table, seq_lens, _, _ = make_paged([6, 2], 2, 6, 64, 1, torch.float16)
    cuda = lambda ts: tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in ts)
    args = {
        "quantize_kv_int4": cuda((rand_kv((3, 2, 64), torch.float16), 1)),
        "reshape_and_cache_int4": cuda(tuple(_write_args().values())),
        "skvq_cache_write": cuda(tuple(_skvq_args().values())),
        "int4_gqa_decode": cuda((query, kc, vc, table, seq_lens, 0.125, 1)),
    }[name]
    with pytest.raises(NotImplementedError, match=rf"qops\.{name}"):
        getattr(torch.ops.qops, name)(*args)
