"""compressed-tensors W8A8 and W4A16 checkpoints in and out of ``qops.llama``.

compressed-tensors is the checkpoint format llm-compressor writes and vLLM serves: a Hugging Face
model folder whose ``config.json`` has a ``quantization_config`` (``quant_method:
"compressed-tensors"``). ``load_compressed`` reads one straight into a
``QuantizedLlamaForCausalLM`` (the integer weights are used as they are, never dequantized) when
its linears are

- W8A8 int8 (format ``int-quantized`` or ``naive-quantized``): int8 weights with per-output-channel
  symmetric ``weight_scale``; int8 activations, dynamic per token, or static per tensor with
  ``input_scale``;
- W4A16 int4 (format ``pack-quantized``): int4 weights packed eight to an int32
  (``weight_packed``, ``weight_shape``) with one ``weight_scale`` per group of 64 or 128 input
  channels, symmetric, or asymmetric with a packed integer ``weight_zero_point``; activations not
  quantized.

``save_compressed`` writes a qops W8A8 or W4A16 model back as such a checkpoint. The quantization
config is parsed, checked and written with the ``compressed-tensors`` package (its
``QuantizationConfig``, compressor registry, ``ModelCompressor`` and the pack-quantized
compressor's ``pack_to_int32`` / ``unpack_from_int32``). See docs/checkpoints.md.

int4 conventions. compressed-tensors: ``q`` a signed int4 in [-8, 7] (stored offset by 8 in the
packed nibbles), ``w = (q - zero_point) * scale`` with an integer ``zero_point`` in [-8, 7].
qops (``qops.w4a16``): the same signed ``q``, ``w = q * scale + zero`` with a float ``zero`` in
the model dtype. So ``q`` carries over as it is, ``scale`` is cast to the model dtype, and ``zero =
-zero_point * scale`` is computed from that cast scale in float32 (exact) and rounded once to the
model dtype. Where rounding can happen: the scale itself when the checkpoint stores it in another
dtype than the model's; that ``zero``, when ``zero_point * scale`` needs more bits than the dtype
has; and the GEMM's dequantization, which
rounds ``q * scale`` and then adds ``zero`` (two roundings) where compressed-tensors rounds
``(q - zero_point) * scale`` once. Symmetric checkpoints dequantize bit-exactly as
compressed-tensors does (``q * scale``, one rounding in both).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..w4a16 import n_major
from .config import LlamaArgs, QuantConfig
from .layers import W4A16Linear, W8A8Linear
from .model import QuantizedLlamaForCausalLM

# Hugging Face linear names of one layer -> the fused qops linear (rows concatenated in this order)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
W8A8_FORMATS = ("int-quantized", "naive-quantized")
W4A16_FORMAT = "pack-quantized"
FORMATS = (*W8A8_FORMATS, W4A16_FORMAT)
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
        f"Supported: W8A8 (format {' or '.join(W8A8_FORMATS)}: int8 symmetric per-channel weights, int8 "
        f"symmetric activations, dynamic per-token or static per-tensor) or W4A16 (format {W4A16_FORMAT}: int4 "
        f"weights in groups of 64 or 128, symmetric or with zero points, no activation quantization, no "
        f"group actorder); every decoder linear quantized alike, no kv_cache_scheme"
    )


def _v(x) -> str:
    """An enum's value (compressed-tensors keeps some as plain strings)."""
    return str(getattr(x, "value", x))


def _w4a16_mode(path, name: str, scheme) -> dict[str, Any]:
    """``QuantConfig`` fields (``weights="int4"``, ``group_size``, ``weight_zeros``) of a supported
    pack-quantized scheme; ``ValueError`` naming what is not."""
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    w = scheme.weights
    if w is None:
        raise _fail(path, f"config group {name!r} has no weight quantization")
    if w.type != QuantizationType.INT or w.num_bits != 4:
        raise _fail(
            path, f"config group {name!r} weights are {_v(w.type)}{w.num_bits} in format {W4A16_FORMAT!r} (need int4)"
        )
    if w.strategy != QuantizationStrategy.GROUP:
        raise _fail(path, f"config group {name!r} int4 weights use strategy {_v(w.strategy)!r} (need 'group')")
    if w.group_size not in (64, 128):
        raise _fail(path, f"config group {name!r} int4 weights use group_size {w.group_size!r} (need 64 or 128)")
    if w.dynamic:
        raise _fail(path, f"config group {name!r} weights are dynamic")
    if w.actorder is not None and _v(w.actorder) not in ("weight", "static"):  # those keep the column order
        raise _fail(path, f"config group {name!r} weights use actorder {_v(w.actorder)!r} (a g_idx permutation)")
    if scheme.input_activations is not None:
        raise _fail(path, f"config group {name!r} quantizes activations in format {W4A16_FORMAT!r} (qops runs W4A16)")
    if scheme.output_activations is not None:
        raise _fail(path, f"config group {name!r} quantizes output activations")
    return {"weights": "int4", "group_size": int(w.group_size), "weight_zeros": not w.symmetric}


def _mode(path, name: str, scheme, fmt: str) -> dict[str, Any]:
    """The ``QuantConfig`` fields a supported config group stands for."""
    if fmt == W4A16_FORMAT:
        return _w4a16_mode(path, name, scheme)
    return {"weights": "int8", "activations": _activation_mode(path, name, scheme)}


def _activation_mode(path, name: str, scheme) -> str:
    """W8A8: ``"dynamic"`` or ``"static"`` for a supported scheme; ``ValueError`` naming what is not."""
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


def read_quantization_config(path: str | Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(QuantizationConfig, {hf linear name: scheme}, QuantConfig fields)`` of a checkpoint
    folder, checked for what qops runs (``ValueError`` otherwise). The linear names are those of
    ``config.json``'s decoder layers (``model.layers.{i}.self_attn.q_proj`` ...); the fields are
    ``{"weights": "int8", "activations": "dynamic" | "static"}`` (W8A8) or ``{"weights": "int4",
    "group_size": 64 | 128, "weight_zeros": bool}`` (W4A16)."""
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
    try:
        qc = QuantizationConfig.model_validate(raw)
    except ValueError as e:  # pydantic's ValidationError: compressed-tensors itself refuses it
        raise _fail(
            path, f"compressed-tensors refuses its quantization_config ({str(e).splitlines()[-1].strip()}: {e})"
        ) from e
    if qc.format not in FORMATS:
        raise _fail(path, f"format {qc.format!r}")
    BaseCompressor.get_value_from_registry(qc.format)  # a format compressed-tensors knows
    if qc.kv_cache_scheme is not None:
        raise _fail(path, "a kv_cache_scheme (static KV-cache scales)")
    modes = {name: _mode(path, name, s, qc.format) for name, s in qc.config_groups.items()}
    if len({tuple(sorted(m.items())) for m in modes.values()}) > 1:
        raise _fail(path, f"config groups quantize differently ({modes}); qops runs one scheme per model")
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
    if not modes:
        raise _fail(path, "no config_groups")
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


def _config_dtype(hf_cfg) -> torch.dtype:
    """A checkpoint config's ``torch_dtype`` when half (float16, bfloat16), else float16."""
    cd = getattr(hf_cfg, "dtype", None) or getattr(hf_cfg, "torch_dtype", None)
    cd = getattr(torch, cd) if isinstance(cd, str) else cd
    return cd if cd in (torch.float16, torch.bfloat16) else torch.float16


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The model dtype ``load_compressed(path)`` uses by default: the checkpoint's ``torch_dtype``
    when half (float16, bfloat16), else float16."""
    return _config_dtype(_hf_config(Path(path)))


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
    """Load a compressed-tensors W8A8 or W4A16 checkpoint folder into a ``QuantizedLlamaForCausalLM``.

    W8A8 (``int-quantized``/``naive-quantized``): the int8 weights and their per-channel scales go
    into the ``W8A8Linear`` as they are (q/k/v and gate/up concatenated); activations are dynamic
    per token, or static per tensor with the checkpoint's ``input_scale`` (q/k/v, and gate/up,
    share one input and so one scale in qops: the largest of theirs, as vLLM does).

    W4A16 (``pack-quantized``): the int4 values are unpacked with compressed-tensors'
    ``unpack_from_int32`` and repacked two per byte (``qops.w4a16.pack_int4``: the same signed
    values), the group scales go into the ``W4A16Linear`` in ``dtype``, and asymmetric zero points
    become ``zero = -zero_point * scale`` with that ``dtype`` scale (float32, rounded once to
    ``dtype``; see the module docstring for where that rounds), so ``save_compressed`` writes the
    same integer zero points back whatever dtype the checkpoint's scales had.

    ``kv_cache`` and other ``QuantConfig`` ``overrides`` (e.g. ``kv_scales``) choose the cache
    (default int8, dynamic scales). ``dtype``: float16 or bfloat16 (default: the checkpoint's
    ``torch_dtype`` when half, else float16).

    Raises ``ValueError`` naming what is unsupported: another format (e.g. ``float-quantized``
    fp8), int8 group-wise/block or per-tensor weights, int4 weights per channel or in groups
    other than 64/128, group actorder (``g_idx``), asymmetric int8 weights or activations, W8A16
    or W4A8 schemes, a ``kv_cache_scheme``, unquantized decoder linears.
    """
    from .config import FAMILIES
    from .quantize import check_sliding_window, check_supported

    path = Path(path)
    qc, schemes, mode = read_quantization_config(path)
    acts = mode.get("activations", "dynamic")
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
    qcfg = QuantConfig(**mode, kv_cache=kv_cache, **overrides)
    check_supported(args, qcfg)
    if dtype is None:
        dtype = _config_dtype(hf_cfg)
    inv_freq, scaling = _inv_freq(hf_cfg)
    src = _load_tensors(path)

    from compressed_tensors.compressors.base import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(qc.format)
    if qcfg.w4a16:
        sd = _w4a16_tensors(path, src, schemes, compressor, args, dtype)
    else:
        sd = _w8a8_tensors(path, src, schemes, compressor, args, acts == "static")
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
    for lin in model.modules():
        if isinstance(lin, W4A16Linear):  # the reference layout; scales N-major (as the kernels read)
            lin.packed_for = "cpu"
            lin.weight_scale = n_major(lin.weight_scale)
            if lin.weight_zero is not None:
                lin.weight_zero = n_major(lin.weight_zero)
    model._retie_rotary()
    return (model.to(device) if device is not None else model).eval()


def _w8a8_tensors(path: Path, src: dict, schemes: dict, compressor, args: LlamaArgs, static: bool) -> dict:
    """The fused qops W8A8 tensors (``...qkv_proj.weight`` int8, ``.weight_scale`` float32 ``[N]``,
    ``.input_scale`` with static activations) of an int-quantized checkpoint's tensors."""
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
                if static:
                    if f"{full}.input_scale" not in src:
                        raise ValueError(f"qops.llama.load_compressed: {full} lacks input_scale in {path}")
                    xs.append(src[f"{full}.input_scale"].float().reshape(-1))
            sd[p + fused + ".weight"] = torch.cat(ws)
            sd[p + fused + ".weight_scale"] = torch.cat(ss)
            if static:
                sd[p + fused + ".input_scale"] = torch.cat(xs).amax().reshape(1)
    return sd


def _w4a16_tensors(path: Path, src: dict, schemes: dict, compressor, args: LlamaArgs, dtype) -> dict:
    """The fused qops W4A16 tensors (``...qkv_proj.weight`` uint8 ``[N, K/2]``, ``.weight_scale``
    and ``.weight_zero`` ``[N, K/G]`` in ``dtype``) of a pack-quantized checkpoint's tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from ..w4a16 import pack_int4

    sd: dict[str, torch.Tensor] = {}
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        for fused, names in FUSED.items():
            qs, ss, zs = [], [], []
            for n in names:
                full = p + n
                scheme = schemes[full]
                expected = compressor.compression_param_names(scheme)
                missing = [k for k in expected if f"{full}.{k}" not in src]
                if missing:
                    raise ValueError(f"qops.llama.load_compressed: {full} lacks {missing} in {path}")
                if f"{full}.weight_g_idx" in src:
                    raise _fail(path, f"{full} has a weight_g_idx (group actorder)")
                packed, scale = src[f"{full}.weight_packed"], src[f"{full}.weight_scale"]
                if packed.dtype != torch.int32:
                    raise _fail(path, f"{full}.weight_packed is {packed.dtype} (need int32)")
                shape = torch.Size(int(x) for x in src[f"{full}.weight_shape"].reshape(-1).tolist())
                g = int(scheme.weights.group_size)
                if len(shape) != 2 or shape[1] % g or tuple(scale.shape) != (shape[0], shape[1] // g):
                    raise ValueError(
                        f"qops.llama.load_compressed: {full}: weight_shape {tuple(shape)} and weight_scale "
                        f"{tuple(scale.shape)} do not fit groups of {g} in {path}"
                    )
                q = unpack_from_int32(packed, 4, shape)  # int8 in [-8, 7]: qops' signed int4 values
                qs.append(q)
                scale = scale.to(dtype)  # the scale the GEMM uses (rounded here if stored in another dtype)
                ss.append(scale)
                if not scheme.weights.symmetric:
                    zp = src[f"{full}.weight_zero_point"]
                    if zp.dtype == torch.int32:  # packed along N (the pack-quantized compressor's layout)
                        zp = unpack_from_int32(zp, 4, scale.shape, packed_dim=0)
                    zp = zp.reshape(scale.shape)
                    # w = (q - zp) * s = q * s + (-zp * s) with s the scale in dtype: -zp * s exact in
                    # float32, rounded once to dtype (so save_compressed gives zp back exactly)
                    zs.append((-zp.float() * scale.float()).to(dtype))
            sd[p + fused + ".weight"] = pack_int4(torch.cat(qs))
            sd[p + fused + ".weight_scale"] = torch.cat(ss)
            if zs:
                sd[p + fused + ".weight_zero"] = torch.cat(zs)
    return sd


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


def save_compressed(
    model: QuantizedLlamaForCausalLM,
    path: str | Path,
    *,
    hf_source: str | Path | None = None,
    tokenizer=None,
) -> None:
    """Write a W8A8 or W4A16 ``QuantizedLlamaForCausalLM`` as a compressed-tensors checkpoint
    folder: ``config.json`` (the model's Hugging Face config with a compressed-tensors
    ``quantization_config`` written by compressed-tensors' ``ModelCompressor.update_config``),
    ``model.safetensors`` and ``generation_config.json``.

    W8A8: format ``int-quantized``: int8 weights, ``weight_scale [N, 1]`` float32, ``input_scale``
    for static activations. W4A16: format ``pack-quantized``: ``weight_packed`` (int4 packed into
    int32 by compressed-tensors' ``pack_to_int32``), ``weight_shape``, ``weight_scale [N, K/G]``
    in the model dtype and, with zeros, ``weight_zero_point`` (integers, packed along N). qops'
    zeros are floats (``w = q * scale + zero``) and compressed-tensors' integers (``w = (q -
    zero_point) * scale``): a zero is written as ``zero_point = -zero / scale`` when that is an
    integer in [-8, 7] that gives ``zero`` back exactly (always so for models loaded from such
    checkpoints, whose zeros ``load_compressed`` computes from the scales in the model dtype: they
    save, and load back, bit-exactly); qops' own asymmetric quantization (``quantize_weight_int4(with_zeros=True)``)
    puts zeros between grid points, and saving them raises ``ValueError`` (save a symmetric W4A16
    model instead). The rest of the tensors are in the model dtype.

    ``hf_source``: a Hugging Face model folder whose tokenizer and generation config files are
    copied along; ``tokenizer``: a tokenizer saved with ``save_pretrained`` (e.g. one read from a
    GGUF). Without a ``generation_config.json`` from ``hf_source`` one is written from the
    model's bos/eos token ids. The KV-cache choice is not saved (the format has none for dynamic
    KV): ``load_compressed`` takes it as an argument."""
    from compressed_tensors.compressors.model_compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors.torch import save_file

    qcfg = model.qcfg
    if not (qcfg.w8a8 or qcfg.w4a16):
        raise ValueError(
            f"qops.llama.save_compressed: only W8A8 and W4A16 models are supported, got {qcfg.label()} "
            f"(float linears have no compressed-tensors quantization)"
        )
    a = model.args
    if a.qkv_bias:
        raise NotImplementedError("qops.llama.save_compressed: q/k/v biases (Qwen2) are not supported")
    hf_cfg = _hf_config_dict(model)  # refuses what the config cannot say (scaled RoPE) before any work
    splits = {
        "self_attn.qkv_proj": [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim],
        "self_attn.o_proj": [a.hidden_size],
        "mlp.gate_up_proj": [a.intermediate_size, a.intermediate_size],
        "mlp.down_proj": [a.hidden_size],
    }
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[0].endswith(tuple(FUSED)):  # the quantized linears: written below
            continue
        out[_qops_to_hf_name(k)] = v.detach().cpu().contiguous()
    if qcfg.w4a16:
        scheme, fmt = _w4a16_scheme(qcfg.group_size, qcfg.weight_zeros), W4A16_FORMAT
        writer = _w4a16_linear_tensors
    else:
        scheme, fmt = _scheme(qcfg.activations == "static"), "int-quantized"
        writer = _w8a8_linear_tensors
    for i, layer in enumerate(model.layers):
        for fused, names in FUSED.items():
            lin = layer.get_submodule(fused)
            if getattr(lin, "bias", None) is not None:
                raise NotImplementedError("qops.llama.save_compressed: linear biases are not supported")
            for n, tensors in zip(names, writer(lin, splits[fused], scheme, f"model.layers.{i}.{fused}")):
                for key, t in tensors.items():
                    out[f"model.layers.{i}.{n}.{key}"] = t.contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if model.lm_head is None:
        out.pop("lm_head.weight", None)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    )
    ModelCompressor(quantization_config=qc).update_config(str(path))
    if hf_source is not None:
        for name in EXTRA_FILES:
            f = Path(hf_source) / name
            if f.is_file():
                shutil.copy(f, path / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    if not (path / "generation_config.json").is_file():
        gen = {k: v for k, v in (("bos_token_id", a.bos_token_id), ("eos_token_id", a.eos_token_id)) if v is not None}
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2))


def _w8a8_linear_tensors(lin, split: list[int], scheme, name: str) -> list[dict[str, torch.Tensor]]:
    """The compressed-tensors tensors of each Hugging Face linear fused in a ``W8A8Linear``,
    compressed by compressed-tensors' own int-quantized compressor (``round(W / s)``, clamped)
    and checked against qops' int8 weights."""
    from compressed_tensors.compressors.base import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry("int-quantized")
    if not isinstance(lin, W8A8Linear):
        raise TypeError(f"qops.llama.save_compressed: {name} is a {type(lin).__name__}, not a W8A8Linear")
    res = []
    ws = lin.weight.detach().cpu().split(split)
    ss = lin.weight_scale.detach().cpu().float().split(split)
    for w, s in zip(ws, ss):
        state = {"weight": w.float() * s[:, None], "weight_scale": s[:, None].clone()}
        comp = compressor.compress(state, scheme)
        if not torch.equal(comp["weight"], w):
            raise RuntimeError(f"qops.llama.save_compressed: {name}: compressed weight differs from qops'")
        t = {key: comp[key] for key in compressor.compression_param_names(scheme)}
        if lin.input_scale is not None:
            t["input_scale"] = lin.input_scale.detach().cpu().float().reshape(1).clone()
        res.append(t)
    return res


def _w4a16_linear_tensors(lin, split: list[int], scheme, name: str) -> list[dict[str, torch.Tensor]]:
    """The pack-quantized tensors of each Hugging Face linear fused in a ``W4A16Linear``: the
    int4 values (qops' signed nibbles, unpacked) packed by compressed-tensors' ``pack_to_int32``,
    the scales as they are, zeros as integer zero points (``ValueError`` where a zero is not one)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from ..w4a16 import unpack_int4

    if not isinstance(lin, W4A16Linear):
        raise TypeError(f"qops.llama.save_compressed: {name} is a {type(lin).__name__}, not a W4A16Linear")
    if lin.packed_for != "cpu":
        raise NotImplementedError(
            f"qops.llama.save_compressed: {name}'s int4 weight is prepacked for {lin.packed_for} "
            f"(qops.w4a16_prepack's device-specific layout, which qops cannot unprepack); quantize or load "
            f"the model on the CPU, save it, and move it afterwards"
        )
    names = BaseCompressor.get_value_from_registry(W4A16_FORMAT).compression_param_names(scheme)
    q_all = unpack_int4(lin.weight.detach().cpu())
    s_all = lin.weight_scale.detach().cpu().contiguous()
    z_all = None if lin.weight_zero is None else lin.weight_zero.detach().cpu().contiguous()
    res = []
    for j, (q, s) in enumerate(zip(q_all.split(split), s_all.split(split))):
        t = {
            "weight_packed": pack_to_int32(q.contiguous(), 4),
            "weight_shape": torch.tensor(q.shape),
            "weight_scale": s,
        }
        if not torch.equal(unpack_from_int32(t["weight_packed"], 4, q.shape), q):
            raise RuntimeError(f"qops.llama.save_compressed: {name}: packed int4 weight differs from qops'")
        if z_all is not None:
            z = z_all.split(split)[j]
            sf, zf = s.float(), z.float()
            zp = torch.where(sf == 0, torch.zeros_like(zf), -zf / torch.where(sf == 0, torch.ones_like(sf), sf))
            zp = zp.round().clamp(-8, 7)
            back = (-zp * sf).to(z.dtype)
            bad = back != z
            if bool(bad.any()):
                n_bad = int(bad.sum())
                raise ValueError(
                    f"qops.llama.save_compressed: {name}: {n_bad} of {z.numel()} int4 zeros are not an integer "
                    f"zero point times the scale (compressed-tensors stores w = (q - zero_point) * scale with an "
                    f"integer zero_point in [-8, 7]; qops' asymmetric RTN puts zeros between grid points). "
                    f"Save a symmetric W4A16 model (weight_zeros=False), or one loaded from a compressed-tensors "
                    f"checkpoint"
                )
            t["weight_zero_point"] = pack_to_int32(zp.to(torch.int8).contiguous(), 4, packed_dim=0)
        if set(t) != set(names):
            raise RuntimeError(
                f"qops.llama.save_compressed: {name}: wrote {sorted(t)}, compressed-tensors expects {sorted(names)}"
            )
        res.append(t)
    return res


def _w4a16_scheme(group_size: int, zeros: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=not zeros, strategy="group", group_size=group_size, dynamic=False
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


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
