"""What a new user broke (issue 40), one test each: transactional steps and generation, quantize-time
checks, padding and duplicate slots in the caches, device and value checks in the references and
fakes. Each failed before the fix. CPU only (the CUDA side of the op contracts is in
tests/test_contracts.py)."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.llama import GenerationError, QuantConfig, QuantizedLlamaForCausalLM, generate
from qops.llama.cache import HalfPagedKVCache
from qops.llama.config import LlamaArgs
from qops.llama.graphs import GraphDecoder
from qops.llama.quantize import quantize_state_dict
from qops.testing import random_llama_state_dict

ARGS = LlamaArgs(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    max_position_embeddings=256,
)


def _state_dict(args: LlamaArgs = ARGS) -> dict:
    return random_llama_state_dict(args)


@pytest.fixture(scope="module")
def model() -> QuantizedLlamaForCausalLM:
    return QuantizedLlamaForCausalLM.from_state_dict(_state_dict(), ARGS, QuantConfig(), dtype=torch.float16)


def _state(cache) -> tuple:
    return ({s: cache.seq_len(s) for s in cache.sequences()}, cache.num_free_blocks)


# ---- 1. generate() on a caller's cache -----------------------------------------------------------
def test_generate_on_a_callers_cache_leaves_its_sequences_alone(model):
    cache = model.new_cache(16)
    prompt = [5, 6, 7, 8, 9]
    model.step([prompt], [0], cache)  # the caller's own sequence 0
    before = _state(cache)
    fresh = generate(model, [[11, 12, 13]], max_new_tokens=4).tokens
    on_cache = generate(model, [[11, 12, 13]], max_new_tokens=4, cache=cache).tokens
    assert on_cache == fresh  # a new prompt, not a continuation of sequence 0
    assert _state(cache) == before  # sequence 0 is still there, with its length


# ---- 2. a failed step changes nothing -------------------------------------------------------------
def test_failed_step_reserves_nothing_and_can_be_retried(model):
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.step([[1, 2, ARGS.vocab_size]], ["a"], cache)
    assert _state(cache) == ({}, 8)
    with pytest.raises(TypeError, match="token ids must be ints"):
        model.step([[1.0, 2.0]], ["a"], cache)
    logits = model.step([[1, 2, 3]], ["a"], cache)  # the retried prefill is a prefill
    assert logits.shape == (1, ARGS.vocab_size) and cache.seq_len("a") == 3


def test_step_that_raises_inside_the_model_rolls_back(model, monkeypatch):
    cache = model.new_cache(8)
    model.step([[1, 2, 3]], ["a"], cache)
    before = _state(cache)

    def boom(*a, **k):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(type(model), "forward", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        model.step([[4]], ["a"], cache)
    with pytest.raises(RuntimeError, match="kernel failed"):
        model.step([[4, 5]], ["b"], cache)
    assert _state(cache) == before
    monkeypatch.undo()
    # a 1-token prompt of a new sequence is a prefill, not a decode over an unwritten slot
    assert model.step([[4]], ["b"], cache).shape == (1, ARGS.vocab_size)
    assert cache.seq_len("b") == 1 and cache.seq_len("a") == 3


def test_graph_decoder_step_is_transactional(model):
    cache = model.new_cache(8)
    model.step([[1, 2], [3]], ["a", "b"], cache)
    dec = GraphDecoder(model, cache, ["a", "b"], max_context=64, capture=False)
    before = _state(cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.step([5, -1])
    with pytest.raises(ValueError, match="2 sequences"):
        dec.step([5])
    assert _state(cache) == before
    dec.step([5, 6])
    assert cache.seq_len("a") == 3 and cache.seq_len("b") == 2
    with pytest.raises(KeyError, match="unknown sequence"):
        GraphDecoder(model, cache, ["zz"], max_context=64, capture=False)


# ---- 3. generate() cleans up and returns what it made ---------------------------------------------
def test_generate_frees_its_sequences_and_reports_partial_tokens(model):
    cache = model.new_cache(3)  # a block each: the prompts fit, the decode runs out at 16 tokens
    model.step([[1]], ["mine"], cache)
    with pytest.raises(GenerationError, match="out of cache blocks") as err:
        generate(model, [[1] * 10, [2] * 10], max_new_tokens=40, cache=cache)
    partial = err.value.result.tokens
    assert [len(t) for t in partial] == [7, 7]  # 1 from the prefill, 6 decode steps fill the block
    assert cache.sequences() == ["mine"] and cache.num_free_blocks == 2


# ---- 4. quantize() rejects what it cannot run ------------------------------------------------------
def test_quantize_rejects_unsupported_models_up_front():
    sd = _state_dict()
    with pytest.raises(ValueError, match="head_dim 64 or 128"):
        a = LlamaArgs(**{**ARGS.to_dict(), "head_dim": 32, "num_heads": 2})
        quantize_state_dict(_state_dict(a), a, QuantConfig())
    with pytest.raises(ValueError, match="multiples of 16"):
        a = LlamaArgs(**{**ARGS.to_dict(), "intermediate_size": 120})
        quantize_state_dict(_state_dict(a), a, QuantConfig())
    with pytest.raises(ValueError, match="calibration_tokens is empty"):
        quantize_state_dict(sd, ARGS, QuantConfig(smoothquant=True), calibration_tokens=[])
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        hidden_act="gelu",
    )
    with pytest.raises(NotImplementedError, match="hidden_act 'gelu'"):
        qops.llama.quantize(transformers.LlamaForCausalLM(cfg))


# ---- 5. H_kv = 0 ---------------------------------------------------------------------------------
def test_decode_attention_with_no_kv_heads_raises():
    kc = torch.zeros(2, 0, 16, 64, dtype=torch.int8)
    args = (
        torch.zeros(1, 4, 64, dtype=torch.float16),
        kc,
        kc.clone(),
        torch.ones(1),
        torch.ones(1),
        torch.zeros(1, 2, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="H_kv >= 1"):
        qops.paged_decode_attention_int8(*args)


# ---- 6. padding in the float cache ----------------------------------------------------------------
def test_half_cache_skips_padding_slots():
    cache = HalfPagedKVCache(1, 1, 16, num_blocks=2, block_size=16)
    slots = cache.append_slots(["a"], [32])
    k = torch.randn(32, 1, 16, dtype=torch.float16)
    cache.write(0, k, k, slots)
    junk = torch.full((2, 1, 16), 7.0, dtype=torch.float16)
    cache.write(0, junk, junk, torch.tensor([-1, -1]))
    got, _ = cache.gather(0, slots, torch.float16)
    assert torch.equal(got, k)  # the last slot of the last block keeps its token


# ---- 7. duplicate slots ----------------------------------------------------------------------------
def test_cache_write_rejects_duplicate_slots():
    kc = torch.zeros(2, 1, 16, 64, dtype=torch.int8)
    ks = torch.ones(2, 1, 16)
    key = torch.randn(2, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="several tokens to one slot"):
        qops.reshape_and_cache_int8(key, key, kc, kc.clone(), ks, ks.clone(), torch.tensor([5, 5]))
    qops.reshape_and_cache_int8(key, key, kc, kc.clone(), ks, ks.clone(), torch.tensor([-1, -1]))  # padding


# ---- 8. devices in references and fakes -------------------------------------------------------------
def test_meta_tensor_mixed_into_a_cpu_call_raises():
    x = torch.randn(4, 64, dtype=torch.float16)
    r = x.clone()
    w = torch.ones(64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="weight must be on cpu, got meta"):
        qops.fused_add_rms_norm_quant(x, r, w, 1e-5)
    assert torch.equal(r, x)
    with pytest.raises(ValueError, match="must be on"):
        qops.quant_per_tensor(x, torch.ones(1, device="meta"))


# ---- 9. static scales and int4 groups ----------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_static_scales_must_be_finite_and_positive(bad):
    x = torch.randn(4, 64, dtype=torch.float16)
    s = torch.tensor([bad])
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        qops.quant_per_tensor(x, s)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        qops.rms_norm_quant(x, torch.ones(64, dtype=torch.float16), 1e-5, s)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        qops.silu_and_mul_quant(x, s)
    kc = torch.zeros(2, 1, 16, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scales must be finite and > 0"):
        qops.reshape_and_cache_int8(x[:1, None], x[:1, None], kc, kc.clone(), s, torch.ones(1), torch.tensor([0]))
    with pytest.raises(ValueError, match="finite and > 0"):
        qops.PagedKVCache(1, 1, 64, 2, k_scale=bad, v_scale=1.0)


def test_int4_groups_stay_finite():
    from qops.int4_kv import dequantize_kv_int4

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    x[1, 5] = -1e6  # below -65504: not an fp16 value
    x[2, 7] = float("inf")
    x[3, :] = float("nan")
    for groups in (1, 4):
        rows = qops.quantize_kv_int4(x, groups)
        assert torch.isfinite(dequantize_kv_int4(rows, groups, 64)).all()


# ---- 10. smaller ones -------------------------------------------------------------------------------
def test_generate_argument_errors_are_clear(model):
    with pytest.raises(TypeError, match="one list of token ids per sequence"):
        generate(model, "hello")
    with pytest.raises(TypeError, match="one list of token ids per sequence"):
        generate(model, [1, 2, 3])
    with pytest.raises(TypeError, match="token ids must be ints"):
        generate(model, [[1.5, 2.0]])
    with pytest.warns(UserWarning, match="past the model's context"):
        generate(model, [[1] * 250], max_new_tokens=10)


def test_generate_takes_eos_as_a_tensor(model):
    first = generate(model, [[3, 4, 5]], max_new_tokens=1).tokens[0][0]
    out = generate(model, [[3, 4, 5]], max_new_tokens=8, eos_token_id=torch.tensor([first]))
    assert out.tokens == [[first]]


def test_cache_manager_errors_name_the_problem():
    cache = qops.BlockAllocator(4, 16)
    cache.append_slots(["a"], [20])
    cache.free("a")
    with pytest.raises(KeyError, match="unknown sequence id 'a'"):
        cache.free("a")
    with pytest.raises(KeyError, match="unknown sequence id 'q'"):
        cache.seq_lens(["q"])
    with pytest.raises(RuntimeError, match="out of cache blocks: 7 needed, 4 free of 4"):
        cache.append_slots(["b"], [100])
