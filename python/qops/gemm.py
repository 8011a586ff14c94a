"""int8 x int8 GEMM with a dequantizing epilogue: ``w8a8_gemm``.

The CUDA kernels (Hopper, sm_90a; and an sm_80 family for Ampere and Ada) are CUTLASS GEMMs
generated at build time through the CUTLASS Python interface (``cutlass_kernels/``);
``docs/w8a8_gemm.md`` describes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference

_OP = "w8a8_gemm"
# |a * b| <= 128 * 128, so K * 2^14 < 2^31 keeps the int32 accumulator exact.
MAX_K = 131071


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@export
@dataclass(frozen=True)
class GemvTuning:
    """Launch options of the decode GEMV that :func:`w8a8_gemm` runs at M <= 16 (CUDA; the
    CUTLASS configs and the CPU reference ignore them). The defaults are the GEMV's own choices;
    tests and benchmark sweeps force the others.

    Attributes:
        shape: ``(rows, warps, chunks)``, one of the built launch shapes
            (``cutlass_kernels.w8a8_configs.GEMV_SHAPES``: rows of N per CTA, warps per CTA,
            64-byte K chunks per load batch), or ``None``.
        early_batches: under ``overlap_prologue``, the weight batches each warp requests before
            the PDL wait (0, 1 or 2; clamped to what the launch shape's build holds), or ``None``.
    """

    shape: tuple[int, int, int] | None = None
    early_batches: int | None = None


def _check_gemv_options(gemv_shape, gemv_early) -> None:
    check(len(gemv_shape) in (0, 3), _OP, f"gemv_shape must be (rows, warps, chunks) or empty, got {list(gemv_shape)}")
    check(-1 <= gemv_early <= 2, _OP, f"gemv_early must be -1 (the GEMV's choice), 0, 1 or 2, got {gemv_early}")


def _check_args(a, b, a_scale, b_scale, out_dtype, bias) -> None:
    check_dtype(a, torch.int8, _OP, "a")
    check_dtype(b, torch.int8, _OP, "b")
    check(a.dim() == 2, _OP, f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
    check(b.dim() == 2, _OP, f"b must be 2-D [N, K], got shape {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[0]
    check(
        b.shape[1] == k, _OP, f"b must be [N, K] with K = {k} (the nn.Linear weight layout), got shape {tuple(b.shape)}"
    )
    check(k % 16 == 0 and n % 16 == 0, _OP, f"K and N must be multiples of 16, got K = {k}, N = {n}")
    check(k <= MAX_K, _OP, f"K must be at most {MAX_K} (beyond it the int32 accumulator can overflow), got {k}")
    check(out_dtype in HALF_DTYPES, _OP, f"out_dtype must be float16 or bfloat16, got {_name(out_dtype)}", TypeError)
    for name, s, length, length_name in (("a_scale", a_scale, m, "M"), ("b_scale", b_scale, n, "N")):
        check_dtype(s, torch.float32, _OP, name)
        check(
            s.numel() in (1, length),
            _OP,
            f"{name} must hold 1 or {length_name} = {length} elements, got shape {tuple(s.shape)}",
        )
    if bias is not None:
        check(
            bias.dtype == out_dtype,
            _OP,
            f"bias must have the output dtype {_name(out_dtype)}, got {_name(bias.dtype)}",
            TypeError,
        )
        check(tuple(bias.shape) == (n,), _OP, f"bias must be [N] = [{n}], got shape {tuple(bias.shape)}")


@reference(_OP)
def _w8a8_gemm_ref(
    a,
    b,
    a_scale,
    b_scale,
    out_dtype,
    bias=None,
    *,
    config="auto",
    overlap_prologue=False,
    enable_pdl=True,
    gemv_shape=(),
    gemv_early=-1,
):
    _check_args(a, b, a_scale, b_scale, out_dtype, bias)
    _check_gemv_options(gemv_shape, gemv_early)
    # acc = a.int32 @ b.int32.T, computed in float64: every partial sum is an integer below
    # 2^31 < 2^53, so this is exact; .float() then rounds to nearest as int32 -> float32 does.
    acc = (a.double() @ b.double().T).float()
    d = acc * a_scale.reshape(-1, 1) * b_scale.reshape(1, -1)
    if bias is not None:
        d = d + bias.float()
    return d.to(out_dtype)


@fake(_OP)
def _w8a8_gemm_fake(a, b, a_scale, b_scale, out_dtype, bias=None, **options):
    _check_args(a, b, a_scale, b_scale, out_dtype, bias)
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@export
def w8a8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    config: str = "auto",
    overlap_prologue: bool = False,
    enable_pdl: bool | None = None,
    tuning: GemvTuning | None = None,
) -> torch.Tensor:
    """int8 GEMM with a dequantizing epilogue (W8A8 linear layer).

    ``acc = a.int() @ b.int().T`` (exact int32 accumulation), then in float32
    ``out = (acc.float() * a_scale.reshape(-1, 1) * b_scale.reshape(1, -1) + bias.float()).to(out_dtype)``.

    Args:
        a: int8 ``[M, K]`` activations, row-major (a row slice of a wider tensor is accepted on
            CUDA when its row stride and start are multiples of 16 bytes).
        b: int8 ``[N, K]`` weights, K-major: the ``nn.Linear`` weight layout.
        a_scale: float32 ``[1]`` (per-tensor) or ``[M]`` (per-token) activation scales.
        b_scale: float32 ``[1]`` (per-tensor) or ``[N]`` (per-channel) weight scales.
        out_dtype: ``torch.float16`` or ``torch.bfloat16``.
        bias: optional ``[N]`` in ``out_dtype``, added in float32 before the final rounding.
        config: CUDA only, keyword-only performance knob: ``"auto"`` (the table's choice by
            problem size) or the name of a config in ``cutlass_kernels/w8a8_configs.py``: a
            CUTLASS tile config, e.g. ``"128x128x128_c2x1x1_pingpong"``, or ``"gemv"``, the
            hand-written decode kernel (M <= 16). The CPU reference ignores it.
        overlap_prologue: keyword-only; True promises that the kernel launched just before this
            call on the same stream does not write ``b`` (weights are constant across a decode
            step). The decode GEMV then requests its first weight batches (up to two, as its
            launch shape affords in registers; at M > 8 it may take a 16-row launch shape for
            that) before it waits for that kernel (programmatic dependent launch, sm_90), so
            that their round trip runs while it finishes; it takes no more than its grid affords
            without another wave of CTAs. A false promise is a race. No effect on the result, on
            the CUTLASS configs, on CPU or where PDL is off.
        enable_pdl: keyword-only; the decode GEMV launches with programmatic dependent launch
            (sm_90). ``None``: on, unless ``QOPS_PDL=0`` was set when qops was imported
            (:mod:`qops.envs`). The CUTLASS configs ignore it.
        tuning: keyword-only :class:`GemvTuning` (the decode GEMV's launch shape and early
            batches; tests and sweeps). No effect on the result.

    K and N must be multiples of 16 and K at most 131071 (the int32 accumulator cannot
    overflow). Returns ``[M, N]`` in ``out_dtype``. On CUDA this runs CUTLASS kernels for Hopper
    (sm_90a), and for decode (M <= 16) a split-K GEMV that streams the weights on every SM; on
    GPUs of compute capability 8.x (or with ``config=`` naming one, e.g. ``"128x128x64_s4_sm80"``)
    the sm_80 CUTLASS family (``SM80_CONFIGS``);
    per-tensor x per-tensor scales and the per-token x per-channel case are separate
    kernels, and a mixed pair (one ``[1]``, one vector) broadcasts the ``[1]`` scale first.
    """
    t = tuning or GemvTuning()
    return torch.ops.qops.w8a8_gemm(
        a,
        b,
        a_scale,
        b_scale,
        out_dtype,
        bias,
        config=config,
        overlap_prologue=bool(overlap_prologue),
        enable_pdl=envs.pdl(enable_pdl),
        gemv_shape=list(t.shape or ()),
        gemv_early=-1 if t.early_batches is None else int(t.early_batches),
    )
