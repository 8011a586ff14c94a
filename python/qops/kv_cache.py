"""Paged int8 KV cache: the quantizing cache write ``reshape_and_cache_int8`` and the cache manager.

Layout (docs/ops.md "Paged int8 KV cache", docs/kv_cache.md):

- ``k_cache``, ``v_cache``: int8 ``[num_blocks, H_kv, block_size, D]``, block_size in {16, 32, 64,
  128}; slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
- ``k_scales``, ``v_scales``: float32 ``[num_blocks, H_kv, block_size]`` (dynamic: one scale per
  (token, kv head), computed at write time) or float32 ``[1]`` (static: one given scale per
  tensor). The mode is inferred from the scales' shape.

``PagedKVCache`` owns the caches of all layers, hands out blocks to sequences, maps new tokens to
slots and builds the ``block_tables`` / ``seq_lens`` tensors that
``qops.paged_decode_attention_int8`` reads.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Iterator, Sequence

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, check_static_scale, export, fake, reference
from .quantization import absmax_scale, quantize_int8

BLOCK_SIZES = (16, 32, 64, 128)
"""The block sizes (tokens per block) that the CUDA kernels support."""

_OP = "reshape_and_cache_int8"


# ---- argument checks (shared by the reference, the fake and the attention op) -----------------
def scale_mode(op: str, k_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor) -> str:
    """``"dynamic"`` or ``"static"``, inferred from the scales' shapes (both must agree)."""
    nb, h, bs = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    check_dtype(k_scales, torch.float32, op, "k_scales")
    check_dtype(v_scales, torch.float32, op, "v_scales")
    modes = []
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(s.shape) == (nb, h, bs):
            modes.append("dynamic")
        elif tuple(s.shape) == (1,):
            modes.append("static")
        else:
            check(
                False,
                op,
                f"{name} must be float32 [num_blocks, H_kv, block_size] = [{nb}, {h}, {bs}] "
                f"(dynamic per-token scales) or [1] (a static per-tensor scale), got shape "
                f"{tuple(s.shape)}",
            )
    check(
        modes[0] == modes[1],
        op,
        f"k_scales and v_scales must both be dynamic or both static, got k_scales {modes[0]} and v_scales {modes[1]}",
    )
    check(k_scales.is_contiguous() and v_scales.is_contiguous(), op, "k_scales and v_scales must be contiguous")
    if modes[0] == "static":
        check_static_scale(op, "k_scales", k_scales)
        check_static_scale(op, "v_scales", v_scales)
    return modes[0]


def check_caches(
    op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor
) -> str:
    """Check the cache tensors of one layer; return the scale mode."""
    check_dtype(k_cache, torch.int8, op, "k_cache")
    check_dtype(v_cache, torch.int8, op, "v_cache")
    check(
        k_cache.dim() == 4,
        op,
        f"k_cache must be int8 [num_blocks, H_kv, block_size, D], got shape {tuple(k_cache.shape)}",
    )
    check(
        tuple(v_cache.shape) == tuple(k_cache.shape),
        op,
        f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}",
    )
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), op, "k_cache and v_cache must be contiguous")
    check(
        k_cache.shape[1] >= 1 and k_cache.shape[3] >= 1,
        op,
        f"k_cache must have H_kv >= 1 and D >= 1, got shape {tuple(k_cache.shape)}",
    )
    check(
        k_cache.shape[2] in BLOCK_SIZES,
        op,
        f"block_size (k_cache.shape[2]) must be one of {BLOCK_SIZES}, got {k_cache.shape[2]}",
    )
    for name, t in (("v_cache", v_cache), ("k_scales", k_scales), ("v_scales", v_scales)):
        check(t.device == k_cache.device, op, f"{name} must be on {k_cache.device}, got {t.device}")
    return scale_mode(op, k_cache, k_scales, v_scales)


def check_slot_mapping(op: str, slot_mapping: torch.Tensor, capacity: int, duplicate_note: str = ""):
    """The reference's value checks of a cache write's ``slot_mapping`` (int8 and int4 caches):
    every slot in ``[-1, capacity)``, no slot twice. Returns ``(keep, slots)``: the mask of the
    tokens written and their slots."""
    bad = (slot_mapping < -1) | (slot_mapping >= capacity)
    check(
        not bool(bad.any()),
        op,
        f"slot_mapping holds slots outside [-1, num_blocks * block_size = {capacity}): "
        f"{slot_mapping[bad][:8].tolist()}",
    )
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    dup = slots.unique(return_counts=True)
    check(
        bool((dup[1] <= 1).all()),
        op,
        f"slot_mapping maps several tokens to one slot: {dup[0][dup[1] > 1][:8].tolist()}{duplicate_note}",
    )
    return keep, slots


def check_block_tables(op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, b: int, device) -> None:
    """Dtypes, shapes, layout and device of a paged cache's ``block_tables`` ``[B, max_blocks]``
    and ``seq_lens`` ``[B]`` (the decode attentions and the SKVQ write)."""
    check_dtype(block_tables, torch.int32, op, "block_tables")
    check(
        block_tables.dim() == 2 and block_tables.shape[0] == b and block_tables.shape[1] >= 1,
        op,
        f"block_tables must be int32 [B, max_blocks] with B = {b}, max_blocks >= 1, got shape "
        f"{tuple(block_tables.shape)}",
    )
    check(block_tables.stride(1) == 1, op, "block_tables' last dimension must be contiguous (stride 1)")
    check_dtype(seq_lens, torch.int32, op, "seq_lens")
    check(tuple(seq_lens.shape) == (b,), op, f"seq_lens must be int32 [B] = [{b}], got {tuple(seq_lens.shape)}")
    check(seq_lens.is_contiguous(), op, "seq_lens must be contiguous")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        check(t.device == device, op, f"{name} must be on {device}, got {t.device}")


def check_table_values(
    op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The reference's value checks of ``block_tables`` and ``seq_lens`` (the CUDA kernels do not
    read them on the host): every length in ``[0, max_blocks * block_size]``, every block id a
    sequence's length covers in ``[0, num_blocks)``."""
    cap = block_tables.shape[1] * block_size
    bad_len = (seq_lens < 0) | (seq_lens > cap)
    check(
        not bool(bad_len.any()),
        op,
        f"seq_lens must be in [0, max_blocks * block_size = {cap}], got {seq_lens[bad_len][:8].tolist()}",
    )
    used = torch.arange(block_tables.shape[1], device=seq_lens.device) * block_size < seq_lens.long()[:, None]
    bad_blk = used & ((block_tables < 0) | (block_tables >= num_blocks))
    check(
        not bool(bad_blk.any()),
        op,
        f"block_tables hold block ids outside [0, num_blocks = {num_blocks}) within seq_lens: "
        f"{block_tables[bad_blk][:8].tolist()}",
    )


def _check_write_args(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping) -> str:
    op = _OP
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
    mode = check_caches(op, k_cache, v_cache, k_scales, v_scales)
    check(
        tuple(key.shape[1:]) == (k_cache.shape[1], k_cache.shape[3]),
        op,
        f"key's [H_kv, D] = {list(key.shape[1:])} must match k_cache's "
        f"[H_kv, D] = [{k_cache.shape[1]}, {k_cache.shape[3]}]",
    )
    check(k_cache.shape[3] % 16 == 0, op, f"D must be a multiple of 16, got {k_cache.shape[3]}")
    check_dtype(slot_mapping, torch.int64, op, "slot_mapping")
    check(
        slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0],
        op,
        f"slot_mapping must be int64 [T] with T = {key.shape[0]}, got shape {tuple(slot_mapping.shape)}",
    )
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        check(t.device == k_cache.device, op, f"{name} must be on {k_cache.device}, got {t.device}")
    return mode


# ---- reshape_and_cache_int8 ---------------------------------------------------------------------
@reference(_OP)
def _reshape_and_cache_int8_ref(
    key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, *, enable_pdl=True
) -> None:
    mode = _check_write_args(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    num_blocks, _, block_size, _ = k_cache.shape
    keep, slots = check_slot_mapping(
        _OP,
        slot_mapping,
        num_blocks * block_size,
        " (a slot holds one token: its int8 row and its scale must come from the same token)",
    )
    blk, off = slots // block_size, slots % block_size
    for x, cache, scales in ((key[keep], k_cache, k_scales), (value[keep], v_cache, v_scales)):
        x = x.float()  # [n, H_kv, D]
        if mode == "dynamic":
            s = absmax_scale(x, -1)  # [n, H_kv]
            scales[blk, :, off] = s  # advanced indices around a slice: indexed shape [n, H_kv]
            cache[blk, :, off] = quantize_int8(x, s.unsqueeze(-1))
        else:
            cache[blk, :, off] = quantize_int8(x, scales.reshape(()))


@fake(_OP)
def _reshape_and_cache_int8_fake(
    key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, *, enable_pdl=True
) -> None:
    _check_write_args(key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping)
    return None


@export
def reshape_and_cache_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    enable_pdl: bool | None = None,
) -> None:
    """Quantize new tokens' K and V to int8 and write them into their slots of the paged cache.

    For every token ``t`` with ``s = slot_mapping[t] >= 0``, ``b, o = s // block_size, s % block_size``
    and every kv head ``h``::

        # dynamic scales ([num_blocks, H_kv, block_size]): computed here, written
        k_scales[b, h, o] = max(key[t, h].float().abs().amax() / 127, 1e-10)
        k_cache[b, h, o] = (key[t, h].float() / k_scales[b, h, o]).round().clamp(-128, 127).to(int8)
        # static scale ([1]): read, never written
        k_cache[b, h, o] = (key[t, h].float() / k_scales).round().clamp(-128, 127).to(int8)

    and the same for ``value`` into ``v_cache`` / ``v_scales`` (round half to even, IEEE float32
    division, NaN quantizes to 0). Slot -1 is padding: the token is skipped. Any other slot outside
    ``[0, num_blocks * block_size)`` is an error: the reference raises; the CUDA kernel never writes
    out of bounds (it skips the token) and traps in debug builds (``QOPS_DEBUG``). Two tokens mapped
    to one slot are an error: the reference raises; the CUDA kernel does not check (that would
    synchronize with the host) and may then leave a mix of the two tokens in the slot. Static
    scales must be finite and > 0 (the reference raises; the CUDA kernel reads them on the device
    unchecked).

    Args:
        key, value: float16 or bfloat16 ``[T, H_kv, D]`` with a contiguous last dimension (token and
            head strides may be anything, e.g. slices of a fused QKV projection).
        k_cache, v_cache: int8 ``[num_blocks, H_kv, block_size, D]``, contiguous, written in place.
        k_scales, v_scales: float32 ``[num_blocks, H_kv, block_size]`` (dynamic) or ``[1]``
            (static), contiguous; both the same mode.
        slot_mapping: int64 ``[T]``.
        enable_pdl: keyword-only; launch with programmatic dependent launch (sm_90). ``None``: on,
            unless ``QOPS_PDL=0`` was set when qops was imported (:mod:`qops.envs`).
    """
    torch.ops.qops.reshape_and_cache_int8(
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping, enable_pdl=envs.pdl(enable_pdl)
    )


# ---- the cache manager --------------------------------------------------------------------------
@export
class BlockAllocator:
    """Block bookkeeping of a paged KV cache: which blocks each sequence owns, its length, and the
    slot mapping / block tables / lengths tensors the cache-write and decode ops take.

    Blocks are handed out lowest id first; a sequence owns the same block ids in every layer, so
    one ``block_tables`` / ``seq_lens`` pair serves every layer of a step. ``PagedKVCache`` (int8)
    and the Llama's float cache share this class, so they allocate identically.
    """

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self._blocks: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._journal: list[tuple] | None = None  # undo records of the open transaction

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Every ``append_slots`` and ``free`` made inside the block is undone if the block raises:
        a failed model step leaves no slot reserved and no length grown. Nested blocks join the
        outermost one."""
        if self._journal is not None:
            yield
            return
        self._journal = []
        try:
            yield
        except BaseException:
            self._undo(self._journal)
            raise
        finally:
            self._journal = None

    def _undo(self, journal: list[tuple]) -> None:
        for record in reversed(journal):
            if record[0] == "append":
                _, sid, prev_len, prev_blocks = record
                blocks = self._blocks[sid]
                while len(blocks) > prev_blocks:
                    self._free.append(blocks.pop())
                if prev_len is None:
                    del self._blocks[sid], self._lens[sid]
                else:
                    self._lens[sid] = prev_len
            else:  # "free"
                _, sid, blocks, length = record
                for b in blocks:
                    self._free.remove(b)
                self._blocks[sid], self._lens[sid] = list(blocks), length

    def _known(self, seq_id: Hashable, where: str) -> None:
        if seq_id not in self._lens:
            raise KeyError(f"{self._name}.{where}: unknown sequence id {seq_id!r} (never added, or already freed)")

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def sequences(self) -> list[Hashable]:
        return list(self._lens)

    def seq_len(self, seq_id: Hashable) -> int:
        self._known(seq_id, "seq_len")
        return self._lens[seq_id]

    def blocks(self, seq_id: Hashable) -> list[int]:
        self._known(seq_id, "blocks")
        return list(self._blocks[seq_id])

    def blocks_needed(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> int:
        """New blocks that ``append_slots(seq_ids, num_tokens)`` would allocate."""
        need = 0
        for sid, n in zip(seq_ids, num_tokens):
            cur = self._lens.get(sid, 0)
            have = len(self._blocks.get(sid, ()))
            need += max(0, -(-(cur + n) // self.block_size) - have)
        return need

    def can_append(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> bool:
        """True when ``append_slots(seq_ids, num_tokens)`` would find enough free blocks."""
        return self.blocks_needed(seq_ids, num_tokens) <= len(self._free)

    def append_slots(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int] | int = 1) -> torch.Tensor:
        """Reserve slots for ``num_tokens[i]`` new tokens at the end of sequence ``seq_ids[i]``.

        Unknown sequence ids are added (empty). Blocks are allocated as needed; the sequences'
        lengths grow by ``num_tokens``. Returns the slot mapping, int64 ``[sum(num_tokens)]`` on the
        cache's device, tokens in the order of ``seq_ids`` (the order of the rows of ``key`` and
        ``value`` given to ``write``). Raises ``RuntimeError`` (and changes nothing) when the free
        blocks do not suffice. Inside ``transaction()`` it is undone if the block raises.
        """
        if isinstance(num_tokens, int):
            num_tokens = [num_tokens] * len(seq_ids)
        check(
            len(num_tokens) == len(seq_ids),
            f"{self._name}.append_slots",
            f"num_tokens must have {len(seq_ids)} entries, got {len(num_tokens)}",
        )
        check(len(set(seq_ids)) == len(seq_ids), f"{self._name}.append_slots", "seq_ids must be distinct")
        check(
            all(isinstance(n, int) and n >= 0 for n in num_tokens),
            f"{self._name}.append_slots",
            f"num_tokens must be ints >= 0, got {list(num_tokens)}",
        )
        need = self.blocks_needed(seq_ids, num_tokens)
        check(
            need <= len(self._free),
            f"{self._name}.append_slots",
            f"out of cache blocks: {need} needed, {len(self._free)} free of {self.num_blocks}",
            RuntimeError,
        )
        bs = self.block_size
        slots: list[int] = []
        for sid, n in zip(seq_ids, num_tokens):
            if self._journal is not None:
                self._journal.append(("append", sid, self._lens.get(sid), len(self._blocks.get(sid, ()))))
            blocks = self._blocks.setdefault(sid, [])
            cur = self._lens.setdefault(sid, 0)
            while len(blocks) * bs < cur + n:
                blocks.append(self._free.pop())
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(cur, cur + n))
            self._lens[sid] = cur + n
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, seq_id: Hashable) -> None:
        """Return a sequence's blocks to the free list and forget it (``KeyError`` for an unknown
        or already freed sequence). Inside ``transaction()`` it is undone if the block raises."""
        self._known(seq_id, "free")
        blocks = self._blocks.pop(seq_id)
        length = self._lens.pop(seq_id)
        if self._journal is not None:
            self._journal.append(("free", seq_id, blocks, length))
        self._free.extend(reversed(blocks))

    def reset(self) -> None:
        """Free every sequence (the cache contents are left as they are)."""
        for sid in list(self._lens):
            self.free(sid)

    def block_tables(self, seq_ids: Sequence[Hashable], max_blocks: int | None = None) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` block ids of the sequences, padded with 0 (never read: the
        decode reads only the first ``seq_lens[b]`` tokens). ``max_blocks`` defaults to the longest
        sequence's block count (at least 1); give a fixed value for CUDA graphs."""
        for sid in seq_ids:
            self._known(sid, "block_tables")
        lists = [self._blocks[sid] for sid in seq_ids]
        width = max([len(b) for b in lists] + [1]) if max_blocks is None else max_blocks
        check(
            all(len(b) <= width for b in lists),
            f"{self._name}.block_tables",
            f"max_blocks={width} is smaller than a sequence's block count",
        )
        rows = [b + [0] * (width - len(b)) for b in lists]
        return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(seq_ids), width)

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 ``[B]`` current lengths (including tokens whose slots were just appended)."""
        for sid in seq_ids:
            self._known(sid, "seq_lens")
        return torch.tensor([self._lens[sid] for sid in seq_ids], dtype=torch.int32, device=self.device)


@export
class PagedKVCache(BlockAllocator):
    """The int8 KV caches of ``num_layers`` layers, with block allocation per sequence.

    All layers share one block allocation: a sequence owns the same block ids in every layer, so
    one ``block_tables`` / ``seq_lens`` pair serves every layer of a step.

    A decode or prefill step::

        slots = cache.append_slots([seq_a, seq_b], [n_a, n_b])   # int64 [n_a + n_b]
        for layer in range(L):
            ...
            cache.write(layer, k, v, slots)                      # k, v [n_a + n_b, H_kv, D]
            bt, lens = cache.block_tables([seq_a, seq_b]), cache.seq_lens([seq_a, seq_b])
            o = qops.paged_decode_attention_int8(q, *cache.layer(layer), bt, lens, sm_scale)
        cache.free(seq_a)

    Args:
        num_layers, num_kv_heads, head_dim: the model's shape (``head_dim`` 64 or 128 for the
            CUDA decode kernel).
        num_blocks: blocks per layer (each holds ``block_size`` tokens of every kv head).
        block_size: 16, 32, 64 or 128.
        k_scale, v_scale: ``None`` (default) for dynamic per-(token, head) scales; a float (or a
            sequence of ``num_layers`` floats) for TensorRT-LLM-style static per-tensor scales.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        device: torch.device | str = "cpu",
        k_scale: float | Sequence[float] | None = None,
        v_scale: float | Sequence[float] | None = None,
    ) -> None:
        op = "PagedKVCache"
        check(block_size in BLOCK_SIZES, op, f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
        check(
            num_layers >= 1 and num_kv_heads >= 1 and num_blocks >= 1,
            op,
            "num_layers, num_kv_heads and num_blocks must be >= 1",
        )
        check(head_dim >= 16 and head_dim % 16 == 0, op, f"head_dim must be a multiple of 16, got {head_dim}")
        check((k_scale is None) == (v_scale is None), op, "give both k_scale and v_scale, or neither")
        super().__init__(num_blocks, block_size, device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.static = k_scale is not None
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k_cache = torch.zeros(shape, dtype=torch.int8, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=torch.int8, device=self.device)
        if self.static:
            self.k_scales = self._static_scales(k_scale, "k_scale")
            self.v_scales = self._static_scales(v_scale, "v_scale")
        else:
            sshape = (num_layers, num_blocks, num_kv_heads, block_size)
            self.k_scales = torch.ones(sshape, dtype=torch.float32, device=self.device)
            self.v_scales = torch.ones(sshape, dtype=torch.float32, device=self.device)

    def _static_scales(self, scale, name: str) -> torch.Tensor:
        vals = [float(scale)] * self.num_layers if isinstance(scale, (int, float)) else [float(s) for s in scale]
        check(
            len(vals) == self.num_layers,
            "PagedKVCache",
            f"{name} must be a float or {self.num_layers} floats, got {len(vals)}",
        )
        check(
            all(math.isfinite(v) and v > 0 for v in vals), "PagedKVCache", f"{name} must be finite and > 0, got {vals}"
        )
        return torch.tensor(vals, dtype=torch.float32, device=self.device).reshape(self.num_layers, 1)

    # -- per-layer tensors
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache, k_scales, v_scales)`` of layer ``i`` (views, contiguous)."""
        return self.k_cache[i], self.v_cache[i], self.k_scales[i], self.v_scales[i]

    def write(self, i: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """``reshape_and_cache_int8`` into layer ``i``."""
        reshape_and_cache_int8(key, value, *self.layer(i), slot_mapping)
