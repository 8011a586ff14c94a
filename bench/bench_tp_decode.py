"""Decode steps of the tensor-parallel quantized Llama (qops.llama.parallel) at TP 1/2/4, and the
share of the step spent in its collectives.

Launch once per TP size (each run appends its rows to one CSV):

    torchrun --nproc-per-node 1 -m bench.bench_tp_decode [--models llama2-7b,llama2-13b]
    torchrun --nproc-per-node 2 -m bench.bench_tp_decode ...
    torchrun --nproc-per-node 4 -m bench.bench_tp_decode ... [--cuda-graph] [--out DIR]

Each rank builds its shard of a random-weight model of a bench/shapes.py shape (``RandomSource``,
quantized layer by layer on its GPU), fills the KV cache with random K/V to ``--context`` tokens,
and times ``--steps`` greedy decode steps (median wall time of a synchronized step; the slowest
rank's median is reported). The same model is then timed with its collectives replaced by local
stand-ins of the same shapes (``TPGroup(collectives=False)``: no all-reduce; the all-gather of the
logits repeats the local shard): ``comm_share = 1 - t(no collectives) / t(with)`` is the share of
the step that the collectives (and the waits on the slowest rank they imply) cost. Its tokens are
meaningless (ranks disagree without their collectives), its timing is the model's compute.

``--device cpu`` runs the same on the CPU over gloo with the reference ops (a smoke test of the
script: the times say nothing about the kernels). Without CUDA and without ``--device cpu`` it
prints why and exits with status 2.

``floor_ms`` is the rank's byte floor: its weight bytes and its KV cache at the context, read once
at the copy bandwidth measured in the same run (``of_floor`` = floor / step).

Writes ``tp_decode.csv`` (appended) and ``tp_decode.md`` (this run's rows) to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.shapes import MODELS
from qops.llama import QuantConfig
from qops.llama.config import LlamaArgs
from qops.llama.eval import format_table
from qops.llama.parallel import RandomSource, build_tp_model, init_tp
from qops.llama.timing import time_qops_decode
from qops.testing import copy_bandwidth_gbps, require_cuda


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama2-7b", help=f"bench/shapes.py names: {', '.join(MODELS)}")
    p.add_argument("--variant", default="W8A8+KV8", help="QuantConfig label (W8A8+KV8, W4A16+KV8, ...)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=None, help="override the layer count (quicker runs)")
    p.add_argument("--cuda-graph", action="store_true", help="replay each decode step as a CUDA graph")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    if a.device == "cuda":
        require_cuda(
            "bench.bench_tp_decode",
            "one GPU per rank, launched with torchrun --nproc-per-node N; --device cpu runs the reference ops over "
            "gloo, a smoke test",
        )
    if a.cuda_graph and a.device != "cuda":
        print("bench.bench_tp_decode: --cuda-graph needs --device cuda", file=sys.stderr)
        return 2
    tp, dev = init_tp(device=a.device)
    qcfg = QuantConfig.from_label(a.variant)
    copy_gbps = copy_bandwidth_gbps() if dev.type == "cuda" else float("nan")
    rows: list[dict] = []
    for name in a.models.split(","):
        shape = MODELS[name].hf_config()
        if a.layers:
            shape["num_hidden_layers"] = a.layers
        args = LlamaArgs.from_hf(argparse.Namespace(**shape))
        t0 = time.perf_counter()
        model = build_tp_model(RandomSource(args, device=dev), args, qcfg, tp, dtype=torch.float16, device=dev)
        if tp.rank == 0:
            print(f"== {name} {qcfg.label()} TP {tp.world_size}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        for b in _ints(a.batches):
            ms = {}
            for comm in (True, False):
                tp.collectives = comm
                t = time_qops_decode(
                    model, b, a.context, steps=a.steps, warmup=a.warmup, fill="random", cuda_graph=a.cuda_graph
                )
                x = torch.tensor([t.step_ms_median], dtype=torch.float64, device=dev)
                if tp.world_size > 1:
                    dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the slowest rank's median
                ms[comm] = float(x.item())
            tp.collectives = True
            # the rank's byte floor: its weights and its KV cache read once at copy bandwidth
            step_bytes = model.weight_bytes() + b * a.context * model.kv_bytes_per_token()
            floor_ms = step_bytes / (copy_gbps * 1e9) * 1e3
            row = {
                "model": name,
                "variant": qcfg.label(),
                "tp": tp.world_size,
                "batch": b,
                "context": a.context,
                "graph": a.cuda_graph,
                "step_ms": ms[True],
                "step_ms_no_comm": ms[False],
                "comm_share": (1 - ms[False] / ms[True]) if tp.world_size > 1 else 0.0,
                "tokens_per_s": b / ms[True] * 1e3,
                "weight_mib_per_rank": model.weight_bytes() / 2**20,
                "step_mib_per_rank": step_bytes / 2**20,
                "copy_gbps": copy_gbps,
                "floor_ms": floor_ms,
                "of_floor": floor_ms / ms[True],
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            }
            rows.append(row)
            if tp.rank == 0:
                print(
                    f"  batch {b:4d}: {row['step_ms']:.3f} ms/step ({row['tokens_per_s']:.0f} tok/s), "
                    f"without collectives {row['step_ms_no_comm']:.3f} ms: collectives {row['comm_share']:.1%}; "
                    f"byte floor {floor_ms:.3f} ms ({row['of_floor']:.2f} of it)",
                    flush=True,
                )
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if tp.rank == 0 and rows:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "tp_decode.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
        cols = [
            ("model", "model", ""),
            ("variant", "variant", ""),
            ("tp", "TP", "d"),
            ("batch", "batch", "d"),
            ("step_ms", "ms/step", ".3f"),
            ("step_ms_no_comm", "ms/step w/o collectives", ".3f"),
            ("comm_share", "collectives", ".1%"),
            ("tokens_per_s", "tok/s", ".0f"),
            ("floor_ms", "byte floor ms", ".3f"),
            ("of_floor", "floor / step", ".2f"),
        ]
        table = format_table(rows, cols)
        (out / f"tp_decode_tp{tp.world_size}.md").write_text(table + "\n")
        print(table)
        print(f"appended to {path}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
