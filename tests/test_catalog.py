"""The op catalog as a whole, derived from the one registry (the schemas in ops/schemas.cpp and the
decorators of qops._registry; no list is kept here): every op has a reference (CPU) kernel, a fake,
an exported wrapper with the contract in its docstring, a section in docs/ops.md, and on CUDA either
a compiled kernel or a clear NotImplementedError."""

from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import qops
from qops import _registry

DOCS_OPS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "ops.md"
OPS = qops.op_names()


def test_registry_is_consistent():
    assert OPS, "no qops schemas registered"
    assert sorted(_registry.references()) == OPS, "every op needs exactly one @reference"
    assert sorted(_registry.fakes()) == OPS, "every op needs exactly one @fake"
    exported = _registry.exports()
    assert set(OPS) <= set(exported), f"ops without an @export wrapper: {sorted(set(OPS) - set(exported))}"
    assert set(qops.__all__) == set(exported) | {"has_cuda_kernel", "op_names"}
    for name in OPS:  # each resolves to an OpOverloadPacket under torch.ops.qops
        assert isinstance(getattr(torch.ops.qops, name), torch._ops.OpOverloadPacket)


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_reference_fake_and_documented_wrapper(name):
    qual = _registry.qualname(name)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), f"{name}: no CPU reference"
    wrapper = getattr(qops, name)
    doc = inspect.getdoc(wrapper) or ""
    assert len(doc) > 80 and ("torch" in doc or "[" in doc), f"qops.{name} needs a docstring with the contract"
    # The wrapper's keyword-only options are the schema's arguments (or a tuning object that stands
    # for several of them), and every keyword-only argument of the schema is reachable from it.
    schema = getattr(torch.ops.qops, name).default._schema
    schema_args = {a.name for a in schema.arguments}
    kw_wrapper = {
        p.name for p in inspect.signature(wrapper).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert kw_wrapper - {"tuning"} <= schema_args, f"qops.{name}: options {kw_wrapper} vs schema {schema_args}"
    kw_schema = {a.name for a in schema.arguments if a.kwarg_only}
    assert kw_schema <= kw_wrapper or "tuning" in kw_wrapper, f"qops.{name}: schema options {kw_schema}"
    assert ("enable_pdl" in kw_schema) == ("enable_pdl" in kw_wrapper)


@pytest.mark.parametrize("name", OPS)
def test_every_op_is_documented_in_ops_md(name):
    assert f"`{name}(" in DOCS_OPS.read_text(), f"docs/ops.md does not state the contract of {name}"


def test_cuda_registration_is_kernel_or_stub():
    for name in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(_registry.qualname(name), "CUDA")
    if not torch.cuda.is_available() and "cpu" in torch.__version__:
        assert not any(qops.has_cuda_kernel(n) for n in OPS)


def _stand_in_args(name: str) -> tuple[list, dict]:
    """Well-typed CUDA arguments for `name`, made from its schema: the stub raises at dispatch,
    before it looks at them."""
    x = torch.zeros(4, 64, device="cuda", dtype=torch.float16)
    by_type = {
        "Tensor": x,
        "float": 1.0,
        "int": 1,
        "bool": False,
        "ScalarType": torch.float16,
        "str": "auto",
        "List[int]": [],
        "Optional[Tensor]": None,
    }
    args, kwargs = [], {}
    for a in getattr(torch.ops.qops, name).default._schema.arguments:
        if a.has_default_value():
            continue
        value = by_type[str(a.type)]
        (kwargs.__setitem__(a.name, value) if a.kwarg_only else args.append(value))
    return args, kwargs


@pytest.mark.gpu
def test_ops_without_cuda_kernel_raise_clearly():
    missing = [n for n in OPS if not qops.has_cuda_kernel(n)]
    for name in missing:
        args, kwargs = _stand_in_args(name)
        with pytest.raises(NotImplementedError, match=f"qops.{name}: this build of qops has no CUDA kernel"):
            getattr(torch.ops.qops, name)(*args, **kwargs)
    print("ops without a CUDA kernel in this build:", missing)
