"""``python -m qops.llama --model PATH``: one model, quantized by qops (or loaded as it is from a
compressed-tensors checkpoint), generating a continuation of ``--prompt``, optionally saved as a
compressed-tensors checkpoint (``--save DIR``). The model comes from ``qops.llama.sources``: a
Hugging Face folder with float weights, a llama GGUF file, or a compressed-tensors folder."""

from __future__ import annotations

import argparse
import sys
import time

import torch

WEIGHTS = ("int8", "int4", "none")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--model`` mode's options (``python -m qops.llama`` adds them to its parser)."""
    g = p.add_argument_group("one model (--model)")
    g.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model folder (float weights: quantized by qops), a llama .gguf file, or a "
        "compressed-tensors checkpoint folder (W8A8 int-quantized, W4A16 pack-quantized: loaded as it is); "
        "runs that one model instead of the SmolLM2 comparison",
    )
    g.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=None,
        help="float checkpoints: int8 (W8A8, the default), int4 (W4A16, RTN) or none (float linears)",
    )
    g.add_argument(
        "--group-size",
        type=int,
        choices=(64, 128),
        default=None,
        help="--weights int4: input channels per scale (default 128 where every linear allows it, else 64)",
    )
    g.add_argument("--kv-cache", choices=("int8", "int4", "fp16"), default="int8", help="the paged KV cache")
    g.add_argument(
        "--smoothquant",
        action="store_true",
        help="--weights int8: SmoothQuant (calibrated on --calib-tokens of --text)",
    )


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def prompt_ids(tok, prompt: str) -> list[int]:
    """The prompt's token ids: through the tokenizer's chat template (a user turn, then the
    generation prompt) when it has one, else as plain text. Both ``python -m qops.llama`` modes
    use it."""
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tok(prompt)["input_ids"])


def run_model(a: argparse.Namespace) -> int:
    """The ``--model`` mode of ``python -m qops.llama`` (``a``: its parsed arguments)."""
    from .compressed import save_compressed
    from .config import LlamaArgs, QuantConfig
    from .data import load_text, tokenize
    from .generate import generate
    from .quantize import quantize, w4a16_linears
    from .sources import load_float, load_quantized, load_tokenizer, resolve

    try:
        src = resolve(a.model)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    if a.save and not src.quantized and a.weights == "none":
        return _error("--save writes a W8A8 or W4A16 model: --weights none (float linears) cannot be saved")
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    # --dtype: a compressed-tensors checkpoint keeps its torch_dtype unless given; else float16
    dtype = None if a.dtype is None else getattr(torch, a.dtype)
    progress = not a.no_progress
    t0 = time.perf_counter()
    try:
        tok = load_tokenizer(src)
    except ValueError as e:
        return _error(str(e))
    if src.quantized:
        if a.weights is not None or a.group_size is not None or a.smoothquant:
            return _error(
                f"--model {a.model}: a compressed-tensors checkpoint is already quantized; "
                f"--weights, --group-size and --smoothquant apply to float checkpoints"
            )
        try:  # loaded on the CPU when saving (W4A16 weights prepacked for a GPU cannot be saved)
            model = load_quantized(src, device="cpu" if a.save else dev, dtype=dtype, kv_cache=a.kv_cache)
        except ValueError as e:
            return _error(str(e))
        how = "loaded as it is (compressed-tensors)"
    else:
        dtype = dtype or torch.float16
        hf = load_float(src, dtype=dtype if gpu else torch.float32, device=dev, progress=progress)
        weights = a.weights or "int8"
        if weights != "int4" and a.group_size is not None:
            return _error("--group-size applies to --weights int4")
        if weights != "int8" and a.smoothquant:
            return _error("--smoothquant applies to --weights int8 (W8A8)")
        kw: dict = {"weights": {"int8": "int8", "int4": "int4", "none": False}[weights], "kv_cache": a.kv_cache}
        if weights == "int4":
            odd = any(k % 128 for _, k in w4a16_linears(LlamaArgs.from_hf(hf.config)).values())
            kw["group_size"] = a.group_size or (64 if odd else 128)
        calib = None
        if a.smoothquant:
            kw.update(smoothquant=True, smooth_alpha=a.alpha)
            text, source = load_text(a.text or "excerpt")
            calib = tokenize(tok, text)[-a.calib_tokens :]
            print(f"  SmoothQuant (alpha {a.alpha}): calibrating on the last {calib.numel()} tokens of {source}")
        qcfg = QuantConfig(**kw)
        # W4A16 weights prepacked for a GPU cannot be saved: quantize on the CPU when saving
        qdev = torch.device("cpu") if (a.save and qcfg.w4a16) else dev
        try:
            model = quantize(hf.to(qdev), calib, config=qcfg, dtype=dtype, device=qdev, progress=progress)
        except (ValueError, NotImplementedError) as e:
            return _error(f"--model {a.model}: {e}")
        how = "quantized by qops"
    print(f"qops.llama: {src.name} ({src.kind}), {model.qcfg.label()}, {how}, in {time.perf_counter() - t0:.1f} s")
    if a.save:
        hf_source = src.path if src.kind in ("hf", "compressed") else None
        try:
            save_compressed(model, a.save, hf_source=hf_source, tokenizer=tok)
        except (ValueError, NotImplementedError) as e:
            return _error(f"--save {a.save}: {str(e).splitlines()[0]}")
        print(f"  saved as a compressed-tensors checkpoint to {a.save}")
    if model.device != dev:
        model = model.to(dev)
    ids = prompt_ids(tok, a.prompt)
    res = generate(model, [ids], a.max_new_tokens, eos_token_id=tok.eos_token_id)
    out = tok.decode(res.tokens[0], skip_special_tokens=True).strip()
    print(f"\nprompt: {a.prompt!r}  (greedy, {a.max_new_tokens} new tokens at most)")
    print(f"[{model.qcfg.label()}] {out}")
    n = res.decode_tokens
    if n and res.decode_s > 0:
        print(f"  prefill {res.prefill_s * 1e3:.0f} ms, decode {n / res.decode_s:.1f} tokens/s ({dev.type})")
    return 0
