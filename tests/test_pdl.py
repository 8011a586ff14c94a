"""Programmatic dependent launch across qops kernels (csrc/common/launch.cuh).

The norm, activation, quant, decode-GEMV and split decode-attention kernels launch with programmatic
stream serialization and release the next kernel early, so a kernel can be dispatched while the
one before it still runs. Each must wait (pdl_wait) before touching memory its predecessor writes.
These tests chain the kernels the way a decode layer does -- each reading what the previous one
wrote, some in place -- and require bit-identical results with PDL on and off (enable_pdl=),
eagerly and replayed from a CUDA graph. The per-op files test PDL chains of one op with itself.
"""

from __future__ import annotations

import pytest
import torch

import qops
from qops.testing import needs_w8a8_gemm  # the chains include the sm_90a GEMMs

gpu = pytest.mark.gpu


def _weights(n, k, g):
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
    s = (torch.rand(n, device="cuda", generator=g) + 0.5) * (0.05 / 127)
    return w, s


def _layer_inputs(m, h, inter, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, h, device="cuda", generator=g) * 2).to(torch.bfloat16)
    r = (torch.randn(m, h, device="cuda", generator=g) * 2).to(torch.bfloat16)
    n1 = (torch.rand(h, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    n2 = (torch.rand(h, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    return x, r, n1, n2, _weights(2 * inter, h, g), _weights(h, inter, g)


def _mlp_chain(x, r, n1, n2, gate_up, down, overlap=False, *, pdl):
    """add + norm + quant -> GEMV -> SiLU-and-mul + quant -> GEMV -> add + norm + quant (r in
    place twice) -> norm + quant, and per-token quant -> GEMV (as after attention): every kernel
    reads what the one before it wrote. ``overlap``: the GEMMs read their first weights before
    their PDL wait (no kernel here writes the weights). ``pdl``: every call's enable_pdl."""
    q1, s1 = qops.fused_add_rms_norm_quant(x, r, n1, 1e-5, enable_pdl=pdl)
    gu = qops.w8a8_gemm(q1, gate_up[0], s1, gate_up[1], torch.bfloat16, overlap_prologue=overlap, enable_pdl=pdl)
    q2, s2 = qops.silu_and_mul_quant(gu, enable_pdl=pdl)
    d = qops.w8a8_gemm(q2, down[0], s2, down[1], torch.bfloat16, overlap_prologue=overlap, enable_pdl=pdl)
    q3, s3 = qops.fused_add_rms_norm_quant(d, r, n2, 1e-5, enable_pdl=pdl)
    q4, s4 = qops.rms_norm_quant(d, n1, 1e-5, enable_pdl=pdl)
    q5, s5 = qops.quant_per_token(d, enable_pdl=pdl)
    h = d.shape[1]
    e = qops.w8a8_gemm(q5, gate_up[0][:h], s5, gate_up[1][:h], torch.bfloat16, overlap_prologue=overlap, enable_pdl=pdl)
    return [gu, q2, s2, d, q3, s3, q4, s4, q5, s5, e]


@gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_decode_mlp_chain_pdl_on_off_and_graph(m, overlap):
    needs_w8a8_gemm()
    h, inter = 1024, 1408
    x, r0, n1, n2, gate_up, down = _layer_inputs(m, h, inter, seed=m)

    def run(pdl):
        r = r0.clone()
        outs = _mlp_chain(x, r, n1, n2, gate_up, down, overlap, pdl=pdl)
        torch.cuda.synchronize()
        return outs + [r]

    want = run(False)
    for _ in range(3):
        for got, ref in zip(run(True), want):
            assert torch.equal(got, ref)
    # in a CUDA graph (PDL edges between the kernels), replayed with a fresh residual
    r = r0.clone()
    _mlp_chain(x, r, n1, n2, gate_up, down, overlap, pdl=True)  # warm-up before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _mlp_chain(x, r, n1, n2, gate_up, down, overlap, pdl=True)
    for _ in range(2):
        r.copy_(r0)
        for o in outs:
            o.zero_()
        g.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs + [r], want):
            assert torch.equal(got, ref)


@gpu
@pytest.mark.parametrize("variant", ["rowres", "pipelined"])
def test_norm_chain_in_place_residual(variant):
    """Consecutive fused add + norm calls on one residual (as consecutive layers do): each reads the
    residual the previous call wrote in place; PDL on and off give the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tuning = qops.NormTuning(variant=variant)
    t, h = 4099, 4096
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [(torch.randn(t, h, device="cuda", generator=g) * 2).to(torch.float16) for _ in range(4)]
    r0 = (torch.randn(t, h, device="cuda", generator=g) * 2).to(torch.float16)
    w = (torch.rand(h, device="cuda", generator=g) + 0.5).to(torch.float16)

    def run(pdl):
        r = r0.clone()
        outs = [qops.fused_add_rms_norm_quant(x, r, w, 1e-6, enable_pdl=pdl, tuning=tuning) for x in xs]
        torch.cuda.synchronize()
        return [t_ for pair in outs for t_ in pair] + [r]

    want = run(False)
    for got, ref in zip(run(True), want):
        assert torch.equal(got, ref)


@gpu
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("num_splits,L", [(4, 600), (4, 610), (4, 33), (1, 600)])
def test_decode_attention_chain(num_splits, L, overlap):
    """Cache write of the new token -> split decode attention (reads that token) -> per-token quant
    of its output -> GEMV, PDL on and off, eagerly and replayed from a CUDA graph. With
    ``overlap_prologue`` (the attention reads its query, its tables and the K/V of older tokens
    before the cache write has completed, as the Llama calls it) the K/V reads must still see the
    new token. With 4 splits of 8-warp CTAs the new token's chunk is, at L = 600, the first chunk
    of a split's last warp (its other warps and splits load theirs before the wait), at L = 610 a
    warp's second, and at L = 33 the only chunk of its split (a new block's first token)."""
    needs_w8a8_gemm()
    B, HQ, HKV, D, bs = 3, 8, 2, 128, 16
    blocks_per_seq = (L + bs - 1) // bs
    g = torch.Generator(device="cuda").manual_seed(7)
    nb = B * blocks_per_seq + 2
    k_cache = torch.zeros(nb, HKV, bs, D, dtype=torch.int8, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(nb, HKV, bs, device="cuda")
    v_scales = torch.zeros_like(k_scales)
    perm = torch.randperm(nb, generator=g, device="cuda")[: B * blocks_per_seq]
    block_tables = perm.view(B, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    pos = torch.arange(L, device="cuda")
    slots = block_tables[:, pos // bs].long() * bs + pos % bs  # [B, L]
    kv = lambda n: (torch.randn(n, HKV, D, device="cuda", generator=g) * 2).to(torch.bfloat16)
    qops.reshape_and_cache_int8(
        kv(B * L), kv(B * L), k_cache, v_cache, k_scales, v_scales, slots.reshape(-1), enable_pdl=False
    )  # the context
    new_k, new_v, new_slots = kv(B), kv(B), slots[:, L - 1].contiguous()
    q = (torch.randn(B, HQ, D, device="cuda", generator=g) * 1.5).to(torch.bfloat16)
    w, ws = _weights(256, HQ * D, g)

    def chain(pdl):
        qops.reshape_and_cache_int8(new_k, new_v, k_cache, v_cache, k_scales, v_scales, new_slots, enable_pdl=pdl)
        out = qops.paged_decode_attention_int8(
            q,
            k_cache,
            v_cache,
            k_scales,
            v_scales,
            block_tables,
            seq_lens,
            num_splits=num_splits,
            overlap_prologue=overlap,
            enable_pdl=pdl,
        )
        qa, sa = qops.quant_per_token(out.view(B, HQ * D), enable_pdl=pdl)
        return [out, qa, sa, qops.w8a8_gemm(qa, w, sa, ws, torch.bfloat16, enable_pdl=pdl)]

    def run(pdl):
        k_cache[block_tables[:, -1].long()] = 0  # the new token's slot must be written again
        outs = chain(pdl)
        torch.cuda.synchronize()
        return outs

    want = run(False)
    for _ in range(3):
        for got, ref in zip(run(True), want):
            assert torch.equal(got, ref)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(True)
    k_cache[block_tables[:, -1].long()] = 0
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref)
