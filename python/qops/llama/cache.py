"""KV caches of the quantized Llama.

- int8: ``qops.kv_cache.PagedKVCache`` (the library's manager: int8 ``[L, num_blocks, H_kv,
  block_size, D]`` caches with dynamic per-(token, head) or static per-layer scales); written by
  ``qops.reshape_and_cache_int8``, read by ``qops.paged_decode_attention_int8``.
- int4: ``Int4PagedKVCache`` below: uint8 ``[L, num_blocks, H_kv, block_size, 4G + D/2]`` caches of
  seed-002 rows (fp16 scale/shift per group, packed nibbles), written by
  ``qops.reshape_and_cache_int4``, read by ``qops.int4_gqa_decode``; optionally SKVQ's
  full-precision sinks and window in side buffers ``[L, max_seqs, H_kv, sinks + window, D]``, one
  row per sequence, written by ``qops.skvq_cache_write`` (docs/int4.md).
- fp16 (or bf16/fp32): ``HalfPagedKVCache`` below, the same block allocation and the same layout
  in the model's dtype, read with PyTorch SDPA. It is the "no KV quantization" variant of the same
  harness (fp16 and W8A8-only runs).

All expose ``append_slots``, ``free``, ``block_tables``, ``seq_lens``, ``layer(i)``,
``write(layer, k, v, slots, ctx=None)``, ``gather(layer, slots, dtype, ctx=None) -> (k, v)`` (the
cached, i.e. dequantized, values of the given slots: what decode reads) and ``bytes_per_token``,
so the attention module does not care which one it has. ``ctx`` is the step's ``StepContext``:
only the SKVQ cache needs it (its write and its reads depend on each sequence's length).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

import qops

from .. import int4_kv
from .._registry import check
from ..kv_cache import BLOCK_SIZES, BlockAllocator, PagedKVCache
from .config import LlamaArgs, QuantConfig

if TYPE_CHECKING:
    from .layers import StepContext


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache [num_blocks, H, bs, D]`` at ``slots [T]`` -> ``[T, H, D]``."""
    bs = cache.shape[2]
    return cache[slots // bs, :, slots % bs]


class Int8PagedKVCache(PagedKVCache):
    """``qops.kv_cache.PagedKVCache`` plus ``gather`` (dequantized reads of given slots, used when
    prefill attends to the cached values, as decode will) and ``bytes_per_token``."""

    kv_dtype = "int8"
    skvq = False

    def write(self, i: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, ctx=None) -> None:
        """``reshape_and_cache_int8`` into layer ``i`` (``ctx`` is not needed)."""
        super().write(i, key, value, slot_mapping)

    def rope_write(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """RoPE on ``q`` and ``k`` in place and the write of the rotated ``k`` and ``v`` into layer
        ``i``: one ``qops.rope_and_cache_int8`` (float16 / bfloat16 activations)."""
        kc, vc, ks, vs = self.layer(i)
        qops.rope_and_cache_int8(positions, q, k, v, cos, sin, kc, vc, ks, vs, slot_mapping)

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V ``[T, H_kv, D]`` in ``dtype`` at ``slots`` of layer ``i``."""
        kc, vc, ks, vs = self.layer(i)
        out = []
        for c, s in ((kc, ks), (vc, vs)):
            x = _gather_slots(c, slots).float()
            scale = _gather_slots(s.unsqueeze(-1), slots) if s.dim() == 3 else s.reshape(())
            out.append((x * scale).to(dtype))
        return out[0], out[1]

    def bytes_per_token(self) -> int:
        """Cache bytes per token over all layers (K and V, scales included)."""
        per = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        if not self.static:
            per += 2 * self.num_layers * self.num_kv_heads * 4
        return per


class HalfPagedKVCache(BlockAllocator):
    """A paged KV cache in a float dtype, with ``PagedKVCache``'s interface and the same block
    allocation (both are ``qops.kv_cache.BlockAllocator``s).

    ``k_cache``, ``v_cache``: ``[L, num_blocks + 1, H_kv, block_size, D]`` in ``dtype``: block
    ``num_blocks`` is never handed out; ``write`` sends padding tokens (slot -1) there, which skips
    them without a host synchronization, as ``reshape_and_cache_int8`` skips them.
    """

    kv_dtype = "fp16"
    static = False
    skvq = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        device="cpu",
        dtype: torch.dtype = torch.float16,
    ) -> None:
        if num_layers < 1 or num_kv_heads < 1 or num_blocks < 1 or block_size < 1:
            raise ValueError("HalfPagedKVCache: num_layers, num_kv_heads, num_blocks and block_size must be >= 1")
        super().__init__(num_blocks, block_size, device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        shape = (num_layers, num_blocks + 1, num_kv_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_scales = self.v_scales = None
        self.dtype = dtype

    # -- storage
    def layer(self, i: int):
        return self.k_cache[i], self.v_cache[i], None, None

    def write(self, i: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, ctx=None) -> None:
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping [T]``; slot -1 is padding and
        is skipped (written to the spare block). Other slots are not range-checked (that would
        synchronize with the host)."""
        bs = self.block_size
        slot_mapping = torch.where(slot_mapping >= 0, slot_mapping, self.num_blocks * bs)
        blk, off = slot_mapping // bs, slot_mapping % bs
        self.k_cache[i][blk, :, off] = key.to(self.dtype)
        self.v_cache[i][blk, :, off] = value.to(self.dtype)

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        return (_gather_slots(self.k_cache[i], slots).to(dtype), _gather_slots(self.v_cache[i], slots).to(dtype))

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_cache.element_size()


class Int4PagedKVCache(BlockAllocator):
    """The paged int4 KV cache (seed-002 rows), with SKVQ's full-precision sinks and window when
    ``sinks + window > 0``; the interface of the other caches (a ``BlockAllocator``).

    ``k_cache``, ``v_cache``: uint8 ``[L, num_blocks, H_kv, block_size, 4 * num_groups + D / 2]``
    (``layer(i)`` gives the ``[num_blocks, H_kv, block_size, row_bytes]`` views the ops take).
    Every position of a sequence has its slot, as in the int8 cache. Padding tokens (slot -1)
    are skipped by ``reshape_and_cache_int4`` itself: no spare block is needed.

    SKVQ (``sinks + window > 0``): ``k_side``, ``v_side`` ``[L, max_seqs, H_kv, sinks + window,
    D]`` in ``dtype``; each sequence owns one side slot (a row of every layer's side buffer) from
    its first ``append_slots`` until ``free``, allocated and released transactionally with its
    blocks (``transaction()``). Position ``p`` of a sequence of ``L`` tokens is read from the side
    buffer when ``p < sinks`` or ``p >= L - window``, else from its int4 slot (written by
    ``qops.skvq_cache_write`` when the token leaves the window).

    Args:
        num_layers, num_kv_heads, head_dim: the model's shape (``head_dim`` 64 or 128).
        num_blocks, block_size: the paged allocation (block_size 16, 32, 64 or 128).
        num_groups: scale/shift groups per row, 1 or 4.
        sinks, window: SKVQ's full-precision tokens (0 and 0: a plain int4 cache).
        clip_ratio: SKVQ's clipping of the int4 range, in (0, 1].
        max_seqs: side slots, i.e. sequences the cache can hold at once (SKVQ only); default
            ``min(num_blocks, 256)``.
        dtype: the model's dtype (float16 or bfloat16): the side buffers' and the K/V's.
    """

    kv_dtype = "int4"
    static = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_groups: int = 1,
        sinks: int = 0,
        window: int = 0,
        clip_ratio: float = 1.0,
        max_seqs: int | None = None,
        device="cpu",
        dtype: torch.dtype = torch.float16,
    ) -> None:
        op = "Int4PagedKVCache"
        check(block_size in BLOCK_SIZES, op, f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
        check(
            num_layers >= 1 and num_kv_heads >= 1 and num_blocks >= 1,
            op,
            "num_layers, num_kv_heads and num_blocks must be >= 1",
        )
        check(head_dim in int4_kv.HEAD_DIMS, op, f"head_dim must be 64 or 128, got {head_dim}")
        check(num_groups in int4_kv.NUM_GROUPS, op, f"num_groups must be 1 or 4, got {num_groups}")
        check(sinks >= 0 and window >= 0, op, f"sinks and window must be >= 0, got {sinks} and {window}")
        check(0.0 < clip_ratio <= 1.0, op, f"clip_ratio must be in (0, 1], got {clip_ratio}")
        half = (torch.float16, torch.bfloat16)
        check(dtype in half, op, f"dtype must be float16 or bfloat16, got {dtype}", TypeError)
        super().__init__(num_blocks, block_size, device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_groups, self.sinks, self.window, self.clip_ratio = num_groups, sinks, window, clip_ratio
        self.dtype = dtype
        self.row_bytes = int4_kv.kv_int4_row_bytes(head_dim, num_groups)
        shape = (num_layers, num_blocks, num_kv_heads, block_size, self.row_bytes)
        self.k_cache = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        self.k_scales = self.v_scales = None
        self.skvq = sinks + window > 0
        self.max_seqs = 0
        self.k_side: torch.Tensor | None = None
        self.v_side: torch.Tensor | None = None
        self._free_side: list[int] = []
        self._side: dict[Hashable, int] = {}
        if self.skvq:
            self.max_seqs = min(num_blocks, 256) if max_seqs is None else max_seqs
            check(self.max_seqs >= 1, op, f"max_seqs must be >= 1, got {self.max_seqs}")
            sshape = (num_layers, self.max_seqs, num_kv_heads, sinks + window, head_dim)
            self.k_side = torch.zeros(sshape, dtype=dtype, device=self.device)
            self.v_side = torch.zeros(sshape, dtype=dtype, device=self.device)
            self._free_side = list(range(self.max_seqs - 1, -1, -1))  # pop() hands out 0, 1, ...

    # -- side slots (SKVQ): one per sequence, taken and released with its blocks
    def append_slots(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | int = 1) -> torch.Tensor:
        """``BlockAllocator.append_slots``; with SKVQ, a new sequence also takes a side slot.
        Raises ``RuntimeError`` (and changes nothing) when blocks or side slots run out."""
        if not self.skvq:
            return super().append_slots(seq_ids, num_tokens)
        new = [sid for sid in dict.fromkeys(seq_ids) if sid not in self._lens]
        check(
            len(new) <= len(self._free_side),
            f"{self._name}.append_slots",
            f"out of side-buffer slots: {len(new)} new sequences, {len(self._free_side)} free of {self.max_seqs} "
            "(max_seqs)",
            RuntimeError,
        )
        slots = super().append_slots(seq_ids, num_tokens)
        for sid in new:
            self._side[sid] = self._free_side.pop()
            if self._journal is not None:
                self._journal.append(("side_take", sid, self._side[sid]))
        return slots

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        if self.skvq:
            slot = self._side.pop(seq_id)
            self._free_side.append(slot)
            if self._journal is not None:
                self._journal.append(("side_free", seq_id, slot))

    def _undo(self, journal: list[tuple]) -> None:
        for record in reversed(journal):
            if record[0] == "side_take":
                _, sid, slot = record
                del self._side[sid]
                self._free_side.append(slot)
            elif record[0] == "side_free":
                _, sid, slot = record
                self._free_side.remove(slot)
                self._side[sid] = slot
            else:
                super()._undo([record])

    @property
    def num_free_side_slots(self) -> int:
        return len(self._free_side)

    def side_slots(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 ``[B]``: each sequence's row of the side buffers (SKVQ only)."""
        check(self.skvq, f"{self._name}.side_slots", "this cache has no side buffers (sinks = window = 0)")
        for sid in seq_ids:
            self._known(sid, "side_slots")
        return torch.tensor([self._side[sid] for sid in seq_ids], dtype=torch.int32, device=self.device)

    # -- storage
    def layer(self, i: int):
        """``(k_cache, v_cache, k_side, v_side)`` of layer ``i`` (the side buffers ``None`` without
        SKVQ)."""
        if self.k_side is None or self.v_side is None:
            return self.k_cache[i], self.v_cache[i], None, None
        return self.k_cache[i], self.v_cache[i], self.k_side[i], self.v_side[i]

    def write(
        self, i: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, ctx: StepContext | None = None
    ) -> None:
        """Quantize ``key``/``value`` ``[T, H_kv, D]`` into layer ``i``: ``reshape_and_cache_int4``
        at ``slot_mapping`` (slot -1 skipped), or with SKVQ ``skvq_cache_write`` with the step's
        ``ctx.block_tables``, ``ctx.side_slots``, ``ctx.seq_lens`` (after the step) and
        ``ctx.cu_seqlens``."""
        kc, vc, ks, vs = self.layer(i)
        if ks is None or vs is None:
            qops.reshape_and_cache_int4(key, value, kc, vc, slot_mapping, self.num_groups, clip_ratio=self.clip_ratio)
            return
        check(
            ctx is not None
            and ctx.block_tables is not None
            and ctx.seq_lens is not None
            and ctx.cu_seqlens is not None
            and ctx.side_slots is not None,
            f"{self._name}.write",
            "the SKVQ cache writes with the step's block_tables, side_slots, seq_lens and cu_seqlens (ctx)",
        )
        assert ctx is not None and ctx.block_tables is not None and ctx.side_slots is not None  # for mypy
        assert ctx.seq_lens is not None and ctx.cu_seqlens is not None
        qops.skvq_cache_write(
            key, value, kc, vc, ks, vs, ctx.block_tables, ctx.side_slots, ctx.seq_lens, ctx.cu_seqlens,
            self.num_groups, self.sinks, self.window, clip_ratio=self.clip_ratio,
        )  # fmt: skip

    def gather(
        self, i: int, slots: torch.Tensor, dtype: torch.dtype, ctx: StepContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, H_kv, D]`` in ``dtype`` at ``slots`` of layer ``i``, as decode reads them
        now: the int4 rows dequantized exactly (``q * scale + shift``, then rounded to ``dtype``);
        with SKVQ, the side buffer's values for the tokens it holds (``ctx`` gives each token's
        position, ``query_lens``, ``seq_lens`` and ``side_slots``: the tokens of ``ctx``'s step)."""
        kc, vc, ks, vs = self.layer(i)
        bs, g, d = self.block_size, self.num_groups, self.head_dim
        blk, off = slots // bs, slots % bs
        k = int4_kv.dequantize_kv_int4(kc[blk, :, off], g, d, dtype)
        v = int4_kv.dequantize_kv_int4(vc[blk, :, off], g, d, dtype)
        if ks is None or vs is None:
            return k, v
        check(
            ctx is not None and ctx.seq_lens is not None and ctx.side_slots is not None,
            f"{self._name}.gather",
            "the SKVQ cache reads the step's tokens with its positions, seq_lens and side_slots (ctx)",
        )
        assert ctx is not None and ctx.seq_lens is not None and ctx.side_slots is not None  # for mypy
        t, sinks, window = slots.shape[0], self.sinks, self.window
        dev = slots.device
        seq = torch.repeat_interleave(
            torch.arange(len(ctx.query_lens), device=dev),
            torch.tensor(ctx.query_lens, device=dev),
            output_size=t,
        )
        n = ctx.seq_lens.long()[seq]
        p = ctx.positions
        lo = n.clamp(max=sinks)
        side = (p < lo) | (p >= torch.maximum(lo, n - window))  # int4_token_range, per token
        idx = torch.where(p < sinks, p, sinks + (p - sinks).remainder(max(window, 1))).clamp(max=sinks + window - 1)
        row = ctx.side_slots.long()[seq]
        sel = side[:, None, None]
        return torch.where(sel, ks[row, :, idx].to(dtype), k), torch.where(sel, vs[row, :, idx].to(dtype), v)

    def bytes_per_token(self) -> int:
        """int4 cache bytes per token over all layers (K and V rows, their fp16 headers
        included); SKVQ's side buffers are per sequence: ``side_bytes_per_seq``."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    def side_bytes_per_seq(self) -> int:
        """Bytes of one sequence's side buffers (K and V, all layers); 0 without SKVQ."""
        if self.k_side is None:
            return 0
        per_layer = self.num_kv_heads * (self.sinks + self.window) * self.head_dim * self.k_side.element_size()
        return 2 * self.num_layers * per_layer


def make_cache(
    args: LlamaArgs,
    qcfg: QuantConfig,
    num_blocks: int,
    *,
    device,
    dtype: torch.dtype,
    k_scales: Sequence[float] | None = None,
    v_scales: Sequence[float] | None = None,
    max_seqs: int | None = None,
):
    """The cache a model with ``qcfg`` uses: int8 (dynamic or static scales), int4 (with SKVQ's
    side buffers for ``max_seqs`` sequences when ``qcfg.kv_window`` or ``kv_sinks``) or float."""
    if qcfg.kv_cache == "int4":
        return Int4PagedKVCache(
            args.num_layers,
            args.num_kv_heads,
            args.head_dim,
            num_blocks,
            qcfg.block_size,
            num_groups=qcfg.kv_groups,
            sinks=qcfg.kv_sinks,
            window=qcfg.kv_window,
            clip_ratio=qcfg.kv_clip,
            max_seqs=max_seqs,
            device=device,
            dtype=dtype,
        )
    if qcfg.kv_cache == "int8":
        if qcfg.kv_scales == "static":
            if k_scales is None or v_scales is None:
                raise ValueError(
                    "static KV scales need calibrated k_scales and v_scales (quantize with calibration tokens)"
                )
            return Int8PagedKVCache(
                args.num_layers,
                args.num_kv_heads,
                args.head_dim,
                num_blocks,
                qcfg.block_size,
                device=device,
                k_scale=list(k_scales),
                v_scale=list(v_scales),
            )
        return Int8PagedKVCache(
            args.num_layers, args.num_kv_heads, args.head_dim, num_blocks, qcfg.block_size, device=device
        )
    return HalfPagedKVCache(
        args.num_layers, args.num_kv_heads, args.head_dim, num_blocks, qcfg.block_size, device=device, dtype=dtype
    )


def blocks_needed(lengths: Sequence[int], block_size: int) -> int:
    """Blocks to hold sequences of the given lengths."""
    return sum(-(-int(n) // block_size) for n in lengths)
