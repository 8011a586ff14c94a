"""The op catalog as a whole: every op of docs/ops.md is defined, has a reference (CPU) kernel, a
fake, a documented wrapper, and on CUDA either a compiled kernel or a clear NotImplementedError."""
from __future__ import annotations

import inspect

import pytest
import torch

import qops
from qops import _registry

CATALOG = [
    "fused_add_rms_norm_quant",
    "int4_gqa_decode",
    "paged_decode_attention_int8",
    "quant_per_tensor",
    "quant_per_token",
    "quantize_kv_int4",
    "reshape_and_cache_int8",
    "rms_norm_quant",
    "silu_and_mul_quant",
    "w4a16_gemm",
    "w4a16_prepack",
    "w8a8_gemm",
]


def test_catalog_is_complete():
    assert qops.op_names() == CATALOG
    for name in CATALOG:  # each resolves to an OpOverloadPacket under torch.ops.qops
        assert isinstance(getattr(torch.ops.qops, name), torch._ops.OpOverloadPacket)


@pytest.mark.parametrize("name", CATALOG)
def test_every_op_has_reference_fake_and_documented_wrapper(name):
    qual = _registry.qualname(name)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), f"{name}: no CPU reference"
    assert name in _registry._references and name in _registry._fakes
    wrapper = getattr(qops, name)
    doc = inspect.getdoc(wrapper) or ""
    assert len(doc) > 80 and ("torch" in doc or "[" in doc), f"qops.{name} needs a docstring with the contract"


def test_cuda_registration_is_kernel_or_stub():
    for name in CATALOG:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(_registry.qualname(name), "CUDA")
    if not torch.cuda.is_available() and "cpu" in torch.__version__:
        assert not any(qops.has_cuda_kernel(n) for n in CATALOG)


@pytest.mark.gpu
def test_ops_without_cuda_kernel_raise_clearly():
    missing = [n for n in CATALOG if not qops.has_cuda_kernel(n)]
    # A stand-in call per op: the stub raises before looking at the arguments.
    for name in missing:
        x = torch.zeros(4, 64, device="cuda", dtype=torch.float16)
        op = getattr(torch.ops.qops, name)
        with pytest.raises((NotImplementedError, RuntimeError), match=f"qops.{name}"):
            _call_with_cuda_args(op, name, x)
    print("ops without a CUDA kernel in this build:", missing)


def _call_with_cuda_args(op, name, x):
    # Minimal well-typed arguments per schema; the stub raises NotImplementedError at dispatch.
    s = torch.tensor([1.0], device="cuda")
    i32 = torch.zeros(4, dtype=torch.int32, device="cuda")
    args = {
        "w4a16_prepack": (x.to(torch.uint8),),
        "w4a16_gemm": (x, x.to(torch.uint8), x, None, 64),
        "quantize_kv_int4": (x, 1),
        "int4_gqa_decode": (x, x.to(torch.uint8), x.to(torch.uint8), i32, 1.0, 1),
        "w8a8_gemm": (x.to(torch.int8), x.to(torch.int8), s, s, torch.float16),
        "rms_norm_quant": (x, x[0], 1e-5),
        "fused_add_rms_norm_quant": (x, x.clone(), x[0], 1e-5),
        "silu_and_mul_quant": (x,),
        "quant_per_token": (x,),
        "quant_per_tensor": (x, s),
        "reshape_and_cache_int8": (x, x, x.to(torch.int8), x.to(torch.int8), s, s, i32.long()),
        "paged_decode_attention_int8": (x, x.to(torch.int8), x.to(torch.int8), s, s, i32[None], i32, 1.0),
    }[name]
    return op(*args)
