"""The one table of model and layer shapes that the benchmarks (and tools/) time: real Llama-family
configurations and their layers under tensor parallelism (as vLLM's ``weight_shapes.py``).

Run the benchmarks from the repository root as modules (``python -m bench.bench_w8a8_gemm``), so
that ``bench.shapes`` and ``cutlass_kernels`` import without path edits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    """A Llama-family decoder's shape (what the kernels see of it)."""

    name: str  # key in MODELS
    label: str  # short name used in benchmark rows, e.g. "7B"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float = 10000.0
    max_positions: int = 4096
    tie_embeddings: bool = False
    norm_eps: float = 1e-5

    def linear_layers(self, tp: int = 1) -> list[tuple[str, int, int]]:
        """``(layer, N, K)`` of the four GEMMs of a decoder layer on one of ``tp`` ranks: fused
        qkv and gate_up column-parallel (N split), o and down row-parallel (K split); KV heads are
        split too (replicated where there are fewer than ranks). Layer names read like "7B.qkv",
        or "70B-tp8.qkv" under tensor parallelism."""
        heads, kv = self.heads // tp, max(1, self.kv_heads // tp)
        tag = self.label if tp == 1 else f"{self.label}-tp{tp}"
        return [
            (f"{tag}.qkv", (heads + 2 * kv) * self.head_dim, self.hidden),
            (f"{tag}.o", self.hidden, heads * self.head_dim),
            (f"{tag}.gate_up", 2 * self.intermediate // tp, self.hidden),
            (f"{tag}.down", self.hidden, self.intermediate // tp),
        ]

    def hf_config(self) -> dict:
        """Keyword arguments of ``transformers.LlamaConfig`` for a random-weight model of this shape."""
        return dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings,
        )


MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("llama2-7b", "7B", 4096, 11008, 32, 32, 32, 128, 32000),
        Model("llama3-8b", "8B", 4096, 14336, 32, 32, 8, 128, 128256, rope_theta=500000.0, max_positions=8192),
        Model("llama2-13b", "13B", 5120, 13824, 40, 40, 40, 128, 32000),
        Model("llama2-70b", "70B", 8192, 28672, 80, 64, 8, 128, 32000),
        Model(
            "smollm2",
            "SmolLM2",
            576,
            1536,
            30,
            9,
            3,
            64,
            49152,
            rope_theta=100000.0,
            max_positions=8192,
            tie_embeddings=True,
        ),
        Model("tiny", "tiny", 128, 256, 2, 4, 2, 64, 512),
    )
}

# The GEMM benchmark's layers: Llama-2-7B, Llama-3-8B, and Llama-2-70B with tensor parallelism 8.
GEMM_LAYERS: list[tuple[str, int, int]] = (
    MODELS["llama2-7b"].linear_layers() + MODELS["llama3-8b"].linear_layers() + MODELS["llama2-70b"].linear_layers(tp=8)
)

# The norm / activation benchmark's (hidden, intermediate) sizes.
NORM_ACT_MODELS = {
    name: (MODELS[name].hidden, MODELS[name].intermediate)
    for name in ("llama2-7b", "llama3-8b", "llama2-70b", "smollm2")
}

# The decode attention benchmark's head configurations: (HQ, HKV, D).
ATTENTION_MODELS = {
    "llama3-8b-gqa": (MODELS["llama3-8b"].heads, MODELS["llama3-8b"].kv_heads, MODELS["llama3-8b"].head_dim),
    "llama2-7b-mha": (MODELS["llama2-7b"].heads, MODELS["llama2-7b"].kv_heads, MODELS["llama2-7b"].head_dim),
    "smollm2-135m": (MODELS["smollm2"].heads, MODELS["smollm2"].kv_heads, MODELS["smollm2"].head_dim),
}
