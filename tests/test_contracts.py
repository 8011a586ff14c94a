"""One contract per op on both devices: a shared list of bad calls, each run on the CPU (the
reference) and on CUDA (the glue), which must raise the same exception type with the same message.

Each case builds its arguments for a device and names the one thing wrong with them. A few checks
exist on one side only, by design, and are listed with ``only=``: the CUDA kernels do not read
values on the host (static scale values, slot and length ranges, duplicate slots: a check would
synchronize), and what a build contains (``config`` names, GEMV launch shapes) is known to the glue
only. docs/ops.md, "CPU and CUDA", states each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import qops

f16, bf16, f32, i8, i32, i64 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.int64


@dataclass
class Bad:
    op: str
    what: str
    make: Callable[[str], tuple[tuple, dict]]  # device -> (args, kwargs) of qops.<op>
    exc: type[Exception]
    match: str
    only: str | None = None  # "cpu" or "cuda": checked on that device only (see the module doc)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.what}"


def _x(d, *shape, dtype=f16):
    return torch.randn(shape, device=d).to(dtype)


def _norm(d, **kw):
    return (_x(d, 4, 64), torch.ones(64, dtype=f16, device=d), 1e-5), kw


def _gemm(d, m=4, n=32, k=64, a_dtype=i8, scale_len=None, out=f16, bias_dtype=None, **kw):
    a = torch.randint(-8, 8, (m, k), dtype=i8, device=d).to(a_dtype)
    b = torch.randint(-8, 8, (n, k), dtype=i8, device=d)
    sa = torch.ones(scale_len or m, device=d)
    sb = torch.ones(n, device=d)
    bias = None if bias_dtype is None else torch.zeros(n, dtype=bias_dtype, device=d)
    return (a, b, sa, sb, out, bias), kw


def _cache(d, nb=4, hkv=2, bs=16, dd=64, static=False):
    kc = torch.zeros(nb, hkv, bs, dd, dtype=i8, device=d)
    ks = torch.ones(1, device=d) if static else torch.ones(nb, hkv, bs, device=d)
    return kc, kc.clone(), ks, ks.clone()


def _write(d, t=3, hkv=2, dd=64, key_dtype=f16, slots=None, slot_dtype=i64, cache=None):
    key = _x(d, t, hkv, dd, dtype=key_dtype)
    sm = torch.tensor(slots if slots is not None else list(range(t)), dtype=slot_dtype, device=d)
    return (key, key.clone(), *(cache or _cache(d, hkv=hkv, dd=dd)), sm), {}


def _decode(d, b=2, hq=4, hkv=2, dd=64, q=None, bt=None, sl=None, alibi=None, cache=None, **kw):
    query = q if q is not None else _x(d, b, hq, dd)
    block_tables = bt if bt is not None else torch.zeros(b, 2, dtype=i32, device=d)
    seq_lens = sl if sl is not None else torch.full((b,), 5, dtype=i32, device=d)
    return (query, *(cache or _cache(d, hkv=hkv, dd=dd)), block_tables, seq_lens, 1.0, alibi), kw


u8 = torch.uint8


def _int4_cache(d, nb=4, hkv=2, bs=16, dd=64, g=1, dtype=u8):
    kc = torch.zeros(nb, hkv, bs, 4 * g + dd // 2, dtype=dtype, device=d)
    return kc, kc.clone()


def _int4_write(d, t=3, hkv=2, dd=64, g=1, key_dtype=f16, slots=None, slot_dtype=i64, cache=None, **kw):
    key = _x(d, t, hkv, dd, dtype=key_dtype)
    sm = torch.tensor(slots if slots is not None else list(range(t)), dtype=slot_dtype, device=d)
    return (key, key.clone(), *(cache or _int4_cache(d, hkv=hkv, dd=dd, g=g)), sm, g), kw


def _side(d, n=3, hkv=2, sinks=2, window=4, dd=64, dtype=f16):
    s = torch.zeros(n, hkv, sinks + window, dd, dtype=dtype, device=d)
    return s, s.clone()


def _skvq(d, b=2, t=5, hkv=2, dd=64, g=1, sinks=2, window=4, key_dtype=f16, side=None, side_slots=None, sl=None,
          cu=None, bt=None, **kw):  # fmt: skip
    key = _x(d, t, hkv, dd, dtype=key_dtype)
    slots = side_slots if side_slots is not None else torch.arange(b, dtype=i32, device=d)
    lens = sl if sl is not None else torch.tensor([3] * (b - 1) + [t - 3 * (b - 1)], dtype=i32, device=d)
    cus = cu if cu is not None else torch.tensor([0, *range(3, 3 * b, 3)][:b] + [t], dtype=i32, device=d)
    tables = bt if bt is not None else torch.zeros(b, 1, dtype=i32, device=d)
    return (
        key, key.clone(), *_int4_cache(d, hkv=hkv, dd=dd, g=g), *(side or _side(d, hkv=hkv, sinks=sinks, window=window,
        dd=dd)), tables, slots, lens, cus, g, sinks, window,
    ), kw  # fmt: skip


def _int4_decode(d, b=2, hq=4, hkv=2, dd=64, g=1, q=None, bt=None, sl=None, cache=None, skvq=None, **kw):
    query = q if q is not None else _x(d, b, hq, dd)
    block_tables = bt if bt is not None else torch.zeros(b, 2, dtype=i32, device=d)
    seq_lens = sl if sl is not None else torch.full((b,), 5, dtype=i32, device=d)
    extra = skvq if skvq is not None else ()
    return (query, *(cache or _int4_cache(d, hkv=hkv, dd=dd, g=g)), block_tables, seq_lens, 1.0, g, *extra), kw


def _skvq_side(d, n=3, hkv=2, sinks=2, window=4, dd=64, dtype=f16, slots=None):
    k, v = _side(d, n, hkv, sinks, window, dd, dtype)
    ss = slots if slots is not None else torch.tensor([0, 2], dtype=i32, device=d)
    return (k, v, ss, sinks, window)


BAD: list[Bad] = [
    # quantization
    Bad(
        "quant_per_token",
        "int-input",
        lambda d: ((torch.zeros(4, 8, dtype=i32, device=d),), {}),
        TypeError,
        "input must be float16",
    ),
    Bad("quant_per_token", "0-dim", lambda d: ((_x(d),), {}), ValueError, "non-empty last dimension"),
    Bad("quant_per_token", "empty-rows", lambda d: ((_x(d, 4, 0),), {}), ValueError, "non-empty last dimension"),
    Bad(
        "quant_per_token",
        "strided-last-dim",
        lambda d: ((_x(d, 8, 4).t(),), {}),
        ValueError,
        "last dimension must be contiguous",
    ),
    Bad(
        "quant_per_tensor",
        "f64-scale",
        lambda d: ((_x(d, 4, 8), torch.ones(1, dtype=torch.float64, device=d)), {}),
        TypeError,
        "scale must be float32",
    ),
    Bad(
        "quant_per_tensor",
        "two-scales",
        lambda d: ((_x(d, 4, 8), torch.ones(2, device=d)), {}),
        ValueError,
        "scale must hold one element",
    ),
    Bad(
        "quant_per_tensor",
        "zero-scale",
        lambda d: ((_x(d, 4, 8), torch.zeros(1, device=d)), {}),
        ValueError,
        "scale must be finite and > 0",
        only="cpu",
    ),
    # norm
    Bad(
        "rms_norm_quant",
        "int-input",
        lambda d: ((torch.zeros(4, 64, dtype=i32, device=d), torch.ones(64, dtype=f16, device=d), 1e-5), {}),
        TypeError,
        "input must be float16 or bfloat16",
    ),
    Bad(
        "rms_norm_quant",
        "weight-shape",
        lambda d: ((_x(d, 4, 64), torch.ones(32, dtype=f16, device=d), 1e-5), {}),
        ValueError,
        r"weight must have shape \[64\]",
    ),
    Bad(
        "rms_norm_quant",
        "weight-dtype",
        lambda d: ((_x(d, 4, 64), torch.ones(64, dtype=bf16, device=d), 1e-5), {}),
        TypeError,
        "weight must be float16",
    ),
    Bad(
        "rms_norm_quant",
        "negative-eps",
        lambda d: ((_x(d, 4, 64), torch.ones(64, dtype=f16, device=d), -1.0), {}),
        ValueError,
        "epsilon must be >= 0",
    ),
    Bad(
        "rms_norm_quant",
        "scale-shape",
        lambda d: ((*_norm(d)[0], torch.ones(2, device=d)), {}),
        ValueError,
        "scale must hold one element",
    ),
    Bad(
        "rms_norm_quant",
        "variant",
        lambda d: _norm(d, variant="fast"),
        ValueError,
        "variant must be auto, rowres or pipelined",
    ),
    Bad("rms_norm_quant", "pipe-stages", lambda d: _norm(d, pipe_stages=5), ValueError, "pipe_stages must be"),
    Bad("rms_norm_quant", "cluster", lambda d: _norm(d, cluster=3), ValueError, "cluster must be"),
    Bad(
        "fused_add_rms_norm_quant",
        "residual-shape",
        lambda d: ((_x(d, 4, 64), _x(d, 2, 64), torch.ones(64, dtype=f16, device=d), 1e-5), {}),
        ValueError,
        "residual must have the input's shape",
    ),
    Bad(
        "fused_add_rms_norm_quant",
        "residual-dtype",
        lambda d: ((_x(d, 4, 64), _x(d, 4, 64, dtype=bf16), torch.ones(64, dtype=f16, device=d), 1e-5), {}),
        TypeError,
        "residual must be float16",
    ),
    # activation
    Bad("silu_and_mul_quant", "odd-width", lambda d: ((_x(d, 4, 63),), {}), ValueError, r"must be 2\*I > 0"),
    Bad(
        "silu_and_mul_quant",
        "threads-per-row",
        lambda d: ((_x(d, 4, 64),), {"threads_per_row": 2000}),
        ValueError,
        "threads_per_row must be in",
    ),
    Bad(
        "silu_and_mul_quant",
        "nan-scale",
        lambda d: ((_x(d, 4, 64), torch.full((1,), float("nan"), device=d)), {}),
        ValueError,
        "scale must be finite and > 0",
        only="cpu",
    ),
    # int8 GEMM
    Bad("w8a8_gemm", "float-a", lambda d: _gemm(d, a_dtype=f16), TypeError, "a must be int8"),
    Bad(
        "w8a8_gemm",
        "k-mismatch",
        lambda d: ((_gemm(d)[0][0][:, :48], *_gemm(d)[0][1:]), {}),
        ValueError,
        r"b must be \[N, K\] with K = 48",
    ),
    Bad("w8a8_gemm", "n-not-16", lambda d: _gemm(d, n=24), ValueError, "K and N must be multiples of 16"),
    Bad("w8a8_gemm", "a-scale-length", lambda d: _gemm(d, scale_len=3), ValueError, "a_scale must hold 1 or M = 4"),
    Bad("w8a8_gemm", "f32-out", lambda d: _gemm(d, out=f32), TypeError, "out_dtype must be float16 or bfloat16"),
    Bad("w8a8_gemm", "bias-dtype", lambda d: _gemm(d, bias_dtype=bf16), TypeError, "bias must have the output dtype"),
    Bad("w8a8_gemm", "gemv-early", lambda d: _gemm(d, gemv_early=3), ValueError, "gemv_early must be -1"),
    Bad("w8a8_gemm", "gemv-shape-form", lambda d: _gemm(d, gemv_shape=[8, 4]), ValueError, "gemv_shape must be"),
    Bad(
        "w8a8_gemm",
        "unknown-config",
        lambda d: _gemm(d, config="64x64"),
        ValueError,
        "unknown config '64x64'",
        only="cuda",
    ),
    # int8 KV cache write
    Bad(
        "reshape_and_cache_int8",
        "f32-key",
        lambda d: _write(d, key_dtype=f32),
        TypeError,
        "key must be float16 or bfloat16",
    ),
    Bad(
        "reshape_and_cache_int8",
        "block-size",
        lambda d: _write(d, cache=_cache(d, bs=8)),
        ValueError,
        r"block_size \(k_cache.shape\[2\]\) must be one of \(16, 32, 64, 128\)",
    ),
    Bad(
        "reshape_and_cache_int8",
        "int32-slots",
        lambda d: _write(d, slot_dtype=i32),
        TypeError,
        "slot_mapping must be int64",
    ),
    Bad(
        "reshape_and_cache_int8",
        "heads",
        lambda d: _write(d, hkv=2, cache=_cache(d, hkv=4)),
        ValueError,
        r"key's \[H_kv, D\]",
    ),
    Bad(
        "reshape_and_cache_int8",
        "mixed-scales",
        lambda d: _write(d, cache=(*_cache(d)[:3], torch.ones(1, device=d))),
        ValueError,
        "k_scales and v_scales must both be dynamic or both static",
    ),
    Bad(
        "reshape_and_cache_int8",
        "no-kv-heads",
        lambda d: _write(d, hkv=0, cache=_cache(d, hkv=0)),
        ValueError,
        "H_kv >= 1",
    ),
    Bad(
        "reshape_and_cache_int8",
        "slot-out-of-range",
        lambda d: _write(d, slots=[0, 1, 999]),
        ValueError,
        "slot_mapping holds slots outside",
        only="cpu",
    ),
    Bad(
        "reshape_and_cache_int8",
        "duplicate-slots",
        lambda d: _write(d, slots=[3, 3, 4]),
        ValueError,
        "several tokens to one slot",
        only="cpu",
    ),
    # int8 decode attention
    Bad(
        "paged_decode_attention_int8",
        "2d-query",
        lambda d: _decode(d, q=_x(d, 2, 64)),
        ValueError,
        r"query must be \[B, HQ, D\]",
    ),
    Bad(
        "paged_decode_attention_int8",
        "head-dim",
        lambda d: _decode(d, dd=96, cache=_cache(d, dd=96)),
        ValueError,
        r"head dim D must be one of \(64, 128\)",
    ),
    Bad(
        "paged_decode_attention_int8",
        "gqa-ratio",
        lambda d: _decode(d, hq=3),
        ValueError,
        "must be a multiple of the number of kv heads",
    ),
    Bad(
        "paged_decode_attention_int8",
        "no-kv-heads",
        lambda d: _decode(d, cache=_cache(d, hkv=0)),
        ValueError,
        "H_kv >= 1",
    ),
    Bad(
        "paged_decode_attention_int8",
        "int64-block-tables",
        lambda d: _decode(d, bt=torch.zeros(2, 2, dtype=i64, device=d)),
        TypeError,
        "block_tables must be int32",
    ),
    Bad(
        "paged_decode_attention_int8",
        "seq-lens-shape",
        lambda d: _decode(d, sl=torch.ones(3, dtype=i32, device=d)),
        ValueError,
        r"seq_lens must be int32 \[B\]",
    ),
    Bad(
        "paged_decode_attention_int8",
        "alibi-shape",
        lambda d: _decode(d, alibi=torch.ones(3, device=d)),
        ValueError,
        r"alibi_slopes must be float32 \[HQ\]",
    ),
    Bad(
        "paged_decode_attention_int8",
        "num-splits",
        lambda d: _decode(d, num_splits=-1),
        ValueError,
        "num_splits must be >= 0",
    ),
    Bad(
        "paged_decode_attention_int8",
        "merge",
        lambda d: _decode(d, merge="tree"),
        ValueError,
        "merge must be auto, cluster, fused or separate",
    ),
    Bad("paged_decode_attention_int8", "warps", lambda d: _decode(d, warps=6), ValueError, "warps must be 0"),
    Bad(
        "paged_decode_attention_int8",
        "seq-len-past-table",
        lambda d: _decode(d, sl=torch.full((2,), 33, dtype=i32, device=d)),
        ValueError,
        "seq_lens must be in",
        only="cpu",
    ),
    # int4 KV cache (seed-002 rows)
    Bad(
        "quantize_kv_int4",
        "f32-input",
        lambda d: ((_x(d, 2, 64, dtype=f32), 1), {}),
        TypeError,
        "kv must be float16 or bfloat16, got float32",
    ),
    Bad(
        "quantize_kv_int4",
        "head-dim",
        lambda d: ((_x(d, 2, 96), 1), {}),
        ValueError,
        r"kv's last dimension \(the head dim D\) must be 64 or 128, got 96",
    ),
    Bad("quantize_kv_int4", "groups", lambda d: ((_x(d, 2, 64), 2), {}), ValueError, "num_groups must be 1 or 4"),
    Bad(
        "quantize_kv_int4",
        "strided-last-dim",
        lambda d: ((_x(d, 64, 2).t(), 1), {}),
        ValueError,
        "kv's last dimension must be contiguous",
    ),
    Bad(
        "quantize_kv_int4",
        "clip-ratio",
        lambda d: ((_x(d, 2, 64), 1), {"clip_ratio": 1.5}),
        ValueError,
        r"clip_ratio must be in \(0, 1\], got 1.5",
    ),
    Bad(
        "reshape_and_cache_int4",
        "f32-key",
        lambda d: _int4_write(d, key_dtype=f32),
        TypeError,
        "key must be float16 or bfloat16, got float32",
    ),
    Bad(
        "reshape_and_cache_int4",
        "int8-cache",
        lambda d: _int4_write(d, cache=_int4_cache(d, dtype=i8)),
        TypeError,
        "k_cache must be uint8, got int8",
    ),
    Bad(
        "reshape_and_cache_int4",
        "block-size",
        lambda d: _int4_write(d, cache=_int4_cache(d, bs=8)),
        ValueError,
        r"block_size \(k_cache.shape\[2\]\) must be one of \(16, 32, 64, 128\), got 8",
    ),
    Bad(
        "reshape_and_cache_int4",
        "row-bytes",
        lambda d: _int4_write(d, g=1, cache=_int4_cache(d, g=4)),
        ValueError,
        r"k_cache's row bytes \(48\) must be 4 \* num_groups \+ D / 2",
    ),
    Bad(
        "reshape_and_cache_int4",
        "heads",
        lambda d: _int4_write(d, hkv=2, cache=_int4_cache(d, hkv=4)),
        ValueError,
        r"key's \[H_kv, D\] = \[2, 64\] must match the cache's \[H_kv, D\] = \[4, 64\]",
    ),
    Bad(
        "reshape_and_cache_int4",
        "int32-slots",
        lambda d: _int4_write(d, slot_dtype=i32),
        TypeError,
        "slot_mapping must be int64, got int32",
    ),
    Bad(
        "reshape_and_cache_int4",
        "clip-ratio",
        lambda d: _int4_write(d, clip_ratio=0.0),
        ValueError,
        r"clip_ratio must be in \(0, 1\], got 0.0",
    ),
    Bad(
        "reshape_and_cache_int4",
        "slot-out-of-range",
        lambda d: _int4_write(d, slots=[0, 1, 999]),
        ValueError,
        "slot_mapping holds slots outside",
        only="cpu",
    ),
    Bad(
        "reshape_and_cache_int4",
        "duplicate-slots",
        lambda d: _int4_write(d, slots=[3, 3, 4]),
        ValueError,
        "several tokens to one slot",
        only="cpu",
    ),
    Bad(
        "skvq_cache_write",
        "f32-key",
        lambda d: _skvq(d, key_dtype=f32),
        TypeError,
        "key must be float16 or bfloat16, got float32",
    ),
    Bad(
        "skvq_cache_write",
        "side-dtype",
        lambda d: _skvq(d, side=_side(d, dtype=bf16)),
        TypeError,
        "k_side must be float16, got bfloat16",
    ),
    Bad(
        "skvq_cache_write",
        "side-shape",
        lambda d: _skvq(d, side=_side(d, window=5)),
        ValueError,
        r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\] = \[\*, 2, 6, 64\]",
    ),
    Bad(
        "skvq_cache_write",
        "negative-sinks",
        lambda d: _skvq(d, sinks=-1, side=_side(d, sinks=0, window=4)),
        ValueError,
        "sinks and window must be >= 0, got -1 and 4",
    ),
    Bad(
        "skvq_cache_write",
        "side-rows-without-side-tokens",
        lambda d: _skvq(d, sinks=0, window=0, side=_side(d, sinks=0, window=1)),
        ValueError,
        r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\] = \[\*, 2, 0, 64\]",
    ),
    Bad(
        "skvq_cache_write",
        "int64-side-slots",
        lambda d: _skvq(d, side_slots=torch.zeros(2, dtype=i64, device=d)),
        TypeError,
        "side_slots must be int32, got int64",
    ),
    Bad(
        "skvq_cache_write",
        "cu-seqlens-shape",
        lambda d: _skvq(d, cu=torch.tensor([0, 5], dtype=i32, device=d)),
        ValueError,
        r"cu_seqlens must be int32 \[B \+ 1\] = \[3\]",
    ),
    Bad(
        "skvq_cache_write",
        "block-tables-rows",
        lambda d: _skvq(d, bt=torch.zeros(3, 1, dtype=i32, device=d)),
        ValueError,
        r"block_tables must be int32 \[B, max_blocks\] with B = 2",
    ),
    Bad(
        "skvq_cache_write",
        "more-new-tokens-than-length",
        lambda d: _skvq(d, sl=torch.tensor([2, 2], dtype=i32, device=d)),
        ValueError,
        r"sequence 0 gets 3 new tokens but seq_lens\[0\] = 2",
        only="cpu",
    ),
    Bad(
        "skvq_cache_write",
        "side-slot-out-of-range",
        lambda d: _skvq(d, side_slots=torch.tensor([0, 3], dtype=i32, device=d)),
        ValueError,
        r"side_slots must lie in \[0, 3\)",
        only="cpu",
    ),
    Bad(
        "int4_gqa_decode",
        "2d-query",
        lambda d: _int4_decode(d, q=_x(d, 2, 64)),
        ValueError,
        r"query must be \[B, HQ, D\]",
    ),
    Bad(
        "int4_gqa_decode",
        "query-head-dim",
        lambda d: _int4_decode(d, q=_x(d, 2, 4, 128)),
        ValueError,
        r"query's D = 128 must match the cache's D = 64 \(row bytes 36\)",
    ),
    Bad(
        "int4_gqa_decode",
        "groups",
        lambda d: _int4_decode(d, g=2, cache=_int4_cache(d)),
        ValueError,
        "num_groups must be 1 or 4, got 2",
    ),
    Bad(
        "int4_gqa_decode",
        "gqa-ratio",
        lambda d: _int4_decode(d, hq=3),
        ValueError,
        r"the number of query heads \(3\) must be a multiple of the number of kv heads \(2\)",
    ),
    Bad(
        "int4_gqa_decode",
        "int64-block-tables",
        lambda d: _int4_decode(d, bt=torch.zeros(2, 2, dtype=i64, device=d)),
        TypeError,
        "block_tables must be int32",
    ),
    Bad(
        "int4_gqa_decode",
        "seq-lens-shape",
        lambda d: _int4_decode(d, sl=torch.ones(3, dtype=i32, device=d)),
        ValueError,
        r"seq_lens must be int32 \[B\] = \[2\]",
    ),
    Bad(
        "int4_gqa_decode",
        "window-without-side",
        lambda d: _int4_decode(d, skvq=(None, None, None, 0, 4)),
        ValueError,
        "sinks and window need the side buffers k_side, v_side and side_slots",
    ),
    Bad(
        "int4_gqa_decode",
        "side-shape",
        lambda d: _int4_decode(d, skvq=(*_side(d, window=5), torch.zeros(2, dtype=i32, device=d), 2, 4)),
        ValueError,
        r"k_side must be \[num_side_slots, H_kv, sinks \+ window, D\]",
    ),
    Bad(
        "int4_gqa_decode",
        "side-dtype",
        lambda d: _int4_decode(d, skvq=_skvq_side(d, dtype=bf16)),
        TypeError,
        "k_side must be float16, got bfloat16",
    ),
    Bad(
        "int4_gqa_decode",
        "num-splits",
        lambda d: _int4_decode(d, skvq=(None, None, None, 0, 0, -1)),
        ValueError,
        "num_splits must be >= 0",
    ),
    Bad(
        "int4_gqa_decode",
        "merge",
        lambda d: _int4_decode(d, merge="tree"),
        ValueError,
        "merge must be auto, cluster, fused or separate",
    ),
    Bad("int4_gqa_decode", "warps", lambda d: _int4_decode(d, warps=6), ValueError, "warps must be 0"),
    Bad(
        "int4_gqa_decode",
        "seq-len-past-table",
        lambda d: _int4_decode(d, sl=torch.full((2,), 33, dtype=i32, device=d)),
        ValueError,
        "seq_lens must be in",
        only="cpu",
    ),
    Bad(
        "int4_gqa_decode",
        "side-slot-out-of-range",
        lambda d: _int4_decode(d, skvq=_skvq_side(d, slots=torch.tensor([0, 3], dtype=i32, device=d))),
        ValueError,
        r"side_slots must lie in \[0, 3\)",
        only="cpu",
    ),
]


def _run(case: Bad, device: str) -> None:
    args, kwargs = case.make(device)
    with pytest.raises(case.exc, match=f"qops.{case.op}: .*{case.match}|qops.{case.op}: {case.match}"):
        getattr(torch.ops.qops, case.op)(*args, **kwargs)


def test_every_op_with_a_cuda_kernel_has_bad_calls():
    # every op of the CUDA build, and the int4 KV ops, whose kernels follow the same messages
    covered = {c.op for c in BAD}
    assert {
        "quant_per_token",
        "quant_per_tensor",
        "rms_norm_quant",
        "fused_add_rms_norm_quant",
        "silu_and_mul_quant",
        "w8a8_gemm",
        "reshape_and_cache_int8",
        "paged_decode_attention_int8",
        "quantize_kv_int4",
        "reshape_and_cache_int4",
        "skvq_cache_write",
        "int4_gqa_decode",
    } <= covered
    assert covered <= set(qops.op_names())


@pytest.mark.parametrize("case", [c for c in BAD if c.only != "cuda"], ids=lambda c: c.id)
def test_bad_call_cpu(case):
    _run(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in BAD if c.only != "cpu"], ids=lambda c: c.id)
def test_bad_call_cuda(case):
    if not qops.has_cuda_kernel(case.op):
        pytest.skip(f"this build has no CUDA kernel for {case.op}")
    if case.op == "w8a8_gemm":
        qops.testing.needs_w8a8_gemm()
    _run(case, "cuda")
    torch.cuda.synchronize()  # no sticky CUDA error left behind
