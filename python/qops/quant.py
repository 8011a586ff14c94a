"""Symmetric int8 quantization ops: ``quant_per_token`` and ``quant_per_tensor``."""

from __future__ import annotations

import torch

from . import envs
from ._registry import check, check_dtype, check_static_scale, export, fake, reference
from .quantization import quantize_int8, quantize_per_token

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_input(op: str, x: torch.Tensor) -> None:
    check_dtype(x, _FLOAT_DTYPES, op, "input")
    check(
        x.dim() >= 1 and x.shape[-1] > 0, op, f"input must have a non-empty last dimension, got shape {tuple(x.shape)}"
    )
    check(x.shape[-1] == 1 or x.stride(-1) == 1, op, "input's last dimension must be contiguous (stride 1)")


# ---- quant_per_token ---------------------------------------------------------------------------
@reference("quant_per_token")
def _quant_per_token_ref(input: torch.Tensor, *, enable_pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    _check_input("quant_per_token", input)
    return quantize_per_token(input.float())


@fake("quant_per_token")
def _quant_per_token_fake(input, *, enable_pdl=True):
    return (
        torch.empty_like(input, dtype=torch.int8, memory_format=torch.contiguous_format),
        input.new_empty(input.shape[:-1], dtype=torch.float32),
    )


@export
def quant_per_token(input: torch.Tensor, *, enable_pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric int8 quantization.

    ``scale = clamp(input.float().abs().amax(-1) / 127, min=1e-10)``;
    ``out = (input.float() / scale[..., None]).round().clamp(-128, 127).to(torch.int8)``
    (round half to even; NaN quantizes to 0).

    Args:
        input: ``[..., H]`` float16, bfloat16 or float32; the last dimension must be contiguous
            (leading dimensions may be strided).
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`qops.rms_norm_quant`).
            ``None``: the :mod:`qops.envs` default (on).
    Returns:
        ``(out int8 [..., H] contiguous, scale float32 [...])``.
    """
    return torch.ops.qops.quant_per_token(input, enable_pdl=envs.pdl(enable_pdl))


# ---- quant_per_tensor --------------------------------------------------------------------------
def _check_scale(op: str, scale: torch.Tensor, like: torch.Tensor) -> None:
    check_dtype(scale, torch.float32, op, "scale")
    check(scale.numel() == 1, op, f"scale must hold one element, got shape {tuple(scale.shape)}")
    check(scale.device == like.device, op, f"scale must be on {like.device}, got {scale.device}")
    check_static_scale(op, "scale", scale)


@reference("quant_per_tensor")
def _quant_per_tensor_ref(input: torch.Tensor, scale: torch.Tensor, *, enable_pdl: bool = True) -> torch.Tensor:
    _check_input("quant_per_tensor", input)
    _check_scale("quant_per_tensor", scale, input)
    return quantize_int8(input.float(), scale.reshape(()))


@fake("quant_per_tensor")
def _quant_per_tensor_fake(input, scale, *, enable_pdl=True):
    return torch.empty_like(input, dtype=torch.int8, memory_format=torch.contiguous_format)


@export
def quant_per_tensor(input: torch.Tensor, scale: torch.Tensor, *, enable_pdl: bool | None = None) -> torch.Tensor:
    """Static per-tensor symmetric int8 quantization.

    ``out = (input.float() / scale).round().clamp(-128, 127).to(torch.int8)`` (round half to even;
    NaN quantizes to 0, +-Inf saturates).

    Args:
        input: ``[..., H]`` float16, bfloat16 or float32, last dimension contiguous.
        scale: float32 tensor with one element, on the input's device (read on the device: no
            host synchronization, CUDA-graph safe).
        enable_pdl: keyword-only; programmatic dependent launch (see :func:`quant_per_token`).
    Returns:
        int8 ``[..., H]``, contiguous.
    """
    return torch.ops.qops.quant_per_tensor(input, scale, enable_pdl=envs.pdl(enable_pdl))
