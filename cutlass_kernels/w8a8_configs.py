"""The GEMM kernel table: the one place that says which GEMMs are generated and which one an op
picks for a problem, for each family: ``w8a8`` (int8 x int8, dequantizing epilogue,
``qops.w8a8_gemm``, sm_90a), ``w8a8_sm80`` (the same op on sm_80/86/89: CUTLASS 2.x kernels with
the same traced epilogue, rows with ``arch=80``) and ``w4a16`` (int4 weights with group scales x
fp16/bf16 activations, the Hopper mixed-input GEMM of CUTLASS example 55, ``qops.w4a16_gemm``).

Pure data (no CUTLASS import), so the tests and benchmarks can read it too. ``gen_w8a8.py`` turns
every (tile config x output dtype x scale mode) into one generated kernel, and ``SELECTION`` into
the generated ``select_config`` of the dispatch table. Every tile config is four kernels of about
a minute of one core each to compile (nvcc 13): add one only with a sweep that shows shapes it
wins.

Tile configs are named by the CTA tile (M x N x K), the cluster shape and the kernel schedule;
the name is the ``config=`` value that the family's op accepts. Hand-written kernels in csrc/
join the table as ``HAND_WRITTEN`` configs: same Problem, same dispatch, same tuner. Each family
is a row list (``CONFIGS``, ``HAND_WRITTEN``, ``SELECTION``) in ``FAMILIES``; every function takes
``family=`` (default ``"w8a8"``).

In the w4a16 family the GEMM runs transposed, as in example 55: the int4 weight [N, K] is operand
A (it must be the register-sourced wgmma operand to be converted), so a tile's M is the weights'
N and its N the tokens (M of the op); K tiles of 64 serve groups of 64 and 128.
"""

from __future__ import annotations

import json
import os
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
    family: str = "w8a8"
    # Relative throughput per output element when every SM is busy (from the sweep), used only to
    # choose between a rule's candidates by their wave quantization (select_config).
    rate: float = 1.0
    # The architecture the kernel is generated for: 90 (CUTLASS 3.x, sm_90a: TMA, wgmma, clusters)
    # or 80 (CUTLASS 2.x multistage mainloop, cp.async + mma.sync; sm_80 and later). Arch-80 rows
    # have schedule "multistage", cluster (1, 1, 1), `stages` shared-memory stages and 2x2 warps.
    arch: int = 90
    stages: int = 0

    @property
    def name(self) -> str:
        m, n, k = self.cta
        if self.arch == 80:
            return f"{m}x{n}x{k}_s{self.stages}_sm80"
        cm, cn, ck = self.cluster
        return f"{m}x{n}x{k}_c{cm}x{cn}x{ck}_{self.schedule}" + ("_streamk" if self.stream_k else "")


# Output dtypes (torch names) and epilogues. "tensor": a_scale [1] and b_scale [1] read as scalars;
# "token_channel": a_scale [M] broadcast along rows, b_scale [N] along
# columns. Both add an optional bias [N] (a null pointer reads as zeros).
OUT_DTYPES = ("float16", "bfloat16")
SCALE_MODES = ("tensor", "token_channel")

CONFIGS: tuple[TileConfig, ...] = (
    # Decode (M <= 64): weight streaming; the 1x8 cluster multicasts A (the activations) over
    # eight N tiles. M=1, N=K=4096: 10.2 us, 1.6 TB/s with the weights rotating through L2.
    TileConfig((64, 64, 256), (1, 8, 1), "ws"),
    # Decode with N >= 8192 (gate_up, 70B down and o): fewer, wider tiles.
    TileConfig((64, 128, 256), (1, 4, 1), "ws"),
    # Medium M (batched decode, short prefill): 128-row tiles, two consumer warp groups.
    TileConfig((128, 64, 128), (1, 2, 1), "cooperative"),
    # Prefill with short K or when its smaller tile quantizes better: one warp group's epilogue
    # overlaps the other's MMAs. About 0.93x the 128x256 tile's rate when both fill the GPU.
    TileConfig((128, 128, 128), (2, 1, 1), "pingpong", rate=0.93),
    # Prefill at small N (70B-tp8 qkv, N = 1280: 10 N tiles): stream-K spreads K over the SMs.
    TileConfig((128, 128, 128), (1, 1, 1), "cooperative", stream_k=True, rate=0.7),
    # Stream-K with the large tile, for prefill where the 128x256 tiles fill a fraction of their
    # last wave: e.g. 7B gate_up at M = 300 takes 0.71x the data-parallel tiles' time, 8B down at
    # M = 1100 0.79x, 70B-tp8 qkv at M = 3500-7000 0.87x. Where the waves are full its partial-tile
    # fixup costs more than it saves (8B qkv, M = 1024: 1.27x), which the wave model of the rules
    # does not know, so no rule names it: only the tuned table picks it.
    TileConfig((128, 256, 128), (1, 1, 1), "cooperative", stream_k=True),
    # Prefill (large M and N): 1.3-1.55 POP/s at M >= 1024 on the Llama layers.
    TileConfig((128, 256, 128), (2, 1, 1), "cooperative"),
)


# ---- w8a8 on Ampere and Ada (sm_80, sm_86, sm_89): CUTLASS 2.x kernels, the same traced epilogue ---
# The same op and contract as CONFIGS (family "w8a8_sm80", selected on GPUs of compute capability
# 8.x, or by name with config=). 2x2 warps per CTA (warp tiles of CTA M/2 x N/2), mma.sync
# m16n8k32 int8, a 64-byte K tile per stage; at most 64 KB of shared memory, which sm_86 and
# sm_89 (99 KB per CTA) afford too. Not yet measured on an Ampere or Ada GPU: the rates are
# guesses (relative MMA work per shared-memory byte), there is no tuned table.
def _sm80(m: int, n: int, k: int, stages: int, rate: float) -> TileConfig:
    return TileConfig((m, n, k), (1, 1, 1), "multistage", family="w8a8_sm80", rate=rate, arch=80, stages=stages)


SM80_CONFIGS: tuple[TileConfig, ...] = (
    # Decode and small M: 64-row tiles, twice the CTAs of 128-row ones at a given N.
    _sm80(64, 64, 64, 4, rate=0.6),
    # Medium M or N: half the 128x128 tile's work per CTA, more CTAs to fill the SMs.
    _sm80(128, 64, 64, 4, rate=0.85),
    # Prefill: CUTLASS's default int8 tile on sm_80 (warp tiles of 64x64).
    _sm80(128, 128, 64, 4, rate=1.0),
)


@dataclass(frozen=True)
class HandWritten:
    """A kernel written in csrc/ that the generated dispatch calls like a tile config: `function`
    (declared in `header`) has the generated launchers' signature and serves every output dtype and
    scale mode of problems with m <= `max_m`."""

    name: str
    header: str
    function: str
    max_m: int
    family: str = "w8a8"


HAND_WRITTEN: tuple[HandWritten, ...] = (
    # Decode: split-K GEMV, 8 or 16 rows of N per CTA with K split over its 4 or 8 warps, so
    # that every SM streams weights (csrc/gemm/w8a8_gemv.cu; docs/w8a8_gemm.md).
    HandWritten("gemv", "gemm/w8a8_gemv.h", "qops::w8a8_sm90::gemv", max_m=16),
)


# ---- w4a16 (mixed input: int4 weights x fp16/bf16) ---------------------------------------------
# Output dtype = activation dtype (fp16, bf16); modes: scale-only ("scale") and scale + zero ("zero").
W4A16_DTYPES = ("float16", "bfloat16")
W4A16_MODES = ("scale", "zero")

# Rates: throughput per output element with every SM busy, relative to the 128x256 tile (H100,
# bench_w4a16 --configs ..., M = 4096 on the 7B / 8B / 70B-tp8 layers: 1.19x and 2.98x its time).
W4A16_CONFIGS: tuple[TileConfig, ...] = (
    # Batched decode / short prefill: 32 tokens per tile, so that N / 128 x M / 32 tiles fill the
    # SMs where N / 128 alone does not (N = 4096: 32 row tiles).
    TileConfig((128, 32, 64), (1, 1, 1), "cooperative", family="w4a16", rate=0.335),
    # Medium M.
    TileConfig((128, 128, 64), (1, 1, 1), "cooperative", family="w4a16", rate=0.84),
    # Prefill: the widest token tile; 0.96-1.03x bf16 cuBLAS at M >= 1024 on the 7B / 8B layers.
    TileConfig((128, 256, 64), (1, 1, 1), "cooperative", family="w4a16"),
)

W4A16_HAND_WRITTEN: tuple[HandWritten, ...] = (
    # Decode: the split-K mma.sync GEMV on the same prepacked weights (csrc/gemm/w4a16_gemv.cu).
    HandWritten("gemv", "gemm/w4a16.h", "qops::w4a16::gemv", max_m=16, family="w4a16"),
)


@dataclass(frozen=True)
class GemvShape:
    """A launch shape of the decode GEMV: rows of N per CTA (8 or 16: one or two row groups),
    warps per CTA (each takes a slice of K) and 64-byte K chunks per load batch. Each is a kernel
    instantiation per (M <= 8 or not) x output dtype x early batches (csrc/gemm/w8a8_gemv.cu)."""

    rows: int
    warps: int
    chunks: int


# The built GEMV launch shapes, in build order: the one definition, emitted as kGemvShapes into the
# generated header w8a8_gemv_shapes.h (the tests and sweeps that force every shape read it here).
# gemv_shape in w8a8_gemv.cu picks among the first five by problem size (docs/w8a8_gemm.md);
# (16, 8, 4) is taken only at M > 8 under overlap_prologue, where its early batch fits.
GEMV_SHAPES: tuple[GemvShape, ...] = (
    GemvShape(8, 4, 4),
    GemvShape(8, 8, 4),
    GemvShape(16, 8, 2),
    GemvShape(8, 4, 8),
    GemvShape(8, 8, 8),
    GemvShape(16, 8, 4),
)


def gemv_launch_shapes() -> list[tuple[int, int, int]]:
    """GEMV_SHAPES as (rows, warps, chunks) triples, in build order."""
    return [(s.rows, s.warps, s.chunks) for s in GEMV_SHAPES]


@dataclass(frozen=True)
class Rule:
    """Problems with m <= max_m, n <= max_n and k <= max_k (None: no bound) run `pick`: one config
    name, or a tuple of names to choose from by wave quantization (select_config)."""

    pick: str | tuple[str, ...]
    max_m: int | None = None
    max_n: int | None = None
    max_k: int | None = None


# Auto selection, first match wins; the last rule must match every problem. From
# `bench/bench_w8a8_gemm.py --sweep` on the H100 at the Llama-2-7B, Llama-3-8B and Llama-2-70B (TP 8)
# layer shapes (docs/w8a8_gemm.md):
# - M <= 64 (decode) is weight-bandwidth bound: one 64-row tile; 64x128 tiles win from N = 8192.
# - 64 < M <= 256: the 128x128 tiles leave SMs idle until N is large; smaller tiles win below.
# - Larger M is compute bound: 128x256 tiles, or 128x128 ping-pong where the bigger tile leaves
#   more of the last wave idle (e.g. M = 1024, N = 6144: 192 tiles on 132 SMs) or K is short
#   (the epilogue's share is large); stream-K at small N.
SELECTION: tuple[Rule, ...] = (
    Rule("gemv", max_m=16),
    Rule("64x64x256_c1x8x1_ws", max_m=64, max_n=8191),
    Rule("64x128x256_c1x4x1_ws", max_m=64),
    Rule("64x64x256_c1x8x1_ws", max_m=128, max_n=2048),
    Rule("64x128x256_c1x4x1_ws", max_m=96),
    Rule("64x128x256_c1x4x1_ws", max_m=128, max_n=4096),
    Rule("128x64x128_c1x2x1_cooperative", max_m=128),
    Rule("64x64x256_c1x8x1_ws", max_m=320, max_n=2048),
    Rule("64x128x256_c1x4x1_ws", max_m=192, max_n=4096),
    Rule("128x64x128_c1x2x1_cooperative", max_m=256, max_n=4096),
    Rule("128x128x128_c2x1x1_pingpong", max_m=256),
    Rule("128x64x128_c1x2x1_cooperative", max_m=768, max_n=2048),
    Rule("128x128x128_c1x1x1_cooperative_streamk", max_n=2048),
    Rule("128x128x128_c2x1x1_pingpong", max_k=2048),
    Rule(("128x256x128_c2x1x1_cooperative", "128x128x128_c2x1x1_pingpong", "128x128x128_c1x1x1_cooperative_streamk")),
)

# w4a16: m, n, k are the op's (tokens, weight rows, K). From the same sweep (docs/w4a16_gemm.md):
# the GEMV up to 16 tokens, then the tile whose busiest SM has the least work (wave_cost on the
# transposed problem: tiles of 128 weight rows x 32/128/256 tokens). E.g. M = 64: 32-token tiles
# where N / 128 x 2 tiles fit one wave (4096 x 4096: 19.4 us against 25.2 for 128 tokens), else
# 128; M >= 1024: 256 except where its tiles leave more of a wave idle (8B qkv, M = 1024).
W4A16_SELECTION: tuple[Rule, ...] = (
    Rule("gemv", max_m=16),
    Rule(("128x32x64_c1x1x1_cooperative", "128x128x64_c1x1x1_cooperative", "128x256x64_c1x1x1_cooperative")),
)


# w8a8 on sm_80/86/89: 64-row tiles up to M = 64, then whichever tile leaves its busiest SM the
# least work (wave_cost, with the SM count of the device: 108 on an A100). Untuned (see above).
SM80_SELECTION: tuple[Rule, ...] = (
    Rule("64x64x64_s4_sm80", max_m=64),
    Rule(("128x128x64_s4_sm80", "128x64x64_s4_sm80", "64x64x64_s4_sm80")),
)


@dataclass(frozen=True)
class Family:
    configs: tuple[TileConfig, ...]
    hand_written: tuple[HandWritten, ...]
    selection: tuple[Rule, ...]
    # The GEMM runs transposed (tile M over the op's N, tile N over its M): the wave model swaps m, n.
    transposed: bool = False


DEFAULT_SMS = 132  # H100 SXM

# Measured per-shape choice (tools/tune_w8a8_gemm.py): for the tuned (N, K) on a GPU with the
# tuned SM count, ``[(max_m, config), ...]`` by M bucket; it takes precedence over SELECTION,
# whose rules cover every other problem. M above the last bucket takes the last pick.
TUNED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "w8a8_tuned.json")


def _load_tuned(path: str = TUNED_PATH) -> tuple[int | None, dict[tuple[int, int], tuple[tuple[int, str], ...]]]:
    if not os.path.exists(path):
        return None, {}
    with open(path) as f:
        doc = json.load(f)
    shapes = {(int(s["n"]), int(s["k"])): tuple((int(m), str(c)) for m, c in s["picks"]) for s in doc["shapes"]}
    return int(doc["num_sms"]), shapes


TUNED_SMS, TUNED = _load_tuned()


def tuned_config(m: int, n: int, k: int, num_sms: int) -> str | None:
    """The tuned table's config for this problem, or None where the table does not apply."""
    picks = TUNED.get((n, k)) if num_sms == TUNED_SMS else None
    if not picks:
        return None
    return next((c for max_m, c in picks if m <= max_m), picks[-1][1])


FAMILIES: dict[str, Family] = {
    "w8a8": Family(CONFIGS, HAND_WRITTEN, SELECTION),
    "w4a16": Family(W4A16_CONFIGS, W4A16_HAND_WRITTEN, W4A16_SELECTION, transposed=True),
    "w8a8_sm80": Family(SM80_CONFIGS, (), SM80_SELECTION),
}


def config_names(m: int | None = None, *, family: str = "w8a8") -> list[str]:
    """Every config's name of a family (the generated tile configs, then the hand-written kernels),
    in the dispatch table's order; with `m`, only those that serve problems of m rows."""
    f = FAMILIES[family]
    return [c.name for c in f.configs] + [h.name for h in f.hand_written if m is None or m <= h.max_m]


def config_max_m(name: str, *, family: str = "w8a8") -> int | None:
    """The largest M config `name` serves (None: any)."""
    return next((h.max_m for h in FAMILIES[family].hand_written if h.name == name), None)


def _by_name(family: str = "w8a8") -> dict[str, TileConfig]:
    return {c.name: c for c in FAMILIES[family].configs}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def wave_cost(cfg: TileConfig, m: int, n: int, num_sms: int) -> float:
    """Relative time of a compute-bound problem on `cfg`: the tiles of the busiest SM (tiles, in
    whole clusters, are dealt round-robin to the SMs; stream-K shares them out evenly), each of
    cta_m x cta_n outputs at the config's rate."""
    tiles_m = _round_up(_ceil_div(m, cfg.cta[0]), cfg.cluster[0])
    tiles_n = _round_up(_ceil_div(n, cfg.cta[1]), cfg.cluster[1])
    tiles = tiles_m * tiles_n
    rounds = tiles / num_sms if cfg.stream_k else -(-tiles // num_sms)
    return rounds * cfg.cta[0] * cfg.cta[1] / cfg.rate


def select_config(m: int, n: int, k: int, num_sms: int = DEFAULT_SMS, *, family: str = "w8a8") -> str:
    """The config ``config="auto"`` picks (the generated C++ ``select_config`` is this function)."""
    tuned = tuned_config(m, n, k, num_sms) if family == "w8a8" else None
    if tuned is not None:
        return tuned
    configs = _by_name(family)
    for r in FAMILIES[family].selection:
        if all(b is None or v <= b for v, b in ((m, r.max_m), (n, r.max_n), (k, r.max_k))):
            if isinstance(r.pick, str):
                return r.pick
            wm, wn = (n, m) if FAMILIES[family].transposed else (m, n)
            return min(r.pick, key=lambda name: wave_cost(configs[name], wm, wn, num_sms))  # first on ties
    raise AssertionError("the last SELECTION rule must match every problem")


def check_table() -> None:
    for family in FAMILIES:
        _check_family(family)
    # qops.w8a8_gemm resolves config= over both w8a8 families: one name, one kernel
    both = config_names() + config_names(family="w8a8_sm80")
    assert len(set(both)) == len(both), "a config name is in both w8a8 families"
    assert all(c.arch == 80 for c in SM80_CONFIGS) and all(c.arch == 90 for c in CONFIGS + W4A16_CONFIGS)
    for c in W4A16_CONFIGS:
        assert c.cta[2] == 64 and not c.stream_k, f"{c.name}: w4a16 tiles take K = 64 (groups of 64 and 128)"
    _check_w8a8_extras()


def _check_family(family: str) -> None:
    f = FAMILIES[family]
    assert all(c.family == family for c in f.configs) and all(h.family == family for h in f.hand_written)
    names = config_names(family=family)
    assert len(set(names)) == len(names), f"{family}: duplicate tile configs"
    last = f.selection[-1] if f.selection else None
    assert last and last.max_m is last.max_n is last.max_k is None, "the last rule must match every problem"
    for r in f.selection:
        for name in (r.pick,) if isinstance(r.pick, str) else r.pick:
            assert name in names, f"{family} SELECTION names an unknown config {name}"
            limit = config_max_m(name, family=family)
            assert isinstance(r.pick, str) or limit is None, f"{name} cannot be a wave-quantization candidate"
            assert limit is None or (r.max_m is not None and r.max_m <= limit), (
                f"a rule picks {name} for M beyond its max_m = {limit}"
            )
    for h in f.hand_written:
        assert h.max_m >= 1 and h.header.endswith(".h") and "::" in h.function, h
    for c in f.configs:
        if c.arch == 80:
            assert c.schedule == "multistage" and c.cluster == (1, 1, 1) and not c.stream_k, c
            assert 3 <= c.stages <= 6 and c.cta[2] == 64 and c.cta[0] % 64 == 0 and c.cta[1] % 64 == 0, c
            # 2x2 warps; the mainloop's stages must fit the 99 KB that sm_86 / sm_89 give a CTA
            assert (c.cta[0] + c.cta[1]) * c.cta[2] * c.stages <= 96 * 1024, f"{c.name}: shared memory"
            continue
        assert c.arch == 90, c
        assert c.schedule in ("ws", "pingpong", "cooperative"), c
        assert c.schedule != "cooperative" or c.cta[0] >= 128, f"{c.name}: cooperative needs CTA M >= 128"
        assert c.cta[2] % 64 == 0 and c.cluster[2] == 1, c
        assert not c.stream_k or c.schedule == "cooperative", f"{c.name}: stream-K needs the cooperative schedule"


def _check_w8a8_extras() -> None:
    names = config_names()
    for (n, k), picks in TUNED.items():
        for max_m, name in picks:
            assert name in names, f"{TUNED_PATH}: N={n} K={k} names an unknown config {name}"
            limit = config_max_m(name)
            assert limit is None or max_m <= limit, f"{TUNED_PATH}: N={n} K={k} picks {name} beyond M = {limit}"
        assert [m for m, _ in picks] == sorted({m for m, _ in picks}), f"{TUNED_PATH}: N={n} K={k}: unsorted"
    shapes = gemv_launch_shapes()
    assert shapes and len(set(shapes)) == len(shapes), "GEMV_SHAPES is empty or repeats a shape"
    for r, w, c in shapes:
        assert r in (8, 16) and w in (4, 8) and c in (2, 4, 8), f"GEMV shape {(r, w, c)} has no kernel build"
