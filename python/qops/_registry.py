"""How a qops op gets its implementations: the one mechanism every family module uses.

The op catalog is the set of schemas in ``ops/schemas.cpp`` (``op_names()``); everything else
derives from it and from these decorators, so that adding an op touches its schema line, its
family module (``python/qops/<family>.py``), its kernel and glue, a test and a benchmark, and no
list anywhere:

- ``@reference(name)`` registers a plain-PyTorch function as the op's CPU kernel. It is the
  numerical contract that the CUDA kernels are tested against.
- ``@fake(name)`` registers the op's fake (meta) implementation for torch.compile / FakeTensor.
- ``@export`` marks a public object of a family module (the op's documented Python wrapper, which
  carries the op's name, or a tuning class): ``qops`` imports every family module and exports what
  they marked (``exports()``).
- CUDA kernels are registered in C++ (``ops/<family>.cpp``). ``install_missing_cuda_stubs()``
  gives every op that has no CUDA kernel in this build a CUDA implementation that raises a clear
  ``NotImplementedError`` instead of PyTorch's generic dispatch error (and never falls back to the
  CPU reference).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

NAMESPACE = "qops"
_references: dict[str, Callable] = {}
_fakes: dict[str, Callable] = {}
_exports: dict[str, Any] = {}

T = TypeVar("T")


def qualname(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def _one_device(name: str, fn: Callable) -> Callable:
    """``fn`` preceded by the check that every tensor argument is on one device (the first
    tensor's), with the CUDA glue's message. Without it a meta tensor mixed into a CPU call would
    dispatch to the fake and return uninitialized CPU memory."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        first = None
        for arg, value in signature.bind(*args, **kwargs).arguments.items():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                if first is None:
                    first = t
                elif t.device != first.device:
                    raise ValueError(f"qops.{name}: {arg} must be on {first.device}, got {t.device}")
        return fn(*args, **kwargs)

    return checked


def reference(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the CPU kernel (the reference implementation) of ``qops::<name>``; every
    tensor argument must be on one device."""

    def deco(fn: Callable) -> Callable:
        fn = _one_device(name, fn)
        torch.library.impl(qualname(name), "CPU")(fn)
        _references[name] = fn
        return fn

    return deco


def fake(name: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the fake (meta) implementation of ``qops::<name>``; every tensor argument
    must be on one device."""

    def deco(fn: Callable) -> Callable:
        fn = _one_device(name, fn)
        torch.library.register_fake(qualname(name))(fn)
        _fakes[name] = fn
        return fn

    return deco


def export(obj: T) -> T:
    """Export ``obj`` (a function or class of a family module) as ``qops.<obj.__name__>``."""
    name = obj.__name__  # type: ignore[attr-defined]
    if name in _exports and _exports[name] is not obj:
        raise RuntimeError(f"qops: two exports named {name}: {_exports[name]!r} and {obj!r}")
    _exports[name] = obj
    return obj


def exports() -> dict[str, Any]:
    """Every exported object by name (op wrappers are named like their op)."""
    return dict(_exports)


def references() -> dict[str, Callable]:
    """The reference (CPU) implementation of each op, by op name."""
    return dict(_references)


def fakes() -> dict[str, Callable]:
    """The fake implementation of each op, by op name."""
    return dict(_fakes)


def op_names() -> list[str]:
    """Names of all ops defined in the ``qops`` namespace (from the C++ schemas)."""
    prefix = NAMESPACE + "::"
    return sorted({s.name[len(prefix) :] for s in torch._C._jit_get_all_schemas() if s.name.startswith(prefix)})


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


def check_static_scale(op: str, name: str, scale: torch.Tensor) -> None:
    """A static scale must be finite and > 0. Checked by the references (on the host); the CUDA
    kernels read the scale on the device and cannot check it without a host synchronization
    (docs/ops.md: there an invalid scale gives IEEE division's result)."""
    if scale.device.type == "meta" or isinstance(scale, torch._subclasses.FakeTensor):
        return
    check(
        bool(torch.isfinite(scale).all()) and bool((scale > 0).all()),
        op,
        f"{name} must be finite and > 0, got {scale.flatten()[:4].tolist()}",
    )


HALF_DTYPES = (torch.float16, torch.bfloat16)
