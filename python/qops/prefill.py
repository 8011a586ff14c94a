"""Prefill and chunked-prefill attention over the paged int8 KV cache:
``paged_prefill_attention_int8``.

The new tokens of many sequences, packed into one ``[T, HQ, D]`` query (``cu_seqlens_q``), each
attending causally to its sequence's whole context as it is in the cache (the cached prefix and
the chunk's own keys, written there before the call), with the int8 K and V dequantized on the
fly: a prompt in one call, a prompt in chunks over its own cache, or several sequences' chunks
together. MHA, GQA and MQA, head_dim 64 and 128, optional ALiBi. The CUDA kernel is the
FlashAttention-2 loop on tensor cores with the int8 K and V converted in registers; see
docs/kv_cache.md.
"""

from __future__ import annotations

import torch

from . import envs
from ._registry import check, check_dtype, export, fake, reference
from .attention import check_alibi, check_query_and_cache
from .kv_cache import check_block_tables, check_table_values

_OP = "paged_prefill_attention_int8"


def _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, alibi_slopes):
    op = _OP
    check_query_and_cache(op, query, k_cache, v_cache, k_scales, v_scales, rows="T")
    check(seq_lens.dim() == 1, op, f"seq_lens must be int32 [B], got shape {tuple(seq_lens.shape)}")
    b = seq_lens.shape[0]
    check_block_tables(op, block_tables, seq_lens, b, k_cache.device)
    check_dtype(cu_seqlens_q, torch.int32, op, "cu_seqlens_q")
    check(
        tuple(cu_seqlens_q.shape) == (b + 1,),
        op,
        f"cu_seqlens_q must be int32 [B + 1] = [{b + 1}], got {tuple(cu_seqlens_q.shape)}",
    )
    check(cu_seqlens_q.is_contiguous(), op, "cu_seqlens_q must be contiguous")
    check(
        cu_seqlens_q.device == k_cache.device,
        op,
        f"cu_seqlens_q must be on {k_cache.device}, got {cu_seqlens_q.device}",
    )
    check_alibi(op, alibi_slopes, query.shape[1], k_cache.device)


def _check_values(query, seq_lens, cu_seqlens_q, max_query_len: int) -> None:
    """The reference's value checks of the packing (the CUDA kernel cannot check them without a
    synchronization): ``cu_seqlens_q`` from 0 to T, non-decreasing; every sequence's new tokens
    within its context; ``max_query_len`` in [0, T]."""
    op = _OP
    cu = cu_seqlens_q.long().cpu()
    n = cu[1:] - cu[:-1]
    check(
        int(cu[0]) == 0 and int(cu[-1]) == query.shape[0] and bool((n >= 0).all()),
        op,
        f"cu_seqlens_q must go from 0 to T = {query.shape[0]} without decreasing, got {cu[:8].tolist()}...",
    )
    lens = seq_lens.long().cpu()
    bad = n > lens
    check(
        not bool(bad.any()),
        op,
        "every sequence's new tokens must be in its context (cu_seqlens_q[b + 1] - cu_seqlens_q[b] <= "
        f"seq_lens[b]), got {n[bad][:4].tolist()} new tokens for lengths {lens[bad][:4].tolist()}",
    )
    check(
        0 <= max_query_len <= query.shape[0],
        op,
        f"max_query_len must be in [0, T = {query.shape[0]}], got {max_query_len}",
    )


def _dequant(cache, scales, blocks, off, dtype) -> torch.Tensor:
    """The dequantized rows at (blocks, off) of one layer's int8 cache: ``[H_kv, L, D]``."""
    x = cache[blocks, :, off].to(dtype)  # [L, H_kv, D]
    s = scales[blocks, :, off].to(dtype).unsqueeze(-1) if scales.dim() == 3 else scales.to(dtype).reshape(())
    return (x * s).transpose(0, 1)


def prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    sm_scale: float,
    alibi_slopes: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The math of the op in ``dtype`` (float32: the registered CPU kernel; float64 in tests), one
    sequence at a time. Returns ``[T, HQ, D]`` in ``dtype``. Arguments as the op's."""
    t_all, hq, d = query.shape
    _, hkv, bs, _ = k_cache.shape
    g = hq // hkv
    out = torch.zeros(t_all, hq, d, dtype=dtype, device=query.device)
    cu = cu_seqlens_q.long().tolist()
    for b, length in enumerate(seq_lens.long().tolist()):
        q0, n = cu[b], cu[b + 1] - cu[b]
        if n == 0:
            continue
        pos = torch.arange(length, device=query.device)
        blocks = block_tables[b, pos // bs].long()
        k, v = (_dequant(c, s, blocks, pos % bs, dtype) for c, s in ((k_cache, k_scales), (v_cache, v_scales)))
        q = query[q0 : q0 + n].to(dtype).transpose(0, 1).reshape(hkv, g, n, d)
        s = torch.einsum("hgnd,hld->hgnl", q, k) * sm_scale
        q_pos = length - n + torch.arange(n, device=query.device)  # [n]
        if alibi_slopes is not None:
            rel = (pos[None, :] - q_pos[:, None]).to(dtype)  # [n, L]
            s = s + alibi_slopes.to(dtype).reshape(hkv, g, 1, 1) * rel
        s = s.masked_fill(pos[None, :] > q_pos[:, None], float("-inf"))
        o = torch.einsum("hgnl,hld->hgnd", torch.softmax(s, dim=-1), v)
        out[q0 : q0 + n] = o.reshape(hq, n, d).transpose(0, 1)
    return out


@reference(_OP)
def _paged_prefill_attention_int8_ref(
    query,
    k_cache,
    v_cache,
    k_scales,
    v_scales,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_query_len,
    sm_scale,
    alibi_slopes=None,
    *,
    enable_pdl=True,
):
    _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, alibi_slopes)
    _check_values(query, seq_lens, cu_seqlens_q, max_query_len)
    check_table_values(_OP, block_tables, seq_lens, k_cache.shape[0], k_cache.shape[2])
    out = prefill_attention_reference(
        query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, sm_scale, alibi_slopes
    )
    return out.to(query.dtype)


@fake(_OP)
def _paged_prefill_attention_int8_fake(
    query,
    k_cache,
    v_cache,
    k_scales,
    v_scales,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    max_query_len,
    sm_scale,
    alibi_slopes=None,
    *,
    enable_pdl=True,
):
    _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q, alibi_slopes)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@export
def paged_prefill_attention_int8(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_query_len: int | None = None,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over the paged int8 KV cache (prefill, chunked
    prefill, several sequences' chunks at once; MHA, GQA, MQA).

    Sequence ``b`` has ``n_b = cu_seqlens_q[b + 1] - cu_seqlens_q[b]`` new tokens, rows
    ``cu_seqlens_q[b] + j`` of ``query``, at positions ``p_j = seq_lens[b] - n_b + j``: its context
    is ``seq_lens[b]`` tokens, the last ``n_b`` of them the new ones, all already written to the
    cache (e.g. by ``rope_and_cache_int8``). With ``K[i]``, ``V[i]`` the dequantized cache rows of
    position ``i`` (as in :func:`paged_decode_attention_int8`) and kv head ``h // (HQ // H_kv)``::

        s[i] = sm_scale * (query[row, h].float() @ K[i]) + alibi_slopes[h] * (i - p_j)   # i <= p_j
        out[row, h] = (softmax(s) @ V[:p_j + 1]).to(query.dtype)

    Args:
        query: float16 or bfloat16 ``[T, HQ, D]``, D in {64, 128}, last dimension contiguous.
        k_cache, v_cache, k_scales, v_scales: the layer's int8 cache, as
            :func:`paged_decode_attention_int8` takes it (dynamic or static scales).
        block_tables: int32 ``[B, max_blocks]``; seq_lens: int32 ``[B]`` (whole contexts).
        cu_seqlens_q: int32 ``[B + 1]``, from 0 to T, non-decreasing (a sequence may have no new
            token).
        max_query_len: in ``[0, T]``, sizes the CUDA grid; the longest ``n_b`` is the fastest
            choice, and any value gives the same result (CTAs loop over longer sequences' query
            tiles). ``None`` reads the longest from ``cu_seqlens_q`` (a device synchronization:
            pass it when capturing a CUDA graph).
        sm_scale: softmax scale; ``None`` means ``D ** -0.5``.
        alibi_slopes: optional float32 ``[HQ]``.
        enable_pdl: keyword-only; programmatic dependent launch (sm_90); ``None``: the
            ``QOPS_PDL`` default (:mod:`qops.envs`).
    Returns:
        ``[T, HQ, D]`` in the query's dtype.
    """
    if sm_scale is None:
        sm_scale = query.shape[-1] ** -0.5
    if max_query_len is None:
        n = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        max_query_len = int(n.max()) if n.numel() else 0
    return torch.ops.qops.paged_prefill_attention_int8(
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        int(max_query_len),
        float(sm_scale),
        alibi_slopes,
        enable_pdl=envs.pdl(enable_pdl),
    )
