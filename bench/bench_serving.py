"""Serving a stream of requests: continuous batching with chunked prefill (mixed steps) against
static batching, on the same quantized model and the same requests, in one run.

Requests have random prompt and output lengths (uniform in ``--prompt-len`` and ``--output-len``)
and arrive at once (``--rate 0``) or as a Poisson stream of ``--rate`` requests per second. Both
servers decode greedily and stop a request at its own output length:

- **static**: batches of up to ``--batch`` arrived requests, each batch served to completion by
  ``qops.llama.generate`` (one prefill of the whole prompts, then decode steps until the batch's
  longest output is done; a finished request's tokens past its length are wasted work) before the
  next batch starts;
- **continuous**: up to ``--batch`` requests in flight; every step (``model.step``) carries the
  next prompt chunk (at most ``--chunk`` tokens) of each request still in prefill and the next
  token of each request in decode, and a finished request's place goes to the next arrived one.

Reports requests/s, output tokens/s, time to first token (TTFT: arrival to first token) and time
per output token after the first (TPOT), p50 / p90 over requests. Models: bench/shapes.py names
with random weights (``tiny`` for a CPU smoke run). Writes ``serving.csv``.

    python -m bench.bench_serving [--model llama2-7b] [--variant W8A8+KV8] [--requests 64]
        [--batch 16] [--chunk 512] [--prompt-len 64,1024] [--output-len 16,256] [--rate 0]
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.bench_llama_decode import SHAPES, random_hf_model
from qops.llama import QuantConfig, generate, quantize
from qops.llama.eval import format_table
from qops.testing import require_cuda


@dataclass
class Request:
    rid: int
    arrival: float  # seconds after the start
    prompt: list[int]
    max_new: int
    first: float | None = None  # time of the first output token
    done: float | None = None
    tokens: list[int] = field(default_factory=list)


def make_requests(n: int, vocab: int, prompt_len, output_len, rate: float, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate > 0:
            t += rng.expovariate(rate)
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))]
        out.append(Request(i, t, p, rng.randint(*output_len)))
    return out


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def serve_static(model, reqs: list[Request], batch: int) -> float:
    """Batches of up to ``batch`` arrived requests, each run to completion by ``generate``."""
    dev = model.device
    _sync(dev)
    t0 = time.perf_counter()
    queue = list(reqs)
    while queue:
        now = time.perf_counter() - t0
        if queue[0].arrival > now:
            time.sleep(queue[0].arrival - now)
            now = time.perf_counter() - t0
        group = [r for r in queue[:batch] if r.arrival <= now]
        queue = queue[len(group) :]
        start = time.perf_counter() - t0
        res = generate(model, [r.prompt for r in group], max(r.max_new for r in group))
        for r, toks in zip(group, res.tokens):
            r.tokens = toks[: r.max_new]
            r.first = start + res.prefill_s
            # the request's last token came out at its step of the batch's decode loop
            steps = len(r.tokens) - 1
            r.done = r.first + (sum(res.step_times[:steps]) if steps else 0.0)
    return time.perf_counter() - t0


def serve_continuous(model, reqs: list[Request], batch: int, chunk: int) -> float:
    """Up to ``batch`` requests in flight; each step carries prompt chunks and decode tokens."""
    dev = model.device
    longest = max(len(r.prompt) + r.max_new for r in reqs)
    cache = model.cache_for([longest] * batch)
    _sync(dev)
    t0 = time.perf_counter()
    waiting = list(reqs)
    running: list[Request] = []
    fed: dict[int, int] = {}  # prompt tokens in the cache
    while waiting or running:
        now = time.perf_counter() - t0
        while waiting and len(running) < batch and waiting[0].arrival <= now:
            r = waiting.pop(0)
            running.append(r)
            fed[r.rid] = 0
        if not running:
            time.sleep(max(0.0, waiting[0].arrival - now))
            continue
        rows = [
            r.prompt[fed[r.rid] : fed[r.rid] + chunk] if fed[r.rid] < len(r.prompt) else [r.tokens[-1]] for r in running
        ]
        logits = model.step(rows, [r.rid for r in running], cache)
        nxt = logits.argmax(-1).tolist()  # synchronizes
        now = time.perf_counter() - t0
        still = []
        for r, row, t in zip(running, rows, nxt):
            if fed[r.rid] < len(r.prompt):
                fed[r.rid] += len(row)
                if fed[r.rid] < len(r.prompt):
                    still.append(r)
                    continue
                r.first = now
            r.tokens.append(t)
            if len(r.tokens) >= r.max_new:
                r.done = now
                cache.free(r.rid)
            else:
                still.append(r)
        running = still
    return time.perf_counter() - t0


def summarize(mode: str, reqs: list[Request], wall: float) -> dict:
    ttft = [r.first - r.arrival for r in reqs if r.first is not None]
    tpot = [
        (r.done - r.first) / (len(r.tokens) - 1)
        for r in reqs
        if r.done is not None and r.first is not None and len(r.tokens) > 1
    ]

    def q(xs, p):
        return statistics.quantiles(xs, n=10)[p // 10 - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))

    out_tokens = sum(len(r.tokens) for r in reqs)
    return {
        "mode": mode,
        "requests": len(reqs),
        "wall_s": wall,
        "req_per_s": len(reqs) / wall,
        "out_tok_per_s": out_tokens / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * q(ttft, 90),
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
        "tpot_p90_ms": 1e3 * q(tpot, 90) if tpot else float("nan"),
    }


def _range(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected lo,hi with 1 <= lo <= hi, got {s!r}")
    return lo, hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--variant", default="W8A8+KV8", help="QuantConfig label (not SKVQ: mixed steps)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="requests in flight (continuous) / per batch (static)")
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens per request and step (continuous)")
    p.add_argument("--prompt-len", type=_range, default=(64, 1024))
    p.add_argument("--output-len", type=_range, default=(16, 256))
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--modes", default="static,continuous")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/out")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        require_cuda("bench.bench_serving", "for --device cuda; --device cpu runs the reference ops")
    qcfg = QuantConfig.from_label(a.variant)
    dtype = torch.float16
    hf = random_hf_model(SHAPES[a.model], dev, dtype)
    model = quantize(hf, config=qcfg, dtype=dtype, device=dev, progress=False)
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(f"{a.model} {qcfg.label()} on {dev}: {a.requests} requests, batch {a.batch}, chunk {a.chunk}", flush=True)
    generate(model, [[1, 2, 3]], 2)  # warm-up (allocator, kernels)
    rows, outputs = [], {}
    for mode in a.modes.split(","):
        reqs = make_requests(a.requests, model.args.vocab_size, a.prompt_len, a.output_len, a.rate)
        if mode == "static":
            wall = serve_static(model, reqs, a.batch)
        elif mode == "continuous":
            wall = serve_continuous(model, reqs, a.batch, a.chunk)
        else:
            p.error(f"--modes: unknown mode {mode!r} (static, continuous)")
        rows.append(summarize(mode, reqs, wall))
        outputs[mode] = [r.tokens for r in reqs]
        r = rows[-1]
        print(
            f"  {mode:10s} {r['wall_s']:7.2f} s  {r['req_per_s']:6.2f} req/s  {r['out_tok_per_s']:8.1f} tok/s  "
            f"TTFT p50 {r['ttft_p50_ms']:8.1f} ms  TPOT p50 {r['tpot_p50_ms']:6.2f} ms",
            flush=True,
        )
    if len(outputs) == 2:
        pairs = list(zip(*outputs.values()))
        same = sum(x == y for x, y in pairs)
        # the first token comes from the prefill alone (static: over the fresh K/V; continuous: over
        # the cache, as chunks): where it differs, so will the rest; the common prefix shows how
        # far the two agree before near-tied logits (random weights) tip them apart
        first = sum(x[:1] == y[:1] for x, y in pairs)
        prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in pairs]
        print(
            f"  greedy outputs identical in both modes: {same}/{a.requests} requests; first token "
            f"{first}/{a.requests}; common prefix median {sorted(prefix)[len(prefix) // 2]} tokens",
            flush=True,
        )
        for r in rows:
            r["identical_outputs"] = same
            r["identical_first_token"] = first
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serving.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = [
        ("mode", "mode", ""),
        ("req_per_s", "req/s", ".2f"),
        ("out_tok_per_s", "out tok/s", ".1f"),
        ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
        ("ttft_p90_ms", "TTFT p90 ms", ".1f"),
        ("tpot_p50_ms", "TPOT p50 ms", ".2f"),
        ("tpot_p90_ms", "TPOT p90 ms", ".2f"),
    ]
    print(format_table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
