"""SiLU-and-mul fused with int8 quantization: ``silu_and_mul_quant``; and ``silu_and_mul`` with an
activation-dtype output (the input of a W4A16 GEMM).

The reference below is the numerical contract (docs/ops.md, docs/norm_activation.md): the gated
activation in float32, then symmetric int8 quantization through :mod:`qops.quantization`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, check_static_scale, export, fake, reference
from .quantization import absmax_scale, quantize_int8


@export
@dataclass(frozen=True)
class FusedQuantTuning:
    """Launch shape of the fused "math + int8 quant" kernels (SiLU-and-mul; the norms extend it as
    :class:`qops.NormTuning`). CUDA only; the CPU reference checks and ignores it. 0 = the kernel's
    choice (the default); a hint that does not fit the input falls back to the kernel's choice.

    Attributes:
        threads_per_row: aim for about this many threads per CTA row slice (1..1024).
        cluster: CTAs per row: 1, 2, 4 or 8 (sm_90 thread-block clusters when > 1).
    """

    threads_per_row: int = 0
    cluster: int = 0


def check_fused_quant_tuning(op: str, threads_per_row: int, cluster: int) -> None:
    check(
        0 <= threads_per_row <= 1024,
        op,
        f"threads_per_row must be in [0, 1024] (0: the kernel's choice), got {threads_per_row}",
    )
    check(cluster in (0, 1, 2, 4, 8), op, f"cluster must be 0 (the kernel's choice), 1, 2, 4 or 8, got {cluster}")


def _check_args(op: str, input: torch.Tensor, scale) -> None:
    check_dtype(input, HALF_DTYPES, op, "input")
    check(
        input.dim() >= 1 and input.shape[-1] > 0 and input.shape[-1] % 2 == 0,
        op,
        f"input's last dimension must be 2*I > 0 (gate then up), got shape {tuple(input.shape)}",
    )
    check(input.stride(-1) == 1, op, "input's last dimension must be contiguous (stride 1)")
    if scale is not None:
        check_dtype(scale, torch.float32, op, "scale")
        check(
            scale.numel() == 1,
            op,
            f"scale must hold one element (a static per-tensor scale), got shape {tuple(scale.shape)}",
        )
        check(scale.device == input.device, op, f"scale must be on {input.device}, got {scale.device}")
        check_static_scale(op, "scale", scale)


def _silu_and_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """``g / (1 + exp(-g)) * u`` in float32 with ``g, u = x[..., :I], x[..., I:]``."""
    xf = x.float()
    i = xf.shape[-1] // 2
    g, u = xf[..., :i], xf[..., i:]
    return g / (1.0 + torch.exp(-g)) * u


@reference("silu_and_mul_quant")
def _silu_and_mul_quant_ref(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool = True,
    threads_per_row: int = 0,
    cluster: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args("silu_and_mul_quant", input, scale)
    check_fused_quant_tuning("silu_and_mul_quant", threads_per_row, cluster)
    y = _silu_and_mul_f32(input)
    if scale is None:
        s = absmax_scale(y, -1)
        return quantize_int8(y, s.unsqueeze(-1)).contiguous(), s
    return quantize_int8(y, scale.reshape(()).float()).contiguous(), scale.reshape(1).clone()


@fake("silu_and_mul_quant")
def _silu_and_mul_quant_fake(input, scale=None, **options):
    out_shape = (*input.shape[:-1], input.shape[-1] // 2)
    q = input.new_empty(out_shape, dtype=torch.int8)
    if scale is None:
        return q, input.new_empty(input.shape[:-1], dtype=torch.float32)
    return q, input.new_empty((1,), dtype=torch.float32)


@export
def silu_and_mul_quant(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool | None = None,
    tuning: FusedQuantTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-and-mul (the gated MLP activation) followed by symmetric int8 quantization.

    With ``g, u = input.float()[..., :I], input.float()[..., I:]``:
    ``y = g / (1 + torch.exp(-g)) * u`` (float32), then

    - static (``scale`` given): ``out = (y / scale).round().clamp(-128, 127).to(torch.int8)``, and
      the second output is a fresh float32 ``[1]`` copy of ``scale``;
    - dynamic (``scale=None``): ``s = clamp(y.abs().amax(-1) / 127, min=1e-10)``,
      ``out = (y / s[..., None]).round().clamp(-128, 127).to(torch.int8)``.

    Rounding is half to even with an IEEE float32 division; NaN quantizes to 0 (docs/ops.md).

    Args:
        input: ``[..., 2*I]`` float16 or bfloat16 (gate then up, the fused gate_up projection's
            output); the last dimension must be contiguous (on CUDA the leading dimensions may be
            strided when they collapse into one row stride).
        scale: optional float32 tensor with one element (static per-tensor scale, read on the
            device).
        enable_pdl: keyword-only; programmatic dependent launch (see
            :func:`qops.rms_norm_quant`). ``None``: the :mod:`qops.envs` default (on).
        tuning: keyword-only :class:`FusedQuantTuning` (launch shape; tests and sweeps).
    Returns:
        ``(out int8 [..., I] contiguous, scales float32 [...] (dynamic) or [1] (static))``.
    """
    t = tuning or FusedQuantTuning()
    return torch.ops.qops.silu_and_mul_quant(
        input, scale, enable_pdl=envs.pdl(enable_pdl), threads_per_row=t.threads_per_row, cluster=t.cluster
    )


# ---- silu_and_mul (no quantization) ---------------------------------------------------------------
@reference("silu_and_mul")
def _silu_and_mul_ref(input: torch.Tensor, *, enable_pdl: bool = True) -> torch.Tensor:
    _check_args("silu_and_mul", input, None)
    return _silu_and_mul_f32(input).to(input.dtype).contiguous()


@fake("silu_and_mul")
def _silu_and_mul_fake(input, **options):
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


@export
def silu_and_mul(input: torch.Tensor, *, enable_pdl: bool | None = None) -> torch.Tensor:
    """SiLU-and-mul with an output in the input's dtype (one fused kernel on CUDA).

    ``(g / (1 + torch.exp(-g)) * u).to(input.dtype)`` with ``g, u = input.float()[..., :I],
    input.float()[..., I:]``: float32, one rounding at the end. The CUDA kernel uses a fast
    exponential and division (as :func:`silu_and_mul_quant`): within one unit in the last place of
    the output dtype of the reference.

    Args:
        input: ``[..., 2*I]`` float16 or bfloat16 (gate then up), last dimension contiguous.
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`qops.rms_norm_quant`).
    Returns:
        ``out [..., I]`` in the input's dtype, contiguous.
    """
    return torch.ops.qops.silu_and_mul(input, enable_pdl=envs.pdl(enable_pdl))
