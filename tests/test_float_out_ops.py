"""The activation-dtype ops of the W4A16 layers and of every variant's attention: rms_norm,
fused_add_rms_norm, silu_and_mul (the fused norm / activation kernels without the quantizer) and
rotary_embedding (in place on q and k).

CPU: qops' references against float64 / an independent statement of the math, fakes, opcheck,
errors. GPU: the CUDA kernels against the reference on fresh random inputs at awkward sizes, with
poisoned outputs, strided inputs, CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.activation import _silu_and_mul_ref
from qops.norm import _fused_add_rms_norm_ref, _rms_norm_ref
from qops.rope import _rotary_embedding_ref
from qops.testing import poison_cuda_allocator

HALF = [torch.float16, torch.bfloat16]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make(T, H, dtype, device="cpu", seed=0, extra=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(T, H + extra, generator=g) * 3).to(dtype)[:, :H]
    r = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    return x.to(device), r.to(device), w.to(device)


def assert_ulp_close(out, ref, max_frac=1e-2):
    """Every element within one unit in the last place of the dtype; at most ``max_frac`` differ."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert not out.isnan().any(), "NaN in the output (an element never written?)"
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=1e-6)
    if out.numel():
        frac = (out != ref).float().mean().item()
        assert frac <= max_frac, f"{frac:.2e} of the outputs differ"


def rope_tables(max_pos, D, base=10000.0, scaling=1.0):
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)
    return (emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous()


def rope64(x, pos, cos, sin):
    """Rotate-half RoPE in float64 from the tables (independent statement of the math)."""
    xd = x.double()
    h = xd.shape[-1] // 2
    c, s = cos[pos].double()[:, None, :], sin[pos].double()[:, None, :]
    lo, hi = xd[..., :h], xd[..., h:]
    return torch.cat((lo * c[..., :h] - hi * s[..., :h], hi * c[..., h:] + lo * s[..., h:]), dim=-1)


# ---- CPU: references ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("H", [64, 111, 4096])
def test_rms_norm_reference(dtype, H):
    x, r, w = make(9, H, dtype, seed=H)
    xd = x.double()
    y64 = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out = qops.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and out.is_contiguous()
    assert_ulp_close(out, y64.to(dtype), max_frac=0.02)
    # fused: the residual becomes the rounded sum, then exactly rms_norm of it
    r0 = r.clone()
    out2 = qops.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(r, (x.float() + r0.float()).to(dtype))
    assert torch.equal(out2, qops.rms_norm(r, w, 1e-5))


@pytest.mark.parametrize("dtype", HALF)
def test_silu_and_mul_reference(dtype):
    x, _, _ = make(7, 2 * 96, dtype)
    g, u = x.double()[:, :96], x.double()[:, 96:]
    y64 = g * torch.sigmoid(g) * u
    out = qops.silu_and_mul(x)
    assert out.shape == (7, 96) and out.dtype == dtype
    assert_ulp_close(out, y64.to(dtype), max_frac=0.02)


@pytest.mark.parametrize("dtype", HALF)
def test_rope_reference(dtype):
    T, HQ, HK, D = 6, 4, 2, 64
    cos, sin = rope_tables(100, D, scaling=1.1)
    qkv = (torch.randn(T, (HQ + 2 * HK) * D) * 2).to(dtype)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    v0 = qkv[:, (HQ + HK) * D :].clone()
    q64, k64 = rope64(q, torch.arange(T) * 13, cos, sin), rope64(k, torch.arange(T) * 13, cos, sin)
    qops.rotary_embedding(torch.arange(T) * 13, q, k, cos, sin)
    assert_ulp_close(q, q64.to(dtype), max_frac=0.05)
    assert_ulp_close(k, k64.to(dtype), max_frac=0.05)
    assert torch.equal(qkv[:, (HQ + HK) * D :], v0), "v must not change"
    # the same math as the Llama's Rotary module
    from qops.llama.layers import Rotary

    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    rot = Rotary(inv, 100, attention_scaling=1.1)
    x = (torch.randn(T, HK, D) * 2).to(dtype)
    pos = torch.tensor([0, 5, 99, 3, 3, 42])
    y = x.clone()
    qops.rotary_embedding(pos, y, torch.empty(T, 0, D, dtype=dtype), rot.cos, rot.sin)
    assert torch.equal(y, rot(x, pos))


def test_float_ops_opcheck():
    x, r, w = make(5, 128, torch.float16)
    torch.library.opcheck(torch.ops.qops.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.qops.fused_add_rms_norm.default, (x, r, w, 1e-6))
    torch.library.opcheck(torch.ops.qops.silu_and_mul.default, (x,))
    cos, sin = rope_tables(16, 32)
    q, k = torch.randn(3, 4, 32, dtype=torch.bfloat16), torch.randn(3, 2, 32, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qops.rotary_embedding.default, (torch.tensor([1, 2, 15]), q, k, cos, sin))


def _errors_on_both_devices(device: str) -> None:
    """The checks the CPU reference and the CUDA glue share, with the same messages."""
    x, r, w = make(3, 64, torch.float16, device)
    with pytest.raises(ValueError, match=r"qops.rms_norm: weight must have shape \[64\]"):
        qops.rms_norm(x, w[:10], 1e-6)
    with pytest.raises(ValueError, match=r"qops.fused_add_rms_norm: residual must have the input's shape"):
        qops.fused_add_rms_norm(x, r[:2], w, 1e-6)
    with pytest.raises(ValueError, match=r"qops.silu_and_mul: input's last dimension must be 2\*I"):
        qops.silu_and_mul(x[:, :63])
    cos, sin = (t.to(device) for t in rope_tables(8, 64))
    q = torch.randn(3, 2, 64, dtype=torch.float16, device=device)
    k = torch.randn(3, 1, 64, dtype=torch.float16, device=device)
    pos = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match=r"key must be \[T, H_kv, D\] = \[3, H_kv, 64\]"):
        qops.rotary_embedding(pos, q, k[:2], cos, sin)
    with pytest.raises(ValueError, match=r"cos must be float32 \[max_pos, D\] with D = 64"):
        qops.rotary_embedding(pos, q, k, cos[:, :32].contiguous(), sin)


def test_float_ops_errors():
    _errors_on_both_devices("cpu")
    x, r, w = make(3, 64, torch.float16)
    with pytest.raises(TypeError, match=r"qops.rms_norm: input must be"):
        qops.rms_norm(x.float(), w, 1e-6)
    cos, sin = rope_tables(8, 64)
    q = torch.randn(3, 2, 64, dtype=torch.float16)
    k = torch.randn(3, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"qops.rotary_embedding: positions must be in \[0, 8\), got \[0, 8\]"):
        qops.rotary_embedding(torch.tensor([0, 1, 8]), q, k, cos, sin)
    with pytest.raises(TypeError, match=r"positions must be"):
        qops.rotary_embedding(torch.tensor([0, 1, 2], dtype=torch.int32), q, k, cos, sin)


# ---- GPU: the CUDA kernels against the reference ---------------------------------------------------
NORM_SIZES = [(1, 64), (3, 111), (17, 576), (1, 4096), (16, 4096), (5, 5120), (33, 11008), (9, 16384),
              (2, 32768), (130, 1000), (1025, 1536), (4097, 4096)]  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,H", NORM_SIZES)
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_rms_norm(dtype, T, H, fused):
    check_cuda_rms_norm(*make(T, H, dtype, "cuda", seed=T * 7 + H), 1e-5, fused)


def check_cuda_rms_norm(x, r, w, eps, fused):
    """The CUDA op (poisoned allocator) against the reference on the same GPU tensors; with
    ``fused``, the residual updated in place too."""
    r_ref = r.clone()
    ref = _fused_add_rms_norm_ref(x, r_ref, w, eps) if fused else _rms_norm_ref(x, w, eps)
    poison_cuda_allocator(8 * x.numel() + 4096)
    out = qops.fused_add_rms_norm(x, r, w, eps) if fused else qops.rms_norm(x, w, eps)
    torch.cuda.synchronize()
    assert out.is_contiguous()
    assert_ulp_close(out, ref)
    if fused:
        assert torch.equal(r, r_ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("extra", [8, 3])  # 16-byte aligned row stride, and not (scalar path)
def test_cuda_rms_norm_strided(dtype, fused, extra):
    check_cuda_rms_norm(*make(37, 2048, dtype, "cuda", seed=extra, extra=extra), 1e-6, fused)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,I", [(1, 64), (3, 100), (1, 11008), (16, 11008), (5, 14336), (2, 28672), (513, 1376)])
@pytest.mark.parametrize("extra", [0, 3])
def test_cuda_silu_and_mul(dtype, T, I, extra):
    x, _, _ = make(T, 2 * I, dtype, "cuda", seed=I + extra, extra=extra)
    ref = _silu_and_mul_ref(x)
    poison_cuda_allocator(4 * T * I + 4096)
    out = qops.silu_and_mul(x)
    assert out.is_contiguous() and out.shape == (T, I)
    assert_ulp_close(out, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("T,HQ,HK,D", [(1, 32, 32, 128), (16, 32, 8, 128), (7, 9, 3, 64), (300, 4, 1, 256),
                                       (5, 3, 1, 80), (4, 2, 2, 36), (3, 2, 1, 6)])  # fmt: skip
def test_cuda_rope(dtype, T, HQ, HK, D):
    g = torch.Generator(device="cpu").manual_seed(T * 31 + D)
    cos, sin = rope_tables(4096, D, scaling=0.9)
    cos, sin = cos.cuda(), sin.cuda()
    qkv = (torch.randn(T, (HQ + 2 * HK) * D, generator=g) * 2).to(dtype).cuda()
    pos = torch.randint(0, 4096, (T,), generator=g).cuda()
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HK) * D].view(T, HK, D)
    v0 = qkv[:, (HQ + HK) * D :].clone()
    q_ref, k_ref = q.clone(), k.clone()
    q_cpu, k_cpu = q.cpu(), k.cpu()
    _rotary_embedding_ref(pos, q_ref, k_ref, cos, sin)
    qops.rotary_embedding(pos, q, k, cos, sin)
    torch.cuda.synchronize()
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref), "not bit-exact with the reference"
    assert torch.equal(qkv[:, (HQ + HK) * D :], v0), "v changed"
    # and against the CPU op
    qops.rotary_embedding(pos.cpu(), q_cpu, k_cpu, cos.cpu(), sin.cpu())
    assert torch.equal(q.cpu(), q_cpu) and torch.equal(k.cpu(), k_cpu)


@gpu
@needs_cuda
def test_cuda_rope_matches_cpu_op_and_bad_position():
    cos, sin = rope_tables(64, 128)
    q, k = torch.randn(5, 4, 128, dtype=torch.float16), torch.randn(5, 2, 128, dtype=torch.float16)
    pos = torch.tensor([0, 63, 7, 7, 1])
    qg, kg = q.cuda(), k.cuda()
    qops.rotary_embedding(pos, q, k, cos, sin)
    qops.rotary_embedding(pos.cuda(), qg, kg, cos.cuda(), sin.cuda())
    assert torch.equal(qg.cpu(), q) and torch.equal(kg.cpu(), k)
    # a position outside the tables: NaN in that token's heads only, no out-of-bounds read
    qg = torch.randn(3, 4, 128, dtype=torch.float16, device="cuda")
    kg = torch.randn(3, 2, 128, dtype=torch.float16, device="cuda")
    qops.rotary_embedding(torch.tensor([1, 64, -1], device="cuda"), qg, kg, cos.cuda(), sin.cuda())
    assert qg[1:].isnan().all() and kg[1:].isnan().all() and not qg[0].isnan().any()


@gpu
@needs_cuda
def test_cuda_float_ops_graph_and_empty():
    x, r, w = make(4, 4096, torch.float16, "cuda")
    cos, sin = rope_tables(64, 128)
    cos, sin = cos.cuda(), sin.cuda()
    q = torch.randn(4, 32, 128, dtype=torch.float16, device="cuda")
    k = torch.randn(4, 8, 128, dtype=torch.float16, device="cuda")
    pos = torch.tensor([3, 4, 5, 6], device="cuda")
    q0, k0, r0 = q.clone(), k.clone(), r.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = qops.rms_norm(x, w, 1e-6)
        b = qops.fused_add_rms_norm(x, r, w, 1e-6)
        c = qops.silu_and_mul(x)
        qops.rotary_embedding(pos, q, k, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, qops.rms_norm(x, w, 1e-6))
    assert torch.equal(c, qops.silu_and_mul(x))
    r1 = r0.clone()
    assert torch.equal(b, qops.fused_add_rms_norm(x, r1, w, 1e-6)) and torch.equal(r, r1)
    q1, k1 = q0.clone(), k0.clone()
    qops.rotary_embedding(pos, q1, k1, cos, sin)
    assert torch.equal(q, q1) and torch.equal(k, k1)
    e = torch.empty(0, 4096, dtype=torch.float16, device="cuda")
    assert qops.rms_norm(e, w, 1e-6).shape == (0, 4096)
    assert qops.silu_and_mul(e).shape == (0, 2048)
    qops.rotary_embedding(pos[:0], q[:0], k[:0], cos, sin)


@gpu
@needs_cuda
def test_cuda_float_ops_errors():
    _errors_on_both_devices("cuda")
