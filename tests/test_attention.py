"""paged_decode_attention_int8: the reference, its CUDA kernel, and the quantization error.

The float64 model at the top is a plain per-sequence loop over the dequantized cache, written
independently of qops.attention.decode_attention_reference (which is vectorized over the batch).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import qops
from qops.attention import alibi_slopes, decode_attention_reference
from qops.testing import cuda_kernel_names, poison_cuda_allocator

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
OP = "paged_decode_attention_int8"
# The split merge is a per-call launch option, tuning=qops.DecodeTuning(merge=...): "cluster" (the
# distributed-shared-memory merge wherever the splits fit one cluster, <= 16 on sm_90; else the
# two-kernel merge), "fused" (the merge fused into the split kernel through a workspace),
# "separate" (split kernel + reduce kernel); the default "auto" is the glue's rule.


# ---- float64 reference ---------------------------------------------------------------------------
def loop_reference(q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, sm_scale, slopes=None):
    """float64, one sequence and one head at a time."""
    q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens = (
        t.cpu() for t in (q, k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens)
    )
    B, HQ, D = q.shape
    _, HKV, bs, _ = k_cache.shape
    out = torch.zeros(B, HQ, D, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        blk = torch.tensor([int(block_tables[b, j // bs]) for j in range(L)])
        off = torch.arange(L) % bs
        for h in range(HQ):
            kh = h // (HQ // HKV)
            k = k_cache[blk, kh, off].double()  # [L, D]
            v = v_cache[blk, kh, off].double()
            if k_scales.dim() == 3:
                k = k * k_scales[blk, kh, off].double()[:, None]
                v = v * v_scales[blk, kh, off].double()[:, None]
            else:
                k, v = k * float(k_scales[0]), v * float(v_scales[0])
            s = (k @ q[b, h].double()) * sm_scale
            if slopes is not None:
                s = s + float(slopes[h]) * (torch.arange(L, dtype=torch.float64) - (L - 1))
            out[b, h] = torch.softmax(s, 0) @ v
    return out


def make_cache(
    seq_lens,
    HKV,
    D,
    block_size,
    *,
    static=False,
    device="cpu",
    seed=0,
    spare_blocks=3,
    kv_dtype=torch.float16,
    table_slack=1,
):
    """Random K/V for each sequence written through reshape_and_cache_int8 into shuffled blocks.
    Returns (k_cache, v_cache, k_scales, v_scales, block_tables, seq_lens, k_fp, v_fp) where
    k_fp/v_fp are the unquantized per-sequence K/V lists (for the quantization-error check).
    ``table_slack``: block-table columns beyond the longest sequence's blocks (filled with -1)."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    nblk = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(nblk + [1]) + table_slack
    block_tables = torch.full((B, max_blocks), -1, dtype=torch.int32)  # -1: past the end, never used
    k_fp, v_fp, slots = [], [], []
    for b, L in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(nblk[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[j // block_size] * block_size + j % block_size for j in range(L)]
        # keys with an outlier channel and per-token magnitude spread, as in real models
        k = torch.randn(L, HKV, D, generator=g) * (0.5 + torch.rand(L, HKV, 1, generator=g) * 2)
        k[..., 3] *= 4
        k_fp.append(k.to(kv_dtype))
        v_fp.append(torch.randn(L, HKV, D, generator=g).to(kv_dtype))
    k_cache = torch.zeros(num_blocks, HKV, block_size, D, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    if static:  # calibrated per-tensor scales (amax / 127 over the data, TensorRT-LLM style)
        k_all = torch.cat(k_fp).float() if slots else torch.ones(1)
        v_all = torch.cat(v_fp).float() if slots else torch.ones(1)
        k_scales = (k_all.abs().amax() / 127).reshape(1)
        v_scales = (v_all.abs().amax() / 127).reshape(1)
    else:
        k_scales = torch.full((num_blocks, HKV, block_size), float("nan"))  # unused slots: poison
        v_scales = k_scales.clone()
    if slots:
        qops.reshape_and_cache_int8(
            torch.cat(k_fp),
            torch.cat(v_fp),
            k_cache,
            v_cache,
            k_scales,
            v_scales,
            torch.tensor(slots, dtype=torch.int64),
        )
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    tensors = [t.to(device) for t in (k_cache, v_cache, k_scales, v_scales, block_tables, lens)]
    return (*tensors, k_fp, v_fp)


def fp_attention(q, k_fp, v_fp, sm_scale, slopes=None):
    """float64 attention on the unquantized K/V (the quantization-error yardstick)."""
    B, HQ, D = q.shape
    out = torch.zeros(B, HQ, D, dtype=torch.float64)
    for b in range(B):
        k, v = k_fp[b].double(), v_fp[b].double()  # [L, HKV, D]
        L, HKV = k.shape[0], k.shape[1]
        if L == 0:
            continue
        for h in range(HQ):
            s = (k[:, h // (HQ // HKV)] @ q[b, h].double().cpu()) * sm_scale
            if slopes is not None:
                s = s + float(slopes[h]) * (torch.arange(L, dtype=torch.float64) - (L - 1))
            out[b, h] = torch.softmax(s, 0) @ v[:, h // (HQ // HKV)]
    return out


# ---- CPU: the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("HQ,HKV", [(4, 4), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("D,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("static", [False, True])
def test_reference_matches_loop(HQ, HKV, D, block_size, static):
    lens = [1, 0, 37, 16]
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache(lens, HKV, D, block_size, static=static)
    q = torch.randn(len(lens), HQ, D, dtype=torch.bfloat16)
    out = torch.ops.qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl, 0.3, None, 0)
    assert out.dtype == q.dtype and out.shape == q.shape
    ref = loop_reference(q, k_cache, v_cache, ks, vs, bt, sl, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=8e-3, rtol=8e-3)
    assert bool((out[1] == 0).all())  # seq_len 0 -> zeros
    ref64 = decode_attention_reference(q, k_cache, v_cache, ks, vs, bt, sl, 0.3, dtype=torch.float64)
    torch.testing.assert_close(ref64, ref, atol=1e-12, rtol=1e-12)


def test_reference_alibi():
    lens = [70, 3]
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache(lens, 2, 64, 16)
    q = torch.randn(2, 6, 64, dtype=torch.float16)
    slopes = alibi_slopes(6)
    out = qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl, 0.125, slopes)
    ref = loop_reference(q, k_cache, v_cache, ks, vs, bt, sl, 0.125, slopes)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    plain = qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl, 0.125)
    assert (plain - out).abs().max() > 1e-2  # ALiBi changes the answer


def test_reference_quantization_error_is_small():
    lens = [300, 129]
    k_cache, v_cache, ks, vs, bt, sl, k_fp, v_fp = make_cache(lens, 2, 128, 16)
    q = torch.randn(2, 8, 128, dtype=torch.float16)
    out = qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl)
    ref = fp_attention(q, k_fp, v_fp, 128**-0.5)
    rel = float((out.double() - ref).norm() / ref.norm())
    assert rel < 5e-2, rel


def test_opcheck():
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache([5, 20], 2, 64, 16)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    torch.library.opcheck(
        torch.ops.qops.paged_decode_attention_int8.default, (q, k_cache, v_cache, ks, vs, bt, sl, 0.125, None, 0)
    )
    torch.library.opcheck(
        torch.ops.qops.paged_decode_attention_int8.default,
        (q, k_cache, v_cache, ks, vs, bt, sl, 0.125, alibi_slopes(4), 3),
    )
    torch.library.opcheck(
        torch.ops.qops.paged_decode_attention_int8.default, (q, k_cache, v_cache, ks, vs, bt, sl, 0.125, None, 2, True)
    )
    # overlap_prologue is a scheduling promise: the same result
    args = (q, k_cache, v_cache, ks, vs, bt, sl, 0.125)
    assert torch.equal(
        qops.paged_decode_attention_int8(*args, overlap_prologue=True), qops.paged_decode_attention_int8(*args)
    )


def _bad_args(**over):
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache([5, 20], 2, 64, 16)
    args = dict(
        query=torch.randn(2, 4, 64, dtype=torch.float16),
        k_cache=k_cache,
        v_cache=v_cache,
        k_scales=ks,
        v_scales=vs,
        block_tables=bt,
        seq_lens=sl,
        sm_scale=0.125,
        alibi_slopes=None,
        num_splits=0,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(query=torch.randn(2, 4, 64)), "query must be float16 or bfloat16"),
        (dict(query=torch.randn(2, 4, 96, dtype=torch.float16)), "must match k_cache's D"),
        (dict(query=torch.randn(2, 3, 64, dtype=torch.float16)), "multiple of the number of kv heads"),
        (dict(query=torch.randn(2, 4, dtype=torch.float16)), "query must be \\[B, HQ, D\\]"),
        (dict(k_cache=torch.zeros(28, 2, 16, 64, dtype=torch.float16)), "k_cache must be int8"),
        (dict(v_scales=torch.ones(1)), "must both be dynamic or both static"),
        (dict(block_tables=torch.zeros(2, 3, dtype=torch.int64)), "block_tables must be int32"),
        (dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables must be int32 \\[B"),
        (dict(seq_lens=torch.tensor([5, 20])), "seq_lens must be int32"),
        (dict(seq_lens=torch.tensor([5, 20, 1], dtype=torch.int32)), "seq_lens must be int32 \\[B\\]"),
        (dict(seq_lens=torch.tensor([5, 4000], dtype=torch.int32)), "seq_lens must be in"),
        (dict(seq_lens=torch.tensor([-1, 4], dtype=torch.int32)), "seq_lens must be in"),
        (dict(block_tables=torch.full((2, 3), 99, dtype=torch.int32)), "block ids outside"),
        (dict(alibi_slopes=torch.ones(3)), "alibi_slopes must be float32 \\[HQ\\]"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), "alibi_slopes must be float32"),
        (dict(num_splits=-1), "num_splits must be >= 0"),
        (
            dict(tuning=qops.DecodeTuning(merge="unfused")),
            "merge must be auto, cluster, fused or separate, got 'unfused'",
        ),
        (dict(tuning=qops.DecodeTuning(warps=2)), "warps must be 0 \\(the kernel's choice\\), 4 or 8, got 2"),
    ],
)
def test_bad_inputs(over, match):
    with pytest.raises((ValueError, TypeError), match=f"qops.{OP}.*{match}"):
        qops.paged_decode_attention_int8(**_bad_args(**over))


# ---- GPU: the CUDA kernel -------------------------------------------------------------------------
def _gpu_inputs(lens, HQ, HKV, D, block_size, *, dtype, static, alibi, seed, table_slack=1):
    """A random cache and query: (CPU tensors, their CUDA copies, sm_scale, CPU/CUDA slopes)."""
    k_cache, v_cache, ks, vs, bt, sl, k_fp, v_fp = make_cache(
        lens, HKV, D, block_size, static=static, seed=seed, kv_dtype=dtype, table_slack=table_slack
    )
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(lens), HQ, D, generator=g) * 1.5).to(dtype)
    slopes = alibi_slopes(HQ) if alibi else None
    cpu = (q, k_cache, v_cache, ks, vs, bt, sl)
    dev = [t.cuda() for t in cpu]
    return cpu, (k_fp, v_fp), dev, 1.0 / math.sqrt(D), slopes, None if slopes is None else slopes.cuda()


def _check_against_reference(out, cpu, sm, slopes, dtype):
    """`out` vs the float64 reference on the dequantized cache; returns the reference."""
    ref = decode_attention_reference(*cpu, sm, slopes, dtype=torch.float64)
    # tight: the output dtype's rounding plus float32 accumulation
    tol = 1.5e-3 if dtype == torch.float16 else 8e-3
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=tol)
    return ref


def _gpu_case(
    lens,
    HQ,
    HKV,
    D,
    block_size,
    *,
    dtype=torch.float16,
    static=False,
    alibi=False,
    num_splits=0,
    seed=0,
    check_quant_error=False,
    table_slack=1,
    tuning=None,
):
    cpu, (k_fp, v_fp), dev, sm, slopes, dslopes = _gpu_inputs(
        lens, HQ, HKV, D, block_size, dtype=dtype, static=static, alibi=alibi, seed=seed, table_slack=table_slack
    )
    q = cpu[0]
    out = qops.paged_decode_attention_int8(*dev, sm, dslopes, num_splits=num_splits, tuning=tuning).cpu()
    assert out.dtype == dtype and out.shape == q.shape
    ref = _check_against_reference(out, cpu, sm, slopes, dtype)
    err = {}
    if check_quant_error:
        fp = fp_attention(q, k_fp, v_fp, sm, slopes)
        err["rel_l2_vs_fp"] = float((out.double() - fp).norm() / fp.norm())
        err["max_abs_vs_fp"] = float((out.double() - fp).abs().max())
        print(
            f"\n[quantization error] lens={lens} HQ={HQ} HKV={HKV} D={D} static={static}: "
            f"rel L2 {err['rel_l2_vs_fp']:.4f}, max abs {err['max_abs_vs_fp']:.4f} "
            f"(kernel vs reference: max abs {float((out.double() - ref).abs().max()):.2e})"
        )
    return out, ref, err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("HQ,HKV", [(8, 8), (9, 3), (32, 8), (16, 2), (32, 1), (12, 1)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_small_gqa_ratios(HQ, HKV, D, dtype):
    _gpu_case([1, 17, 0, 100, 33], HQ, HKV, D, 16, dtype=dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_small_block_sizes_and_static(block_size, static):
    _gpu_case([5, 130, 257, 64], 8, 2, 128, block_size, static=static, seed=block_size)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("HQ,HKV,D", [(8, 2, 128), (9, 3, 64), (4, 4, 64)])
def test_gpu_small_alibi(HQ, HKV, D):
    _gpu_case([3, 100, 47], HQ, HKV, D, 16, alibi=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
def test_gpu_small_num_splits(num_splits):
    out, _, _ = _gpu_case([0, 1, 15, 16, 17, 700], 8, 2, 128, 16, num_splits=num_splits, alibi=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [0, 2, 3, 7, 64])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_small_tight_block_table(num_splits, block_size):
    """A block table exactly as wide as the longest sequence needs: each warp's guess of its first
    block-table entries (made from the table's width, before seq_len is read) is right for the
    sequences that fill their row (700 and 704 tokens: 44 chunks at either block size) and wrong
    for the others, except in split 0, which starts at chunk 0 either way."""
    _gpu_case([700, 704, 33, 1, 0, 380], 8, 2, 128, block_size, num_splits=num_splits, table_slack=0, seed=block_size)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize(
    "HQ,HKV,D,num_splits", [(32, 8, 128, 8), (9, 3, 64, 3), (32, 1, 128, 5), (8, 8, 64, 1), (16, 1, 64, 16)]
)
def test_gpu_small_forced_warps(warps, HQ, HKV, D, num_splits):
    """Both warps-per-CTA builds (DecodeTuning.warps overrides the launcher's rule, which picks by
    grid size) on each merge path."""
    for path in PATHS:
        _gpu_case(
            [1000, 17, 0, 333],
            HQ,
            HKV,
            D,
            32,
            dtype=torch.bfloat16,
            num_splits=num_splits,
            alibi=HQ == 9,
            seed=warps,
            tuning=qops.DecodeTuning(merge=path, warps=warps),
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "D,HQ,HKV,dtype", [(128, 32, 8, torch.bfloat16), (64, 9, 3, torch.float16), (128, 32, 32, torch.float16)]
)
def test_gpu_long_context_and_quantization_error(D, HQ, HKV, dtype):
    lens = [4097, 1025, 16384 if HKV < 32 else 3000]
    _, _, err = _gpu_case(lens, HQ, HKV, D, 16, dtype=dtype, check_quant_error=True)
    assert err["rel_l2_vs_fp"] < 5e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_quantization_error_report():
    for static in (False, True):
        _, _, err = _gpu_case([200, 513], 8, 2, 128, 16, static=static, check_quant_error=True)
        # per-tensor static scales saturate nothing (calibrated) but resolve small keys coarsely
        assert err["rel_l2_vs_fp"] < (5e-2 if not static else 0.3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_large_query_and_scales():
    """bf16 queries far outside fp16 range (the kernel rescales them), tiny V scales."""
    lens = [50, 300]
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache(lens, 2, 128, 16)
    vs = vs * 1e-6
    q = torch.randn(2, 4, 128).to(torch.bfloat16) * 1e6
    q[0, 1] = 0
    sm = 1e-7
    out = qops.paged_decode_attention_int8(*(t.cuda() for t in (q, k_cache, v_cache, ks, vs, bt, sl)), sm).cpu()
    ref = decode_attention_reference(q, k_cache, v_cache, ks, vs, bt, sl, sm, dtype=torch.float64)
    scale = ref.abs().max()
    torch.testing.assert_close(out.double() / scale, ref / scale, atol=8e-3, rtol=8e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_small_scales_that_move_along_the_context(dtype, num_splits):
    """The kernel rescales its running output only when a chunk's score passes the running
    reference by a margin, or a chunk's V scale needs a smaller P scale. Here the K scales grow
    along each sequence (new score maxima, far past the margin, many times over), and the V scales
    grow by 2^10 in one sequence, shrink by 2^10 in another and jump once in a third: both rescale
    paths are taken mid-sequence, in every warp and split."""
    lens = [700, 611, 900, 33]
    HQ, HKV, D = 8, 2, 128
    cpu, _, _, sm, _, _ = _gpu_inputs(lens, HQ, HKV, D, 16, dtype=dtype, static=False, alibi=False, seed=7)
    q, k_cache, v_cache, ks, vs, bt, sl = cpu
    ks, vs = ks.clone(), vs.clone()
    for b, L in enumerate(lens):
        j = torch.arange(L)
        blk, off = bt[b, j // 16].long(), j % 16
        grow = torch.exp2(j.double() * 10 / L).float()
        ks[blk, :, off] *= (1 + j.float() / 16)[:, None]
        vs[blk, :, off] *= {0: grow, 1: 1 / grow, 2: torch.where(j >= L // 2, 600.0, 1.0), 3: grow}[b][:, None]
    cpu = (q, k_cache, v_cache, ks, vs, bt, sl)
    out = qops.paged_decode_attention_int8(*(t.cuda() for t in cpu), sm, num_splits=num_splits)
    ref = decode_attention_reference(*cpu, sm, dtype=torch.float64)
    scale = ref.abs().amax(dim=-1, keepdim=True)  # per (sequence, head): the V scales differ a lot
    tol = 1.5e-3 if dtype == torch.float16 else 8e-3
    torch.testing.assert_close(out.cpu().double() / scale, ref / scale, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_poisoned_output_and_strided_query():
    lens = [33, 0, 5]
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache(lens, 2, 64, 16)
    qkv = torch.randn(3, 12, 64, dtype=torch.float16)
    q = qkv[:, :8]  # strided: a slice of a fused projection
    torch.empty(1 << 24, dtype=torch.uint8, device="cuda").fill_(0xFF)  # NaN-ish garbage in the pool
    out = qops.paged_decode_attention_int8(*(t.cuda() for t in (q, k_cache, v_cache, ks, vs, bt, sl))).cpu()
    ref = decode_attention_reference(q, k_cache, v_cache, ks, vs, bt, sl, 64**-0.5, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=1.5e-3, rtol=1.5e-3)
    assert bool((out[1] == 0).all())


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_cuda_graph():
    lens = [100, 7]
    args = [t.cuda() for t in make_cache(lens, 2, 64, 16)[:6]]
    q = torch.randn(2, 8, 64, dtype=torch.float16, device="cuda")
    eager = qops.paged_decode_attention_int8(q, *args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qops.paged_decode_attention_int8(q, *args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_bad_inputs():
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache([5, 20], 2, 64, 16, device="cuda")
    q = torch.randn(2, 4, 64, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=f"qops.{OP}.*seq_lens must be on"):
        qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl.cpu())
    with pytest.raises(TypeError, match=f"qops.{OP}.*query"):
        qops.paged_decode_attention_int8(q.float(), k_cache, v_cache, ks, vs, bt, sl)
    with pytest.raises(ValueError, match=f"qops.{OP}.*head dim"):
        qops.paged_decode_attention_int8(
            torch.randn(2, 4, 32, dtype=torch.float16, device="cuda"),
            k_cache[..., :32].contiguous(),
            v_cache[..., :32].contiguous(),
            ks,
            vs,
            bt,
            sl,
        )
    with pytest.raises(ValueError, match=f"qops.{OP}: merge must be auto, cluster, fused or separate, got 'unfused'"):
        qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl, tuning=qops.DecodeTuning(merge="unfused"))
    with pytest.raises(ValueError, match=f"qops.{OP}: warps must be 0 \\(the kernel's choice\\), 4 or 8, got 2"):
        qops.paged_decode_attention_int8(q, k_cache, v_cache, ks, vs, bt, sl, tuning=qops.DecodeTuning(warps=2))


# ---- GPU: the three split merges -------------------------------------------------------------------
# With num_splits > 1 the CUDA path merges the splits in the split kernel itself: through
# distributed shared memory when the splits of a (sequence, kv head, head group) fit one thread-block
# cluster (the default on sm_90), else the last CTA of each group (found with a self-resetting
# counter) merges partials from a workspace; merge="separate" selects the split kernel + reduce
# kernel. All three use the same merge arithmetic in the same split order, so their outputs must be
# bit-identical, not merely close.
SHARED_COUNTERS = 4096  # ops/attention.cpp kSharedSplitCounters: more groups -> workspace counters
# The merges forced (DecodeTuning.merge): "cluster" (falls back to the two-kernel merge where the
# splits do not fit a cluster), "fused" and "separate" (the two-kernel merge).
PATHS = ("cluster", "fused", "separate")


def _merge(path):
    """The launch options of a split-merge path: one of PATHS, or True / False for "fused" /
    "separate"."""
    return qops.DecodeTuning(merge={True: "fused", False: "separate"}.get(path, path))


def _decode(args, sm, slopes, num_splits, path, overlap=False, *, pdl=None):
    """One call on `path` (see _merge) with garbage-filled fresh memory."""
    poison_cuda_allocator()  # outputs and workspaces start as garbage
    out = qops.paged_decode_attention_int8(
        *args, sm, slopes, num_splits=num_splits, overlap_prologue=overlap, enable_pdl=pdl, tuning=_merge(path)
    )
    torch.cuda.synchronize()
    return out


def _fused_vs_unfused(
    lens, HQ, HKV, D, block_size=16, *, dtype=torch.float16, static=False, alibi=False, num_splits=0, seed=0
):
    """All three merge paths, bit-identical, and close to the float64 reference."""
    cpu, _, dev, sm, slopes, dslopes = _gpu_inputs(
        lens, HQ, HKV, D, block_size, dtype=dtype, static=static, alibi=alibi, seed=seed
    )
    cluster = _decode(dev, sm, dslopes, num_splits, "cluster")
    fused = _decode(dev, sm, dslopes, num_splits, True)
    unfused = _decode(dev, sm, dslopes, num_splits, False)
    fused_again = _decode(dev, sm, dslopes, num_splits, True)
    cluster_again = _decode(dev, sm, dslopes, num_splits, "cluster")
    # the prologue read before the PDL wait (each path): the same bits
    overlapped = [_decode(dev, sm, dslopes, num_splits, path, overlap=True) for path in PATHS]
    for o in overlapped:
        assert torch.equal(o, unfused)
    assert torch.equal(fused, unfused), float((fused.double() - unfused.double()).abs().max())
    assert torch.equal(cluster, unfused), float((cluster.double() - unfused.double()).abs().max())
    assert torch.equal(fused_again, fused)
    assert torch.equal(cluster_again, cluster)
    _check_against_reference(fused, cpu, sm, slopes, dtype)
    return fused


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        # (lens, HQ, HKV, D, dtype, static, alibi, num_splits); num_splits 0 = the heuristic, which
        # splits these long, small batches (and launches 8 warps per CTA where the grid fits the SMs)
        ([4097, 1025, 3000], 32, 8, 128, torch.bfloat16, False, False, 0),
        ([5000, 33], 9, 3, 64, torch.float16, False, False, 0),
        ([300, 2000], 32, 1, 128, torch.float16, False, False, 0),  # MQA: two head groups of 16
        ([2000], 32, 32, 128, torch.float16, False, False, 0),  # MHA, B=1
        # MHA, B=1, T=4096 (Llama-2-7B shape): on an H100 the heuristic's 4 splits drop to 3, whose
        # 3-CTA clusters all fit; the split count must not depend on the merge path
        ([4096], 32, 32, 128, torch.bfloat16, False, False, 0),
        ([4096, 4000, 3500, 17], 32, 8, 128, torch.float16, False, False, 0),  # GQA, 32 kv heads
        ([0, 1, 15, 16, 17, 700], 8, 2, 128, torch.float16, False, True, 2),
        ([0, 1, 15, 16, 17, 700], 8, 2, 128, torch.float16, False, True, 3),
        ([0, 1, 15, 16, 17, 700], 8, 2, 128, torch.bfloat16, False, False, 7),
        ([0, 1, 15, 16, 17, 700], 8, 2, 64, torch.float16, False, False, 64),  # mostly empty splits
        ([700, 1, 90], 12, 1, 64, torch.bfloat16, False, False, 5),  # 12 rows in one group
        ([130, 257, 5], 8, 2, 128, torch.float16, True, False, 4),  # static scales
        ([0, 0], 8, 2, 128, torch.float16, False, False, 2),  # every split empty -> zeros
        # the cluster merge: 8 splits (the portable limit), 16 (a cluster where it fits) and 17 (merged
        # through a workspace)
        ([4097, 2000], 32, 8, 128, torch.bfloat16, False, False, 16),
        ([4097, 3, 900], 9, 3, 64, torch.float16, True, False, 16),
        ([1025, 64], 32, 32, 128, torch.float16, False, True, 8),
        ([3000, 16], 32, 1, 64, torch.bfloat16, False, False, 8),  # MQA: 2 head groups of 16 rows
        ([3000, 16], 32, 8, 128, torch.float16, False, False, 17),
        # past the portable cluster size (sm_90: up to 16 CTAs per cluster where the clusters fit):
        # SmolLM2 at B = 1 (the heuristic's 16 splits), one kv head at B = 1 (16), forced 13 and 12
        ([4096], 9, 3, 64, torch.float16, False, False, 0),
        ([3000], 8, 1, 128, torch.bfloat16, False, True, 0),
        ([2500], 9, 3, 64, torch.bfloat16, True, False, 13),
        ([1900, 37], 8, 1, 128, torch.float16, False, False, 12),
    ],
)
def test_gpu_small_fused_merge_matches_unfused(case):
    lens, HQ, HKV, D, dtype, static, alibi, ns = case
    out = _fused_vs_unfused(lens, HQ, HKV, D, dtype=dtype, static=static, alibi=alibi, num_splits=ns)
    for b, L in enumerate(lens):
        if L == 0:
            assert bool((out[b] == 0).all())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "lens,HQ,HKV,D,ns",
    [
        ([4096], 9, 3, 64, 0),  # SmolLM2, B = 1: the heuristic's 16 splits
        ([3000], 8, 1, 128, 0),  # one kv head, B = 1: 16 splits
        ([2500], 9, 3, 64, 13),
    ],
)
def test_gpu_wide_cluster_merge_runs(lens, HQ, HKV, D, ns):
    """On sm_90 these run as one cluster kernel of 9-16 CTAs per cluster (non-portable size), with
    no workspace merge or second kernel; the bit-identity with the other merges is checked above."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster merge needs sm_90")
    _, _, dev, sm, _, _ = _gpu_inputs(lens, HQ, HKV, D, 16, dtype=torch.float16, static=False, alibi=False, seed=3)
    names = cuda_kernel_names(
        lambda: qops.paged_decode_attention_int8(*dev, sm, num_splits=ns), "paged_decode_int8"
    )  # the default merge ("auto")
    if names is None:
        pytest.skip("torch.profiler records no CUDA kernels here")
    assert len(names) == 1 and "reduce" not in names[0], names
    # the kernel's last template argument is kCluster
    assert re.search(r"paged_decode_int8_kernel<[^>]*,\s*(true|1)>", names[0]), names


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "HQ,HKV,D,dtype",
    [(8, 2, 128, torch.float16), (32, 1, 64, torch.bfloat16), (16, 1, 128, torch.bfloat16), (4, 4, 64, torch.float16)],
)
def test_gpu_small_fused_merge_max_splits(HQ, HKV, D, dtype):
    """num_splits forced to the maximum (128): 128 partials per row, 16 rows per group at most,
    many splits empty (the short sequences, and the tail of the long ones)."""
    _fused_vs_unfused([2500, 3000, 1, 2049], HQ, HKV, D, dtype=dtype, num_splits=128, seed=3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("path", PATHS)
def test_gpu_small_reads_what_the_previous_kernel_wrote(pdl, path):
    """Split calls launch with programmatic dependent launch (enable_pdl=False: without): they
    may start before the previous kernel ends and must still read the query, cache, scales, block
    table and lengths that kernel (here: copies right before each call) wrote, eagerly and in a
    CUDA graph; outputs are bit-identical to the launch without PDL and match the reference."""
    lens = [700, 300, 37, 1000]
    HQ, HKV, D = 8, 2, 128
    sm = D**-0.5
    gq = torch.Generator().manual_seed(5)
    srcs = [
        [
            t.cuda()
            for t in (
                torch.randn(len(lens), HQ, D, generator=gq).to(torch.float16),
                *make_cache(lens, HKV, D, 16, seed=s)[:6],
            )
        ]
        for s in range(3)
    ]
    bufs = [torch.zeros_like(t) for t in srcs[0]]  # q, k_cache, v_cache, ks, vs, bt, sl

    def chain():
        outs = []
        for src in srcs:
            for dst, t in zip(bufs, src):
                dst.copy_(t)  # the producers, right before the call
            outs.append(qops.paged_decode_attention_int8(*bufs, sm, num_splits=8, enable_pdl=pdl, tuning=_merge(path)))
        return outs

    want = [_decode(src, sm, None, 8, "separate", pdl=False) for src in srcs]
    for got, ref in zip(chain(), want):
        assert torch.equal(got, ref)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain()
    for o in outs:
        o.fill_(float("nan"))
    for b in bufs:
        b.zero_()
    g.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref)
    ref = decode_attention_reference(*(t.cpu() for t in srcs[2]), sm, dtype=torch.float64)
    torch.testing.assert_close(outs[2].cpu().double(), ref, atol=1.5e-3, rtol=1.5e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["fused", "cluster"])
def test_gpu_small_fused_merge_repeated_and_cuda_graph(path):
    """The counters reset themselves: calls in a row (same and different split counts, sharing
    counter slots), and CUDA graphs replayed with changing inputs, stay bit-identical to the
    two-kernel path. The same for the cluster merge (no counters; a cluster launch in a graph)."""
    lens = [700, 300, 37, 1000]
    HQ, HKV, D = 8, 2, 128
    sets = [make_cache(lens, HKV, D, 16, seed=s)[:6] for s in range(3)]  # same shapes, new data
    gq = torch.Generator().manual_seed(11)
    qs = [torch.randn(len(lens), HQ, D, generator=gq).to(torch.float16) for _ in range(3)]
    sls = [(torch.tensor(lens) - torch.tensor([13, 7, 1, 100]) * i).to(torch.int32) for i in range(3)]
    sm = D**-0.5
    static = [t.cuda() for t in (qs[0], *sets[0])]  # q, k_cache, v_cache, ks, vs, bt, sl

    def load(i):
        for dst, src in zip(static, (qs[i], *sets[i][:5], sls[i])):
            dst.copy_(src)

    # eager, several in a row
    load(0)
    ref0 = _decode(static, sm, None, 8, False)
    for _ in range(5):
        assert torch.equal(_decode(static, sm, None, 8, path), ref0)
    for ns in (2, 7, 64, 3, 0, 5, 2, 16):  # different split counts on the same counter slots
        assert torch.equal(_decode(static, sm, None, ns, path), _decode(static, sm, None, ns, False)), ns

    # a graph holding three fused calls (the counters must be back at 0 between them and at the
    # end of every replay), replayed with new inputs
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_a = qops.paged_decode_attention_int8(*static, sm, num_splits=4, tuning=_merge(path))
        out_b = qops.paged_decode_attention_int8(*static, sm, num_splits=16, tuning=_merge(path))
        out_c = qops.paged_decode_attention_int8(*static, sm, tuning=_merge(path))
    for i in (1, 2, 0, 1):
        load(i)
        g.replay()
        torch.cuda.synchronize()
        got = [out_a.clone(), out_b.clone(), out_c.clone()]
        for out, ns in zip(got, (4, 16, 0)):
            assert torch.equal(out, _decode(static, sm, None, ns, False)), (i, ns)
        ref = decode_attention_reference(qs[i], *sets[i][:5], sls[i], sm, dtype=torch.float64)
        torch.testing.assert_close(got[0].cpu().double(), ref, atol=1.5e-3, rtol=1.5e-3)
        # an eager fused call between replays shares the counters: they are 0 again
        assert torch.equal(_decode(static, sm, None, 8, path), _decode(static, sm, None, 8, False))


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_fused_merge_workspace_counters():
    """More (sequence, kv head, head group)s than the shared counter buffer holds: the counters
    go to the per-call workspace, zeroed with a memset (also under a CUDA graph)."""
    g = torch.Generator().manual_seed(5)
    B, HQ, HKV, D = 130, 32, 32, 64
    assert B * HKV > SHARED_COUNTERS
    lens = torch.randint(0, 80, (B,), generator=g).tolist()
    k_cache, v_cache, ks, vs, bt, sl, _, _ = make_cache(lens, HKV, D, 16, seed=5)
    q = torch.randn(B, HQ, D, generator=g).to(torch.float16)
    args = [t.cuda() for t in (q, k_cache, v_cache, ks, vs, bt, sl)]
    sm = D**-0.5
    fused = _decode(args, sm, None, 3, True)
    unfused = _decode(args, sm, None, 3, False)
    assert torch.equal(fused, unfused)
    ref = decode_attention_reference(q, k_cache, v_cache, ks, vs, bt, sl, sm, dtype=torch.float64)
    torch.testing.assert_close(fused.cpu().double(), ref, atol=1.5e-3, rtol=1.5e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the fused merge
        out = qops.paged_decode_attention_int8(*args, sm, num_splits=3, tuning=_merge(True))
    for i in range(3):
        args[0].copy_(torch.randn(B, HQ, D, generator=g).to(torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.clone(), _decode(args, sm, None, 3, False)), i


_FIRST_CALL_CAPTURED = textwrap.dedent("""
    import torch, qops
    FUSED = qops.DecodeTuning(merge="fused")  # the workspace-and-counters merge
    SEPARATE = qops.DecodeTuning(merge="separate")  # the two-kernel merge
    torch.manual_seed(0)
    B, HQ, HKV, D, BS, T = 3, 8, 2, 128, 16, 900
    nb = B * (T // BS + 1)
    kc = torch.randint(-127, 128, (nb, HKV, BS, D), dtype=torch.int8, device="cuda")
    vc = torch.randint(-127, 128, (nb, HKV, BS, D), dtype=torch.int8, device="cuda")
    ks = torch.rand(nb, HKV, BS, device="cuda") * 0.02 + 1e-3
    vs = torch.rand(nb, HKV, BS, device="cuda") * 0.02 + 1e-3
    bt = torch.randperm(nb, device="cuda").to(torch.int32).reshape(B, -1)
    sl = torch.tensor([T, 500, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.float16)
    args = (q, kc, vc, ks, vs, bt, sl)

    def unfused():
        return qops.paged_decode_attention_int8(*args, num_splits=6, tuning=SEPARATE)

    unfused()  # loads the kernels; the two-kernel path never makes the shared counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # the first fused call of the process is captured
        out = qops.paged_decode_attention_int8(*args, num_splits=6, tuning=FUSED)
    for i in range(3):
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, unfused()), i
    eager = qops.paged_decode_attention_int8(*args, num_splits=6, tuning=FUSED)  # makes the shared counters
    assert torch.equal(eager, unfused())
    g.replay()  # still on its own (workspace) counters
    torch.cuda.synchronize()
    assert torch.equal(out, unfused())
    print("first-call-captured OK")
""")


@pytest.mark.gpu
@needs_cuda
def test_gpu_small_fused_merge_first_call_captured():
    """The first fused call of a process made during a CUDA-graph capture cannot create the
    shared (zeroed) counters: it takes workspace counters zeroed by a memset node. A fresh process,
    since this process has made the shared counters long ago."""
    r = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL_CAPTURED], capture_output=True, text=True, timeout=600, check=False
    )
    assert r.returncode == 0 and "first-call-captured OK" in r.stdout, r.stdout + r.stderr
