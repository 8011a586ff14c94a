"""Decode attention over the paged int8 KV cache: ``paged_decode_attention_int8``.

One query token per sequence, any number of query heads per kv head (MHA, GQA, MQA), the int8
cache dequantized on the fly with its per-(token, head) or static scales, float32 softmax and
accumulation, optional ALiBi. The CUDA kernel splits long contexts across CTAs (flash-decoding)
and the last CTA of each head group merges the partial softmaxes; see docs/kv_cache.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference
from .kv_cache import check_block_tables, check_caches, check_table_values

_OP = "paged_decode_attention_int8"
HEAD_DIMS = (64, 128)
"""The head dims that the CUDA kernel supports (the reference takes any)."""


MERGES = ("auto", "cluster", "fused", "separate")


@export
@dataclass(frozen=True)
class DecodeTuning:
    """Launch options of :func:`paged_decode_attention_int8` on CUDA (the CPU reference checks and
    ignores them). The defaults are the kernel's own choices; tests and benchmarks force the
    others. Every merge of the same splits gives bit-identical outputs.

    Attributes:
        merge: how the splits of a split context are merged: ``"auto"`` (the cluster merge
            through distributed shared memory where the splits fit a cluster and the clusters fit
            the GPU, sm_90; else the fused merge, in which the last CTA of each head group merges,
            where it measured faster: head_dim 128 and contexts of 4096 tokens or more; else a
            second kernel), ``"cluster"`` (the cluster merge where it fits, else a second
            kernel), ``"fused"`` (never the cluster merge; the fused merge) or ``"separate"``
            (never the cluster merge; a second kernel). Concurrent calls on one device that are
            not stream-ordered (concurrently replayed graphs, unsynchronized streams) must not use
            the fused merge, whose counters are shared per device: pass ``"separate"``.
        warps: warps per CTA, 4 or 8; 0 chooses.
    """

    merge: str = "auto"
    warps: int = 0


def _check_tuning(merge: str, warps: int) -> None:
    check(merge in MERGES, _OP, f"merge must be auto, cluster, fused or separate, got '{merge}'")
    check(warps in (0, 4, 8), _OP, f"warps must be 0 (the kernel's choice), 4 or 8, got {warps}")


def check_query_and_cache(op: str, query, k_cache, v_cache, k_scales, v_scales, rows: str = "B") -> str:
    """A half query ``[rows, HQ, D]`` (last dimension contiguous, D in HEAD_DIMS, HQ a multiple of
    H_kv) over one layer's int8 cache on its device; returns the scale mode (``check_caches``)."""
    check_dtype(query, HALF_DTYPES, op, "query")
    check(query.dim() == 3, op, f"query must be [{rows}, HQ, D], got shape {tuple(query.shape)}")
    check(query.stride(-1) == 1, op, "query's last dimension must be contiguous (stride 1)")
    mode = check_caches(op, k_cache, v_cache, k_scales, v_scales)
    _, hq, d = query.shape
    hkv = k_cache.shape[1]
    check(d == k_cache.shape[3], op, f"query's D = {d} must match k_cache's D = {k_cache.shape[3]}")
    check(d in HEAD_DIMS, op, f"head dim D must be one of {HEAD_DIMS}, got {d}")
    check(hq % hkv == 0, op, f"the number of query heads ({hq}) must be a multiple of the number of kv heads ({hkv})")
    check(query.device == k_cache.device, op, f"query must be on {k_cache.device}, got {query.device}")
    return mode


def check_alibi(op: str, alibi_slopes, hq: int, device) -> None:
    """Optional ALiBi slopes: float32 ``[HQ]``, contiguous, on ``device``."""
    if alibi_slopes is None:
        return
    check_dtype(alibi_slopes, torch.float32, op, "alibi_slopes")
    check(
        tuple(alibi_slopes.shape) == (hq,),
        op,
        f"alibi_slopes must be float32 [HQ] = [{hq}], got {tuple(alibi_slopes.shape)}",
    )
    check(alibi_slopes.is_contiguous(), op, "alibi_slopes must be contiguous")
    check(alibi_slopes.device == device, op, f"alibi_slopes must be on {device}, got {alibi_slopes.device}")


def _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, alibi_slopes, num_splits) -> str:
    op = _OP
    mode = check_query_and_cache(op, query, k_cache, v_cache, k_scales, v_scales)
    check_block_tables(op, block_tables, seq_lens, query.shape[0], k_cache.device)
    check_alibi(op, alibi_slopes, query.shape[1], k_cache.device)
    check(num_splits >= 0, op, f"num_splits must be >= 0 (0: heuristic), got {num_splits}")
    return mode


def decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    alibi_slopes: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The math of the op in ``dtype`` (float32: the registered CPU kernel; float64 in tests),
    vectorized over the batch. Returns ``[B, HQ, D]`` in ``dtype``. Arguments as the op's."""
    b, hq, d = query.shape
    _, hkv, bs, _ = k_cache.shape
    g = hq // hkv
    lens = seq_lens.long()
    max_len = int(lens.max()) if b > 0 else 0
    if b == 0 or max_len == 0:
        return torch.zeros(b, hq, d, dtype=dtype, device=query.device)
    nb = -(-max_len // bs)
    pos = torch.arange(nb * bs, device=query.device)  # token positions 0 .. nb*bs-1
    valid = pos[None, :] < lens[:, None]  # [B, L]
    blocks = block_tables[:, :nb].long()  # [B, nb]; entries past a sequence's length are ignored
    blocks = torch.where(valid[:, ::bs], blocks, torch.zeros_like(blocks))

    def gather(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = cache[blocks].to(dtype)  # [B, nb, H_kv, bs, D]
        if scales.dim() == 3:
            x = x * scales[blocks].to(dtype).unsqueeze(-1)  # scales [B, nb, H_kv, bs, 1]
        else:
            x = x * scales.to(dtype).reshape(())
        x = x.permute(0, 2, 1, 3, 4).reshape(b, hkv, nb * bs, d)  # [B, H_kv, L, D]
        return torch.where(valid[:, None, :, None], x, torch.zeros_like(x))  # past the end: unread

    k = gather(k_cache, k_scales)
    v = gather(v_cache, v_scales)
    q = query.to(dtype).reshape(b, hkv, g, d)
    s = torch.einsum("bhgd,bhld->bhgl", q, k) * sm_scale  # [B, H_kv, G, L]
    if alibi_slopes is not None:
        rel = (pos[None, :] - (lens[:, None] - 1)).to(dtype)  # [B, L]: j - (L_b - 1)
        s = s + alibi_slopes.to(dtype).reshape(1, hkv, g, 1) * rel[:, None, None, :]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(valid[:, None, None, :], p, torch.zeros_like(p))  # seq_len 0: NaN rows -> 0
    o = torch.einsum("bhgl,bhld->bhgd", p, v)
    return o.reshape(b, hq, d)


@reference(_OP)
def _paged_decode_attention_int8_ref(
    query,
    k_cache,
    v_cache,
    k_scales,
    v_scales,
    block_tables,
    seq_lens,
    sm_scale,
    alibi_slopes=None,
    num_splits=0,
    overlap_prologue=False,
    *,
    enable_pdl=True,
    merge="auto",
    warps=0,
):
    _check_tuning(merge, warps)
    _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, alibi_slopes, num_splits)
    check_table_values(_OP, block_tables, seq_lens, k_cache.shape[0], k_cache.shape[2])
    out = decode_attention_reference(
        query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, sm_scale, alibi_slopes, torch.float32
    )
    return out.to(query.dtype)


@fake(_OP)
def _paged_decode_attention_int8_fake(
    query,
    k_cache,
    v_cache,
    k_scales,
    v_scales,
    block_tables,
    seq_lens,
    sm_scale,
    alibi_slopes=None,
    num_splits=0,
    overlap_prologue=False,
    *,
    enable_pdl=True,
    merge="auto",
    warps=0,
):
    _check_tuning(merge, warps)
    _check_args(query, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, alibi_slopes, num_splits)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@export
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi slopes of Press et al. (as in BLOOM / TensorRT-LLM), float32 ``[num_heads]``."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / p)
    slopes = [base ** (i + 1) for i in range(p)]
    if p < num_heads:
        extra = 2.0 ** (-4.0 / p)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - p)]
    return torch.tensor(slopes, dtype=torch.float32)


@export
def paged_decode_attention_int8(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    *,
    num_splits: int = 0,
    overlap_prologue: bool = False,
    enable_pdl: bool | None = None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:
    """Single-token decode attention over the paged int8 KV cache (MHA, GQA, MQA).

    For sequence ``b`` of length ``L = seq_lens[b]`` and query head ``h`` (kv head
    ``kh = h // (HQ // H_kv)``), with ``K[j] = k_cache[blk, kh, off].float() * k_scale(blk, kh, off)``
    for token ``j`` at ``blk = block_tables[b, j // block_size]``, ``off = j % block_size`` (the
    scale is ``k_scales[blk, kh, off]`` when dynamic, ``k_scales[0]`` when static), V likewise::

        s[j] = sm_scale * (query[b, h].float() @ K[j]) + alibi_slopes[h] * (j - (L - 1))   # j < L
        out[b, h] = (softmax(s) @ V[:L]).to(query.dtype)                 # float32 throughout

    ``seq_lens[b] == 0`` gives zeros. Block-table entries past a sequence's length are never used
    (the kernel may read them, inside ``block_tables``, before it knows the length).

    Args:
        query: float16 or bfloat16 ``[B, HQ, D]``, D in {64, 128}, last dimension contiguous.
        k_cache, v_cache: int8 ``[num_blocks, H_kv, block_size, D]``; HQ a multiple of H_kv.
        k_scales, v_scales: float32 ``[num_blocks, H_kv, block_size]`` or ``[1]`` (both alike).
        block_tables: int32 ``[B, max_blocks]``; seq_lens: int32 ``[B]``, each <= max_blocks *
            block_size.
        sm_scale: softmax scale; ``None`` means ``D ** -0.5``.
        alibi_slopes: optional float32 ``[HQ]``.
        num_splits: keyword-only performance knob: how many CTAs share one sequence's context
            (flash-decoding split-K); 0 lets the kernel choose. The result does not depend on it
            beyond float32 rounding.
        overlap_prologue: keyword-only; True promises that, of what this call reads, the kernel
            launched just before it on the same stream writes only each sequence's last token
            (position ``seq_lens[b] - 1``) in the KV cache and its per-token scales, as the decode
            step's ``reshape_and_cache_int8`` of the new tokens does: none of ``query``,
            ``block_tables``, ``seq_lens``, ``alibi_slopes``, static scales or older tokens. With
            programmatic dependent launch (sm_90, split contexts) the kernel then reads those, and
            starts streaming its first K/V chunks, while that kernel finishes; only the last
            token's chunk waits for it. A false promise is a race. No effect on CPU or where PDL
            is off.
        enable_pdl: keyword-only; launch with programmatic dependent launch (sm_90). ``None``:
            on, unless ``QOPS_PDL=0`` was set when qops was imported (:mod:`qops.envs`).
        tuning: keyword-only :class:`DecodeTuning` (the split merge and warps per CTA).
    Returns:
        ``[B, HQ, D]`` in the query's dtype.
    """
    if sm_scale is None:
        sm_scale = query.shape[-1] ** -0.5
    t = tuning or DecodeTuning()
    return torch.ops.qops.paged_decode_attention_int8(
        query,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        float(sm_scale),
        alibi_slopes,
        int(num_splits),
        bool(overlap_prologue),
        enable_pdl=envs.pdl(enable_pdl),
        merge=t.merge,
        warps=t.warps,
    )
