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
from qops.llama.quantize import quantize_state_dict
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
