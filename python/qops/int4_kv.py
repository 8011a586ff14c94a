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

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference
from .kv_cache import check_block_tables, check_slot_mapping, check_table_values

HEAD_DIMS = (64, 128)
NUM_GROUPS = (1, 4)
INT4_KV_MAX = 15
FP16_MAX = 65504.0


def kv_int4_row_bytes(head_dim: int, num_groups: int) -> int:
    """Bytes of one int4 KV row: ``4 * num_groups + head_dim / 2`` (D=128: 68 or 80; D=64: 36 or 48)."""
    return 4 * num_groups + head_dim // 2


def _check_clip(op: str, clip_ratio: float) -> None:
    check(0.0 < clip_ratio <= 1.0, op, f"clip_ratio must be in (0, 1], got {clip_ratio}")


def _check_head_dim_groups(op: str, head_dim: int, num_groups: int, what: str) -> None:
    check(head_dim in HEAD_DIMS, op, f"{what} (the head dim D) must be 64 or 128, got {head_dim}")
    check(num_groups in NUM_GROUPS, op, f"num_groups must be 1 or 4, got {num_groups}")


# ---- quantize_kv_int4 ----------------------------------------------------------------------------
@reference("quantize_kv_int4")
def _quantize_kv_int4_ref(kv: torch.Tensor, num_groups: int, *, clip_ratio: float = 1.0) -> torch.Tensor:
    op = "quantize_kv_int4"
    _check_clip(op, clip_ratio)
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
    if clip_ratio != 1.0:  # SKVQ's clipped range (float32 products; 1.0 leaves it exact)
        lo, hi = lo * clip_ratio, hi * clip_ratio
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
def _quantize_kv_int4_fake(kv, num_groups, *, clip_ratio=1.0):
    return kv.new_empty((*kv.shape[:-1], 4 * num_groups + kv.shape[-1] // 2), dtype=torch.uint8)


@export
def quantize_kv_int4(kv: torch.Tensor, num_groups: int, *, clip_ratio: float = 1.0) -> torch.Tensor:
    """Asymmetric int4 quantization of K or V heads into seed-002 rows.

    Per group ``x_g`` of ``D / num_groups`` consecutive channels, all in float32::

        lo, hi = clip_ratio * x_g.min(), clip_ratio * x_g.max()       # SKVQ's clipping
        shift = fp16(lo)
        scale = fp16((hi - lo) / 15)
        q     = clamp(round_half_even((x_g - shift) / scale), 0, 15)   # q = 0 where scale == 0
        row   = [(scale_g, shift_g) as fp16 bytes for g in groups] + [q[2j] | q[2j+1] << 4 for j]

    Args:
        kv: ``[..., D]`` float16 or bfloat16, ``D`` in {64, 128}, last dimension contiguous.
            Values outside the fp16 range (bf16, +-Inf) saturate to +-65504; NaN is ignored by the
            group's min and max and quantizes to code 0, so the header is always finite.
        num_groups: 1 or 4 groups per row.
        clip_ratio: keyword-only, in (0, 1]: SKVQ's clipped dynamic quantization shrinks each
            group's range to ``[clip_ratio * min, clip_ratio * max]`` (values outside saturate to
            codes 0 and 15); 1.0 (the default) is plain min/max quantization.
    Returns:
        uint8 ``[..., 4 * num_groups + D / 2]``, contiguous.
    """
    return torch.ops.qops.quantize_kv_int4(kv, num_groups, clip_ratio=clip_ratio)


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


# ---- the paged int4 cache ------------------------------------------------------------------------
# k_cache, v_cache: uint8 [num_blocks, H_kv, block_size, row_bytes] (the int8 cache's "HND" blocks,
# with seed-002 rows); slot s is block s // block_size, offset s % block_size.
BLOCK_SIZES = (16, 32, 64, 128)


def _check_int4_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, num_groups: int) -> tuple[int, int]:
    """Checks a pair of paged int4 caches; returns ``(H_kv, D)``."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(t, torch.uint8, op, name)
        check(
            t.dim() == 4,
            op,
            f"{name} must be uint8 [num_blocks, H_kv, block_size, row_bytes], got shape {tuple(t.shape)}",
        )
        check(t.is_contiguous(), op, f"{name} must be contiguous")
    check(
        tuple(v_cache.shape) == tuple(k_cache.shape),
        op,
        f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}",
    )
    check(v_cache.device == k_cache.device, op, f"v_cache must be on {k_cache.device}, got {v_cache.device}")
    check(num_groups in NUM_GROUPS, op, f"num_groups must be 1 or 4, got {num_groups}")
    check(
        k_cache.shape[2] in BLOCK_SIZES,
        op,
        f"block_size (k_cache.shape[2]) must be one of {BLOCK_SIZES}, got {k_cache.shape[2]}",
    )
    rb = k_cache.shape[3]
    d = next((d for d in HEAD_DIMS if kv_int4_row_bytes(d, num_groups) == rb), None)  # (rb may be a SymInt)
    check(
        d is not None,
        op,
        f"k_cache's row bytes ({rb}) must be 4 * num_groups + D / 2 for D in {HEAD_DIMS} "
        f"({[kv_int4_row_bytes(d, num_groups) for d in HEAD_DIMS]} with num_groups = {num_groups})",
    )
    assert d is not None
    return k_cache.shape[1], d


def _check_kv_tokens(op: str, key: torch.Tensor, value: torch.Tensor, hkv: int, d: int, device) -> None:
    check_dtype(key, HALF_DTYPES, op, "key")
    check(value.dtype == key.dtype, op, f"value must have key's dtype {key.dtype}, got {value.dtype}")
    check(key.dim() == 3, op, f"key must be [T, H_kv, D], got shape {tuple(key.shape)}")
    check(
        tuple(value.shape) == tuple(key.shape),
        op,
        f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}",
    )
    check(
        key.stride(-1) == 1 and value.stride(-1) == 1,
        op,
        "key and value must have a contiguous last dimension (stride 1)",
    )
    check(
        tuple(key.shape[1:]) == (hkv, d),
        op,
        f"key's [H_kv, D] = {list(key.shape[1:])} must match the cache's [H_kv, D] = [{hkv}, {d}]",
    )
    for name, t in (("key", key), ("value", value)):
        check(t.device == device, op, f"{name} must be on {device}, got {t.device}")


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    bs = cache.shape[2]
    cache[slots // bs, :, slots % bs] = rows


# ---- reshape_and_cache_int4 ----------------------------------------------------------------------
def _check_cache_int4_args(key, value, k_cache, v_cache, slot_mapping, num_groups, clip_ratio) -> None:
    op = "reshape_and_cache_int4"
    hkv, d = _check_int4_caches(op, k_cache, v_cache, num_groups)
    _check_kv_tokens(op, key, value, hkv, d, k_cache.device)
    _check_clip(op, clip_ratio)
    check_dtype(slot_mapping, torch.int64, op, "slot_mapping")
    check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        op,
        f"slot_mapping must be int64 [T] with T = {key.shape[0]}, got shape {tuple(slot_mapping.shape)}",
    )
    check(
        slot_mapping.device == k_cache.device,
        op,
        f"slot_mapping must be on {k_cache.device}, got {slot_mapping.device}",
    )


@reference("reshape_and_cache_int4")
def _reshape_and_cache_int4_ref(
    key, value, k_cache, v_cache, slot_mapping, num_groups, *, clip_ratio=1.0, enable_pdl=True
) -> None:
    op = "reshape_and_cache_int4"
    _check_cache_int4_args(key, value, k_cache, v_cache, slot_mapping, num_groups, clip_ratio)
    keep, slots = check_slot_mapping(op, slot_mapping, k_cache.shape[0] * k_cache.shape[2])
    for x, cache in ((key, k_cache), (value, v_cache)):
        _write_rows(cache, slots, _quantize_kv_int4_ref(x[keep], num_groups, clip_ratio=clip_ratio))


@fake("reshape_and_cache_int4")
def _reshape_and_cache_int4_fake(
    key, value, k_cache, v_cache, slot_mapping, num_groups, *, clip_ratio=1.0, enable_pdl=True
) -> None:
    _check_cache_int4_args(key, value, k_cache, v_cache, slot_mapping, num_groups, clip_ratio)


@export
def reshape_and_cache_int4(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_groups: int,
    *,
    clip_ratio: float = 1.0,
    enable_pdl: bool | None = None,
) -> None:
    """Quantize new tokens' K and V to int4 rows and write them into their slots of the paged cache.

    For every token ``t`` with ``s = slot_mapping[t] >= 0`` (slot -1 is padding: skipped)::

        k_cache[s // block_size, :, s % block_size] = quantize_kv_int4(key[t], num_groups, clip_ratio)

    and the same for ``value`` into ``v_cache``. Bit-identical on CPU and CUDA. Slots outside
    ``[-1, num_blocks * block_size)`` and two tokens in one slot are errors (the reference raises;
    the CUDA kernel skips out-of-range slots without a host synchronization, and traps in debug
    builds).

    Args:
        key, value: float16 or bfloat16 ``[T, H_kv, D]``, D in {64, 128}, last dimension contiguous.
        k_cache, v_cache: uint8 ``[num_blocks, H_kv, block_size, 4 * num_groups + D / 2]``,
            contiguous, block_size in {16, 32, 64, 128}; written in place.
        slot_mapping: int64 ``[T]``.
        num_groups: 1 or 4 (scale/shift groups per row).
        clip_ratio: keyword-only; SKVQ's clipping (see :func:`quantize_kv_int4`).
        enable_pdl: keyword-only; programmatic dependent launch (sm_90); ``None``: the default.
    """
    torch.ops.qops.reshape_and_cache_int4(
        key, value, k_cache, v_cache, slot_mapping, num_groups, clip_ratio=clip_ratio, enable_pdl=envs.pdl(enable_pdl)
    )


# ---- SKVQ: the full-precision sinks and window beside the int4 cache -----------------------------
def side_index(position: int, sinks: int, window: int) -> int:
    """Where a full-precision token sits in the side buffer: sink ``p < sinks`` at ``p``; a window
    token ``p >= sinks`` in the ring at ``sinks + (p - sinks) % window``."""
    return position if position < sinks else sinks + (position - sinks) % window


def int4_token_range(seq_len: int, sinks: int, window: int) -> tuple[int, int]:
    """The positions ``[lo, hi)`` of a sequence of ``seq_len`` tokens that are read from the int4
    cache: after the ``min(sinks, L)`` sinks, before the newest ``min(window, L - sinks)`` tokens.
    The others are in the side buffer."""
    lo = min(sinks, seq_len)
    hi = max(lo, seq_len - window)
    return lo, hi


def _check_side(op, query_dtype, k_side, v_side, side_slots, b, hkv, d, sinks, window, device, required=False) -> None:
    """The side buffers: optional for the decode (none without sinks and window), always given to
    the write (``required``; with ``sinks = window = 0`` they hold no token)."""
    check(sinks >= 0 and window >= 0, op, f"sinks and window must be >= 0, got {sinks} and {window}")
    if not required and k_side is None and v_side is None and side_slots is None:
        check(
            sinks == 0 and window == 0,
            op,
            "sinks and window need the side buffers k_side, v_side and side_slots",
        )
        return
    check(
        k_side is not None and v_side is not None and side_slots is not None,
        op,
        "k_side, v_side and side_slots go together (all or none)",
    )
    check(required or sinks + window > 0, op, "side buffers were given with sinks = window = 0")
    for name, t in (("k_side", k_side), ("v_side", v_side)):
        check_dtype(t, (query_dtype,), op, name)
        check(
            t.dim() == 4 and t.shape[1:] == (hkv, sinks + window, d),
            op,
            f"{name} must be [num_side_slots, H_kv, sinks + window, D] = [*, {hkv}, {sinks + window}, {d}], "
            f"got shape {tuple(t.shape)}",
        )
        check(t.is_contiguous(), op, f"{name} must be contiguous")
        check(t.device == device, op, f"{name} must be on {device}, got {t.device}")
    check(
        tuple(v_side.shape) == tuple(k_side.shape),
        op,
        f"v_side must have k_side's shape {tuple(k_side.shape)}, got {tuple(v_side.shape)}",
    )
    check_dtype(side_slots, torch.int32, op, "side_slots")
    check(tuple(side_slots.shape) == (b,), op, f"side_slots must be int32 [B] = [{b}], got {tuple(side_slots.shape)}")
    check(side_slots.device == device, op, f"side_slots must be on {device}, got {side_slots.device}")


def _check_side_values(op, side_slots, k_side) -> None:
    if side_slots is None:
        return
    n = k_side.shape[0]
    bad = (side_slots < 0) | (side_slots >= n)
    check(not bool(bad.any()), op, f"side_slots must lie in [0, {n}), got {side_slots[bad][:8].tolist()}")


def _check_skvq_write(
    key,
    value,
    k_cache,
    v_cache,
    k_side,
    v_side,
    block_tables,
    side_slots,
    seq_lens,
    cu_seqlens,
    num_groups,
    sinks,
    window,
    clip_ratio,
) -> None:
    op = "skvq_cache_write"
    hkv, d = _check_int4_caches(op, k_cache, v_cache, num_groups)
    _check_kv_tokens(op, key, value, hkv, d, k_cache.device)
    _check_clip(op, clip_ratio)
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_block_tables(op, block_tables, seq_lens, b, k_cache.device)
    _check_side(op, key.dtype, k_side, v_side, side_slots, b, hkv, d, sinks, window, k_cache.device, required=True)
    check_dtype(cu_seqlens, torch.int32, op, "cu_seqlens")
    check(
        tuple(cu_seqlens.shape) == (b + 1,),
        op,
        f"cu_seqlens must be int32 [B + 1] = [{b + 1}], got {tuple(cu_seqlens.shape)}",
    )
    check(cu_seqlens.device == k_cache.device, op, f"cu_seqlens must be on {k_cache.device}, got {cu_seqlens.device}")


@reference("skvq_cache_write")
def _skvq_cache_write_ref(
    key,
    value,
    k_cache,
    v_cache,
    k_side,
    v_side,
    block_tables,
    side_slots,
    seq_lens,
    cu_seqlens,
    num_groups,
    sinks,
    window,
    *,
    clip_ratio=1.0,
    enable_pdl=True,
) -> None:
    op = "skvq_cache_write"
    _check_skvq_write(
        key,
        value,
        k_cache,
        v_cache,
        k_side,
        v_side,
        block_tables,
        side_slots,
        seq_lens,
        cu_seqlens,
        num_groups,
        sinks,
        window,
        clip_ratio,
    )
    bs = k_cache.shape[2]
    check_table_values(op, block_tables, seq_lens, k_cache.shape[0], bs)
    _check_side_values(op, side_slots, k_side)
    cu = cu_seqlens.tolist()
    check(
        cu[0] == 0 and cu[-1] == key.shape[0] and all(a <= c for a, c in zip(cu, cu[1:])),
        op,
        f"cu_seqlens must rise from 0 to T = {key.shape[0]}, got {cu[:8]}",
    )
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        n_new, l_new = cu[b + 1] - cu[b], lens[b]
        check(n_new <= l_new, op, f"sequence {b} gets {n_new} new tokens but seq_lens[{b}] = {l_new}")
        l_old = l_new - n_new
        _, hi_new = int4_token_range(l_new, sinks, window)

        def slot(p: int, b: int = b) -> int:
            return int(block_tables[b, p // bs]) * bs + p % bs

        side = int(side_slots[b]) if side_slots is not None else -1
        # tokens that leave the window: their full-precision values move into the int4 cache
        _, hi_old = int4_token_range(l_old, sinks, window)
        for p in range(max(sinks, hi_old), min(hi_new, l_old)):
            i = side_index(p, sinks, window)
            for src, cache in ((k_side, k_cache), (v_side, v_cache)):
                _write_rows(
                    cache,
                    torch.tensor([slot(p)]),
                    _quantize_kv_int4_ref(src[side, :, i][None], num_groups, clip_ratio=clip_ratio),
                )
        # the new tokens: sinks and window into the side buffer, the others into the int4 cache
        for j in range(n_new):
            p, t = l_old + j, cu[b] + j
            if p < sinks or p >= hi_new:
                i = side_index(p, sinks, window)
                k_side[side, :, i] = key[t]
                v_side[side, :, i] = value[t]
            else:
                for src, cache in ((key, k_cache), (value, v_cache)):
                    _write_rows(
                        cache,
                        torch.tensor([slot(p)]),
                        _quantize_kv_int4_ref(src[t][None], num_groups, clip_ratio=clip_ratio),
                    )


@fake("skvq_cache_write")
def _skvq_cache_write_fake(
    key,
    value,
    k_cache,
    v_cache,
    k_side,
    v_side,
    block_tables,
    side_slots,
    seq_lens,
    cu_seqlens,
    num_groups,
    sinks,
    window,
    *,
    clip_ratio=1.0,
    enable_pdl=True,
) -> None:
    _check_skvq_write(
        key,
        value,
        k_cache,
        v_cache,
        k_side,
        v_side,
        block_tables,
        side_slots,
        seq_lens,
        cu_seqlens,
        num_groups,
        sinks,
        window,
        clip_ratio,
    )


@export
def skvq_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_side: torch.Tensor,
    v_side: torch.Tensor,
    block_tables: torch.Tensor,
    side_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_groups: int,
    sinks: int,
    window: int,
    *,
    clip_ratio: float = 1.0,
    enable_pdl: bool | None = None,
) -> None:
    """Append tokens to an SKVQ cache: the first ``sinks`` tokens and the newest ``window`` tokens
    of each sequence in full precision (the side buffers), the others as int4 rows (seed 003).

    Sequence ``b`` gets ``n_b = cu_seqlens[b + 1] - cu_seqlens[b]`` new tokens, ``key[cu_seqlens[b]:
    cu_seqlens[b + 1]]`` at positions ``[seq_lens[b] - n_b, seq_lens[b])`` (``seq_lens`` is the
    length after the write). Position ``p`` lives:

    - ``p < sinks``: in ``k_side[side_slots[b], :, p]`` (a sink, forever);
    - among the newest ``window`` positions: in the ring, ``k_side[side_slots[b], :, sinks + (p -
      sinks) % window]``;
    - otherwise: as an int4 row (:func:`quantize_kv_int4` with ``num_groups``, ``clip_ratio``) in
      its paged slot ``block_tables[b, p // block_size] * block_size + p % block_size``.

    Tokens that leave the window in this call are quantized from the ring into their int4 slots
    before the ring slot is reused. Bit-identical on CPU and CUDA. With ``sinks = window = 0`` every
    token goes to the int4 cache (then ``k_side``/``v_side`` may be empty).

    Args:
        key, value: float16 or bfloat16 ``[T, H_kv, D]``, tokens packed by sequence.
        k_cache, v_cache: uint8 ``[num_blocks, H_kv, block_size, row_bytes]`` (see
            :func:`reshape_and_cache_int4`).
        k_side, v_side: ``[num_side_slots, H_kv, sinks + window, D]`` in key's dtype.
        block_tables: int32 ``[B, max_blocks]``; seq_lens: int32 ``[B]`` (after the write);
        side_slots: int32 ``[B]``, each sequence's row of the side buffers.
        cu_seqlens: int32 ``[B + 1]``, rising from 0 to ``T``.
        num_groups, sinks, window, clip_ratio: as above.
    """
    torch.ops.qops.skvq_cache_write(
        key, value, k_cache, v_cache, k_side, v_side, block_tables, side_slots, seq_lens, cu_seqlens,
        num_groups, sinks, window, clip_ratio=clip_ratio, enable_pdl=envs.pdl(enable_pdl),
    )  # fmt: skip


# ---- int4_gqa_decode -----------------------------------------------------------------------------
def _check_int4_decode(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    num_groups,
    k_side,
    v_side,
    side_slots,
    sinks,
    window,
    num_splits,
    merge,
    warps,
) -> None:
    op = "int4_gqa_decode"
    check_dtype(query, HALF_DTYPES, op, "query")
    check(query.dim() == 3, op, f"query must be [B, HQ, D], got shape {tuple(query.shape)}")
    check(query.stride(-1) == 1, op, "query's last dimension must be contiguous (stride 1)")
    hkv, d = _check_int4_caches(op, k_cache, v_cache, num_groups)
    b, hq, dq = query.shape
    check(dq == d, op, f"query's D = {dq} must match the cache's D = {d} (row bytes {k_cache.shape[3]})")
    check(hq % hkv == 0, op, f"the number of query heads ({hq}) must be a multiple of the number of kv heads ({hkv})")
    check(query.device == k_cache.device, op, f"query must be on {k_cache.device}, got {query.device}")
    check_block_tables(op, block_tables, seq_lens, b, k_cache.device)
    _check_side(op, query.dtype, k_side, v_side, side_slots, b, hkv, d, sinks, window, k_cache.device)
    check(num_splits >= 0, op, f"num_splits must be >= 0 (0: the kernel chooses), got {num_splits}")
    check(
        merge in ("auto", "cluster", "fused", "separate"),
        op,
        f"merge must be auto, cluster, fused or separate, got '{merge}'",
    )
    check(warps in (0, 4, 8), op, f"warps must be 0 (the kernel's choice), 4 or 8, got {warps}")


def int4_decode_reference(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    sm_scale,
    num_groups,
    k_side=None,
    v_side=None,
    side_slots=None,
    sinks=0,
    window=0,
    dtype=torch.float32,
) -> torch.Tensor:
    """The op's math in ``dtype`` (float32: the registered CPU kernel; float64 in tests): int4 rows
    dequantized exactly (``q * scale + shift``), side-buffer tokens as stored. ``[B, HQ, D]``."""
    b, hq, d = query.shape
    hkv, bs = k_cache.shape[1], k_cache.shape[2]
    rep = hq // hkv
    out = torch.zeros(b, hq, d, dtype=dtype, device=query.device)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        pos = torch.arange(n, device=query.device)
        slots = block_tables[i, pos // bs].long() * bs + pos % bs
        blk, off = slots // bs, slots % bs
        keys = dequantize_kv_int4(k_cache[blk, :, off], num_groups, d).to(dtype)  # [n, H_kv, D]
        vals = dequantize_kv_int4(v_cache[blk, :, off], num_groups, d).to(dtype)
        lo, hi = int4_token_range(n, sinks, window)
        if side_slots is not None:
            s = int(side_slots[i])
            for p in [*range(lo), *range(hi, n)]:
                j = side_index(p, sinks, window)
                keys[p] = k_side[s, :, j].to(dtype)
                vals[p] = v_side[s, :, j].to(dtype)
        keys = keys.repeat_interleave(rep, dim=1)  # [n, HQ, D]
        vals = vals.repeat_interleave(rep, dim=1)
        scores = sm_scale * torch.einsum("hd,nhd->hn", query[i].to(dtype), keys)
        p = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", p, vals)
    return out


@reference("int4_gqa_decode")
def _int4_gqa_decode_ref(
    query,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    sm_scale,
    num_groups,
    k_side=None,
    v_side=None,
    side_slots=None,
    sinks=0,
    window=0,
    num_splits=0,
    *,
    enable_pdl=True,
    merge="auto",
    warps=0,
):
    op = "int4_gqa_decode"
    _check_int4_decode(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        num_groups,
        k_side,
        v_side,
        side_slots,
        sinks,
        window,
        num_splits,
        merge,
        warps,
    )
    check_table_values(op, block_tables, seq_lens, k_cache.shape[0], k_cache.shape[2])
    _check_side_values(op, side_slots, k_side)
    out = int4_decode_reference(
        query, k_cache, v_cache, block_tables, seq_lens, sm_scale, num_groups, k_side, v_side, side_slots, sinks, window
    )
    return out.to(query.dtype)


@fake("int4_gqa_decode")
def _int4_gqa_decode_fake(
    query, k_cache, v_cache, block_tables, seq_lens, sm_scale, num_groups, k_side=None, v_side=None, side_slots=None,
    sinks=0, window=0, num_splits=0, *, enable_pdl=True, merge="auto", warps=0,
):  # fmt: skip
    _check_int4_decode(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        num_groups,
        k_side,
        v_side,
        side_slots,
        sinks,
        window,
        num_splits,
        merge,
        warps,
    )
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@export
def int4_gqa_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_groups: int,
    *,
    k_side: torch.Tensor | None = None,
    v_side: torch.Tensor | None = None,
    side_slots: torch.Tensor | None = None,
    sinks: int = 0,
    window: int = 0,
    num_splits: int = 0,
    enable_pdl: bool | None = None,
    tuning=None,
) -> torch.Tensor:
    """Grouped-query decode attention over the paged int4 KV cache (seed 002), with SKVQ's
    full-precision sinks and window (seed 003) read in the same call.

    For sequence ``b`` of ``L = seq_lens[b]`` tokens and query head ``h`` (kv head
    ``h // (HQ / H_kv)``), position ``p``'s K (and V) is

    - the side buffer's ``k_side[side_slots[b], kvh, side_index(p)]`` for the first
      ``min(sinks, L)`` positions and the newest ``min(window, L - sinks)`` (see
      :func:`skvq_cache_write`);
    - else the int4 row in slot ``block_tables[b, p // block_size] * block_size + p % block_size``,
      dequantized exactly: ``q * scale_g + shift_g``.

    Then ``out[b, h] = softmax(sm_scale * q K^T) V`` with float32 softmax and accumulation, and
    zeros when ``L == 0``. The CUDA kernel rounds V and the softmax weights to fp16 before the P V
    product on tensor cores (a few fp16 units in the last place of difference; docs/int4.md).

    Args:
        query: ``[B, HQ, D]`` float16 or bfloat16, D in {64, 128}.
        k_cache, v_cache: uint8 ``[num_blocks, H_kv, block_size, 4 * num_groups + D / 2]``.
        block_tables: int32 ``[B, max_blocks]``; seq_lens: int32 ``[B]``, each in
            ``[0, max_blocks * block_size]``.
        sm_scale: softmax scale, typically ``D ** -0.5``.
        num_groups: 1 or 4.
        k_side, v_side, side_slots, sinks, window: SKVQ's side buffers
            (``[num_side_slots, H_kv, sinks + window, D]`` in the query's dtype, ``side_slots``
            int32 ``[B]``); none of them for a plain int4 cache.
        num_splits: split-K factor over the context (0: the kernel chooses); never changes the
            result beyond float32 rounding.
        enable_pdl: programmatic dependent launch (sm_90); ``None``: the default.
        tuning: :class:`qops.DecodeTuning` (merge, warps), as for the int8 decode.
    Returns:
        ``[B, HQ, D]`` in ``query.dtype``.
    """
    merge, warps = ("auto", 0) if tuning is None else (tuning.merge, tuning.warps)
    return torch.ops.qops.int4_gqa_decode(
        query, k_cache, v_cache, block_tables, seq_lens, sm_scale, num_groups, k_side, v_side, side_slots,
        sinks, window, num_splits, enable_pdl=envs.pdl(enable_pdl), merge=merge, warps=warps,
    )  # fmt: skip
