"""How a qops op gets its implementations: the one mechanism every family module uses.

- ``@reference(name)`` registers a plain-PyTorch function as the op's CPU kernel. It is the
  numerical contract that the CUDA kernels are tested against.
- ``@fake(name)`` registers the op's fake (meta) implementation for torch.compile / FakeTensor.
- CUDA kernels are registered in C++ (``ops/<family>.cpp``). ``install_missing_cuda_stubs()``
  gives every op that has no CUDA kernel in this build a CUDA implementation that raises a clear
  ``NotImplementedError`` instead of PyTorch's generic dispatch error (and never falls back to the
  CPU reference).
"""
from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "qops"
_references: dict[str, Callable] = {}
_fakes: dict[str, Callable] = {}


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def reference(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the CPU kernel (the reference implementation) of ``qops::<name>``."""

    def deco(fn: Callable) -> Callable:
        torch.library.impl(qualname(name), "CPU")(fn)
        _references[name] = fn
        return fn

    return deco


def fake(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the fake (meta) implementation of ``qops::<name>``."""

    def deco(fn: Callable) -> Callable:
        torch.library.register_fake(qualname(name))(fn)
        _fakes[name] = fn
        return fn

    return deco


def op_names() -> list[str]:
    """Names of all ops defined in the ``qops`` namespace (from the C++ schemas)."""
    prefix = NAMESPACE + "::"
    return sorted(
        {s.name[len(prefix):] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)}
    )


def has_cuda_kernel(name: str) -> bool:
    """True when this build registered a compiled CUDA kernel (not a stub) for ``qops::<name>``."""
    return name in _compiled_cuda


_compiled_cuda: set[str] = set()


def install_missing_cuda_stubs() -> None:
    for name in op_names():
        if torch._C._dispatch_has_kernel_for_dispatch_key(qualname(name), "CUDA"):
            _compiled_cuda.add(name)
            continue

        def _no_cuda_kernel(*args, _name=name, **kwargs):
            raise NotImplementedError(
                f"qops.{_name}: this build of qops has no CUDA kernel for this op "
                f"(built for CPU only, or the kernel family was skipped at build time). "
                f"Move the inputs to the CPU to run the reference implementation."
            )

        torch.library.impl(qualname(name), "CUDA")(_no_cuda_kernel)


def check(cond: bool, op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc`` with a message naming the op when ``cond`` is false."""
    if not cond:
        raise exc(f"qops.{op}: {msg}")


def check_dtype(t: torch.Tensor, dtypes, op: str, name: str) -> None:
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    check(
        t.dtype in dtypes,
        op,
        f"{name} must be {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, got "
        f"{str(t.dtype).replace('torch.', '')}",
        TypeError,
    )


HALF_DTYPES = (torch.float16, torch.bfloat16)
