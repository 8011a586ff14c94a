"""``quantize``: a Hugging Face ``LlamaForCausalLM`` -> ``QuantizedLlamaForCausalLM``, with
optional calibration (SmoothQuant smoothing, static activation scales, static KV scales).

Calibration runs the *unquantized* tree (same modules, float linears, float cache) on the
calibration tokens and records, per layer, the per-channel absolute maxima of the inputs of the
four linears and of the post-RoPE keys and the values. SmoothQuant (Xiao et al. 2023) then picks
per input channel ``k``::

    s_k = amax(|X[:, k]|) ** alpha / amax(|W[:, k]|) ** (1 - alpha)
    X' = X / s,  W' = W * s        (X' W'^T == X W^T)

and folds ``1 / s`` into the op that produces ``X``: the RMSNorm weight for qkv and gate/up,
the up projection's rows for down, the v projection's rows for o (``s`` then has to be shared by
the query heads of one kv head: it is computed from the group's maxima). See docs/llama.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import cast

import torch

from ..quantization import absmax_scale
from .cache import HalfPagedKVCache
from .config import FAMILIES, LlamaArgs, QuantConfig
from .layers import DecoderLayer
from .model import QuantizedLlamaForCausalLM


def _static_scale(amax_stats: torch.Tensor) -> float:
    """A static per-tensor int8 scale from calibrated per-channel amax statistics (the qops
    convention: ``max(amax / 127, SCALE_FLOOR)``, :func:`qops.quantization.absmax_scale`)."""
    return float(absmax_scale(amax_stats.reshape(-1), 0))


# linear key -> Hugging Face weight names (rows concatenated in this order)
LINEARS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


# RoPE types whose Hugging Face ``inv_freq`` (and ``attention_scaling``) is one fixed table, which
# ``Rotary`` takes as it is: "dynamic" (NTK) and "longrope" recompute it from the sequence length.
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def rope_type(cfg) -> str:
    """The RoPE type of a ``LlamaConfig``: ``rope_parameters`` (transformers 5) or ``rope_scaling``
    (4.x; key ``rope_type`` or the legacy ``type``); ``"default"`` when unscaled."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(cfg, attr, None)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type")):
            return str(params.get("rope_type") or params.get("type"))
    return "default"


def check_float_weights(sd: dict, quantized_config=None) -> None:
    """Raise ``ValueError`` when a weight of ``sd`` is not a floating-point tensor: a quantized
    checkpoint (e.g. compressed-tensors W8A8) loaded without its dequantizer has int8 linear
    weights and no scales, and would give NaN or garbage logits."""
    bad = {k: v.dtype for k, v in sd.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()}
    bad = {k: d for k, d in bad.items() if k.endswith(".weight") or "_proj" in k}
    if bad:
        shown = ", ".join(f"{k} ({d})" for k, d in list(bad.items())[:4]) + (" ..." if len(bad) > 4 else "")
        qc = f" (its config has quantization_config {quantized_config!r})" if quantized_config else ""
        raise ValueError(
            f"qops.llama.quantize: the model has non-float weights: {shown}{qc}. The checkpoint looks "
            f"already quantized (e.g. compressed-tensors W8A8 loaded with plain from_pretrained, which "
            f"keeps the int8 weights and drops their scales); qops.llama quantizes float weights: load "
            f"the checkpoint dequantized (or its unquantized original) in float16/bfloat16/float32, or read a "
            f"compressed-tensors W8A8 checkpoint folder directly with qops.llama.load_compressed(path)"
        )


def check_sliding_window(cfg) -> None:
    """Raise ``NotImplementedError`` for a config whose sliding-window attention would apply
    within its context (Mistral's ``sliding_window``; Qwen2/Qwen3 with ``use_sliding_window``):
    qops attends to the whole context. A window of ``None``, turned off (``use_sliding_window``
    false, or no ``"sliding_attention"`` in ``layer_types``) or at least
    ``max_position_embeddings`` (it never drops a token) is full attention, and accepted."""
    window = getattr(cfg, "sliding_window", None)
    if window is None or getattr(cfg, "use_sliding_window", None) is False:
        return
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return
    context = getattr(cfg, "max_position_embeddings", None)
    if context is not None and window >= context:
        return
    raise NotImplementedError(
        f"qops.llama: sliding-window attention is not supported: {getattr(cfg, 'model_type', '?')} config "
        f"has sliding_window={window} < max_position_embeddings={context} (qops attends to the whole "
        f"context and would diverge past the window); set sliding_window=None (or >= the context) "
        f"if the model is used within its window"
    )


# ---- Hugging Face model -> float weights --------------------------------------------------------
def hf_parts(model):
    """``(state_dict, LlamaArgs, inv_freq, attention_scaling)`` of a ``LlamaForCausalLM`` (or a
    ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``: ``config.FAMILIES``)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(getattr(model, "model", None), "layers"):
        raise TypeError(f"qops.llama.quantize expects a transformers LlamaForCausalLM, got {type(model).__name__}")
    model_type = getattr(cfg, "model_type", None) or "llama"
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"qops.llama: model_type {model_type!r} is not supported (the Llama-architecture "
            f"families: {', '.join(FAMILIES)})"
        )
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise NotImplementedError(f"qops.llama: {model_type} with attention_bias or mlp_bias: biases are not supported")
    check_sliding_window(cfg)
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(
            f"qops.llama: hidden_act {act!r} is not supported (the MLP runs SiLU-and-mul: silu only)"
        )
    rope = rope_type(cfg)
    if rope not in SUPPORTED_ROPE:
        raise NotImplementedError(
            f"qops.llama: rope type {rope!r} is not supported (the qops rotary uses one fixed inv_freq "
            f"table: {', '.join(SUPPORTED_ROPE)}; 'dynamic' and 'longrope' change it with the sequence "
            f"length, and would silently diverge from Hugging Face)"
        )
    args = LlamaArgs.from_hf(cfg)
    sd = dict(model.state_dict().items())
    check_float_weights(sd, quantized_config=getattr(cfg, "quantization_config", None))
    # the biases a family declares (Qwen2: q/k/v) go into the fused qkv linear; any other is refused
    allowed = {f"self_attn.{n}_proj.bias" for n in "qkv"} if args.qkv_bias else set()
    biases = [k for k in sd if k.endswith("_proj.bias") and k.split(".", 3)[-1] not in allowed]
    if biases:
        raise NotImplementedError(
            f"qops.llama: linear biases are not supported (the qops linears have none"
            f"{', except q/k/v' if args.qkv_bias else ''}), got {biases[:3]}"
        )
    if "lm_head.weight" not in sd or args.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rot, "inv_freq", None)
    scaling = float(getattr(rot, "attention_scaling", 1.0) or 1.0)
    if inv_freq is not None and inv_freq.device.type == "meta":
        inv_freq = None
    return sd, args, inv_freq, scaling


# ---- calibration --------------------------------------------------------------------------------
class _ObservingCache(HalfPagedKVCache):
    """A float cache that records per-layer, per-channel amax of K (post-RoPE) and V ``[H_kv, D]``."""

    def __init__(self, *a, stats: dict, **k) -> None:
        super().__init__(*a, **k)
        self.stats = stats

    def write(self, i, key, value, slot_mapping, ctx=None) -> None:
        for name, x in (("k", key), ("v", value)):
            m = x.detach().float().abs().amax(0)  # [H_kv, D]
            key_ = f"layers.{i}.{name}"
            self.stats[key_] = torch.maximum(self.stats[key_], m) if key_ in self.stats else m
        super().write(i, key, value, slot_mapping, ctx)


def _windows(tokens, seq_len: int) -> list[torch.Tensor]:
    t = torch.as_tensor(tokens, dtype=torch.long)
    if t.dim() == 2:
        return list(t)
    t = t.flatten()
    n = max(1, t.numel() // seq_len)
    return [t[i * seq_len : (i + 1) * seq_len] for i in range(n) if t[i * seq_len : (i + 1) * seq_len].numel() > 1]


@torch.no_grad()
def calibrate(
    sd: dict,
    args: LlamaArgs,
    tokens,
    *,
    seq_len: int = 512,
    batch_size: int = 4,
    device=None,
    dtype: torch.dtype | None = None,
    inv_freq=None,
    attention_scaling: float = 1.0,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Run the unquantized tree on ``tokens`` (int ``[N]``, split into windows of ``seq_len``, or
    ``[B, S]``) and return per-channel amax statistics (float32, on the CPU):

    ``layers.{i}.{qkv,o,gate_up,down}``: ``[K]`` of each linear's input;
    ``layers.{i}.{k,v}``: ``[H_kv, D]`` of the cached keys (after RoPE) and values.
    """
    device = torch.device(device) if device is not None else sd["model.embed_tokens.weight"].device
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.float16
    fcfg = QuantConfig(weights=False, kv_cache="fp16")
    tree = QuantizedLlamaForCausalLM.from_state_dict(
        sd, args, fcfg, dtype=dtype, device=device, inv_freq=inv_freq, attention_scaling=attention_scaling
    )
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    # an nn.ModuleList types its items as nn.Module; the tree's are DecoderLayers
    for i, layer in enumerate(cast("Iterable[DecoderLayer]", tree.layers)):
        mods = {
            "qkv": layer.self_attn.qkv_proj,
            "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj,
        }
        for key, mod in mods.items():

            def hook(_m, inp, key=f"layers.{i}.{key}"):
                m = inp[0].detach().float().abs().amax(0)
                stats[key] = torch.maximum(stats[key], m) if key in stats else m

            hooks.append(mod.register_forward_pre_hook(hook))
    wins = _windows(tokens, seq_len)
    batches = [wins[i : i + batch_size] for i in range(0, len(wins), batch_size)]
    it: Iterable = batches
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(batches, desc="calibrating", unit="batch", leave=False)
        except ImportError:
            pass
    try:
        for batch in it:
            lens = [int(w.numel()) for w in batch]
            nblocks = sum(-(-n // fcfg.block_size) for n in lens)
            cache = _ObservingCache(
                args.num_layers,
                args.num_kv_heads,
                args.head_dim,
                nblocks,
                fcfg.block_size,
                device=device,
                dtype=dtype,
                stats=stats,
            )
            tree.step([w.tolist() for w in batch], list(range(len(batch))), cache, last_only=True)
    finally:
        for h in hooks:
            h.remove()
    return {k: v.cpu() for k, v in stats.items()}


# ---- SmoothQuant --------------------------------------------------------------------------------
def smooth_factors(
    act_amax: torch.Tensor, weight: torch.Tensor, alpha: float, groups: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """Per-input-channel factors ``s [K]`` for a linear with float ``weight [N, K]``.

    ``groups = (H_kv, G, D)``: the K channels are ``[H_kv, G, D]`` and ``s`` must not depend on
    ``G`` (o_proj, whose factor is folded into v_proj's ``[H_kv, D]`` rows).
    """
    act_amax = act_amax.to(weight.device)  # statistics live on the CPU, weights anywhere
    a = act_amax.float().clamp(min=1e-5)
    w = weight.float().abs().amax(0).clamp(min=1e-5)
    if groups is not None:
        hkv, g, d = groups
        a = a.view(hkv, g, d).amax(1, keepdim=True).expand(hkv, g, d).reshape(-1)
        w = w.view(hkv, g, d).amax(1, keepdim=True).expand(hkv, g, d).reshape(-1)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where(act_amax.float() > 0, s, torch.ones_like(s))  # dead channels: leave alone
    return s.clamp(min=1e-5)


def apply_smoothing(sd: dict, args: LlamaArgs, stats: dict, alpha: float, targets: Iterable[str]) -> tuple[dict, dict]:
    """Return ``(sd', factors)``: a shallow copy of ``sd`` with smoothed (float32) tensors, and
    ``factors["layers.{i}.{target}"] = s [K]`` (the activation seen by the linear is ``X / s``)."""
    sd = dict(sd)
    factors = {}
    hkv, d, g = args.num_kv_heads, args.head_dim, args.num_heads // args.num_kv_heads
    for i in range(args.num_layers):
        p = f"model.layers.{i}."

        def get(n, p=p):
            return sd[p + n + ".weight"].float()

        def put(n, t, like, p=p):
            sd[p + n + ".weight"] = t.to(like.dtype)

        for tgt in targets:
            a = stats[f"layers.{i}.{tgt}"]
            if tgt in ("qkv", "gate_up"):
                names = LINEARS[tgt]
                ws = [get(n) for n in names]
                s = smooth_factors(a, torch.cat(ws), alpha).to(ws[0].device)
                norm = "input_layernorm" if tgt == "qkv" else "post_attention_layernorm"
                put(norm, get(norm) / s, sd[p + norm + ".weight"])
                for n, w in zip(names, ws):
                    put(n, w * s[None, :], sd[p + n + ".weight"])
            elif tgt == "down":
                w = get("mlp.down_proj")
                s = smooth_factors(a, w, alpha).to(w.device)
                put("mlp.up_proj", get("mlp.up_proj") / s[:, None], sd[p + "mlp.up_proj.weight"])
                put("mlp.down_proj", w * s[None, :], sd[p + "mlp.down_proj.weight"])
            elif tgt == "o":
                w = get("self_attn.o_proj")
                s = smooth_factors(a, w, alpha, groups=(hkv, g, d)).to(w.device)
                s_kv = s.view(hkv, g, d)[:, 0, :].reshape(-1)
                put("self_attn.v_proj", get("self_attn.v_proj") / s_kv[:, None], sd[p + "self_attn.v_proj.weight"])
                vb = sd.get(p + "self_attn.v_proj.bias")
                if vb is not None:  # Qwen2: v = x W_v^T + b_v, all of it scaled by 1 / s
                    sd[p + "self_attn.v_proj.bias"] = (vb.float() / s_kv.to(vb.device)).to(vb.dtype)
                put("self_attn.o_proj", w * s[None, :], sd[p + "self_attn.o_proj.weight"])
            factors[f"layers.{i}.{tgt}"] = s.cpu()
    return sd, factors


# ---- the entry points ---------------------------------------------------------------------------
def _unused_calibration(qcfg: QuantConfig, calibration_tokens, stats) -> str | None:
    """Why ``calibration_tokens`` go unused (``None``: they are used, or none were given)."""
    if calibration_tokens is None:
        return None
    if not qcfg.needs_calibration:
        return (
            f"qops.llama.quantize: calibration_tokens are ignored: {qcfg.label()} has dynamic scales "
            f"and no SmoothQuant. The options that use them: smoothquant=True (with W8A8, weights='int8'), "
            f"activations='static' (with W8A8), kv_scales='static' (with kv_cache='int8')"
        )
    if stats is not None:
        return "qops.llama.quantize: calibration_tokens are ignored: precomputed stats were given"
    return None


def check_supported(args: LlamaArgs, qcfg: QuantConfig) -> None:
    """Raise at quantize time, with the reason, for a model the quantized kernels cannot run
    (instead of at the first decode step): the int8 GEMMs need K and N multiples of 16, the int4
    GEMM (W4A16) N a multiple of 16 and K a multiple of the group size, the int8 KV cache's decode
    attention head_dim 64 or 128 (the float cache runs attention in PyTorch: any even head_dim)."""
    if args.head_dim % 2:
        raise ValueError(f"qops.llama.quantize: RoPE needs an even head_dim, got {args.head_dim}")
    if qcfg.w8a8:
        sizes = {
            "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size,
            "num_heads * head_dim": args.num_heads * args.head_dim,
            "qkv size": args.qkv_size,
        }
        bad = {k: v for k, v in sizes.items() if v % 16}
        if bad:
            raise ValueError(
                f"qops.llama.quantize: W8A8 needs layer sizes that are multiples of 16 "
                f"(the int8 GEMMs' K and N), got {bad}; use weights=False"
            )
    if qcfg.w4a16:
        g = qcfg.group_size
        linears = w4a16_linears(args)
        odd = [f"{name} [N={n}, K={k}]" for name, (n, k) in linears.items() if n % 16 or k % g]
        if odd:
            fits = g == 128 and all(n % 16 == 0 and k % 64 == 0 for n, k in linears.values())
            raise ValueError(
                f"qops.llama.quantize: W4A16 (qops.w4a16_gemm) needs every linear's N (output features) a "
                f"multiple of 16 and K (input features) a multiple of group_size ({g}); in every layer, "
                f"{', '.join(odd)} {'does' if len(odd) == 1 else 'do'} not"
                + ("; group_size=64 fits this model" if fits else "; use weights='int8' or weights=False")
            )
    if qcfg.kv_cache in ("int8", "int4") and args.head_dim not in (64, 128):
        raise ValueError(
            f"qops.llama.quantize: the {qcfg.kv_cache} KV cache's decode attention supports head_dim "
            f"64 or 128, got {args.head_dim}; use kv_cache='fp16'"
        )


def w4a16_linears(args: LlamaArgs) -> dict[str, tuple[int, int]]:
    """The ``[N, K]`` of the four (fused) linears of every layer, by name."""
    return {
        "self_attn.qkv_proj (q/k/v fused)": (args.qkv_size, args.hidden_size),
        "self_attn.o_proj": (args.hidden_size, args.num_heads * args.head_dim),
        "mlp.gate_up_proj (gate/up fused)": (2 * args.intermediate_size, args.hidden_size),
        "mlp.down_proj": (args.hidden_size, args.intermediate_size),
    }


def quantize(
    model,
    calibration_tokens=None,
    config: QuantConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
    device=None,
    calib_seq_len: int = 512,
    calib_batch_size: int = 4,
    progress: bool = True,
    stats: dict | None = None,
    **overrides,
) -> QuantizedLlamaForCausalLM:
    """Quantize a Hugging Face ``LlamaForCausalLM`` into a ``QuantizedLlamaForCausalLM``.

    The result is a new module tree; ``model`` is left unchanged (the float weights are read,
    int8 weights with per-output-channel scales produced from them, or with ``weights="int4"``
    int4 weights with a scale (and zero) per group of ``group_size`` input channels, prepacked
    on ``device``).

    Model families (``config.model_type``): ``llama``; ``mistral`` (``MistralForCausalLM``);
    ``qwen2`` (``Qwen2ForCausalLM``: the q/k/v biases are added by the fused qkv linear, in the
    model dtype; a bias on any other linear, or in a family without them, is refused); ``qwen3``
    (``Qwen3ForCausalLM``: the per-head RMSNorm of q and k before RoPE, ``q_norm``/``k_norm``
    weights ``[head_dim]``, runs in PyTorch on the float q/k). None with sliding-window
    attention: a ``sliding_window`` below ``max_position_embeddings`` (Qwen: with
    ``use_sliding_window``) raises ``NotImplementedError``; ``None`` is full attention.

    Args:
        model: a ``transformers.LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
            or ``Qwen3ForCausalLM`` (fp16, bf16 or fp32) on any device.
        calibration_tokens: int token ids ``[N]`` or ``[B, S]``; needed for SmoothQuant and for
            static scales (activations or KV). Given to a config that uses none of them (the
            default: dynamic scales, no SmoothQuant), or beside ``stats``, they are ignored with
            a ``UserWarning`` that names the options that would use them.
        config: a ``QuantConfig`` (default: W8A8 with dynamic per-token activations and the int8
            KV cache with dynamic scales); keyword ``overrides`` replace its fields, e.g.
            ``quantize(m, toks, smoothquant=True, smooth_alpha=0.8)`` or
            ``quantize(m, weights="int4", group_size=64)`` (W4A16 + KV8).
        dtype: activation dtype (float16 or bfloat16; float32 only for float-only variants);
            default: the model's if half, else float16.
        device: where the quantized model lives (default: the model's device).
        calib_seq_len, calib_batch_size: how calibration tokens are windowed and batched.
        progress: tqdm progress bars (calibration, quantization).
        stats: precomputed ``calibrate`` statistics (skips the calibration run).
    """
    import dataclasses

    qcfg = config or QuantConfig()
    if overrides:
        qcfg = dataclasses.replace(qcfg, **overrides)
    sd, args, inv_freq, scaling = hf_parts(model)
    unused = _unused_calibration(qcfg, calibration_tokens, stats)
    if unused:
        warnings.warn(unused, UserWarning, stacklevel=2)
        calibration_tokens = None  # warned once, here
    return quantize_state_dict(
        sd,
        args,
        qcfg,
        calibration_tokens=calibration_tokens,
        dtype=dtype,
        device=device,
        calib_seq_len=calib_seq_len,
        calib_batch_size=calib_batch_size,
        progress=progress,
        stats=stats,
        inv_freq=inv_freq,
        attention_scaling=scaling,
    )


def quantize_state_dict(
    sd: dict,
    args: LlamaArgs,
    qcfg: QuantConfig,
    *,
    calibration_tokens=None,
    dtype: torch.dtype | None = None,
    device=None,
    calib_seq_len: int = 512,
    calib_batch_size: int = 4,
    progress: bool = False,
    stats: dict | None = None,
    inv_freq: torch.Tensor | None = None,
    attention_scaling: float = 1.0,
) -> QuantizedLlamaForCausalLM:
    """``quantize`` from float weights with Hugging Face names and a ``LlamaArgs`` (no
    transformers needed). Arguments as ``quantize``'s (unused ``calibration_tokens`` warn)."""
    unused = _unused_calibration(qcfg, calibration_tokens, stats)
    if unused:
        warnings.warn(unused, UserWarning, stacklevel=2)
    mdtype = sd["model.embed_tokens.weight"].dtype
    if dtype is None:
        dtype = mdtype if mdtype in (torch.float16, torch.bfloat16) else torch.float16
    if qcfg.weights and dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qops.llama: {qcfg.weight_label()} models run in float16 or bfloat16, got dtype={dtype}")
    if qcfg.kv_cache in ("int8", "int4") and dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"qops.llama: the {qcfg.kv_cache} KV cache takes float16 or bfloat16 K/V, got dtype={dtype}")
    device = torch.device(device) if device is not None else sd["model.embed_tokens.weight"].device
    check_float_weights(sd)
    check_supported(args, qcfg)

    if qcfg.needs_calibration and stats is None:
        if calibration_tokens is None:
            raise ValueError(
                f"qops.llama.quantize: {qcfg.label()} (SmoothQuant or static scales) needs calibration_tokens"
            )
        if torch.as_tensor(calibration_tokens).numel() < 2:
            raise ValueError(
                "qops.llama.quantize: calibration_tokens is empty (at least 2 tokens are "
                "needed; give a few thousand for useful statistics)"
            )
        stats = calibrate(
            sd,
            args,
            calibration_tokens,
            seq_len=calib_seq_len,
            batch_size=calib_batch_size,
            device=device,
            inv_freq=inv_freq,
            attention_scaling=attention_scaling,
            progress=progress,
        )
    factors: dict = {}
    if qcfg.w8a8 and qcfg.smoothquant:
        assert stats is not None  # qcfg.needs_calibration: given or calibrated above
        sd, factors = apply_smoothing(sd, args, stats, qcfg.smooth_alpha, qcfg.smooth_targets)
        if "o" in qcfg.smooth_targets:  # V was rescaled: its statistics with it
            stats = dict(stats)
            for i in range(args.num_layers):
                s = factors[f"layers.{i}.o"].view(args.num_kv_heads, -1, args.head_dim)[:, 0, :]
                stats[f"layers.{i}.v"] = stats[f"layers.{i}.v"] / s.to(stats[f"layers.{i}.v"].device)
    input_scales = None
    if qcfg.w8a8 and qcfg.activations == "static":
        assert stats is not None  # qcfg.needs_calibration: given or calibrated above
        input_scales = {}
        for key in ("qkv", "o", "gate_up", "down"):
            for i in range(args.num_layers):
                k = f"layers.{i}.{key}"
                a = stats[k] / factors[k] if k in factors else stats[k]
                input_scales[k] = _static_scale(a)
    qmodel = QuantizedLlamaForCausalLM.from_state_dict(
        sd,
        args,
        qcfg,
        dtype=dtype,
        device=device,
        inv_freq=inv_freq,
        attention_scaling=attention_scaling,
        input_scales=input_scales,
        progress=progress,
    )
    if qcfg.kv_cache == "int8" and qcfg.kv_scales == "static":
        assert stats is not None  # qcfg.needs_calibration: given or calibrated above
        qmodel.kv_scales = (
            [_static_scale(stats[f"layers.{i}.k"]) for i in range(args.num_layers)],
            [_static_scale(stats[f"layers.{i}.v"]) for i in range(args.num_layers)],
        )
    return qmodel.eval()
