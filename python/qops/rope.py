"""Rotary position embedding (rotate-half convention, Hugging Face's Llama), in place on the query
and key heads: ``rotary_embedding``.

The reference below is the numerical contract (docs/ops.md): float32 products and sums, each
rounded separately, then one rounding to the activation dtype; the CUDA kernel is bit-exact with
it.
"""

from __future__ import annotations

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference

_OP = "rotary_embedding"


def _check_args(positions, query, key, cos, sin) -> None:
    check_dtype(query, HALF_DTYPES, _OP, "query")
    for x, name in ((query, "query"), (key, "key")):
        check(x.dim() == 3, _OP, f"{name} must be [T, H, D], got shape {tuple(x.shape)}")
        check(
            x.shape[2] == 1 or x.stride(2) == 1,
            _OP,
            f"{name}'s last dimension must be contiguous (stride 1), got strides {x.stride()}",
        )
    check_dtype(key, query.dtype, _OP, "key")
    t, d = query.shape[0], query.shape[2]
    check(
        key.shape[0] == t and key.shape[2] == d,
        _OP,
        f"key must be [T, H_kv, D] = [{t}, H_kv, {d}] like query, got shape {tuple(key.shape)}",
    )
    check(d % 2 == 0 and d > 0, _OP, f"head_dim must be even, got {d}")
    check_dtype(positions, torch.int64, _OP, "positions")
    check(
        positions.dim() == 1 and positions.shape[0] == t,
        _OP,
        f"positions must be int64 [T] with T = {t}, got shape {tuple(positions.shape)}",
    )
    for tab, name in ((cos, "cos"), (sin, "sin")):
        check_dtype(tab, torch.float32, _OP, name)
        check(
            tab.dim() == 2 and tab.shape[1] == d and tab.shape[0] >= 1,
            _OP,
            f"{name} must be float32 [max_pos, D] with D = {d}, got shape {tuple(tab.shape)}",
        )
    check(sin.shape == cos.shape, _OP, f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in float32 (``x [T, H, D]``, ``cos``/``sin`` ``[T, D]``),
    returned in ``x.dtype``: the contract's arithmetic (the products and the sum rounded
    separately)."""
    xf = x.float()
    h = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., h:], xf[..., :h]), dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


@reference(_OP)
def _rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    enable_pdl: bool = True,
) -> None:
    _check_args(positions, query, key, cos, sin)
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        check(0 <= lo and hi < cos.shape[0], _OP, f"positions must be in [0, {cos.shape[0]}), got [{lo}, {hi}]")
    c, s = cos[positions], sin[positions]
    query.copy_(rotate(query, c, s))
    key.copy_(rotate(key, c, s))


@fake(_OP)
def _rotary_embedding_fake(positions, query, key, cos, sin, **options) -> None:
    return None


@export
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    enable_pdl: bool | None = None,
) -> None:
    """Rotary position embedding of ``query`` and ``key`` in place (rotate-half convention).

    For every token ``t`` at ``p = positions[t]`` and every head ``x`` (``D`` values, ``h = D // 2``)::

        xf = x.float(); rot = cat(-xf[h:], xf[:h])
        x <- (xf * cos[p] + rot * sin[p]).to(x.dtype)

    (each product and the sum rounded separately in float32, no fused multiply-add: the CUDA
    kernel is bit-exact with the reference). ``cos``/``sin`` are the model's tables, e.g.
    ``cat(f, f).cos()`` for ``f = outer(arange(max_pos), inv_freq)``, times any attention scaling.

    Args:
        positions: int64 ``[T]``, each in ``[0, max_pos)``. The CPU reference raises otherwise; the
            CUDA kernel (which cannot raise without a synchronization) writes NaN into that token's
            heads and never reads outside the tables.
        query: ``[T, H_q, D]`` float16 or bfloat16, last dimension contiguous, any token and head
            strides (e.g. a view into a fused qkv output); rotated in place.
        key: ``[T, H_kv, D]``, query's dtype; rotated in place.
        cos, sin: float32 ``[max_pos, D]``, contiguous.
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`qops.rms_norm_quant`).
    """
    torch.ops.qops.rotary_embedding(positions, query, key, cos, sin, enable_pdl=envs.pdl(enable_pdl))


# ---- RoPE fused with the paged int8 cache write ---------------------------------------------------
_OP_CACHE = "rope_and_cache_int8"


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The interleaved (GPT-J) layout: pairs ``(x[2j], x[2j + 1])`` rotated by the angle of
    ``cos[:, j]`` / ``sin[:, j]`` (``j < D / 2``; ``cos``/``sin`` ``[T, D]``), float32 products and
    sums rounded separately, returned in ``x.dtype``."""
    xf = x.float()
    h = xf.shape[-1] // 2
    c, s = cos[:, None, :h], sin[:, None, :h]
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return out.to(x.dtype)


@reference(_OP_CACHE)
def _rope_and_cache_int8_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    enable_pdl: bool = True,
) -> None:
    from .kv_cache import _check_write_args, _reshape_and_cache_int8_ref

    # every check before anything is written
    _check_args(positions, query, key, cos, sin)
    _check_write_args(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        check(0 <= lo and hi < cos.shape[0], _OP_CACHE, f"positions must be in [0, {cos.shape[0]}), got [{lo}, {hi}]")
    c, s = cos[positions], sin[positions]
    turn = rotate if is_neox else rotate_interleaved
    query.copy_(turn(query, c, s))
    key.copy_(turn(key, c, s))
    _reshape_and_cache_int8_ref(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)


@fake(_OP_CACHE)
def _rope_and_cache_int8_fake(
    positions, query, key, value, cos, sin, k_cache, v_cache, k_scales, v_scales, slot_mapping, **options
) -> None:
    from .kv_cache import _check_write_args

    _check_args(positions, query, key, cos, sin)
    _check_write_args(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    return None


@export
def rope_and_cache_int8(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = True,
    enable_pdl: bool | None = None,
) -> None:
    """RoPE on ``query`` and ``key`` in place, then the paged int8 write of the rotated ``key`` and
    of ``value``, in one CUDA launch: exactly::

        qops.rotary_embedding(positions, query, key, cos, sin)       # is_neox=True (rotate-half)
        qops.reshape_and_cache_int8(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)

    (``is_neox=False``: the interleaved layout, pairs ``(x[2j], x[2j + 1])`` at the angle of
    ``cos[p, j]``, ``sin[p, j]``, ``j < D / 2``, the same float32 steps). Bit-exact on both devices.

    Args:
        positions: int64 ``[T]`` in ``[0, max_pos)`` (the CPU reference raises otherwise; CUDA
            writes NaN into that token's q/k heads; its k cache rows hold zeros, its v rows are
            written as usual).
        query: ``[T, H_q, D]`` float16/bfloat16, last dimension contiguous; rotated in place.
        key, value: ``[T, H_kv, D]`` in query's dtype; key rotated in place.
        cos, sin: float32 ``[max_pos, D]`` (the model's tables, with any RoPE scaling applied).
        k_cache, v_cache, k_scales, v_scales, slot_mapping: as :func:`qops.reshape_and_cache_int8`
            (``D`` a multiple of 16, at most 256 on CUDA).
        is_neox: keyword-only; rotate-half (True) or interleaved pairs.
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`qops.rms_norm_quant`).
    """
    torch.ops.qops.rope_and_cache_int8(
        positions,
        query,
        key,
        value,
        cos,
        sin,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        slot_mapping,
        is_neox=is_neox,
        enable_pdl=envs.pdl(enable_pdl),
    )
