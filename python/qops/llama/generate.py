"""Batched generation with the paged cache: one prefill step for all prompts (variable lengths
packed together), then decode steps of one token per live sequence; greedy or sampling."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from .model import token_rows


@dataclass
class GenerationResult:
    """Output of ``generate``.

    Attributes:
        tokens: the generated token ids of each prompt (prompt excluded; eos included if hit).
        prefill_s, decode_s: wall time of the prefill step and of all decode steps (synchronized).
        decode_steps: decode steps run; decode_tokens: tokens produced by decode steps (the
            first token of each sequence comes from the prefill).
        kv_bytes_per_token: the cache's bytes per token (all layers).
        peak_memory: CUDA peak allocated bytes during the call (None on CPU).
    """

    tokens: list[list[int]]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    kv_bytes_per_token: int = 0
    peak_memory: int | None = None
    step_times: list[float] = field(default_factory=list, repr=False)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def time_per_output_token_ms(self) -> float:
        """Mean time of one decode step (every live sequence gets one token per step)."""
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")


class GenerationError(RuntimeError):
    """A step of ``generate`` raised (e.g. the cache ran out of blocks mid-decode). ``result``
    holds what was generated until then; the sequences ``generate`` added to the cache are freed.
    The original exception is the ``__cause__``."""

    def __init__(self, message: str, result: GenerationResult) -> None:
        super().__init__(message)
        self.result = result


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.reshape(-1).tolist()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    try:
        return {int(t) for t in eos_token_id}
    except TypeError:
        raise TypeError(
            f"generate: eos_token_id must be an int, a sequence of ints or a tensor, got {type(eos_token_id).__name__}"
        ) from None


def sample_next(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next tokens ``[B]`` from float logits ``[B, V]``: argmax, or sampling with temperature,
    top-k and nucleus (top-p) filtering."""
    if not do_sample or temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class _SampleOptions(TypedDict):
    """The keyword arguments of ``sample_next`` that ``generate`` passes on every step."""

    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    seed: int | None = None,
    cache=None,
    progress: bool = False,
    prefill_chunk: int | None = None,
) -> GenerationResult:
    """Generate continuations of a batch of prompts with a ``QuantizedLlamaForCausalLM``.

    Args:
        model: the quantized (or float-tree) model.
        prompts: one list of token ids per prompt (ints in ``[0, vocab_size)``), any lengths >= 1
            (one batch); a ``[B, S]`` integer tensor also works.
        max_new_tokens: tokens to generate per prompt (fewer if it hits ``eos_token_id``).
        do_sample, temperature, top_k, top_p: sampling (greedy when ``do_sample`` is False).
        eos_token_id: stop a sequence at this token (or any of these: a sequence or a tensor of
            ids); ``None``: never.
        seed: seeds the sampling generator.
        cache: a cache from ``model.new_cache`` (default: one sized for this batch). Sequences the
            caller holds in it are left alone: ``generate`` adds its own, and frees them all when
            it returns or raises.
        prefill_chunk: prefill the prompts at most this many tokens per sequence and step
            (chunked prefill); a sequence whose prompt is done decodes in the same steps as the
            others' remaining chunks (mixed steps, ``QuantizedLlamaForCausalLM.step``). Each
            chunk attends to its prompt's earlier tokens as read back from the cache. ``None``
            (default): one prefill of every whole prompt. Not with an SKVQ cache.
    Raises:
        GenerationError: a step failed (e.g. the cache ran out of blocks); ``.result`` holds the
            tokens generated so far.
    """
    prompts = token_rows(prompts, model.args.vocab_size, "generate")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"generate: max_new_tokens must be an int, got {max_new_tokens!r}")
    if prefill_chunk is not None and (
        isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
    ):
        raise ValueError(f"generate: prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
    dev = model.device
    b = len(prompts)
    if b == 0 or max_new_tokens <= 0:
        return GenerationResult(tokens=[[] for _ in prompts])
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    eos = _eos_set(eos_token_id)
    limit = model.args.max_position_embeddings
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > limit:
        warnings.warn(
            f"generate: prompt + max_new_tokens reaches {longest} tokens, past the model's "
            f"context of {limit} (max_position_embeddings): quality degrades there",
            stacklevel=2,
        )
    if cache is None:
        cache = model.cache_for([len(p) + max_new_tokens for p in prompts])
    gen = None
    if do_sample:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed if seed is not None else torch.seed())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    opts = _SampleOptions(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    out: list[list[int]] = [[] for _ in range(b)]
    res = GenerationResult(tokens=out, kv_bytes_per_token=cache.bytes_per_token())
    # Private sequence ids: a caller's cache may hold sequences of its own (any ids); these are
    # unique to this call and are all freed when it ends, normally or not.
    key = object()
    ids = [(key, i) for i in range(b)]
    live: list[int] = []
    try:
        _sync(dev)
        t0 = time.perf_counter()

        def take(i: int, t: int) -> bool:  # a new token of sequence i; True: it goes on
            out[i].append(t)
            if t in eos or len(out[i]) >= max_new_tokens:
                cache.free(ids[i])
                return False
            return True

        if prefill_chunk is None:
            logits = model.step(prompts, ids, cache)
            nxt = sample_next(logits, **opts).tolist()
            live = [i for i, t in enumerate(nxt) if take(i, t)]
        else:
            done = [0] * b  # prompt tokens in the cache
            while any(done[i] < len(prompts[i]) for i in range(b)):
                who = [i for i in range(b) if done[i] < len(prompts[i]) or i in live]
                rows = [
                    prompts[i][done[i] : done[i] + prefill_chunk] if done[i] < len(prompts[i]) else [out[i][-1]]
                    for i in who
                ]
                logits = model.step(rows, [ids[i] for i in who], cache)
                nxt = sample_next(logits, **opts).tolist()
                for i, row, t in zip(who, rows, nxt):
                    if done[i] < len(prompts[i]):
                        done[i] += len(row)
                        if done[i] < len(prompts[i]):
                            continue  # a chunk before the prompt's last: its logits are not used
                        if take(i, t):
                            live.append(i)
                    elif not take(i, t):
                        live.remove(i)
        _sync(dev)
        res.prefill_s = time.perf_counter() - t0
        steps = range(max_new_tokens - 1)
        if progress:
            try:
                from tqdm.auto import tqdm

                steps = tqdm(steps, desc="decoding", leave=False)
            except ImportError:
                pass
        t1 = time.perf_counter()
        for _ in steps:
            if not live:
                break
            ts = time.perf_counter()
            logits = model.step([[out[i][-1]] for i in live], [ids[i] for i in live], cache)
            nxt = sample_next(logits, **opts).tolist()  # .tolist() synchronizes
            res.step_times.append(time.perf_counter() - ts)
            res.decode_steps += 1
            res.decode_tokens += len(live)
            live = [i for i, t in zip(live, nxt) if take(i, t)]
        _sync(dev)
        res.decode_s = time.perf_counter() - t1
    except Exception as e:
        raise GenerationError(
            f"generate: a step failed after {sum(map(len, out))} generated tokens "
            f"({type(e).__name__}: {e}); the partial result is in .result",
            res,
        ) from e
    finally:
        known = set(cache.sequences())
        for sid in ids:
            if sid in known:
                cache.free(sid)
    if dev.type == "cuda":
        res.peak_memory = torch.cuda.max_memory_allocated(dev)
    return res
