"""qops: quantized LLM inference ops (W8A8 GEMMs, fused norm/activation + int8 quant, int8 and int4
KV-cache decode attention) for NVIDIA GPUs, with a reference CPU implementation of every op.

All ops live under ``torch.ops.qops.*``; the functions here are typed wrappers with docstrings.
``docs/ops.md`` states each op's numerical contract.
"""
from __future__ import annotations

import importlib

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # noqa: F401  (the op schemas, and the CUDA kernels when built with CUDA)
from ._registry import has_cuda_kernel, install_missing_cuda_stubs, op_names

# One module per op family: each registers its ops' reference (CPU) and fake implementations and
# defines their Python wrappers. Adding a family means adding its name here.
_FAMILIES = ("quant", "norm", "activation", "gemm", "w4a16", "kv_cache", "attention", "int4_kv")
for _family in _FAMILIES:
    importlib.import_module(f"{__name__}.{_family}")
install_missing_cuda_stubs()

from .activation import silu_and_mul_quant  # noqa: E402
from .attention import paged_decode_attention_int8  # noqa: E402
from .gemm import w8a8_gemm  # noqa: E402
from .int4_kv import int4_gqa_decode, quantize_kv_int4  # noqa: E402
from .kv_cache import reshape_and_cache_int8  # noqa: E402
from .norm import fused_add_rms_norm_quant, rms_norm_quant  # noqa: E402
from .quant import quant_per_tensor, quant_per_token  # noqa: E402
from .w4a16 import w4a16_gemm, w4a16_prepack  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "fused_add_rms_norm_quant",
    "has_cuda_kernel",
    "int4_gqa_decode",
    "op_names",
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
