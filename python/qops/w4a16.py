"""int4-weight x fp16/bf16-activation GEMM (the Hopper mixed-input GEMM of CUTLASS example 55):
the ops ``w4a16_prepack`` and ``w4a16_gemm``, and the int4 weight utilities ``pack_int4``,
``unpack_int4`` and ``quantize_weight_int4``.

The weight layout (docs/ops.md "int4 weights", docs/int4.md): uint8 ``[N, K/2]``; byte
``w[n, j]`` holds ``q[n, 2j]`` in its low nibble and ``q[n, 2j+1]`` in its high nibble, each a
signed two's-complement int4 in [-8, 7]. The dequantized weight of group ``g = k // G`` is
``q * scales[n, g]`` (scale-only mode) or ``q * scales[n, g] + zeros[n, g]`` (scale+zero mode).
"""

from __future__ import annotations

import torch

from . import envs
from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference

INT4_MIN = -8
INT4_MAX = 7
GROUP_SIZES = (64, 128)
N_MULTIPLE = 16  # rows of the shuffled layout's atom (docs/int4.md): N must be a multiple on every device


# ---- int4 weight utilities -----------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values two per byte.

    ``out[..., j] = (q[..., 2j] & 0xF) | ((q[..., 2j+1] & 0xF) << 4)``: even index in the low
    nibble, odd index in the high nibble, two's complement.

    Args:
        q: int8 ``[..., K]`` with values in [-8, 7], ``K`` even (``[N, K]`` for a weight).
    Returns:
        uint8 ``[..., K/2]``, contiguous.
    """
    op = "pack_int4"
    check_dtype(q, torch.int8, op, "q")
    check(q.dim() >= 1 and q.shape[-1] % 2 == 0, op, f"q's last dimension must be even, got shape {tuple(q.shape)}")
    check(bool(((q >= INT4_MIN) & (q <= INT4_MAX)).all()), op, "q's values must lie in [-8, 7]")
    nib = q.to(torch.int16) & 0xF  # two's-complement nibble
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[..., K/2]`` -> int8 ``[..., K]`` in [-8, 7]."""
    op = "unpack_int4"
    check_dtype(packed, torch.uint8, op, "packed")
    check(packed.dim() >= 1, op, "packed must have at least one dimension")
    p = packed.to(torch.int16)
    nib = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)  # [..., K]: low nibble first
    return ((nib ^ 8) - 8).to(torch.int8)  # sign-extend 4 bits


def quantize_weight_int4(
    w: torch.Tensor,
    group_size: int,
    with_zeros: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-wise int4 quantization of an ``nn.Linear`` weight for :func:`w4a16_gemm`.

    ``w`` is split along ``K`` into groups of ``G = group_size`` channels; each (row ``n``,
    group ``g``) gets one scale (and zero). All arithmetic is float32; ``scale`` and ``zero`` are
    rounded to ``dtype`` *before* ``q`` is computed, so the returned tensors dequantize exactly as
    the GEMM will:

    - scale-only (``with_zeros=False``, symmetric)::

          scale = dtype(amax(|w_g|) / 7)
          q     = clamp(round_half_even(w / scale), -8, 7)        # in practice [-7, 7]
          w    ~= q * scale

    - scale+zero (``with_zeros=True``, asymmetric; ``q`` in [-8, 7] covers ``[min, max]``)::

          scale = dtype((max(w_g) - min(w_g)) / 15)
          zero  = dtype(min(w_g) + 8 * scale)                      # so q = -8 -> min, q = 7 -> max
          q     = clamp(round_half_even((w - zero) / scale), -8, 7)
          w    ~= q * scale + zero

    A group whose scale rounds to 0 (all zeros; constant in scale+zero mode) stores ``q = 0``
    (it dequantizes to 0, resp. to ``zero``). The error per element is at most ``scale / 2``
    (plus, with zeros, the rounding error of ``zero`` in ``dtype``). ``w`` must be finite (NaN
    stores ``q = 0``) and its scales must fit ``dtype``.

    Args:
        w: ``[N, K]`` float16, bfloat16 or float32; ``K`` a multiple of ``group_size``.
        group_size: 64 or 128.
        with_zeros: asymmetric (scale+zero) instead of symmetric (scale-only) quantization.
        dtype: dtype of ``scales``/``zeros``, which must be the activations' dtype (float16 or
            bfloat16); defaults to ``w.dtype``.
    Returns:
        ``(packed uint8 [N, K/2], scales dtype [N, K/G], zeros dtype [N, K/G] or None)``;
        ``packed`` is in the reference layout: pass it through :func:`w4a16_prepack` once before
        :func:`w4a16_gemm`.
    """
    op = "quantize_weight_int4"
    check_dtype(w, (torch.float16, torch.bfloat16, torch.float32), op, "w")
    check(w.dim() == 2, op, f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    check(group_size in GROUP_SIZES, op, f"group_size must be 64 or 128, got {group_size}")
    n, k = w.shape
    check(
        k > 0 and k % group_size == 0,
        op,
        f"K (w.shape[1] = {k}) must be a positive multiple of group_size ({group_size})",
    )
    dtype = w.dtype if dtype is None else dtype
    check(dtype in HALF_DTYPES, op, f"dtype (of scales and zeros) must be float16 or bfloat16, got {dtype}", TypeError)

    x = w.float().reshape(n, k // group_size, group_size)
    z: torch.Tensor | float  # the zero point per group (a tensor), or 0 in symmetric mode
    if with_zeros:
        lo, hi = x.amin(-1), x.amax(-1)
        scales = ((hi - lo) / 15).to(dtype)
        zeros = (lo + 8 * scales.float()).to(dtype)
        z = zeros.float().unsqueeze(-1)
    else:
        scales = (x.abs().amax(-1) / INT4_MAX).to(dtype)
        zeros = None
        z = 0.0
    s = scales.float().unsqueeze(-1)
    q = ((x - z) / s).round().clamp(INT4_MIN, INT4_MAX)
    q = torch.where((s == 0) | torch.isnan(q), torch.zeros_like(q), q)
    return pack_int4(q.to(torch.int8).reshape(n, k)), scales, zeros


def dequantize_weight_int4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """The weight ``W [N, K]`` that :func:`w4a16_gemm` multiplies by, in ``scales.dtype``.

    ``W = (q * scales[:, k // G]).to(dtype)``, then ``W = (W + zeros[:, k // G]).to(dtype)`` with
    zeros: each step is one float32 operation rounded once to the half dtype, the order of the
    Hopper mixed-input mainloop (int4 -> half conversion is exact; then HMUL2 by the scale, then
    HADD2 of the zero).
    """
    q = unpack_int4(packed).float()
    dtype = scales.dtype
    w = (q * scales.float().repeat_interleave(group_size, dim=1)).to(dtype)
    if zeros is not None:
        w = (w.float() + zeros.float().repeat_interleave(group_size, dim=1)).to(dtype)
    return w


# ---- w4a16_prepack -------------------------------------------------------------------------------
def _check_packed_weight(op: str, name: str, w: torch.Tensor) -> None:
    check_dtype(w, torch.uint8, op, name)
    check(w.dim() == 2, op, f"{name} must be 2-D uint8 [N, K/2], got shape {tuple(w.shape)}")
    check(
        w.shape[0] % N_MULTIPLE == 0,
        op,
        f"N = {name}.shape[0] must be a multiple of {N_MULTIPLE}, got shape {tuple(w.shape)}",
    )


def n_major(t: torch.Tensor) -> torch.Tensor:
    """``scales`` / ``zeros`` ``[N, K/G]`` in the layout the CUDA kernels read: N contiguous
    (strides ``(1, N)``, i.e. ``t.t().contiguous().t()``; no copy if ``t`` already is).

    :func:`w4a16_gemm` accepts both this and the row-major layout; on the GPU a row-major
    ``scales`` is transposed on every call, so store them N-major once at load time.
    """
    return t if _is_n_major(t) else t.t().contiguous().t()


def _is_n_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.shape[0] <= 1 or t.stride(0) == 1) and (t.shape[1] <= 1 or t.stride(1) == t.shape[0])


@reference("w4a16_prepack")
def _w4a16_prepack_ref(weight: torch.Tensor) -> torch.Tensor:
    op = "w4a16_prepack"
    _check_packed_weight(op, "weight", weight)
    check(
        weight.shape[1] > 0 and weight.shape[1] % 32 == 0,
        op,
        f"K = 2 * weight.shape[1] must be a positive multiple of 64 (the smallest group size), "
        f"got weight shape {tuple(weight.shape)}",
    )
    # The reference (CPU) packed format is the reference layout itself.
    return weight.clone(memory_format=torch.contiguous_format)


@fake("w4a16_prepack")
def _w4a16_prepack_fake(weight):
    if weight.device.type == "cuda":  # the shuffled layout's shape (docs/int4.md)
        n, half_k = weight.shape
        return weight.new_empty((2 * half_k // 16, n // 16, 128))
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


@export
def w4a16_prepack(weight: torch.Tensor) -> torch.Tensor:
    """Reorder int4 weights once, at load time, into the format :func:`w4a16_gemm` reads.

    The result is opaque and device-specific: only pass it to :func:`w4a16_gemm` on the same
    device. On the CPU it is ``weight.contiguous()`` (a copy): the reference layout. On CUDA it
    is uint8 ``[K/16, N/16, 128]``: the 16 x 16 (n, k) atoms of the layout the CUTLASS
    mixed-input kernels and the decode GEMV read (docs/int4.md), the same bytes for every M.
    Its shape differs from the reference layout's, so an unprepacked weight passed to the CUDA
    GEMM is refused instead of misread.

    Args:
        weight: uint8 ``[N, K/2]`` in the int4 weight layout (:func:`pack_int4`), ``N`` a
            multiple of 16, ``K`` a multiple of 64.
    Returns:
        the prepacked weight (CPU: uint8 ``[N, K/2]``, contiguous, never aliasing ``weight``;
        CUDA: uint8 ``[K/16, N/16, 128]``).
    """
    return torch.ops.qops.w4a16_prepack(weight)


# ---- w4a16_gemm ----------------------------------------------------------------------------------
def _check_w4a16_gemm(
    a: torch.Tensor,
    weight_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
) -> None:
    op = "w4a16_gemm"
    check_dtype(a, HALF_DTYPES, op, "a")
    check(a.dim() == 2, op, f"a must be 2-D [M, K], got shape {tuple(a.shape)}")
    check(a.stride(-1) == 1, op, "a's last dimension must be contiguous (stride 1)")
    check(group_size in GROUP_SIZES, op, f"group_size must be 64 or 128, got {group_size}")
    k = a.shape[1]
    check(
        k > 0 and k % group_size == 0,
        op,
        f"K (a.shape[1] = {k}) must be a positive multiple of group_size ({group_size})",
    )
    check(
        weight_packed.dim() != 3,
        op,
        f"weight_packed has the CUDA prepacked shape {tuple(weight_packed.shape)}; on {a.device} pass "
        "w4a16_prepack's output for that device (the CPU layout is uint8 [N, K/2])",
    )
    _check_packed_weight(op, "weight_packed", weight_packed)
    n = weight_packed.shape[0]
    check(
        weight_packed.shape[1] == k // 2,
        op,
        f"weight_packed must be [N, K/2] = [N, {k // 2}], got shape {tuple(weight_packed.shape)}",
    )
    check(weight_packed.is_contiguous(), op, "weight_packed must be contiguous")
    expected = (n, k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        check_dtype(t, a.dtype, op, f"{name} (a's dtype)")
        check(
            tuple(t.shape) == expected,
            op,
            f"{name} must be [N, K/group_size] = {list(expected)}, got shape {tuple(t.shape)}",
        )
        check(
            t.is_contiguous() or _is_n_major(t),
            op,
            f"{name} must be contiguous or N-major (strides (1, N): qops.w4a16.n_major), got strides {t.stride()}",
        )
    for name, t in (("weight_packed", weight_packed), ("scales", scales), ("zeros", zeros)):
        if t is not None:
            check(t.device == a.device, op, f"{name} must be on {a.device}, got {t.device}")


@reference("w4a16_gemm")
def _w4a16_gemm_ref(
    a: torch.Tensor,
    weight_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    config: str = "auto",
    enable_pdl: bool = True,
) -> torch.Tensor:
    _check_w4a16_gemm(a, weight_packed, scales, zeros, group_size)
    w = dequantize_weight_int4(weight_packed, scales, zeros, group_size)  # [N, K] in a.dtype
    return (a.float() @ w.float().T).to(a.dtype)  # float32 accumulation


@fake("w4a16_gemm")
def _w4a16_gemm_fake(a, weight_packed, scales, zeros, group_size, *, config="auto", enable_pdl=True):
    # N from scales: the prepacked weight's shape is device-specific.
    return a.new_empty((a.shape[0], scales.shape[0]))


@export
def w4a16_gemm(
    a: torch.Tensor,
    weight_packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    *,
    config: str = "auto",
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """int4-weight GEMM: ``a @ W.T`` with ``W`` dequantized group-wise along ``K``.

    With ``G = group_size`` and ``q = unpack_int4(weight) [N, K]`` (before prepacking)::

        W = (q.float() * scales.float().repeat_interleave(G, 1)).to(a.dtype)
        W = (W.float() + zeros.float().repeat_interleave(G, 1)).to(a.dtype)   # if zeros
        out = (a.float() @ W.float().T).to(a.dtype)                          # f32 accumulation

    Args:
        a: ``[M, K]`` float16 or bfloat16, last dimension contiguous; ``K`` a multiple of
            ``group_size``.
        weight_packed: :func:`w4a16_prepack` of the uint8 ``[N, K/2]`` int4 weight (same device);
            ``N`` a multiple of 16.
        scales: ``[N, K/G]`` in ``a.dtype``, contiguous or N-major (:func:`n_major`, the layout
            the CUDA kernels read; a contiguous one is transposed on every CUDA call).
        zeros: ``[N, K/G]`` in ``a.dtype`` (scale+zero mode), or None (scale-only mode); same
            layouts as ``scales``.
        group_size: 64 or 128.
        config: CUDA only, keyword-only performance knob: ``"auto"`` (the table's choice by
            problem size, ``cutlass_kernels/w8a8_configs.py``) or the name of a w4a16 config
            there (a CUTLASS tile config or ``"gemv"``, the decode GEMV for M <= 16). The CPU
            reference ignores it.
        enable_pdl: CUDA only: launch the hand-written GEMV with programmatic dependent launch
            (None: the ``QOPS_PDL`` default, :mod:`qops.envs`).
    Returns:
        ``[M, N]`` in ``a.dtype``.
    """
    return torch.ops.qops.w4a16_gemm(
        a, weight_packed, scales, zeros, group_size, config=config, enable_pdl=envs.pdl(enable_pdl)
    )
