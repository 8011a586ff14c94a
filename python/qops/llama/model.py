"""``QuantizedLlamaForCausalLM``: the Llama module tree rebuilt from qops modules, the step API
(prefill / decode over a paged cache), and construction from a Hugging Face model."""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..int4_kv import kv_int4_row_bytes
from ..w4a16 import n_major
from .cache import blocks_needed, make_cache
from .config import LlamaArgs, QuantConfig
from .layers import (
    MLP,
    Attention,
    DecoderLayer,
    FloatLinear,
    MixedPlan,
    RMSNorm,
    Rotary,
    StepContext,
    W4A16Linear,
    W8A8Linear,
    add_rms_norm,
    make_linear,
)


def token_rows(input_ids, vocab_size: int, where: str) -> list[list[int]]:
    """``input_ids`` (one sequence of token ids per sequence, or an integer tensor ``[B, S]``) as
    lists of Python ints, checked: integers (not floats or strings) in ``[0, vocab_size)``."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"{where}: token ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"{where}: a token id tensor must be [S] or [B, S], got shape {tuple(input_ids.shape)}")
        t = input_ids.to("cpu")
        rows = t.tolist() if t.dim() == 2 else [t.tolist()]
    else:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise TypeError(f"{where}: expected one list of token ids per sequence, got {type(input_ids).__name__}")
        rows = []
        for r in input_ids:
            if isinstance(r, torch.Tensor):
                r = token_rows(r.reshape(-1), vocab_size, where)[0]
            elif isinstance(r, (str, bytes)) or not isinstance(r, Sequence):
                raise TypeError(
                    f"{where}: expected one list of token ids per sequence (e.g. [[1, 2, 3]]), "
                    f"got an element of type {type(r).__name__}"
                )
            rows.append(list(r))
    out = []
    for r in rows:
        ints = []
        for t in r:
            try:
                if isinstance(t, bool):
                    raise TypeError
                i = operator.index(t)
            except TypeError:
                raise TypeError(f"{where}: token ids must be ints, got {t!r} ({type(t).__name__})") from None
            if not 0 <= i < vocab_size:
                raise ValueError(f"{where}: token id {i} is outside the vocabulary [0, {vocab_size})")
            ints.append(i)
        out.append(ints)
    return out


class QuantizedLlamaForCausalLM(nn.Module):
    """A Llama decoder whose linears, norms, activation and attention call ``torch.ops.qops``.

    Built by ``qops.llama.quantize`` (from a ``transformers.LlamaForCausalLM``). The embedding,
    the final norm and the LM head stay in the model dtype (as in SmoothQuant / vLLM W8A8, and
    in vLLM's W4A16).

    Use:
        ``cache = model.new_cache(num_blocks)`` then ``model.step(input_ids, seq_ids, cache)``
        for each prefill or decode step (``qops.llama.generate`` wraps this), or
        ``model.score(input_ids)`` for the logits of whole windows (evaluation).

    Attributes:
        args: ``LlamaArgs`` (shape); qcfg: ``QuantConfig``; dtype: the activation dtype
            (float16/bfloat16; float32 for float-only calibration trees).
        kv_scales: ``(k_scales, v_scales)`` per layer (static KV scales) or ``None``.
    """

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
    ) -> None:
        super().__init__()
        self.args, self.qcfg, self.dtype = args, qcfg, dtype
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(final_norm, requires_grad=False)
        self.lm_head = None if lm_head is None else nn.Parameter(lm_head, requires_grad=False)
        self.rotary = rotary
        self.kv_scales: tuple[list[float], list[float]] | None = None

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_state_dict(
        cls,
        sd: dict,
        args: LlamaArgs,
        qcfg: QuantConfig,
        *,
        dtype=torch.float16,
        device=None,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
        input_scales: dict | None = None,
        progress: bool = False,
    ) -> QuantizedLlamaForCausalLM:
        """Build from float weights with Hugging Face names (``sd``, any dtype; moved to
        ``device``), quantizing the linears per ``qcfg``. ``input_scales`` holds static
        activation scales ``{"layers.{i}.{qkv,o,gate_up,down}": float}``."""
        device = torch.device(device) if device is not None else sd["model.embed_tokens.weight"].device
        input_scales = input_scales or {}
        if inv_freq is None:
            d = args.head_dim
            inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        rotary = Rotary(inv_freq.to(device), min(args.max_position_embeddings, 4096), attention_scaling)
        quant_acts = qcfg.w8a8  # W4A16 and float linears take the norms' float output
        layers = []
        it = range(args.num_layers)
        if progress:
            try:
                from tqdm.auto import tqdm

                it = tqdm(it, desc=f"quantizing ({qcfg.label()})", leave=False)
            except ImportError:
                pass
        for i in it:
            p = f"model.layers.{i}."

            def w(name, p=p):
                return sd[p + name + ".weight"].to(device=device, dtype=torch.float32)

            def lin(weight, key, name, i=i, bias=None, p=p):
                return make_linear(weight, qcfg, dtype, input_scales.get(f"layers.{i}.{key}"), bias, p + name)

            qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            qkv_bias = None
            if args.qkv_bias:  # Qwen2
                qkv_bias = torch.cat([sd[p + n + ".bias"].to(device=device, dtype=torch.float32) for n in qkv_names])
            qkv = lin(torch.cat([w(n) for n in qkv_names]), "qkv", "self_attn.qkv_proj (q/k/v fused)", bias=qkv_bias)
            o = lin(w("self_attn.o_proj"), "o", "self_attn.o_proj")
            gate_up = lin(
                torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]), "gate_up", "mlp.gate_up_proj (gate/up fused)"
            )
            down = lin(w("mlp.down_proj"), "down", "mlp.down_proj")
            n1 = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize=quant_acts, dtype=dtype, device=device)
            n2 = RMSNorm(args.hidden_size, args.rms_norm_eps, quantize=quant_acts, dtype=dtype, device=device)
            n1.weight.copy_(w("input_layernorm"))
            n2.weight.copy_(w("post_attention_layernorm"))
            attn = Attention(i, args, qkv, o, rotary)
            if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3
                attn.q_norm.copy_(w("self_attn.q_norm"))
                attn.k_norm.copy_(w("self_attn.k_norm"))
            layers.append(DecoderLayer(attn, MLP(gate_up, down), n1, n2))
        embed = sd["model.embed_tokens.weight"].to(device=device, dtype=dtype)
        head = None
        if not args.tie_word_embeddings:
            head = sd["lm_head.weight"].to(device=device, dtype=dtype)
        final_norm = sd["model.norm.weight"].to(device=device, dtype=dtype)
        return cls(args, qcfg, embed, layers, final_norm, head, rotary, dtype)

    # ---- caches ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_blocks: int, max_seqs: int | None = None):
        """An empty KV cache of ``num_blocks`` blocks for this model (int8, int4 or float per
        ``qcfg``); ``max_seqs``: the sequences an SKVQ cache holds at once (its side buffers;
        default ``min(num_blocks, 256)``), unused by the other caches."""
        ks, vs = self.kv_scales if self.kv_scales is not None else (None, None)
        return make_cache(
            self.args,
            self.qcfg,
            num_blocks,
            device=self.device,
            dtype=self.dtype,
            k_scales=ks,
            v_scales=vs,
            max_seqs=max_seqs,
        )

    def cache_for(self, lengths: Sequence[int]):
        """A cache just large enough for sequences of the given final lengths."""
        return self.new_cache(max(1, blocks_needed(lengths, self.qcfg.block_size)), max_seqs=max(1, len(lengths)))

    # ---- forward --------------------------------------------------------------------------------
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor, enable_pdl: bool | None = None) -> torch.Tensor:
        """Final residual add, RMSNorm and LM head: ``[T, H]`` -> float32 ``[T, V]``. ``residual``
        (the step's own stream, or rows gathered from it) is consumed: the add is in place.
        ``enable_pdl``: the norm's (``False`` after a collective, ``RMSNorm.forward``)."""
        x = add_rms_norm(hidden, residual, self.norm, self.args.rms_norm_eps, enable_pdl)
        w = self.head_weight()
        if x.device.type == "cpu" and x.dtype == torch.float16:
            # CPU float16 GEMMs are slow; float32 is faster and at least as accurate
            return F.linear(x.float(), w.float())
        return F.linear(x, w).float()

    def forward(
        self, input_ids: torch.Tensor, ctx: StepContext, logits_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` (flattened over sequences) -> logits f32 ``[T, V]`` (or
        ``[len(logits_rows), V]``: only those rows go through the LM head)."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        assert residual is not None  # set by the first layer (a model has at least one)
        if logits_rows is not None:
            hidden, residual = hidden[logits_rows], residual[logits_rows]
        return self.logits(hidden, residual)

    @torch.no_grad()
    def step(
        self,
        input_ids: Sequence[Sequence[int]] | torch.Tensor,
        seq_ids: Sequence[Hashable],
        cache,
        *,
        last_only: bool = True,
        prefill_from_cache: bool = False,
    ) -> torch.Tensor:
        """One model step for a batch of sequences.

        ``input_ids``: one list of new tokens per sequence (or an int tensor ``[B, S]`` of equal
        lengths). Any mix: sequences unknown to the cache are prefilled, known ones continue from
        their cached context with any number of new tokens (a decode token, or a chunk of a long
        prompt: chunked prefill). Three kinds of step:

        - every sequence known and bringing one token: a decode step (the paged decode kernels);
        - every sequence new: a prefill (causal attention over the step's own K/V, or with
          ``prefill_from_cache`` over the values read back from the cache);
        - otherwise a mixed step: each sequence's new tokens attend causally to its whole context
          as read back from the cache (cached prefix and the step's tokens, dequantized: what
          decode sees), one sequence at a time (PyTorch SDPA; not for SKVQ caches).

        Returns float32 logits ``[B, V]`` of each sequence's last token (``last_only``), else
        ``[T, V]`` for all tokens.

        Transactional: the arguments (token ids are ints in ``[0, vocab_size)``) and the free
        blocks are checked before any slot is reserved, and a step that raises later gives its
        slots back, so the cache is as it was before the call.
        """
        rows = token_rows(input_ids, self.args.vocab_size, "step")
        seq_ids = list(seq_ids)
        if len(rows) != len(seq_ids):
            raise ValueError(f"step: {len(rows)} token lists for {len(seq_ids)} sequence ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("step: seq_ids must be distinct")
        live = set(cache.sequences())
        known = [sid in live for sid in seq_ids]
        qlens = [len(r) for r in rows]
        if any(n == 0 for n in qlens):
            raise ValueError("step: every sequence needs at least one new token")
        decode = all(known) and all(n == 1 for n in qlens)
        mixed = not decode and any(known)  # chunked prefill and / or prefill beside decode
        if mixed and cache.skvq:
            raise NotImplementedError(
                "step: mixed steps (a known sequence with several new tokens, or known and new sequences "
                "together) are not supported with an SKVQ cache; run prefills and decode steps separately"
            )
        dev = self.device
        starts = [cache.seq_len(s) if k else 0 for s, k in zip(seq_ids, known)]
        # The arguments are checked: reserve the slots (append_slots checks the free blocks and
        # changes nothing when they do not suffice) and run; if anything raises from here on, the
        # cache's transaction gives the slots back and the lengths are as before the call.
        with cache.transaction():
            self.rotary.ensure(max(s + n for s, n in zip(starts, qlens)))
            slots = cache.append_slots(seq_ids, qlens)
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, qlens)]).to(dev)
            ids = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=dev)
            ctx = StepContext(
                cache=cache,
                positions=positions,
                slot_mapping=slots,
                query_lens=qlens,
                decode=decode,
                prefill_from_cache=prefill_from_cache,
            )
            if decode or mixed or cache.skvq:  # the SKVQ write needs the tables and lengths in prefill too
                ctx.block_tables = tables = cache.block_tables(seq_ids)
                ctx.seq_lens = lens = cache.seq_lens(seq_ids)
                if mixed:
                    ctx.mixed = MixedPlan.build(starts, qlens, tables, lens, cache.block_size)
            if cache.skvq:
                ctx.cu_seqlens = torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=dev)
                ctx.side_slots = cache.side_slots(seq_ids)
            last = None
            if last_only:
                last = torch.tensor(qlens, device=dev).cumsum(0) - 1
            return self(ids, ctx, last)

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, *, prefill_from_cache: bool = True) -> torch.Tensor:
        """Logits f32 ``[B, S, V]`` of every position of ``input_ids [B, S]`` (a fresh cache;
        attention reads the cached K/V, so an int8 cache's quantization error is included)."""
        b, s = input_ids.shape
        cache = self.cache_for([s] * b)
        out = self.step(input_ids, list(range(b)), cache, last_only=False, prefill_from_cache=prefill_from_cache)
        return out.reshape(b, s, -1)

    # ---- info -----------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of all parameters and buffers (the tied embedding once)."""
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def kv_bytes_per_token(self, context: int | None = None) -> int:
        """KV-cache bytes per token (all layers, K and V, int8 scales and int4 headers included).

        SKVQ's side buffers (sinks + window tokens in the model dtype) are per sequence: with
        ``context`` they are spread over a sequence of that many tokens (rounded to an int);
        without, the int4 rows alone (the long-sequence limit)."""
        a, q = self.args, self.qcfg
        per = 2 * a.num_layers * a.num_kv_heads * a.head_dim
        half = torch.finfo(self.dtype).bits // 8
        if q.kv_cache == "int8":
            return per + (0 if q.kv_scales == "static" else 2 * a.num_layers * a.num_kv_heads * 4)
        if q.kv_cache == "int4":
            rows = 2 * a.num_layers * a.num_kv_heads * kv_int4_row_bytes(a.head_dim, q.kv_groups)
            if context is None or not q.skvq:
                return rows
            return rows + round(per * half * (q.kv_sinks + q.kv_window) / context)
        return per * half

    # ---- save / load ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Save the quantized model (int8 or int4 weights and scales) to a folder: ``config.json``
        and ``model.safetensors`` (or ``model.pt`` without safetensors).

        int4 weights are saved in the reference layout (``[N, K/2]``, ``qops.w4a16.pack_int4``),
        so a W4A16 model must hold them so: one quantized on the CPU (``load(path,
        device="cuda")`` prepacks them for the GPU); the layout prepacked for a GPU cannot be
        turned back (``NotImplementedError``)."""
        prepacked = {lin.packed_for for lin in self.modules() if isinstance(lin, W4A16Linear)} - {"cpu"}
        if prepacked:
            raise NotImplementedError(
                f"QuantizedLlamaForCausalLM.save: the int4 weights are prepacked for {', '.join(sorted(prepacked))} "
                f"(qops.w4a16_prepack's device-specific layout, which qops cannot unprepack); quantize the model "
                f"on the CPU, save it, and load it with load(path, device=...)"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": "qops.llama/1",
            "args": self.args.to_dict(),
            "qcfg": self.qcfg.to_dict(),
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_scales": self.kv_scales,
            "attention_scaling": self.rotary.attention_scaling,
        }
        (path / "config.json").write_text(json.dumps(meta, indent=1))
        sd = {k: v.contiguous() for k, v in self.state_dict().items()}
        sd["rotary.inv_freq"] = self.rotary.inv_freq.contiguous()
        if self.lm_head is None:
            sd.pop("lm_head", None)
        try:
            from safetensors.torch import save_file

            save_file({k: v.cpu() for k, v in sd.items()}, str(path / "model.safetensors"))
        except ImportError:
            torch.save(sd, path / "model.pt")

    @classmethod
    def load(cls, path: str | Path, device=None) -> QuantizedLlamaForCausalLM:
        """Load a model saved with ``save`` (no float checkpoint needed)."""
        path = Path(path)
        meta = json.loads((path / "config.json").read_text())
        if meta.get("format") != "qops.llama/1":
            raise ValueError(f"{path}: not a qops.llama checkpoint")
        args = LlamaArgs(**meta["args"])
        qcfg = QuantConfig.from_dict(meta["qcfg"])
        dtype = getattr(torch, meta["dtype"])
        if (path / "model.safetensors").is_file():
            from safetensors.torch import load_file

            sd = load_file(str(path / "model.safetensors"))
        else:
            sd = torch.load(path / "model.pt", map_location="cpu")
        model = cls.empty(
            args,
            qcfg,
            dtype=dtype,
            device="meta",
            inv_freq=sd.pop("rotary.inv_freq"),
            attention_scaling=meta.get("attention_scaling", 1.0),
        )
        model.load_state_dict(sd, strict=True, assign=True)
        for lin in model.modules():
            if isinstance(lin, W4A16Linear):  # saved in the reference layout, scales row-major
                lin.packed_for = "cpu"
                lin.weight_scale = n_major(lin.weight_scale)
                if lin.weight_zero is not None:
                    lin.weight_zero = n_major(lin.weight_zero)
        model._retie_rotary()
        if meta.get("kv_scales"):
            model.kv_scales = tuple(meta["kv_scales"])
        return model.to(device) if device is not None else model

    @classmethod
    def empty(
        cls,
        args: LlamaArgs,
        qcfg: QuantConfig,
        *,
        dtype=torch.float16,
        device=None,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
    ):
        """A model with uninitialized (or random, for benchmarks) weights of the right shapes."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if inv_freq is None:
            d = args.head_dim
            inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        rotary = Rotary(
            inv_freq.to("cpu" if dev.type == "meta" else dev),
            min(args.max_position_embeddings, 4096),
            attention_scaling,
        )
        h, i_, a = args.hidden_size, args.intermediate_size, args
        static = qcfg.activations == "static"

        def lin(k, n, name, bias=False):
            if qcfg.w4a16:
                return W4A16Linear(k, n, group_size=qcfg.group_size, zeros=qcfg.weight_zeros, out_dtype=dtype,
                                   bias=bias, device=dev, name=name)  # fmt: skip
            if qcfg.w8a8:
                return W8A8Linear(k, n, out_dtype=dtype, static=static, bias=bias, device=dev)
            return FloatLinear(k, n, bias=bias, dtype=dtype, device=dev)

        layers = []
        for i in range(a.num_layers):
            p = f"model.layers.{i}."
            qkv = lin(h, a.qkv_size, p + "self_attn.qkv_proj (q/k/v fused)", a.qkv_bias)
            attn = Attention(i, a, qkv, lin(a.num_heads * a.head_dim, h, p + "self_attn.o_proj"), rotary)
            mlp = MLP(lin(h, 2 * i_, p + "mlp.gate_up_proj (gate/up fused)"), lin(i_, h, p + "mlp.down_proj"))
            n1 = RMSNorm(h, a.rms_norm_eps, quantize=qcfg.w8a8, dtype=dtype, device=dev)
            n2 = RMSNorm(h, a.rms_norm_eps, quantize=qcfg.w8a8, dtype=dtype, device=dev)
            layers.append(DecoderLayer(attn, mlp, n1, n2))
        embed = torch.empty(a.vocab_size, h, dtype=dtype, device=dev)
        head = None if a.tie_word_embeddings else torch.empty(a.vocab_size, h, dtype=dtype, device=dev)
        return cls(a, qcfg, embed, layers, torch.ones(h, dtype=dtype, device=dev), head, rotary, dtype)

    def _retie_rotary(self) -> None:
        # an nn.ModuleList types its items as nn.Module; ours are DecoderLayers
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            layer.self_attn.rotary = [self.rotary]

    def _apply(self, fn, recurse=True):
        # keep the rotary tables (non-persistent buffers of a shared module) on the model's device
        out = super()._apply(fn, recurse)
        self._retie_rotary()
        return out

    def extra_repr(self) -> str:
        return f"{self.qcfg.label()}, dtype={str(self.dtype).replace('torch.', '')}"
