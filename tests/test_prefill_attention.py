"""paged_prefill_attention_int8: packed (chunked) prefill over the paged int8 cache.

CPU: the reference against the decode reference run once per new token (an independent
formulation: query j of a sequence is a decode step at context p_j + 1), the registered op, the
argument checks. GPU: the CUDA kernel against the float64 reference at awkward sizes (chunks of
0, 1, 5, 63-65, 130 tokens over prefixes of 0 to 700, GQA ratios 1 to 8 and MQA, both head dims,
both dtypes, static scales, ALiBi, block sizes 16 to 128), a strided query, a poisoned memory pool,
CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.attention import alibi_slopes, decode_attention_reference
from qops.prefill import prefill_attention_reference

OP = "paged_prefill_attention_int8"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_inputs(prefix, new, HQ, HKV, D, block_size, *, static=False, dtype=torch.float16, seed=0):
    """Sequences of prefix[b] cached tokens and new[b] new ones, all written (reshape_and_cache_int8)
    into shuffled blocks; the new tokens' queries packed. Returns (query, k_cache, v_cache,
    k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in zip(prefix, new)]
    nblk = [-(-L // block_size) for L in lens]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(lens), max(nblk + [1]) + 1), -1, dtype=torch.int32)
    slots, ks_fp, vs_fp = [], [], []
    for b, L in enumerate(lens):
        blocks = [perm.pop() for _ in range(nblk[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[j // block_size] * block_size + j % block_size for j in range(L)]
        k = torch.randn(L, HKV, D, generator=g) * (0.5 + torch.rand(L, HKV, 1, generator=g) * 2)
        k[..., 3] *= 4  # an outlier channel
        ks_fp.append(k.to(dtype))
        vs_fp.append((torch.randn(L, HKV, D, generator=g) * (0.2 + torch.rand(L, HKV, 1, generator=g))).to(dtype))
    k_cache = torch.zeros(num_blocks, HKV, block_size, D, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    if static:
        k_scales = (torch.cat(ks_fp).float().abs().amax() / 127).reshape(1)
        v_scales = (torch.cat(vs_fp).float().abs().amax() / 127).reshape(1)
    else:
        k_scales = torch.full((num_blocks, HKV, block_size), float("nan"))  # unused slots: poison
        v_scales = k_scales.clone()
    if slots:
        qops.reshape_and_cache_int8(
            torch.cat(ks_fp), torch.cat(vs_fp), k_cache, v_cache, k_scales, v_scales, torch.tensor(slots)
        )
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = (torch.randn(int(cu[-1]), HQ, D, generator=g) * 1.5).to(dtype)
    return q, k_cache, v_cache, k_scales, v_scales, block_tables, torch.tensor(lens, dtype=torch.int32), cu


def per_token_oracle(q, k_cache, v_cache, ks, vs, bt, lens, cu, sm, slopes):
    """Each new token as a decode step over its own prefix (float64)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(lens)):
        n = int(cu[b + 1] - cu[b])
        for j in range(n):
            row = int(cu[b]) + j
            ctx = torch.tensor([int(lens[b]) - n + j + 1], dtype=torch.int32)
            o = decode_attention_reference(
                q[row : row + 1], k_cache, v_cache, ks, vs, bt[b : b + 1], ctx, sm, slopes, dtype=torch.float64
            )
            out[row] = o[0]
    return out


# ---- CPU: the reference and the registered op -----------------------------------------------------
@pytest.mark.parametrize("HQ,HKV", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("D,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("static,alibi", [(False, False), (True, False), (False, True)])
def test_reference_matches_per_token_decode(HQ, HKV, D, block_size, static, alibi):
    args = make_inputs([0, 13, 40, 5], [9, 1, 20, 0], HQ, HKV, D, block_size, static=static, seed=HQ + D)
    sm = D**-0.5
    slopes = alibi_slopes(HQ) if alibi else None
    ref = prefill_attention_reference(*args, sm, slopes, dtype=torch.float64)
    torch.testing.assert_close(ref, per_token_oracle(*args, sm, slopes), rtol=1e-10, atol=1e-10)
    # the op on the CPU: the float32 reference in the query's dtype
    out = qops.paged_prefill_attention_int8(*args, None, sm, slopes)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)


def test_reference_causality_can_fail():
    """A mask that lets a chunk's queries see their own later tokens changes the result (the
    check above would notice): the last chunk token's output differs from the first's context."""
    q, kc, vc, ks, vs, bt, lens, cu = make_inputs([10], [6], 4, 2, 64, 16)
    full = prefill_attention_reference(q, kc, vc, ks, vs, bt, lens, cu, 0.125, dtype=torch.float64)
    # the same queries as if each saw the whole context (no causality inside the chunk)
    nocausal = decode_attention_reference(
        q, kc, vc, ks, vs, bt.expand(6, -1).contiguous(), lens.expand(6).contiguous(), 0.125, dtype=torch.float64
    )
    assert torch.allclose(full[-1], nocausal[-1])
    assert (full[:-1] - nocausal[:-1]).abs().max() > 1e-3


def test_opcheck():
    args = make_inputs([3, 20], [5, 17], 4, 2, 64, 16)
    torch.library.opcheck(torch.ops.qops.paged_prefill_attention_int8.default, (*args, 17, 0.125, None))
    torch.library.opcheck(torch.ops.qops.paged_prefill_attention_int8.default, (*args, 20, 0.125, alibi_slopes(4)))


def _bad(**over):
    q, kc, vc, ks, vs, bt, lens, cu = make_inputs([3, 20], [5, 17], 4, 2, 64, 16)
    a = dict(query=q, k_cache=kc, v_cache=vc, k_scales=ks, v_scales=vs, block_tables=bt, seq_lens=lens, cu_seqlens_q=cu)
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(query=torch.randn(22, 4, 64)), "query must be float16 or bfloat16"),
        (dict(query=torch.randn(22, 4, 96, dtype=torch.float16)), "must match k_cache's D"),
        (dict(query=torch.randn(22, 3, 64, dtype=torch.float16)), "multiple of the number of kv heads"),
        (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), "cu_seqlens_q must be int32 \\[B \\+ 1\\]"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 22])), "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 21], dtype=torch.int32)), "from 0 to T = 22"),
        (dict(cu_seqlens_q=torch.tensor([0, 23, 22], dtype=torch.int32)), "without decreasing"),
        (dict(cu_seqlens_q=torch.tensor([0, 9, 22], dtype=torch.int32)), "must be in its context"),
        (dict(max_query_len=23), "max_query_len must be in"),
        (dict(max_query_len=-1), "max_query_len must be in"),
        (dict(seq_lens=torch.tensor([8, 4000], dtype=torch.int32)), "seq_lens must be in"),
        (dict(block_tables=torch.full((2, 3), 99, dtype=torch.int32)), "block ids outside"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must be float32 \\[HQ\\]"),
    ],
)
def test_bad_inputs(over, match):
    with pytest.raises((ValueError, TypeError), match=f"qops.{OP}.*{match}"):
        qops.paged_prefill_attention_int8(**_bad(**over))


# ---- GPU: the CUDA kernel -------------------------------------------------------------------------
def _gpu_case(prefix, new, HQ, HKV, D, block_size, *, dtype=torch.float16, static=False, alibi=False, seed=0):
    cpu = make_inputs(prefix, new, HQ, HKV, D, block_size, static=static, dtype=dtype, seed=seed)
    sm = D**-0.5
    slopes = alibi_slopes(HQ) if alibi else None
    torch.empty(1 << 24, dtype=torch.uint8, device="cuda").fill_(0xFF)  # garbage in the pool
    out = qops.paged_prefill_attention_int8(
        *(t.cuda() for t in cpu), None, sm, None if slopes is None else slopes.cuda()
    ).cpu()
    assert out.dtype == dtype and out.shape == cpu[0].shape
    ref = prefill_attention_reference(*cpu, sm, slopes, dtype=torch.float64)
    # per (token, head): P in fp16 (one rounding per weight) and the output's rounding
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-6)
    tol = 4e-3 if dtype == torch.float16 else 1.2e-2
    torch.testing.assert_close(out.double() / scale, ref / scale, atol=tol, rtol=0)
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("HQ,HKV", [(8, 8), (9, 3), (32, 8), (16, 2), (12, 1)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_gqa_ratios(HQ, HKV, D, dtype):
    _gpu_case([0, 7, 100, 0, 33], [1, 5, 64, 0, 130], HQ, HKV, D, 16, dtype=dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_block_sizes_and_static(block_size, static):
    _gpu_case([700, 3, 0], [63, 65, 200], 8, 2, 128, block_size, static=static, seed=block_size)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_alibi(D):
    _gpu_case([40, 0], [70, 129], 8, 4, D, 16, alibi=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_long_prompt():
    _gpu_case([0], [2048], 32, 8, 128, 16, dtype=torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_gpu_strided_query_and_graph():
    q, kc, vc, ks, vs, bt, lens, cu = (t.cuda() for t in make_inputs([30, 2], [17, 40], 8, 2, 64, 16))
    qkv = torch.randn(q.shape[0], 12, 64, dtype=torch.float16, device="cuda")
    qkv[:, :8] = q
    strided = qkv[:, :8]  # a slice of a fused projection
    eager = qops.paged_prefill_attention_int8(q, kc, vc, ks, vs, bt, lens, cu)
    assert torch.equal(qops.paged_prefill_attention_int8(strided, kc, vc, ks, vs, bt, lens, cu), eager)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qops.paged_prefill_attention_int8(q, kc, vc, ks, vs, bt, lens, cu, 40)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_gpu_misaligned_query_and_any_max_query_len():
    """A contiguous query at an address that is not 8-byte aligned (copied by the glue), and
    max_query_len as a grid size only: 1 (CTAs loop over the long sequence's query tiles) and T."""
    q, kc, vc, ks, vs, bt, lens, cu = (t.cuda() for t in make_inputs([5, 0], [150, 70], 8, 2, 128, 16))
    ref = qops.paged_prefill_attention_int8(q, kc, vc, ks, vs, bt, lens, cu)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    odd = buf[1:].view(q.shape)
    odd.copy_(q)
    assert odd.is_contiguous() and odd.data_ptr() % 8 != 0
    assert torch.equal(qops.paged_prefill_attention_int8(odd, kc, vc, ks, vs, bt, lens, cu), ref)
    for m in (0, 1, 64, q.shape[0]):
        assert torch.equal(qops.paged_prefill_attention_int8(q, kc, vc, ks, vs, bt, lens, cu, m), ref), m


@pytest.mark.gpu
@needs_cuda
def test_gpu_v_scales_spread_over_many_octaves():
    """V rows whose magnitudes (hence scales) differ by up to 2^24 along the context: P' = P v_scale
    2^e keeps every key's share (the exponent follows the largest scale so far)."""
    q, kc, vc, ks, vs, bt, lens, cu = make_inputs([300], [90], 4, 2, 64, 16, seed=5)
    mag = 2.0 ** torch.linspace(-12, 12, ks.numel()).reshape(vs.shape)
    vs = torch.where(torch.isnan(vs), vs, vs * mag[torch.randperm(mag.numel()).reshape(vs.shape)])
    sm = 64**-0.5
    out = qops.paged_prefill_attention_int8(*(t.cuda() for t in (q, kc, vc, ks, vs, bt, lens, cu)), None, sm).cpu()
    ref = prefill_attention_reference(q, kc, vc, ks, vs, bt, lens, cu, sm, dtype=torch.float64)
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out.double() / scale, ref / scale, atol=4e-3, rtol=0)
