"""w4a16_prepack / w4a16_gemm and the int4 weight utilities (docs/ops.md, docs/int4.md)."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.testing import random_int4_weight
from qops.w4a16 import dequantize_weight_int4, n_major, pack_int4, quantize_weight_int4, unpack_int4

OPS = ("w4a16_prepack", "w4a16_gemm")
HALF = (torch.float16, torch.bfloat16)


# ---- float64 references, independent of qops -----------------------------------------------------
def ref_unpack_loops(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> float64 [N, K], one byte at a time (small sizes only)."""
    n, kh = packed.shape
    out = torch.empty(n, 2 * kh, dtype=torch.float64)
    for r in range(n):
        for j in range(kh):
            byte = int(packed[r, j])
            lo, hi = byte & 0x0F, (byte >> 4) & 0x0F
            out[r, 2 * j] = lo - 16 if lo >= 8 else lo
            out[r, 2 * j + 1] = hi - 16 if hi >= 8 else hi
    return out


def ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The same by integer arithmetic (any size): low nibble = even k, two's complement."""
    p = packed.to(torch.int64)
    lo, hi = p % 16, p // 16
    q = torch.empty(*p.shape[:-1], 2 * p.shape[-1], dtype=torch.int64)
    q[..., 0::2], q[..., 1::2] = lo, hi
    return torch.where(q >= 8, q - 16, q).double()


def ref_weight(packed, scales, zeros, g) -> torch.Tensor:
    """W[n, k] = q[n, k] * scales[n, k // g] (+ zeros[n, k // g]) in float64, no rounding."""
    q = ref_unpack(packed)
    k = torch.arange(q.shape[1])
    w = q * scales.double()[:, k // g]
    if zeros is not None:
        w = w + zeros.double()[:, k // g]
    return w


def ref_weight_kernel_order(packed, scales, zeros, g) -> torch.Tensor:
    """W as the mixed-input mainloop forms it: q*scale rounded to the half dtype, + zero rounded."""
    q = ref_unpack(packed)
    k = torch.arange(q.shape[1])
    w = (q * scales.double()[:, k // g]).to(scales.dtype).double()
    if zeros is not None:
        w = (w + zeros.double()[:, k // g]).to(scales.dtype).double()
    return w


def ref_gemm(a, packed, scales, zeros, g, kernel_order=False) -> torch.Tensor:
    w = (ref_weight_kernel_order if kernel_order else ref_weight)(packed, scales, zeros, g)
    return a.double() @ w.T


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


# ---- the reference layout: pack / unpack ---------------------------------------------------------
def test_unpack_every_byte_matches_loops():
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(unpack_int4(packed).double(), ref_unpack_loops(packed))
    assert torch.equal(ref_unpack(packed), ref_unpack_loops(packed))


def test_pack_bytes_match_loops():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (3, 10), generator=gen, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5)
    for r in range(3):
        for j in range(5):
            lo, hi = int(q[r, 2 * j]), int(q[r, 2 * j + 1])
            assert int(packed[r, j]) == (lo & 0xF) | ((hi & 0xF) << 4)
    # e.g. q = [-8, 7] -> 0x78, q = [-1, 0] -> 0x0F
    assert pack_int4(torch.tensor([[-8, 7, -1, 0]], dtype=torch.int8)).tolist() == [[0x78, 0x0F]]


@pytest.mark.parametrize("shape", [(1, 2), (7, 64), (2, 3, 128)])
def test_pack_unpack_round_trip(shape):
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, shape, generator=gen, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    p = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(p)), p)


def test_pack_rejects_bad_input():
    with pytest.raises(TypeError, match=r"qops\.pack_int4: q must be int8"):
        pack_int4(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"qops\.pack_int4: .*even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"qops\.pack_int4: .*\[-8, 7\]"):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
    with pytest.raises(TypeError, match=r"qops\.unpack_int4: packed must be uint8"):
        unpack_int4(torch.zeros(2, 3, dtype=torch.int8))


# ---- quantize_weight_int4 ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("g", [64, 128])
def test_quantize_weight_scale_only(dtype, g):
    n, k = 24, 3 * 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    packed, scales, zeros = quantize_weight_int4(w, g)
    assert zeros is None
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert scales.shape == (n, k // g) and scales.dtype == dtype
    wg = w.double().reshape(n, k // g, g)
    torch.testing.assert_close(scales.double(), wg.abs().amax(-1) / 7, rtol=eps(dtype), atol=0)
    q = ref_unpack(packed)
    assert q.min() >= -7 and q.max() <= 7  # symmetric: -8 is never needed
    err = (ref_weight(packed, scales, None, g) - w.double()).reshape(n, k // g, g).abs()
    assert (err <= scales.double().unsqueeze(-1) / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("g", [64, 128])
def test_quantize_weight_scale_and_zero(dtype, g):
    n, k = 40, 256
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(n, k, generator=gen) + torch.randn(n, 1, generator=gen)).to(dtype)  # offsets
    packed, scales, zeros = quantize_weight_int4(w, g, with_zeros=True)
    assert zeros is not None and zeros.shape == (n, k // g) and zeros.dtype == dtype
    wg = w.double().reshape(n, k // g, g)
    lo, hi = wg.amin(-1), wg.amax(-1)
    torch.testing.assert_close(scales.double(), (hi - lo) / 15, rtol=eps(dtype), atol=0)
    exact_zero = lo + 8 * scales.double()  # q = -8 -> min, q = 7 -> max
    torch.testing.assert_close(zeros.double(), exact_zero, rtol=eps(dtype), atol=1e-6)
    q = ref_unpack(packed).reshape(n, k // g, g)
    assert (q.amin(-1) <= -7).all() and (q.amax(-1) >= 6).all()  # the range is used
    err = (ref_weight(packed, scales, zeros, g) - w.double()).reshape(n, k // g, g).abs()
    bound = scales.double() / 2 * (1 + 1e-6) + (zeros.double() - exact_zero).abs() + 1e-7
    assert (err <= bound.unsqueeze(-1)).all()


def test_quantize_weight_zero_and_constant_groups():
    w = torch.randn(3, 128, dtype=torch.float16)
    w[0, :64] = 0.0
    w[1, 64:] = 1.5
    w[2, :64] = 2.0**-24  # amax / 7 underflows: scale 0, q 0 (not w / 0 = inf -> 7)
    packed, scales, _ = quantize_weight_int4(w, 64)
    assert scales[0, 0] == 0 and (ref_unpack(packed)[0, :64] == 0).all()
    assert scales[2, 0] == 0 and (ref_unpack(packed)[2, :64] == 0).all()
    packed, scales, zeros = quantize_weight_int4(w, 64, with_zeros=True)
    assert scales[1, 1] == 0 and zeros[1, 1] == 1.5 and (ref_unpack(packed)[1, 64:] == 0).all()
    assert scales[0, 0] == 0 and zeros[0, 0] == 0
    w_deq = ref_weight(packed, scales, zeros, 64)
    assert (w_deq[1, 64:] == 1.5).all() and (w_deq[0, :64] == 0).all()


def test_quantize_weight_float32_input_and_dtype():
    w = torch.randn(8, 128)
    packed, scales, zeros = quantize_weight_int4(w, 128, with_zeros=True, dtype=torch.bfloat16)
    assert scales.dtype == zeros.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"qops\.quantize_weight_int4: dtype"):
        quantize_weight_int4(w, 128)  # float32 scales are not a w4a16_gemm input
    with pytest.raises(ValueError, match=r"qops\.quantize_weight_int4: K .*group_size"):
        quantize_weight_int4(torch.randn(8, 96, dtype=torch.float16), 64)
    with pytest.raises(ValueError, match=r"qops\.quantize_weight_int4: group_size"):
        quantize_weight_int4(torch.randn(8, 128, dtype=torch.float16), 32)


# ---- w4a16_prepack -------------------------------------------------------------------------------
def test_prepack_is_a_contiguous_copy_on_cpu():
    w = torch.randint(0, 256, (32, 128), dtype=torch.uint8)
    p = qops.w4a16_prepack(w)
    assert torch.equal(p, w) and p.is_contiguous() and p.data_ptr() != w.data_ptr()
    wide = torch.randint(0, 256, (32, 160), dtype=torch.uint8)
    p = qops.w4a16_prepack(wide[:, :128])
    assert torch.equal(p, wide[:, :128]) and p.is_contiguous()


def test_prepack_bad_input():
    with pytest.raises(TypeError, match=r"qops\.w4a16_prepack: weight must be uint8"):
        qops.w4a16_prepack(torch.zeros(8, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"qops\.w4a16_prepack: weight must be 2-D"):
        qops.w4a16_prepack(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"qops\.w4a16_prepack: K .*multiple of 64"):
        qops.w4a16_prepack(torch.zeros(16, 48, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"qops\.w4a16_prepack: N = weight.shape\[0\] must be a multiple of 16"):
        qops.w4a16_prepack(torch.zeros(8, 64, dtype=torch.uint8))


# ---- w4a16_gemm ----------------------------------------------------------------------------------
# Awkward shapes: M = 1, 3, 17; N not a power of two (a multiple of 16); K several groups.
SHAPES = [(1, 48, 128), (3, 80, 256), (17, 112, 384)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("with_zeros", [False, True], ids=["scale", "scale+zero"])
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_float64(m, n, k, g, with_zeros, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    packed, scales, zeros = random_int4_weight(n, k, g, dtype, with_zeros, seed=m + k)
    a = torch.randn(m, k, generator=gen).to(dtype)
    out = qops.w4a16_gemm(a, qops.w4a16_prepack(packed), scales, zeros, g)
    assert out.shape == (m, n) and out.dtype == dtype

    # The contract (exact W): error of the half-dtype weight and output roundings only.
    ref = ref_gemm(a, packed, scales, zeros, g)
    scale = (a.double().abs() @ ref_weight(packed, scales, zeros, g).abs().T).clamp(min=1e-3)
    assert ((out.double() - ref).abs() <= 4 * eps(dtype) * scale).all()
    # Exactly the kernel's rounding order of W: out is ref rounded once to dtype (f32 accumulation).
    ref_k = ref_gemm(a, packed, scales, zeros, g, kernel_order=True)
    torch.testing.assert_close(out.double(), ref_k, rtol=eps(dtype), atol=1e-5)


def test_gemm_dequantized_weight_helper_is_kernel_order():
    packed, scales, zeros = random_int4_weight(16, 128, 64, torch.bfloat16, True)
    w = dequantize_weight_int4(packed, scales, zeros, 64)
    assert w.dtype == torch.bfloat16
    assert torch.equal(w.double(), ref_weight_kernel_order(packed, scales, zeros, 64))


@pytest.mark.parametrize("with_zeros", [False, True])
def test_gemm_end_to_end_quantized_linear(with_zeros):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(80, 256, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    a = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    packed, scales, zeros = quantize_weight_int4(w, 64, with_zeros)
    out = qops.w4a16_gemm(a, qops.w4a16_prepack(packed), scales, zeros, 64)
    ref = a.double() @ w.double().T
    assert (out.double() - ref).norm() / ref.norm() < 0.15  # int4 quantization noise


def test_gemm_strided_a_and_empty_m():
    packed, scales, zeros = random_int4_weight(32, 128, 64, torch.float16, True)
    wide = torch.randn(3, 200, dtype=torch.float16)
    a = wide[:, 8:136]  # row stride 200, last dim contiguous
    out = qops.w4a16_gemm(a, packed, scales, zeros, 64)
    assert torch.equal(out, qops.w4a16_gemm(a.contiguous(), packed, scales, zeros, 64))
    empty = qops.w4a16_gemm(torch.empty(0, 128, dtype=torch.float16), packed, scales, zeros, 64)
    assert empty.shape == (0, 32)


def test_gemm_n_major_scales_same_result():
    packed, scales, zeros = random_int4_weight(48, 256, 64, torch.bfloat16, True)
    a = torch.randn(5, 256, dtype=torch.bfloat16)
    sn, zn = n_major(scales), n_major(zeros)
    assert sn.stride() == (1, 48) and torch.equal(sn, scales) and n_major(sn) is sn
    out = qops.w4a16_gemm(a, packed, sn, zn, 64)
    assert torch.equal(out, qops.w4a16_gemm(a, packed, scales, zeros, 64))


def test_gemm_inputs_unchanged():
    packed, scales, zeros = random_int4_weight(32, 128, 128, torch.bfloat16, True)
    a = torch.randn(3, 128, dtype=torch.bfloat16)
    before = [t.clone() for t in (a, packed, scales, zeros)]
    qops.w4a16_gemm(a, packed, scales, zeros, 128)
    assert all(torch.equal(x, y) for x, y in zip(before, (a, packed, scales, zeros)))


def _gemm_args(**over):
    args = dict(
        a=torch.randn(3, 256, dtype=torch.float16),
        weight_packed=torch.zeros(32, 128, dtype=torch.uint8),
        scales=torch.ones(32, 2, dtype=torch.float16),
        zeros=None,
        group_size=128,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(a=torch.randn(3, 256)), TypeError, r"a must be float16 or bfloat16, got float32"),
        (dict(a=torch.randn(1, 3, 256, dtype=torch.float16)), ValueError, r"a must be 2-D"),
        (dict(a=torch.randn(256, 3, dtype=torch.float16).T), ValueError, r"a's last dimension must be contiguous"),
        (dict(group_size=32), ValueError, r"group_size must be 64 or 128"),
        (
            dict(
                a=torch.randn(3, 192, dtype=torch.float16),
                weight_packed=torch.zeros(32, 96, dtype=torch.uint8),
                scales=torch.ones(32, 1, dtype=torch.float16),
            ),
            ValueError,
            r"K \(a.shape\[1\] = 192\) must be a positive multiple of group_size \(128\)",
        ),
        (dict(weight_packed=torch.zeros(32, 128, dtype=torch.int8)), TypeError, r"weight_packed must be uint8"),
        (dict(weight_packed=torch.zeros(32, 256, dtype=torch.uint8)), ValueError, r"weight_packed must be \[N, K/2\]"),
        (dict(scales=torch.ones(32, 2, dtype=torch.bfloat16)), TypeError, r"scales \(a's dtype\) must be float16"),
        (
            dict(scales=torch.ones(32, 4, dtype=torch.float16)),
            ValueError,
            r"scales must be \[N, K/group_size\] = \[32, 2\]",
        ),
        (dict(scales=torch.ones(31, 2, dtype=torch.float16)), ValueError, r"scales must be \[N, K/group_size\]"),
        (dict(zeros=torch.ones(32, 2, dtype=torch.float32)), TypeError, r"zeros \(a's dtype\) must be float16"),
        (dict(zeros=torch.ones(32, 3, dtype=torch.float16)), ValueError, r"zeros must be \[N, K/group_size\]"),
        (dict(scales=torch.ones(4, 32, dtype=torch.float16)[::2].T), ValueError, r"scales must be contiguous or N-"),
        (
            dict(weight_packed=torch.zeros(24, 128, dtype=torch.uint8), scales=torch.ones(24, 2, dtype=torch.float16)),
            ValueError,
            r"N = weight_packed.shape\[0\] must be a multiple of 16",
        ),
    ],
)
def test_gemm_bad_input(over, exc, pattern):
    with pytest.raises(exc, match=r"qops\.w4a16_gemm: " + pattern):
        qops.w4a16_gemm(**_gemm_args(**over))


# ---- op registration -----------------------------------------------------------------------------
@pytest.mark.parametrize("with_zeros", [False, True])
def test_opcheck_gemm(with_zeros):
    packed, scales, zeros = random_int4_weight(32, 128, 64, torch.bfloat16, with_zeros)
    a = torch.randn(3, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qops.w4a16_gemm.default, (a, packed, scales, zeros, 64))


def test_opcheck_prepack():
    w = torch.randint(0, 256, (32, 64), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.qops.w4a16_prepack.default, (w,))


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only torch build")
@pytest.mark.parametrize("name", OPS)
def test_no_cuda_kernel_in_cpu_build(name):
    assert name in qops.op_names()
    assert not qops.has_cuda_kernel(name)


@pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
@pytest.mark.parametrize("name", OPS)
def test_cuda_without_kernel_raises(name):
    if qops.has_cuda_kernel(name):
        pytest.skip(f"this build has a CUDA kernel for {name}")
    packed, scales, zeros = random_int4_weight(32, 128, 64, torch.float16, True)
    args = {
        "w4a16_prepack": (packed,),
        "w4a16_gemm": (torch.randn(3, 128, dtype=torch.float16), packed, scales, zeros, 64),
    }[name]
    args = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in args)
    with pytest.raises(NotImplementedError, match=rf"qops\.{name}"):
        getattr(torch.ops.qops, name)(*args)
