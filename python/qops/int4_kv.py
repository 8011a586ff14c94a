"""int4 KV cache (the row layout of seed 002) and its GQA decode: the ops ``quantize_kv_int4`` and
``int4_gqa_decode``, and the helpers ``dequantize_kv_int4`` and ``kv_int4_row_bytes``.

One row is one (token, kv head) of ``D`` channels in ``G = num_groups`` groups of ``D / G``
(docs/ops.md "int4 KV rows", docs/int4.md)::

    bytes [0, 4G):        G pairs (scale_g, shift_g), each a little-endian fp16, group order
    bytes [4G, 4G + D/2): byte j holds channel 2j in its low nibble, channel 2j+1 in its high one

with unsigned ``q`` in [0, 15] and ``x ~= q * scale_g + shift_g``.
"""

from __future__ import annotations

import torch

from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference

HEAD_DIMS = (64, 128)
NUM_GROUPS = (1, 4)
INT4_KV_MAX = 15
FP16_MAX = 65504.0


def kv_int4_row_bytes(head_dim: int, num_groups: int) -> int:
    """Bytes of one int4 KV row: ``4 * num_groups + head_dim / 2`` (D=128: 68 or 80; D=64: 36 or 48)."""
    return 4 * num_groups + head_dim // 2


def _check_head_dim_groups(op: str, head_dim: int, num_groups: int, what: str) -> None:
    check(head_dim in HEAD_DIMS, op, f"{what} (the head dim D) must be 64 or 128, got {head_dim}")
    check(num_groups in NUM_GROUPS, op, f"num_groups must be 1 or 4, got {num_groups}")


# ---- quantize_kv_int4 ----------------------------------------------------------------------------
@reference("quantize_kv_int4")
def _quantize_kv_int4_ref(kv: torch.Tensor, num_groups: int) -> torch.Tensor:
    op = "quantize_kv_int4"
    check_dtype(kv, HALF_DTYPES, op, "kv")
    check(kv.dim() >= 1, op, "kv must have a last dimension (the head dim D)")
    _check_head_dim_groups(op, kv.shape[-1], num_groups, "kv's last dimension")
    check(kv.stride(-1) == 1, op, "kv's last dimension must be contiguous (stride 1)")

    lead, d, g = kv.shape[:-1], kv.shape[-1], num_groups
    # Values are saturated to the fp16 range (bf16 holds larger ones; +-Inf saturates too), and NaN
    # is left out of the group's min and max (it quantizes to code 0): the header stays finite.
    x = kv.float().clamp(-FP16_MAX, FP16_MAX).reshape(*lead, g, d // g)
    nan = torch.isnan(x)
    lo = torch.where(nan, torch.inf, x).amin(-1)
    hi = torch.where(nan, -torch.inf, x).amax(-1)
    empty = torch.isinf(lo)  # every value NaN
    lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    shift = lo.to(torch.float16)  # fp16(min)
    scale = ((hi - lo) / INT4_KV_MAX).to(torch.float16)  # fp16((max - min) / 15), f32 division
    s = scale.float().unsqueeze(-1)
    b = shift.float().unsqueeze(-1)
    q = ((x - b) / s).round().clamp(0, INT4_KV_MAX)  # round half to even, with the fp16 values
    q = torch.where((s == 0) | torch.isnan(q), torch.zeros_like(q), q).to(torch.uint8)
    q = q.reshape(*lead, d)
    data = q[..., 0::2] | (q[..., 1::2] << 4)  # [..., D/2]
    header = torch.stack((scale, shift), dim=-1)  # [..., G, 2] fp16
    header = header.view(torch.uint8).reshape(*lead, 4 * g)
    return torch.cat((header, data), dim=-1)


@fake("quantize_kv_int4")
def _quantize_kv_int4_fake(kv, num_groups):
    return kv.new_empty((*kv.shape[:-1], 4 * num_groups + kv.shape[-1] // 2), dtype=torch.uint8)


@export
def quantize_kv_int4(kv: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Asymmetric int4 quantization of K or V heads into seed-002 rows.

    Per group ``x_g`` of ``D / num_groups`` consecutive channels, all in float32::

        shift = fp16(x_g.min())
        scale = fp16((x_g.max() - x_g.min()) / 15)
        q     = clamp(round_half_even((x_g - shift) / scale), 0, 15)   # q = 0 where scale == 0
        row   = [(scale_g, shift_g) as fp16 bytes for g in groups] + [q[2j] | q[2j+1] << 4 for j]

    Args:
        kv: ``[..., D]`` float16 or bfloat16, ``D`` in {64, 128}, last dimension contiguous.
            Values outside the fp16 range (bf16, +-Inf) saturate to +-65504; NaN is ignored by the
            group's min and max and quantizes to code 0, so the header is always finite.
        num_groups: 1 or 4 groups per row.
    Returns:
        uint8 ``[..., 4 * num_groups + D / 2]``, contiguous.
    """
    return torch.ops.qops.quantize_kv_int4(kv, num_groups)


def dequantize_kv_int4(
    rows: torch.Tensor,
    num_groups: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_int4`: ``x = q * scale_g + shift_g``.

    Computed in float32 (``q * scale`` is exact, the addition rounds once: the value of
    ``fmaf(q, scale, shift)``), then rounded to ``dtype``.

    Args:
        rows: uint8 ``[..., 4 * num_groups + head_dim / 2]``.
        num_groups: 1 or 4.
        head_dim: ``D``, 64 or 128.
        dtype: float32, float16 or bfloat16.
    Returns:
        ``[..., D]`` in ``dtype``.
    """
    op = "dequantize_kv_int4"
    check_dtype(rows, torch.uint8, op, "rows")
    _check_head_dim_groups(op, head_dim, num_groups, "head_dim")
    row_bytes = kv_int4_row_bytes(head_dim, num_groups)
    check(
        rows.dim() >= 1 and rows.shape[-1] == row_bytes,
        op,
        f"rows' last dimension must be {row_bytes} (4 * num_groups + head_dim / 2), got shape {tuple(rows.shape)}",
    )
    check(
        dtype in (torch.float32, *HALF_DTYPES),
        op,
        f"dtype must be float32, float16 or bfloat16, got {dtype}",
        TypeError,
    )

    lead, g, d = rows.shape[:-1], num_groups, head_dim
    header = rows[..., : 4 * g].contiguous().view(torch.float16).float().reshape(*lead, g, 2)
    scale, shift = header[..., 0:1], header[..., 1:2]  # [..., G, 1]
    data = rows[..., 4 * g :]
    q = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(*lead, g, d // g).float()
    return (q * scale + shift).reshape(*lead, d).to(dtype)


# ---- int4_gqa_decode -----------------------------------------------------------------------------
def _check_int4_gqa_decode(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    num_groups: int,
    num_splits: int,
) -> None:
    op = "int4_gqa_decode"
    check_dtype(query, HALF_DTYPES, op, "query")
    check(query.dim() == 3, op, f"query must be 3-D [B, HQ, D], got shape {tuple(query.shape)}")
    check(query.stride(-1) == 1, op, "query's last dimension must be contiguous (stride 1)")
    b, hq, d = query.shape
    _check_head_dim_groups(op, d, num_groups, "query's last dimension")
    row_bytes = kv_int4_row_bytes(d, num_groups)
    for name, t in (("k", k), ("v", v)):
        check_dtype(t, torch.uint8, op, name)
        check(
            t.dim() == 4 and t.shape[0] == b and t.shape[3] == row_bytes,
            op,
            f"{name} must be [B, T_max, H_kv, 4 * num_groups + D / 2] = [{b}, T_max, H_kv, "
            f"{row_bytes}], got shape {tuple(t.shape)}",
        )
        check(t.stride(-1) == 1, op, f"{name}'s last dimension must be contiguous (stride 1)")
        check(t.device == query.device, op, f"{name} must be on {query.device}, got {t.device}")
    check(v.shape == k.shape, op, f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    h_kv = k.shape[2]
    check(
        h_kv > 0 and hq % h_kv == 0, op, f"HQ (query.shape[1] = {hq}) must be a multiple of H_kv (k.shape[2] = {h_kv})"
    )
    check_dtype(seq_lens, torch.int32, op, "seq_lens")
    check(tuple(seq_lens.shape) == (b,), op, f"seq_lens must be [B] = [{b}], got shape {tuple(seq_lens.shape)}")
    check(seq_lens.device == query.device, op, f"seq_lens must be on {query.device}, got {seq_lens.device}")
    check(num_splits >= 0, op, f"num_splits must be >= 0 (0: the kernel chooses), got {num_splits}")


@reference("int4_gqa_decode")
def _int4_gqa_decode_ref(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_groups: int,
    num_splits: int = 0,
) -> torch.Tensor:
    _check_int4_gqa_decode(query, k, v, seq_lens, num_groups, num_splits)
    op = "int4_gqa_decode"
    t_max = k.shape[1]
    check(
        bool(((seq_lens >= 0) & (seq_lens <= t_max)).all()),
        op,
        f"seq_lens must lie in [0, T_max = {t_max}], got {seq_lens.tolist()}",
    )

    b, hq, d = query.shape
    rep = hq // k.shape[2]  # query head h reads kv head h // rep
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=query.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue  # an empty sequence gives zeros
        # The dequantized cache, in the query's dtype (the kernel's MMA operand type).
        keys = dequantize_kv_int4(k[i, :n], num_groups, d, query.dtype).float()  # [n, H_kv, D]
        vals = dequantize_kv_int4(v[i, :n], num_groups, d, query.dtype).float()
        keys = keys.repeat_interleave(rep, dim=1)  # [n, HQ, D]
        vals = vals.repeat_interleave(rep, dim=1)
        scores = sm_scale * torch.einsum("hd,nhd->hn", query[i].float(), keys)
        p = torch.softmax(scores, dim=-1)  # float32
        out[i] = torch.einsum("hn,nhd->hd", p, vals)
    return out.to(query.dtype)


@fake("int4_gqa_decode")
def _int4_gqa_decode_fake(query, k, v, seq_lens, sm_scale, num_groups, num_splits=0):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@export
def int4_gqa_decode(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_groups: int,
    *,
    num_splits: int = 0,
) -> torch.Tensor:
    """Grouped-query decode attention over an int4 KV cache (seed 002).

    For each sequence ``b`` with ``L = seq_lens[b]`` and query head ``h`` (kv head
    ``h // (HQ / H_kv)``), with ``K, V = dequantize_kv_int4(k[b, :L, kvh], num_groups, D,
    query.dtype)`` (and likewise ``v``)::

        p = torch.softmax(sm_scale * (query[b, h].float() @ K.float().T), -1)   # float32
        out[b, h] = (p @ V.float()).to(query.dtype)                             # 0 when L == 0

    Args:
        query: ``[B, HQ, D]`` float16 or bfloat16, ``D`` in {64, 128}.
        k, v: uint8 ``[B, T_max, H_kv, 4 * num_groups + D / 2]`` (rows of
            :func:`quantize_kv_int4`); ``HQ`` a multiple of ``H_kv``.
        seq_lens: int32 ``[B]``, each in ``[0, T_max]``; tokens past ``seq_lens[b]`` are not read.
        sm_scale: softmax scale, typically ``D ** -0.5``.
        num_groups: 1 or 4 (as quantized).
        num_splits: split-K factor over the sequence (0: the kernel chooses); never changes the
            result beyond float32 rounding.
    Returns:
        ``[B, HQ, D]`` in ``query.dtype``.
    """
    return torch.ops.qops.int4_gqa_decode(query, k, v, seq_lens, sm_scale, num_groups, num_splits)
