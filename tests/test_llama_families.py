"""qops.llama on the Llama-architecture families beside ``LlamaForCausalLM`` (issue 43): a tiny
random Hugging Face model of each family, its unquantized qops tree against Hugging Face's
logits (fp tolerance), and W8A8+KV8 and W4A16+KV8 against the same logits (quantization
tolerances, as in test_llama and test_llama_w4a16)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qops.llama import QuantConfig, QuantizedLlamaForCausalLM, W4A16Linear, W8A8Linear, quantize
from qops.llama.config import LlamaArgs
from qops.testing import compare_logits as compare
from qops.testing import random_llama_state_dict, tiny_family_args

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (llama extra)"
)

FLOAT = QuantConfig(weights=False, kv_cache="fp16")


def tiny_args(model_type: str) -> LlamaArgs:
    return tiny_family_args(model_type)


def hf_model(model_type: str, seed: int = 0, strict: bool = True, **cfg_overrides):
    """A tiny ``{Mistral,Qwen2,Qwen3}ForCausalLM`` (float32) with qops.testing's random weights."""
    import transformers

    name = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    args = tiny_args(model_type)
    kw = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=False,
    )
    kw.update(cfg_overrides)
    cfg = getattr(transformers, name + "Config")(**kw)
    hf = getattr(transformers, name + "ForCausalLM")(cfg).eval()
    hf.load_state_dict(random_llama_state_dict(args, seed), strict=strict)
    return hf


def ids(vocab: int = 320) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))


def check_family(hf, model_type: str) -> None:
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits.float()
    tree = quantize(hf, config=FLOAT, dtype=torch.float32, progress=False)
    assert tree.args.model_type == model_type
    torch.testing.assert_close(tree.score(x), ref, rtol=1e-4, atol=1e-4)
    # a decode step after a prefill gives the last position's logits
    cache = tree.cache_for([x.shape[1]] * 2)
    tree.step(x[:, :-1], [0, 1], cache)
    torch.testing.assert_close(tree.step(x[:, -1:], [0, 1], cache), ref[:, -1], rtol=1e-4, atol=1e-4)
    # W8A8+KV8 (float16): close to Hugging Face's float32 logits (test_llama's W8A8+KV8 tolerance)
    q = quantize(hf, progress=False)
    assert q.qcfg.label() == "W8A8+KV8" and isinstance(q.layers[0].self_attn.qkv_proj, W8A8Linear)
    m = compare(q.score(x), ref)
    assert m["rel"] < 0.055 and m["kl"] < 0.014 and m["top1"] >= 0.88, m


def check_save_load(hf, tmp_path) -> None:
    x = ids()
    q = quantize(hf, progress=False)
    q.save(tmp_path / "m")
    q2 = QuantizedLlamaForCausalLM.load(tmp_path / "m")
    assert q2.args == q.args
    torch.testing.assert_close(q2.score(x), q.score(x), rtol=0, atol=0)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
def test_w4a16_families(model_type):
    """``quantize(hf, weights="int4")``: W4A16 (groups of 128, RTN) of each family is Hugging
    Face's model with int4-round-tripped linear weights (up to float16), and W4A16+KV8 lies within
    a quantization tolerance of Hugging Face's float32 logits (measured over 4 seeds, with margin:
    RTN int4 on random weights moves these tiny models' logits by ~25-35%, test_llama_w4a16)."""
    from qops.w4a16 import dequantize_weight_int4, quantize_weight_int4

    hf = hf_model(model_type)
    x = ids()
    with torch.no_grad():
        ref = hf(x).logits.float()
    q = quantize(hf, weights="int4", progress=False)
    assert q.qcfg.label() == "W4A16+KV8"
    qkv = q.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, W4A16Linear) and qkv.weight.dtype == torch.uint8
    assert (qkv.bias is not None) == (model_type == "qwen2")
    m = compare(q.score(x), ref)
    assert m["rel"] < 0.37 and m["kl"] < 0.75 and m["top1"] >= 0.40, m
    # exactness: the same model as Hugging Face's on the weights the int4 GEMM multiplies by
    q16 = quantize(hf, weights="int4", kv_cache="fp16", progress=False)
    sd = {}
    for k, w in hf.state_dict().items():
        if k.endswith("_proj.weight"):
            packed, s, z = quantize_weight_int4(w, 128, dtype=torch.float16)
            w = dequantize_weight_int4(packed, s, z, 128).float()
        sd[k] = w
    hf.load_state_dict(sd)
    with torch.no_grad():
        ref4 = hf(x).logits.float()
    m = compare(q16.score(x), ref4)
    assert m["rel"] < 4e-3 and m["top1"] >= 0.97, m


# ---- Mistral ------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 256, 4096])
def test_mistral_matches_hf(window):
    """A sliding window of None, or at least max_position_embeddings, is full attention."""
    check_family(hf_model("mistral", sliding_window=window), "mistral")


@pytest.mark.parametrize("window", [16, 255])
def test_mistral_sliding_window_is_refused(window):
    hf = hf_model("mistral", sliding_window=window)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        quantize(hf, config=FLOAT, dtype=torch.float32, progress=False)


# ---- Qwen2: q/k/v biases ------------------------------------------------------------------------
def test_qwen2_matches_hf():
    hf = hf_model("qwen2")
    check_family(hf, "qwen2")
    q = quantize(hf, progress=False)
    qkv = q.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and qkv.bias.shape == (q.args.qkv_size,) and qkv.bias.dtype == torch.float16
    assert q.layers[0].self_attn.o_proj.bias is None and q.layers[0].mlp.down_proj.bias is None


def test_qwen2_save_load(tmp_path):
    check_save_load(hf_model("qwen2"), tmp_path)


def test_qwen2_smoothing_keeps_the_float_model():
    """SmoothQuant's o target divides v_proj's rows by s: its bias too."""
    from qops.llama.quantize import apply_smoothing, calibrate, hf_parts

    sd, args, inv_freq, scaling = hf_parts(hf_model("qwen2"))
    calib = torch.randint(0, args.vocab_size, (128,), generator=torch.Generator().manual_seed(2))
    stats = calibrate(sd, args, calib, seq_len=64, inv_freq=inv_freq, progress=False)
    smoothed, _ = apply_smoothing(sd, args, stats, 0.5, ("qkv", "gate_up", "down", "o"))
    assert not torch.equal(smoothed["model.layers.0.self_attn.v_proj.bias"], sd["model.layers.0.self_attn.v_proj.bias"])
    x = ids()
    trees = [
        QuantizedLlamaForCausalLM.from_state_dict(s, args, FLOAT, dtype=torch.float32, inv_freq=inv_freq)
        for s in (sd, smoothed)
    ]
    torch.testing.assert_close(trees[1].score(x), trees[0].score(x), rtol=1e-4, atol=1e-4)
    q = quantize(hf_model("qwen2"), calib, smoothquant=True, smooth_targets=("qkv", "gate_up", "down", "o"),
                 calib_seq_len=64, progress=False)  # fmt: skip
    assert compare(q.score(x), trees[0].score(x))["rel"] < 0.055


def test_qwen2_sliding_window_and_stray_biases_are_refused():
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        quantize(hf, config=FLOAT, dtype=torch.float32, progress=False)
    # a window switched off (or on layers past the model's) is full attention
    quantize(hf_model("qwen2", use_sliding_window=False, sliding_window=16), config=FLOAT, progress=False)
    # only q/k/v carry biases in Qwen2: another one is refused
    hf = hf_model("qwen2")
    hf.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(hf.config.hidden_size))
    with pytest.raises(NotImplementedError, match="biases are not supported"):
        quantize(hf, config=FLOAT, dtype=torch.float32, progress=False)


# ---- Qwen3: RMSNorm of q and k per head ---------------------------------------------------------
def test_qwen3_matches_hf():
    hf = hf_model("qwen3")
    check_family(hf, "qwen3")
    attn = quantize(hf, progress=False).layers[1].self_attn
    assert attn.q_norm is not None and attn.q_norm.shape == (64,) and attn.q_norm.dtype == torch.float16
    torch.testing.assert_close(attn.k_norm.float(), hf.model.layers[1].self_attn.k_norm.weight.half().float())


def test_qwen3_save_load(tmp_path):
    check_save_load(hf_model("qwen3"), tmp_path)


def test_qwen3_with_attention_bias_is_refused():
    """Qwen3's attention_bias puts a bias on o_proj too, which the qops linears do not carry."""
    with pytest.raises(NotImplementedError, match="biases are not supported"):
        quantize(hf_model("qwen3", strict=False, attention_bias=True), config=FLOAT, progress=False)
