"""Tensor parallelism's fused all-reduce: ``allreduce_add_rms_norm_quant`` and
``allreduce_add_rms_norm``, and the symmetric workspace they run on (``SymmetricWorkspace``).

The op is "sum the row-parallel partial outputs of every rank, then exactly
``fused_add_rms_norm_quant`` (``fused_add_rms_norm``) on the sum", in one CUDA kernel per rank
that reads its peers' partials over peer-to-peer loads (csrc/comm/allreduce_norm.h). Every rank
computes bit-identical outputs (the partials are added in rank order). The CPU reference holds a
single rank (world 1): there the op is the norm itself; multi-rank runs fall back to
``torch.distributed.all_reduce`` + the norm (``qops.llama.parallel``).
"""

from __future__ import annotations

import warnings

import torch

from ._registry import HALF_DTYPES, check, check_dtype, export, fake, reference
from .norm import _fused_add_rms_norm_quant_ref, _fused_add_rms_norm_ref

FLAGS_BYTES = (2 * 64 * 8 + 64) * 4  # csrc/comm/allreduce_norm.h kFlagsBytes
MAX_RANKS = 8
MAX_HIDDEN = 16384


def _check(op: str, input, residual, weight, buffers, rank: int, buffer_bytes: int) -> None:
    check_dtype(input, HALF_DTYPES, op, "input")
    check(input.dim() == 2, op, f"input must be [T, H], got shape {tuple(input.shape)}")
    t, h = input.shape
    check(h % 8 == 0 and 0 < h <= MAX_HIDDEN, op, f"H must be a positive multiple of 8 up to {MAX_HIDDEN}, got {h}")
    check(residual.shape == input.shape, op, f"residual must be [T, H] like input, got shape {tuple(residual.shape)}")
    check_dtype(buffers, torch.int64, op, "buffers")
    check(
        buffers.dim() == 1 and 1 <= buffers.shape[0] <= MAX_RANKS,
        op,
        f"buffers must be int64 [world] (world 1 to {MAX_RANKS}), got shape {tuple(buffers.shape)}",
    )
    check(0 <= rank < buffers.shape[0], op, f"rank must be in [0, {buffers.shape[0]}), got {rank}")
    check(
        FLAGS_BYTES + t * h * 2 <= buffer_bytes,
        op,
        f"T = {t} rows of H = {h} do not fit the workspace buffers ({buffer_bytes} bytes, of which "
        f"{FLAGS_BYTES} are flags)",
    )


def _one_rank(op: str, buffers: torch.Tensor) -> None:
    check(
        buffers.shape[0] == 1,
        op,
        f"the CPU reference holds one rank (world 1), got world {buffers.shape[0]}: "
        "on CPU, all-reduce with torch.distributed and call the norm",
    )


@reference("allreduce_add_rms_norm_quant")
def _allreduce_add_rms_norm_quant_ref(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None,
    buffers: torch.Tensor,
    rank: int,
    buffer_bytes: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "allreduce_add_rms_norm_quant"
    _check(op, input, residual, weight, buffers, rank, buffer_bytes)
    _one_rank(op, buffers)
    return _fused_add_rms_norm_quant_ref(input, residual, weight, epsilon, scale)


@fake("allreduce_add_rms_norm_quant")
def _allreduce_add_rms_norm_quant_fake(input, residual, weight, epsilon, scale, buffers, rank, buffer_bytes):
    q = torch.empty_like(input, dtype=torch.int8, memory_format=torch.contiguous_format)
    if scale is None:
        return q, input.new_empty(input.shape[:-1], dtype=torch.float32)
    return q, input.new_empty((1,), dtype=torch.float32)


@reference("allreduce_add_rms_norm")
def _allreduce_add_rms_norm_ref(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    buffers: torch.Tensor,
    rank: int,
    buffer_bytes: int,
) -> torch.Tensor:
    op = "allreduce_add_rms_norm"
    _check(op, input, residual, weight, buffers, rank, buffer_bytes)
    _one_rank(op, buffers)
    return _fused_add_rms_norm_ref(input, residual, weight, epsilon)


@fake("allreduce_add_rms_norm")
def _allreduce_add_rms_norm_fake(input, residual, weight, epsilon, buffers, rank, buffer_bytes):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@export
def allreduce_add_rms_norm_quant(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor | None,
    workspace: SymmetricWorkspace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce (sum over the ranks of ``workspace``) + residual add + RMSNorm + int8 quant.

    With ``x = sum_r input_r`` (the ``[T, H]`` partial outputs of a row-parallel linear on every
    rank, added in float32 in rank order and rounded to the input dtype)::

        out, scale_out = qops.fused_add_rms_norm_quant(x, residual, weight, epsilon, scale)

    exactly, on every rank (bit-identical outputs across ranks). ``residual`` is updated in place.

    Args:
        input: this rank's ``[T, H]`` float16/bfloat16 partial sums (rows contiguous, a row stride
            that is a multiple of 8); ``H`` a multiple of 8 up to 16384.
        residual: ``[T, H]`` in input's dtype, updated in place.
        weight: ``[H]``; epsilon: the norm's epsilon.
        scale: None (dynamic per-token scales) or one float32 (static).
        workspace: the group's ``SymmetricWorkspace`` (``T`` rows must fit it). Every rank calls
            with the same ``T``, in the same order.
    Returns:
        ``(int8 [T, H], float32 [T] or [1])`` as ``qops.fused_add_rms_norm_quant``.
    """
    return torch.ops.qops.allreduce_add_rms_norm_quant(
        input, residual, weight, epsilon, scale, workspace.buffers, workspace.rank, workspace.buffer_bytes
    )


@export
def allreduce_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    workspace: SymmetricWorkspace,
) -> torch.Tensor:
    """All-reduce + residual add + RMSNorm with an output in the input's dtype: exactly
    ``qops.fused_add_rms_norm(x, residual, weight, epsilon)`` on ``x = sum_r input_r`` (the
    ``[T, H]`` partials added in float32 in rank order, rounded to the input dtype); arguments and
    conditions as :func:`allreduce_add_rms_norm_quant`. Returns ``[T, H]`` in input's dtype."""
    return torch.ops.qops.allreduce_add_rms_norm(
        input, residual, weight, epsilon, workspace.buffers, workspace.rank, workspace.buffer_bytes
    )


@export
class SymmetricWorkspace:
    """The buffers ``allreduce_add_rms_norm(_quant)`` runs on: one per rank, each addressable by
    every rank, ``buffer_bytes`` each (flags, then room for ``max_tokens`` rows of ``hidden``
    16-bit values), with ``buffers`` the int64 ``[world]`` device tensor of their addresses.

    ``SymmetricWorkspace.allocate(group, max_tokens, hidden, device)`` makes them with
    ``torch.distributed._symmetric_memory`` (CUDA, NVLink or PCIe peer access; every rank of
    ``group`` calls it together); it returns None where that is unavailable, and callers then use
    ``torch.distributed.all_reduce`` + the norm. ``SymmetricWorkspace.local(...)`` makes a world-1
    workspace in ordinary memory (the CPU reference's, or one GPU's). ``simulated(world, ...)``
    makes ``world`` workspaces on one GPU, for testing the protocol with one kernel per stream.
    """

    def __init__(self, buffers: torch.Tensor, rank: int, buffer_bytes: int, keep: object = None) -> None:
        self.buffers, self.rank, self.buffer_bytes = buffers, rank, buffer_bytes
        self._keep = keep  # the memory behind the addresses

    @property
    def world(self) -> int:
        return int(self.buffers.shape[0])

    @staticmethod
    def bytes_for(max_tokens: int, hidden: int) -> int:
        return FLAGS_BYTES + max_tokens * hidden * 2

    @classmethod
    def local(cls, max_tokens: int, hidden: int, device) -> SymmetricWorkspace:
        n = cls.bytes_for(max_tokens, hidden)
        mem = torch.zeros(n, dtype=torch.uint8, device=device)
        return cls(torch.tensor([mem.data_ptr()], dtype=torch.int64, device=device), 0, n, mem)

    @classmethod
    def simulated(cls, world: int, max_tokens: int, hidden: int, device) -> list[SymmetricWorkspace]:
        n = cls.bytes_for(max_tokens, hidden)
        mems = [torch.zeros(n, dtype=torch.uint8, device=device) for _ in range(world)]
        ptrs = torch.tensor([m.data_ptr() for m in mems], dtype=torch.int64, device=device)
        return [cls(ptrs, r, n, mems) for r in range(world)]

    @classmethod
    def allocate(cls, group, max_tokens: int, hidden: int, device) -> SymmetricWorkspace | None:
        """Every rank of ``group`` calls this together; all of them get a workspace or all get None
        (the ranks agree through an all-reduce, so none takes the kernel while a peer takes NCCL)."""
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        world = dist.get_world_size(pg)
        if not (1 < world <= MAX_RANKS and hidden % 8 == 0 and 0 < hidden <= MAX_HIDDEN):
            return None  # outside the kernel's limits: the same answer on every rank
        ws: SymmetricWorkspace | None = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            n = cls.bytes_for(max_tokens, hidden)
            buf = symm_mem.empty(n, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(buf, pg)
            # the tensor sits at handle.offset inside each rank's allocation (a shared pool)
            offset = int(getattr(handle, "offset", 0))
            ptrs = [int(p) + offset for p in handle.buffer_ptrs]
            if ptrs[int(handle.rank)] != buf.data_ptr():
                raise RuntimeError("symmetric buffer addresses do not match the local tensor")
            buf.zero_()  # the flags and epochs
            torch.cuda.synchronize(device)
            handle.barrier()  # every rank's zeros are in place ...
            torch.cuda.synchronize(device)  # ... before any rank's first call
            ws = cls(torch.tensor(ptrs, dtype=torch.int64, device=device), int(handle.rank), n, (buf, handle))
        except Exception as e:  # no symmetric memory here (no P2P, an old torch): the NCCL path
            msg = f"qops: no symmetric workspace ({type(e).__name__}: {e}); using NCCL all-reduce"
            warnings.warn(msg, stacklevel=2)
        ok = torch.tensor([1 if ws is not None else 0], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=pg)
        return ws if int(ok.item()) == 1 else None
