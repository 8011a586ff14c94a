"""The modules of the quantized Llama: linears, norms, attention, MLP, decoder layer.

Activations flow between modules either as a float tensor ``[T, H]`` (model dtype) or, when the
next consumer is a W8A8 linear, as an already quantized pair ``QAct(q int8 [T, H], s f32 [T] or
[1])`` produced by a fused op (RMSNorm+quant, SiLU-and-mul+quant). W4A16 linears
(``W4A16Linear``, ``qops.w4a16_gemm``) take the float tensor: with them the norms and the MLP
activation are the same fused kernels without the quantizer (``qops.rms_norm``,
``qops.fused_add_rms_norm``, ``qops.silu_and_mul``), in the model dtype, as in the float variant.
Tokens are flattened: ``T`` is the number of tokens in the step over all sequences (vLLM style),
``H`` a hidden size.

Which op replaces what (docs/llama.md):

================================  =============================================================
Hugging Face module               qops module / op
================================  =============================================================
input_layernorm                   ``qops.rms_norm_quant`` (layer 0) / ``qops.fused_add_rms_norm_quant``
q_proj, k_proj, v_proj            one fused ``W8A8Linear`` (``qops.w8a8_gemm``; Qwen2: + bias)
rotary + attention                ``qops.rotary_embedding`` in place on q and k (Qwen3: after a
                                  q/k RMSNorm per head, PyTorch);
                                  ``qops.reshape_and_cache_int8``; decode:
                                  ``qops.paged_decode_attention_int8``; prefill: SDPA
                                  (int4 cache: ``qops.reshape_and_cache_int4`` or, SKVQ,
                                  ``qops.skvq_cache_write``; decode ``qops.int4_gqa_decode``)
o_proj                            ``qops.quant_per_token`` (or ``quant_per_tensor``) + ``W8A8Linear``
post_attention_layernorm          ``qops.fused_add_rms_norm_quant``
gate_proj, up_proj                one fused ``W8A8Linear``
act_fn(gate) * up                 ``qops.silu_and_mul_quant``
down_proj                         ``W8A8Linear``
================================  =============================================================

W4A16 (``QuantConfig(weights="int4")``): the four linears are ``W4A16Linear`` (same fusion of
q/k/v and of gate/up; Qwen2's bias added after the GEMM), the norms ``qops.rms_norm`` /
``qops.fused_add_rms_norm`` and the MLP activation ``qops.silu_and_mul``, in the model dtype (float32
models: the same math in PyTorch).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Union, cast

import torch
import torch.nn.functional as F
from torch import nn

import qops
from qops._registry import HALF_DTYPES
from qops.quantization import quantize_per_channel
from qops.rope import rotate
from qops.w4a16 import N_MULTIPLE, dequantize_weight_int4, n_major, quantize_weight_int4

from .cache import Int4PagedKVCache, Int8PagedKVCache
from .config import LlamaArgs, QuantConfig

if TYPE_CHECKING:
    from .cache import HalfPagedKVCache


class QAct(NamedTuple):
    """An int8 activation: ``q`` int8 ``[T, H]`` and its scales, f32 ``[T]`` (per token) or ``[1]``."""

    q: torch.Tensor
    s: torch.Tensor


Act = Union[torch.Tensor, QAct]  # noqa: UP007 (a runtime alias: X | Y of classes needs 3.10 evaluation)


# ---- linears ------------------------------------------------------------------------------------
class W8A8Linear(nn.Module):
    """``y = x @ W.T`` with int8 ``W`` (per-output-channel scales) and int8 ``x``.

    ``forward(x)`` takes a ``QAct`` (already quantized by a fused op) or a float ``[T, K]``
    tensor, which it quantizes per token (``qops.quant_per_token``) or, with a static
    ``input_scale``, per tensor (``qops.quant_per_tensor``). Then
    ``qops.w8a8_gemm(q, weight, s, weight_scale, out_dtype)``, i.e.
    ``(q.float() @ weight.float().T) * s[:, None] * weight_scale[None, :]``.

    Buffers: ``weight`` int8 ``[N, K]``, ``weight_scale`` f32 ``[N]``, ``input_scale`` f32 ``[1]``
    (static activations only), ``bias`` ``[N]`` in ``out_dtype`` (optional).
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        out_dtype=torch.float16,
        static: bool = False,
        bias: bool = False,
        device=None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device) if static else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device) if bias else None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        out_dtype=torch.float16,
        input_scale: float | None = None,
    ) -> W8A8Linear:
        """Quantize a float ``weight [N, K]`` per output channel (``qops.quantization``)."""
        n, k = weight.shape
        m = cls(k, n, out_dtype=out_dtype, static=input_scale is not None, bias=bias is not None, device=weight.device)
        q, s = quantize_per_channel(weight.float())
        m.weight.copy_(q)
        m.weight_scale.copy_(s)
        if input_scale is not None:
            assert m.input_scale is not None  # registered: static=True above
            m.input_scale.fill_(float(input_scale))
        if bias is not None:
            assert m.bias is not None  # registered: bias=True above
            m.bias.copy_(bias.to(out_dtype))
        return m

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]

    def quantize_input(self, x: torch.Tensor) -> QAct:
        """Quantize a float ``x [T, K]`` as this layer expects it."""
        if self.input_scale is not None:
            return QAct(qops.quant_per_tensor(x, self.input_scale), self.input_scale)
        return QAct(*qops.quant_per_token(x))

    def forward(self, x: Act) -> torch.Tensor:
        if not isinstance(x, QAct):
            x = self.quantize_input(x)
        # the weights are never written during a step: the decode GEMV may read them early
        return qops.w8a8_gemm(
            x.q, self.weight, x.s, self.weight_scale, self.out_dtype, self.bias, overlap_prologue=True
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, act="
            f"{'static' if self.input_scale is not None else 'dynamic per-token'}"
        )


def check_w4a16_shape(in_features: int, out_features: int, group_size: int, name: str = "a linear") -> None:
    """Raise ``ValueError`` when ``qops.w4a16_gemm`` cannot run a linear ``[N, K]``: ``N`` (out
    features) must be a multiple of 16, ``K`` (in features) a multiple of ``group_size``."""
    why = []
    if out_features % N_MULTIPLE:
        why.append(f"N = {out_features} (output features) is not a multiple of {N_MULTIPLE}")
    if in_features <= 0 or in_features % group_size:
        why.append(f"K = {in_features} (input features) is not a multiple of group_size {group_size}")
    if why:
        raise ValueError(
            f"qops.llama: W4A16 cannot quantize {name} [N={out_features}, K={in_features}]: {' and '.join(why)} "
            f"(qops.w4a16_gemm needs N % {N_MULTIPLE} == 0 and K % group_size == 0)"
        )


class W4A16Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with int4 ``W`` (group-wise scales along K, optional zeros) and
    float16/bfloat16 ``x`` (not quantized): ``qops.w4a16_gemm``.

    ``W`` is quantized round-to-nearest per (output channel, group of ``group_size`` input
    channels) by ``qops.w4a16.quantize_weight_int4``: scale-only (symmetric, ``q * scale``) or
    with zeros (asymmetric, ``q * scale + zero``), the scales and zeros in the model dtype.

    Buffers: ``weight`` uint8, ``qops.w4a16_prepack`` of the packed ``[N, K/2]`` int4 weight for
    this module's device (``packed_for``: the device type it was prepacked for; ``"cpu"`` is the
    reference layout, ``[N, K/2]`` as ``qops.w4a16.pack_int4`` writes it); ``weight_scale`` and
    ``weight_zero`` (scale+zero mode; else ``None``) ``[N, K/G]`` in ``out_dtype``, N-major
    (``qops.w4a16.n_major``: the layout the CUDA kernels read); ``bias`` ``[N]`` in ``out_dtype``
    (optional, added after the GEMM).

    Moving the module from the CPU to another device prepacks the weight there. A weight
    prepacked for a GPU keeps that layout wherever it is moved (qops has no unprepack): it runs
    only on that kind of device again, and cannot be saved.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero: torch.Tensor | None
    bias: torch.Tensor | None
    input_scale = None  # activations are not quantized (DecoderLayer hands it to the norms)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int = 128,
        zeros: bool = False,
        out_dtype=torch.float16,
        bias: bool = False,
        device=None,
        name: str = "a linear",
    ) -> None:
        super().__init__()
        check_w4a16_shape(in_features, out_features, group_size, name)
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.group_size = group_size
        dev = torch.device(device) if device is not None else torch.device("cpu")
        w = torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=dev)
        self.packed_for = "cpu"  # the reference layout (also the placeholder on "meta", for load)
        if dev.type not in ("cpu", "meta"):
            w, self.packed_for = qops.w4a16_prepack(w), dev.type
        groups = (out_features, in_features // group_size)
        self.register_buffer("weight", w)
        self.register_buffer("weight_scale", n_major(torch.ones(groups, dtype=out_dtype, device=dev)))
        self.register_buffer(
            "weight_zero", n_major(torch.zeros(groups, dtype=out_dtype, device=dev)) if zeros else None
        )
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=dev) if bias else None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        group_size: int = 128,
        zeros: bool = False,
        out_dtype=torch.float16,
        name: str = "a linear",
    ) -> W4A16Linear:
        """Quantize a float ``weight [N, K]`` (RTN, ``quantize_weight_int4``) and prepack it on
        its device."""
        n, k = weight.shape
        m = cls(k, n, group_size=group_size, zeros=zeros, out_dtype=out_dtype, bias=bias is not None,
                device="meta", name=name)  # fmt: skip
        packed, scales, zero = quantize_weight_int4(weight, group_size, zeros, dtype=out_dtype)
        m.weight = qops.w4a16_prepack(packed)
        m.packed_for = "cpu" if weight.device.type in ("cpu", "meta") else weight.device.type
        m.weight_scale = n_major(scales)
        if zero is not None:
            m.weight_zero = n_major(zero)
        if bias is not None:
            m.bias = bias.to(out_dtype)
        return m

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 ``W [N, K]`` the GEMM multiplies by (reference layout only)."""
        if self.packed_for != "cpu":
            raise RuntimeError(f"W4A16Linear: the weight is prepacked for {self.packed_for}, not the reference layout")
        zero = None if self.weight_zero is None else self.weight_zero.contiguous()
        w = dequantize_weight_int4(self.weight, self.weight_scale.contiguous(), zero, self.group_size)
        return w.float()

    def forward(self, x: Act) -> torch.Tensor:
        if isinstance(x, QAct):
            raise TypeError("W4A16Linear takes float16/bfloat16 activations, got an int8 QAct")
        if self.weight.device.type != self.packed_for:
            raise RuntimeError(
                f"W4A16Linear: the int4 weight is prepacked for {self.packed_for} and cannot run on "
                f"{self.weight.device} (qops has no unprepack): move the model back to {self.packed_for}, or "
                f"quantize it on {self.weight.device.type}"
            )
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = qops.w4a16_gemm(x, self.weight, self.weight_scale, self.weight_zero, self.group_size)
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        dev = self.weight.device.type
        if self.packed_for == "cpu" and dev not in ("cpu", "meta"):
            # the reference layout arrived on another device: prepack it for that device
            self.weight, self.packed_for = qops.w4a16_prepack(self.weight), dev
        # else the bytes travel as they are (a GPU model parked on the CPU and moved back runs;
        # forward refuses to run them elsewhere)
        self.weight_scale = n_major(self.weight_scale)
        if self.weight_zero is not None:
            self.weight_zero = n_major(self.weight_zero)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, int4 groups of {self.group_size}, "
            f"{'scale+zero' if self.weight_zero is not None else 'scale-only'}, act=float"
        )


class FloatLinear(nn.Linear):
    """``nn.Linear`` in the model dtype (the unquantized variant); takes float input only."""

    input_scale = None

    def forward(self, x: Act) -> torch.Tensor:
        if isinstance(x, QAct):
            raise TypeError("FloatLinear got an int8 activation")
        return F.linear(x, self.weight, self.bias)


def make_linear(
    weight: torch.Tensor,
    qcfg: QuantConfig,
    dtype: torch.dtype,
    input_scale: float | None = None,
    bias: torch.Tensor | None = None,
    name: str = "a linear",
) -> nn.Module:
    """A ``W8A8Linear`` (``qcfg.w8a8``), a ``W4A16Linear`` (``qcfg.w4a16``) or a
    ``FloatLinear`` from a float ``weight [N, K]`` (and ``bias [N]``: Qwen2's q/k/v; kept in the
    model dtype, added in the W8A8 GEMM's epilogue or after the W4A16 GEMM). ``name`` names the
    linear in errors."""
    if qcfg.w4a16:
        return W4A16Linear.from_float(
            weight, bias, group_size=qcfg.group_size, zeros=qcfg.weight_zeros, out_dtype=dtype, name=name
        )
    if qcfg.w8a8:
        return W8A8Linear.from_float(
            weight, bias, out_dtype=dtype, input_scale=input_scale if qcfg.activations == "static" else None
        )
    lin = FloatLinear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


# ---- RMSNorm (+ residual add) (+ quant) --------------------------------------------------------
def rms_norm_float(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm``: normalize in float32, scale in the input dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, enable_pdl: bool | None = None
) -> torch.Tensor:
    """(``residual <- x + residual``, in place, then) RMSNorm in the model dtype: one fused op
    (``qops.rms_norm`` / ``qops.fused_add_rms_norm``; float32 models: PyTorch). ``enable_pdl``:
    the op's (``False`` right after a collective: see ``RMSNorm.forward``)."""
    if x.dtype in HALF_DTYPES:
        if residual is None:
            return qops.rms_norm(x, weight, eps, enable_pdl=enable_pdl)
        return qops.fused_add_rms_norm(x, residual, weight, eps, enable_pdl=enable_pdl)
    if residual is not None:
        residual.add_(x)
        x = residual
    return rms_norm_float(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm feeding one linear. ``forward(x, residual=None)``:

    - ``residual is None``: ``y = rmsnorm(x)``;
    - else ``residual <- x + residual`` (in place, in the model dtype) and ``y = rmsnorm(residual)``.

    ``quantize=True``: ``y`` is returned as a ``QAct`` from ``qops.rms_norm_quant`` /
    ``qops.fused_add_rms_norm_quant`` (dynamic per-token scales, or the consumer's static
    ``input_scale``); else a tensor in the model dtype from ``qops.rms_norm`` /
    ``qops.fused_add_rms_norm`` (``add_rms_norm``).
    """

    def __init__(self, hidden_size: int, eps: float, *, quantize: bool, dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.quantize = eps, quantize

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        enable_pdl: bool | None = None,
    ) -> Act:
        """``enable_pdl=False`` when ``x`` comes straight from a collective (tensor parallelism): a
        kernel launched with programmatic dependent launch may start once the previous *kernel* in
        the stream lets it, ahead of the stream's wait on the NCCL stream, and read the partial
        sums before the all-reduce has written them (seen on 2 GPUs: W4A16 TP 2 decode logits off
        by a relative 1.26 with PDL, right without)."""
        if self.quantize:
            if residual is None:
                return QAct(*qops.rms_norm_quant(x, self.weight, self.eps, scale, enable_pdl=enable_pdl))
            out = qops.fused_add_rms_norm_quant(x, residual, self.weight, self.eps, scale, enable_pdl=enable_pdl)
            return QAct(*out)
        return add_rms_norm(x, residual, self.weight, self.eps, enable_pdl)


# ---- RoPE ---------------------------------------------------------------------------------------
class Rotary(nn.Module):
    """Rotary embedding, Hugging Face's rotate-half convention.

    ``cos``/``sin`` tables f32 ``[max_pos, D]`` are built once from ``inv_freq [D/2]`` (taken
    from the Hugging Face model when available, so scaled RoPE variants come for free).
    """

    inv_freq: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, max_pos: int, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.attention_scaling = attention_scaling
        self._build(max_pos)

    def _build(self, max_pos: int) -> None:
        t = torch.arange(max_pos, dtype=torch.float32, device=self.inv_freq.device)
        f = torch.outer(t, self.inv_freq)
        emb = torch.cat((f, f), dim=-1)
        self.register_buffer("cos", emb.cos() * self.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * self.attention_scaling, persistent=False)

    def ensure(self, max_pos: int) -> None:
        """Grow the tables to cover positions ``< max_pos`` (called on the host side, by
        ``step``, so that ``forward`` never synchronizes)."""
        if max_pos > self.cos.shape[0]:
            self._build(max(max_pos, 2 * self.cos.shape[0]))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated at ``positions [T]`` (in float32, returned in ``x.dtype``);
        positions must be below the table size (``ensure``)."""
        return rotate(x, self.cos[positions], self.sin[positions])

    def apply_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H_q, D]`` and ``k [T, H_kv, D]`` rotated: in place by ``qops.rotary_embedding``
        (one kernel for both on CUDA) in float16 / bfloat16, else by ``forward``. Returns them."""
        if q.dtype in HALF_DTYPES:
            qops.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        return self(q, positions), self(k, positions)


# ---- attention ----------------------------------------------------------------------------------
@dataclass
class StepContext:
    """Per-step metadata shared by all layers (built by ``QuantizedLlamaForCausalLM.step``).

    Attributes:
        cache: the KV cache (``Int8PagedKVCache``, ``Int4PagedKVCache`` or ``HalfPagedKVCache``).
        positions: int64 ``[T]`` token positions.
        slot_mapping: int64 ``[T]`` cache slots of the new tokens.
        query_lens: new tokens per sequence (sums to ``T``).
        decode: one new token per sequence appended to existing context; uses the paged decode
            attention. Otherwise a prefill from an empty cache (causal attention per sequence).
        block_tables, seq_lens: int32 ``[B, max_blocks]`` and ``[B]`` (the lengths after the
            step's tokens): decode, and any step of an SKVQ cache (its write needs them).
        cu_seqlens: int32 ``[B + 1]``, the packed tokens' sequence boundaries (SKVQ cache).
        side_slots: int32 ``[B]``, each sequence's row of the side buffers (SKVQ cache).
        mixed: a mixed step (``decode`` False; ``MixedPlan``): which rows decode and which
            sequences' new tokens attend to their cached prefix and to themselves, all read back
            from the cache. ``None``: a plain prefill of new sequences.
        prefill_from_cache: prefill attends to the values read back from the cache (dequantized
            int8 / int4 with a quantized cache) instead of the fresh fp16 K/V: what decode sees,
            for quality evaluation of the KV cache. With SKVQ, each query position sees its own
            window in full precision, as the decode step at that position would.
    """

    cache: Int8PagedKVCache | HalfPagedKVCache | Int4PagedKVCache
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list
    decode: bool
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    prefill_from_cache: bool = False
    cu_seqlens: torch.Tensor | None = None
    side_slots: torch.Tensor | None = None
    mixed: MixedPlan | None = None


class PaddedChunks(NamedTuple):
    """A mixed step's chunks as one padded batch for SDPA over ``cache.gather`` (float and int4
    caches): ``rows [B, N]`` (token rows, padded with the chunk's first), ``valid [B, N]``,
    ``slots [B, C]`` (the cache slots of the chunk's whole context, padded with its first slot) and
    ``mask [B, 1, N, C]`` (query ``i`` sees context position ``p <= c + i``; padded queries see
    position 0 only, padded positions nothing)."""

    rows: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class MixedPlan:
    """A mixed step's attention plan, built once per step (``build``) for every layer.

    ``decode_rows`` (int64, token rows) are the sequences with cached context and one new token:
    they take the decode kernels with ``decode_block_tables`` / ``decode_seq_lens`` (their rows of
    the step's tables), ``None`` when there are none. Every other sequence has a prompt chunk:
    ``chunks`` holds its first token row, its ``c`` cached and ``n`` new tokens, ``chunk_tables``
    its block-table rows; ``padded()`` gives the chunks as one padded batch for SDPA, built on
    first use."""

    decode_rows: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    chunks: tuple[tuple[int, int, int], ...] = ()  # (first token row, c, n) per chunk
    chunk_tables: torch.Tensor | None = None
    block_size: int = 0
    _padded: PaddedChunks | None = None

    @classmethod
    def build(cls, context_lens, query_lens, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
        dev = block_tables.device
        starts = [0, *itertools.accumulate(query_lens)]
        dec = [b for b, (c, n) in enumerate(zip(context_lens, query_lens)) if c > 0 and n == 1]
        rows = tables = lens = None
        if dec:
            sel = torch.tensor(dec, device=dev)
            rows = torch.tensor([starts[b] for b in dec], device=dev)
            tables, lens = block_tables[sel], seq_lens[sel]
        chunk = [b for b, (c, n) in enumerate(zip(context_lens, query_lens)) if not (c > 0 and n == 1)]
        if not chunk:
            return cls(rows, tables, lens)
        return cls(
            rows, tables, lens, tuple((starts[b], context_lens[b], query_lens[b]) for b in chunk),
            block_tables[torch.tensor(chunk, device=dev)], block_size,
        )  # fmt: skip

    def padded(self) -> PaddedChunks:
        """The chunks as a padded batch (``PaddedChunks``), built once per step."""
        if self._padded is None:
            assert self.chunk_tables is not None and self.chunks
            dev = self.chunk_tables.device
            first, c, n = (torch.tensor(x, device=dev)[:, None] for x in zip(*self.chunks))
            big_c = max(ci + ni for _, ci, ni in self.chunks)
            i = torch.arange(max(ni for _, _, ni in self.chunks), device=dev)[None, :]
            valid = i < n  # [B, N]
            pos = torch.arange(big_c, device=dev)[None, :]
            in_ctx = pos < c + n  # [B, C]
            at = torch.where(in_ctx, pos, 0)
            bs = self.block_size
            slots = self.chunk_tables.long().gather(1, at // bs) * bs + at % bs
            causal = pos[:, None, :] <= (c + i)[:, :, None]  # [B, N, C]
            mask = torch.where(valid[:, :, None], causal & in_ctx[:, None, :], pos[:, None, :] == 0)
            self._padded = PaddedChunks(torch.where(valid, first + i, first), valid, slots, mask[:, None])
        return self._padded


def _sdpa_gqa(q, k, v, causal: bool, mask=None):
    """SDPA on ``q [B, HQ, S, D]``, ``k, v [B, H_kv, L, D]`` (kv heads repeated for GQA)."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


class Attention(nn.Module):
    """Llama attention over the paged cache. ``forward(x [T, H] or QAct, ctx) -> [T, H]``.

    qkv projection (one fused linear, rows ``[q heads | k heads | v heads]``) -> RoPE on q and k
    -> cache write (``cache.write``: ``reshape_and_cache_int8`` / ``reshape_and_cache_int4`` /
    ``skvq_cache_write``) -> attention -> o projection. Decode:
    ``qops.paged_decode_attention_int8`` (int8 cache), ``qops.int4_gqa_decode`` (int4 cache) or
    SDPA over the gathered blocks (float cache). Prefill: causal SDPA per sequence, on the fresh
    K/V or (``prefill_from_cache``) on the values read back from the cache (SKVQ: each query with
    its own full-precision window, ``_prefill_skvq``).
    """

    q_norm: nn.Parameter | None
    k_norm: nn.Parameter | None

    def __init__(self, layer_idx: int, args: LlamaArgs, qkv: nn.Module, o: nn.Module, rotary: Rotary) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv, self.d = args.num_heads, args.num_kv_heads, args.head_dim
        self.sm_scale = self.d**-0.5
        self.qkv_proj, self.o_proj = qkv, o
        self.rotary = [rotary]  # shared, not a submodule of every layer
        # Qwen3: RMSNorm of each q and k head (weights [D]) before RoPE; float, in PyTorch
        self.eps = args.rms_norm_eps
        qkv_w = cast(torch.Tensor, qkv.weight)
        dev, dt = qkv_w.device, (qkv.out_dtype if isinstance(qkv, (W8A8Linear, W4A16Linear)) else qkv_w.dtype)
        for name in ("q_norm", "k_norm"):
            w = nn.Parameter(torch.ones(self.d, dtype=dt, device=dev), requires_grad=False) if args.qk_norm else None
            self.register_parameter(name, w)

    def forward(self, x: Act, ctx: StepContext) -> torch.Tensor:
        t = ctx.positions.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = q.reshape(t, self.hq, self.d), k.reshape(t, self.hkv, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm_float(q, self.q_norm, self.eps), rms_norm_float(k, self.k_norm, self.eps)
        v = v.reshape(t, self.hkv, self.d)
        cache = ctx.cache
        rot = self.rotary[0]
        if isinstance(cache, Int8PagedKVCache) and q.dtype in HALF_DTYPES:
            # one launch: RoPE on q and k, and the int8 write of the rotated k and of v
            cache.rope_write(self.layer_idx, q, k, v, ctx.positions, rot.cos, rot.sin, ctx.slot_mapping)
        else:
            q, k = rot.apply_(q, k, ctx.positions)
            cache.write(self.layer_idx, k, v, ctx.slot_mapping, ctx)
        if ctx.decode:
            o = self._decode(q, cache, ctx)
        elif ctx.mixed is not None:
            o = self._mixed(q, cache, ctx)
        elif not ctx.prefill_from_cache:
            o = self._prefill(q, k, v, ctx.query_lens)
        else:
            kc, vc = cache.gather(self.layer_idx, ctx.slot_mapping, q.dtype, ctx)
            if isinstance(cache, Int4PagedKVCache) and cache.skvq:
                o = self._prefill_skvq(q, k, v, kc, vc, ctx.query_lens, cache.sinks, cache.window)
            else:
                o = self._prefill(q, kc, vc, ctx.query_lens)
        return self.o_proj(o.reshape(t, self.hq * self.d))

    def _decode(self, q, cache, ctx) -> torch.Tensor:
        kc, vc, ks, vs = cache.layer(self.layer_idx)
        if cache.kv_dtype == "int4":
            # the SKVQ cache's sinks and window come from the side buffers (ks, vs: None without)
            return qops.int4_gqa_decode(
                q, kc, vc, ctx.block_tables, ctx.seq_lens, self.sm_scale, cache.num_groups,
                k_side=ks, v_side=vs, side_slots=ctx.side_slots, sinks=cache.sinks, window=cache.window,
            )  # fmt: skip
        if ks is not None:
            # The kernel just before is rope_and_cache_int8 (float16/bfloat16), which also writes
            # q: no overlapped prologue then (it reads q before its PDL wait). After the plain
            # cache write (float32 models), which wrote only each sequence's new token (position
            # seq_len - 1), the kernel may read q, the tables and the older K/V while it finishes.
            overlap = q.dtype not in HALF_DTYPES
            return qops.paged_decode_attention_int8(
                q, kc, vc, ks, vs, ctx.block_tables, ctx.seq_lens, self.sm_scale, overlap_prologue=overlap
            )
        # float cache: gather each sequence's blocks, mask beyond its length
        bt = ctx.block_tables.long()
        b, nb = bt.shape
        bs = kc.shape[2]
        k = kc[bt].permute(0, 2, 1, 3, 4).reshape(b, self.hkv, nb * bs, self.d).to(q.dtype)
        v = vc[bt].permute(0, 2, 1, 3, 4).reshape(b, self.hkv, nb * bs, self.d).to(q.dtype)
        valid = torch.arange(nb * bs, device=q.device)[None, :] < ctx.seq_lens.long()[:, None]
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill(~valid, float("-inf"))
        o = _sdpa_gqa(q[:, :, None, :], k, v, causal=False, mask=mask[:, None, None, :])
        return o[:, :, 0, :]

    def _prefill(self, q, k, v, query_lens) -> torch.Tensor:
        """Causal attention within each sequence of the packed ``q [T, HQ, D]``, ``k, v [T, H_kv, D]``."""
        if len(set(query_lens)) == 1:  # equal lengths: one batched call
            b, s = len(query_lens), query_lens[0]
            qb = q.reshape(b, s, self.hq, self.d).transpose(1, 2)
            kb = k.reshape(b, s, self.hkv, self.d).transpose(1, 2)
            vb = v.reshape(b, s, self.hkv, self.d).transpose(1, 2)
            return _sdpa_gqa(qb, kb, vb, causal=True).transpose(1, 2).reshape(b * s, self.hq, self.d)
        outs, start = [], 0
        for n in query_lens:
            sl = slice(start, start + n)
            o = _sdpa_gqa(
                q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None], causal=True
            )
            outs.append(o[0].transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)

    def _mixed(self, q, cache, ctx: StepContext) -> torch.Tensor:
        """A mixed step (chunked prefill, prefill beside decode; ``ctx.mixed``). Sequences with
        cached context and one new token take the decode path (``_decode`` on those rows: the same
        kernels, hence the same values, as a decode step). Every other sequence's new queries
        attend causally to its whole context as read back from the cache (``cache.gather``), all
        of them in one padded SDPA call (``MixedPlan.padded``)."""
        plan = ctx.mixed
        assert plan is not None
        o = torch.empty_like(q)
        if plan.decode_rows is not None:
            sub = replace(ctx, block_tables=plan.decode_block_tables, seq_lens=plan.decode_seq_lens)
            o[plan.decode_rows] = self._decode(q[plan.decode_rows], cache, sub)
        if plan.chunks:
            pc = plan.padded()
            b, big_c = pc.slots.shape
            k, v = cache.gather(self.layer_idx, pc.slots.reshape(-1), q.dtype, ctx)
            kb = k.reshape(b, big_c, self.hkv, self.d).transpose(1, 2)
            vb = v.reshape(b, big_c, self.hkv, self.d).transpose(1, 2)
            qb = q[pc.rows].transpose(1, 2)  # [B, HQ, N, D]
            ob = _sdpa_gqa(qb, kb, vb, causal=False, mask=pc.mask).transpose(1, 2)
            o[pc.rows[pc.valid]] = ob[pc.valid]
        return o

    def _prefill_skvq(self, q, k, v, kc, vc, query_lens, sinks: int, window: int) -> torch.Tensor:
        """Causal attention of a prefill as the SKVQ decode steps see it: query ``t`` reads key
        ``p`` in full precision (the fresh ``k``, ``v``: what the side buffers held) when
        ``p < sinks`` or ``p > t - window``, else as its int4 row (``kc``, ``vc``: read back from
        the cache, where every such key lies outside the final window)."""
        if max(query_lens) <= sinks + window:  # no query reads an int4 row
            return self._prefill(q, k, v, query_lens)
        if len(set(query_lens)) == 1:  # equal lengths: one batched call
            b, s = len(query_lens), query_lens[0]
            qb, kb, vb, kcb, vcb = (t.reshape(b, s, *t.shape[1:]) for t in (q, k, v, kc, vc))
            return self._mixed_attention(qb, kb, vb, kcb, vcb, sinks, window).reshape(b * s, self.hq, self.d)
        outs, start = [], 0
        for n in query_lens:
            qs, ks, vs, kcs, vcs = (t[start : start + n][None] for t in (q, k, v, kc, vc))
            outs.append(self._mixed_attention(qs, ks, vs, kcs, vcs, sinks, window)[0])
            start += n
        return torch.cat(outs, dim=0)

    def _mixed_attention(self, q, kf, vf, kq, vq, sinks: int, window: int) -> torch.Tensor:
        """``q [B, S, HQ, D]``, full-precision ``kf, vf`` and int4-read ``kq, vq`` ``[B, S, H_kv,
        D]`` -> ``[B, S, HQ, D]``: causal softmax attention in float32 where query ``t`` takes
        key ``p``'s int4 value iff ``sinks <= p < t + 1 - window``."""
        s, rep = q.shape[1], self.hq // self.hkv
        t = torch.arange(s, device=q.device)
        int4 = (t[None, :] >= sinks) & (t[None, :] < t[:, None] + 1 - window)  # [query, key]
        future = t[None, :] > t[:, None]

        def heads(x):  # kv [B, S, H_kv, D] -> float32 [B, HQ, S, D]
            return x.float().transpose(1, 2).repeat_interleave(rep, dim=1)

        qf = q.float().transpose(1, 2)
        scores = torch.where(int4, qf @ heads(kq).transpose(-1, -2), qf @ heads(kf).transpose(-1, -2))
        p = torch.softmax((scores * self.sm_scale).masked_fill(future, float("-inf")), dim=-1)
        o = torch.where(int4, p, 0.0) @ heads(vq) + torch.where(int4, 0.0, p) @ heads(vf)
        return o.transpose(1, 2).to(q.dtype)


# ---- MLP ----------------------------------------------------------------------------------------
class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate/up fused (rows ``[gate | up]``).

    W8A8: ``qops.silu_and_mul_quant`` hands ``down`` an int8 activation; float and W4A16:
    ``qops.silu_and_mul``, in the model dtype (float32 models: PyTorch)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down

    def forward(self, x: Act) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if isinstance(self.down_proj, W8A8Linear):
            return self.down_proj(QAct(*qops.silu_and_mul_quant(gu, self.down_proj.input_scale)))
        if gu.dtype in HALF_DTYPES:
            return self.down_proj(qops.silu_and_mul(gu))
        g, u = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(g) * u)


# ---- decoder layer ------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    """One Llama block on the (hidden, residual) pair (vLLM style).

    ``forward(hidden [T, H], residual [T, H] or None, ctx) -> (mlp_out, residual)``: the residual
    stream is ``residual``, updated in place by the fused add+RMSNorm; ``hidden`` is the previous
    block's MLP output (or the embeddings for layer 0, with ``residual=None``). The sum
    ``mlp_out + residual`` is the block's output, added by the next layer's fused norm.
    """

    def __init__(self, attn: Attention, mlp: MLP, input_norm: RMSNorm, post_norm: RMSNorm) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_norm, post_norm

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext):
        qkv_scale = self.self_attn.qkv_proj.input_scale
        if residual is None:
            residual = hidden.clone()
            x = self.input_layernorm(hidden, None, qkv_scale)
        else:
            x = self.input_layernorm(hidden, residual, qkv_scale)
        h = self.self_attn(x, ctx)
        x = self.post_attention_layernorm(h, residual, self.mlp.gate_up_proj.input_scale)
        return self.mlp(x), residual


def sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
