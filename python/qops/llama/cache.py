"""KV caches of the quantized Llama.

- int8: ``qops.kv_cache.PagedKVCache`` (the library's manager: int8 ``[L, num_blocks, H_kv,
  block_size, D]`` caches with dynamic per-(token, head) or static per-layer scales); written by
  ``qops.reshape_and_cache_int8``, read by ``qops.paged_decode_attention_int8``.
- fp16 (or bf16/fp32): ``HalfPagedKVCache`` below, the same block allocation and the same layout
  in the model's dtype, read with PyTorch SDPA. It is the "no KV quantization" variant of the same
  harness (fp16 and W8A8-only runs).

Both expose ``append_slots``, ``free``, ``block_tables``, ``seq_lens``, ``write(layer, k, v,
slots)`` and ``gather(layer, slots) -> (k, v)`` (the cached, i.e. dequantized, values of the given
slots), so the attention module does not care which one it has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv_cache import BlockAllocator, PagedKVCache
from .config import LlamaArgs, QuantConfig


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache [num_blocks, H, bs, D]`` at ``slots [T]`` -> ``[T, H, D]``."""
    bs = cache.shape[2]
    return cache[slots // bs, :, slots % bs]


class Int8PagedKVCache(PagedKVCache):
    """``qops.kv_cache.PagedKVCache`` plus ``gather`` (dequantized reads of given slots, used when
    prefill attends to the cached values, as decode will) and ``bytes_per_token``."""

    kv_dtype = "int8"

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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

    def write(self, i: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, H_kv, D]`` at ``slot_mapping [T]``; slot -1 is padding and
        is skipped (written to the spare block). Other slots are not range-checked (that would
        synchronize with the host)."""
        bs = self.block_size
        slot_mapping = torch.where(slot_mapping >= 0, slot_mapping, self.num_blocks * bs)
        blk, off = slot_mapping // bs, slot_mapping % bs
        self.k_cache[i][blk, :, off] = key.to(self.dtype)
        self.v_cache[i][blk, :, off] = value.to(self.dtype)

    def gather(self, i: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (_gather_slots(self.k_cache[i], slots).to(dtype), _gather_slots(self.v_cache[i], slots).to(dtype))

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.k_cache.element_size()


def make_cache(
    args: LlamaArgs,
    qcfg: QuantConfig,
    num_blocks: int,
    *,
    device,
    dtype: torch.dtype,
    k_scales: Sequence[float] | None = None,
    v_scales: Sequence[float] | None = None,
):
    """The cache a model with ``qcfg`` uses: int8 (dynamic or static scales) or float."""
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
