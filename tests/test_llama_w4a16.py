"""qops.llama with W4A16 linears (``QuantConfig(weights="int4")``): int4 weights (RTN, a scale
and optionally a zero per group of 64 or 128 input channels, ``qops.w4a16_gemm``) and float16
activations, on tiny random models through the CPU reference ops.

Two kinds of checks: exactness (the W4A16 model is the float model whose linear weights are
replaced by their int4 round trip, ``dequantize_weight_int4(quantize_weight_int4(w))``, up to
float16 rounding), and quantization tolerances against the float32 model (relative L2 error of
the logits, next-token KL divergence, top-1 agreement), measured on these models with margin.

RTN int4 on these random Gaussian weights is a ~10% relative error per weight (W8A8's is ~0.5%),
and the tiny models have sharp output distributions: the logits move by ~20-30% and top-1
agreement is ~55-70% (test_llama's W8A8: 4%, ~95%). The tolerances pin that level, the ordering
(zeros and groups of 64 help) and everything the exactness check cannot see (KV caches, decode).
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.llama import QuantConfig, QuantizedLlamaForCausalLM, generate
from qops.llama.config import LlamaArgs
from qops.llama.layers import QAct, RMSNorm, W4A16Linear
from qops.llama.quantize import check_supported, quantize_state_dict
from qops.testing import compare_logits as compare
from qops.testing import random_llama_state_dict, tiny_family_args, tiny_llama_args
from qops.w4a16 import dequantize_weight_int4, quantize_weight_int4

# test_llama's TINY (hidden 192, intermediate 320: K fits groups of 64 only) and a shape whose
# every K is a multiple of 128 (groups of 128 and 64)
TINY = tiny_llama_args()
TINY128 = LlamaArgs(
    vocab_size=384,
    hidden_size=256,
    intermediate_size=384,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)
FLOAT = QuantConfig(weights=False, kv_cache="fp16")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def family(model_type: str) -> LlamaArgs:
    """test_llama_families' tiny shape of a family (K = 128 or 256: both group sizes fit)."""
    return tiny_family_args(model_type)


def build(sd, args: LlamaArgs, qcfg: QuantConfig, dtype=torch.float16, **kw) -> QuantizedLlamaForCausalLM:
    return QuantizedLlamaForCausalLM.from_state_dict(sd, args, qcfg, dtype=dtype, **kw).eval()


def int4_round_trip(sd: dict, group_size: int, zeros: bool, dtype=torch.float16) -> dict:
    """``sd`` with every linear weight replaced by the weight the W4A16 GEMM multiplies by."""
    out = dict(sd)
    for k, w in sd.items():
        if k.endswith("_proj.weight"):
            packed, s, z = quantize_weight_int4(w, group_size, zeros, dtype=dtype)
            out[k] = dequantize_weight_int4(packed, s, z, group_size).float()
    return out


_MODELS: dict = {}


def model_data(args: LlamaArgs):
    """``(state_dict, ids [3, 48], float32 reference logits)`` of a tiny random model, cached."""
    key = (args.hidden_size, args.intermediate_size, args.model_type)
    if key not in _MODELS:
        sd = random_llama_state_dict(args, 0)
        ids = torch.randint(0, args.vocab_size, (3, 48), generator=torch.Generator().manual_seed(1))
        _MODELS[key] = sd, ids, build(sd, args, FLOAT, dtype=torch.float32).score(ids)
    return _MODELS[key]


# ---- the config ---------------------------------------------------------------------------------
def test_quant_config_w4a16_labels():
    for label, fields in [
        ("W4A16", dict(weights="int4", group_size=128, weight_zeros=False, kv_cache="fp16")),
        ("W4A16+KV8", dict(weights="int4", kv_cache="int8")),
        ("W4A16-g64", dict(group_size=64)),
        ("W4A16-asym", dict(group_size=128, weight_zeros=True)),
        ("W4A16-g64-asym+KV4", dict(group_size=64, weight_zeros=True, kv_cache="int4")),
        ("W4A16+KV4-w128s4", dict(kv_cache="int4", kv_window=128, kv_sinks=4)),
        ("W4A16-g64+KV8-static", dict(kv_scales="static")),
    ]:
        cfg = QuantConfig.from_label(label)
        assert cfg.label() == label and QuantConfig.from_dict(cfg.to_dict()) == cfg
        assert cfg.w4a16 and not cfg.w8a8 and cfg.needs_calibration == label.endswith("static")
        assert all(getattr(cfg, k) == v for k, v in fields.items()), (label, cfg)
    assert QuantConfig.from_label("W4A16-g128").label() == "W4A16"
    assert QuantConfig(weights="int4", kv_cache="int8").label() == "W4A16+KV8"
    # weights=True is W8A8, as before; "int8" is its synonym (stored as True)
    assert QuantConfig() == QuantConfig(weights=True) == QuantConfig(weights="int8")
    assert QuantConfig(weights="int8").weights is True and QuantConfig(weights="int8").w8a8
    assert QuantConfig(weights=True).label() == "W8A8+KV8" and QuantConfig(weights=False).label() == "KV8"
    old = QuantConfig().to_dict()
    assert old["weights"] is True
    del old["group_size"], old["weight_zeros"]  # a config.json written before W4A16
    assert QuantConfig.from_dict(old) == QuantConfig()


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(weights="int4", smoothquant=True), "smoothquant=True applies to W8A8"),
        (dict(weights="int4", activations="static"), "activations='static' applies to W8A8"),
        (dict(weights="int4", group_size=32), r"group_size must be one of \(64, 128\)"),
        (dict(weights="int4", group_size=256), r"group_size must be one of \(64, 128\)"),
        (dict(weights="int8", group_size=64), "group_size and weight_zeros apply to weights='int4'"),
        (dict(weights=False, weight_zeros=True), "group_size and weight_zeros apply to weights='int4'"),
        (dict(weights="int3"), "QuantConfig.weights must be False"),
        (dict(weights="W4A16"), "QuantConfig.weights must be False"),
        (dict(weights=1), "QuantConfig.weights must be False"),
    ],
)
def test_quant_config_w4a16_rejects(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        QuantConfig(**kwargs)


@pytest.mark.parametrize(
    "label,msg",
    [
        ("W4A16+SQ0.5", "smoothquant=True applies to W8A8"),
        ("W4A16-g32", "group_size must be one of"),
        ("W4A16-zp", "unknown W4A16 option 'zp'"),
        ("W4A16-static", "unknown W4A16 option 'static'"),
        ("W4A8", "unknown variant part 'W4A8'"),
    ],
)
def test_quant_config_w4a16_bad_labels(label, msg):
    with pytest.raises(ValueError, match=msg):
        QuantConfig.from_label(label)


# ---- the linear ---------------------------------------------------------------------------------
@pytest.mark.parametrize("zeros", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_linear(group_size, zeros, dtype):
    g = torch.Generator().manual_seed(0)
    n, k = 48, 256
    w = torch.randn(n, k, generator=g) / 16
    b = torch.randn(n, generator=g)
    x = torch.randn(9, k, generator=g).to(dtype)
    lin = W4A16Linear.from_float(w, b, group_size=group_size, zeros=zeros, out_dtype=dtype)
    # buffers: the prepacked uint8 weight (CPU: the reference layout), N-major scales / zeros
    assert lin.weight.dtype == torch.uint8 and lin.weight.shape == (n, k // 2) and lin.packed_for == "cpu"
    for t in (lin.weight_scale, lin.weight_zero) if zeros else (lin.weight_scale,):
        assert t is not None and t.dtype == dtype and t.shape == (n, k // group_size) and t.stride() == (1, n)
    assert (lin.weight_zero is None) == (not zeros) and lin.input_scale is None
    packed, scales, zero = quantize_weight_int4(w, group_size, zeros, dtype=dtype)
    assert torch.equal(lin.weight, packed) and torch.equal(lin.weight_scale, scales)
    # forward: the GEMM with the dequantized weight, then the bias (in the model dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (9, n)
    w_q = lin.dequantized_weight()
    expect = ((x.float() @ w_q.T).to(dtype) + b.to(dtype)).float()
    torch.testing.assert_close(y.float(), expect, rtol=0, atol=0)
    # against the float weight: within RTN's error (half a step per element)
    err = (w_q - w).abs().reshape(n, -1, group_size)
    assert bool((err <= scales.float()[:, :, None] / 2 * 1.01 + 1e-3).all())
    ref = x.float() @ w.T + b
    assert float((y.float() - ref).norm() / ref.norm()) < 0.15
    with pytest.raises(TypeError, match="int8 QAct"):
        lin(QAct(torch.zeros(9, k, dtype=torch.int8), torch.ones(9)))
    # a non-contiguous activation (rows of a wider tensor) is fine
    xs = torch.cat([x, x], 1)[:, :k]
    assert xs.stride(-1) == 1 and not xs.is_contiguous()
    torch.testing.assert_close(lin(xs), y, rtol=0, atol=0)


@pytest.mark.parametrize(
    "n,k,g,msg",
    [
        (40, 256, 128, r"N = 40 \(output features\) is not a multiple of 16"),
        (48, 192, 128, r"K = 192 \(input features\) is not a multiple of group_size 128"),
        (40, 96, 64, "N = 40 .* and K = 96"),
    ],
)
def test_w4a16_linear_shape_errors(n, k, g, msg):
    with pytest.raises(ValueError, match=rf"W4A16 cannot quantize layer.x.proj \[N={n}, K={k}\]: {msg}"):
        W4A16Linear.from_float(torch.randn(n, k), group_size=g, name="layer.x.proj")


# ---- the model ----------------------------------------------------------------------------------
def test_w4a16_model_structure():
    """Every linear is a W4A16Linear holding uint8 packed weights and N-major scales; the norms
    emit float (no activation quantization); the MLP's activation is plain SiLU-and-mul."""
    sd, ids, _ = model_data(TINY)
    model = build(sd, TINY, QuantConfig.from_label("W4A16-g64+KV8"))
    a = TINY
    shapes = {
        "self_attn.qkv_proj": (a.qkv_size, a.hidden_size),
        "self_attn.o_proj": (a.hidden_size, a.num_heads * a.head_dim),
        "mlp.gate_up_proj": (2 * a.intermediate_size, a.hidden_size),
        "mlp.down_proj": (a.hidden_size, a.intermediate_size),
    }
    for layer in model.layers:
        for name, (n, k) in shapes.items():
            lin = layer.get_submodule(name)
            assert isinstance(lin, W4A16Linear) and lin.group_size == 64
            assert lin.weight.dtype == torch.uint8 and lin.weight.shape == (n, k // 2)
            assert lin.weight_scale.dtype == torch.float16 and lin.weight_scale.shape == (n, k // 64)
            assert lin.weight_scale.stride() == (1, n) and lin.weight_zero is None and lin.bias is None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            assert isinstance(norm, RMSNorm) and not norm.quantize
    # int4 weights: a quarter of the float16 bytes, plus one fp16 scale per 64 weights
    n_lin = sum(n * k for n, k in shapes.values()) * a.num_layers
    lin_bytes = sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, W4A16Linear)
                    for t in m.buffers())  # fmt: skip
    assert lin_bytes == n_lin // 2 + n_lin // 64 * 2
    assert "int4 groups of 64" in repr(model.layers[0].mlp.down_proj)


@pytest.mark.parametrize(
    "args,label",
    [
        (TINY, "W4A16-g64"),
        (TINY, "W4A16-g64-asym+KV8"),
        (TINY128, "W4A16"),
        (TINY128, "W4A16-asym"),
        (family("qwen2"), "W4A16"),
        (family("qwen3"), "W4A16-g64-asym"),
    ],
    ids=["llama-g64", "llama-g64-asym-kv8", "llama-g128", "llama-g128-asym", "qwen2-g128", "qwen3-g64-asym"],
)
def test_w4a16_is_the_float_model_with_int4_weights(args, label):
    """Exactness: W4A16 == the float16 tree whose linear weights went through the int4 round
    trip (the bias of Qwen2, the q/k norms of Qwen3 and the KV cache included)."""
    sd, ids, _ = model_data(args)
    cfg = QuantConfig.from_label(label)
    model = build(sd, args, cfg)
    fake_cfg = QuantConfig(weights=False, kv_cache=cfg.kv_cache)
    fake = build(int4_round_trip(sd, cfg.group_size, cfg.weight_zeros), args, fake_cfg)
    m = compare(model.score(ids), fake.score(ids))
    assert m["rel"] < 2e-3 and m["top1"] >= 0.99, m


# (shape, variant, max relative L2 error of the logits, max KL, min top-1 agreement), measured
# max over seeds 0-2 of the random weights: see the module docstring for why these are loose
W4A16_TOLERANCES = [
    (TINY, "W4A16-g64", 0.29, 0.45, 0.50),
    (TINY, "W4A16-g64-asym", 0.25, 0.32, 0.60),
    (TINY, "W4A16-g64+KV8", 0.29, 0.45, 0.50),
    (TINY, "W4A16-g64+KV4", 0.31, 0.55, 0.45),
    (TINY, "W4A16-g64+KV4-w16s4", 0.29, 0.45, 0.50),
    (TINY128, "W4A16", 0.29, 0.45, 0.53),
    (TINY128, "W4A16+KV8", 0.29, 0.45, 0.53),
    (TINY128, "W4A16-asym", 0.25, 0.34, 0.55),
    (TINY128, "W4A16+KV4", 0.31, 0.48, 0.52),
    (family("qwen2"), "W4A16", 0.36, 0.65, 0.45),
    (family("qwen2"), "W4A16+KV8", 0.36, 0.65, 0.45),
    (family("qwen3"), "W4A16+KV8", 0.30, 0.45, 0.50),
]


@pytest.mark.parametrize(
    "args,variant,max_rel,max_kl,min_top1",
    W4A16_TOLERANCES,
    ids=[f"{a.model_type}-{a.hidden_size}-{v}" for a, v, *_ in W4A16_TOLERANCES],
)
def test_w4a16_matches_float(args, variant, max_rel, max_kl, min_top1):
    sd, ids, ref = model_data(args)
    model = quantize_state_dict(sd, args, QuantConfig.from_label(variant))
    assert model.qcfg.label() == variant
    m = compare(model.score(ids), ref)
    assert m["rel"] < max_rel and m["kl"] < max_kl and m["top1"] >= min_top1, m


def test_w4a16_error_ordering():
    """W8A8 < W4A16 with zeros < W4A16 scale-only, and groups of 64 < groups of 128 (relative
    L2 error of the logits; weights of 256 or 384 input channels)."""
    sd, ids, ref = model_data(TINY128)
    errs = {
        v: compare(build(sd, TINY128, QuantConfig.from_label(v)).score(ids), ref)["rel"]
        for v in ("W8A8", "W4A16", "W4A16-asym", "W4A16-g64", "W4A16-g64-asym")
    }
    assert errs["W8A8"] < errs["W4A16-g64-asym"] < errs["W4A16-asym"] < errs["W4A16"], errs
    assert errs["W4A16-g64-asym"] < errs["W4A16-g64"] < errs["W4A16"], errs


def test_qwen2_bias_and_qwen3_norms():
    sd, _, _ = model_data(family("qwen2"))
    qkv = build(sd, family("qwen2"), QuantConfig.from_label("W4A16")).layers[0].self_attn.qkv_proj
    assert isinstance(qkv, W4A16Linear) and qkv.bias is not None
    assert qkv.bias.dtype == torch.float16 and qkv.bias.shape == (family("qwen2").qkv_size,)
    sd, _, _ = model_data(family("qwen3"))
    attn = build(sd, family("qwen3"), QuantConfig.from_label("W4A16")).layers[1].self_attn
    assert attn.q_norm is not None and attn.q_norm.dtype == torch.float16


@pytest.mark.parametrize("variant", ["W4A16-g64+KV8", "W4A16-g64-asym+KV4", "W4A16-g64+KV4-w16s4"])
def test_w4a16_decode_matches_prefill(variant):
    """Teacher-forced decode steps give the logits of a prefill that attends to the cached K/V
    (as test_llama's test_decode_matches_prefill; the linears see the same rows either way)."""
    sd, ids, _ = model_data(TINY)
    model = build(sd, TINY, QuantConfig.from_label(variant))
    full = model.score(ids)
    b, s = ids.shape
    cache = model.cache_for([s] * b)
    n0 = 7
    outs = [model.step(ids[:, :n0], list(range(b)), cache, last_only=False, prefill_from_cache=True).reshape(b, n0, -1)]
    outs += [model.step(ids[:, t : t + 1], list(range(b)), cache)[:, None] for t in range(n0, s)]
    m = compare(torch.cat(outs, 1), full)
    assert m["rel"] < 0.015 and m["top1"] >= 0.95, m


def test_w4a16_generate():
    sd, _, _ = model_data(TINY)
    model = build(sd, TINY, QuantConfig.from_label("W4A16-g64+KV8"))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 9)]
    cache = model.new_cache(64)
    out = generate(model, prompts, 8, cache=cache)
    assert [len(t) for t in out.tokens] == [8] * 3
    assert cache.num_free_blocks == 64 and cache.sequences() == []


# ---- what cannot be built -----------------------------------------------------------------------
def test_w4a16_unsupported_shapes_are_refused():
    sd, _, _ = model_data(TINY)
    # K = 192 and 320 are not multiples of 128: named, with the group size that fits
    with pytest.raises(ValueError, match=r"W4A16 .* group_size \(128\); in every layer, self_attn.qkv_proj "
                       r"\(q/k/v fused\) \[N=640, K=192\], mlp.gate_up_proj .* \[N=640, K=192\], "
                       r"mlp.down_proj \[N=192, K=320\] do not; group_size=64 fits this model"):  # fmt: skip
        quantize_state_dict(sd, TINY, QuantConfig(weights="int4"))
    # building from the state dict directly fails at the first linear, by name
    with pytest.raises(ValueError, match=r"W4A16 cannot quantize model.layers.0.self_attn.qkv_proj"):
        build(sd, TINY, QuantConfig(weights="int4"))
    # N not a multiple of 16 (qkv: (4 + 2) * 8 * 40 = 1920 is, o_proj's K = 4 * 40 = 160 is not a
    # multiple of 64, nor hidden 200 of 16)
    odd = LlamaArgs(vocab_size=64, hidden_size=200, intermediate_size=256, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=40)  # fmt: skip
    with pytest.raises(ValueError, match=r"self_attn.o_proj \[N=200, K=160\].*use weights='int8' or weights=False"):
        check_supported(odd, QuantConfig(weights="int4", group_size=64, kv_cache="fp16"))
    with pytest.raises(TypeError, match="W4A16-g64 models run in float16 or bfloat16"):
        quantize_state_dict(sd, TINY, QuantConfig(weights="int4", group_size=64), dtype=torch.float32)


# ---- save / load, devices ------------------------------------------------------------------------
def test_w4a16_save_load(tmp_path):
    sd, ids, _ = model_data(family("qwen2"))
    model = build(sd, family("qwen2"), QuantConfig.from_label("W4A16-g64-asym+KV8"))
    model.save(tmp_path / "m")
    loaded = QuantizedLlamaForCausalLM.load(tmp_path / "m")
    assert loaded.qcfg == model.qcfg and loaded.qcfg.label() == "W4A16-g64-asym+KV8"
    lin = loaded.layers[1].mlp.down_proj
    assert isinstance(lin, W4A16Linear) and lin.packed_for == "cpu" and lin.weight.dtype == torch.uint8
    assert lin.weight_scale.stride() == (1, lin.out_features) and lin.weight_zero is not None
    assert lin.weight_zero.stride() == (1, lin.out_features)
    torch.testing.assert_close(loaded.score(ids), model.score(ids), rtol=0, atol=0)
    # a weight prepacked for a GPU cannot be saved, nor run on the CPU (no unprepack)
    for m in model.modules():
        if isinstance(m, W4A16Linear):
            m.packed_for = "cuda"
    with pytest.raises(NotImplementedError, match="prepacked for cuda"):
        model.save(tmp_path / "m2")
    with pytest.raises(RuntimeError, match="prepacked for cuda and cannot run on cpu"):
        model.score(ids)


# ---- GPU: the CUDA kernels against the reference ops -----------------------------------------------
@pytest.mark.parametrize("variant", ["W4A16", "W4A16+KV8", "W4A16-g64-asym+KV8"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_w4a16_cuda_matches_cpu(variant):
    if not all(qops.has_cuda_kernel(n) for n in ("w4a16_prepack", "w4a16_gemm")):
        pytest.skip("this build has no CUDA kernels for w4a16")
    sd, ids, _ = model_data(TINY128)
    qcfg = QuantConfig.from_label(variant)
    cpu = build(sd, TINY128, qcfg)
    cuda = build(sd, TINY128, qcfg, device="cuda")
    assert cuda.layers[0].self_attn.qkv_proj.packed_for == "cuda"
    m = compare(cuda.score(ids.cuda()).cpu(), cpu.score(ids))
    assert m["rel"] < 0.03 and m["top1"] > 0.95, m
    # A CPU-built model moved to the GPU is prepacked there. It holds the CPU model's int4 weights
    # (quantized on the CPU: with zeros, a GPU-built model's zeros can differ by a rounding, so it
    # is not compared bitwise with that one), so only the kernels' rounding separates it from them.
    cpu_logits = cpu.score(ids)
    moved = cpu.to("cuda")
    assert moved.layers[0].mlp.down_proj.packed_for == "cuda"
    m = compare(moved.score(ids.cuda()).cpu(), cpu_logits)
    assert m["rel"] < 0.03 and m["top1"] > 0.95, m
    # Greedy generation on the GPU, checked token by token against the CPU model scoring the same
    # sequences: a chosen token must be the CPU model's best up to a near-tie (a margin of 10% of
    # the logits' RMS; the kernels' rounding may flip a near-tie, after which comparing the two
    # generations token for token would compare different contexts).
    prompts = ids[:, :10].tolist()
    out_gpu = generate(moved, prompts, 8)
    cpu = build(sd, TINY128, qcfg)  # `moved` was `cpu` (Module.to moves in place): the same weights again
    for prompt, new in zip(prompts, out_gpu.tokens):
        assert len(new) > 0
        ref = cpu.score(torch.tensor([prompt + new]))[0, len(prompt) - 1 : -1].float()
        chosen = ref.gather(-1, torch.tensor(new)[:, None])[:, 0]
        gap = ref.max(-1).values - chosen
        assert (gap <= 0.1 * ref.pow(2).mean(-1).sqrt()).all(), (gap, new)
