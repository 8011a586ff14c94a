"""RMSNorm (+ residual add) fused with int8 quantization: ``rms_norm_quant`` and
``fused_add_rms_norm_quant``; and the same norms with an activation-dtype output, ``rms_norm`` and
``fused_add_rms_norm`` (the input of a W4A16 GEMM).

The references below are the numerical contract (docs/ops.md, docs/norm_activation.md): RMSNorm in
float32, then symmetric int8 quantization through :mod:`qops.quantization`, either with a static
per-tensor scale or with dynamic per-token scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, check_static_scale, export, fake, reference
from .activation import FusedQuantTuning, check_fused_quant_tuning
from .quantization import absmax_scale, quantize_int8

NORM_VARIANTS = ("auto", "rowres", "pipelined")


@export
@dataclass(frozen=True)
class NormTuning(FusedQuantTuning):
    """Launch options of the RMSNorm + quant kernels (CUDA; the CPU reference checks and ignores
    them). The defaults are the kernels' own choices; tests and benchmark sweeps force the others.

    Attributes:
        variant: ``"auto"`` (the launcher's rule), ``"rowres"`` (one row per CTA, registers only)
            or ``"pipelined"`` (persistent CTAs streaming rows through a cp.async shared-memory
            ring; a forced pipelined variant that does not fit the input, e.g. unaligned rows or a
            hidden size above 8192, runs row-resident).
        pipe_stages: the pipelined ring's depth, 2 or 3; 0 chooses.
        threads_per_row, cluster: see :class:`FusedQuantTuning`.
    """

    variant: str = "auto"
    pipe_stages: int = 0


def _check_tuning(op: str, t: NormTuning) -> None:
    check_fused_quant_tuning(op, t.threads_per_row, t.cluster)
    check(t.variant in NORM_VARIANTS, op, f"variant must be auto, rowres or pipelined, got '{t.variant}'")
    check(t.pipe_stages in (0, 2, 3), op, f"pipe_stages must be 0 (the kernel's choice), 2 or 3, got {t.pipe_stages}")


def _tuning_kwargs(enable_pdl: bool | None, tuning: NormTuning | None) -> dict:
    t = tuning or NormTuning()
    return dict(
        enable_pdl=envs.pdl(enable_pdl),
        variant=t.variant,
        pipe_stages=t.pipe_stages,
        threads_per_row=t.threads_per_row,
        cluster=t.cluster,
    )


# ---- argument checks (shared by the references; the CUDA glue makes the same checks) ------------
def _check_norm_args(op: str, input: torch.Tensor, weight: torch.Tensor, epsilon: float, scale) -> None:
    check_dtype(input, HALF_DTYPES, op, "input")
    check(
        input.dim() >= 1 and input.shape[-1] > 0,
        op,
        f"input must have a non-empty last dimension, got shape {tuple(input.shape)}",
    )
    check(input.shape[-1] == 1 or input.stride(-1) == 1, op, "input's last dimension must be contiguous (stride 1)")
    H = input.shape[-1]
    check_dtype(weight, input.dtype, op, "weight")
    check(
        weight.dim() == 1 and weight.shape[0] == H,
        op,
        f"weight must have shape [{H}] (the input's last dimension), got {tuple(weight.shape)}",
    )
    check(weight.device == input.device, op, f"weight must be on {input.device}, got {weight.device}")
    check(float(epsilon) >= 0.0, op, f"epsilon must be >= 0, got {epsilon}")
    if scale is not None:
        check_dtype(scale, torch.float32, op, "scale")
        check(
            scale.numel() == 1,
            op,
            f"scale must hold one element (a static per-tensor scale), got shape {tuple(scale.shape)}",
        )
        check(scale.device == input.device, op, f"scale must be on {input.device}, got {scale.device}")
        check_static_scale(op, "scale", scale)


def _rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w``, all in float32."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return xf * torch.rsqrt(var + epsilon) * weight.float()


def _quantize(y: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Static (``scale`` given: returns a fresh [1] copy of it) or dynamic per-token int8."""
    if scale is None:
        s = absmax_scale(y, -1)
        return quantize_int8(y, s.unsqueeze(-1)).contiguous(), s
    s = scale.reshape(()).float()
    return quantize_int8(y, s).contiguous(), scale.reshape(1).clone()


def _add_residual(op: str, input: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Checks ``residual`` and updates it in place to ``input + residual``; returns it."""
    check_dtype(residual, input.dtype, op, "residual")
    check(
        residual.shape == input.shape,
        op,
        f"residual must have the input's shape {tuple(input.shape)}, got {tuple(residual.shape)}",
    )
    check(residual.device == input.device, op, f"residual must be on {input.device}, got {residual.device}")
    check(
        residual.shape[-1] == 1 or residual.stride(-1) == 1,
        op,
        "residual's last dimension must be contiguous (stride 1)",
    )
    # The sum is formed in float32 and rounded once to the input dtype (what the kernel does, and
    # what PyTorch's half addition does); the norm then reads the rounded residual.
    new_res = (input.float() + residual.float()).to(input.dtype)
    residual.copy_(new_res)
    return residual


# ---- rms_norm_quant ------------------------------------------------------------------------------
@reference("rms_norm_quant")
def _rms_norm_quant_ref(
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool = True,
    variant: str = "auto",
    pipe_stages: int = 0,
    threads_per_row: int = 0,
    cluster: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_norm_args("rms_norm_quant", input, weight, epsilon, scale)
    _check_tuning(
        "rms_norm_quant",
        NormTuning(threads_per_row=threads_per_row, cluster=cluster, variant=variant, pipe_stages=pipe_stages),
    )
    return _quantize(_rms_norm_f32(input, weight, epsilon), scale)


def _norm_fake(input, scale):
    q = torch.empty_like(input, dtype=torch.int8, memory_format=torch.contiguous_format)
    if scale is None:
        return q, input.new_empty(input.shape[:-1], dtype=torch.float32)
    return q, input.new_empty((1,), dtype=torch.float32)


@fake("rms_norm_quant")
def _rms_norm_quant_fake(input, weight, epsilon, scale=None, **options):
    return _norm_fake(input, scale)


@export
def rms_norm_quant(
    input: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool | None = None,
    tuning: NormTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm followed by symmetric int8 quantization.

    ``y = input.float() * torch.rsqrt(input.float().pow(2).mean(-1, keepdim=True) + epsilon)
    * weight.float()``, then

    - static (``scale`` given): ``out = (y / scale).round().clamp(-128, 127).to(torch.int8)`` and
      the second output is a fresh float32 ``[1]`` copy of ``scale``;
    - dynamic (``scale=None``): ``s = clamp(y.abs().amax(-1) / 127, min=1e-10)``,
      ``out = (y / s[..., None]).round().clamp(-128, 127).to(torch.int8)``.

    Rounding is half to even with an IEEE float32 division; NaN quantizes to 0 (docs/ops.md).

    Args:
        input: ``[..., H]`` float16 or bfloat16; the last dimension must be contiguous (on CUDA the
            leading dimensions may be strided when they collapse into one row stride).
        weight: ``[H]``, the same dtype as ``input``.
        epsilon: added to the mean square before the reciprocal square root.
        scale: optional float32 tensor with one element (a static per-tensor scale, read on the
            device: no host synchronization, CUDA-graph safe).
        enable_pdl: keyword-only; launch with programmatic dependent launch (sm_90: the kernel
            may start while the previous one in the stream finishes). ``None``: on, unless
            ``QOPS_PDL=0`` was set when qops was imported (:mod:`qops.envs`). No effect on the
            result or on CPU.
        tuning: keyword-only :class:`NormTuning` (kernel variant and launch shape; tests and
            sweeps). No effect on the result beyond the float32 order of the mean square.
    Returns:
        ``(out int8 [..., H] contiguous, scales float32 [...] (dynamic) or [1] (static))``.
    """
    return torch.ops.qops.rms_norm_quant(input, weight, epsilon, scale, **_tuning_kwargs(enable_pdl, tuning))


# ---- fused_add_rms_norm_quant --------------------------------------------------------------------
@reference("fused_add_rms_norm_quant")
def _fused_add_rms_norm_quant_ref(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool = True,
    variant: str = "auto",
    pipe_stages: int = 0,
    threads_per_row: int = 0,
    cluster: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "fused_add_rms_norm_quant"
    _check_norm_args(op, input, weight, epsilon, scale)
    _check_tuning(
        op, NormTuning(threads_per_row=threads_per_row, cluster=cluster, variant=variant, pipe_stages=pipe_stages)
    )
    new_res = _add_residual(op, input, residual)
    return _quantize(_rms_norm_f32(new_res, weight, epsilon), scale)


@fake("fused_add_rms_norm_quant")
def _fused_add_rms_norm_quant_fake(input, residual, weight, epsilon, scale=None, **options):
    return _norm_fake(input, scale)


@export
def fused_add_rms_norm_quant(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None = None,
    *,
    enable_pdl: bool | None = None,
    tuning: NormTuning | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add (in place), RMSNorm, then symmetric int8 quantization.

    ``residual.copy_((input.float() + residual.float()).to(input.dtype))`` (the next layer reads
    the updated residual), then exactly ``rms_norm_quant(residual, weight, epsilon, scale)`` on the
    rounded residual.

    Args:
        input: ``[..., H]`` float16 or bfloat16, last dimension contiguous.
        residual: same shape and dtype as ``input``, last dimension contiguous; updated in place.
        weight: ``[H]``, the input's dtype.
        epsilon: RMSNorm epsilon.
        scale: optional float32 one-element static scale (see :func:`rms_norm_quant`).
        enable_pdl, tuning: keyword-only launch options (see :func:`rms_norm_quant`).
    Returns:
        ``(out int8 [..., H] contiguous, scales float32 [...] (dynamic) or [1] (static))``.
    """
    return torch.ops.qops.fused_add_rms_norm_quant(
        input, residual, weight, epsilon, scale, **_tuning_kwargs(enable_pdl, tuning)
    )


# ---- rms_norm, fused_add_rms_norm (no quantization) ---------------------------------------------
def _rms_norm_out(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y.to(dtype).contiguous()


@reference("rms_norm")
def _rms_norm_ref(
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, *, enable_pdl: bool = True
) -> torch.Tensor:
    _check_norm_args("rms_norm", input, weight, epsilon, None)
    return _rms_norm_out(_rms_norm_f32(input, weight, epsilon), input.dtype)


@fake("rms_norm")
def _rms_norm_fake(input, weight, epsilon, **options):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@export
def rms_norm(
    input: torch.Tensor, weight: torch.Tensor, epsilon: float, *, enable_pdl: bool | None = None
) -> torch.Tensor:
    """RMSNorm with an output in the input's dtype (one fused kernel on CUDA).

    ``(input.float() * torch.rsqrt(input.float().pow(2).mean(-1, keepdim=True) + epsilon)
    * weight.float()).to(input.dtype)``: float32 throughout, one rounding at the end (Hugging
    Face's ``LlamaRMSNorm`` rounds the normalized value to the input dtype before the weight
    multiply; the results differ by at most one rounding). The CUDA kernel multiplies in the order
    ``(x * w) * rstd``: within one unit in the last place of the output dtype of the reference.

    Args:
        input: ``[..., H]`` float16 or bfloat16, last dimension contiguous (see
            :func:`rms_norm_quant` for strided rows).
        weight: ``[H]``, the input's dtype.
        epsilon: added to the mean square.
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`rms_norm_quant`).
    Returns:
        ``out [..., H]`` in the input's dtype, contiguous.
    """
    return torch.ops.qops.rms_norm(input, weight, epsilon, enable_pdl=envs.pdl(enable_pdl))


@reference("fused_add_rms_norm")
def _fused_add_rms_norm_ref(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float, *, enable_pdl: bool = True
) -> torch.Tensor:
    op = "fused_add_rms_norm"
    _check_norm_args(op, input, weight, epsilon, None)
    new_res = _add_residual(op, input, residual)
    return _rms_norm_out(_rms_norm_f32(new_res, weight, epsilon), input.dtype)


@fake("fused_add_rms_norm")
def _fused_add_rms_norm_fake(input, residual, weight, epsilon, **options):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@export
def fused_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    *,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Residual add (in place) and RMSNorm with an output in the input's dtype.

    ``residual.copy_((input.float() + residual.float()).to(input.dtype))``, then exactly
    :func:`rms_norm` of the rounded residual.

    Args:
        input: ``[..., H]`` float16 or bfloat16, last dimension contiguous.
        residual: same shape and dtype, last dimension contiguous; updated in place.
        weight: ``[H]``, the input's dtype.
        epsilon: RMSNorm epsilon.
        enable_pdl: keyword-only launch option (see :func:`rms_norm_quant`).
    Returns:
        ``out [..., H]`` in the input's dtype, contiguous.
    """
    return torch.ops.qops.fused_add_rms_norm(input, residual, weight, epsilon, enable_pdl=envs.pdl(enable_pdl))
