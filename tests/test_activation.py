"""silu_and_mul_quant: reference, fake, opcheck and CUDA-vs-reference tests.

The float64 reference at the top is independent of qops' own reference (python/qops/activation.py);
the CPU op (= qops' reference) is checked against it, and the CUDA kernel against qops' reference.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.activation import _silu_and_mul_quant_ref

FLOOR = 1e-10
HALF = [torch.float16, torch.bfloat16]


# ---- float64 reference ---------------------------------------------------------------------------
def ref64(x, scale=None):
    xd = x.double()
    i = xd.shape[-1] // 2
    g, u = xd[..., :i], xd[..., i:]
    y = g * torch.sigmoid(g) * u
    if scale is None:
        s = torch.clamp(y.abs().amax(-1) / 127, min=FLOOR)
        return torch.round(y / s[..., None]).clamp(-128, 127).to(torch.int8), s, y
    return torch.round(y / scale.double()).clamp(-128, 127).to(torch.int8), scale.double().reshape(1), y


def assert_q_close(q, q_ref, max_frac=None):
    assert q.dtype == torch.int8 and q.shape == q_ref.shape, (q.dtype, q.shape, q_ref.shape)
    if not q.numel():
        return
    d = (q.int() - q_ref.int()).abs()
    assert int(d.max()) <= 1, f"max |dq| = {int(d.max())}"
    if max_frac is not None:
        frac = (d > 0).float().mean().item()
        assert frac <= max_frac, f"{frac:.2e} of the outputs differ by one step"


def make(T, I, dtype, device="cpu", seed=0, extra=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(T, 2 * I + extra, generator=g) * 3).to(dtype)[:, : 2 * I]
    return x.to(device)


# ---- CPU --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("I", [8, 37, 1536])
@pytest.mark.parametrize("static", [False, True])
def test_reference_matches_float64(dtype, I, static):
    x = make(13, I, dtype)
    scale = torch.tensor([0.03]) if static else None
    q, s = qops.silu_and_mul_quant(x, scale)
    q64, s64, _ = ref64(x, scale)
    assert_q_close(q, q64, max_frac=2e-3)
    assert s.dtype == torch.float32 and s.shape == ((13,) if not static else (1,))
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=0)


def test_zero_rows_saturation_and_shapes():
    x = make(4, 64, torch.float16)
    x[1] = 0
    q, s = qops.silu_and_mul_quant(x)
    assert q.shape == (4, 64) and torch.all(q[1] == 0) and s[1].item() == pytest.approx(FLOOR)
    q, s = qops.silu_and_mul_quant(x, torch.tensor([1e-6]))
    y = ref64(x)[2]
    assert torch.all(q[y > 0] == 127) and torch.all(q[y < 0] == -128)
    q, s = qops.silu_and_mul_quant(torch.randn(2, 3, 32, dtype=torch.bfloat16))
    assert q.shape == (2, 3, 16) and s.shape == (2, 3)


@pytest.mark.parametrize("static", [False, True])
def test_opcheck(static):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    scale = torch.tensor([0.05]) if static else None
    torch.library.opcheck(torch.ops.qops.silu_and_mul_quant.default, (x, scale))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="input must be float16 or bfloat16"):
        qops.silu_and_mul_quant(x.float())
    with pytest.raises(ValueError, match="2\\*I"):
        qops.silu_and_mul_quant(torch.randn(4, 63, dtype=torch.float16))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        qops.silu_and_mul_quant(torch.randn(64, 4, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="scale must hold one element"):
        qops.silu_and_mul_quant(x, torch.ones(3))
    with pytest.raises(TypeError, match="scale must be float32"):
        qops.silu_and_mul_quant(x, torch.ones(1, dtype=torch.bfloat16))


def test_tuning_errors():
    """The CPU reference checks the launch options (FusedQuantTuning) as the CUDA glue does."""
    x = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"qops.silu_and_mul_quant: threads_per_row must be in \[0, 1024\]"):
        qops.silu_and_mul_quant(x, tuning=qops.FusedQuantTuning(threads_per_row=1025))
    with pytest.raises(
        ValueError,
        match=r"qops.silu_and_mul_quant: cluster must be 0 \(the kernel's choice\), "
        r"1, 2, 4 or 8, got 16",
    ):
        qops.silu_and_mul_quant(x, tuning=qops.FusedQuantTuning(cluster=16))
    q, s = qops.silu_and_mul_quant(x, tuning=qops.FusedQuantTuning(threads_per_row=128, cluster=2))
    q0, s0 = qops.silu_and_mul_quant(x)
    assert torch.equal(q, q0) and torch.equal(s, s0)  # no effect on the result


# ---- GPU --------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def poison_allocator(nbytes):
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(0x5A)
    del t


ACT_SIZES = [
    (1, 8),
    (3, 37),
    (17, 1536),
    (1025, 1536),
    (5, 11008),
    (16, 14336),
    (3, 28672),
    (4097, 2048),
    (64, 4100),
    (2, 13),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,I", ACT_SIZES)
@pytest.mark.parametrize("static", [False, True])
def test_cuda_matches_reference(dtype, T, I, static):
    x = make(T, I, dtype, "cuda", seed=T + I)
    scale = torch.tensor([0.04], device="cuda") if static else None
    q_ref, s_ref = _silu_and_mul_quant_ref(x, scale)
    poison_allocator(2 * T * I + 4096)
    q, s = qops.silu_and_mul_quant(x, scale)
    torch.cuda.synchronize()
    assert q.is_contiguous() and q.shape == (T, I)
    assert_q_close(q, q_ref, max_frac=2e-3)
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_matches_cpu_op(dtype):
    x = make(21, 1536, dtype)
    q_ref, s_ref = qops.silu_and_mul_quant(x)
    q, s = qops.silu_and_mul_quant(x.cuda())
    assert_q_close(q.cpu(), q_ref, max_frac=2e-3)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["row_strided", "unaligned", "3d_collapsible"])
@pytest.mark.parametrize("static", [False, True])
def test_cuda_strided(dtype, layout, static):
    T, I = 36, 1536
    g = torch.Generator(device="cpu").manual_seed(3)
    big = (torch.randn(T, 4 * I + 8, generator=g) * 2).to(dtype).cuda()
    if layout == "row_strided":
        x = big[:, : 2 * I]
    elif layout == "unaligned":
        x = big[:, 1 : 2 * I + 1]
    else:
        x = big[:, : 4 * I].reshape(6, 12, 2 * I)[:, ::2, :]
    scale = torch.tensor([0.04], device="cuda") if static else None
    q_ref, s_ref = _silu_and_mul_quant_ref(x, scale)
    q, s = qops.silu_and_mul_quant(x, scale)
    assert q.shape == (*x.shape[:-1], I)
    assert_q_close(q, q_ref, max_frac=2e-3)
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
def test_cuda_noncollapsible_leading_dims_error():
    big = torch.randn(4, 5, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="leading dimensions"):
        qops.silu_and_mul_quant(big[:, :3, :])


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
def test_cuda_zero_rows_saturation_nonfinite(dtype):
    T, I = 8, 14336
    x = make(T, I, dtype, "cuda")
    x[2] = 0
    x[3, 10] = float("nan")  # gate NaN: that output is NaN -> 0, ignored by amax
    x[4, I + 11] = float("inf")  # up Inf: that output is +-Inf -> the row's scale is Inf
    poison_allocator(2 * T * I)
    q, s = qops.silu_and_mul_quant(x)
    q_ref, s_ref = _silu_and_mul_quant_ref(x)
    assert torch.all(q[2] == 0) and s[2].item() == pytest.approx(FLOOR, rel=1e-6)
    assert q[3, 10].item() == 0 and torch.all(q[4] == 0) and torch.isinf(s[4])
    assert_q_close(q, q_ref)
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)
    q, s = qops.silu_and_mul_quant(x, torch.tensor([1e-9], device="cuda"))
    y = ref64(x)[2]
    fin = torch.isfinite(y)
    assert torch.all(q[(y > 0) & fin] == 127) and torch.all(q[(y < 0) & fin] == -128)
    assert torch.all(q[torch.isnan(y)] == 0)
    assert s.shape == (1,) and s.item() == pytest.approx(1e-9)


@gpu
@needs_cuda
def test_cuda_empty_graph_and_input_unchanged():
    q, s = qops.silu_and_mul_quant(torch.empty(0, 256, dtype=torch.float16, device="cuda"))
    assert q.shape == (0, 128) and s.shape == (0,)
    x = make(4, 14336, torch.bfloat16, "cuda")
    x0 = x.clone()
    scale = torch.tensor([0.05], device="cuda")
    ref = qops.silu_and_mul_quant(x, scale)[0]
    assert torch.equal(x, x0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qg, sg = qops.silu_and_mul_quant(x, scale)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(qg, ref) and sg.item() == pytest.approx(0.05)


@gpu
@needs_cuda
def test_cuda_errors():
    x = torch.randn(4, 64, dtype=torch.float16, device="cuda")
    with pytest.raises((TypeError, RuntimeError), match="input must be float16 or bfloat16"):
        qops.silu_and_mul_quant(x.float())
    with pytest.raises((ValueError, RuntimeError), match="scale must"):
        qops.silu_and_mul_quant(x, torch.ones(1))  # CPU scale with a CUDA input
    with pytest.raises((ValueError, RuntimeError), match=r"threads_per_row must be in \[0, 1024\]"):
        qops.silu_and_mul_quant(x, tuning=qops.FusedQuantTuning(threads_per_row=1025))
    with pytest.raises((ValueError, RuntimeError), match="cluster must be 0"):
        qops.silu_and_mul_quant(x, tuning=qops.FusedQuantTuning(cluster=3))


@gpu
@needs_cuda
@pytest.mark.parametrize("tpr,cluster", [(64, 0), (256, 0), (1024, 0), (0, 1), (0, 2), (128, 4), (0, 8)])
@pytest.mark.parametrize("static", [False, True])
def test_cuda_forced_launch_shapes(tpr, cluster, static):
    """Launch-shape hints (FusedQuantTuning) do not change the result; one that does not fit the
    input falls back to the kernel's own shape."""
    tuning = qops.FusedQuantTuning(threads_per_row=tpr, cluster=cluster)
    scale = torch.tensor([0.04], device="cuda") if static else None
    for T, I in [(3, 14336), (17, 1536), (2, 13), (1025, 2048)]:
        x = make(T, I, torch.bfloat16, "cuda", seed=T + I)
        q_ref, s_ref = _silu_and_mul_quant_ref(x, scale)
        poison_allocator(2 * T * I + 4096)
        q, s = qops.silu_and_mul_quant(x, scale, tuning=tuning)
        assert_q_close(q, q_ref, max_frac=2e-3)
        torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)
