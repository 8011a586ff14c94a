"""Where a model comes from, for the command lines (``python -m qops.llama --model PATH``,
``python -m qops.llama.eval --model PATH``): the bundled SmolLM2 GGUF (the default), a Hugging
Face model folder with float weights, a llama GGUF file, or a compressed-tensors checkpoint folder
(W8A8 ``int-quantized`` or W4A16 ``pack-quantized``).

    src = resolve("path/to/Llama-3.2-1B")       # ModelSource(kind="hf", ...)
    hf = load_float(src)                        # transformers model (quantize it with qops)
    qm = load_quantized(src, kv_cache="int8")   # compressed-tensors: straight into qops
    tok = load_tokenizer(src)
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

KINDS = ("smollm2", "hf", "gguf", "compressed")


@dataclass(frozen=True)
class ModelSource:
    """``kind``: ``"smollm2"`` (the bundled GGUF), ``"hf"`` (a Hugging Face folder, float
    weights), ``"gguf"`` (a llama GGUF file) or ``"compressed"`` (a compressed-tensors checkpoint
    folder); ``path`` (None for the bundled model); ``name``: a label for tables."""

    kind: str
    path: Path | None
    name: str

    @property
    def quantized(self) -> bool:
        """A checkpoint that is already quantized (loaded as it is, not quantized by qops)."""
        return self.kind == "compressed"


def resolve(model: str | os.PathLike | None) -> ModelSource:
    """What ``--model`` names: None (or ``"smollm2"``) is the bundled SmolLM2-135M-Instruct; a
    ``.gguf`` file; a folder with ``config.json`` (compressed-tensors when its
    ``quantization_config`` says so, else float weights). Anything else raises
    ``FileNotFoundError`` / ``ValueError`` saying what was expected."""
    if model is None or str(model) == "smollm2":
        return ModelSource("smollm2", None, "SmolLM2-135M-Instruct")
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"--model {str(model)!r}: no such file or folder (expected a Hugging Face model folder, "
            f"a compressed-tensors checkpoint folder or a .gguf file)"
        )
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(
                f"--model {str(model)!r}: a file that is not a .gguf (expected a Hugging Face model folder, "
                f"a compressed-tensors checkpoint folder or a .gguf file)"
            )
        return ModelSource("gguf", p, p.stem)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        ggufs = sorted(p.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file" if ggufs else ""
        raise ValueError(f"--model {str(model)!r}: the folder has no config.json (not a Hugging Face model){hint}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {str(model)!r}: config.json is not readable JSON ({e})") from None
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        if qc.get("quant_method") == "compressed-tensors":
            return ModelSource("compressed", p, p.name)
        raise ValueError(
            f"--model {str(model)!r}: quantized with {qc.get('quant_method')!r}; qops loads float checkpoints "
            f"(which it quantizes) and compressed-tensors ones"
        )
    return ModelSource("hf", p, p.name)


def load_float(src: ModelSource, *, dtype: torch.dtype = torch.float32, device="cpu", progress: bool = True):
    """The float ``transformers`` model of a non-quantized source (eval mode, SDPA attention)."""
    from . import smollm2

    if src.kind == "smollm2":
        return smollm2.load_model(dtype=dtype, device=device, progress=progress)
    if src.kind == "gguf":
        return smollm2.load_model(dtype=dtype, device=device, path=src.path, progress=progress)
    if src.kind == "hf":
        from transformers import AutoModelForCausalLM

        assert src.path is not None
        model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()
    raise ValueError(f"qops.llama.sources.load_float: {src.name} is a {src.kind} checkpoint, not float weights")


def load_reference(src: ModelSource, *, dtype: torch.dtype = torch.float32, device="cpu", progress: bool = True):
    """The float model to compare against: ``load_float``, or for a compressed-tensors checkpoint
    transformers' own load of it, decompressed to ``dtype`` (the checkpoint's dequantized weights)."""
    if not src.quantized:
        return load_float(src, dtype=dtype, device=device, progress=progress)
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    assert src.path is not None
    with warnings.catch_warnings():  # "the quantization_config from the model will be used": as meant
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(
            str(src.path),
            dtype=dtype,
            attn_implementation="sdpa",
            quantization_config=CompressedTensorsConfig(dequantize=True),
        )
    return model.to(device).eval()


def load_quantized(src: ModelSource, *, device=None, dtype: torch.dtype | None = None, **qcfg_overrides):
    """A compressed-tensors checkpoint as a ``QuantizedLlamaForCausalLM`` (``load_compressed``;
    ``qcfg_overrides``: the KV cache, e.g. ``kv_cache="int4"``)."""
    from .compressed import load_compressed

    if not src.quantized or src.path is None:
        raise ValueError(f"qops.llama.sources.load_quantized: {src.name} is not a compressed-tensors checkpoint")
    return load_compressed(src.path, device=device, dtype=dtype, **qcfg_overrides)


def load_tokenizer(src: ModelSource):
    """The source's tokenizer: the GGUF's (converted once and cached, ``smollm2.load_tokenizer``)
    or the folder's (``AutoTokenizer``)."""
    from . import smollm2

    if src.kind == "smollm2":
        return smollm2.load_tokenizer()
    if src.kind == "gguf":
        return smollm2.load_tokenizer(src.path)
    from transformers import AutoTokenizer

    assert src.path is not None
    try:
        return AutoTokenizer.from_pretrained(str(src.path))
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {str(src.path)!r}: no tokenizer in the folder ({e})") from None
