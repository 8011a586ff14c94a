"""Quality of the quantized SmolLM2-135M-Instruct: perplexity, next-token KL divergence and top-1
agreement against the float model, for fp16 / KV8 / KV4 / W8A8 / W8A8+KV8 (dynamic and static
scales, with and without SmoothQuant) and W4A16 / W4A16+KV8 (int4 weights, RTN, groups of 64), on
the Jargon File.

    python -m bench.eval_quality [--out DIR] [--tokens N] [--seq-len S] [--variants ...]

A thin wrapper of ``python -m qops.llama.eval`` (same arguments; see its --help). Writes
``quality_gpu.md/.csv`` (or ``quality_cpu.*``) to ``--out``. On a GPU the default is ~300k tokens
in windows of 1024; on a CPU 1024 tokens in windows of 256.
"""

from __future__ import annotations

from qops.llama.eval import main

if __name__ == "__main__":
    main()
