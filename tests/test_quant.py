"""quant_per_token / quant_per_tensor: the reference against float64 math, then CUDA against the
reference (bit-exact: both are IEEE float32 divisions and round-half-to-even)."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.quantization import quantize_int8
from qops.testing import poison_cuda_allocator


# ---- float64 re-derivation of the contract (independent of qops.quantization) ----------------
def ref64_per_token(x: torch.Tensor):
    x64 = x.double()
    x64 = torch.where(torch.isnan(x64), torch.zeros_like(x64), x64)
    amax = x64.abs().amax(-1)
    s = torch.clamp((amax.float() / 127.0).double(), min=torch.tensor(1e-10, dtype=torch.float32).item())
    q = torch.round(x64 / s.unsqueeze(-1)).clamp(-128, 127)
    return q, s


ROWS = [1, 3, 17, 1025]
COLS = [1, 7, 64, 576, 1000, 4097]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(r, c) for r in ROWS for c in COLS][::3] + [(17, 4097), (1025, 576)])
def test_per_token_reference_matches_float64(rows, cols, dtype):
    x = torch.randn(rows, cols, dtype=dtype) * 3
    q, s = qops.quant_per_token(x)
    q64, s64 = ref64_per_token(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == (rows,)
    torch.testing.assert_close(s.double(), s64, rtol=1e-7, atol=0)
    torch.testing.assert_close(q.double(), q64, atol=1, rtol=0)
    # Every row uses the full range: its amax element maps to +-127.
    assert (q.abs().amax(-1) == 127).all()


def test_per_token_zero_rows_and_leading_dims():
    x = torch.randn(2, 5, 33, dtype=torch.float16)
    x[1, 2] = 0
    q, s = qops.quant_per_token(x)
    assert s.shape == (2, 5)
    assert s[1, 2].item() == pytest.approx(1e-10)
    assert (q[1, 2] == 0).all()
    assert not torch.isnan(s).any()


def test_per_token_rounding_is_half_to_even():
    # amax 127 -> scale exactly 1.0, so x / scale is x: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5]])
    q, s = qops.quant_per_token(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2]]


def test_per_token_nonfinite_contract():
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5], [1.0, float("inf"), -2.0, 3.0]])
    q, s = qops.quant_per_token(x)
    # NaN is ignored by amax and quantizes to 0.
    assert s[0].item() == pytest.approx(2.0 / 127)
    assert q[0].tolist() == [64, 0, -127, 32]
    # A row with Inf gets scale Inf and quantizes to zeros.
    assert s[1].item() == float("inf")
    assert q[1].tolist() == [0, 0, 0, 0]


def test_per_tensor_reference_and_saturation():
    x = torch.randn(17, 1000) * 10
    scale = torch.tensor([0.05])
    q = qops.quant_per_tensor(x, scale)
    q64 = torch.round(x.double() / 0.05).clamp(-128, 127)
    torch.testing.assert_close(q.double(), q64, atol=1, rtol=0)
    assert q.max().item() == 127 and q.min().item() == -128  # |x| up to ~40 / 0.05 saturates
    xi = torch.tensor([[float("inf"), float("-inf"), float("nan"), 1e30]])
    assert qops.quant_per_tensor(xi, torch.tensor([1.0])).tolist() == [[127, -128, 0, 127]]


def test_strided_rows_accepted():
    wide = torch.randn(9, 200, dtype=torch.float16)
    x = wide[:, 10:110]  # rows 200 apart, last dim contiguous
    q, s = qops.quant_per_token(x)
    q2, s2 = qops.quant_per_token(x.contiguous())
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (
            lambda: qops.quant_per_token(torch.zeros(4, 8, dtype=torch.int32)),
            TypeError,
            "qops.quant_per_token: input must be",
        ),
        (lambda: qops.quant_per_token(torch.zeros(8, 4).t()), ValueError, "last dimension must be contiguous"),
        (lambda: qops.quant_per_token(torch.zeros(4, 0)), ValueError, "non-empty last dimension"),
        (
            lambda: qops.quant_per_tensor(torch.zeros(4, 8), torch.tensor([1.0], dtype=torch.float64)),
            TypeError,
            "qops.quant_per_tensor: scale must be float32",
        ),
        (lambda: qops.quant_per_tensor(torch.zeros(4, 8), torch.ones(2)), ValueError, "scale must hold one element"),
    ],
)
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_opcheck():
    for dtype in DTYPES:
        x = torch.randn(5, 24, dtype=dtype)
        torch.library.opcheck(torch.ops.qops.quant_per_token.default, (x,))
        torch.library.opcheck(torch.ops.qops.quant_per_tensor.default, (x, torch.tensor([0.02])))


# ---- CUDA against the reference --------------------------------------------------------------
GPU_SHAPES = [(1, 1), (1, 4096), (3, 7), (17, 576), (1025, 4097), (4097, 1000), (64, 16384), (5, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", GPU_SHAPES)
def test_cuda_per_token_matches_reference(rows, cols, dtype):
    x = (torch.randn(rows, cols, dtype=torch.float32) * torch.rand(rows, 1) * 10).to(dtype)
    if rows > 2:
        x[1] = 0  # an all-zero row
    poison_cuda_allocator()
    q, s = qops.quant_per_token(x.cuda())
    q_ref, s_ref = qops.quant_per_token(x)
    torch.cuda.synchronize()
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", GPU_SHAPES)
def test_cuda_per_tensor_matches_reference(rows, cols, dtype):
    x = (torch.randn(rows, cols) * 8).to(dtype)
    scale = torch.tensor([0.04])
    poison_cuda_allocator()
    q = qops.quant_per_tensor(x.cuda(), scale.cuda())
    assert torch.equal(q.cpu(), qops.quant_per_tensor(x, scale))


@pytest.mark.gpu
def test_cuda_strided_misaligned_and_3d():
    wide = torch.randn(33, 1031, dtype=torch.float16, device="cuda")
    for x in (wide[:, 3:515], wide[:, 8:520], wide[:, :1024].reshape(33, 2, 512)[:, 1]):
        q, s = qops.quant_per_token(x)
        q_ref, s_ref = qops.quant_per_token(x.cpu())
        assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    x3 = torch.randn(2, 3, 4096, dtype=torch.bfloat16, device="cuda")
    q, s = qops.quant_per_token(x3)
    assert s.shape == (2, 3)
    assert torch.equal(q.cpu(), qops.quant_per_token(x3.cpu())[0])


# Static scales across the quantizer's fast range (1e-30 <= |s| <= 1e30: one reciprocal, then two
# FMAs per element) and outside it (the IEEE division), with +-Inf and NaN elements, on the vector
# and the scalar (odd width) paths: bit-identical to the reference either way.
@pytest.mark.gpu
@pytest.mark.parametrize("cols", [64, 37])
@pytest.mark.parametrize("scale", [0.02, 1e-30, 1e30, 3e-31, 2e31, -0.5, 0.0, float("inf"), float("nan")])
def test_cuda_per_tensor_scales_at_and_past_the_fast_range(scale, cols):
    x = torch.randn(3, cols) * 100
    x[0, 3], x[1, 7], x[2, 0] = float("inf"), float("-inf"), float("nan")
    for dtype in DTYPES:
        xd = x.to(dtype)
        s = torch.tensor([scale])
        q = qops.quant_per_tensor(xd.cuda(), s.cuda())
        # The convention's IEEE division, for valid and invalid scales alike (the reference rejects
        # scales that are not finite and > 0; the CUDA kernel reads the scale on the device unchecked).
        assert torch.equal(q.cpu(), quantize_int8(xd.float(), s.reshape(())))


@pytest.mark.gpu
def test_cuda_nonfinite_and_empty():
    x = torch.tensor([[1.0, float("nan"), -2.0, 0.5], [1.0, float("inf"), -2.0, 3.0]])
    q, s = qops.quant_per_token(x.cuda())
    q_ref, s_ref = qops.quant_per_token(x)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    q, s = qops.quant_per_token(torch.empty(0, 64, device="cuda"))
    assert q.shape == (0, 64) and s.shape == (0,)


@pytest.mark.gpu
def test_cuda_bad_inputs():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="qops.quant_per_tensor: scale must be on"):
        qops.quant_per_tensor(x, torch.tensor([1.0]))
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        qops.quant_per_token(x.t())
    with pytest.raises(TypeError, match="input must be float16, bfloat16 or float32"):
        qops.quant_per_token(x.to(torch.int32))


@pytest.mark.gpu
def test_cuda_graph_capture():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    scale = torch.tensor([0.03], device="cuda")
    qops.quant_per_token(x)
    qops.quant_per_tensor(x, scale)  # warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, s = qops.quant_per_token(x)
        qt = qops.quant_per_tensor(x, scale)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    q_ref, s_ref = qops.quant_per_token(x.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    assert torch.equal(qt.cpu(), qops.quant_per_tensor(x.cpu(), scale.cpu()))
