"""compressed-tensors W8A8 checkpoints in and out of ``qops.llama``.

compressed-tensors is the checkpoint format llm-compressor writes and vLLM serves: a Hugging Face
model folder whose ``config.json`` has a ``quantization_config`` (``quant_method:
"compressed-tensors"``). ``load_compressed`` reads one whose linears are W8A8 int8 (format
``int-quantized`` or ``naive-quantized``: int8 weights with per-output-channel symmetric
``weight_scale``; int8 activations, dynamic per token, or static per tensor with ``input_scale``)
straight into a ``QuantizedLlamaForCausalLM`` (the int8 weights are used as they are, never
dequantized); ``save_compressed`` writes a qops W8A8 model back as such a checkpoint. The
quantization config is parsed, checked and written with the ``compressed-tensors`` package (its
``QuantizationConfig``, compressor registry and ``ModelCompressor``). See docs/llama.md.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from .config import LlamaArgs, QuantConfig
from .layers import W8A8Linear
from .model import QuantizedLlamaForCausalLM

# Hugging Face linear names of one layer -> the fused qops linear (rows concatenated in this order)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
FORMATS = ("int-quantized", "naive-quantized")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# files of a Hugging Face model folder copied by save_compressed (tokenizer, generation config)
EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def _fail(path, what: str) -> ValueError:
    return ValueError(
        f"qops.llama.load_compressed({str(path)!r}): unsupported compressed-tensors checkpoint: {what}. "
        f"Supported: format {' or '.join(FORMATS)}, int8 symmetric per-channel weights, int8 symmetric "
        f"activations (dynamic per-token, or static per-tensor), every decoder linear quantized, no kv_cache_scheme"
    )


def _v(x) -> str:
    """An enum's value (compressed-tensors keeps some as plain strings)."""
    return str(getattr(x, "value", x))


def _activation_mode(path, name: str, scheme) -> str:
    """``"dynamic"`` or ``"static"`` for a supported scheme; ``ValueError`` naming what is not."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    w, a = scheme.weights, scheme.input_activations
    if w is None:
        raise _fail(path, f"config group {name!r} has no weight quantization")
    if w.type != QuantizationType.INT or w.num_bits != 8:
        raise _fail(path, f"config group {name!r} weights are {_v(w.type)}{w.num_bits} (need int8)")
    if w.strategy != QuantizationStrategy.CHANNEL:
        raise _fail(path, f"config group {name!r} weights use strategy {_v(w.strategy)!r} (need 'channel')")
    if not w.symmetric:
        raise _fail(path, f"config group {name!r} weights are asymmetric (need symmetric)")
    if w.dynamic:
        raise _fail(path, f"config group {name!r} weights are dynamic")
    if scheme.output_activations is not None:
        raise _fail(path, f"config group {name!r} quantizes output activations")
    if a is None:
        raise _fail(path, f"config group {name!r} is weight-only (W8A16): qops runs W8A8")
    if a.type != QuantizationType.INT or a.num_bits != 8:
        raise _fail(path, f"config group {name!r} activations are {_v(a.type)}{a.num_bits} (need int8)")
    if not a.symmetric:
        raise _fail(path, f"config group {name!r} activations are asymmetric (need symmetric)")
    if a.strategy == QuantizationStrategy.TOKEN and a.dynamic is True:
        return "dynamic"
    if a.strategy == QuantizationStrategy.TENSOR and a.dynamic is False:
        return "static"
    raise _fail(
        path,
        f"config group {name!r} activations use strategy {_v(a.strategy)!r} with dynamic={a.dynamic!r} "
        f"(need dynamic 'token' or static 'tensor')",
    )


def read_quantization_config(path: str | Path) -> tuple[Any, dict[str, Any], str]:
    """``(QuantizationConfig, {hf linear name: scheme}, activations)`` of a checkpoint folder, checked
    for what qops runs (``ValueError`` otherwise). The linear names are those of ``config.json``'s
    decoder layers (``model.layers.{i}.self_attn.q_proj`` ...)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    raw = cfg.get("quantization_config")
    if not isinstance(raw, dict) or raw.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"qops.llama.load_compressed({str(path)!r}): config.json has no compressed-tensors quantization_config"
        )
    if raw.get("sparsity_config"):
        raise _fail(path, "a sparsity_config")
    if raw.get("transform_config"):
        raise _fail(path, "a transform_config")
    qc = QuantizationConfig.model_validate(raw)
    if qc.format not in FORMATS:
        raise _fail(path, f"format {qc.format!r}")
    BaseCompressor.get_value_from_registry(qc.format)  # a format compressed-tensors knows
    if qc.kv_cache_scheme is not None:
        raise _fail(path, "a kv_cache_scheme (static KV-cache scales)")
    modes = {name: _activation_mode(path, name, s) for name, s in qc.config_groups.items()}
    if len(set(modes.values())) > 1:
        raise _fail(path, f"config groups mix dynamic and static activations ({modes})")
    probe = torch.nn.Linear(1, 1, device="meta")
    ignore = qc.ignore or []
    schemes: dict[str, Any] = {}
    for i in range(int(cfg["num_hidden_layers"])):
        for names in FUSED.values():
            for n in names:
                full = f"model.layers.{i}.{n}"
                hit = [s for s in qc.config_groups.values() if is_match(full, probe, s.targets, ignore)]
                if not hit:
                    raise _fail(path, f"{full} is not quantized (ignored or matched by no config group)")
                schemes[full] = hit[0]
    if any(is_match("lm_head", probe, s.targets, ignore) for s in qc.config_groups.values()):
        raise _fail(path, "a quantized lm_head")
    return qc, schemes, next(iter(modes.values()))


def _hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _inv_freq(hf_cfg) -> tuple[torch.Tensor | None, float]:
    """The RoPE table and attention scaling Hugging Face computes for ``hf_cfg``."""
    from .quantize import SUPPORTED_ROPE, rope_type

    rope = rope_type(hf_cfg)
    if rope not in SUPPORTED_ROPE:
        raise NotImplementedError(f"qops.llama: rope type {rope!r} is not supported ({', '.join(SUPPORTED_ROPE)})")
    if rope == "default":
        return None, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope](hf_cfg, "cpu")
    return inv_freq, float(scaling)


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"qops.llama.load_compressed: no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def load_compressed(
    path: str | Path,
    *,
    device=None,
    dtype: torch.dtype | None = None,
    kv_cache: str = "int8",
    **overrides,
) -> QuantizedLlamaForCausalLM:
    """Load a compressed-tensors W8A8 checkpoint folder into a ``QuantizedLlamaForCausalLM``.

    The int8 weights and their per-channel scales go into the ``W8A8Linear`` as they are (q/k/v
    and gate/up concatenated); activations are dynamic per token, or static per tensor with the
    checkpoint's ``input_scale`` (q/k/v, and gate/up, share one input and so one scale in qops:
    the largest of theirs, as vLLM does). ``kv_cache`` and other ``QuantConfig`` ``overrides``
    (e.g. ``kv_scales``) choose the cache (default int8, dynamic scales). ``dtype``: float16 or
    bfloat16 (default: the checkpoint's ``torch_dtype`` when half, else float16).

    Raises ``ValueError`` naming what is unsupported: another format (e.g. ``float-quantized``
    fp8, ``pack-quantized`` int4), group-wise/block or per-tensor weights, asymmetric weights or
    activations, weight-only schemes, a ``kv_cache_scheme``, unquantized decoder linears.
    """
    from .config import FAMILIES
    from .quantize import check_sliding_window, check_supported

    path = Path(path)
    qc, schemes, acts = read_quantization_config(path)
    hf_cfg = _hf_config(path)
    model_type = getattr(hf_cfg, "model_type", "llama")
    if model_type not in FAMILIES:
        raise NotImplementedError(f"qops.llama: model_type {model_type!r} is not supported ({', '.join(FAMILIES)})")
    if getattr(hf_cfg, "attention_bias", False) or getattr(hf_cfg, "mlp_bias", False):
        raise NotImplementedError("qops.llama.load_compressed: linear biases are not supported")
    check_sliding_window(hf_cfg)
    args = LlamaArgs.from_hf(hf_cfg)
    if args.qkv_bias:
        raise NotImplementedError("qops.llama.load_compressed: q/k/v biases (Qwen2) are not supported")
    qcfg = QuantConfig(weights="int8", activations=acts, kv_cache=kv_cache, **overrides)
    check_supported(args, qcfg)
    if dtype is None:
        cd = getattr(hf_cfg, "dtype", None) or getattr(hf_cfg, "torch_dtype", None)
        cd = getattr(torch, cd) if isinstance(cd, str) else cd
        dtype = cd if cd in (torch.float16, torch.bfloat16) else torch.float16
    inv_freq, scaling = _inv_freq(hf_cfg)
    src = _load_tensors(path)

    from compressed_tensors.compressors.base import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(qc.format)
    sd: dict[str, torch.Tensor] = {}
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        for fused, names in FUSED.items():
            ws, ss, xs = [], [], []
            for n in names:
                full = p + n
                expected = compressor.compression_param_names(schemes[full])
                missing = [k for k in expected if f"{full}.{k}" not in src]
                if missing:
                    raise ValueError(f"qops.llama.load_compressed: {full} lacks {missing} in {path}")
                w = src[f"{full}.weight"]
                if w.dtype != torch.int8:
                    raise _fail(path, f"{full}.weight is {w.dtype} (need int8)")
                ws.append(w)
                ss.append(src[f"{full}.weight_scale"].float().reshape(-1))
                if acts == "static":
                    if f"{full}.input_scale" not in src:
                        raise ValueError(f"qops.llama.load_compressed: {full} lacks input_scale in {path}")
                    xs.append(src[f"{full}.input_scale"].float().reshape(-1))
            sd[p + fused + ".weight"] = torch.cat(ws)
            sd[p + fused + ".weight_scale"] = torch.cat(ss)
            if acts == "static":
                sd[p + fused + ".input_scale"] = torch.cat(xs).amax().reshape(1)
    model = QuantizedLlamaForCausalLM.empty(
        args, qcfg, dtype=dtype, device="meta", inv_freq=inv_freq, attention_scaling=scaling
    )
    qops_sd = {}
    for k, v in model.state_dict().items():
        hf = _qops_to_hf_name(k)
        t = sd[hf] if hf in sd else src[hf]
        if t.shape != v.shape:
            t = t.reshape(v.shape)
        qops_sd[k] = t.to(v.dtype) if v.dtype != torch.int8 else t
    model.load_state_dict(qops_sd, strict=True, assign=True)
    model._retie_rotary()
    return (model.to(device) if device is not None else model).eval()


def _qops_to_hf_name(k: str) -> str:
    """A ``QuantizedLlamaForCausalLM`` state-dict key -> the Hugging Face (or fused) tensor name."""
    if k == "embed_tokens.weight":
        return "model.embed_tokens.weight"
    if k == "norm":
        return "model.norm.weight"
    if k == "lm_head":
        return "lm_head.weight"
    parts = k.split(".")  # layers.{i}.<module path>.<buffer>
    i, rest = parts[1], parts[2:]
    mod = ".".join(rest)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if mod.startswith(norm):
            return f"model.layers.{i}.{norm}.weight"
    for qn in ("q_norm", "k_norm"):
        if mod == f"self_attn.{qn}":
            return f"model.layers.{i}.self_attn.{qn}.weight"
    return f"model.layers.{i}.{mod}"


def _scheme(static: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)
    if static:
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)
    else:
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def save_compressed(model: QuantizedLlamaForCausalLM, path: str | Path, *, hf_source: str | Path | None = None) -> None:
    """Write a W8A8 ``QuantizedLlamaForCausalLM`` as a compressed-tensors checkpoint folder:
    ``config.json`` (the model's Hugging Face config with a compressed-tensors ``quantization_config``,
    format ``int-quantized``, written by compressed-tensors' ``ModelCompressor.update_config``) and
    ``model.safetensors`` (int8 weights, ``weight_scale [N, 1]`` float32, ``input_scale`` for static
    activations, the rest in the model dtype). ``hf_source``: a Hugging Face model folder whose
    tokenizer and generation config files are copied along. The KV-cache choice is not saved (the
    format has none for dynamic int8 KV): ``load_compressed`` takes it as an argument."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.model_compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import save_file

    if not model.qcfg.w8a8:
        raise ValueError(f"qops.llama.save_compressed: only W8A8 models are supported, got {model.qcfg.label()}")
    a = model.args
    if a.qkv_bias:
        raise NotImplementedError("qops.llama.save_compressed: q/k/v biases (Qwen2) are not supported")
    static = model.qcfg.activations == "static"
    scheme = _scheme(static)
    compressor = BaseCompressor.get_value_from_registry("int-quantized")
    splits = {
        "self_attn.qkv_proj": [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim],
        "self_attn.o_proj": [a.hidden_size],
        "mlp.gate_up_proj": [a.intermediate_size, a.intermediate_size],
        "mlp.down_proj": [a.hidden_size],
    }
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[0].endswith(tuple(FUSED)):  # the W8A8 linears: written below
            continue
        out[_qops_to_hf_name(k)] = v.detach().cpu().contiguous()
    for i, layer in enumerate(model.layers):
        for fused, names in FUSED.items():
            lin = layer.get_submodule(fused)
            assert isinstance(lin, W8A8Linear)
            if lin.bias is not None:
                raise NotImplementedError("qops.llama.save_compressed: linear biases are not supported")
            ws = lin.weight.detach().cpu().split(splits[fused])
            ss = lin.weight_scale.detach().cpu().float().split(splits[fused])
            for n, w, s in zip(names, ws, ss):
                full = f"model.layers.{i}.{n}"
                # compress with compressed-tensors' own int-quantized compressor (round(W / s), clamped)
                state = {"weight": w.float() * s[:, None], "weight_scale": s[:, None].clone()}
                comp = compressor.compress(state, scheme)
                if not torch.equal(comp["weight"], w):
                    raise RuntimeError(f"qops.llama.save_compressed: {full}: compressed weight differs from qops'")
                for key in compressor.compression_param_names(scheme):
                    out[f"{full}.{key}"] = comp[key].contiguous()
                if static:
                    assert lin.input_scale is not None
                    out[f"{full}.input_scale"] = lin.input_scale.detach().cpu().float().reshape(1).clone()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model.lm_head is None:
        out.pop("lm_head.weight", None)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = _hf_config_dict(model)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="int-quantized",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    )
    ModelCompressor(quantization_config=qc).update_config(str(path))
    if hf_source is not None:
        for name in EXTRA_FILES:
            f = Path(hf_source) / name
            if f.is_file():
                shutil.copy(f, path / name)


def _hf_config_dict(model: QuantizedLlamaForCausalLM) -> dict:
    a = model.args
    if model.rotary.attention_scaling != 1.0:
        raise NotImplementedError("qops.llama.save_compressed: scaled RoPE (attention_scaling != 1) is not supported")
    d = {
        "architectures": [ARCHITECTURES.get(a.model_type, "LlamaForCausalLM")],
        "model_type": a.model_type,
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "bos_token_id": a.bos_token_id,
        "eos_token_id": a.eos_token_id,
        "hidden_act": "silu",
        "torch_dtype": str(model.dtype).replace("torch.", ""),
    }
    if a.model_type != "llama":
        d["sliding_window"] = None  # qops attends to the whole context
    d0 = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
    if not torch.allclose(model.rotary.inv_freq.cpu().float(), d0):
        raise NotImplementedError("qops.llama.save_compressed: scaled RoPE (a non-default inv_freq) is not supported")
    return d
