"""Tensor parallelism for the quantized Llama over ``torch.distributed`` (docs/tensor_parallel.md).

Megatron-style sharding of every decoder layer over the ranks of one process group:

- column-parallel (output rows split): the fused ``qkv`` (each rank takes its q heads, its KV
  heads, its v heads; KV heads are replicated when there are fewer than ranks) and the fused
  ``gate_up`` (its gate rows and its up rows). Per-output-channel int8 weight scales (W8A8),
  int4 group scales and zeros (W4A16) and Qwen2's q/k/v bias follow the rows.
- row-parallel (input columns split): ``o`` and ``down``. The int8 per-channel weight scales stay
  whole; int4 group scales/zeros are split with K (the K shard must be a multiple of the group
  size). Each rank's GEMM dequantizes in its epilogue and returns *partial sums* in the model
  dtype; no scale is ever reduced. Dynamic per-token activation scales are computed locally, on
  the rank's shard of the activation (finer-grained than TP 1, so W8A8 is not bit-identical to TP
  1); static per-tensor scales are replicated.
- the partial sums are summed by ``all_reduce_add_rms_norm`` just before the residual add and the
  next RMSNorm (+ int8 quant): the one seam where a fused all-reduce + residual + RMSNorm + quant
  kernel replaces the sequence later.
- vocab-parallel embedding (out-of-shard ids give zeros, all-reduce) and LM head (local logits,
  all-gather along the vocabulary; the vocabulary is padded to a multiple of the world size).

The quantized model is built layer by layer from a ``WeightSource`` (a state dict in memory, a
Hugging Face safetensors folder read tensor by tensor, or seeded random weights): each rank reads
one layer's float weights, quantizes the *full* fused weight exactly as ``from_state_dict`` does
(so the shards hold exactly the TP-1 integers and scales), keeps its shard and drops the rest.
No rank holds more than one layer of float weights (the vocab-sharded embedding and head are read
as row slices where the source allows it).

Launch: ``torchrun --nproc-per-node N -m qops.llama.parallel --model ...`` (``python -m qops.llama``
dispatches here when ``WORLD_SIZE > 1``). Backend: NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import qops
from qops import envs
from qops._registry import HALF_DTYPES
from qops.comm import SymmetricWorkspace
from qops.quantization import quantize_per_channel
from qops.w4a16 import n_major, quantize_weight_int4

from .config import LlamaArgs, QuantConfig
from .layers import MLP, Act, Attention, DecoderLayer, FloatLinear, QAct, RMSNorm, Rotary, W4A16Linear, W8A8Linear
from .model import QuantizedLlamaForCausalLM
from .quantize import check_supported


# ---- the process group ---------------------------------------------------------------------------
class TPGroup:
    """This rank's place in the tensor-parallel group, and the two collectives the model uses.

    ``all_reduce`` (sum, in place) and ``all_gather`` (along a dimension) are no-ops at world size
    1. ``collectives=False`` replaces them by local stand-ins of the same shapes (the benchmark's
    "without communication" run: ``all_gather`` repeats the local tensor); the results are wrong
    then, the timing is the model without its collectives.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None, *, collectives: bool = True) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TPGroup: rank {rank} outside world size {world_size}")
        self.rank, self.world_size, self.group, self.collectives = rank, world_size, group, collectives
        # the fused all-reduce + norm kernel's buffers (build_tp_model, CUDA with peer access)
        self.workspace: SymmetricWorkspace | None = None

    @classmethod
    def from_dist(cls, group=None) -> TPGroup:
        """The group of an initialized ``torch.distributed`` (default: the world)."""
        if not dist.is_initialized():
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.world_size > 1 and self.collectives:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all) along ``dim``, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        if not self.collectives:
            return torch.cat([x] * self.world_size, dim=dim)
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))  # ranks concatenated along dim 0
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, world_size={self.world_size})"


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor: deprecated there, the name of 2.11)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_tp(backend: str | None = None, device=None) -> tuple[TPGroup, torch.device]:
    """Initialize ``torch.distributed`` from the torchrun environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) unless it already is, and pick this rank's
    device: ``cuda:LOCAL_RANK`` (backend NCCL) when CUDA is there and ``device`` is not ``"cpu"``,
    else the CPU (gloo). Without ``WORLD_SIZE`` (a plain ``python``): world size 1, no init."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = torch.device(device) if device is not None else None
    cuda = torch.cuda.is_available() and (want is None or want.type == "cuda")
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), device_id=dev if cuda else None)
    return TPGroup.from_dist(), dev


# ---- what a rank holds ---------------------------------------------------------------------------
def _split(n: int, world: int, rank: int) -> slice:
    per = n // world
    return slice(rank * per, (rank + 1) * per)


def check_tp(args: LlamaArgs, world: int, qcfg: QuantConfig | None = None) -> None:
    """Raise ``ValueError`` (naming the size) when ``args`` cannot be split over ``world`` ranks:
    heads and the intermediate size must divide by the world size; KV heads must divide by it, or
    (replicated) divide it; with ``qcfg``, every rank's GEMM shapes must suit its kernels."""
    if world < 1:
        raise ValueError(f"tensor parallel: world size must be >= 1, got {world}")
    why = []
    if args.num_heads % world:
        why.append(f"num_heads = {args.num_heads} is not a multiple of {world}")
    hkv = args.num_kv_heads
    if hkv >= world and hkv % world:
        why.append(f"num_kv_heads = {hkv} is not a multiple of {world}")
    if hkv < world and world % hkv:
        why.append(f"num_kv_heads = {hkv} (fewer than the ranks, so replicated) does not divide {world}")
    if args.intermediate_size % world:
        why.append(f"intermediate_size = {args.intermediate_size} is not a multiple of {world}")
    if why:
        raise ValueError(f"tensor parallel size {world}: cannot shard this model: {'; '.join(why)}")
    if qcfg is not None:
        try:
            check_supported(local_args(args, world), qcfg)
        except ValueError as e:
            raise ValueError(f"tensor parallel size {world} (per-rank shapes): {e}") from None


def local_args(args: LlamaArgs, world: int) -> LlamaArgs:
    """The shape one rank's modules see: its q heads, KV heads (at least 1: replicated) and
    intermediate channels; the hidden size and the vocabulary stay whole."""
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // world,
        num_kv_heads=max(1, args.num_kv_heads // world),
        intermediate_size=args.intermediate_size // world,
    )


def kv_heads_of(args: LlamaArgs, world: int, rank: int) -> slice:
    """The KV heads rank ``rank`` holds: its own share, or (fewer KV heads than ranks) the one
    KV head its q heads attend to, replicated on ``world / num_kv_heads`` ranks."""
    hkv = args.num_kv_heads
    if hkv >= world:
        return _split(hkv, world, rank)
    h = rank // (world // hkv)
    return slice(h, h + 1)


def qkv_rows(args: LlamaArgs, world: int, rank: int) -> torch.Tensor:
    """Row indices (int64) of the fused ``[q; k; v]`` weight that rank ``rank`` holds, in the
    local fused order ``[its q heads; its k heads; its v heads]``."""
    check_tp(args, world)
    d, hq, hkv = args.head_dim, args.num_heads, args.num_kv_heads
    q = _split(hq, world, rank)
    kv = kv_heads_of(args, world, rank)
    rows = [
        torch.arange(q.start * d, q.stop * d),
        hq * d + torch.arange(kv.start * d, kv.stop * d),
        (hq + hkv) * d + torch.arange(kv.start * d, kv.stop * d),
    ]
    return torch.cat(rows)


def gate_up_rows(intermediate_size: int, world: int, rank: int) -> torch.Tensor:
    """Row indices of the fused ``[gate; up]`` weight that rank ``rank`` holds: its gate rows,
    then its up rows (so ``chunk(2)`` of the local output still gives gate and up)."""
    if intermediate_size % world:
        raise ValueError(f"tensor parallel size {world}: intermediate_size {intermediate_size} does not divide")
    s = _split(intermediate_size, world, rank)
    return torch.cat([torch.arange(s.start, s.stop), intermediate_size + torch.arange(s.start, s.stop)])


def vocab_shard(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """``(start, rows)``: rank ``rank``'s rows of the vocabulary padded to a multiple of ``world``
    (rows past ``vocab_size`` are zero padding)."""
    per = -(-vocab_size // world)
    return rank * per, per


# ---- sharding quantized tensors -------------------------------------------------------------------
# A quantized linear as plain tensors: {"weight", "weight_scale"?, "weight_zero"?, "bias"?}.
# W8A8: weight int8 [N, K], weight_scale f32 [N]. W4A16: weight uint8 [N, K/2] (the reference
# layout, before any prepack), weight_scale (and weight_zero) [N, K/G]. Float: weight [N, K].
QTensors = dict


def quantize_tensors(weight: torch.Tensor, qcfg: QuantConfig, dtype: torch.dtype) -> QTensors:
    """Quantize a float ``weight [N, K]`` as ``make_linear`` does (the same calls: the same
    integers and scales), in plain tensors (int4 in the reference layout, not prepacked)."""
    if qcfg.w8a8:
        q, s = quantize_per_channel(weight.float())
        return {"weight": q, "weight_scale": s}
    if qcfg.w4a16:
        packed, scales, zero = quantize_weight_int4(weight, qcfg.group_size, qcfg.weight_zeros, dtype=dtype)
        out = {"weight": packed, "weight_scale": scales}
        if zero is not None:
            out["weight_zero"] = zero
        return out
    return {"weight": weight.to(dtype)}


def shard_column(t: QTensors, rows: torch.Tensor) -> QTensors:
    """Column-parallel shard: the output rows ``rows`` of every tensor (weight, per-channel or
    group scales, zeros, bias all have N first)."""
    rows = rows.to(t["weight"].device)
    return {k: v.index_select(0, rows.to(v.device)).contiguous() for k, v in t.items()}


def shard_row(t: QTensors, world: int, rank: int, group_size: int | None = None, name: str = "a linear") -> QTensors:
    """Row-parallel shard: rank ``rank``'s slice of the input dimension K. int8 per-channel
    scales stay whole; int4 weights (uint8, two values a byte) and their group scales/zeros are
    split along K, which must then be a multiple of ``group_size`` per rank. A bias goes to rank 0
    only: the all-reduce adds it exactly once."""
    w = t["weight"]
    packed = w.dtype == torch.uint8
    k = w.shape[1] * (2 if packed else 1)
    if k % world:
        raise ValueError(f"tensor parallel size {world}: {name}: K = {k} (input features) does not divide")
    kl = k // world
    out: QTensors = {}
    if packed:
        if group_size is None or kl % group_size:
            raise ValueError(
                f"tensor parallel size {world}: {name}: the per-rank K = {kl} is not a multiple of the int4 "
                f"group size {group_size} (row-parallel int4 shards must hold whole groups)"
            )
        out["weight"] = w[:, rank * kl // 2 : (rank + 1) * kl // 2].contiguous()
        g = kl // group_size
        for key in ("weight_scale", "weight_zero"):
            if key in t:
                out[key] = t[key][:, rank * g : (rank + 1) * g].contiguous()
    else:
        out["weight"] = w[:, rank * kl : (rank + 1) * kl].contiguous()
        if "weight_scale" in t:
            out["weight_scale"] = t["weight_scale"]  # per output channel: whole
    if "bias" in t and rank == 0:
        out["bias"] = t["bias"]
    return out


def linear_from_tensors(
    t: QTensors,
    qcfg: QuantConfig,
    dtype: torch.dtype,
    device,
    input_scale: float | None = None,
    name: str = "a linear",
) -> nn.Module:
    """The qops linear module holding ``t`` on ``device`` (int4 weights prepacked there)."""
    dev = torch.device(device)
    w = t["weight"].to(dev)
    bias = t.get("bias")
    n = w.shape[0]
    if qcfg.w8a8:
        static = qcfg.activations == "static" and input_scale is not None
        m8 = W8A8Linear(w.shape[1], n, out_dtype=dtype, static=static, bias=bias is not None, device=dev)
        m8.weight.copy_(w)
        m8.weight_scale.copy_(t["weight_scale"])
        if static:
            assert m8.input_scale is not None
            m8.input_scale.fill_(float(cast(float, input_scale)))
        if bias is not None:
            assert m8.bias is not None
            m8.bias.copy_(bias.to(dtype))
        return m8
    if qcfg.w4a16:
        k = 2 * w.shape[1]
        m4 = W4A16Linear(k, n, group_size=qcfg.group_size, zeros="weight_zero" in t, out_dtype=dtype,
                         bias=bias is not None, device="meta", name=name)  # fmt: skip
        m4.weight = qops.w4a16_prepack(w)
        m4.packed_for = "cpu" if dev.type in ("cpu", "meta") else dev.type
        m4.weight_scale = n_major(t["weight_scale"].to(dev, dtype))
        if "weight_zero" in t:
            m4.weight_zero = n_major(t["weight_zero"].to(dev, dtype))
        if bias is not None:
            m4.bias = bias.to(dev, dtype)
        return m4
    lin = FloatLinear(w.shape[1], n, bias=bias is not None, device=dev, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


# ---- the seam for a fused kernel ------------------------------------------------------------------
def all_reduce_add_rms_norm(
    tp: TPGroup, partial: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, scale: torch.Tensor | None
) -> Act:
    """Sum a row-parallel linear's ``partial`` outputs over the ranks, add them to ``residual``
    (in place) and apply ``norm`` (RMSNorm, + int8 quant with ``scale`` or dynamic per-token scales
    for W8A8: ``qops.fused_add_rms_norm_quant``). Every all-reduce between decoder layers goes
    through here (``TPDecoderLayer`` looks it up at call time), so a fused all-reduce + residual +
    RMSNorm + quant kernel can replace this one function."""
    ws = tp.workspace
    if (
        ws is not None
        and tp.collectives
        and partial.dim() == 2
        and partial.dtype in HALF_DTYPES
        and ws.bytes_for(partial.shape[0], partial.shape[1]) <= ws.buffer_bytes
    ):
        # one kernel: every rank reads its peers' partials over P2P (qops.comm)
        if norm.quantize:
            return QAct(*qops.allreduce_add_rms_norm_quant(partial, residual, norm.weight, norm.eps, scale, ws))
        return qops.allreduce_add_rms_norm(partial, residual, norm.weight, norm.eps, ws)
    tp.all_reduce(partial)
    # the norm reads the all-reduce's output: launched without PDL (RMSNorm.forward says why)
    return norm(partial, residual, scale, enable_pdl=False if tp.world_size > 1 else None)


# ---- modules ------------------------------------------------------------------------------------
class TPDecoderLayer(DecoderLayer):
    """``DecoderLayer`` on one rank: attention over its heads, MLP over its intermediate channels;
    ``o`` and ``down`` return partial sums, reduced by ``all_reduce_add_rms_norm`` in front of the
    next norm. ``forward(hidden, residual, ctx)`` takes the previous layer's *unreduced* MLP output
    (or the embeddings, ``residual=None``) and returns its own unreduced MLP output."""

    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm, tp: TPGroup) -> None:
        super().__init__(attn, mlp, input_norm, post_norm)
        self.tp = tp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx):
        hook = sys.modules[__name__].all_reduce_add_rms_norm  # replaceable (a fused kernel)
        qkv_scale = self.self_attn.qkv_proj.input_scale
        if residual is None:  # layer 0: the embeddings, already whole
            residual = hidden.clone()
            x = self.input_layernorm(hidden, None, qkv_scale)
        else:
            x = hook(self.tp, hidden, residual, self.input_layernorm, qkv_scale)
        h = self.self_attn(x, ctx)
        x = hook(self.tp, h, residual, self.post_attention_layernorm, self.mlp.gate_up_proj.input_scale)
        return self.mlp(x), residual


class TPLlamaForCausalLM(QuantizedLlamaForCausalLM):
    """One rank of a tensor-parallel ``QuantizedLlamaForCausalLM``. Built by ``build_tp_model`` /
    ``load_tp``; used like the TP-1 model (``step``, ``generate``, ``GraphDecoder``, ``new_cache``),
    every rank calling the same methods with the same arguments in the same order.

    ``args`` is the rank's shape (``local_args``: its heads, KV heads and intermediate channels;
    the KV cache it makes holds its KV heads), ``global_args`` the model's. ``embed_tokens`` and the
    LM head hold rows ``[vocab_start, vocab_start + rows)`` of the padded vocabulary; ``step``
    returns the whole vocabulary's logits on every rank (identical bits on all ranks)."""

    def __init__(
        self,
        args: LlamaArgs,
        qcfg: QuantConfig,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor | None,
        rotary: Rotary,
        dtype: torch.dtype,
        *,
        tp: TPGroup,
        global_args: LlamaArgs,
    ) -> None:
        la = local_args(global_args, tp.world_size)
        super().__init__(la, qcfg, embed, layers, final_norm, lm_head, rotary, dtype)
        self.tp, self.global_args = tp, global_args
        self.vocab_start, self.vocab_rows = vocab_shard(global_args.vocab_size, tp.world_size, tp.rank)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this rank's rows (zeros for ids outside them), summed."""
        if self.tp.world_size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        x = F.embedding(local.clamp(0, self.vocab_rows - 1), self.embed_tokens.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, enable_pdl: bool | None = None) -> torch.Tensor:
        """Final add + RMSNorm, this rank's LM-head rows, all-gathered: float32 ``[T, V]``. The
        norm follows the last all-reduce, so it launches without PDL (``RMSNorm.forward``)."""
        if self.tp.world_size > 1:
            enable_pdl = False
        local = super().logits(hidden, residual, enable_pdl)
        return self.tp.all_gather(local, dim=-1)[:, : self.global_args.vocab_size]

    def forward(self, input_ids: torch.Tensor, ctx, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        assert residual is not None
        if logits_rows is not None:
            hidden, residual = hidden[logits_rows], residual[logits_rows]
        self.tp.all_reduce(hidden)  # the last down projection's partial sums
        return self.logits(hidden, residual)

    def save(self, path) -> None:
        raise NotImplementedError(
            "TPLlamaForCausalLM.save: a rank holds a shard; save the TP-1 model (QuantizedLlamaForCausalLM)"
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp rank {self.tp.rank} of {self.tp.world_size}"


# ---- weight sources -----------------------------------------------------------------------------
class WeightSource:
    """Float weights by Hugging Face name, read one tensor (or a row slice) at a time."""

    def keys(self) -> set[str]:
        raise NotImplementedError

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in self.keys()


class DictSource(WeightSource):
    """A state dict already in memory (tests; a model loaded whole)."""

    def __init__(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.sd = sd

    def keys(self) -> set[str]:
        return set(self.sd.keys())

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        t = self.sd[name]
        return t if rows is None else t[rows]


class SafetensorsSource(WeightSource):
    """The ``*.safetensors`` files of a Hugging Face checkpoint folder, opened lazily
    (``safe_open``): each ``get`` reads one tensor, or only its rows ``rows`` (``get_slice``)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
        self._open = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
        self._where = {k: f for f, h in self._open.items() for k in h.keys()}

    def keys(self) -> set[str]:
        return set(self._where)

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        h = self._open[self._where[name]]
        if rows is None:
            return h.get_tensor(name)
        return h.get_slice(name)[rows]


class RandomSource(WeightSource):
    """Seeded random float weights of a model shape, made on request (``random_llama_state_dict``'s
    scaling: ``N(0, 1/K)`` linears, norms near 1): the same tensor on every rank and every run,
    without the whole model ever in memory. For benchmarks and large-shape tests."""

    def __init__(self, args: LlamaArgs, seed: int = 0, device=None) -> None:
        self.args, self.seed = args, seed
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._shapes = self._make_shapes()

    def _make_shapes(self) -> dict[str, tuple[int, ...]]:
        a = self.args
        h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
        s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
        if not a.tie_word_embeddings:
            s["lm_head.weight"] = (a.vocab_size, h)
        for li in range(a.num_layers):
            p = f"model.layers.{li}."
            s[p + "self_attn.q_proj.weight"] = (a.num_heads * d, h)
            s[p + "self_attn.k_proj.weight"] = (a.num_kv_heads * d, h)
            s[p + "self_attn.v_proj.weight"] = (a.num_kv_heads * d, h)
            s[p + "self_attn.o_proj.weight"] = (h, a.num_heads * d)
            s[p + "mlp.gate_proj.weight"] = (i, h)
            s[p + "mlp.up_proj.weight"] = (i, h)
            s[p + "mlp.down_proj.weight"] = (h, i)
            s[p + "input_layernorm.weight"] = (h,)
            s[p + "post_attention_layernorm.weight"] = (h,)
            if a.qkv_bias:
                for n, rows in (("q", a.num_heads * d), ("k", a.num_kv_heads * d), ("v", a.num_kv_heads * d)):
                    s[p + f"self_attn.{n}_proj.bias"] = (rows,)
            if a.qk_norm:
                s[p + "self_attn.q_norm.weight"] = (d,)
                s[p + "self_attn.k_norm.weight"] = (d,)
        return s

    def keys(self) -> set[str]:
        return set(self._shapes)

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        shape = self._shapes[name]
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g, device=self.device)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.1 * x
        elif len(shape) == 2 and "embed" not in name:
            x = x / shape[1] ** 0.5
        return x if rows is None else x[rows]


def _vocab_rows(src: WeightSource, name: str, vocab: int, start: int, rows: int) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of a ``[V, H]`` tensor, zero past ``V`` (the padding)."""
    stop = min(start + rows, vocab)
    part = src.get(name, slice(start, stop)) if stop > start else None
    if part is not None and stop - start == rows:
        return part
    h = src.get(name, slice(0, 1)).shape[1]
    out = torch.zeros(rows, h, dtype=torch.float32)
    if part is not None:
        out[: stop - start] = part.float()
    return out


# ---- building --------------------------------------------------------------------------------
def build_tp_model(
    source: WeightSource | Mapping[str, torch.Tensor],
    args: LlamaArgs,
    qcfg: QuantConfig,
    tp: TPGroup | None = None,
    *,
    dtype: torch.dtype = torch.float16,
    device=None,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
    input_scales: dict | None = None,
    kv_scales: tuple[list[float], list[float]] | None = None,
    progress: bool = False,
    fused_tokens: int | None = None,
) -> TPLlamaForCausalLM:
    """This rank's shard of the model, quantized layer by layer from ``source`` (float weights with
    Hugging Face names: a ``WeightSource`` or a state dict).

    Each fused linear is quantized whole, as ``QuantizedLlamaForCausalLM.from_state_dict`` does
    (so the integers and scales are exactly TP 1's), then sharded: ``qkv`` and ``gate_up``
    column-parallel, ``o`` and ``down`` row-parallel. ``input_scales`` (static activation scales,
    ``{"layers.{i}.{qkv,o,gate_up,down}": float}``) and ``kv_scales`` (static KV scales per layer)
    are replicated. Refuses (``ValueError``) a model whose heads, KV heads or intermediate size do
    not split over the ranks, or whose per-rank GEMM shapes the kernels cannot run.

    On CUDA at world size > 1 the inter-layer all-reduces of up to ``fused_tokens`` tokens (default
    256; 0, or ``QOPS_TP_FUSED=0``, turns it off) run as one fused all-reduce + residual + RMSNorm
    (+ quant) kernel over symmetric memory (``qops.comm``), where the ranks can map each other's
    memory; larger steps (prefill) use ``torch.distributed.all_reduce`` + the norm."""
    tp = tp or TPGroup()
    if fused_tokens is None:
        fused_tokens = 256 if envs.TP_FUSED else 0
    src = source if isinstance(source, WeightSource) else DictSource(source)
    world, rank = tp.world_size, tp.rank
    check_tp(args, world, qcfg)
    if qcfg.weights and dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qops.llama: {qcfg.weight_label()} models run in float16 or bfloat16, got dtype={dtype}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    input_scales = input_scales or {}
    if inv_freq is None:
        d = args.head_dim
        inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rotary = Rotary(inv_freq.to(dev), min(args.max_position_embeddings, 4096), attention_scaling)
    la = local_args(args, world)
    rows_qkv = qkv_rows(args, world, rank)
    rows_gu = gate_up_rows(args.intermediate_size, world, rank)
    quant_acts = qcfg.w8a8
    g = qcfg.group_size if qcfg.w4a16 else None

    layers: list[DecoderLayer] = []
    it: Any = range(args.num_layers)
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(it, desc=f"TP rank {rank}: quantizing ({qcfg.label()})", leave=False)
        except ImportError:
            pass
    for i in it:
        p = f"model.layers.{i}."

        def w(name: str, p: str = p) -> torch.Tensor:
            return src.get(p + name + ".weight").to(device=dev, dtype=torch.float32)

        def lin(t: QTensors, key: str, name: str, i: int = i, p: str = p) -> nn.Module:
            return linear_from_tensors(t, qcfg, dtype, dev, input_scales.get(f"layers.{i}.{key}"), p + name)

        qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        qkv_t = quantize_tensors(torch.cat([w(n) for n in qkv_names]), qcfg, dtype)
        if args.qkv_bias:  # Qwen2: rows with the weight
            qkv_t["bias"] = torch.cat([src.get(p + n + ".bias").to(dev, torch.float32) for n in qkv_names])
        qkv = lin(shard_column(qkv_t, rows_qkv), "qkv", "self_attn.qkv_proj (q/k/v fused, column-parallel)")
        del qkv_t
        o_t = shard_row(quantize_tensors(w("self_attn.o_proj"), qcfg, dtype), world, rank, g, p + "self_attn.o_proj")
        o = lin(o_t, "o", "self_attn.o_proj (row-parallel)")
        gu_t = quantize_tensors(torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]), qcfg, dtype)
        gate_up = lin(shard_column(gu_t, rows_gu), "gate_up", "mlp.gate_up_proj (gate/up fused, column-parallel)")
        del gu_t
        down_t = shard_row(quantize_tensors(w("mlp.down_proj"), qcfg, dtype), world, rank, g, p + "mlp.down_proj")
        down = lin(down_t, "down", "mlp.down_proj (row-parallel)")
        n1 = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize=quant_acts, dtype=dtype, device=dev)
        n2 = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize=quant_acts, dtype=dtype, device=dev)
        n1.weight.copy_(w("input_layernorm"))
        n2.weight.copy_(w("post_attention_layernorm"))
        attn = Attention(i, la, qkv, o, rotary)
        if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3: per-head weights, replicated
            attn.q_norm.copy_(w("self_attn.q_norm"))
            attn.k_norm.copy_(w("self_attn.k_norm"))
        layers.append(TPDecoderLayer(attn, MLP(gate_up, down), n1, n2, tp))

    start, nrows = vocab_shard(args.vocab_size, world, rank)
    embed = _vocab_rows(src, "model.embed_tokens.weight", args.vocab_size, start, nrows).to(dev, dtype)
    head = None
    if not args.tie_word_embeddings:
        name = "lm_head.weight" if "lm_head.weight" in src else "model.embed_tokens.weight"
        head = _vocab_rows(src, name, args.vocab_size, start, nrows).to(dev, dtype)
    final_norm = src.get("model.norm.weight").to(dev, dtype)
    if dev.type == "cuda" and world > 1 and tp.collectives and tp.workspace is None and fused_tokens > 0:
        # every rank gets here together (a collective allocation); None where peers cannot map it
        tp.workspace = SymmetricWorkspace.allocate(tp.group, fused_tokens, args.hidden_size, dev)
    model = TPLlamaForCausalLM(la, qcfg, embed, layers, final_norm, head, rotary, dtype, tp=tp, global_args=args)
    model.kv_scales = kv_scales
    return model.eval()


def hf_config_args(folder: str | os.PathLike) -> LlamaArgs:
    """``LlamaArgs`` from a Hugging Face ``config.json`` (no transformers needed). RoPE scaling
    other than the default is refused: pass ``inv_freq`` to ``build_tp_model`` instead."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    rope = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise NotImplementedError(
            f"{folder}: rope_scaling {kind!r}: load_tp computes the default RoPE table only; build the "
            f"inv_freq table (e.g. from the Hugging Face model's rotary_emb) and call build_tp_model"
        )
    return LlamaArgs.from_hf(argparse.Namespace(**cfg))


def load_tp(
    model: str | os.PathLike | Mapping[str, torch.Tensor] | WeightSource,
    qcfg: QuantConfig | str | None = None,
    *,
    args: LlamaArgs | None = None,
    tp: TPGroup | None = None,
    dtype: torch.dtype = torch.float16,
    device=None,
    progress: bool = False,
    **kw,
) -> TPLlamaForCausalLM:
    """This rank's shard of a model (``TPGroup.from_dist()`` unless ``tp``):

    - ``model`` a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``): read
      tensor by tensor (``SafetensorsSource``), the embedding and LM head as row slices;
    - ``"random:<name>"`` (a shape of ``bench/shapes.py``'s table given as ``args``, or
      ``args`` itself): seeded random weights (``RandomSource``), made on ``device``;
    - a state dict or a ``WeightSource``, with ``args``.

    ``qcfg``: a ``QuantConfig`` or a label (``"W8A8+KV8"``, ``"W4A16+KV8"``; default W8A8+KV8
    with dynamic scales). Calibrated variants need ``input_scales`` / ``kv_scales`` (see
    ``build_tp_model``): calibration itself is not run here."""
    if isinstance(qcfg, str):
        qcfg = QuantConfig.from_label(qcfg)
    qcfg = qcfg or QuantConfig()
    tp = tp or TPGroup.from_dist()
    src: WeightSource | Mapping[str, torch.Tensor]
    if isinstance(model, (str, os.PathLike)) and str(model).startswith("random:"):
        if args is None:
            raise ValueError("load_tp: 'random:...' needs args (the model's LlamaArgs)")
        src = RandomSource(args, device=device)
    elif isinstance(model, (str, os.PathLike)):
        args = args or hf_config_args(model)
        src = SafetensorsSource(model)
    else:
        if args is None:
            raise ValueError("load_tp: a state dict or WeightSource needs args (the model's LlamaArgs)")
        src = model
    return build_tp_model(src, args, qcfg, tp, dtype=dtype, device=device, progress=progress, **kw)


# ---- command line -------------------------------------------------------------------------------
def _shape_args(name: str) -> LlamaArgs:
    """A model shape of bench/shapes.py (importable from the repository root) as ``LlamaArgs``."""
    try:
        from bench.shapes import MODELS
    except ImportError as e:
        raise SystemExit(f"random:{name}: run from the repository root (bench/shapes.py holds the shapes): {e}") from e
    if name not in MODELS:
        raise SystemExit(f"random:{name}: unknown shape; one of {', '.join(MODELS)}")
    return LlamaArgs.from_hf(argparse.Namespace(**MODELS[name].hf_config()))


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m qops.llama.parallel",
        description="Greedy generation with the quantized Llama sharded over the ranks (tensor parallel).",
    )
    p.add_argument(
        "--model",
        default="random:tiny",
        help="smollm2 (the bundled SmolLM2, loaded whole on every rank), a Hugging Face folder "
        "(config.json + safetensors, read tensor by tensor) or random:<bench/shapes.py name>",
    )
    p.add_argument("--variant", default="W8A8+KV8", help="QuantConfig label (W8A8+KV8, W4A16+KV8, W8A8, fp16, ...)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default=None, help="cuda (default when available: cuda:LOCAL_RANK) or cpu")
    p.add_argument("--prompt-len", type=int, default=16, help="random prompt tokens (seeded; same on all ranks)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cuda-graph", action="store_true", help="decode through GraphDecoder (CUDA)")
    p.add_argument(
        "--compare",
        action="store_true",
        help="rank 0 also builds the TP-1 model and compares greedy tokens and first-step logits",
    )
    return p.parse_args(argv)


def _greedy(model, prompts: list[list[int]], steps: int, cuda_graph: bool) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens ``[B][steps]`` and the prefill's last-token logits (float32 ``[B, V]``)."""
    from .graphs import GraphDecoder

    b = len(prompts)
    cache = model.cache_for([len(p) + steps + 1 for p in prompts])
    ids = list(range(b))
    first = model.step(prompts, ids, cache).float()
    tok = first.argmax(-1).tolist()
    out = [[t] for t in tok]
    runner = GraphDecoder(model, cache, ids, max(len(p) for p in prompts) + steps + 1) if cuda_graph else None
    for _ in range(steps - 1):
        logits = runner.step(tok) if runner is not None else model.step([[t] for t in tok], ids, cache)
        tok = logits.argmax(-1).tolist()
        for row, t in zip(out, tok):
            row.append(t)
    return out, first.cpu()


def main(argv=None) -> int:
    a = _parse(argv)
    tp, dev = init_tp(device=a.device)
    dtype = getattr(torch, a.dtype)
    qcfg = QuantConfig.from_label(a.variant)
    say = print if tp.rank == 0 else (lambda *x, **k: None)
    kw: dict = {}
    t0 = time.perf_counter()
    src: WeightSource
    if a.model == "smollm2":
        from . import smollm2
        from .quantize import hf_parts

        hf = smollm2.load_model(dtype=torch.float32, device="cpu", progress=False)
        sd, args, inv_freq, scaling = hf_parts(hf)
        src, kw = DictSource(sd), dict(inv_freq=inv_freq, attention_scaling=scaling)
    elif a.model.startswith("random:"):
        args = _shape_args(a.model.split(":", 1)[1])
        src = RandomSource(args, device=dev)
    else:
        args = hf_config_args(a.model)
        src = SafetensorsSource(a.model)
    model = build_tp_model(src, args, qcfg, tp, dtype=dtype, device=dev, **kw)
    say(f"TP {tp.world_size} x {dev.type}: {a.model} {qcfg.label()} built in {time.perf_counter() - t0:.1f} s "
        f"(rank 0 holds {model.weight_bytes() / 2**20:.0f} MiB)", flush=True)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab_size, (a.batch, a.prompt_len), generator=gen).tolist()
    t0 = time.perf_counter()
    toks, first = _greedy(model, prompts, a.max_new_tokens, a.cuda_graph)
    say(f"  {a.max_new_tokens} greedy steps x batch {a.batch} in {time.perf_counter() - t0:.2f} s")
    for i, row in enumerate(toks):
        say(f"  seq {i}: {row[:16]}{' ...' if len(row) > 16 else ''}")
    rc = 0
    if a.compare:
        if tp.rank == 0:
            ref_model = build_tp_model(src, args, qcfg, TPGroup(), dtype=dtype, device=dev, **kw)
            ref_toks, ref_first = _greedy(ref_model, prompts, a.max_new_tokens, a.cuda_graph)
            same = sum(x == y for r, q in zip(ref_toks, toks) for x, y in zip(r, q))
            total = sum(len(r) for r in ref_toks)
            rel = float((first - ref_first).norm() / ref_first.norm())
            print(f"  vs TP 1: greedy tokens identical {same}/{total}; prefill logits relative L2 error {rel:.2e}")
            rc = 0 if same == total else 3
        if tp.world_size > 1:
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return rc


__all__ = [
    "DictSource",
    "RandomSource",
    "SafetensorsSource",
    "TPDecoderLayer",
    "TPGroup",
    "TPLlamaForCausalLM",
    "WeightSource",
    "all_reduce_add_rms_norm",
    "build_tp_model",
    "check_tp",
    "gate_up_rows",
    "init_tp",
    "linear_from_tensors",
    "load_tp",
    "local_args",
    "qkv_rows",
    "quantize_tensors",
    "shard_column",
    "shard_row",
    "vocab_shard",
]

if __name__ == "__main__":
    sys.exit(main())
