"""Run one W4A16 GEMM a few times eagerly, for a profiler (ncu) or compute-sanitizer.

python -m tools.ncu_w4a16_case --n 12288 --k 4096 --m 1 [--group 128] [--zeros] [--dtype bf16]
ncu --set full -k regex:gemv_kernel --launch-skip 2 --launch-count 1 python3 -m tools.ncu_w4a16_case ...
"""

import argparse

import torch

import qops
from qops.w4a16 import n_major, quantize_weight_int4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--group", type=int, default=128, choices=[64, 128])
    ap.add_argument("--zeros", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--config", default="auto")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k, dtype=dtype, device="cuda") * 0.02
    q, s, z = quantize_weight_int4(w, args.group, args.zeros, dtype=dtype)
    packed = qops.w4a16_prepack(q)
    s = n_major(s)
    z = n_major(z) if z is not None else None
    a = torch.randn(args.m, args.k, dtype=dtype, device="cuda")
    for _ in range(args.iters):
        out = qops.w4a16_gemm(a, packed, s, z, args.group, config=args.config)
    torch.cuda.synchronize()
    print(f"w4a16 N={args.n} K={args.k} M={args.m}: out {tuple(out.shape)} finite={bool(out.isfinite().all())}")


if __name__ == "__main__":
    main()
