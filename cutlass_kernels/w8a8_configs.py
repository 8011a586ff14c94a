"""The w8a8 GEMM kernel table: the one place that says which int8 GEMMs are generated and which
one ``qops.w8a8_gemm`` picks for a problem.

Pure data (no CUTLASS import), so the tests and benchmarks can read it too. ``gen_w8a8.py`` turns
every (tile config x output dtype x scale mode) into one generated kernel, and ``SELECTION`` into
the generated ``select_config`` of the dispatch table. Every tile config is four kernels of about
a minute of one core each to compile (nvcc 13): add one only with a sweep that shows shapes it
wins.

Tile configs are named by the CTA tile (M x N x K), the cluster shape and the kernel schedule;
the name is the ``config=`` value that ``qops.w8a8_gemm`` accepts.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    cta: tuple[int, int, int]  # CTA tile M, N, K (K in int8 elements: 128 or 256 = 128 B or 256 B)
    cluster: tuple[int, int, int]
    schedule: str  # "ws" (one consumer warp group), "pingpong" or "cooperative" (persistent)
    # Stream-K tile scheduler (cooperative only): CTAs split the K loop of the output tiles so
    # that all SMs work when there are fewer tiles than SMs (decode at small N), and the last CTA
    # of a tile reduces the partial int32 accumulators (exact) from a workspace.
    stream_k: bool = False

    @property
    def name(self) -> str:
        m, n, k = self.cta
        cm, cn, ck = self.cluster
        return f"{m}x{n}x{k}_c{cm}x{cn}x{ck}_{self.schedule}" + ("_streamk" if self.stream_k else "")


# Output dtypes (torch names) and epilogues. "tensor": a_scale [1] and b_scale [1] read as scalars; "token_channel": a_scale [M] broadcast along rows, b_scale [N] along
# columns. Both add an optional bias [N] (a null pointer reads as zeros).
OUT_DTYPES = ("float16", "bfloat16")
SCALE_MODES = ("tensor", "token_channel")

CONFIGS: tuple[TileConfig, ...] = (
    # Decode (M <= 64): weight streaming; the 1x8 cluster multicasts A (the activations) over
    # eight N tiles. M=1, N=K=4096: 10.0 us, 1.7 TB/s with the weights rotating through L2.
    TileConfig((64, 64, 256), (1, 8, 1), "ws"),
    # Decode with N >= 8192 (gate_up, 70B down and o): fewer, wider tiles.
    TileConfig((64, 128, 256), (1, 4, 1), "ws"),
    # Medium M (batched decode, short prefill): 128-row tiles, two consumer warp groups.
    TileConfig((128, 64, 128), (1, 2, 1), "cooperative"),
    # Prefill (large M): 1.26-1.41 POP/s at M = 4096 on the Llama layers.
    TileConfig((128, 128, 128), (2, 1, 1), "pingpong"),
    # Candidates under evaluation (bench/bench_w8a8_gemm.py --sweep).
    TileConfig((128, 64, 256), (1, 1, 1), "cooperative", stream_k=True),
    TileConfig((128, 128, 128), (1, 1, 1), "cooperative", stream_k=True),
    TileConfig((128, 256, 128), (2, 1, 1), "cooperative"),
    TileConfig((256, 128, 128), (1, 2, 1), "cooperative"),
)

# Auto selection, first match wins: (largest M, largest N, config name); None: no bound. The
# last rule must match every problem. From `bench/bench_w8a8_gemm.py --sweep` on the H100 at the
# Llama-3-8B and Llama-2-70B (TP 8) layer shapes (docs/w8a8_gemm.md):
# - M <= 64 (decode) is weight-bandwidth bound: one 64-row tile; 64x128 tiles win from N = 8192.
# - 64 < M <= 256: the 128x128 tiles leave SMs idle until N is large; smaller tiles win below.
# - Larger M is compute bound: ping-pong 128x128.
SELECTION: tuple[tuple[int | None, int | None, str], ...] = (
    (64, 8191, "64x64x256_c1x8x1_ws"),
    (64, None, "64x128x256_c1x4x1_ws"),
    (128, 2048, "64x64x256_c1x8x1_ws"),
    (128, 4096, "64x128x256_c1x4x1_ws"),
    (128, None, "128x64x128_c1x2x1_cooperative"),
    (256, 2048, "64x64x256_c1x8x1_ws"),
    (256, 4096, "128x64x128_c1x2x1_cooperative"),
    (None, None, "128x128x128_c2x1x1_pingpong"),
)


def config_names() -> list[str]:
    return [c.name for c in CONFIGS]


def select_config(m: int, n: int, k: int) -> str:
    """The config ``config="auto"`` picks (the generated C++ ``select_config`` is this function)."""
    for max_m, max_n, name in SELECTION:
        if (max_m is None or m <= max_m) and (max_n is None or n <= max_n):
            return name
    raise AssertionError("the last SELECTION rule must match every problem")


def check_table() -> None:
    names = config_names()
    assert len(set(names)) == len(names), "duplicate tile configs"
    assert SELECTION and SELECTION[-1][:2] == (None, None), "the last rule must match every problem"
    for _, _, name in SELECTION:
        assert name in names, f"SELECTION names an unknown config {name}"
    for c in CONFIGS:
        assert c.schedule in ("ws", "pingpong", "cooperative"), c
        assert c.schedule != "cooperative" or c.cta[0] >= 128, f"{c.name}: cooperative needs CTA M >= 128"
        assert c.cta[2] % 64 == 0 and c.cluster[2] == 1, c
        assert not c.stream_k or c.schedule == "cooperative", f"{c.name}: stream-K needs the cooperative schedule"
