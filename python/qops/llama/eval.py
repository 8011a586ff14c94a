"""Quality evaluation: perplexity, next-token KL divergence and top-1 agreement of quantized
variants against the float model, on non-overlapping windows of a text.

    python -m qops.llama.eval                       # GPU: ~300k tokens of the Jargon File
    python -m qops.llama.eval --tokens 2048 --seq-len 256 --device cpu   # a short CPU slice
    python -m qops.llama.eval --model DIR --text FILE   # any model (sources.resolve) and text

Writes ``quality_{gpu,cpu}.md`` and ``.csv`` to ``--out``. The windows (``--layout spread``, the
default) are ``--tokens // --seq-len`` disjoint windows spread evenly over the text; each variant
gets a 95% percentile-bootstrap interval over windows of its perplexity and, paired with the
reference's windows, of its perplexity ratio (``bootstrap_ci``).

Definitions (per window of ``S`` tokens, positions ``t = 0 .. S-2`` predicting ``t+1``):
``ppl = exp(mean NLL)``; ``KL = mean_t sum_v p_ref(v) (log p_ref(v) - log p_q(v))`` with ``p`` the
next-token softmax; ``top1 = mean_t [argmax p_q == argmax p_ref]``. The reference is the Hugging
Face model (fp16 on a GPU, fp32 on a CPU). Weight variants: ``W8A8`` (int8 weights and
activations, ``+SQ<alpha>`` with SmoothQuant) and ``W4A16`` (int4 weights, RTN, one scale per
group of 128 input channels, or 64 with ``-g64``, the default here: SmolLM2's hidden size 576 is
not a multiple of 128; activations stay in float16). Quantized variants attend to what their cache holds:
the int8 K/V (dequantized) with KV8, the int4 rows (dequantized) with KV4, exactly what the decode
kernel reads; with SKVQ's window (``KV4-w128s4``: the newest 128 tokens and the first 4 in full
precision) each position sees its own window in full precision, as its decode step would. KV
bytes per token count SKVQ's per-sequence side buffers spread over one window of ``--seq-len``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..testing import require_cuda
from .config import QuantConfig

if TYPE_CHECKING:
    from .model import QuantizedLlamaForCausalLM


# ---- variants -----------------------------------------------------------------------------------
def parse_variant(name: str) -> QuantConfig:
    """A variant name (``fp16``, ``W8A8+KV8+SQ0.5``, ...) -> ``QuantConfig`` (``QuantConfig.from_label``)."""
    return QuantConfig.from_label(name)


INT4_KV_OPS = ("reshape_and_cache_int4", "skvq_cache_write", "int4_gqa_decode")
W4A16_OPS = ("w4a16_prepack", "w4a16_gemm")


def missing_kernels(qcfg: QuantConfig, device) -> list[str]:
    """The int4 ops (KV cache, W4A16 GEMM) a variant needs that this build has no CUDA kernel
    for (none on a CPU, where every op runs its reference): such variants are left out of a GPU
    run."""
    import qops

    if torch.device(device).type != "cuda":
        return []
    needed = (INT4_KV_OPS if qcfg.kv_cache == "int4" else ()) + (W4A16_OPS if qcfg.w4a16 else ())
    return [n for n in needed if not qops.has_cuda_kernel(n)]


# ---- metrics ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Metrics:
    nll: float = 0.0
    kl: float = 0.0
    top1: float = 0.0
    count: int = 0
    window_nll: list[float] = dataclasses.field(default_factory=list)  # mean NLL of each window added whole

    def add(self, logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor, chunk: int = 2048) -> None:
        """``logits``, ``ref`` ``[N, V]`` float; ``targets [N]`` (rows in chunks: bounded memory).
        One call is one window: its mean NLL goes to ``window_nll`` (confidence intervals)."""
        nll0 = self.nll
        for i in range(0, targets.numel(), chunk):
            lp = torch.log_softmax(logits[i : i + chunk].float(), -1)
            lr = torch.log_softmax(ref[i : i + chunk].float(), -1)
            t = targets[i : i + chunk]
            self.nll += float(-lp.gather(-1, t[:, None]).sum())
            self.kl += float((lr.exp() * (lr - lp)).sum())
            self.top1 += float((lp.argmax(-1) == lr.argmax(-1)).sum())
            self.count += t.numel()
        if targets.numel():
            self.window_nll.append((self.nll - nll0) / targets.numel())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / max(self.count, 1))

    def row(self) -> dict:
        n = max(self.count, 1)
        return {"ppl": self.ppl, "kl": self.kl / n, "top1": self.top1 / n, "tokens": self.count}


def windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows ``[W, seq_len]`` of a token stream."""
    t = tokens.flatten()
    if max_tokens is not None:
        t = t[:max_tokens]
    n = t.numel() // seq_len
    if n == 0:
        raise ValueError(f"need at least seq_len={seq_len} tokens, got {t.numel()}")
    return t[: n * seq_len].reshape(n, seq_len)


def spread_windows(tokens: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``count`` disjoint windows ``[count, seq_len]`` spread evenly over the whole token stream
    (the first at its start, the last at its end), so that a sample of a long text sees all of it."""
    t = tokens.flatten()
    if count < 1 or count * seq_len > t.numel():
        raise ValueError(f"need at least {max(count, 1)} x seq_len={seq_len} tokens, got {t.numel()}")
    if count == 1:
        return t[:seq_len].reshape(1, seq_len)
    last = t.numel() - seq_len
    starts = [round(i * last / (count - 1)) for i in range(count)]
    return torch.stack([t[s : s + seq_len] for s in starts])


def bootstrap_ci(
    values: torch.Tensor, level: float = 0.95, resamples: int = 2000, seed: int = 0, idx: torch.Tensor | None = None
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (one per window; the
    windows are the independent units). Deterministic (``seed``); ``idx [resamples, n]`` reuses
    resampling indices (paired intervals). One value: ``(v, v)``."""
    v = values.double().flatten()
    n = v.numel()
    if n == 0:
        raise ValueError("bootstrap_ci: no values")
    if n == 1:
        return float(v[0]), float(v[0])
    if idx is None:
        idx = bootstrap_indices(n, resamples, seed)
    means = v[idx].mean(1)
    a = (1 - level) / 2
    lo, hi = torch.quantile(means, torch.tensor([a, 1 - a], dtype=torch.float64)).tolist()
    return float(lo), float(hi)


def bootstrap_indices(n: int, resamples: int = 2000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (resamples, n), generator=g)


@torch.no_grad()
def evaluate(
    reference: Callable[[torch.Tensor], torch.Tensor],
    variants: dict[str, Callable],
    wins: torch.Tensor,
    batch_size: int = 1,
    device="cpu",
    progress: bool = True,
) -> dict[str, dict]:
    """Metrics of every variant (``name -> fn(ids [B, S]) -> logits [B, S, V]``) and of the
    reference against the reference, over the windows ``wins [W, S]``."""
    names = ["reference", *variants]
    acc = {n: Metrics() for n in names}
    secs = dict.fromkeys(names, 0.0)
    batches = list(wins.split(batch_size))
    it = batches
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(batches, desc="evaluating", unit="batch", leave=False)
        except ImportError:
            pass
    for ids in it:
        ids = ids.to(device)
        targets = ids[:, 1:].reshape(-1)
        t0 = time.perf_counter()
        ref = reference(ids)
        secs["reference"] += time.perf_counter() - t0
        b, s = ids.shape
        ref = ref[:, :-1].reshape(targets.numel(), -1).float()
        per = s - 1  # predicted tokens per window: each window is added on its own (intervals)
        for j in range(b):
            r = ref[j * per : (j + 1) * per]
            acc["reference"].add(r, r, targets[j * per : (j + 1) * per])
        for name, fn in variants.items():
            t0 = time.perf_counter()
            out = fn(ids)
            secs[name] += time.perf_counter() - t0
            out = out[:, :-1].reshape(targets.numel(), -1)
            for j in range(b):
                rows_j = slice(j * per, (j + 1) * per)
                acc[name].add(out[rows_j], ref[rows_j], targets[rows_j])
            del out
    rows = {}
    ref_w = torch.tensor(acc["reference"].window_nll, dtype=torch.float64)
    idx = bootstrap_indices(ref_w.numel()) if ref_w.numel() > 1 else None
    for n in names:
        rows[n] = acc[n].row()
        rows[n]["eval_s"] = secs[n]
        # 95% bootstrap intervals over windows: of the perplexity, and (paired with the reference's
        # windows) of the perplexity ratio to the reference
        w = torch.tensor(acc[n].window_nll, dtype=torch.float64)
        lo, hi = bootstrap_ci(w, idx=idx)
        dlo, dhi = bootstrap_ci(w - ref_w, idx=idx)
        rows[n].update(
            windows=w.numel(),
            ppl_lo=math.exp(lo),
            ppl_hi=math.exp(hi),
            dppl_lo=math.expm1(dlo),
            dppl_hi=math.expm1(dhi),
        )
        rows[n]["ppl_ci"] = f"{math.exp(lo):.3f} – {math.exp(hi):.3f}"
        rows[n]["dppl_ci"] = f"{math.expm1(dlo):+.2%} – {math.expm1(dhi):+.2%}"
    return rows


def hf_logits_fn(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids [B, S] -> logits f32 [B, S, V]`` of a Hugging Face causal LM (no cache)."""

    def fn(ids):
        return model(input_ids=ids, use_cache=False).logits.float()

    return fn


# ---- tables -------------------------------------------------------------------------------------
def format_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table; ``columns`` = ``(key, header, format)``."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---:" if f else "---" for _, _, f in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for k, _, f in columns:
            v = r.get(k, "")
            cells.append(format(v, f) if (f and isinstance(v, (int, float))) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


QUALITY_COLUMNS = [
    ("variant", "variant", ""),
    ("ppl", "perplexity", ".3f"),
    ("ppl_ci", "ppl 95% CI", ""),
    ("dppl", "Δppl vs ref", "+.2%"),
    ("dppl_ci", "Δppl 95% CI (paired)", ""),
    ("kl", "KL(ref‖q) nats/token", ".5f"),
    ("top1", "top-1 agreement", ".2%"),
    ("kv_bytes", "KV bytes/token", "d"),
    ("kv_ratio", "KV vs fp16", ".3f"),
]


def write_outputs(rows: list[dict], out: Path, stem: str, title: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    md = f"{title}\n\n" + format_table(rows, QUALITY_COLUMNS) + "\n"
    (out / f"{stem}.md").write_text(md)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return md


# ---- the whole run ------------------------------------------------------------------------------
def run_quality(
    hf_model,
    tokens: torch.Tensor,
    variant_names: Sequence[str],
    *,
    seq_len: int,
    max_tokens: int | None,
    batch_size: int,
    calib_tokens: torch.Tensor | None,
    device,
    dtype,
    ref_label: str,
    progress: bool = True,
    log=print,
    spread: bool = False,
    build: Callable[[QuantConfig], QuantizedLlamaForCausalLM] | None = None,
) -> list[dict]:
    """Quantize ``hf_model`` into each variant, evaluate all against ``hf_model`` on ``tokens``;
    returns table rows (the reference first). ``spread``: ``max_tokens // seq_len`` windows
    spread evenly over all of ``tokens`` (``spread_windows``) instead of the first ``max_tokens``.
    ``build``: makes each variant's model from its ``QuantConfig`` instead of quantizing
    ``hf_model`` (a quantized checkpoint whose variants are KV-cache choices); the rows are then
    labelled with the built model's ``qcfg.label()``."""
    from .quantize import calibrate, hf_parts, quantize

    if spread:
        nwin = tokens.numel() // seq_len if max_tokens is None else min(max_tokens, tokens.numel()) // seq_len
        wins = spread_windows(tokens, seq_len, nwin)
        log(f"evaluating {nwin} windows x {seq_len} tokens spread over {tokens.numel()} tokens on {device}")
    else:
        wins = windows(tokens, seq_len, max_tokens)
        log(f"evaluating {wins.shape[0]} windows x {seq_len} tokens on {device}")
    cfgs = {n: parse_variant(n) for n in variant_names}
    for n in [n for n, c in cfgs.items() if missing_kernels(c, device)]:
        log(f"skipping {n}: this build has no CUDA kernel for {', '.join(missing_kernels(cfgs.pop(n), device))}")
    stats = None
    if build is None and any(c.needs_calibration for c in cfgs.values()):
        if calib_tokens is None:
            raise ValueError("calibration tokens needed for SmoothQuant / static variants")
        sd, args, inv_freq, scaling = hf_parts(hf_model)
        t0 = time.perf_counter()
        stats = calibrate(
            sd,
            args,
            calib_tokens,
            seq_len=min(512, seq_len),
            device=device,
            inv_freq=inv_freq,
            attention_scaling=scaling,
            progress=progress,
        )
        log(f"calibrated on {calib_tokens.numel()} tokens in {time.perf_counter() - t0:.1f} s")
    models: dict[str, QuantizedLlamaForCausalLM] = {}
    for name, cfg in cfgs.items():
        if build is not None:
            m = build(cfg)
            models[m.qcfg.label()] = m
        else:
            models[name] = quantize(hf_model, config=cfg, dtype=dtype, device=device, stats=stats, progress=progress)
    fns = {n: (lambda ids, m=m: m.score(ids)) for n, m in models.items()}
    res = evaluate(hf_logits_fn(hf_model), fns, wins, batch_size=batch_size, device=device, progress=progress)
    fp16_kv = next(iter(models.values())).args if models else None
    rows = []
    ref_ppl = res["reference"]["ppl"]
    for name, r in res.items():
        row = {"variant": ref_label if name == "reference" else name, **r}
        row["dppl"] = r["ppl"] / ref_ppl - 1.0
        if name != "reference":
            m = models[name]
            row["kv_bytes"] = m.kv_bytes_per_token(seq_len)
            a = m.args
            row["kv_ratio"] = row["kv_bytes"] / (2 * a.num_layers * a.num_kv_heads * a.head_dim * 2)
            row["weight_bytes"] = m.weight_bytes()
        elif fp16_kv is not None:
            a = fp16_kv
            row["kv_bytes"] = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 2
            row["kv_ratio"] = 1.0
        rows.append(row)
    return rows


DEFAULT_VARIANTS = (
    "fp16,KV8,KV8-static,KV4,KV4-w128s4,KV4-g4,KV4-g4-w128s4,W8A8,W8A8+SQ0.5,W8A8+KV8,"
    "W8A8+KV8+SQ0.5,W8A8+KV4-w128s4+SQ0.5,W8A8+KV8-static+SQ0.5,W8A8-static+KV8+SQ0.5,"
    "W4A16-g64,W4A16-g64+KV8"
)
# a compressed-tensors checkpoint's variants: KV-cache choices that need no calibration
DEFAULT_KV_VARIANTS = "fp16,KV8,KV4,KV4-w128s4,KV4-g4,KV4-g4-w128s4"


def _error(msg: str) -> int:
    print(f"python -m qops.llama.eval: error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    """The command line; returns the exit status (2: a bad model path, text or variant)."""
    p = argparse.ArgumentParser(
        prog="python -m qops.llama.eval",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model folder or a llama .gguf file (float weights, quantized into each variant), or a "
        "compressed-tensors checkpoint folder (the variants are then KV-cache choices: fp16, KV8, KV4...; the "
        "reference is transformers' dequantized load of it); default: the bundled SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--text",
        default="jargon",
        help="jargon (Debian's file, else the bundled excerpt), excerpt, or a path to a .txt/.txt.gz",
    )
    p.add_argument(
        "--layout",
        choices=("spread", "first"),
        default="spread",
        help="spread: --tokens // --seq-len windows spread evenly over the text (default); first: the first "
        "--tokens tokens (the layout of the tables in docs/llama_results.md)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="evaluate at most this many tokens (default: 300000 on GPU, 1024 on CPU)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="window length (default 1024 GPU, 256 CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="windows per batch (default 8 GPU, 2 CPU)")
    p.add_argument("--skip-tokens", type=int, default=0, help="start the evaluation this many tokens into the text")
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=2048,
        help="calibration tokens (SQ/static variants), taken from the end of the text",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated variant labels (QuantConfig.from_label: fp16, W8A8[-static], "
        "W4A16[-g64][-asym] (int4 weights, groups of 128 or 64; SmolLM2 needs -g64), KV8[-static], "
        "KV4[-g4][-w<window>s<sinks>][-c<clip>], +SQ<alpha>); default: " + DEFAULT_VARIANTS + "; for a "
        "compressed-tensors checkpoint (KV-cache choices without calibration): " + DEFAULT_KV_VARIANTS,
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float16", "bfloat16"],
        help="activation dtype (default: float16; a compressed-tensors --model: its torch_dtype)",
    )
    p.add_argument("--out", default="bench/out")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    from .data import jargon_tokens, load_text, tokenize
    from .sources import load_quantized, load_reference, load_tokenizer, resolve

    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    if gpu:
        require_cuda("qops.llama.eval", "for --device cuda; --device cpu runs the reference ops")
    tokens_n = a.tokens or (300_000 if gpu else 1024)
    seq_len = a.seq_len or (1024 if gpu else 256)
    bsz = a.batch_size or (8 if gpu else 2)
    try:
        src = resolve(a.model)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    # the variants, checked before anything is loaded
    names = [n.strip() for n in (a.variants or (DEFAULT_KV_VARIANTS if src.quantized else DEFAULT_VARIANTS)).split(",")]
    for n in names:
        try:
            cfg = parse_variant(n)
        except ValueError as e:
            return _error(f"--variants: {e}")
        if src.quantized and (cfg.weights is not False or cfg.needs_calibration):
            return _error(
                f"variant {n!r}: the variants of a compressed-tensors checkpoint are KV-cache choices without "
                f"calibration ({DEFAULT_KV_VARIANTS.replace(',', ', ')}, ...)"
            )
    # --dtype: a compressed-tensors checkpoint keeps its torch_dtype unless given; else float16
    if a.dtype is not None:
        dtype = getattr(torch, a.dtype)
    elif src.quantized and src.path is not None:
        from .compressed import checkpoint_dtype

        dtype = checkpoint_dtype(src.path)
    else:
        dtype = torch.float16
    try:
        tok = load_tokenizer(src)
        if a.text == "jargon":
            toks, source = jargon_tokens(tok)
        else:
            text, source = load_text(a.text)
            toks = tokenize(tok, text)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    calib = toks[-a.calib_tokens :] if a.calib_tokens else None
    evalt = toks[a.skip_tokens : max(0, toks.numel() - (a.calib_tokens or 0))]
    ref_dtype = dtype if gpu else torch.float32
    model = load_reference(src, dtype=ref_dtype, device=dev, progress=not a.no_progress)
    ref_label = f"{'fp16' if ref_dtype == torch.float16 else str(ref_dtype).replace('torch.', '')} (HF reference)"
    build = None
    if src.quantized:
        ref_label = ref_label.replace("(HF reference)", "(HF, the checkpoint dequantized)")

        def build(cfg: QuantConfig):
            kv = {f: getattr(cfg, f) for f in ("kv_cache", "kv_groups", "kv_window", "kv_sinks", "kv_clip")}
            return load_quantized(src, device=dev, dtype=dtype, **kv).eval()

    t0 = time.perf_counter()
    rows = run_quality(
        model,
        evalt,
        names,
        seq_len=seq_len,
        max_tokens=tokens_n,
        batch_size=bsz,
        calib_tokens=calib,
        device=dev,
        dtype=dtype,
        ref_label=ref_label,
        progress=not a.no_progress,
        spread=a.layout == "spread",
        build=build,
    )
    n = rows[0]["tokens"]
    where = torch.cuda.get_device_name(dev) if gpu else "CPU (reference ops)"
    if a.skip_tokens:
        source += f" from token {a.skip_tokens}"
    nw = rows[0]["windows"]
    layout = f"spread over {evalt.numel()} tokens" if a.layout == "spread" else "from its start"
    title = (
        f"### {src.name} quality, {source}: {n} predicted tokens in {nw} windows of {seq_len} {layout} "
        f"({where}, activations {str(dtype).replace('torch.', '')}; {time.perf_counter() - t0:.0f} s; "
        f"95% CIs: bootstrap over windows)"
    )
    print(write_outputs(rows, Path(a.out), "quality_gpu" if gpu else "quality_cpu", title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
