"""The fused all-reduce + residual + RMSNorm + int8 quant kernel (``qops.allreduce_add_rms_norm_quant``)
against NCCL's all-reduce of the same bf16 message alone and followed by the fused norm op
(``qops.fused_add_rms_norm_quant``), on every GPU of one host:

    python -m torch.distributed.run --nproc-per-node N -m bench.bench_allreduce_norm [--tokens 1,8,...]

Each variant is captured as a CUDA graph of ``--calls`` calls and replayed; the median replay over
the calls is its time per call (microseconds, rank 0's clock; every rank runs the same graphs).
Target (issue 44): the fused kernel <= 1.2x the plain all-reduce at <= 64 tokens, and faster than
all-reduce + norm. Rank 0 prints the table and writes ``allreduce_norm.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics

import torch
import torch.distributed as dist

import qops
from qops.comm import SymmetricWorkspace
from qops.testing import require_cuda


def graph_us(fn, calls: int, replays: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,4,16,32,64,128,256")
    p.add_argument("--hidden", default="4096,8192")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default="bench/out")
    a = p.parse_args()
    require_cuda("bench.bench_allreduce_norm", "it times CUDA collectives")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = [int(t) for t in a.tokens.split(",")]
    hiddens = [int(h) for h in a.hidden.split(",")]
    ws = SymmetricWorkspace.allocate(dist.group.WORLD, max(tokens), max(hiddens), dev)
    if ws is None and rank == 0:
        print("symmetric memory unavailable here: only the NCCL rows are timed", flush=True)
    rows = []
    for h in hiddens:
        w = torch.ones(h, dtype=torch.bfloat16, device=dev)
        for t in tokens:
            x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
            res = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
            r = {"world": world, "T": t, "H": h, "MB": t * h * 2 / 1e6}
            r["nccl_us"] = graph_us(lambda: dist.all_reduce(x), a.calls, a.replays)
            r["nccl_norm_us"] = graph_us(
                lambda: (dist.all_reduce(x), qops.fused_add_rms_norm_quant(x, res, w, 1e-6, enable_pdl=False)),
                a.calls,
                a.replays,
            )
            if ws is not None:
                r["fused_us"] = graph_us(
                    lambda: qops.allreduce_add_rms_norm_quant(x, res, w, 1e-6, None, ws), a.calls, a.replays
                )
                r["fused_vs_nccl"] = r["fused_us"] / r["nccl_us"]
                r["fused_vs_nccl_norm"] = r["fused_us"] / r["nccl_norm_us"]
            rows.append(r)
            if rank == 0:
                line = (
                    f"world {world} T {t:4d} H {h:5d}: nccl {r['nccl_us']:7.1f} us, nccl+norm {r['nccl_norm_us']:7.1f}"
                )
                if "fused_us" in r:
                    line += f", fused {r['fused_us']:7.1f} ({r['fused_vs_nccl']:.2f}x nccl"
                    line += f", {r['fused_vs_nccl_norm']:.2f}x nccl+norm)"
                print(line, flush=True)
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "allreduce_norm.csv")
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(
                f,
                fieldnames=sorted(
                    {k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99
                ),
            )
            wr.writeheader()
            wr.writerows(rows)
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
