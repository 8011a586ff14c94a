"""Decode timing for the quantized model and for the Hugging Face fp16 anchors (eager or SDPA
attention, dynamic or static cache), shared by ``python -m qops.llama`` and
``bench/bench_llama_decode.py``.

Both harnesses do the same thing: fill a batch's KV cache to ``context`` tokens (a real prefill,
or random K/V written straight into the cache: decode speed does not depend on the values), then
time ``steps`` greedy decode steps of the whole batch (synchronized wall time per step; median
and mean reported). Tokens/s counts one token per sequence per step.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class DecodeTiming:
    name: str
    batch: int
    context: int
    steps: int
    step_ms_median: float
    step_ms_mean: float
    tokens_per_s: float
    peak_memory: int | None
    kv_bytes_per_token: int
    weight_bytes: int
    note: str = ""

    def row(self) -> dict:
        return asdict(self)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _summarize(name, batch, context, times, dev, kv_bytes, weight_bytes, note="") -> DecodeTiming:
    med = statistics.median(times)
    mean = statistics.fmean(times)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return DecodeTiming(
        name, batch, context, len(times), 1e3 * med, 1e3 * mean, batch / med, peak, kv_bytes, weight_bytes, note
    )


# ---- the quantized model -----------------------------------------------------------------------
@torch.no_grad()
def fill_cache_random(model, cache, seq_ids, context: int, generator: torch.Generator | None = None) -> None:
    """Reserve ``context`` tokens for each sequence and fill the cache with random K/V (int8
    values and plausible scales, int4 codes under plausible fp16 scale/shift headers and random
    side buffers, or float values)."""
    cache.append_slots(list(seq_ids), [context] * len(seq_ids))
    if cache.k_cache.dtype == torch.int8:
        for t in (cache.k_cache, cache.v_cache):
            t.random_(-127, 128, generator=generator)
        if cache.k_scales is not None and cache.k_scales.dim() > 2:  # dynamic: [L, nb, H, bs]
            cache.k_scales.uniform_(0.01, 0.05, generator=generator)
            cache.v_scales.uniform_(0.01, 0.05, generator=generator)
    elif cache.k_cache.dtype == torch.uint8:  # int4 rows: [fp16 (scale, shift) x G | codes]
        hdr = 4 * cache.num_groups
        for t in (cache.k_cache, cache.v_cache):
            t.random_(0, 256, generator=generator)
            pairs = torch.empty((*t.shape[:-1], cache.num_groups, 2), dtype=torch.float16, device=t.device)
            pairs[..., 0].uniform_(0.02, 0.2, generator=generator)  # scale: codes 0..15 span 0.3 .. 3
            pairs[..., 1].uniform_(-1.5, -0.1, generator=generator)  # shift
            t[..., :hdr] = pairs.view(torch.uint8).reshape(*t.shape[:-1], hdr)
        for t in (cache.k_side, cache.v_side):
            if t is not None:
                t.normal_(generator=generator)
    else:
        cache.k_cache.normal_(generator=generator)
        cache.v_cache.normal_(generator=generator)


@torch.no_grad()
def time_qops_decode(
    model,
    batch: int,
    context: int,
    steps: int = 32,
    warmup: int = 3,
    *,
    fill: str = "random",
    prefill_group: int = 8,
    vocab_limit: int | None = None,
    name: str | None = None,
    cuda_graph: bool = False,
) -> DecodeTiming:
    """Decode throughput of a ``QuantizedLlamaForCausalLM`` at ``batch`` x ``context``.

    ``fill="prefill"`` runs the real prefill (``prefill_group`` sequences per step) on random
    token ids; ``"random"`` writes random K/V into the cache. ``cuda_graph``: replay the decode
    step as a CUDA graph (``qops.llama.graphs``)."""
    dev = model.device
    total = context + warmup + steps + 1
    cache = model.cache_for([total] * batch)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    vocab = vocab_limit or model.args.vocab_size
    seq_ids = list(range(batch))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    if fill == "prefill":
        for i in range(0, batch, prefill_group):
            grp = seq_ids[i : i + prefill_group]
            ids = torch.randint(0, vocab, (len(grp), context), device=dev, generator=g)
            model.step(ids, grp, cache)
    else:
        fill_cache_random(model, cache, seq_ids, context, g)
    tok = torch.randint(0, vocab, (batch,), device=dev, generator=g).tolist()
    runner = None
    if cuda_graph:
        from .graphs import GraphDecoder

        runner = GraphDecoder(model, cache, seq_ids, max_context=total)
    times = []
    for i in range(warmup + steps):
        _sync(dev)
        t0 = time.perf_counter()
        if runner is not None:
            logits = runner.step(tok)
        else:
            logits = model.step([[t] for t in tok], seq_ids, cache)
        tok = logits.argmax(-1).tolist()  # synchronizes
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    label = name or model.qcfg.label() + (" (graph)" if cuda_graph else "")
    return _summarize(
        label, batch, context, times, dev, model.kv_bytes_per_token(), model.weight_bytes(), note=f"qops, fill={fill}"
    )


@torch.no_grad()
def profile_qops_decode(model, batch: int, context: int, steps: int = 5, warmup: int = 2) -> list[dict]:
    """Where a decode step's GPU time goes: the kernels of ``steps`` eager decode steps of
    ``model`` at ``batch`` x ``context`` (random K/V cache), grouped by kernel name, with the
    device time and launch count per step, largest first (``torch.profiler``, CUDA activity).

    Kernel times are what the GPU spent inside each kernel; the gaps between kernels (launch
    overhead, which a CUDA graph removes) are not in the sum."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = model.device
    if dev.type != "cuda":
        raise RuntimeError("profile_qops_decode profiles CUDA kernels: the model must be on a GPU")
    cache = model.cache_for([context + warmup + steps + 1] * batch)
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    seq_ids = list(range(batch))
    fill_cache_random(model, cache, seq_ids, context, g)
    tok = torch.randint(0, model.args.vocab_size, (batch,), device=dev, generator=g).tolist()
    for _ in range(warmup):
        tok = model.step([[t] for t in tok], seq_ids, cache).argmax(-1).tolist()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = model.step([[t] for t in tok], seq_ids, cache).argmax(-1).tolist()
        _sync(dev)
    agg: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = agg.setdefault(e.name, [0.0, 0.0])
            a[0] += e.device_time_total
            a[1] += 1
    rows = [{"kernel": k, "us_per_step": t / steps, "calls_per_step": n / steps} for k, (t, n) in agg.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


# ---- Hugging Face anchors ------------------------------------------------------------------------
def _make_hf_cache(model, kind: str, batch: int, max_len: int):
    import transformers

    cfg = model.config
    if kind == "dynamic":
        try:
            return transformers.DynamicCache(config=cfg)
        except TypeError:
            return transformers.DynamicCache()
    if kind != "static":
        raise ValueError(f"cache kind must be dynamic or static, got {kind!r}")
    dev, dtype = model.device, model.dtype
    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kw = dict(config=cfg, max_cache_len=max_len)
    for k, v in (("max_batch_size", batch), ("batch_size", batch), ("device", dev), ("dtype", dtype)):
        if k in params:
            kw[k] = v
    return transformers.StaticCache(**kw)


def _set_attn(model, attn: str) -> None:
    """Switch a transformers model's attention implementation (``eager``/``sdpa``)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(attn)
    else:  # transformers 4.48 - 4.5x dispatch on the config at forward time
        model.config._attn_implementation = attn
    if model.config._attn_implementation != attn:
        raise RuntimeError(f"could not switch the attention implementation to {attn!r}")


def _position_kwargs(model, pos: torch.Tensor) -> dict:
    """``position_ids`` (transformers 5) and ``cache_position`` (4.x) for new tokens at ``pos``."""
    kw = {"position_ids": pos[None, :]}
    if "cache_position" in inspect.signature(model.model.forward).parameters:
        kw["cache_position"] = pos
    return kw


def _cache_kwarg(model) -> str:
    """The forward keyword for the KV cache: ``cache`` where the installed transformers has it
    (there ``past_key_values`` is deprecated with a FutureWarning, to be removed in 5.40), else the
    older ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def time_hf_decode(
    model,
    batch: int,
    context: int,
    steps: int = 32,
    warmup: int = 3,
    *,
    cache: str = "dynamic",
    attn: str = "sdpa",
    fill: str = "random",
    prefill_chunk: int = 256,
    vocab_limit: int | None = None,
    compile_backend: str | None = None,
) -> DecodeTiming:
    """Decode throughput of a Hugging Face ``LlamaForCausalLM`` (its own dtype) with a
    ``DynamicCache`` or ``StaticCache`` and ``eager`` or ``sdpa`` attention.

    ``fill="random"`` writes random K/V through ``cache.update`` (no prefill compute);
    ``"prefill"`` runs the model over random ids in chunks of ``prefill_chunk`` tokens.
    ``compile_backend`` (static cache only): run the decode step through
    ``torch.compile(model, backend=..., fullgraph=True, dynamic=False)``; ``"cudagraphs"`` replays it as
    a CUDA graph (transformers' recommended fast decode: static cache + compile), ``"inductor"``
    also fuses kernels (needs triton). Compilation happens in three extra warm-up steps."""
    dev = model.device
    cfg = model.config
    if compile_backend and cache != "static":
        raise ValueError(f"compile_backend needs the static cache (fixed shapes), got cache={cache!r}")
    if compile_backend:
        warmup += 3  # trace, then (cudagraphs) warm up and record
    old_attn = cfg._attn_implementation
    _set_attn(model, attn)
    try:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        total = context + warmup + steps + 1
        kv = _make_hf_cache(model, cache, batch, total)
        g = torch.Generator(device=dev)
        g.manual_seed(0)
        vocab = vocab_limit or cfg.vocab_size
        hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = inspect.signature(model.forward).parameters
        keep = {k: 1 for k in ("logits_to_keep", "num_logits_to_keep") if k in params}
        cache_kw = _cache_kwarg(model)
        if fill == "random":
            pos = torch.arange(context, device=dev)
            for layer in range(cfg.num_hidden_layers):
                k = torch.randn(batch, hkv, context, d, device=dev, dtype=model.dtype, generator=g)
                v = torch.randn(batch, hkv, context, d, device=dev, dtype=model.dtype, generator=g)
                kv.update(k, v, layer, {"cache_position": pos})
                del k, v
        else:
            for s in range(0, context, prefill_chunk):
                n = min(prefill_chunk, context - s)
                ids = torch.randint(0, vocab, (batch, n), device=dev, generator=g)
                model(
                    input_ids=ids,
                    **{cache_kw: kv},
                    use_cache=True,
                    **_position_kwargs(model, torch.arange(s, s + n, device=dev)),
                    **keep,
                )
        tok = torch.randint(0, vocab, (batch, 1), device=dev, generator=g)
        fwd = model
        if compile_backend:
            torch._dynamo.reset()
            fwd = torch.compile(model, backend=compile_backend, fullgraph=True, dynamic=False)
        times = []
        for i in range(warmup + steps):
            p = context + i
            _sync(dev)
            t0 = time.perf_counter()
            out = fwd(
                input_ids=tok,
                **{cache_kw: kv},
                use_cache=True,
                **_position_kwargs(model, torch.tensor([p], device=dev)),
            )
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok.tolist()  # synchronize like the qops loop does
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            del out
        a = cfg
        kvb = 2 * a.num_hidden_layers * hkv * d * torch.finfo(model.dtype).bits // 8
        wb = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
        dt = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(model.dtype, str(model.dtype).replace("torch.", ""))
        tag = f" +compile({compile_backend})" if compile_backend else ""
        return _summarize(
            f"HF {dt} {attn}/{cache}{tag}", batch, context, times, dev, kvb, wb, note=f"transformers, fill={fill}"
        )
    finally:
        _set_attn(model, old_attn)
