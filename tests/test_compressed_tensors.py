"""compressed-tensors W8A8 checkpoints in and out of qops.llama (issue 43): checkpoints written by
compressed-tensors' own compressor from a tiny random Llama load into the qops W8A8 model with the
int8 weights as they are (dynamic and static activations), save_compressed writes one that
compressed-tensors and transformers read back, and unsupported schemes raise. CPU only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

from qops.llama import QuantConfig, W8A8Linear, load_compressed, save_compressed  # noqa: E402
from qops.llama.compressed import FUSED, _scheme  # noqa: E402
from qops.llama.config import LlamaArgs  # noqa: E402
from qops.llama.model import QuantizedLlamaForCausalLM  # noqa: E402

INPUT_SCALE = 0.03


def _write_checkpoint(path: Path, static: bool) -> tuple[dict, LlamaArgs]:
    """A tiny random Llama quantized and saved by compressed-tensors (apply_quantization_config,
    per-channel absmax scales, ModelCompressor.compress_model, save_pretrained, update_config).
    Returns the dequantized float state dict (Hugging Face names) and the shape."""
    from compressed_tensors.compressors.model_compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.float16).eval()
    qc = QuantizationConfig(config_groups={"group_0": _scheme(static)}, format="int-quantized", ignore=["lm_head"])
    apply_quantization_config(model, qc, show_progress=False)
    for mod in model.modules():
        if hasattr(mod, "weight_scale"):
            amax = mod.weight.detach().float().abs().amax(1, keepdim=True)
            mod.weight_scale.data.copy_((amax / 127).to(mod.weight_scale.dtype))
            if static:
                mod.input_scale.data.fill_(INPUT_SCALE)
    float_sd, expected = {}, {}
    for k, v in model.state_dict().items():
        if k.endswith(".weight") and "_proj" in k:
            mod = model.get_submodule(k[: -len(".weight")])
            scale = mod.weight_scale.detach().float()
            q = torch.round(v / mod.weight_scale).clamp(-128, 127).float()  # as compressed-tensors: in fp16
            expected[k[: -len(".weight")]] = (q.to(torch.int8), scale.reshape(-1))
            float_sd[k] = q * scale  # the int8 weight the checkpoint holds, dequantized
        elif not k.endswith(("_scale", "_zero_point")):
            float_sd[k] = v.detach().clone()
    comp = ModelCompressor.from_pretrained_model(model, "int-quantized")
    comp.compress_model(model)
    model.save_pretrained(str(path))
    comp.update_config(str(path))
    float_sd["expected"] = expected
    return float_sd, LlamaArgs.from_hf(cfg)


@pytest.fixture(scope="module", params=["dynamic", "static"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ct_{request.param}")
    sd, args = _write_checkpoint(path, request.param == "static")
    return request.param, path, sd, args


@pytest.fixture(scope="module")
def dynamic_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct_dynamic_only")
    _write_checkpoint(path, False)
    return path


def _reference(sd: dict, args: LlamaArgs, acts: str) -> QuantizedLlamaForCausalLM:
    """The qops W8A8 model built from the dequantized weights, its linears then given the int8
    weights and scales computed above (what compressed-tensors' compressor writes)."""
    scales = None
    if acts == "static":
        x = float(torch.tensor(INPUT_SCALE, dtype=torch.float16))  # the checkpoint's, in fp16
        scales = {f"layers.{i}.{k}": x for i in range(args.num_layers) for k in ("qkv", "o", "gate_up", "down")}
    qcfg = QuantConfig(weights="int8", activations=acts)
    sd = dict(sd)
    expected = sd.pop("expected")
    model = QuantizedLlamaForCausalLM.from_state_dict(sd, args, qcfg, dtype=torch.float16, input_scales=scales)
    for i, layer in enumerate(model.layers):
        for fused, names in FUSED.items():
            lin = layer.get_submodule(fused)
            lin.weight.copy_(torch.cat([expected[f"model.layers.{i}.{n}"][0] for n in names]))
            lin.weight_scale.copy_(torch.cat([expected[f"model.layers.{i}.{n}"][1] for n in names]))
    return model.eval()


IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64, 8], [3, 3, 100, 12, 0, 45, 6, 90, 11]])


def test_load_compressed_matches_qops_model(checkpoint):
    acts, path, sd, args = checkpoint
    model = load_compressed(path)
    assert model.qcfg.w8a8 and model.qcfg.activations == acts and model.qcfg.kv_cache == "int8"
    assert model.dtype == torch.float16
    ref = _reference(sd, args, acts)
    for lm, lr in zip(model.layers, ref.layers):
        for fused in FUSED:
            a, b = lm.get_submodule(fused), lr.get_submodule(fused)
            assert isinstance(a, W8A8Linear) and a.weight.dtype == torch.int8
            assert torch.equal(a.weight, b.weight)
            assert torch.equal(a.weight_scale, b.weight_scale)
            if acts == "static":
                assert a.input_scale is not None and float(a.input_scale) == pytest.approx(INPUT_SCALE, rel=1e-3)
            else:
                assert a.input_scale is None
    assert torch.equal(model.score(IDS), ref.score(IDS))


def test_load_compressed_weights_are_the_checkpoints_int8(checkpoint):
    from safetensors.torch import load_file

    _, path, sd, _ = checkpoint
    raw = load_file(str(path / "model.safetensors"))
    for name, (q, _) in sd["expected"].items():  # compressed-tensors wrote round(W / scale)
        assert torch.equal(raw[name + ".weight"], q), name
    model = load_compressed(path)
    qkv = model.layers[1].self_attn.qkv_proj
    want = torch.cat([raw[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv.weight, want)


def test_save_compressed_round_trip(checkpoint, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    acts, path, _, _ = checkpoint
    model = load_compressed(path, kv_cache="fp16")
    (path / "tokenizer_config.json").write_text("{}")  # copied along from hf_source
    save_compressed(model, tmp_path / "out", hf_source=path)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    assert qc.format == "int-quantized" and qc.quant_method == "compressed-tensors"
    strategy = str(qc.config_groups["group_0"].input_activations.strategy)
    assert strategy.endswith("tensor" if acts == "static" else "token")
    again = load_compressed(tmp_path / "out", kv_cache="fp16")
    for a, b in zip(model.state_dict().items(), again.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    assert torch.equal(model.score(IDS), again.score(IDS))


def test_save_compressed_loads_in_transformers(checkpoint, tmp_path):
    acts, path, _, _ = checkpoint
    model = load_compressed(path, kv_cache="fp16")
    save_compressed(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(IDS).logits.float()
    # transformers runs the dequantized weights in float32 (with fake-quantized activations)
    torch.testing.assert_close(model.score(IDS), ref, rtol=0, atol=0.05)


def _edit(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    for k, v in changes.items():
        if k == "format":
            qc["format"] = v
            for g in qc["config_groups"].values():
                g["format"] = v
        else:
            side, field = k.split("__")
            for g in qc["config_groups"].values():
                g[side][field] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(weights__strategy="group", weights__group_size=32), "strategy 'group'"),
        (dict(weights__symmetric=False), "weights are asymmetric"),
        (dict(input_activations__symmetric=False), "activations are asymmetric"),
        (dict(format="float-quantized"), "format 'float-quantized'"),
        (dict(weights__type="float"), "weights are float8"),
        # int4 in pack-quantized is W4A16 (tests/test_compressed_tensors_w4a16.py): per-channel W4A8 is not
        (dict(weights__num_bits=4, format="pack-quantized"), "int4 weights use strategy 'channel'"),
        (dict(input_activations__strategy="tensor", input_activations__dynamic=True), "dynamic=True"),
    ],
)
def test_unsupported_scheme_raises(dynamic_path, tmp_path, changes, match):
    bad = _edit(dynamic_path, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match="unsupported compressed-tensors checkpoint") as e:
        load_compressed(bad)
    assert match in str(e.value)


def test_weight_only_and_kv_scheme_raise(dynamic_path, tmp_path):
    bad = tmp_path / "w8a16"
    shutil.copytree(dynamic_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weight-only"):
        load_compressed(bad)
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = dict(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    cfg["quantization_config"]["kv_cache_scheme"] = dict(num_bits=8, type="int", symmetric=True, strategy="tensor")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        load_compressed(bad)


def test_not_compressed_tensors_raises(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="no compressed-tensors quantization_config"):
        load_compressed(tmp_path)


def test_naive_quantized_format_loads(dynamic_path, tmp_path):
    ok = _edit(dynamic_path, tmp_path / "naive", format="naive-quantized")
    assert torch.equal(load_compressed(ok).score(IDS), load_compressed(dynamic_path).score(IDS))


def test_ignored_decoder_linear_raises(dynamic_path, tmp_path):
    bad = tmp_path / "ignored"
    shutil.copytree(dynamic_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj is not quantized"):
        load_compressed(bad)
