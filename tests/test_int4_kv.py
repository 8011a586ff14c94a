"""quantize_kv_int4 / int4_gqa_decode and dequantize_kv_int4: the seed-002 int4 KV rows
(docs/ops.md "int4 KV rows", docs/int4.md)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import qops
from qops.int4_kv import dequantize_kv_int4, kv_int4_row_bytes

OPS = ("quantize_kv_int4", "int4_gqa_decode")
HALF = (torch.float16, torch.bfloat16)


# ---- references, independent of qops: numpy float32 scalars, struct, explicit loops --------------
def ref_quantize_row(x: list[float], num_groups: int) -> bytes:
    """One row, the contract step by step: f32 arithmetic, fp16 scale/shift, RNE, clamp."""
    d = len(x)
    gs = d // num_groups
    header, q = b"", []
    for g in range(num_groups):
        xs = [np.float32(v) for v in x[g * gs : (g + 1) * gs]]
        lo, hi = min(xs), max(xs)
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


def ref_quantize(kv: torch.Tensor, num_groups: int) -> torch.Tensor:
    flat = kv.float().reshape(-1, kv.shape[-1]).tolist()
    rows = [list(ref_quantize_row(r, num_groups)) for r in flat]
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


def ref_decode(query, k_deq, v_deq, seq_lens, sm_scale) -> torch.Tensor:
    """float64 softmax(sm_scale q K^T) V per (b, h), kv head h // (HQ / H_kv); zeros for L = 0."""
    b_, hq, d = query.shape
    rep = hq // k_deq.shape[2]
    out = torch.zeros(b_, hq, d, dtype=torch.float64)
    for b in range(b_):
        n = int(seq_lens[b])
        if n == 0:
            continue
        for h in range(hq):
            kk, vv = k_deq[b, :n, h // rep].double(), v_deq[b, :n, h // rep].double()
            s = sm_scale * (kk @ query[b, h].double())
            p = torch.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ vv
    return out


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


# ---- int4_gqa_decode -----------------------------------------------------------------------------
def make_decode(b, t_max, h_kv, ratio, d, g, dtype, seq_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, h_kv * ratio, d, generator=gen).to(dtype)
    k = qops.quantize_kv_int4(rand_kv((b, t_max, h_kv, d), dtype, seed=seed + 1), g)
    v = qops.quantize_kv_int4(rand_kv((b, t_max, h_kv, d), dtype, seed=seed + 2), g)
    return query, k, v, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("ratio", [1, 3, 8])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_matches_float64(d, g, ratio, dtype):
    seq_lens = [19, 0, 1, 13]  # full, empty, one token, partial
    query, k, v, lens = make_decode(4, 19, 2, ratio, d, g, dtype, seq_lens, seed=d + g + ratio)
    sm_scale = d**-0.5
    out = qops.int4_gqa_decode(query, k, v, lens, sm_scale, g)
    assert out.shape == query.shape and out.dtype == dtype
    assert (out[1] == 0).all()  # seq_len 0 gives zeros

    # The contract on exactly dequantized rows: the cache's rounding to dtype and f32 softmax.
    ref = ref_decode(query, ref_dequantize(k, g, d), ref_dequantize(v, g, d), lens, sm_scale)
    torch.testing.assert_close(out.double(), ref, rtol=8 * eps(dtype), atol=8 * eps(dtype))
    # Rows dequantized to the query's dtype (the MMA operand type): out is ref rounded once.
    ref_q = ref_decode(query, ref_dequantize(k, g, d).to(dtype), ref_dequantize(v, g, d).to(dtype), lens, sm_scale)
    torch.testing.assert_close(out.double(), ref_q, rtol=eps(dtype), atol=1e-5)


def test_decode_ignores_tokens_past_seq_len_and_num_splits():
    query, k, v, lens = make_decode(3, 24, 2, 4, 128, 4, torch.bfloat16, [5, 24, 0], seed=3)
    out = qops.int4_gqa_decode(query, k, v, lens, 0.1, 4)
    k2, v2 = k.clone(), v.clone()
    k2[0, 5:] = torch.randint(0, 256, k2[0, 5:].shape, dtype=torch.uint8)  # garbage past seq_len
    v2[0, 5:] = 0xFF
    k2[2] = 0x7C  # NaN scales/shifts (0x7C7C): sequence 2 is empty, never read
    for splits in (0, 1, 7, 64):
        assert torch.equal(qops.int4_gqa_decode(query, k2, v2, lens, 0.1, 4, num_splits=splits), out)
    before = [t.clone() for t in (query, k, v, lens)]
    qops.int4_gqa_decode(query, k, v, lens, 0.1, 4)
    assert all(torch.equal(x, y) for x, y in zip(before, (query, k, v, lens)))


def test_decode_single_token_returns_its_value():
    # L = 1: softmax is 1, out = V[0] (dequantized to the query dtype) for every query head.
    query, k, v, lens = make_decode(1, 4, 2, 3, 64, 1, torch.float16, [1], seed=4)
    out = qops.int4_gqa_decode(query, k, v, lens, 1.0, 1)
    v0 = dequantize_kv_int4(v[0, 0], 1, 64, torch.float16)  # [H_kv, D]
    assert torch.equal(out[0], v0.repeat_interleave(3, dim=0))


def test_decode_with_uniform_scores_averages_values():
    # sm_scale 0: uniform attention over the first L tokens.
    query, k, v, lens = make_decode(2, 9, 1, 2, 128, 4, torch.bfloat16, [9, 4], seed=5)
    out = qops.int4_gqa_decode(query, k, v, lens, 0.0, 4)
    vd = ref_dequantize(v, 4, 128).to(torch.bfloat16).double()
    torch.testing.assert_close(out[1, 0].double(), vd[1, :4, 0].mean(0), rtol=eps(torch.bfloat16), atol=1e-5)


def _decode_args(**over):
    query, k, v, lens = make_decode(2, 8, 2, 3, 128, 4, torch.float16, [8, 3])
    args = dict(query=query, k=k, v=v, seq_lens=lens, sm_scale=0.1, num_groups=4)
    args.update(over)
    return args


_K80 = torch.zeros(2, 8, 2, 80, dtype=torch.uint8)
_K68 = torch.zeros(2, 8, 2, 68, dtype=torch.uint8)


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(query=torch.randn(2, 6, 128)), TypeError, r"query must be float16 or bfloat16, got float32"),
        (dict(query=torch.randn(6, 128, dtype=torch.float16)), ValueError, r"query must be 3-D"),
        (
            dict(query=torch.randn(2, 6, 96, dtype=torch.float16)),
            ValueError,
            r"query's last dimension \(the head dim D\) must be 64 or 128, got 96",
        ),
        (dict(num_groups=2), ValueError, r"num_groups must be 1 or 4, got 2"),
        (dict(k=_K80.to(torch.int8)), TypeError, r"k must be uint8"),
        (dict(v=_K80.float()), TypeError, r"v must be uint8"),
        (
            dict(k=_K68, v=_K68),
            ValueError,
            r"k must be \[B, T_max, H_kv, 4 \* num_groups \+ D / 2\] = \[2, T_max, H_kv, 80\]",
        ),
        (dict(k=_K80[:, :, :, None]), ValueError, r"k must be \[B, T_max, H_kv"),
        (dict(k=torch.zeros(3, 8, 2, 80, dtype=torch.uint8)), ValueError, r"k must be \[B, T_max, H_kv"),
        (dict(v=torch.zeros(2, 9, 2, 80, dtype=torch.uint8)), ValueError, r"v must have k's shape"),
        (
            dict(k=torch.zeros(2, 8, 4, 80, dtype=torch.uint8), v=torch.zeros(2, 8, 4, 80, dtype=torch.uint8)),
            ValueError,
            r"HQ \(query.shape\[1\] = 6\) must be a multiple of H_kv \(k.shape\[2\] = 4\)",
        ),
        (dict(seq_lens=torch.tensor([8, 3])), TypeError, r"seq_lens must be int32, got int64"),
        (dict(seq_lens=torch.tensor([8], dtype=torch.int32)), ValueError, r"seq_lens must be \[B\] = \[2\]"),
        (dict(seq_lens=torch.tensor([9, 3], dtype=torch.int32)), ValueError, r"seq_lens must lie in \[0, T_max = 8\]"),
        (dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, r"seq_lens must lie in"),
        (dict(num_splits=-1), ValueError, r"num_splits must be >= 0"),
    ],
)
def test_decode_bad_input(over, exc, pattern):
    args = _decode_args(**over)
    num_splits = args.pop("num_splits", 0)
    with pytest.raises(exc, match=r"qops\.int4_gqa_decode: " + pattern):
        qops.int4_gqa_decode(**args, num_splits=num_splits)


# ---- op registration -----------------------------------------------------------------------------
@pytest.mark.parametrize("g", [1, 4])
def test_opcheck_quantize(g):
    torch.library.opcheck(torch.ops.qops.quantize_kv_int4.default, (rand_kv((3, 2, 64), torch.bfloat16), g))


@pytest.mark.parametrize("g", [1, 4])
def test_opcheck_decode(g):
    query, k, v, lens = make_decode(2, 6, 2, 3, 64, g, torch.float16, [6, 2])
    torch.library.opcheck(torch.ops.qops.int4_gqa_decode.default, (query, k, v, lens, 0.125, g, 0))


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
    query, k, v, lens = make_decode(2, 6, 2, 3, 64, 1, torch.float16, [6, 2])
    args = {
        "quantize_kv_int4": (rand_kv((3, 2, 64), torch.float16).cuda(), 1),
        "int4_gqa_decode": (query.cuda(), k.cuda(), v.cuda(), lens.cuda(), 0.125, 1, 0),
    }[name]
    with pytest.raises(NotImplementedError, match=rf"qops\.{name}"):
        getattr(torch.ops.qops, name)(*args)
