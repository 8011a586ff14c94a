"""What a new user found broken loading checkpoints (issue 43), one test each: quantized
(compressed-tensors) checkpoints, model features the qops layers do not implement, the GGUF loader
and tokenizer cache, and calibration tokens that the config does not use. Each failed before the
fix. CPU only."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.llama import QuantConfig
from qops.llama.config import LlamaArgs
from qops.llama.quantize import calibrate, quantize_state_dict
from qops.testing import random_llama_state_dict

ARGS = LlamaArgs(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    max_position_embeddings=256,
)


def _hf(**overrides):
    """A tiny random ``LlamaForCausalLM`` (float32) with ``LlamaConfig`` fields overridden."""
    transformers = pytest.importorskip("transformers")
    kw = dict(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()


FP16 = QuantConfig(weights=False, kv_cache="fp16")


# ---- 1. a quantized (compressed-tensors) checkpoint loaded without its dequantizer --------------
def test_quantize_rejects_int8_linear_weights():
    hf = _hf()
    q = hf.model.layers[1].self_attn.k_proj
    w = q.weight.detach()
    q.weight = torch.nn.Parameter((w / w.abs().max() * 127).round().to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"non-float weights: model\.layers\.1\.self_attn\.k_proj\.weight.*quantized"):
        qops.llama.quantize(hf, progress=False)
    with pytest.raises(ValueError, match="compressed-tensors"):
        qops.llama.quantize(hf, config=FP16, dtype=torch.float32, progress=False)


def test_quantize_state_dict_rejects_int8_weights():
    sd = random_llama_state_dict(ARGS)
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 128, dtype=torch.int8)
    with pytest.raises(ValueError, match="looks already quantized"):
        quantize_state_dict(sd, ARGS, FP16, dtype=torch.float32)


# ---- 2. features the qops layers do not implement ------------------------------------------------
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_quantize_rejects_dynamic_rope(rope):
    hf = _hf(rope_scaling=rope)
    with pytest.raises(NotImplementedError, match=f"rope type '{rope.get('rope_type') or rope['type']}'"):
        qops.llama.quantize(hf, config=FP16, dtype=torch.float32, progress=False)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_static_rope_types_match_hf(rope):
    """The rope types accepted take Hugging Face's fixed inv_freq table: same logits, also past
    the original context (where dynamic RoPE would have rescaled)."""
    hf = _hf(rope_scaling=rope)
    tree = qops.llama.quantize(hf, config=FP16, dtype=torch.float32, progress=False)
    ids = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(tree.score(ids), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"attention_bias": True}, "biases are not supported"),
        ({"mlp_bias": True}, "biases are not supported"),
    ],
)
def test_quantize_rejects_unsupported_features(overrides, match):
    hf = _hf(**overrides)
    with pytest.raises(NotImplementedError, match=match):
        qops.llama.quantize(hf, config=FP16, dtype=torch.float32, progress=False)


def test_quantize_rejects_biases_in_the_weights():
    """A bias the config does not declare (a converted checkpoint) is refused too."""
    hf = _hf()
    hf.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.ones(128))
    with pytest.raises(NotImplementedError, match=r"linear biases.*q_proj\.bias"):
        qops.llama.quantize(hf, config=FP16, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("kv", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [32, 96])
def test_quantized_kv_cache_rejects_head_dims_without_kernels(kv, head_dim):
    hf = _hf(head_dim=head_dim).half()
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        qops.llama.quantize(hf, config=QuantConfig(weights=False, kv_cache=kv), progress=False)


def test_float_cache_takes_other_head_dims_but_rope_needs_them_even():
    a = LlamaArgs(**{**ARGS.to_dict(), "head_dim": 32})
    quantize_state_dict(random_llama_state_dict(a), a, FP16, dtype=torch.float32)  # attention in PyTorch
    a = LlamaArgs(**{**ARGS.to_dict(), "head_dim": 33})
    with pytest.raises(ValueError, match="even head_dim"):
        quantize_state_dict(random_llama_state_dict(a), a, FP16, dtype=torch.float32)


# ---- 4. calibration tokens the config does not use -----------------------------------------------
def test_unused_calibration_tokens_warn_and_name_the_options():
    hf = _hf().half()
    ids = torch.randint(0, 96, (256,), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"calibration_tokens are ignored.*smoothquant=True.*activations='static'"):
        qops.llama.quantize(hf, ids, progress=False)  # the default: W8A8 + KV8, dynamic scales
    sd = random_llama_state_dict(ARGS)
    with pytest.warns(UserWarning, match="kv_scales='static'"):
        quantize_state_dict(sd, ARGS, FP16, calibration_tokens=ids, dtype=torch.float32)
    stats = calibrate(sd, ARGS, ids, seq_len=64, progress=False)
    with pytest.warns(UserWarning, match="precomputed stats"):
        quantize_state_dict(
            sd, ARGS, QuantConfig(smoothquant=True, kv_cache="fp16"), calibration_tokens=ids, stats=stats
        )


def test_used_calibration_tokens_do_not_warn(recwarn):
    hf = _hf().half()
    ids = torch.randint(0, 96, (256,), generator=torch.Generator().manual_seed(0))
    qops.llama.quantize(hf, ids, smoothquant=True, calib_seq_len=64, progress=False)
    qops.llama.quantize(hf, progress=False)
    assert not [w for w in recwarn if "calibration_tokens" in str(w.message)]
