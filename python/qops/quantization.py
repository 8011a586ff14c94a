"""Quantization conventions of qops: the one module that defines them.

Every reference implementation quantizes through these functions, and every CUDA kernel
reproduces them bit for bit (docs/ops.md):

- symmetric int8: ``q = saturate(round_half_to_even(x_f32 / scale))`` into [-128, 127], with an
  IEEE float32 division;
- dynamic per-token scale: ``max(amax(|x|) / 127, SCALE_FLOOR)`` in float32, so an all-zero row
  gives zeros, not NaN;
- NaN quantizes to 0 and is ignored by amax; +-Inf saturates with a static scale, and makes a
  dynamic scale Inf (the row then quantizes to zeros).
"""

from __future__ import annotations

import torch

INT8_MIN = -128
INT8_MAX = 127
SCALE_FLOOR = 1e-10


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate(rne(x / scale))`` as int8; ``x`` and ``scale`` float32 and broadcastable."""
    y = x.float() / scale
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    return y.round().clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def absmax_scale(x: torch.Tensor, dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    """Dynamic symmetric scale ``max(amax(|x|) / 127, SCALE_FLOOR)`` over ``dim`` (NaN ignored)."""
    x = x.float()
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x).abs().amax(dim)
    return torch.clamp(a / INT8_MAX, min=SCALE_FLOOR)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row (last dim): returns ``(q, scale[...])``."""
    s = absmax_scale(x, -1)
    return quantize_int8(x, s.unsqueeze(-1)), s


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights ``[N, K]`` with one scale per output channel ``n``: ``(q int8 [N,K], s f32 [N])``."""
    return quantize_per_token(w)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale
