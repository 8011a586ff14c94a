"""Text for perplexity: the Jargon File (public domain) from Debian's ``jargon-text`` package,
and a short excerpt of it bundled with qops (``qops/llama/data/jargon_excerpt.txt``, ~12 KB)
for tests and the CPU demo.

``apt-get install jargon-text`` puts the full file (1.68 MB, ~400k SmolLM2 tokens) at
``/usr/share/doc/jargon-text/jargon.txt.gz``. The Jargon File 4.4.7 is in the public domain
(Eric S. Raymond et al.); the excerpt is taken from it with ``clean_jargon``.
"""

from __future__ import annotations

import gzip
import os
import re
from pathlib import Path

import torch

JARGON_GZ = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
EXCERPT = Path(__file__).with_name("data") / "jargon_excerpt.txt"
_BOX = re.compile(r"[\u2500-\u257f]")


def clean_jargon(raw: str) -> str:
    """Reflow the Jargon File's plain-text rendering into paragraphs of prose: lines of one
    paragraph are joined with spaces, indentation and box-drawn tables are dropped."""
    paras = []
    for block in re.split(r"\n\s*\n", raw):
        if _BOX.search(block):
            continue
        lines = [ln.strip() for ln in block.strip().splitlines()]
        text = " ".join(ln for ln in lines if ln)
        if text:
            paras.append(text)
    return "\n\n".join(paras) + "\n"


def read_text(path: str | os.PathLike) -> str:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def jargon_text(full: bool = True) -> tuple[str, str]:
    """``(text, source)``: the full Jargon File when ``full`` and Debian's file is installed,
    else the bundled excerpt."""
    if full and JARGON_GZ.is_file():
        return clean_jargon(read_text(JARGON_GZ)), str(JARGON_GZ)
    return EXCERPT.read_text(encoding="utf-8"), f"{EXCERPT.name} (bundled excerpt)"


def load_text(source: str = "jargon") -> tuple[str, str]:
    """``(text, source)``: ``"jargon"`` (full file, else the excerpt), ``"excerpt"``, or a path
    to a text file (``.gz`` allowed)."""
    if source == "jargon":
        return jargon_text(full=True)
    if source == "excerpt":
        return jargon_text(full=False)
    return read_text(source), str(source)


def tokenize(tokenizer, text: str, max_tokens: int | None = None) -> torch.Tensor:
    """int64 ``[N]`` token ids of ``text`` (no special tokens), truncated to ``max_tokens``.
    Long texts are encoded in paragraph chunks (the tokenizer is slow on one huge string)."""
    ids: list[int] = []
    chunk: list[str] = []
    size = 0
    paras = text.split("\n\n")
    for i, p in enumerate(paras):
        chunk.append(p)
        size += len(p)
        if size > 20000 or i == len(paras) - 1:
            s = "\n\n".join(chunk) + ("\n\n" if i < len(paras) - 1 else "")
            ids.extend(tokenizer(s, add_special_tokens=False)["input_ids"])
            chunk, size = [], 0
            if max_tokens is not None and len(ids) >= max_tokens:
                break
    t = torch.tensor(ids, dtype=torch.long)
    return t[:max_tokens] if max_tokens is not None else t


def jargon_tokens(tokenizer=None) -> tuple[torch.Tensor, str]:
    """``(ids int64 [N], source)`` of the whole cleaned Jargon File: tokenized from Debian's
    file, or read from ``$QOPS_LLAMA_DATA/jargon_tokens.pt`` (pre-tokenized, for machines with
    neither the file nor the tokenizer)."""
    from .smollm2 import data_dir

    if JARGON_GZ.is_file() and tokenizer is not None:
        return tokenize(tokenizer, clean_jargon(read_text(JARGON_GZ))), str(JARGON_GZ)
    d = data_dir()
    if d is not None and (d / "jargon_tokens.pt").is_file():
        return torch.load(d / "jargon_tokens.pt").long(), "jargon.txt.gz (pre-tokenized)"
    if tokenizer is None:
        raise FileNotFoundError("no tokenizer and no pre-tokenized Jargon File")
    text, source = jargon_text(full=True)
    return tokenize(tokenizer, text), source
