"""Helpers shared by qops' tests and benchmarks (and by anyone testing or timing qops ops):

- ``require_cuda``: the clean exit of a CUDA-only entry point on a machine without CUDA;
- test helpers: outputs poisoned so that an unwritten element shows (``poison_``,
  ``poison_cuda_allocator``), the kernels a call launches (``cuda_kernel_names``), and the skip
  rule of the sm_90a GEMMs (``needs_w8a8_gemm``) and of the sm_80 ones (``needs_w8a8_gemm_sm80``);
- benchmark helpers: timing that L2 does not flatter, the copy-bandwidth ceiling, and CSV / PNG
  output.

Timing: ``bench_us(make_call, n_sets)`` builds ``n_sets`` independent input sets (so one call's
inputs are not in L2 from the previous call), captures one CUDA graph that calls the op once per
set, replays it, and reports the median time per call over many replays (CUDA events). Graph
replay removes CPU launch gaps, as in a CUDA-graph decode loop. The replay itself still starts
some microseconds after the start event (the host submits the graph after recording it), so a
graph of few calls charges that latency to each call (2 sets of a 25 us call: +1-2 us per call);
``_runner`` therefore repeats the sets in the graph until it runs ~1 ms (``GRAPH_MIN_US``).
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import torch


# ---- entry points ------------------------------------------------------------------------------
def require_cuda(prog: str, why: str = "it times the CUDA kernels") -> None:
    """Exit a command-line entry point (a benchmark) with one line on stderr and status 1 when torch
    sees no CUDA device, instead of a traceback from the first CUDA allocation."""
    if not torch.cuda.is_available():
        print(f"{prog}: needs a CUDA device ({why}); torch {torch.__version__} sees none", file=sys.stderr)
        raise SystemExit(1)


# ---- test helpers -------------------------------------------------------------------------------
def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no correct kernel writes (NaN for floats, a sentinel for ints)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.int8:
        return t.fill_(-77)
    if t.dtype == torch.uint8:
        return t.fill_(0xFF)  # int4 KV rows: NaN scale and shift
    return t.fill_(-7777)


def poison_cuda_allocator(nbytes: int = 64 << 20) -> None:
    """Fill a large block of the CUDA caching allocator with 0xA5 bytes and return it to the cache,
    so outputs the next ops allocate start as garbage rather than as zeros left by an earlier op:
    an element a kernel forgets to write then shows up as a mismatch. No-op without CUDA."""
    if torch.cuda.is_available():
        torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xA5)


def needs_w8a8_gemm() -> None:
    """Skip the calling test (pytest) unless the w8a8_gemm CUDA kernels can run here: a CUDA device,
    a build with the sm_90a CUTLASS kernels (QOPS_ENABLE_SM90, the default) and a Hopper (sm_90)
    GPU. Elsewhere w8a8_gemm raises a clear NotImplementedError on CUDA tensors."""
    import pytest

    import qops

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not qops.has_cuda_kernel("w8a8_gemm"):
        pytest.skip("this build has no w8a8_gemm CUDA kernel (built without sm_90a)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the w8a8_gemm kernels are sm_90a (Hopper) only")


def needs_w8a8_gemm_sm80(config: str) -> None:
    """Skip the calling test (pytest) unless the sm_80 w8a8_gemm family can run here: a CUDA device
    of compute capability 8.0 or later and a build with the sm_80 CUTLASS kernels
    (QOPS_ENABLE_SM80, the default), which has `config` (a name of
    ``w8a8_configs.SM80_CONFIGS``). GPUs of compute capability 9.0 and later run them through the
    driver's compilation of their compute_80 PTX when ``config=`` names them (the H100 tests)."""
    import pytest

    import qops

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not qops.has_cuda_kernel("w8a8_gemm"):
        pytest.skip("this build has no w8a8_gemm CUDA kernel")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the sm_80 w8a8_gemm kernels need compute capability 8.0 or later")
    x = torch.zeros(16, 16, dtype=torch.int8, device="cuda")
    one = torch.ones(1, device="cuda")
    try:
        qops.w8a8_gemm(x, x, one, one, torch.float16, config=config)
    except ValueError as e:
        if "unknown config" not in str(e):
            raise
        pytest.skip(f"this build has no sm_80 w8a8_gemm kernels ({config}: built with QOPS_ENABLE_SM80=OFF?)")


def cuda_kernel_names(fn: Callable[[], object], contains: str) -> list[str] | None:
    """Names of the CUDA kernels ``fn`` launches whose name contains ``contains`` (torch.profiler);
    None when the profiler records no such kernels here (no CUPTI): the caller skips."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if contains in e.name]
    except Exception:
        return None
    return names or None


def tiny_llama_args():
    """The tests' tiny Llama shape (``qops.llama.LlamaArgs``): hidden 192, intermediate 320,
    2 layers, 6 heads over 2 KV heads of 64 (GQA 3:1); its K fit int4 groups of 64 only."""
    from qops.llama import LlamaArgs

    return LlamaArgs(
        vocab_size=384,
        hidden_size=192,
        intermediate_size=320,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def tiny_family_args(model_type: str):
    """A tiny shape of a Llama-family model (``"llama"``, ``"mistral"``, ``"qwen2"`` with q/k/v
    biases, ``"qwen3"`` with q/k norms): hidden 128, intermediate 256, 2 layers, 4 heads over 2 KV
    heads of 64; K = 128 or 256, so int4 groups of 64 and 128 both fit."""
    from qops.llama import LlamaArgs

    return LlamaArgs(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        model_type=model_type,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
    )


def random_int4_weight(n: int, k: int, group_size: int, dtype: torch.dtype, with_zeros: bool = False, seed: int = 0):
    """Random int4 weights for ``qops.w4a16_gemm`` tests: ``(packed uint8 [N, K/2] in the
    reference layout, scales [N, K/G], zeros [N, K/G] or None)``, every q in [-8, 7] equally
    likely, scales in [0.005, 0.025), zeros ~ N(0, 0.05), in ``dtype``."""
    from qops.w4a16 import pack_int4

    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = (torch.randn(n, k // group_size, generator=gen) * 0.05).to(dtype) if with_zeros else None
    return pack_int4(q), scales, zeros


def compare_logits(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative L2 error, mean next-token KL(ref || q) and top-1 agreement of ``[..., V]`` logits
    against reference logits (the Llama tests' closeness measures)."""
    lq, lr = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref.float(), -1)
    return {
        "rel": float((logits.float() - ref.float()).norm() / ref.float().norm()),
        "kl": float((lr.exp() * (lr - lq)).sum(-1).mean()),
        "top1": float((lq.argmax(-1) == lr.argmax(-1)).float().mean()),
    }


def random_llama_state_dict(args, seed: int = 0) -> dict:
    """Random weights of a Llama model of shape ``args`` (a ``qops.llama.LlamaArgs``), float32 on
    the CPU, with Hugging Face names (``quantize_state_dict`` / ``from_state_dict`` take them), and
    some realism: a few activation outlier channels (large RMSNorm weights), as trained LLMs have."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = args.hidden_size, args.intermediate_size, args.head_dim

    def lin(n, k):
        return torch.randn(n, k, generator=g) / math.sqrt(k)

    sd = {
        "model.embed_tokens.weight": torch.randn(args.vocab_size, h, generator=g),
        "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": lin(args.vocab_size, h) * 4,
    }
    for layer in range(args.num_layers):
        p = f"model.layers.{layer}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = 1 + 0.1 * torch.randn(h, generator=g)
            w[torch.randint(0, h, (3,), generator=g)] = 6.0  # outlier channels
            sd[p + name + ".weight"] = w
        sd[p + "self_attn.q_proj.weight"] = lin(args.num_heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = lin(args.num_kv_heads * d, h)
        sd[p + "self_attn.v_proj.weight"] = lin(args.num_kv_heads * d, h)
        sd[p + "self_attn.o_proj.weight"] = lin(h, args.num_heads * d)
        sd[p + "mlp.gate_proj.weight"] = lin(i, h)
        sd[p + "mlp.up_proj.weight"] = lin(i, h)
        sd[p + "mlp.down_proj.weight"] = lin(h, i)
        if getattr(args, "qkv_bias", False):  # Qwen2
            for name, n in (("q", args.num_heads), ("k", args.num_kv_heads), ("v", args.num_kv_heads)):
                sd[p + f"self_attn.{name}_proj.bias"] = 0.5 * torch.randn(n * d, generator=g)
        if getattr(args, "qk_norm", False):  # Qwen3
            for name in ("q_norm", "k_norm"):
                sd[p + f"self_attn.{name}.weight"] = 1 + 0.2 * torch.randn(d, generator=g)
    return sd


# ---- benchmark helpers --------------------------------------------------------------------------
def l2_rotation_sets(bytes_per_set: int, min_sets: int = 2, max_sets: int = 32) -> int:
    """How many input sets to rotate so that together they exceed the L2 cache twice over."""
    l2 = 50 << 20
    if torch.cuda.is_available():
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2) or l2
    n = -(-2 * l2 // max(bytes_per_set, 1))
    return int(max(min_sets, min(max_sets, n)))


# A timed CUDA-graph replay runs at least this long (when GRAPH_MAX_CALLS allow): the replay
# starts a few microseconds after its start event, which is then < 1% of the time measured.
GRAPH_MIN_US = 1000.0
GRAPH_MAX_CALLS = 128


def _capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    return g


def _graph_repeats(per_call_us: float, n_sets: int) -> int:
    """How many times to repeat the ``n_sets`` calls in one graph: enough for GRAPH_MIN_US, at
    most GRAPH_MAX_CALLS calls, at least once."""
    want = -(-GRAPH_MIN_US // max(per_call_us * n_sets, 1e-3))
    return int(max(1, min(GRAPH_MAX_CALLS // max(n_sets, 1), want)))


def _runner(make_call: Callable[[int], Callable[[], object]], n_sets: int, use_graph: bool):
    """The warmed-up calls of ``n_sets`` input sets as one zero-argument runner (a CUDA graph
    replay when ``use_graph``) and the number of calls it makes.

    The graph calls the sets in turn (0, 1, ..., n_sets - 1, 0, 1, ...), so consecutive calls
    never share inputs (given n_sets >= 2), and repeats that sequence until a replay takes about
    GRAPH_MIN_US: the replay's own launch latency (it starts after the host submits it, some
    microseconds after the start event) is then not charged to the calls, as in a model's decode
    graph of many kernels. Each set is called equally often."""
    calls = [make_call(i) for i in range(n_sets)]
    for c in calls:  # warm up (module load, autotuning, allocator)
        c()
    torch.cuda.synchronize()
    if not use_graph:

        def run():
            for c in calls:
                c()

        return run, len(calls)
    g = _capture(calls)
    g.replay()
    per_call = statistics.median(_time_us(g.replay, len(calls)) for _ in range(3))
    reps = _graph_repeats(per_call, len(calls))
    if reps > 1:
        del g
        g = _capture(calls * reps)
    return g.replay, len(calls) * reps


def _time_us(run: Callable[[], object], ncalls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / ncalls


def bench_us(
    make_call: Callable[[int], Callable[[], object]],
    n_sets: int = 4,
    *,
    replays: int = 50,
    warmup: int = 5,
    use_graph: bool = True,
) -> float:
    """Median microseconds per call. ``make_call(i)`` returns a zero-argument callable running the
    op on input set ``i`` (allocate the inputs inside ``make_call``, outside the timed region)."""
    run, ncalls = _runner(make_call, n_sets, use_graph)
    for _ in range(warmup):
        run()
    return statistics.median(_time_us(run, ncalls) for _ in range(replays))


def bench_interleaved_us(
    makers: dict[str, Callable[[int], Callable[[], object]]],
    n_sets: int = 4,
    *,
    replays: int = 50,
    warmup: int = 5,
) -> dict[str, float]:
    """Median microseconds per call of several variants of one problem, timed interleaved: every
    replay round replays each variant's CUDA graph once, in turn. Variants timed one after the
    other drift apart with the GPU's clock and temperature (a compute-bound GEMM throttles within
    milliseconds), by more than the few percent being compared; interleaved, they share them."""
    runners = {name: _runner(make, n_sets, True) for name, make in makers.items()}
    for _ in range(warmup):
        for run, _n in runners.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(replays):
        for name, (run, ncalls) in runners.items():
            times[name].append(_time_us(run, ncalls))
    return {name: statistics.median(t) for name, t in times.items()}


_copy_gbps: float | None = None


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written:
    the practical memory ceiling that the memory-bound kernels are compared with."""
    global _copy_gbps
    if _copy_gbps is None:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        us = bench_us(lambda i: lambda: dst.copy_(src), 1, replays=20, use_graph=False)
        _copy_gbps = 2 * nbytes / (us * 1e-6) / 1e9
    return _copy_gbps


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def write_csv(rows: Sequence[dict], path: str) -> None:
    if not rows:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's columns, first-seen order
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


def print_table(rows: Sequence[dict], cols: Sequence[str] | None = None) -> None:
    if not rows:
        return
    cols = list(cols or rows[0].keys())

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1e4 else (f"{v:.0f}" if isinstance(v, float) else str(v))

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def bar_plot(
    rows: Sequence[dict], label_key: str, value_keys: Sequence[str], title: str, ylabel: str, path: str
) -> None:
    """Grouped bar chart of ``value_keys`` per row; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: skipped plot {path}")
        return
    n = len(rows)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * n * len(value_keys)), 4.5))
    width = 0.8 / len(value_keys)
    for j, k in enumerate(value_keys):
        ax.bar([i + j * width for i in range(n)], [float(r[k]) for r in rows], width, label=k)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(n)])
    ax.set_xticklabels([str(r[label_key]) for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def line_grid_plot(
    rows: Sequence[dict],
    group_key: str,
    x_key: str,
    value_keys: Sequence[str],
    title: str,
    ylabel: str,
    path: str,
    *,
    logx: bool = True,
) -> None:
    """One small line chart per ``group_key`` value (e.g. per layer shape), ``x_key`` on the x axis
    (e.g. M) and one line per ``value_keys`` entry: readable where a bar chart of every
    (shape, M) pair is not. Skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: skipped plot {path}")
        return
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[group_key]), []).append(r)
    n = len(groups)
    cols = min(4, n)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for ax, (g, rs) in zip(axes.flat, groups.items()):
        rs = sorted(rs, key=lambda r: float(r[x_key]))
        xs = [float(r[x_key]) for r in rs]
        for k in value_keys:
            ys = [float(r[k]) for r in rs]
            ax.plot(xs, ys, marker="o", markersize=3, label=k)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_title(g, fontsize=9)
        ax.set_xlabel(x_key, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
