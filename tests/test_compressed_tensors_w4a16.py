"""compressed-tensors W4A16 (``pack-quantized``) checkpoints in and out of qops.llama (issue 43):
checkpoints written by compressed-tensors itself (apply_quantization_config, ModelCompressor) from
a tiny random Llama, symmetric and with zero points, groups of 64 and 128, load into the qops
W4A16 model with the int4 values as they are; their dequantized weights match compressed-tensors'
own decompression (bit-exactly without zeros; within the documented roundings with them);
save_compressed writes checkpoints that load back bit-exactly and that compressed-tensors and
transformers read; unsupported schemes raise. CPU only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from qops.llama import W4A16Linear, load_compressed, quantize, save_compressed  # noqa: E402
from qops.llama.compressed import FUSED, _w4a16_scheme  # noqa: E402
from qops.w4a16 import unpack_int4  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64, 8], [3, 3, 100, 12, 0, 45, 6, 90, 11]])


def _tiny_hf(seed: int = 0, dtype: torch.dtype = torch.float16):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def _write_checkpoint(path: Path, group_size: int, zeros: bool, dtype: torch.dtype = torch.float16) -> None:
    """A tiny random Llama quantized to int4 and saved by compressed-tensors: min/max scales (and
    integer zero points) per group, as llm-compressor's observer computes them, then
    ModelCompressor.compress_model (pack-quantized), save_pretrained and update_config. ``dtype``:
    the model's (its ``torch_dtype``) and the scales' (float32: scales that float16 rounds)."""
    from compressed_tensors.compressors.model_compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = _tiny_hf(dtype=dtype)
    qc = QuantizationConfig(
        config_groups={"group_0": _w4a16_scheme(group_size, zeros)}, format="pack-quantized", ignore=["lm_head"]
    )
    apply_quantization_config(model, qc, show_progress=False)
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.detach().float()
            g = w.reshape(w.shape[0], -1, group_size)
            if zeros:
                lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
                scale = ((hi - lo) / 15).to(dtype)
                zp = (-8 - lo / scale.float()).round().clamp(-8, 7)
                mod.weight_zero_point.data.copy_(zp.to(torch.int8))
            else:
                scale = (g.abs().amax(-1) / 7.5).to(dtype)
            mod.weight_scale.data.copy_(scale)
    comp = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    comp.compress_model(model)
    model.save_pretrained(str(path))
    comp.update_config(str(path))


@pytest.fixture(scope="module", params=[(128, False), (64, True), (128, True)], ids=["g128", "g64-asym", "g128-asym"])
def checkpoint(request, tmp_path_factory):
    g, z = request.param
    path = tmp_path_factory.mktemp(f"ct_w4_g{g}_{'asym' if z else 'sym'}")
    _write_checkpoint(path, g, z)
    return g, z, path


@pytest.fixture(scope="module")
def sym_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct_w4_sym_only")
    _write_checkpoint(path, 128, False)
    return path


def _decompressed(path: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantized weight of every decoder linear of a pack-quantized
    checkpoint (its pack-quantized compressor's ``decompress``, in the scale's dtype)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    comp = BaseCompressor.get_value_from_registry(qc.format)
    raw = load_file(str(path / "model.safetensors"))
    out = {}
    for k in raw:
        if k.endswith(".weight_packed"):
            name = k[: -len(".weight_packed")]
            state = {key: raw[f"{name}.{key}"] for key in comp.compression_param_names(scheme)}
            out[name] = comp.decompress(state, scheme)["weight"]
    return out


def _fused(weights: dict[str, torch.Tensor], i: int, fused: str) -> torch.Tensor:
    return torch.cat([weights[f"model.layers.{i}.{n}"] for n in FUSED[fused]])


def test_load_pack_quantized(checkpoint):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    g, zeros, path = checkpoint
    model = load_compressed(path)
    assert model.qcfg.w4a16 and model.qcfg.group_size == g and model.qcfg.weight_zeros == zeros
    assert model.qcfg.kv_cache == "int8" and model.dtype == torch.float16
    raw = load_file(str(path / "model.safetensors"))
    ref = _decompressed(path)
    for i, layer in enumerate(model.layers):
        for fused, names in FUSED.items():
            lin = layer.get_submodule(fused)
            assert isinstance(lin, W4A16Linear) and lin.group_size == g
            assert (lin.weight_zero is not None) == zeros
            # the int4 values are the checkpoint's, as they are (compressed-tensors' own unpacking)
            qs = [
                unpack_from_int32(
                    raw[f"model.layers.{i}.{n}.weight_packed"], 4, raw[f"model.layers.{i}.{n}.weight_shape"]
                )
                for n in names
            ]
            assert torch.equal(unpack_int4(lin.weight), torch.cat(qs))
            scales = torch.cat([raw[f"model.layers.{i}.{n}.weight_scale"] for n in names])
            assert torch.equal(lin.weight_scale, scales)
            got, want = lin.dequantized_weight(), _fused(ref, i, fused).float()
            if not zeros:  # q * s rounded once in fp16 in both
                assert torch.equal(got, want)
            else:
                # qops: fp16(fp16(q * s) + fp16(-zp * s)); compressed-tensors: fp16((q - zp) * s):
                # up to three fp16 roundings against one, each at most half an ulp of its result
                s = lin.weight_scale.float().repeat_interleave(g, 1)
                bound = 2.0**-10 * (2 * want.abs() + 8 * s) + 1e-7
                assert bool(((got - want).abs() <= bound).all())
                # the zeros are the checkpoint's integer zero points (its raw tensors, unpacked by
                # compressed-tensors) times the scale in the model dtype, rounded once
                zps = [
                    unpack_from_int32(
                        raw[f"model.layers.{i}.{n}.weight_zero_point"],
                        4,
                        raw[f"model.layers.{i}.{n}.weight_scale"].shape,
                        packed_dim=0,
                    )
                    for n in names
                ]
                zp = torch.cat(zps)
                assert zp.dtype == torch.int8 and int(zp.min()) >= -8 and int(zp.max()) <= 7
                want_zero = (-zp.float() * scales.to(model.dtype).float()).to(model.dtype)
                assert torch.equal(lin.weight_zero, want_zero)


def _hf_load(path: Path, zeros: bool):
    """transformers' own loading of a pack-quantized checkpoint. With zero points, transformers
    5.24's default (compressed) load builds ``weight_zero_point`` unpacked ``[N, K/G]`` and then
    refuses compressed-tensors' packed ``[N/8, K/G]`` (a size mismatch, for checkpoints that
    compressed-tensors itself wrote): those load with ``dequantize=True`` (decompressed at load)."""
    kw = {}
    if zeros:
        from transformers.utils.quantization_config import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()


def test_load_pack_quantized_matches_transformers(checkpoint):
    _, zeros, path = checkpoint
    model = load_compressed(path, kv_cache="fp16")
    hf = _hf_load(path, zeros)
    with torch.no_grad():
        ref = hf(IDS).logits.float()
    # transformers decompresses the same int4 weights (in fp16) and runs them in float32
    torch.testing.assert_close(model.score(IDS), ref, rtol=0, atol=0.02)


def test_save_pack_quantized_round_trip(checkpoint, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    g, zeros, path = checkpoint
    model = load_compressed(path, kv_cache="fp16")
    (path / "tokenizer_config.json").write_text("{}")  # copied along from hf_source
    save_compressed(model, tmp_path / "out", hf_source=path)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert (tmp_path / "out" / "generation_config.json").is_file()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    w = qc.config_groups["group_0"].weights
    assert qc.format == "pack-quantized" and w.num_bits == 4 and w.group_size == g and w.symmetric == (not zeros)
    assert qc.config_groups["group_0"].input_activations is None
    again = load_compressed(tmp_path / "out", kv_cache="fp16")
    for a, b in zip(model.state_dict().items(), again.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    assert torch.equal(model.score(IDS), again.score(IDS))
    # what compressed-tensors decompresses from the saved checkpoint is what it did from the original
    ref, out = _decompressed(path), _decompressed(tmp_path / "out")
    assert ref.keys() == out.keys() and all(torch.equal(ref[k], out[k]) for k in ref)


def test_save_float32_scales_loaded_as_fp16(tmp_path):
    """An asymmetric checkpoint with float32 scales (torch_dtype float32) loads as float16 (the
    scales rounded to float16, the zeros computed from those), saves, and loads back bit-exactly."""
    from safetensors.torch import load_file

    path = tmp_path / "ckpt_f32"
    _write_checkpoint(path, 64, True, dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "float32"
    raw = load_file(str(path / "model.safetensors"))
    s32 = raw["model.layers.0.self_attn.q_proj.weight_scale"]
    assert s32.dtype == torch.float32 and not torch.equal(s32.half().float(), s32)  # float16 rounds them
    model = load_compressed(path, dtype=torch.float16, kv_cache="fp16")
    assert model.dtype == torch.float16
    save_compressed(model, tmp_path / "out")
    again = load_compressed(tmp_path / "out", kv_cache="fp16")
    assert again.dtype == torch.float16
    for a, b in zip(model.state_dict().items(), again.state_dict().items()):
        assert a[0] == b[0] and a[1].dtype == b[1].dtype and torch.equal(a[1], b[1]), a[0]
    assert torch.equal(model.score(IDS), again.score(IDS))
    # the saved integer zero points are the original checkpoint's
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k in raw:
        if k.endswith((".weight_zero_point", ".weight_packed")):
            assert torch.equal(raw[k], out[k]), k


def test_save_qops_quantized_w4a16(tmp_path):
    """A model quantized by qops (symmetric RTN) saves as pack-quantized: compressed-tensors
    decompresses exactly qops' dequantized weights, transformers loads it and agrees."""
    hf = _tiny_hf(seed=1, dtype=torch.float32)
    model = quantize(hf, weights="int4", group_size=64, kv_cache="fp16", dtype=torch.float16, progress=False)
    tok_src = tmp_path / "src"
    tok_src.mkdir()
    (tok_src / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 7}))
    save_compressed(model, tmp_path / "out", hf_source=tok_src)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["max_new_tokens"] == 7
    ref = _decompressed(tmp_path / "out")
    for i, layer in enumerate(model.layers):
        for fused in FUSED:
            assert torch.equal(layer.get_submodule(fused).dequantized_weight(), _fused(ref, i, fused).float())
    again = load_compressed(tmp_path / "out", kv_cache="fp16")
    assert torch.equal(model.score(IDS), again.score(IDS))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = loaded(IDS).logits.float()
    torch.testing.assert_close(model.score(IDS), logits, rtol=0, atol=0.02)


def test_save_refuses_qops_asymmetric_zeros(tmp_path):
    hf = _tiny_hf(seed=2, dtype=torch.float32)
    model = quantize(hf, weights="int4", group_size=64, weight_zeros=True, kv_cache="fp16", progress=False)
    with pytest.raises(ValueError, match="not an integer zero point times the scale"):
        save_compressed(model, tmp_path / "out")


def test_save_refuses_float_model(tmp_path):
    hf = _tiny_hf(seed=3, dtype=torch.float32)
    model = quantize(hf, weights=False, kv_cache="fp16", progress=False)
    with pytest.raises(ValueError, match="only W8A8 and W4A16"):
        save_compressed(model, tmp_path / "out")


def _edit(src: Path, dst: Path, activations=None, **weights) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for grp in cfg["quantization_config"]["config_groups"].values():
        grp["weights"].update(weights)
        if activations is not None:
            grp["input_activations"] = activations
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(group_size=32), "group_size 32"),
        (dict(strategy="channel", group_size=None), "strategy 'channel'"),
        (dict(num_bits=8), "int8 in format 'pack-quantized'"),
        (dict(actorder="group"), "actorder='group' has been removed"),  # refused by compressed-tensors itself
        (
            dict(activations=dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
            "quantizes activations",
        ),
    ],
)
def test_unsupported_pack_quantized_raises(sym_path, tmp_path, change, match):
    bad = _edit(sym_path, tmp_path / "bad", **change)
    with pytest.raises(ValueError, match="unsupported compressed-tensors checkpoint") as e:
        load_compressed(bad)
    assert match in str(e.value)
