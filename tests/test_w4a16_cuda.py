"""w4a16_prepack / w4a16_gemm on CUDA against the CPU reference (python/qops/w4a16.py): the
prepack's bytes against an independent statement of the shuffled layout, every config (the decode
GEMV and, in sm_90a builds, the CUTLASS mixed-input kernels) within half-dtype rounding of a
float64 product of the same int4 weights, and the CUDA-only input errors."""

from __future__ import annotations

import pytest
import torch

import qops
from qops.testing import poison_cuda_allocator, random_int4_weight
from qops.w4a16 import n_major, unpack_int4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HALF = (torch.float16, torch.bfloat16)


def shuffle_reference(packed: torch.Tensor) -> torch.Tensor:
    """The shuffled layout (docs/int4.md) from its definition: atom (k // 16, n // 16), lane
    4 (n % 8) + (k % 16 // 2) % 4, nibble (n % 16) // 8 + 2 ((k % 16) // 8) + 4 (k % 2)."""
    n, half_k = packed.shape
    k = 2 * half_k
    p = packed.to(torch.int64)
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, 0::2], q[:, 1::2] = p & 0xF, p >> 4  # nibbles (two's complement kept as 0..15)
    nn = torch.arange(n).view(n, 1).expand(n, k)
    kk = torch.arange(k).view(1, k).expand(n, k)
    atom = (kk // 16) * (n // 16) + nn // 16
    lane = 4 * (nn % 8) + ((kk % 16) // 2) % 4
    nib = (nn % 16) // 8 + 2 * ((kk % 16) // 8) + 4 * (kk % 2)
    word = torch.zeros(n * k // 8, dtype=torch.int64)
    word.index_add_(0, (atom * 32 + lane).flatten(), (q << (4 * nib)).flatten())
    return word.to(torch.int32).view(torch.uint8).view(k // 16, n // 16, 128)


def ref_weight(packed, scales, zeros, g) -> torch.Tensor:
    """W[n, k] = q s (+ z) in float64, no rounding (the exact weights)."""
    w = unpack_int4(packed).double() * scales.double().repeat_interleave(g, 1)
    return w if zeros is None else w + zeros.double().repeat_interleave(g, 1)


def configs() -> list[str]:
    """The configs of this build: the table's w4a16 family in sm_90a builds, else the GEMV."""
    if not qops.has_cuda_kernel("w8a8_gemm"):
        return ["gemv"]
    from cutlass_kernels import w8a8_configs as table

    return table.config_names(family="w4a16")


def check_close(out, a, packed, scales, zeros, g):
    """|out - a W^T| <= 4 eps (|a| |W|^T) (+ a tiny floor): the half-dtype rounding of W (the
    CUTLASS mainloop forms half(q s) (+ z)) and of the output, f32 accumulation."""
    w = ref_weight(packed, scales, zeros, g)
    ref = a.double().cpu() @ w.T
    bound = 4 * torch.finfo(a.dtype).eps * (a.double().cpu().abs() @ w.abs().T) + 1e-6
    err = (out.double().cpu() - ref).abs()
    assert torch.isfinite(out).all()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess {worst:.3g} (max err {err.max().item():.3g})"


# ---- prepack --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k", [(16, 64), (48, 128), (4096, 192), (80, 4096)])
def test_prepack_matches_layout_definition(n, k):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    out = qops.w4a16_prepack(w.cuda())
    assert out.shape == (k // 16, n // 16, 128) and out.dtype == torch.uint8
    assert torch.equal(out.cpu(), shuffle_reference(w))


def test_prepack_strided_input_and_errors():
    wide = torch.randint(0, 256, (32, 96), dtype=torch.uint8).cuda()
    assert torch.equal(qops.w4a16_prepack(wide[:, :64]).cpu(), shuffle_reference(wide[:, :64].cpu()))
    with pytest.raises(ValueError, match=r"qops\.w4a16_prepack: N = weight.shape\[0\] must be a multiple of 16"):
        qops.w4a16_prepack(torch.zeros(8, 64, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match=r"qops\.w4a16_prepack: K .*multiple of 64"):
        qops.w4a16_prepack(torch.zeros(16, 48, dtype=torch.uint8, device="cuda"))


# ---- the GEMM: every config, awkward shapes ----------------------------------------------------
MS = (1, 2, 7, 16, 17, 64, 255, 1000, 4096)
NK = ((48, 128), (4096, 4096), (1280, 1024), (272, 2304))


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["scale", "scale+zero"])
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("m", MS)
def test_gemm_auto_matches_reference(m, g, with_zeros, dtype):
    n, k = NK[m % len(NK)]
    if m >= 1000 and n * k > 4096 * 1024:
        n, k = 1280, 1024
    packed, scales, zeros = random_int4_weight(n, k, g, dtype, with_zeros, seed=m + g)
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(m, k, generator=gen).to(dtype)
    wp = qops.w4a16_prepack(packed.cuda())
    poison_cuda_allocator()
    zc = None if zeros is None else n_major(zeros.cuda())
    out = qops.w4a16_gemm(a.cuda(), wp, n_major(scales.cuda()), zc, g)
    assert out.shape == (m, n) and out.dtype == dtype
    check_close(out, a, packed, scales, zeros, g)


@pytest.mark.parametrize("config", configs())
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_zeros", [False, True], ids=["scale", "scale+zero"])
@pytest.mark.parametrize(
    "m,n,k,g",
    [(1, 4096, 4096, 128), (5, 272, 2304, 64), (16, 12288, 4096, 128), (13, 1280, 8192, 64), (3, 8192, 1024, 128)],
)
def test_gemm_each_config(config, m, n, k, g, with_zeros, dtype):
    packed, scales, zeros = random_int4_weight(n, k, g, dtype, with_zeros, seed=n + k + m)
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    wp = qops.w4a16_prepack(packed.cuda())
    poison_cuda_allocator()
    zc = None if zeros is None else zeros.cuda()  # row-major: the glue transposes them
    out = qops.w4a16_gemm(a.cuda(), wp, scales.cuda(), zc, g, config=config)
    check_close(out, a, packed, scales, zeros, g)


# The decode GEMV splits K over CTAs where the 64-row tiles alone leave SMs idle (as many splits as
# fit in one wave), and over the 8 warps of a CTA; a partial last tile has 1-3 row blocks. These
# shapes cover one CTA, many splits of few groups, no split, last tiles of one row block and long
# K (down projections), at M on either side of the 8-token MMA tile.
GEMV_SHAPES = [
    (16, 64, 64),  # one CTA, one group
    (80, 4096, 128),  # 2 tiles (the last one row block), 32 groups: many splits
    (8192, 1024, 128),  # 128 tiles, 8 groups: one group per warp, no split
    (1040, 11008, 64),  # 17 tiles x 172 groups, last tile one row block
    (4096, 14336, 128),  # long K: 4 splits of 28 groups
    (4096, 14336, 64),
    (208, 8192, 64),  # 4 tiles (the last one row block) x 128 groups, many splits
]


@pytest.mark.parametrize("n,k,g", GEMV_SHAPES, ids=[f"{n}x{k}g{g}" for n, k, g in GEMV_SHAPES])
@pytest.mark.parametrize("m", [1, 7, 9, 16])
def test_gemv_partitions(n, k, g, m):
    dtype = torch.float16 if (n + m) % 2 else torch.bfloat16
    with_zeros = (k // g + m) % 2 == 1
    packed, scales, zeros = random_int4_weight(n, k, g, dtype, with_zeros, seed=n * 7 + k + m)
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(dtype)
    wp = qops.w4a16_prepack(packed.cuda())
    s = n_major(scales.cuda())
    z = None if zeros is None else n_major(zeros.cuda())
    poison_cuda_allocator()
    outs = [qops.w4a16_gemm(a.cuda(), wp, s, z, g, config="gemv") for _ in range(2)]
    assert torch.equal(outs[0], outs[1])  # the partials are added in a fixed order
    check_close(outs[0], a, packed, scales, zeros, g)


def test_gemm_matches_cpu_reference_and_is_deterministic():
    packed, scales, zeros = random_int4_weight(272, 1024, 128, torch.bfloat16, True, seed=3)
    a = torch.randn(9, 1024, dtype=torch.bfloat16)
    wp = qops.w4a16_prepack(packed.cuda())
    outs = [qops.w4a16_gemm(a.cuda(), wp, scales.cuda(), zeros.cuda(), 128) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = qops.w4a16_gemm(a, packed, scales, zeros, 128)  # CPU reference (kernel order)
    check_close(outs[0], a, packed, scales, zeros, 128)
    check_close(ref, a, packed, scales, zeros, 128)


def test_gemm_strided_and_unaligned_a():
    packed, scales, _ = random_int4_weight(64, 256, 64, torch.float16, False, seed=1)
    wp = qops.w4a16_prepack(packed.cuda())
    s = scales.cuda()
    wide = torch.randn(6, 300, dtype=torch.float16, device="cuda")
    for a in (wide[:, 8:264], wide[:, 1:257], wide[1:, 2:258]):
        out = qops.w4a16_gemm(a, wp, s, None, 64)
        torch.testing.assert_close(out, qops.w4a16_gemm(a.contiguous(), wp, s, None, 64), rtol=0, atol=0)


def test_gemm_cuda_graph_and_reuse():
    packed, scales, zeros = random_int4_weight(1280, 8192, 128, torch.bfloat16, True, seed=7)
    wp = qops.w4a16_prepack(packed.cuda())
    s, z = n_major(scales.cuda()), n_major(zeros.cuda())
    a = torch.randn(4, 8192, dtype=torch.bfloat16, device="cuda")
    eager = qops.w4a16_gemm(a, wp, s, z, 128)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qops.w4a16_gemm(a, wp, s, z, 128)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = qops.w4a16_gemm(a, wp, s, z, 128)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, qops.w4a16_gemm(a, wp, s, z, 128))
    assert not torch.equal(out, eager)


def test_gemm_cuda_errors():
    packed, scales, zeros = random_int4_weight(32, 128, 64, torch.float16, True)
    a = torch.randn(3, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(
        ValueError, match=r"qops\.w4a16_gemm: weight_packed must be qops\.w4a16_prepack's output.*reference layout"
    ):
        qops.w4a16_gemm(a, packed.cuda(), scales.cuda(), None, 64)
    wp = qops.w4a16_prepack(packed.cuda())
    with pytest.raises(TypeError, match=r"qops\.w4a16_gemm: scales \(a's dtype\) must be"):
        qops.w4a16_gemm(a, wp, scales.cuda().bfloat16(), None, 64)
    with pytest.raises(ValueError, match=r"qops\.w4a16_gemm: scales must be \[N, K/group_size\] = \[32, 2\]"):
        qops.w4a16_gemm(a, wp, scales.cuda()[:, :1], None, 64)
    with pytest.raises(ValueError, match=r"qops\.w4a16_gemm: weight_packed .* must have K = 256"):
        qops.w4a16_gemm(torch.randn(3, 256, dtype=torch.float16, device="cuda"), wp, scales.cuda(), None, 128)
    with pytest.raises(ValueError, match=r"qops\.w4a16_gemm: unknown config 'nope'"):
        qops.w4a16_gemm(a, wp, scales.cuda(), None, 64, config="nope")
    with pytest.raises(ValueError, match=r"qops\.w4a16_gemm: zeros must be contiguous or N-major"):
        qops.w4a16_gemm(a, wp, scales.cuda(), torch.ones(32, 4, dtype=torch.float16, device="cuda")[:, ::2], 64)
