"""w8a8_gemm: the reference against float64 math, the kernel generator, then every generated CUDA
kernel against the reference.

The CUDA kernels do the reference's float32 operations in the same order, so they must agree
within one rounding of the output dtype (a fused multiply-add may round once less); most elements
are bit-identical, and the tests check that too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import qops
from cutlass_kernels import w8a8_configs as table
from qops.testing import needs_w8a8_gemm, needs_w8a8_gemm_sm80, poison_cuda_allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the generator runs from here

HALF = [torch.float16, torch.bfloat16]
_MANT = {torch.float16: 10, torch.bfloat16: 7}
_MIN_EXP = {torch.float16: -14, torch.bfloat16: -126}


# ---- float64 re-derivation of the contract ------------------------------------------------------
def ref64(a, b, a_scale, b_scale, bias=None):
    """``(a @ b.T) * a_scale * b_scale + bias`` in float64, and the magnitude of its terms."""
    prod = (a.double() @ b.double().T) * a_scale.double().reshape(-1, 1) * b_scale.double().reshape(1, -1)
    if bias is None:
        return prod, prod.abs()
    return prod + bias.double(), prod.abs() + bias.double().abs()


def assert_within_one_rounding(d, ref, scale, dtype):
    """|d - ref| <= one ulp of ``dtype`` at ref, plus float32 rounding of the terms (``scale``)."""
    assert d.dtype == dtype and d.shape == ref.shape
    exp = torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** _MIN_EXP[dtype])))
    tol = torch.exp2(exp - _MANT[dtype]) + scale * 2.0**-22
    err = (d.double() - ref).abs()
    bad = ~(err <= tol)  # NaN fails
    assert not bad.any(), (
        f"{int(bad.sum())} of {d.numel()} elements off, first at {bad.nonzero()[0].tolist()}: "
        f"got {d[tuple(bad.nonzero()[0])].item()}, expected {ref[tuple(bad.nonzero()[0])].item()}"
    )


def make_inputs(m, n, k, *, device="cpu", per_token=True, per_channel=True, bias=False, dtype=torch.float16):
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device)
    # Scales as quantization produces them: amax / 127 of activations / weights of unit size.
    sa = (torch.rand(m if per_token else 1, device=device) + 0.5) * (3.0 / 127)
    sb = (torch.rand(n if per_channel else 1, device=device) + 0.5) * (0.05 / 127)
    bz = (torch.randn(n, device=device) * 2).to(dtype) if bias else None
    return a, b, sa, sb, bz


# ---- the reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (3, 48, 32), (17, 208, 272), (130, 64, 1024)])
@pytest.mark.parametrize("scales", ["tensor", "token_channel", "token_tensor", "tensor_channel"])
def test_reference_matches_float64(m, n, k, scales, dtype):
    a, b, sa, sb, bias = make_inputs(
        m, n, k, per_token=scales.startswith("token"), per_channel=scales.endswith("channel"), bias=k > 100, dtype=dtype
    )
    d = qops.w8a8_gemm(a, b, sa, sb, dtype, bias)
    assert d.shape == (m, n) and d.dtype == dtype
    assert_within_one_rounding(d, *ref64(a, b, sa, sb, bias), dtype)


def test_reference_is_exact_in_int32_and_saturates_nothing():
    # K * 128 * 128 just below 2^31: every product at the int8 extremes.
    k = 131056
    a = torch.full((2, k), -128, dtype=torch.int8)
    b = torch.full((16, k), -128, dtype=torch.int8)
    b[1] = 127
    one = torch.ones(1)
    d = qops.w8a8_gemm(a, b, one * 2.0**-20, one, torch.float16)
    # acc = 16384 * k = 2^31 - 2^18 is exact in int32 and float32; * 2^-20 = 2047.75, which
    # rounds to 2048 in fp16 (spacing 1 below 2048).
    assert d[0, 0].item() == 2048.0
    torch.testing.assert_close(d, ref64(a, b, one * 2.0**-20, one)[0].to(torch.float16), rtol=0, atol=0)


def test_reference_zero_sizes_and_bias_only():
    b = torch.randint(-128, 128, (32, 16), dtype=torch.int8)
    assert qops.w8a8_gemm(
        torch.empty(0, 16, dtype=torch.int8), b, torch.ones(1), torch.ones(32), torch.bfloat16
    ).shape == (0, 32)
    bias = torch.randn(32).half()
    d = qops.w8a8_gemm(
        torch.empty(3, 0, dtype=torch.int8),
        torch.empty(32, 0, dtype=torch.int8),
        torch.ones(3),
        torch.ones(32),
        torch.float16,
        bias,
    )
    assert torch.equal(d, bias.expand(3, 32))


def _bad_calls(device):
    a, b, sa, sb, _ = make_inputs(4, 32, 64, device=device)
    h = torch.float16
    return [
        ((a.float(), b, sa, sb, h), TypeError, "a must be int8"),
        ((a, b[:, :48], sa, sb, h), ValueError, "b must be \\[N, K\\] with K = 64"),
        ((a[:, :56], b[:, :56], sa, sb, h), ValueError, "K and N must be multiples of 16"),
        ((a, b[:24], sa, sb[:24], h), ValueError, "K and N must be multiples of 16"),
        ((a, b, sa[:3], sb, h), ValueError, "a_scale must hold 1 or M = 4"),
        ((a, b, sa, sb[:5], h), ValueError, "b_scale must hold 1 or N = 32"),
        ((a, b, sa.double(), sb, h), TypeError, "a_scale must be float32"),
        ((a, b, sa, sb, torch.float32), TypeError, "out_dtype must be float16 or bfloat16"),
        (
            (a, b, sa, sb, h, torch.zeros(32, device=device, dtype=torch.bfloat16)),
            TypeError,
            "bias must have the output dtype",
        ),
        ((a, b, sa, sb, h, torch.zeros(16, device=device, dtype=h)), ValueError, "bias must be \\[N\\]"),
        ((a[0], b, sa, sb, h), ValueError, "a must be 2-D"),
    ]


N_BAD_CALLS = len(_bad_calls("cpu"))


@pytest.mark.parametrize("i", range(N_BAD_CALLS))
def test_reference_errors_name_the_argument(i):
    args, exc, msg = _bad_calls("cpu")[i]
    with pytest.raises(exc, match=f"qops.w8a8_gemm: {msg}"):
        qops.w8a8_gemm(*args)


def test_reference_checks_the_gemv_options():
    """The CPU reference takes and ignores the GEMV's launch options (GemvTuning), but checks their
    form as the CUDA glue does (which also checks the shape against the built ones)."""
    a, b, sa, sb, _ = make_inputs(4, 32, 64)
    d = qops.w8a8_gemm(a, b, sa, sb, torch.float16)
    for shape in (None, *table.gemv_launch_shapes()):
        for early in (None, 0, 1, 2):
            tuning = qops.GemvTuning(shape=shape, early_batches=early)
            assert torch.equal(qops.w8a8_gemm(a, b, sa, sb, torch.float16, tuning=tuning), d)
    with pytest.raises(
        ValueError, match=re.escape("qops.w8a8_gemm: gemv_shape must be (rows, warps, chunks) or empty, got [8, 4]")
    ):
        qops.w8a8_gemm(a, b, sa, sb, torch.float16, tuning=qops.GemvTuning(shape=(8, 4)))
    for bad in (3, -2):
        with pytest.raises(
            ValueError,
            match=re.escape(f"qops.w8a8_gemm: gemv_early must be -1 (the GEMV's choice), 0, 1 or 2, got {bad}"),
        ):
            qops.w8a8_gemm(a, b, sa, sb, torch.float16, tuning=qops.GemvTuning(early_batches=bad))


def test_opcheck_cpu():
    a, b, sa, sb, bias = make_inputs(5, 48, 32, bias=True)
    torch.library.opcheck(torch.ops.qops.w8a8_gemm.default, (a, b, sa, sb, torch.float16, bias))
    torch.library.opcheck(
        torch.ops.qops.w8a8_gemm.default, (a, b, sa, sb, torch.float16, bias), {"overlap_prologue": True}
    )
    torch.library.opcheck(
        torch.ops.qops.w8a8_gemm.default,
        (a, b, sa, sb, torch.float16, bias),
        {"gemv_shape": list(table.gemv_launch_shapes()[0]), "gemv_early": 1},
    )


# ---- the kernel table and the generator (no GPU needed) -----------------------------------------
def test_table_is_consistent():
    table.check_table()
    names = table.config_names()
    for m in (1, 16, 17, 32, 33, 64, 128, 129, 4096, 100000):
        for n in (16, 4096, 16384, 28672):
            pick = table.select_config(m, n, 4096)
            assert pick in names and m <= (table.config_max_m(pick) or m)
    assert table.config_names(17) == [c.name for c in table.CONFIGS]  # the GEMV serves M <= 16
    assert table.config_names(16)[-1] == "gemv" and table.select_config(1, 576, 1536) == "gemv"


def test_tuner_merge_replaces_only_the_timed_buckets():
    from tools import tune_w8a8_gemm as tune

    a, b, c = table.config_names()[:3]
    old = [
        {"layer": "x", "n": 64, "k": 64, "picks": [[16, a], [256, b], [8192, c]]},
        {"layer": "y", "n": 32, "k": 64, "picks": [[8192, c]]},
    ]
    rows = [{"M": m, "N": 64, "K": 64} for m in (193, 256)]  # bucket (192, 256] only
    new = tune.build_table([{**r, "layer": "x", f"{a}_us": 1.0, f"{b}_us": 2.0, f"{c}_us": 3.0} for r in rows], 0.03)
    assert new == [{"layer": "x", "n": 64, "k": 64, "picks": [[256, a]]}]
    merged = tune.merge_tables(new, old, rows)
    assert merged[0]["picks"] == [[16, a], [192, b], [256, a], [8192, c]]
    assert merged[1] == old[1]  # a shape not re-timed is kept
    # re-timing the decode bucket: a prefix
    rows16 = [{"M": m, "N": 64, "K": 64} for m in (1, 16)]
    merged = tune.merge_tables([{"layer": "x", "n": 64, "k": 64, "picks": [[16, c]]}], old, rows16)
    assert merged[0]["picks"] == [[16, c], [256, b], [8192, c]]


def _read(path):
    with open(path) as f:
        return f.read()


def _generate(out, *options):
    """Run the generator as the build does (a module, from the repository root); its files by name."""
    r = subprocess.run(
        [sys.executable, "-m", "cutlass_kernels.gen_w8a8", "--out", str(out), *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return {os.path.basename(p): _read(p) for p in r.stdout.split()}


def test_generator_is_deterministic_and_emits_the_table(tmp_path):
    pytest.importorskip("cutlass_cppgen", reason="nvidia-cutlass is not installed")
    outs = [_generate(tmp_path / d) for d in ("one", "two")]
    assert outs[0] == outs[1], "the generator is not deterministic"
    files = outs[0]
    # one file per kernel of each family, their dispatch tables and the three plain-data headers
    w8a8 = len(table.CONFIGS) * len(table.OUT_DTYPES) * len(table.SCALE_MODES)
    w4a16 = len(table.W4A16_CONFIGS) * len(table.W4A16_DTYPES) * len(table.W4A16_MODES)
    sm80 = len(table.SM80_CONFIGS) * len(table.OUT_DTYPES) * len(table.SCALE_MODES)
    assert len(files) == w8a8 + w4a16 + sm80 + 7
    headers = ("w8a8_select.h", "w8a8_gemv_shapes.h", "w4a16_select.h", "w8a8_sm80_select.h")
    assert {"w8a8_dispatch.cu", "w4a16_dispatch.cu", "w8a8_sm80_dispatch.cu", *headers} <= set(files)
    assert _generate(tmp_path / "headers", "--headers-only") == {n: files[n] for n in headers}
    for cfg in table.W4A16_CONFIGS:
        m, n, k = cfg.cta
        kernels = [t for name, t in files.items() if name.startswith(f"w4a16_{cfg.name}")]
        assert len(kernels) == len(table.W4A16_DTYPES) * len(table.W4A16_MODES)
        for text in kernels:
            assert f"cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>" in text
            # the shuffled weight layout, through qops' copy of CUTLASS's reordering atom
            assert "qops::w4a16_sm90::compute_memory_reordering_atom<" in text
            assert "cutlass::compute_memory_reordering_atom" not in text
    for name in table.config_names(family="w4a16"):
        assert f'"{name}"' in files["w4a16_dispatch.cu"]
    for cfg in table.CONFIGS:
        m, n, k = cfg.cta
        cm, cn, ck = cfg.cluster
        for name, text in files.items():
            if cfg.name in name and name.startswith("w8a8_"):
                # The emitted CTA tile and cluster are the table's (not the cluster's tile).
                assert f"cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>" in text
                assert f"cute::Shape<cute::_{cm},cute::_{cn},cute::_{ck}>" in text
                assert "ElementD, StrideD, 8" in text  # 16-byte output alignment
                scalar = "Sm90ScalarBroadcast" in text
                assert scalar == name.endswith("_tensor.cu"), name
    dispatch = files["w8a8_dispatch.cu"]
    for name in table.config_names():
        assert f'"{name}"' in dispatch
    everything = "".join(files.values())
    assert "#include <torch" not in everything and "ATen" not in everything  # torch-free kernels


def test_sm80_kernels_and_dispatch_are_the_table(tmp_path):
    """The arch-80 rows (SM80_CONFIGS): one CUTLASS 2.x kernel per config x dtype x scale mode with
    the table's tile and stages and the traced epilogue's tree, and a dispatch table whose config
    names, order and (config, dtype, mode) -> kernel entries are the table's."""
    pytest.importorskip("cutlass_cppgen", reason="nvidia-cutlass is not installed")
    files = _generate(tmp_path / "gen")
    dtypes = {"float16": ("cutlass::half_t", "kFloat16"), "bfloat16": ("cutlass::bfloat16_t", "kBFloat16")}
    modes = {"tensor": "kPerTensor", "token_channel": "kPerTokenPerChannel"}
    want_entries = []
    for ci, cfg in enumerate(table.SM80_CONFIGS):
        assert cfg.arch == 80 and cfg.family == "w8a8_sm80" and cfg.name.endswith("_sm80")
        m, n, k = cfg.cta
        for dtype, (element, enum) in dtypes.items():
            for mode, mode_enum in modes.items():
                function = f"w8a8_{cfg.name}_{dtype}_{mode}"
                text = files[f"w8a8_sm80_{cfg.name}_{dtype}_{mode}.cu"]
                assert f"cutlass::gemm::GemmShape<{m}, {n}, {k}>" in text
                assert f"cutlass::gemm::GemmShape<{m // 2}, {n // 2}, {k}>" in text  # 2x2 warps
                assert f"GemmIdentityThreadblockSwizzle<1>,\n    {cfg.stages}," in text
                assert "cutlass::arch::Sm80" in text and "cutlass::epilogue::threadblock::Sm80EVT<" in text
                assert "Sm90" not in text and "sm_90" not in text
                assert ("VisitorScalarBroadcast" in text) == (mode == "tensor")
                assert ("VisitorColBroadcast" in text) == (mode == "token_channel")
                # the output store and the bias are in the output dtype, the scales float32
                assert f"VisitorAuxStore<\n    OutputTileThreadMap, {element}," in text
                assert f"static_cast<{element} const*>(p.bias)" in text and f"static_cast<{element}*>(p.d)" in text
                assert f"cudaError_t {function}(const Problem& p" in text
                want_entries.append((ci, enum, mode_enum, function))
    dispatch = files["w8a8_sm80_dispatch.cu"]
    names = re.search(r"kConfigNames\[\] = \{(.*?)\};", dispatch, re.S).group(1)
    assert re.findall(r'"([^"]+)"', names) == table.config_names(family="w8a8_sm80")
    assert f"int num_configs() {{ return {len(table.SM80_CONFIGS)}; }}" in dispatch
    entries = re.findall(
        r"\{(\d+), OutDtype::(\w+), ScaleMode::(\w+), &kernels::(\w+)\}", dispatch.split("kKernels[]")[1]
    )
    assert [(int(c), d, mo, f) for c, d, mo, f in entries] == want_entries
    for *_, function in want_entries:  # declared before the table
        assert f"cudaError_t {function}(const Problem&, const LaunchOptions&, int, cudaStream_t, size_t*);" in dispatch
    # the sm_90a files do not change with the sm_80 rows: no sm_80 kernel in their dispatch
    assert "sm80" not in files["w8a8_dispatch.cu"]


def test_generated_selection_matches_the_table(tmp_path):
    """The generated C++ select_config (host-only header) picks what w8a8_configs.select_config
    picks: tuned shapes at every M bucket edge and off-table shapes, at several SM counts."""
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    _generate(tmp_path / "gen", "--headers-only")  # w8a8_select.h: plain data, no CUTLASS needed
    ms = sorted(
        {1, 2, 15, 16, 17, 63, 64, 65, 100, 1000, 5000, 8192, 8193, 20000}
        | {m + d for picks in table.TUNED.values() for m, _ in picks for d in (-1, 0, 1)}
    )
    shapes = sorted(
        set(table.TUNED)
        | {(4096, 4096), (576, 1536), (1280, 8192), (28672, 4096), (100, 64), (16384, 2048), (2048, 16384)}
    )
    problems = [(m, n, k, sms) for (n, k) in shapes for m in ms for sms in (132, 114, 108, 78)]
    main_cc = tmp_path / "main.cc"
    main_cc.write_text(
        '#include <cstdio>\n#include "w8a8_select.h"\n#include "w4a16_select.h"\n#include "w8a8_sm80_select.h"\n'
        "int main() {\n  int m, n, k, s;\n"
        '  while (std::scanf("%d %d %d %d", &m, &n, &k, &s) == 4)\n'
        '    std::printf("%d %d %d\\n", qops::w8a8_sm90::select::select_config(m, n, k, s),\n'
        "                qops::w4a16_sm90::select::select_config(m, n, k, s),\n"
        "                qops::w8a8_sm80::select::select_config(m, n, k, s));\n}\n"
    )
    exe = tmp_path / "select"
    r = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-I", str(tmp_path / "gen"), str(main_cc), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [str(exe)],
        input="".join(f"{m} {n} {k} {s}\n" for m, n, k, s in problems),
        capture_output=True,
        text=True,
        check=True,
    )
    names = table.config_names()
    names4 = table.config_names(family="w4a16")
    names80 = table.config_names(family="w8a8_sm80")
    triples = [line.split() for line in r.stdout.splitlines()]
    got = [(names[int(a)], names4[int(b)], names80[int(c)]) for a, b, c in triples]
    want = [
        (
            table.select_config(m, n, k, s),
            table.select_config(m, n, k, s, family="w4a16"),
            table.select_config(m, n, k, s, family="w8a8_sm80"),
        )
        for m, n, k, s in problems
    ]
    assert len(got) == len(problems)
    bad = [(p, g, w) for p, g, w in zip(problems, got, want) if g != w]
    assert not bad, bad[:10]
    assert table.TUNED, "the tuned table is empty: the check above tested the rules only"
    assert any(table.tuned_config(m, n, k, s) for m, n, k, s in problems)


# ---- CUDA ---------------------------------------------------------------------------------------
def run_and_check(a, b, sa, sb, dtype, bias=None, **kw):
    poison_cuda_allocator()
    d = qops.w8a8_gemm(a, b, sa, sb, dtype, bias, **kw)
    torch.cuda.synchronize()
    ref = qops.gemm._w8a8_gemm_ref(a, b, sa, sb, dtype, bias)  # the contract, on the GPU
    assert_within_one_rounding(d, *ref64(a, b, sa, sb, bias), dtype)
    assert_within_one_rounding(d, ref.double(), ref64(a, b, sa, sb, bias)[1], dtype)
    identical = (d == ref).double().mean().item()
    assert identical >= 0.99, f"only {identical:.4f} of the elements equal the reference"
    return d


# decode_split: 20 N tiles of K = 8192 at M = 5, which the stream-K configs split over the SMs.
_KERNEL_SHAPES = {
    "small": (133, 208, 272),
    "multi_k": (300, 1040, 4112),
    "decode_split": (5, 1280, 8192),
    "decode_small": (16, 48, 272),
}
# Every config at every shape it serves (the hand-written GEMV: M <= 16 only).
_CONFIG_SHAPES = [
    pytest.param(c, shape, id=f"{c}-{sid}")
    for c in table.config_names()
    for sid, shape in _KERNEL_SHAPES.items()
    if (table.config_max_m(c) or shape[0]) >= shape[0]
]


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mode", table.SCALE_MODES)
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("config,shape", _CONFIG_SHAPES)
def test_every_generated_kernel(config, shape, dtype, mode, bias):
    needs_w8a8_gemm()
    m, n, k = shape
    per = mode == "token_channel"
    a, b, sa, sb, bz = make_inputs(m, n, k, device="cuda", per_token=per, per_channel=per, bias=bias, dtype=dtype)
    run_and_check(a, b, sa, sb, dtype, bz, config=config)


# The sm_80 family, forced by name (on the H100 through the driver's compilation of its compute_80
# PTX): every kernel at shapes with partial tiles in M and N, K tails of a stage (272 = 4.25 x 64),
# many K stages, a single row and the smallest problem.
_SM80_SHAPES = {
    "small": (133, 208, 272),
    "multi_k": (300, 1040, 4112),
    "decode": (5, 1280, 8192),
    "one_row": (1, 48, 16),
    "tiny": (16, 16, 16),
}
_SM80_NAMES = [c.name for c in table.SM80_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mode", table.SCALE_MODES)
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", list(_SM80_SHAPES.values()), ids=list(_SM80_SHAPES))
@pytest.mark.parametrize("config", _SM80_NAMES)
def test_every_sm80_kernel(config, shape, dtype, mode, bias):
    needs_w8a8_gemm_sm80(config)
    m, n, k = shape
    per = mode == "token_channel"
    a, b, sa, sb, bz = make_inputs(m, n, k, device="cuda", per_token=per, per_channel=per, bias=bias, dtype=dtype)
    run_and_check(a, b, sa, sb, dtype, bz, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", _SM80_NAMES)
def test_sm80_strided_operands_mixed_scales_and_unaligned_bias(config):
    needs_w8a8_gemm_sm80(config)
    a, b, sa, sb, _ = make_inputs(70, 96, 160, device="cuda")
    wide_a = torch.randint(-128, 128, (70, 192), dtype=torch.int8, device="cuda")
    wide_b = torch.randint(-128, 128, (96, 224), dtype=torch.int8, device="cuda")
    bias = torch.randn(97, device="cuda").half()[1:]  # starts at an odd element: copied by the glue
    run_and_check(wide_a[:, 16:176], wide_b[:, 32:192], sa, sb, torch.float16, bias, config=config)
    run_and_check(a, b, sa[:1], sb, torch.float16, config=config)  # per-tensor x per-channel
    run_and_check(a, b, sa, sb[:1], torch.bfloat16, config=config)  # per-token x per-tensor


@pytest.mark.gpu
def test_sm80_int8_extremes_accumulate_exactly():
    needs_w8a8_gemm_sm80(_SM80_NAMES[0])
    k = 131056
    a = torch.full((2, k), -128, dtype=torch.int8, device="cuda")
    b = torch.full((16, k), -128, dtype=torch.int8, device="cuda")
    b[1] = 127
    one = torch.ones(1, device="cuda")
    for config in _SM80_NAMES:  # the saturating int8 MMA never saturates below K = 131071
        d = qops.w8a8_gemm(a, b, one * 2.0**-20, one, torch.float16, config=config)
        assert torch.equal(d.cpu(), qops.w8a8_gemm(a.cpu(), b.cpu(), one.cpu() * 2.0**-20, one.cpu(), torch.float16))


@pytest.mark.gpu
def test_sm80_cuda_graph_replay():
    needs_w8a8_gemm_sm80(_SM80_NAMES[-1])
    a, b, sa, sb, bias = make_inputs(200, 272, 320, device="cuda", bias=True)
    config = _SM80_NAMES[-1]
    want = qops.w8a8_gemm(a, b, sa, sb, torch.float16, bias, config=config)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qops.w8a8_gemm(a, b, sa, sb, torch.float16, bias, config=config)
    a.copy_(torch.randint(-128, 128, a.shape, dtype=torch.int8, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, want)
    assert torch.equal(out, qops.w8a8_gemm(a, b, sa, sb, torch.float16, bias, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (64, 1280, 1024), (65, 6144, 4096), (1000, 4096, 11008)])
def test_sm80_auto_on_ampere_and_ada(m, n, k):
    """config="auto" on a GPU of compute capability 8.x takes the sm_80 family (and refuses a
    forced sm_90a config clearly)."""
    needs_w8a8_gemm_sm80(_SM80_NAMES[0])
    if torch.cuda.get_device_capability()[0] != 8:
        pytest.skip("auto takes the sm_80 family on compute capability 8.x only")
    a, b, sa, sb, bias = make_inputs(m, n, k, device="cuda", bias=True, dtype=torch.bfloat16)
    run_and_check(a, b, sa, sb, torch.bfloat16, bias)
    with pytest.raises(NotImplementedError, match="runs kernels built for sm_90a"):
        qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, config=table.CONFIGS[0].name)


# The decode GEMV at every launch shape it has (GemvTuning.shape = rows of N per CTA, warps per
# CTA, K chunks per load batch: w8a8_configs.GEMV_SHAPES, built as kGemvShapes), for M of one row
# group and of two: rows that leave a partial last CTA (N = 48 with 16 rows), K tails that are not
# a whole 64-byte chunk, more K slices than chunks (idle warps).
_GEMV_PROBLEMS = [(1, 48, 16), (3, 208, 272), (8, 1040, 4112), (9, 80, 1040), (16, 1296, 8208)]
_GEMV_SHAPES = table.gemv_launch_shapes()  # w8a8_configs.GEMV_SHAPES as (rows, warps, chunks)


def test_gemv_launch_shapes_are_the_generated_header(tmp_path):
    """The shape list the GEMV tests and the benchmark force is the table's, which the generator
    emits as the kernels' kGemvShapes (w8a8_gemv_shapes.h), in the same order; the list is not
    empty (which would silently skip the parametrizations below) and holds no duplicates."""
    assert len(_GEMV_SHAPES) >= 2 and (8, 4, 4) in _GEMV_SHAPES
    assert len(set(_GEMV_SHAPES)) == len(_GEMV_SHAPES)
    for rows, warps, chunks in _GEMV_SHAPES:
        assert rows in (8, 16) and warps in (4, 8) and chunks in (2, 4, 8), (rows, warps, chunks)
    header = _generate(tmp_path, "--headers-only")["w8a8_gemv_shapes.h"]
    body = header[header.index("kGemvShapes[]") :]
    emitted = [tuple(map(int, t)) for t in re.findall(r"\{(\d+),\s*(\d+),\s*(\d+)\}", body)]
    assert emitted == _GEMV_SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("launch", _GEMV_SHAPES, ids=[f"r{r}w{w}c{c}" for r, w, c in _GEMV_SHAPES])
@pytest.mark.parametrize("problem", _GEMV_PROBLEMS, ids=[f"{m}x{n}x{k}" for m, n, k in _GEMV_PROBLEMS])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_gemv_every_launch_shape(problem, launch, dtype):
    needs_w8a8_gemm()
    m, n, k = problem
    i = _GEMV_PROBLEMS.index(problem) + _GEMV_SHAPES.index(launch)
    per, bias = i % 3 != 0, i % 2 == 0  # both scale modes, with and without bias, across problems
    a, b, sa, sb, bz = make_inputs(m, n, k, device="cuda", per_token=per, per_channel=per, bias=bias, dtype=dtype)
    d = run_and_check(a, b, sa, sb, dtype, bz, config="gemv", tuning=qops.GemvTuning(shape=launch))
    # exact int32 sums and the reference's float32 steps, each rounded: the reference's bits
    assert torch.equal(d, qops.gemm._w8a8_gemm_ref(a, b, sa, sb, dtype, bz))
    # the builds that request weight batches before the PDL wait (overlap_prologue): its own
    # choice, then 0, 1 and 2 batches forced (clamped to what the build has): the same bits
    for early in (None, 0, 1, 2):
        poison_cuda_allocator()
        tuning = qops.GemvTuning(shape=launch, early_batches=early)
        assert torch.equal(
            qops.w8a8_gemm(a, b, sa, sb, dtype, bz, config="gemv", overlap_prologue=True, tuning=tuning), d
        ), early


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_gemv_own_shape_at_multi_wave_layers(m, dtype):
    """The GEMV's own shape choice, which counts waves from the occupancy API where N > 4096
    (csrc/gemm/w8a8_gemv.cu gemv_shape), on layers whose grids take more than one wave: 70B-tp8
    down (N = 8192, K = 3584; 8 chunks at M = 16 on an H100) and N = 8208 with K = 2064 (a tail
    that is not a whole 64-byte chunk), where the same holds. Under overlap_prologue the choice
    counts waves again (at M = 16 on an H100, 70B-tp8 down takes the 16-row build with an early
    batch): the same bits. (No tuning: the GEMV's own launch shape and early batches.)"""
    needs_w8a8_gemm()
    for n, k in [(8192, 3584), (8208, 2064)]:
        a, b, sa, sb, bz = make_inputs(m, n, k, device="cuda", per_token=True, per_channel=True, bias=True, dtype=dtype)
        d = run_and_check(a, b, sa, sb, dtype, bz, config="gemv")
        assert torch.equal(d, qops.gemm._w8a8_gemm_ref(a, b, sa, sb, dtype, bz))
        poison_cuda_allocator()
        assert torch.equal(qops.w8a8_gemm(a, b, sa, sb, dtype, bz, config="gemv", overlap_prologue=True), d)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", _GEMV_SHAPES, ids=[f"r{r}w{w}c{c}" for r, w, c in _GEMV_SHAPES])
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_gemv_bias_at_odd_element(launch, dtype):
    """The GEMV's M > 8 builds (M = 9 here) stage each output pair's bias as one 4-byte copy when
    the bias is 4-byte aligned; a bias slice that starts at an odd element is read element by
    element instead. Both give the reference's bits."""
    needs_w8a8_gemm()
    m, n, k = 9, 208, 272
    a, b, sa, sb, _ = make_inputs(m, n, k, device="cuda", dtype=dtype)
    bias = (torch.randn(n + 1, device="cuda") * 2).to(dtype)[1:]
    assert bias.data_ptr() % 4 == 2
    d = run_and_check(a, b, sa, sb, dtype, bias, config="gemv", tuning=qops.GemvTuning(shape=launch))
    assert torch.equal(d, qops.gemm._w8a8_gemm_ref(a, b, sa, sb, dtype, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 16])
@pytest.mark.parametrize(
    "launch", [None, ((8, 4, 4), 2), ((16, 8, 4), 1)], ids=["own", "r8w4c4_early2", "r16w8c4_early1"]
)
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no_pdl"])
def test_gemv_reads_what_the_previous_kernel_wrote(pdl, overlap, launch, m):
    """Programmatic dependent launch lets the GEMV launch before the previous kernel ends: it must
    still read the activations and scales that kernel writes (eager and in a CUDA graph), also
    when it requests weight batches before the wait (overlap_prologue: the producers do not
    write the weights). `launch`: the own choice (at N = K = 4096 on an H100: 8 chunks per batch
    and an early batch at M = 4; under the promise at M = 16, the 16-row build with one), or a
    forced shape with as many early batches as its build has: the 8-row, 4-warp, 4-chunk shape
    (2 at M = 4, 1 at M = 16) and the 16-row, 8-warp, 4-chunk shape (1)."""
    needs_w8a8_gemm()
    tuning = None if launch is None else qops.GemvTuning(shape=launch[0], early_batches=launch[1])
    n, k = 4096, 4096
    a_buf = torch.zeros(m, k, dtype=torch.int8, device="cuda")
    sa_buf = torch.zeros(m, device="cuda")
    _, b, _, sb, _ = make_inputs(m, n, k, device="cuda")
    srcs = [make_inputs(m, 16, k, device="cuda")[0:3:2] for _ in range(4)]  # (a, a_scale) pairs

    def chain():
        outs = []
        for a, sa in srcs:
            a_buf.copy_(a)  # the producers, right before the GEMV
            sa_buf.copy_(sa)
            outs.append(
                qops.w8a8_gemm(
                    a_buf,
                    b,
                    sa_buf,
                    sb,
                    torch.bfloat16,
                    config="gemv",
                    overlap_prologue=overlap,
                    enable_pdl=pdl,
                    tuning=tuning,
                )
            )
        return outs

    want = [qops.gemm._w8a8_gemm_ref(a, b, sa, sb, torch.bfloat16) for a, sa in srcs]
    for got, ref in zip(chain(), want):
        assert torch.equal(got, ref)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        outs = chain()
    for o in outs:
        o.fill_(float("nan"))
    a_buf.zero_()
    g.replay()
    torch.cuda.synchronize()
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref)


@pytest.mark.gpu
def test_gemv_errors():
    needs_w8a8_gemm()
    a, b, sa, sb, _ = make_inputs(17, 32, 64, device="cuda")
    with pytest.raises(ValueError, match="qops.w8a8_gemm: config 'gemv' serves M <= 16, got M = 17"):
        qops.w8a8_gemm(a, b, sa, sb, torch.float16, config="gemv")
    built = "".join(f" ({r}, {w}, {c})" for r, w, c in _GEMV_SHAPES)
    for bad in ((12, 4, 4), (16,), (16, 4, 2), (8, 4), (8, 4, 2), (8, 4, 4, 4)):
        want = (
            f"qops.w8a8_gemm: gemv_shape must be (rows, warps, chunks), one of{built}; got [{', '.join(map(str, bad))}]"
        )
        with pytest.raises(ValueError, match=re.escape(want)):
            qops.w8a8_gemm(a[:4], b, sa[:4], sb, torch.float16, config="gemv", tuning=qops.GemvTuning(shape=bad))
    for bad in (3, -2, 12):
        with pytest.raises(
            ValueError,
            match=re.escape(f"qops.w8a8_gemm: gemv_early must be -1 (the GEMV's choice), 0, 1 or 2, got {bad}"),
        ):
            qops.w8a8_gemm(
                a[:4],
                b,
                sa[:4],
                sb,
                torch.float16,
                config="gemv",
                overlap_prologue=True,
                tuning=qops.GemvTuning(early_batches=bad),
            )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 4096, 4096),
        (3, 576, 1536),
        (16, 28672, 4096),
        (17, 1536, 576),
        (64, 192, 576),
        (129, 6144, 4096),
        (1025, 1024, 1024),
        (4097, 1040, 528),
    ],
)
def test_auto_selection_at_awkward_sizes(m, n, k):
    needs_w8a8_gemm()
    a, b, sa, sb, bias = make_inputs(m, n, k, device="cuda", bias=m % 2 == 1, dtype=torch.bfloat16)
    run_and_check(a, b, sa, sb, torch.bfloat16, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", ["token_tensor", "tensor_channel", "column_vector"])
def test_mixed_scale_shapes(mixed):
    needs_w8a8_gemm()
    m, n, k = 37, 96, 256
    a, b, sa, sb, _ = make_inputs(
        m, n, k, device="cuda", per_token=mixed != "tensor_channel", per_channel=mixed != "token_tensor"
    )
    if mixed == "column_vector":
        sa, sb = sa[:, None], sb[None, :]  # [M, 1] and [1, N] are accepted and flattened
    run_and_check(a, b, sa, sb, torch.float16)


@pytest.mark.gpu
def test_strided_operands_and_scales():
    needs_w8a8_gemm()
    m, n, k = 50, 64, 320
    a_wide = torch.randint(-128, 128, (m, k + 48), dtype=torch.int8, device="cuda")
    b_wide = torch.randint(-128, 128, (n, k + 16), dtype=torch.int8, device="cuda")
    a, b = a_wide[:, 32 : 32 + k], b_wide[:, :k]  # row strides 368 and 336, 16-byte aligned starts
    sa = torch.rand(2 * m, device="cuda")[::2] * 0.02  # non-contiguous: copied by the op
    sb = torch.rand(n + 1, device="cuda")[1:] * 0.001  # contiguous, 4-byte offset: copied too
    d = run_and_check(a, b, sa, sb, torch.float16)
    assert torch.equal(
        d, qops.w8a8_gemm(a.contiguous(), b.contiguous(), sa.contiguous(), sb.contiguous(), torch.float16)
    )


@pytest.mark.gpu
def test_int8_extremes_accumulate_exactly():
    needs_w8a8_gemm()
    k = 131056
    a = torch.full((16, k), -128, dtype=torch.int8, device="cuda")
    b = torch.full((32, k), -128, dtype=torch.int8, device="cuda")
    b[1::2] = 127
    a[1::2, ::2] = 127
    sa = torch.full((16,), 2.0**-20, device="cuda")
    sb = torch.ones(32, device="cuda")
    run_and_check(a, b, sa, sb, torch.float16)


@pytest.mark.gpu
def test_zero_sizes_and_zero_k_on_cuda():
    needs_w8a8_gemm()
    b = torch.randint(-128, 128, (32, 16), dtype=torch.int8, device="cuda")
    d = qops.w8a8_gemm(
        torch.empty(0, 16, dtype=torch.int8, device="cuda"),
        b,
        torch.ones(1, device="cuda"),
        torch.ones(32, device="cuda"),
        torch.float16,
    )
    assert d.shape == (0, 32) and d.is_cuda
    bias = torch.randn(32, device="cuda").half()
    poison_cuda_allocator()
    d = qops.w8a8_gemm(
        torch.empty(3, 0, dtype=torch.int8, device="cuda"),
        torch.empty(32, 0, dtype=torch.int8, device="cuda"),
        torch.ones(3, device="cuda"),
        torch.ones(32, device="cuda"),
        torch.float16,
        bias,
    )
    assert torch.equal(d, bias.expand(3, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["auto", "gemv"] + [c.name for c in table.CONFIGS if c.stream_k])
def test_inputs_unchanged_and_cuda_graph_replay(config):
    """Also: a stream-K config's workspace, allocated during capture, is re-initialized per replay."""
    needs_w8a8_gemm()
    m = 16 if config == "gemv" else 17
    a, b, sa, sb, bias = make_inputs(m, 4096, 4096, device="cuda", bias=True, dtype=torch.bfloat16)
    saved = [t.clone() for t in (a, b, sa, sb, bias)]
    expect = qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, bias, config=config)
    for t, s in zip((a, b, sa, sb, bias), saved):
        assert torch.equal(t, s)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, bias, config=config)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, bias, config=config)
    a.copy_(torch.randint(-128, 128, a.shape, dtype=torch.int8, device="cuda"))
    sa.mul_(2)  # scales are read on the device at replay time
    for _ in range(2):  # a second replay must not see the first one's partial sums
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, expect)
        run_and_check(a, b, sa, sb, torch.bfloat16, bias, config=config)
        assert torch.equal(out, qops.w8a8_gemm(a, b, sa, sb, torch.bfloat16, bias, config=config))


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(N_BAD_CALLS))
def test_cuda_errors_name_the_argument(i):
    needs_w8a8_gemm()
    args, exc, msg = _bad_calls("cuda")[i]
    with pytest.raises(exc, match=f"qops.w8a8_gemm: {msg}"):
        qops.w8a8_gemm(*args)


@pytest.mark.gpu
def test_cuda_layout_and_config_errors():
    needs_w8a8_gemm()
    a, b, sa, sb, _ = make_inputs(4, 32, 64, device="cuda")
    h = torch.float16
    wide = torch.zeros(4, 80, dtype=torch.int8, device="cuda")
    cases = [
        ((wide[:, 1:65], b, sa, sb, h), {}, "a must start at a 16-byte aligned address"),
        ((a.t().contiguous().t(), b, sa, sb, h), {}, "a must be row-major"),
        ((a[:1].expand(4, 64), b, sa, sb, h), {}, "a's rows must not overlap"),
        (
            (torch.zeros(4, 72, dtype=torch.int8, device="cuda")[:, :64], b, sa, sb, h),
            {},
            "a's rows must not overlap and their stride must be a multiple of 16 elements, "
            "got shape \\[4, 64\\] and strides \\[72, 1\\]",
        ),
        (
            (a, b, sa, sb, h),
            {"config": "nope"},
            "unknown config 'nope'; this build has: auto, " + table.config_names()[0],
        ),
        ((a.cpu(), b, sa, sb, h), {}, "a must be a CUDA tensor"),
        ((a, b, sa.cpu(), sb, h), {}, "a_scale must be on cuda"),
    ]
    for args, kw, msg in cases:
        with pytest.raises((ValueError, TypeError, RuntimeError), match=f"qops.w8a8_gemm: {msg}"):
            qops.w8a8_gemm(*args, **kw)


@pytest.mark.gpu
def test_opcheck_cuda():
    needs_w8a8_gemm()
    a, b, sa, sb, bias = make_inputs(33, 128, 256, device="cuda", bias=True)
    torch.library.opcheck(torch.ops.qops.w8a8_gemm.default, (a, b, sa, sb, torch.float16, bias))
    torch.library.opcheck(
        torch.ops.qops.w8a8_gemm.default, (a, b, sa[:1], sb[:1], torch.float16), {"config": table.CONFIGS[-1].name}
    )
    torch.library.opcheck(
        torch.ops.qops.w8a8_gemm.default, (a[:5], b, sa[:5], sb, torch.float16), {"overlap_prologue": True}
    )
