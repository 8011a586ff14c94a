"""rms_norm_quant and fused_add_rms_norm_quant: reference, fake, opcheck and CUDA-vs-reference tests.

The float64 reference at the top is independent of qops' own reference (python/qops/norm.py); the
CPU op (= qops' reference) is checked against it, and the CUDA kernels against qops' reference.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.norm import _fused_add_rms_norm_quant_ref, _rms_norm_quant_ref
from qops.testing import cuda_kernel_names

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


@pytest.mark.parametrize("fused", [False, True])
def test_tuning_errors(fused):
    """The CPU reference checks the launch options as the CUDA glue does (test_cuda_variant_errors)."""
    x = torch.randn(4, 64, dtype=torch.float16)
    w = torch.ones(64, dtype=torch.float16)
    if fused:
        name = "fused_add_rms_norm_quant"
        op = lambda t: qops.fused_add_rms_norm_quant(x, x.clone(), w, 1e-6, tuning=t)
    else:
        name = "rms_norm_quant"
        op = lambda t: qops.rms_norm_quant(x, w, 1e-6, tuning=t)
    with pytest.raises(ValueError, match=f"qops.{name}: variant must be auto, rowres or pipelined, got 'fast'"):
        op(qops.NormTuning(variant="fast"))
    with pytest.raises(ValueError, match=r"pipe_stages must be 0 \(the kernel's choice\), 2 or 3, got 4"):
        op(qops.NormTuning(pipe_stages=4))
    with pytest.raises(ValueError, match=r"threads_per_row must be in \[0, 1024\]"):
        op(qops.NormTuning(threads_per_row=2048))
    with pytest.raises(ValueError, match=r"cluster must be 0 \(the kernel's choice\), 1, 2, 4 or 8, got 3"):
        op(qops.NormTuning(cluster=3))
    for variant in ("auto", "rowres", "pipelined"):  # accepted (and ignored) on CPU
        op(qops.NormTuning(variant=variant, pipe_stages=3, threads_per_row=128, cluster=2))


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


NORM_SIZES = [
    (1, 64),
    (3, 111),
    (17, 576),
    (1025, 1536),
    (5, 5120),
    (64, 8192),
    (33, 11008),
    (7, 14336),
    (9, 16384),
    (4097, 4096),
    (2, 2056),
    (130, 1000),
]


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
        x = big[:, 1 : H + 1]  # rows only 2-byte aligned: the scalar path
    else:
        x = big[:, : H * 2].reshape(6, 12, H)[:, ::2, :]  # strides (12H', 2H', 1) collapse to one
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
@pytest.mark.parametrize("variant", ["auto", "pipelined"])
def test_cuda_zero_rows_and_saturation(dtype, fused, variant):
    tuning = qops.NormTuning(variant=variant)
    T, H = 8, 4096
    x, r, w = make(T, H, dtype, "cuda")
    x[2] = 0
    r[2] = 0
    poison_allocator(4 * T * H)
    if fused:
        q, s = qops.fused_add_rms_norm_quant(x, r.clone(), w, 1e-6, tuning=tuning)
    else:
        q, s = qops.rms_norm_quant(x, w, 1e-6, tuning=tuning)
    assert torch.all(q[2] == 0)
    assert s[2].item() == pytest.approx(FLOOR, rel=1e-6)
    assert not torch.isnan(s).any()
    # static saturation near the type limits: a tiny scale saturates, values map to +-127/-128
    q, s = qops.rms_norm_quant(x, w, 1e-6, torch.tensor([1e-9], device="cuda"), tuning=tuning)
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
    q, s = qops.rms_norm_quant(
        torch.empty(0, 4096, dtype=torch.float16, device="cuda"), w, 1e-6, torch.tensor([0.5], device="cuda")
    )
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


# ---- GPU: both kernel variants (tuning=qops.NormTuning(variant=...)) -----------------------------
# "rowres": one row (slice) per CTA, registers only; "pipelined": persistent CTAs with a cp.async ring
# of rows (csrc/norm/norm_rowres.cu, norm_pipelined.cu). The launcher picks pipelined by itself for
# many rows (>= 16 per SM, e.g. the 4097 x 4096 case of test_cuda_matches_reference on an H100);
# these tests force each one.
VARIANTS = ["rowres", "pipelined"]
# (T, H): T not a multiple of any grid; H covering 1..8 warps per row, whole and partial last
# vectors per thread (576: 72 vectors on one warp, 4 rows per CTA; 2056: 257 vectors on 3 warps),
# 1..4 vectors per thread (64, 1000, 1536, 4096, 5120, 8192; the pipelined kernel's 2-vector rows
# at 2048 and 4096), and fewer rows than CTAs.
VARIANT_SIZES = [
    (4099, 576),
    (4099, 1536),
    (4099, 4096),
    (4099, 5120),
    (4099, 8192),
    (4099, 2056),
    (4099, 2048),
    (1000, 64),
    (257, 1000),
    (3, 4096),
    (1, 8192),
]


def make_cuda(T, H, dtype, seed=0):
    """make() drawn on the GPU (large shapes: the CPU generator would dominate the test time)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, generator=g, device="cuda") * 3).to(dtype)
    r = (torch.randn(T, H, generator=g, device="cuda") * 3).to(dtype)
    w = (torch.rand(H, generator=g, device="cuda") + 0.5).to(dtype)
    return x, r, w


def zero_some_rows(x, r):
    """Rows 0, T // 2 and T - 1 (the last row only when T < 8; none for T = 1) set to zeros in x and
    the residual, so that z = 0 too. Returns their indices."""
    T = x.shape[0]
    rows = sorted({0, T // 2, T - 1}) if T >= 8 else ([T - 1] if T >= 2 else [])
    for i in rows:
        x[i] = 0
        r[i] = 0
    return rows


def check_against_reference(fused, x, r, w, eps, scale, zero_rows=(), tuning=None):
    q_ref, s_ref, r_ref = cuda_ref(fused, x, r, w, eps, scale)
    poison_allocator(4 * x.numel() + 4096)
    if fused:
        q, s = qops.fused_add_rms_norm_quant(x, r, w, eps, scale, tuning=tuning)
        torch.cuda.synchronize()
        assert torch.equal(r, r_ref), "residual differs from the rounded x + residual"
    else:
        q, s = qops.rms_norm_quant(x, w, eps, scale, tuning=tuning)
    torch.cuda.synchronize()
    assert q.is_contiguous() and q.shape == x.shape
    assert_q_close(q, q_ref, max_frac=1e-3)
    assert s.shape == s_ref.shape and s.dtype == torch.float32
    torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)
    for i in zero_rows:
        assert torch.all(q[i] == 0)
        if scale is None:
            assert s[i].item() == pytest.approx(FLOOR, rel=1e-6)
    assert not torch.isnan(s).any()


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,H", VARIANT_SIZES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_variant_matches_reference(variant, dtype, T, H, static, fused):
    x, r, w = make_cuda(T, H, dtype, seed=T * 5 + H)
    zeros = zero_some_rows(x, r)
    scale = torch.tensor([0.015], device="cuda") if static else None
    check_against_reference(fused, x, r, w, 1e-5, scale, zeros, qops.NormTuning(variant=variant))


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,H", [(4099, 4096), (4099, 576), (517, 8192)])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_variant_strided_rows(variant, dtype, T, H, fused):
    """Row strides that are not H (16-byte aligned: the vector paths of both variants), for the
    input and the residual, which must keep its padding untouched."""
    tuning = qops.NormTuning(variant=variant)
    g = torch.Generator(device="cpu").manual_seed(H + T)
    x = (torch.randn(T, H + 64, generator=g) * 3).to(dtype).cuda()[:, :H]
    r_big = (torch.randn(T, H + 24, generator=g) * 3).to(dtype).cuda()
    r = r_big[:, :H]
    w = (torch.rand(H, generator=g) + 0.5).to(dtype).cuda()
    pad = r_big[:, H:].clone()
    zeros = zero_some_rows(x, r)
    check_against_reference(fused, x, r, w, 1e-6, None, zeros, tuning)
    assert torch.equal(r_big[:, H:], pad), "the residual's row padding was written"
    check_against_reference(False, x, r, w, 1e-6, torch.tensor([0.02], device="cuda"), tuning=tuning)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("stages,tpr", [(3, 0), (2, 256), (3, 128), (0, 64)])  # 0: the kernel's choice
def test_cuda_pipelined_shapes(dtype, fused, stages, tpr):
    """The pipelined kernel's other ring depth and thread-per-row shapes (NormTuning.pipe_stages,
    threads_per_row; a hint that does not fit falls back to the default shape)."""
    tuning = qops.NormTuning(variant="pipelined", pipe_stages=stages, threads_per_row=tpr)
    for T, H in [(4099, 4096), (2049, 8192), (1031, 1536), (777, 576)]:
        x, r, w = make_cuda(T, H, dtype, seed=T + H)
        zeros = zero_some_rows(x, r)
        check_against_reference(fused, x, r, w, 1e-5, None, zeros, tuning)
        check_against_reference(fused, x, r.clone(), w, 1e-5, torch.tensor([0.01], device="cuda"), tuning=tuning)


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_pipelined_fallbacks(fused):
    """Forcing pipelined where it does not apply runs the row-resident kernel: rows only 2-byte
    aligned (scalar path), hidden above 8192, and a hidden size that is not a multiple of 8."""
    tuning = qops.NormTuning(variant="pipelined")
    g = torch.Generator(device="cpu").manual_seed(3)
    for T, H, offset in [(2100, 1536, 1), (300, 11008, 0), (300, 16384, 0), (2100, 1000 + 4, 0)]:
        big = (torch.randn(T, H + 8, generator=g) * 2).to(torch.bfloat16).cuda()
        x = big[:, offset : offset + H]
        w = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).cuda()
        r = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        check_against_reference(fused, x, r, w, 1e-6, None, tuning=tuning)


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_pipelined_nonfinite_rows(fused):
    """NaN / Inf rows and a row whose sum of squares overflows, under the pipelined kernel: each
    such row quantizes to zeros with the floor scale (dynamic), as in the reference."""
    tuning = qops.NormTuning(variant="pipelined")
    T, H = 2500, 4096
    for dtype in HALF:
        x, r, w = make_cuda(T, H, dtype, seed=11)
        x[3, 5] = float("nan")
        x[700, 7] = float("inf")
        if dtype == torch.bfloat16:
            x[1200, 9] = 3e38  # z^2 overflows: rstd = 0 (z * w may overflow too: y = NaN there)
        for scale in (None, torch.tensor([0.01], device="cuda")):
            q_ref, s_ref, r_ref = cuda_ref(fused, x, r, w, 1e-6, scale)
            rr = r.clone()
            q, s = (
                qops.fused_add_rms_norm_quant(x, rr, w, 1e-6, scale, tuning=tuning)
                if fused
                else qops.rms_norm_quant(x, w, 1e-6, scale, tuning=tuning)
            )
            if fused:  # NaN where x had a NaN: compare with equal_nan, bit-exact otherwise
                torch.testing.assert_close(rr, r_ref, rtol=0, atol=0, equal_nan=True)
            assert_q_close(q, q_ref, max_frac=1e-3)
            torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)


@gpu
@needs_cuda
def test_cuda_pipelined_graph_capture():
    tuning = qops.NormTuning(variant="pipelined")
    x, _, w = make_cuda(4099, 4096, torch.float16, seed=5)
    scale = torch.tensor([0.02], device="cuda")
    eager = qops.rms_norm_quant(x, w, 1e-6, tuning=tuning)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qg, sg = qops.rms_norm_quant(x, w, 1e-6, tuning=tuning)
        qs, ss = qops.rms_norm_quant(x, w, 1e-6, scale, tuning=tuning)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(qg, eager[0]) and torch.equal(sg, eager[1])
    assert torch.equal(qs, qops.rms_norm_quant(x, w, 1e-6, scale, tuning=tuning)[0]) and ss.item() == pytest.approx(
        0.02
    )


@gpu
@needs_cuda
def test_cuda_variant_errors():
    x, _, w = make(4, 64, torch.float16, "cuda")
    with pytest.raises(
        (ValueError, RuntimeError), match="qops.rms_norm_quant: variant must be auto, rowres or pipelined, got 'fast'"
    ):
        qops.rms_norm_quant(x, w, 1e-6, tuning=qops.NormTuning(variant="fast"))
    with pytest.raises(
        (ValueError, RuntimeError),
        match="qops.fused_add_rms_norm_quant: variant must be auto, rowres or pipelined, got 'fast'",
    ):
        qops.fused_add_rms_norm_quant(x, x.clone(), w, 1e-6, tuning=qops.NormTuning(variant="fast"))
    with pytest.raises((ValueError, RuntimeError), match="pipe_stages must be 0"):
        qops.rms_norm_quant(x, w, 1e-6, tuning=qops.NormTuning(variant="pipelined", pipe_stages=4))
    qops.rms_norm_quant(x, w, 1e-6, tuning=qops.NormTuning(variant="auto"))


@gpu
@needs_cuda
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_variant_selection(fused):
    """Which kernel runs: the default rule (without a residual, pipelined for >= 16 rows per SM,
    H <= 8192 and either > 256 KB of input per SM or rows of one warp, H <= 1024; row-resident
    otherwise and with a residual) and the NormTuning(variant=...) overrides."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big, mid, small = 32 * sms + 3, 16 * sms + 3, 16  # 4096-wide bf16 rows: 8 KB each

    def run(T, H=4096, variant="auto"):
        x, r, w = make_cuda(T, H, torch.bfloat16)
        tuning = qops.NormTuning(variant=variant)
        return cuda_kernel_names(
            lambda: (
                qops.fused_add_rms_norm_quant(x, r, w, 1e-6, tuning=tuning)
                if fused
                else qops.rms_norm_quant(x, w, 1e-6, tuning=tuning)
            ),
            "norm_quant",
        )

    def kind(names):
        kinds = {"pipelined" if "rms_norm_quant_pipe_kernel" in n else "rowres" for n in names}
        assert len(kinds) == 1, names
        return kinds.pop()

    names = run(big)
    if names is None:
        pytest.skip("torch.profiler records no CUDA kernels here")
    assert kind(names) == ("rowres" if fused else "pipelined")
    assert kind(run(mid)) == "rowres"  # 136 KB per SM
    assert kind(run(mid, 576)) == ("rowres" if fused else "pipelined")  # one-warp rows
    assert kind(run(small)) == "rowres"
    assert kind(run(big, 16384)) == "rowres"  # rows longer than the pipelined kernel takes
    assert kind(run(big, variant="rowres")) == "rowres"
    assert kind(run(small, variant="pipelined")) == "pipelined"
