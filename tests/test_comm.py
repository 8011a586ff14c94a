"""allreduce_add_rms_norm(_quant): the fused all-reduce + residual + RMSNorm (+ int8 quant) of
tensor parallelism (python/qops/comm.py, csrc/comm/). The CPU reference holds one rank; on one GPU
the kernel runs at world 1 against it, and at world 2 and 4 with every rank's kernel on its own
stream of the same GPU (buffers in ordinary device memory: the same protocol, peers being other
streams), each in a subprocess with a timeout (a broken barrier hangs rather than fails)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import qops
from qops.comm import SymmetricWorkspace
from qops.testing import poison_cuda_allocator

HALF = (torch.float16, torch.bfloat16)
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(t, h, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    r = torch.randn(t, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return x.to(device), r.to(device), w.to(device)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("static", [False, True])
def test_world1_reference_is_the_fused_norm(dtype, static):
    x, r, w = _inputs(5, 64, dtype, 1)
    ws = SymmetricWorkspace.local(8, 64, "cpu")
    scale = torch.tensor([0.03]) if static else None
    r1, r2 = r.clone(), r.clone()
    q1, s1 = qops.allreduce_add_rms_norm_quant(x, r1, w, 1e-6, scale, ws)
    q2, s2 = qops.fused_add_rms_norm_quant(x, r2, w, 1e-6, scale)
    assert torch.equal(q1, q2) and torch.equal(s1, s2) and torch.equal(r1, r2)
    r1, r2 = r.clone(), r.clone()
    assert torch.equal(qops.allreduce_add_rms_norm(x, r1, w, 1e-6, ws), qops.fused_add_rms_norm(x, r2, w, 1e-6))
    assert torch.equal(r1, r2)


def test_errors():
    x, r, w = _inputs(4, 64, torch.float16, 2)
    ws = SymmetricWorkspace.local(8, 64, "cpu")
    two = SymmetricWorkspace.simulated(2, 8, 64, "cpu")[0]
    with pytest.raises(ValueError, match="one rank"):
        qops.allreduce_add_rms_norm(x, r, w, 1e-6, two)
    with pytest.raises(ValueError, match="do not fit"):
        qops.allreduce_add_rms_norm(*_inputs(9, 64, torch.float16, 3), 1e-6, ws)
    with pytest.raises(ValueError, match="multiple of 8"):
        qops.allreduce_add_rms_norm(*_inputs(2, 60, torch.float16, 3), 1e-6, SymmetricWorkspace.local(2, 60, "cpu"))
    with pytest.raises(TypeError):
        qops.allreduce_add_rms_norm(x.float(), r.float(), w.float(), 1e-6, ws)
    bad = SymmetricWorkspace(ws.buffers, 1, ws.buffer_bytes)
    with pytest.raises(ValueError, match="rank must be in"):
        qops.allreduce_add_rms_norm(x, r, w, 1e-6, bad)


# ---- CUDA ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("t,h", [(1, 4096), (7, 2048), (64, 8192), (130, 512), (3, 16384)])
@pytest.mark.parametrize("quant", ["dynamic", "static", "float"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_cuda_world1(dtype, t, h, quant, device):
    """One rank: the kernel against the CPU reference (the norm kernels' tolerance: int8 within 1,
    the float output within one rounding; the residual exactly)."""
    x, r, w = _inputs(t, h, dtype, t + h)
    ws = SymmetricWorkspace.local(256, h, device)
    rc, rr = r.to(device), r.clone()
    poison_cuda_allocator()
    if quant == "float":
        out = qops.allreduce_add_rms_norm(x.to(device), rc, w.to(device), 1e-6, ws)
        ref = qops.fused_add_rms_norm(x, rr, w, 1e-6)
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-7, atol=1e-3)
    else:
        scale = torch.tensor([0.02]) if quant == "static" else None
        q, s = qops.allreduce_add_rms_norm_quant(
            x.to(device), rc, w.to(device), 1e-6, None if scale is None else scale.to(device), ws
        )
        q2, s2 = qops.fused_add_rms_norm_quant(x, rr, w, 1e-6, scale)
        assert (q.cpu().int() - q2.int()).abs().max() <= 1
        torch.testing.assert_close(s.cpu(), s2, rtol=1e-6, atol=0)
    assert torch.equal(rc.cpu(), rr)


SIMULATED = textwrap.dedent(
    """
    import sys, torch, qops
    from qops.comm import SymmetricWorkspace
    world, t, h = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    quant, dtype = sys.argv[4], getattr(torch, sys.argv[5])
    g = torch.Generator().manual_seed(world * 100 + t)
    parts = [torch.randn(t, h, generator=g).to(dtype) for _ in range(world)]
    res = torch.randn(t, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    wss = SymmetricWorkspace.simulated(world, 128, h, "cuda")
    streams = [torch.cuda.Stream() for _ in range(world)]
    # the reference: the rank-order float32 sum, rounded, then the norm on the CPU
    x = torch.zeros(t, h)
    for p in parts:
        x += p.float()
    x = x.to(dtype)
    xs, wc = [p.cuda() for p in parts], w.cuda()
    for it in range(3):  # every call a new epoch: call again
        # every input in place before the first launch: a rank's kernel waits in its barrier until
        # all have started, and an allocation or copy between the launches could serialize them
        rs = [res.cuda() for _ in range(world)]
        outs = [None] * world
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                xr, wr = xs[r], wc
                if quant == "float":
                    outs[r] = qops.allreduce_add_rms_norm(xr, rs[r], wr, 1e-6, wss[r])
                else:
                    outs[r] = qops.allreduce_add_rms_norm_quant(xr, rs[r], wr, 1e-6, None, wss[r])
        torch.cuda.synchronize()
        rr = res.clone()
        if quant == "float":
            ref = qops.fused_add_rms_norm(x, rr, w, 1e-6)
            for r in range(world):
                assert torch.equal(outs[r].cpu(), outs[0].cpu()), "ranks differ"
            torch.testing.assert_close(outs[0].cpu().float(), ref.float(), rtol=2 ** -7, atol=1e-3)
        else:
            q2, s2 = qops.fused_add_rms_norm_quant(x, rr, w, 1e-6)
            for r in range(world):
                assert torch.equal(outs[r][0].cpu(), outs[0][0].cpu()), "ranks differ"
            assert (outs[0][0].cpu().int() - q2.int()).abs().max() <= 1
            torch.testing.assert_close(outs[0][1].cpu(), s2, rtol=1e-6, atol=0)
        for r in range(world):
            assert torch.equal(rs[r].cpu(), rr), "residual"
    print("ok")
    """
)


@pytest.mark.parametrize("world", [2, 4])
# world x min(T, 64) blocks must all be resident on the one GPU (two per SM): T <= 32 at world 4
@pytest.mark.parametrize("t,h,quant,dtype", [(1, 4096, "dynamic", "bfloat16"), (16, 8192, "float", "float16"),
                                             (32, 1024, "dynamic", "float16")])  # fmt: skip
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_cuda_simulated_ranks(world, t, h, quant, dtype, device):
    """``world`` ranks as streams of one GPU: every rank's output bit-identical, equal to the
    reference on the rank-order sum, three calls in a row (the flags return to zero)."""
    proc = subprocess.run(
        [sys.executable, "-c", SIMULATED, str(world), str(t), str(h), quant, dtype],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
