"""quant_per_token / quant_per_tensor against torch.compile of the reference, in one run.

Reports GB/s of the bytes that must move (read the input once, write int8 and the scales) and the
fraction of the measured device-to-device copy bandwidth.

Run from the repository root:

    python -m bench.bench_quant --out bench/out
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import qops
from qops.quantization import quantize_int8, quantize_per_token
from qops.testing import (
    bar_plot,
    bench_us,
    copy_bandwidth_gbps,
    gbps,
    l2_rotation_sets,
    print_table,
    require_cuda,
    write_csv,
)

TOKENS = [1, 16, 128, 4096, 16384]
HIDDEN = [4096, 8192, 14336]  # a sweep of row lengths (the Llama hidden and intermediate sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    args = p.parse_args()
    require_cuda("bench.bench_quant")
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    copy = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy:.0f} GB/s")

    compiled_tok = torch.compile(lambda x: quantize_per_token(x.float()), dynamic=False)
    compiled_ten = torch.compile(lambda x, s: quantize_int8(x.float(), s), dynamic=False)
    rows = []
    for h in HIDDEN:
        for t in TOKENS:
            nbytes_in = t * h * dtype.itemsize
            n_sets = l2_rotation_sets(nbytes_in)
            xs = [torch.randn(t, h, device="cuda", dtype=dtype) for _ in range(n_sets)]
            scale = torch.tensor([0.02], device="cuda")
            moved_tok = nbytes_in + t * h + 4 * t
            moved_ten = nbytes_in + t * h + 4
            us = {
                "per_token": bench_us(lambda i: lambda: qops.quant_per_token(xs[i]), n_sets),
                "per_token_compile": bench_us(lambda i: lambda: compiled_tok(xs[i]), n_sets),
                "per_tensor": bench_us(lambda i: lambda: qops.quant_per_tensor(xs[i], scale), n_sets),
                "per_tensor_compile": bench_us(lambda i: lambda: compiled_ten(xs[i], scale), n_sets),
            }
            r = {"T": t, "H": h}
            for k, v in us.items():
                moved = moved_tok if k.startswith("per_token") else moved_ten
                r[f"{k}_us"] = v
                r[f"{k}_GBps"] = gbps(moved, v)
            r["per_token_frac_copy"] = r["per_token_GBps"] / copy
            r["per_token_vs_compile"] = us["per_token_compile"] / us["per_token"]
            r["per_tensor_frac_copy"] = r["per_tensor_GBps"] / copy
            r["per_tensor_vs_compile"] = us["per_tensor_compile"] / us["per_tensor"]
            rows.append(r)
    write_csv(rows, os.path.join(args.out, "bench_quant.csv"))
    for r in rows:
        r["shape"] = f"{r['T']}x{r['H']}"
    bar_plot(
        rows,
        "shape",
        ["per_token_GBps", "per_token_compile_GBps", "per_tensor_GBps"],
        f"int8 quant ({args.dtype}), copy = {copy:.0f} GB/s",
        "GB/s moved",
        os.path.join(args.out, "bench_quant.png"),
    )
    print_table(
        rows,
        [
            "T",
            "H",
            "per_token_us",
            "per_token_GBps",
            "per_token_frac_copy",
            "per_token_compile_us",
            "per_token_vs_compile",
            "per_tensor_us",
            "per_tensor_frac_copy",
            "per_tensor_vs_compile",
        ],
    )


if __name__ == "__main__":
    sys.exit(main())
