"""What a new user found broken loading checkpoints (issue 43), one test each: quantized
(compressed-tensors) checkpoints, model features the qops layers do not implement, the GGUF loader
and tokenizer cache, and calibration tokens that the config does not use. Each failed before the
fix. CPU only."""

from __future__ import annotations

import re
from pathlib import Path

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


# ---- 3. the GGUF loader and the tokenizer cache --------------------------------------------------
class _Field:
    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value


class _Tensor:
    def __init__(self, name: str, shape_out_in: tuple[int, ...]) -> None:
        import numpy as np
        from gguf import GGMLQuantizationType

        self.name = name
        self.shape = np.array(list(reversed(shape_out_in)))  # GGUF order: ne0 (the inner dim) first
        g = np.random.default_rng(len(name))
        self.data = g.standard_normal(shape_out_in).astype(np.float32)
        self.tensor_type = GGMLQuantizationType.F32


class _Reader:
    """A tiny llama GGUF as ``gguf.GGUFReader`` shows it (fields with ``contents()``, tensors)."""

    def __init__(self, extra_fields: dict | None = None, extra_tensors=(), drop=()) -> None:
        h, i, v, heads = 64, 128, 96, 2
        fields = {
            "llama.embedding_length": h,
            "llama.attention.head_count": heads,
            "llama.attention.head_count_kv": 1,
            "llama.feed_forward_length": i,
            "llama.block_count": 1,
            "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.rope.freq_base": 10000.0,
            "llama.rope.dimension_count": h // heads,
            "llama.context_length": 256,
            "llama.vocab_size": v,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
        }
        fields.update(extra_fields or {})
        self.fields = {k: _Field(x) for k, x in fields.items() if k not in drop}
        d = h // heads
        shapes = {
            "token_embd.weight": (v, h),
            "output_norm.weight": (h,),
            "blk.0.attn_q.weight": (heads * d, h),
            "blk.0.attn_k.weight": (d, h),
            "blk.0.attn_v.weight": (d, h),
            "blk.0.attn_output.weight": (h, heads * d),
            "blk.0.ffn_gate.weight": (i, h),
            "blk.0.ffn_up.weight": (i, h),
            "blk.0.ffn_down.weight": (h, i),
            "blk.0.attn_norm.weight": (h,),
            "blk.0.ffn_norm.weight": (h,),
            **dict(extra_tensors),
        }
        self.tensors = [_Tensor(n, s) for n, s in shapes.items() if n not in drop]


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py): rotate-half pairs interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, hf, extra_tensors=(), extra_fields=None):
    """A real llama GGUF (F32 tensors) of a transformers ``LlamaForCausalLM``, written the way
    llama.cpp's converter does (GGUF names, q/k permuted, untied output)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for k, v in (extra_fields or {}).items():
        w.add_key_value(k, v[0], v[1])
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    kinds = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for k, t in sd.items():
        if k in names:
            w.add_tensor(names[k], t)
            continue
        _, _, i, *rest = k.split(".")
        kind = kinds[".".join(rest[:-1])]
        if kind == "attn_q":
            t = _llama_cpp_permute(torch.from_numpy(t), cfg.num_attention_heads).numpy()
        elif kind == "attn_k":
            t = _llama_cpp_permute(torch.from_numpy(t), cfg.num_key_value_heads).numpy()
        w.add_tensor(f"blk.{i}.{kind}.weight", t)
    for name, t in extra_tensors:
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_gguf_loads_through_transformers(tmp_path):
    """A real GGUF written as llama.cpp writes it comes back as the model it was written from
    (transformers' GGUF loading: dequantization, q/k unpermutation, names, config)."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from qops.llama import smollm2

    hf = _tiny_hf_llama()
    write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    m = smollm2.load_model(path=tmp_path / "tiny.gguf", progress=False)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.num_key_value_heads == 2
    ref = hf.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref[k]), k
    ids = torch.randint(0, 96, (1, 12))
    torch.testing.assert_close(m(ids).logits, hf(ids).logits, rtol=0, atol=1e-5)


def test_gguf_loader_refuses_what_transformers_would_drop(tmp_path):
    """transformers loads a llama GGUF with a rope_freqs tensor or RoPE scaling metadata without a
    word, into a model that differs from the file's; qops refuses it."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import gguf

    from qops.llama import smollm2

    hf = _tiny_hf_llama()
    write_tiny_gguf(tmp_path / "f.gguf", hf, extra_tensors=[("rope_freqs.weight", torch.ones(8).numpy())])
    with pytest.raises(smollm2.UnsupportedGGUF, match="does not map.*rope_freqs.weight"):
        smollm2.load_model(path=tmp_path / "f.gguf", progress=False)
    scaling = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
               "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}  # fmt: skip
    write_tiny_gguf(tmp_path / "s.gguf", hf, extra_fields=scaling)
    with pytest.raises(smollm2.UnsupportedGGUF, match="RoPE scaling"):
        smollm2.load_model(path=tmp_path / "s.gguf", progress=False)


@pytest.mark.parametrize("tensor", ["rope_freqs.weight", "blk.0.attn_q.bias", "blk.0.attn_q_norm.weight"])
def test_gguf_check_refuses_unmapped_tensors(tensor):
    from qops.llama.smollm2 import UnsupportedGGUF, check_gguf

    check_gguf(_Reader())
    with pytest.raises(UnsupportedGGUF, match="does not map.*" + re.escape(tensor)):
        check_gguf(_Reader(extra_tensors={tensor: (16,)}))


@pytest.mark.parametrize(
    "fields",
    [
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
        {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.original_context_length": 128},
        {"llama.rope.dimension_count": 16},
    ],
)
def test_gguf_check_refuses_rope_scaling_metadata(fields):
    from qops.llama.smollm2 import UnsupportedGGUF, check_gguf

    with pytest.raises(UnsupportedGGUF, match="RoPE scaling|rope.dimension_count"):
        check_gguf(_Reader(extra_fields=fields))


def test_gguf_check_ignores_neutral_rope_scaling():
    from qops.llama.smollm2 import check_gguf

    check_gguf(_Reader(extra_fields={"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 1.0}))


def test_load_tokenizer_caches_per_gguf(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    from qops import envs
    from qops.llama import smollm2

    conversions = []

    class FakeTok:
        def __init__(self, source: str) -> None:
            self.source = source

        def save_pretrained(self, d: str) -> None:
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "tokenizer.json").write_text(self.source)

    def from_pretrained(d, gguf_file=None):
        if gguf_file is not None:
            conversions.append(gguf_file)
            return FakeTok(gguf_file)
        return FakeTok((Path(d) / "tokenizer.json").read_text())

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"a")
    b.write_bytes(b"bb")
    monkeypatch.setattr(envs, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(smollm2, "data_dir", lambda: None)
    monkeypatch.setattr(smollm2, "gguf_path", lambda fetch=True: a)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert smollm2.load_tokenizer(path=a).source == "a.gguf"
    assert smollm2.load_tokenizer(path=b).source == "b.gguf"  # was: a's cached tokenizer
    assert smollm2.load_tokenizer(path=b).source == "b.gguf"
    assert smollm2.load_tokenizer().source == "a.gguf"  # the default GGUF shares a's cache
    assert conversions == ["a.gguf", "b.gguf"]
    assert smollm2.tokenizer_cache_dir(b) != smollm2.tokenizer_cache_dir(a) == smollm2.tokenizer_cache_dir()
