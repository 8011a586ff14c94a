"""rms_norm_quant and fused_add_rms_norm_quant: reference, fake, opcheck and CUDA-vs-reference tests.

The float64 reference at the top is independent of qops' own reference (python/qops/norm.py); the
CPU op (= qops' reference) is checked against it, and the CUDA kernels against qops' reference.
"""
from __future__ import annotations

import pytest
import torch

import qops
from qops.norm import _fused_add_rms_norm_quant_ref, _rms_norm_quant_ref

FLOOR = 1e-10
HALF = [torch.float16, torch.bfloat16]


# ---- float64 reference ---------------------------------------------------------------------------
def ref64(x, w, eps, scale=None):
    """RMSNorm in float64, then int8 (static scale or dynamic per-token). Returns (q, s, y)."""
    xd = x.double()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    if scale is None:
        s = torch.clamp(y.abs().amax(-1) / 127, min=FLOOR)
        q = torch.round(y / s[..., None]).clamp(-128, 127).to(torch.int8)
        return q, s, y
    q = torch.round(y / scale.double()).clamp(-128, 127).to(torch.int8)
    return q, scale.double().reshape(1), y


def assert_q_close(q, q_ref, max_frac=None):
    """int8 outputs within one quantization step; optionally also bound the fraction that differ."""
    assert q.dtype == torch.int8 and q.shape == q_ref.shape, (q.dtype, q.shape, q_ref.shape)
    d = (q.int() - q_ref.int()).abs()
    assert int(d.max()) <= 1 if d.numel() else True, f"max |dq| = {int(d.max())}"
    if max_frac is not None and d.numel():
        frac = (d > 0).float().mean().item()
        assert frac <= max_frac, f"{frac:.2e} of the outputs differ by one step"


def make(T, H, dtype, device="cpu", seed=0, extra=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(T, H + extra, generator=g) * 3).to(dtype)[:, :H]
    r = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    return x.to(device), r.to(device), w.to(device)


# ---- CPU: the reference against float64 ------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("H", [64, 111, 576, 4096])
@pytest.mark.parametrize("static", [False, True])
def test_reference_matches_float64(dtype, H, static):
    x, _, w = make(17, H, dtype)
    scale = torch.tensor([0.02]) if static else None
    q, s = qops.rms_norm_quant(x, w, 1e-6, scale)
    q64, s64, _ = ref64(x, w, 1e-6, scale)
    assert_q_close(q, q64, max_frac=1e-3)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=0)
    assert s.shape == ((17,) if not static else (1,))


@pytest.mark.parametrize("dtype", HALF)
def test_fused_add_reference(dtype):
    x, r, w = make(19, 576, dtype)
    r0 = r.clone()
    scale = None
    q, s = qops.fused_add_rms_norm_quant(x, r, w, 1e-5, scale)
    expect_res = (x.float() + r0.float()).to(dtype)
    assert torch.equal(r, expect_res)
    q64, s64, _ = ref64(expect_res, w, 1e-5)
    assert_q_close(q, q64, max_frac=1e-3)
    torch.testing.assert_close(s.double(), s64, rtol=1e-6, atol=0)


def test_zero_rows_and_saturation_reference():
    x, _, w = make(4, 64, torch.float16)
    x[1] = 0
    q, s = qops.rms_norm_quant(x, w, 1e-6)
    assert torch.all(q[1] == 0) and s[1].item() == pytest.approx(FLOOR) and not torch.isnan(s).any()
    # a tiny static scale saturates to the int8 limits
    q, _ = qops.rms_norm_quant(x, w, 1e-6, torch.tensor([1e-6]))
    y = ref64(x, w, 1e-6)[2]
    assert torch.equal(q[y > 0], torch.full_like(q[y > 0], 127))
    assert torch.equal(q[y < 0], torch.full_like(q[y < 0], -128))


def test_3d_input_shapes():
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    q, s = qops.rms_norm_quant(x, w, 1e-6)
    assert q.shape == (2, 3, 128) and s.shape == (2, 3)
    q, s = qops.rms_norm_quant(x, w, 1e-6, torch.tensor(0.1))
    assert q.shape == (2, 3, 128) and s.shape == (1,)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_opcheck(static, fused):
    x = torch.randn(2, 5, 64, dtype=torch.float16)
    w = torch.rand(64, dtype=torch.float16) + 0.5
    scale = torch.tensor([0.05]) if static else None
    if fused:
        r = torch.randn(2, 5, 64, dtype=torch.float16)
        torch.library.opcheck(torch.ops.qops.fused_add_rms_norm_quant.default, (x, r, w, 1e-6, scale))
    else:
        torch.library.opcheck(torch.ops.qops.rms_norm_quant.default, (x, w, 1e-6, scale))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.ones(64, dtype=torch.float16)
    with pytest.raises(TypeError, match="input must be float16 or bfloat16"):
        qops.rms_norm_quant(x.float(), w.float(), 1e-6)
    with pytest.raises(TypeError, match="weight must be float16"):
        qops.rms_norm_quant(x, w.bfloat16(), 1e-6)
    with pytest.raises(ValueError, match=r"weight must have shape \[64\]"):
        qops.rms_norm_quant(x, w[:32], 1e-6)
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        qops.rms_norm_quant(torch.randn(64, 4, dtype=torch.float16).t(), w[:4], 1e-6)
    with pytest.raises(ValueError, match="scale must hold one element"):
        qops.rms_norm_quant(x, w, 1e-6, torch.ones(2))
    with pytest.raises(TypeError, match="scale must be float32"):
        qops.rms_norm_quant(x, w, 1e-6, torch.ones(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        qops.fused_add_rms_norm_quant(x, x[:2].clone(), w, 1e-6)
    with pytest.raises(TypeError, match="residual must be float16"):
        qops.fused_add_rms_norm_quant(x, x.bfloat16(), w, 1e-6)


# ---- GPU: the CUDA kernels against the reference ---------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def poison_allocator(nbytes):
    """Fill memory the caching allocator will hand out next with a non-zero pattern, so an output
    element the kernel never writes shows up as a mismatch."""
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t.fill_(0x5A)
    del t


def cuda_ref(fused, x, r, w, eps, scale):
    """qops' reference (plain torch) evaluated on the GPU tensors (CPU-op numerics, GPU speed)."""
    if fused:
        r2 = r.clone()
        q, s = _fused_add_rms_norm_quant_ref(x, r2, w, eps, scale)
        return q, s, r2
    q, s = _rms_norm_quant_ref(x, w, eps, scale)
    return q, s, None


NORM_SIZES = [(1, 64), (3, 111), (17, 576), (1025, 1536), (5, 5120), (64, 8192), (33, 11008),
              (7, 14336), (9, 16384), (4097, 4096), (2, 2056), (130, 1000)]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,H", NORM_SIZES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_matches_reference(dtype, T, H, static, fused):
    x, r, w = make(T, H, dtype, "cuda", seed=T * 7 + H)
    eps = 1e-5
    scale = torch.tensor([0.015], device="cuda") if static else None
    q_ref, s_ref, r_ref = cuda_ref(fused, x, r, w, eps, scale)
    poison_allocator(4 * T * H + 4096)
    if fused:
        q, s = qops.fused_add_rms_norm_quant(x, r, w, eps, scale)
        assert torch.equal(r, r_ref), "residual differs from the rounded x + residual"
    else:
        q, s = qops.rms_norm_quant(x, w, eps, scale)
    torch.cuda.synchronize()
    assert q.is_contiguous() and q.shape == (T, H)
    assert_q_close(q, q_ref, max_frac=1e-3)
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_matches_cpu_op(dtype, fused):
    """Against the registered CPU op itself (small sizes)."""
    x, r, w = make(29, 1536, dtype)
    rc = r.clone()
    if fused:
        q_ref, s_ref = qops.fused_add_rms_norm_quant(x, rc, w, 1e-6)
        q, s = qops.fused_add_rms_norm_quant(x.cuda(), r_gpu := r.cuda(), w.cuda(), 1e-6)
        assert torch.equal(r_gpu.cpu(), rc)
    else:
        q_ref, s_ref = qops.rms_norm_quant(x, w, 1e-6)
        q, s = qops.rms_norm_quant(x.cuda(), w.cuda(), 1e-6)
    assert_q_close(q.cpu(), q_ref, max_frac=1e-3)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["row_strided", "unaligned", "3d_collapsible"])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_strided(dtype, layout, fused):
    T, H = 36, 1536
    g = torch.Generator(device="cpu").manual_seed(1)
    big = (torch.randn(T, 2 * H + 8, generator=g) * 2).to(dtype).cuda()
    if layout == "row_strided":
        x = big[:, :H]  # row stride 2H + 8 elements (16-byte aligned rows): the vector path
    elif layout == "unaligned":
        x = big[:, 1:H + 1]  # rows only 2-byte aligned: the scalar path
    else:
        x = big[:, :H * 2].reshape(6, 12, H)[:, ::2, :]  # strides (12H', 2H', 1) collapse to one
        assert not x.is_contiguous()
    w = (torch.rand(H, generator=g) + 0.5).to(dtype).cuda()
    r = (torch.randn(x.shape, generator=g)).to(dtype).cuda()
    r_strided = torch.empty(*x.shape[:-1], H + 16, dtype=dtype, device="cuda")[..., :H]
    r_strided.copy_(r)
    q_ref, s_ref, r_ref = cuda_ref(fused, x, r, w, 1e-6, None)
    if fused:
        q, s = qops.fused_add_rms_norm_quant(x, r_strided, w, 1e-6)
        assert torch.equal(r_strided, r_ref)
    else:
        q, s = qops.rms_norm_quant(x, w, 1e-6)
    assert_q_close(q, q_ref, max_frac=1e-3)
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
def test_cuda_noncollapsible_leading_dims_error():
    H = 256
    big = torch.randn(4, 5, H, dtype=torch.float16, device="cuda")
    x = big[:, :3, :]  # strides (5H, H, 1): rows are not one stride apart
    w = torch.ones(H, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="leading dimensions"):
        qops.rms_norm_quant(x, w, 1e-6)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_zero_rows_and_saturation(dtype, fused):
    T, H = 8, 4096
    x, r, w = make(T, H, dtype, "cuda")
    x[2] = 0
    r[2] = 0
    poison_allocator(4 * T * H)
    if fused:
        q, s = qops.fused_add_rms_norm_quant(x, r.clone(), w, 1e-6)
    else:
        q, s = qops.rms_norm_quant(x, w, 1e-6)
    assert torch.all(q[2] == 0)
    assert s[2].item() == pytest.approx(FLOOR, rel=1e-6)
    assert not torch.isnan(s).any()
    # static saturation near the type limits: a tiny scale saturates, values map to +-127/-128
    q, s = qops.rms_norm_quant(x, w, 1e-6, torch.tensor([1e-9], device="cuda"))
    y = ref64(x, w, 1e-6)[2]
    assert torch.all(q[y > 0] == 127) and torch.all(q[y < 0] == -128) and torch.all(q[2] == 0)
    assert s.shape == (1,) and s.item() == pytest.approx(1e-9)


@gpu
@needs_cuda
def test_cuda_static_scale_is_fresh_copy_and_input_unchanged():
    x, _, w = make(16, 4096, torch.bfloat16, "cuda")
    x0 = x.clone()
    scale = torch.tensor([0.02], device="cuda")
    q, s = qops.rms_norm_quant(x, w, 1e-6, scale)
    assert s.data_ptr() != scale.data_ptr() and s.item() == pytest.approx(0.02)
    assert torch.equal(x, x0)


@gpu
@needs_cuda
@pytest.mark.parametrize("static", [False, True])
def test_cuda_nonfinite(static):
    """A row holding NaN (or Inf) has a NaN (or Inf) mean square: the row quantizes to zeros (NaN
    -> 0), and a dynamic scale is the floor, as in the reference. Other rows are unaffected."""
    H = 1024
    x, _, w = make(4, H, torch.float16, "cuda")
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    scale = torch.tensor([0.01], device="cuda") if static else None
    q, s = qops.rms_norm_quant(x, w, 1e-6, scale)
    q_ref, s_ref, _ = cuda_ref(False, x, None, w, 1e-6, scale)
    assert torch.all(q[:2] == 0) and torch.all(q_ref[:2] == 0)
    assert_q_close(q, q_ref)
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
def test_cuda_empty_and_graph():
    w = torch.ones(4096, dtype=torch.float16, device="cuda")
    q, s = qops.rms_norm_quant(torch.empty(0, 4096, dtype=torch.float16, device="cuda"), w, 1e-6)
    assert q.shape == (0, 4096) and s.shape == (0,)
    q, s = qops.rms_norm_quant(torch.empty(0, 4096, dtype=torch.float16, device="cuda"), w, 1e-6,
                               torch.tensor([0.5], device="cuda"))
    assert s.shape == (1,) and s.item() == 0.5
    # CUDA-graph capture (static scale read on the device, no host sync)
    x = torch.randn(4, 4096, dtype=torch.float16, device="cuda")
    scale = torch.tensor([0.01], device="cuda")
    qops.rms_norm_quant(x, w, 1e-6, scale)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qg, sg = qops.rms_norm_quant(x, w, 1e-6, scale)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(qg, qops.rms_norm_quant(x, w, 1e-6, scale)[0])


@gpu
@needs_cuda
def test_cuda_errors():
    x = torch.randn(4, 64, dtype=torch.float16, device="cuda")
    w = torch.ones(64, dtype=torch.float16, device="cuda")
    with pytest.raises((TypeError, RuntimeError), match="input must be float16 or bfloat16"):
        qops.rms_norm_quant(x.float(), w.float(), 1e-6)
    with pytest.raises((ValueError, RuntimeError), match="weight must"):
        qops.rms_norm_quant(x, w[:32], 1e-6)
    with pytest.raises((ValueError, RuntimeError), match="scale must"):
        qops.rms_norm_quant(x, w, 1e-6, torch.ones(1))  # CPU scale with CUDA input
    with pytest.raises((ValueError, RuntimeError), match="residual must"):
        qops.fused_add_rms_norm_quant(x, x[:2].clone(), w, 1e-6)
