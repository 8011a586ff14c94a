#!/usr/bin/env python3
"""Generate the GEMM families of the config table (Hopper, sm_90a): the w8a8 int8 GEMMs with the
CUTLASS Python interface, and the w4a16 mixed-input GEMMs with cutlass_library's emitter.

For every tile config of ``w8a8_configs.CONFIGS`` x output dtype x scale mode, this traces the
dequantizing epilogue ``D = accum * a_scale * b_scale + bias`` into a CUTLASS epilogue visitor tree
(EVT), emits the kernel with ``cutlass_cppgen`` and wraps it in a torch-free launcher (one ``.cu``
each). It then writes ``w8a8_dispatch.cu``, which implements ``csrc/gemm/w8a8_sm90.h``: the config
names, the table's selection rules and the (config, dtype, mode) -> kernel table, in which the
hand-written kernels of ``w8a8_configs.HAND_WRITTEN`` (csrc/) follow the generated ones.

    python -m cutlass_kernels.gen_w8a8 --out DIR [--nvcc-version 13.0] [--headers-only]

(from the repository root) prints the generated files, one per line (CMake reads that list). It
needs no GPU, its output depends only on its inputs, and it rewrites a file only when the content
changes, so a rebuild recompiles only the kernels whose source changed.

The w4a16 family (``w8a8_configs.W4A16_CONFIGS`` x dtype x scale / scale+zero): cutlass_library's
``EmitGemmUniversal3xInstance`` emits the SM90 mixed-input kernel type (int4 weights as operand A
in the shuffled layout, the activations as B, D column-major, i.e. the op's [M, N] row-major
output), each wrapped in a launcher of its ``Arguments``; ``w4a16_dispatch.cu`` implements
``csrc/gemm/w4a16_sm90.h`` with the same selection code as w8a8 and the hand-written GEMV last.
``--headers-only`` writes only the table's plain-data headers (``w8a8_gemv_shapes.h``,
``w8a8_select.h``, ``w4a16_select.h``) and does not import
CUTLASS: the portable kernels in csrc/ include them on builds without the sm_90a kernels too.
"""

from __future__ import annotations

import argparse
import os
import re

from cutlass_kernels import w8a8_configs as table
from cutlass_kernels.cutlass_env import TARGET_CC, cutlass_cppgen_for_sm90

# Example extents for tracing; the emitted code does not depend on them.
_M, _N = 512, 512


def _epilogue(accum, a_scale, b_scale, bias):
    # Traced by cutlass_cppgen: float32 math in this order, rounded once to the output dtype. The
    # names become the EVT node names (AScale, BScale, Bias) that _evt_arguments fills in.
    D = accum * a_scale * b_scale + bias
    return D


def _trace(cutlass, out_dtype, scale_mode, cc=TARGET_CC):
    from cutlass_cppgen import DataType, LayoutType

    def t(element, shape):
        return cutlass.Tensor(element=element, shape=shape, layout_tag=LayoutType.RowMajor)

    scale_shapes = {"tensor": ((1, 1), (1, 1)), "token_channel": ((_M, 1), (1, _N))}[scale_mode]
    examples = {
        "accum": t(DataType.f32, (_M, _N)),
        "a_scale": t(DataType.f32, scale_shapes[0]),
        "b_scale": t(DataType.f32, scale_shapes[1]),
        "bias": t(out_dtype, (1, _N)),
        "D": t(out_dtype, (_M, _N)),
    }
    return cutlass.epilogue.trace(_epilogue, examples, cc=cc)


_SCHEDULES = {  # name -> (kernel schedule, epilogue schedule); EVT needs a TMA epilogue
    "ws": ("TmaWarpSpecialized", "TmaWarpSpecialized"),
    "pingpong": ("TmaWarpSpecializedPingpong", "TmaWarpSpecialized"),
    "cooperative": ("TmaWarpSpecializedCooperative", "TmaWarpSpecializedCooperative"),
}

_DTYPES = {  # torch name -> (DataType name, C++ element, API enum)
    "float16": ("f16", "cutlass::half_t", "OutDtype::kFloat16"),
    "bfloat16": ("bf16", "cutlass::bfloat16_t", "OutDtype::kBFloat16"),
}
_MODES = {"tensor": "ScaleMode::kPerTensor", "token_channel": "ScaleMode::kPerTokenPerChannel"}


def _emit_kernel(cutlass, cfg: table.TileConfig, out_dtype: str, scale_mode: str) -> tuple[str, str]:
    """The CUTLASS kernel definition (C++ type declarations) for one table entry, and its type name."""
    from cutlass_cppgen import DataType, EpilogueScheduleType, KernelScheduleType, LayoutType, TileSchedulerType

    element_d = getattr(DataType, _DTYPES[out_dtype][0])
    plan = cutlass.op.Gemm(
        element_A=DataType.s8,
        element_B=DataType.s8,
        element_C=DataType.void,
        element_D=element_d,
        element_accumulator=DataType.s32,
        layout_A=LayoutType.RowMajor,
        layout_B=LayoutType.ColumnMajor,
        layout_C=LayoutType.RowMajor,
        cc=TARGET_CC,
        kernel_cc=TARGET_CC,
    )
    plan.epilogue_visitor = _trace(cutlass, element_d, scale_mode)
    kernel_schedule, epilogue_schedule = _SCHEDULES[cfg.schedule]
    # For SM90, cutlass_cppgen's threadblock_shape is the cluster's tile: it emits
    # threadblock_shape / cluster_shape as the CTA tile.
    td = plan.tile_descriptions()[0].clone_and_update(
        {
            "threadblock_shape": [c * k for c, k in zip(cfg.cta, cfg.cluster)],
            "cluster_shape": list(cfg.cluster),
            "stages": None,  # as many as fit beside the epilogue's shared memory
            "kernel_schedule": getattr(KernelScheduleType, kernel_schedule),
            "epilogue_schedule": getattr(EpilogueScheduleType, epilogue_schedule),
            "tile_scheduler": TileSchedulerType.StreamK if cfg.stream_k else TileSchedulerType.Default,
        }
    )
    # The C/D alignment follows operand C's: ask for 16 bytes explicitly (8 fp16/bf16 elements).
    operation = plan.construct(td, alignment_A=16, alignment_B=16, alignment_C=8)
    source = operation.rt_module.emit()
    m, n, k = cfg.cta
    expect = (
        f"cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>",
        "ElementD, StrideD, 8",
        f"cutlass::gemm::Kernel{kernel_schedule}",
        "cutlass::gemm::StreamKScheduler" if cfg.stream_k else "",
    )
    for s in expect:
        if s not in source:
            raise RuntimeError(f"{cfg.name}: emitted kernel lacks `{s}` (cutlass_cppgen changed?)")
    return source, operation.procedural_name()


# The EVT node kinds of each CUTLASS generation: (namespace, tree node, {leaf or compute type: kind}).
_EVT_DIALECTS = {
    90: (
        "cutlass::epilogue::fusion::",
        "Sm90EVT",
        {
            "Sm90AccFetch": "acc",
            "Sm90ScalarBroadcast": "scalar",
            "Sm90RowBroadcast": "row",
            "Sm90ColBroadcast": "col",
            "Sm90Compute": "compute",
        },
    ),
    # CUTLASS 2.x (sm80): the output D is a node too (an auxiliary store at the tree's root).
    80: (
        "cutlass::epilogue::threadblock::",
        "Sm80EVT",
        {
            "VisitorAccFetch": "acc",
            "VisitorScalarBroadcast": "scalar",
            "VisitorRowBroadcast": "row",
            "VisitorColBroadcast": "col",
            "VisitorCompute": "compute",
            "VisitorAuxStore": "store",
        },
    ),
}


def _evt_arguments(source: str, bias_type: str, cc: int = TARGET_CC, out_type: str = "") -> str:
    """The C++ initializer of the emitted EVT's arguments, derived from the emitted tree.

    An ``Sm90EVT<Op, Children...>`` (``Sm80EVT``) takes ``{children..., op}``; leaves are filled
    from the launcher's ``Problem p`` by their traced names (sm80: and the store ``D``, whose
    element type is ``out_type``).
    """
    namespace, tree, kinds = _EVT_DIALECTS[cc]
    ns = re.escape(namespace)
    nodes = {}
    for name, body in re.findall(rf"using (\w+) = {ns}{tree}<([^;]*)>;", source):
        _op, *children = [s.strip() for s in body.split(",")]
        nodes[name] = ("evt", children)
    for name, kind in re.findall(rf"using (\w+) = {ns}(\w+)", source):
        if kind in kinds:
            nodes[name] = (kinds[kind], [])
    pointers = {"AScale": "p.a_scale", "BScale": "p.b_scale", "Bias": f"static_cast<{bias_type} const*>(p.bias)"}
    stores = {"D": f"static_cast<{out_type}*>(p.d), {{p.ldd, {{}}, {{}}}}"}  # ptr_aux, dAux (M, N, L)

    def init(name: str) -> str:
        kind, children = nodes[name]
        if kind == "evt":
            return "{" + ", ".join([init(c) for c in children] + ["{}"]) + "}"
        if kind in ("compute", "acc"):
            return "{}"
        if kind == "scalar":  # {scalars[1], scalar_ptrs[1]}: read on the device
            return "{{}, {" + pointers[name] + "}}"
        if kind == "store":
            return "{" + stores[name] + "}"
        return "{" + pointers[name] + "}"  # row / column broadcast: {ptr} (nullptr reads zeros)

    def init_root(name: str) -> str:
        # sm80: the root is the tree node over the store, {child, store-args}
        kind, children = nodes[name]
        if cc == 80:
            store = _op_of(source, name, namespace, tree)
            if kind != "evt" or nodes.get(store, ("",))[0] != "store" or len(children) != 1:
                raise RuntimeError(f"the emitted sm80 epilogue does not end in a store: {name}")
            return "{" + init(children[0]) + ", " + init(store) + "}"
        return init(name)

    roots = {n for n, (k, _) in nodes.items() if k == "evt"} - {
        c for _, (k, ch) in nodes.items() if k == "evt" for c in ch
    }
    if len(roots) != 1:
        raise RuntimeError(f"cannot find the EVT root in the emitted epilogue: {sorted(roots)}")
    leaves = sorted(n for n, (k, _) in nodes.items() if k in ("scalar", "row", "col"))
    if leaves != sorted(pointers):
        raise RuntimeError(f"unexpected EVT inputs {leaves}")
    return init_root(roots.pop())


def _op_of(source: str, name: str, namespace: str, tree: str) -> str:
    """The node op (first template argument) of tree node `name`."""
    body = re.search(rf"using {name} = {re.escape(namespace)}{tree}<([^;]*)>;", source)
    assert body is not None
    return body.group(1).split(",")[0].strip()


def _emit_kernel_sm80(cutlass, cfg: table.TileConfig, out_dtype: str, scale_mode: str) -> tuple[str, str]:
    """The CUTLASS 2.x kernel definition of one arch-80 table entry (a multistage sm80 GEMM with
    the epilogue traced for cc 80: an ``Sm80EVT`` tree), and its type name."""
    from cutlass_cppgen import DataType, LayoutType

    element_d = getattr(DataType, _DTYPES[out_dtype][0])
    # No C operand is read (the tree has no C node, ptr_C is null), but CUTLASS 2.x's default
    # epilogue that DefaultGemmWithVisitor derives its thread map from needs a real element type.
    plan = cutlass.op.Gemm(
        element_A=DataType.s8,
        element_B=DataType.s8,
        element_C=element_d,
        element_D=element_d,
        element_accumulator=DataType.s32,
        layout_A=LayoutType.RowMajor,
        layout_B=LayoutType.ColumnMajor,
        layout_C=LayoutType.RowMajor,
        cc=80,
        kernel_cc=80,
    )
    plan.epilogue_visitor = _trace(cutlass, element_d, scale_mode, cc=80)
    td = plan.tile_descriptions()[0].clone_and_update(
        {"threadblock_shape": list(cfg.cta), "warp_count": [2, 2, 1], "stages": cfg.stages}
    )
    operation = plan.construct(td, alignment_A=16, alignment_B=16, alignment_C=8)
    source = operation.rt_module.emit()
    m, n, k = cfg.cta
    expect = (
        f"cutlass::gemm::GemmShape<{m}, {n}, {k}>,\n    cutlass::gemm::GemmShape<{m // 2}, {n // 2}, {k}>",
        "cutlass::gemm::GemmShape<16, 8, 32>",  # mma.sync m16n8k32 (int8)
        "cutlass::arch::Sm80",
        "int8_t, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, 16",
        "int8_t, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, 16",
        f"{_DTYPES[out_dtype][1]}, cutlass::layout::RowMajor, 8",  # 16-byte output vectors
        f"GemmIdentityThreadblockSwizzle<1>,\n    {cfg.stages},",
        "cutlass::gemm::kernel::DefaultGemmWithVisitor<",
    )
    for e in expect:
        if e not in source:
            raise RuntimeError(f"{cfg.name}: emitted kernel lacks `{e}` (cutlass_cppgen changed?)")
    return source, operation.procedural_name()


_SM80_INCLUDES = (
    "cutlass/cutlass.h",
    "cutlass/numeric_types.h",
    "cutlass/arch/arch.h",
    "cutlass/arch/mma.h",
    "cutlass/layout/matrix.h",
    "cutlass/gemm/device/gemm_universal_adapter.h",
    "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h",
    "cutlass/epilogue/threadblock/fusion/visitors.hpp",
)

_SM80_KERNEL_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// w8a8 GEMM for sm_80 and later (CUTLASS 2.x), tile config {config}, output {out_dtype}, scales
// {scale_mode}.
#include <cuda_runtime_api.h>

{includes}

#include "gemm/w8a8_sm80.h"

namespace {namespace} {{
// ---- emitted by the CUTLASS Python interface (cutlass_cppgen) ----------------------------------
{kernel}
// ------------------------------------------------------------------------------------------------
using DeviceKernel = cutlass::gemm::device::GemmUniversalAdapter<{operation}_type>;
}}  // namespace {namespace}

namespace qops {{
namespace w8a8_sm80 {{
namespace kernels {{

// With `workspace_bytes` set: stores the workspace this problem needs (none: one CTA per output
// tile, no split-K) and launches nothing. Neither the launch options nor the SM count apply.
cudaError_t {function}(const Problem& p, const LaunchOptions&, int, cudaStream_t stream,
                       size_t* workspace_bytes) {{
  using namespace {namespace};
  typename {root}::Arguments epilogue{evt_arguments};
  typename DeviceKernel::Arguments args(cutlass::gemm::GemmUniversalMode::kGemm,
                                        cutlass::gemm::GemmCoord{{p.m, p.n, p.k}}, /*batch_count=*/1,
                                        epilogue, p.a, p.b, /*ptr_C=*/nullptr, /*ptr_D=*/nullptr,
                                        int64_t{{0}}, int64_t{{0}}, int64_t{{0}}, int64_t{{0}},
                                        p.lda, p.ldb, int64_t{{0}}, int64_t{{0}});
{run_adapter}
}}  // namespace kernels
}}  // namespace w8a8_sm80
}}  // namespace qops
"""


def generate_sm80(cutlass) -> dict[str, str]:
    """File name -> content of the w8a8_sm80 family's kernels and dispatch table."""
    files: dict[str, str] = {}
    includes = "\n".join(f'#include "{h}"' for h in _SM80_INCLUDES)
    # CUTLASS 2.x's device adapter runs with operator()(args, workspace, stream).
    run_adapter = _RUN_ADAPTER.replace("gemm.run(args, p.workspace, stream)", "gemm(args, p.workspace, stream)")
    declarations, entries = [], []
    for ci, cfg in enumerate(table.SM80_CONFIGS):
        for out_dtype in table.OUT_DTYPES:
            for scale_mode in table.SCALE_MODES:
                tag = re.sub(r"\W", "_", f"{cfg.name}_{out_dtype}_{scale_mode}")
                function = f"w8a8_{tag}"  # the config name ends in _sm80: w8a8_<...>_sm80_<dtype>_<mode>
                kernel, operation = _emit_kernel_sm80(cutlass, cfg, out_dtype, scale_mode)
                root = re.findall(r"using (\w+) = cutlass::epilogue::threadblock::Sm80EVT<", kernel)[-1]
                files[f"w8a8_sm80_{tag}.cu"] = _SM80_KERNEL_TEMPLATE.format(
                    config=cfg.name,
                    out_dtype=out_dtype,
                    scale_mode=scale_mode,
                    includes=includes,
                    namespace=f"qops_gen_{function}",
                    kernel=kernel.strip("\n"),
                    operation=operation,
                    function=function,
                    root=root,
                    evt_arguments=_evt_arguments(kernel, _DTYPES[out_dtype][1], cc=80, out_type=_DTYPES[out_dtype][1]),
                    run_adapter=run_adapter,
                )
                declaration, entry = _table_row(ci, function, out_dtype, scale_mode)
                declarations.append(declaration)
                entries.append(entry)
    files["w8a8_sm80_dispatch.cu"] = _dispatch_file(
        "w8a8_sm80", "w8a8_sm80_select.h", declarations, entries, table.config_names(family="w8a8_sm80")
    )
    return files


# The end of every generated launcher: the CUTLASS device adapter's check, workspace query and run
# (the w8a8 and w4a16 templates fill in `args` and `p` before it).
_RUN_ADAPTER = """\
  DeviceKernel gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
  const size_t need = DeviceKernel::get_workspace_size(args);
  if (workspace_bytes != nullptr) {
    *workspace_bytes = need;
    return cudaSuccess;
  }
  if (need > p.workspace_bytes || (need != 0 && p.workspace == nullptr)) return cudaErrorInvalidValue;
  if (gemm.run(args, p.workspace, stream) != cutlass::Status::kSuccess) {
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}
"""

_KERNEL_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// w8a8 GEMM, tile config {config}, output {out_dtype}, scales {scale_mode}.
#include <cuda_runtime_api.h>

{includes}
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

#include "gemm/w8a8_sm90.h"

namespace {namespace} {{
// ---- emitted by the CUTLASS Python interface (cutlass_cppgen) ----------------------------------
{kernel}
// ------------------------------------------------------------------------------------------------
using DeviceKernel = cutlass::gemm::device::GemmUniversalAdapter<{operation}_type>;
}}  // namespace {namespace}

namespace qops {{
namespace w8a8_sm90 {{
namespace kernels {{

// With `workspace_bytes` set: stores the workspace this problem needs and launches nothing. The
// launch options are the hand-written kernels' (gemm/w8a8_sm90.h LaunchOptions): none applies here.
cudaError_t {function}(const Problem& p, const LaunchOptions&, int sm_count, cudaStream_t stream,
                       size_t* workspace_bytes) {{
  using namespace {namespace};
  using GemmKernel = DeviceKernel::GemmKernel;
  auto stride_a = cutlass::make_cute_packed_stride(GemmKernel::StrideA{{}}, cute::make_shape(p.m, p.k, 1));
  auto stride_b = cutlass::make_cute_packed_stride(GemmKernel::StrideB{{}}, cute::make_shape(p.n, p.k, 1));
  auto stride_d = cutlass::make_cute_packed_stride(StrideD{{}}, cute::make_shape(p.m, p.n, 1));
  cute::get<0>(stride_a) = p.lda;
  cute::get<0>(stride_b) = p.ldb;
  cute::get<0>(stride_d) = p.ldd;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.sm_count = sm_count;
  typename DeviceKernel::Arguments args{{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {{p.m, p.n, p.k, 1}},
      {{p.a, stride_a, p.b, stride_b}},
      {{{evt_arguments},
       nullptr, stride_d, static_cast<ElementD*>(p.d), stride_d}},
      hw_info}};
{run_adapter}
}}  // namespace kernels
}}  // namespace w8a8_sm90
}}  // namespace qops
"""

# One family's dispatch file (w8a8_sm90, w8a8_sm80): it implements csrc/gemm/<family>.h.
_DISPATCH_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// Implements csrc/gemm/{family}.h: the config names, the selection rules, the kernel table.
#include <cstdint>
#include <initializer_list>

#include "common/device_cache.h"
#include "gemm/{family}.h"
#include "{select_header}"{hand_written_includes}

namespace qops {{
namespace {family} {{
namespace kernels {{
{declarations}
}}  // namespace kernels

namespace {{

struct Entry {{
  int config;
  OutDtype out_dtype;
  ScaleMode scale_mode;
  LaunchFn launch;
}};

constexpr const char* kConfigNames[] = {{
{names}
}};

constexpr Entry kKernels[] = {{
{entries}
}};

}}  // namespace

int num_configs() {{ return {num_configs}; }}

const char* config_name(int config) {{
  return config >= 0 && config < num_configs() ? kConfigNames[config] : nullptr;
}}

int config_max_m(int config) {{
  switch (config) {{
{max_m_cases}    default: return 0;
  }}
}}

int select_config(int m, int n, int k, int num_sms) {{ return select::select_config(m, n, k, num_sms); }}

namespace {{

cudaError_t find_and_call(const Problem& p, int config, const LaunchOptions& options,
                          cudaStream_t stream, size_t* workspace_bytes) {{
  {arch_comment}
  qops::DeviceProps device;
  if (const cudaError_t err = qops::current_device_props(&device)) return err;
  if ({arch_mismatch}) return cudaErrorNoKernelImageForDevice;
  if (config < 0) config = select_config(p.m, p.n, p.k, device.sms);
  for (const Entry& e : kKernels) {{
    if (e.config == config && e.out_dtype == p.out_dtype && e.scale_mode == p.scale_mode) {{
      return e.launch(p, options, device.sms, stream, workspace_bytes);
    }}
  }}
  return cudaErrorInvalidValue;
}}

}}  // namespace

cudaError_t workspace_size(const Problem& p, int config, size_t* bytes) {{
  *bytes = 0;
  return find_and_call(p, config, LaunchOptions{{}}, nullptr, bytes);
}}

cudaError_t gemm(const Problem& p, int config, const LaunchOptions& options, cudaStream_t stream) {{
  return find_and_call(p, config, options, stream, nullptr);
}}

}}  // namespace {family}
}}  // namespace qops
"""

_ARCH = {  # family -> (comment in find_and_call, the device check that rejects a GPU)
    "w8a8_sm90": (
        "// The persistent kernels size their grid by the SM count; sm_90 is the only architecture these\n"
        "  // kernels are built for.",
        "device.cc_major != 9 || device.cc_minor != 0",
    ),
    "w8a8_sm80": (
        "// Built as sm_80 code and compute_80 PTX: sm_8x GPUs run the former, later ones (the H100) the\n"
        "  // driver's compilation of the latter.",
        "device.cc_major < 8",
    ),
}


def _dispatch_file(family: str, select_header: str, declarations, entries, names, max_m_cases=(), includes=()) -> str:
    comment, mismatch = _ARCH[family]
    return _DISPATCH_TEMPLATE.format(
        family=family,
        select_header=select_header,
        hand_written_includes="".join("\n" + i for i in includes),
        declarations="\n".join(declarations),
        names="\n".join(f'    "{n}",' for n in names),
        entries="\n".join(entries),
        max_m_cases="".join(c + "\n" for c in max_m_cases),
        num_configs=len(names),
        arch_comment=comment,
        arch_mismatch=mismatch,
    )


def _table_row(ci: int, function: str, out_dtype: str, scale_mode: str) -> tuple[str, str]:
    """A generated launcher's declaration and its kernel-table entry."""
    return (
        f"cudaError_t {function}(const Problem&, const LaunchOptions&, int, cudaStream_t, size_t*);",
        f"    {{{ci}, {_DTYPES[out_dtype][2]}, {_MODES[scale_mode]}, &kernels::{function}}},",
    )


_SELECT_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py and
// w8a8_tuned.json: do not edit. The config choice of config="auto" (w8a8_configs.select_config,
// family {family}), host-only C++ so that the tests can compile it and compare it with the table.
#pragma once
#include <cstdint>
#include <initializer_list>

namespace qops {{
namespace {namespace} {{
namespace select {{

// Output tile, cluster, scheduler and relative rate of each config (w8a8_configs.TileConfig).
struct Tile {{
  int m, n, cluster_m, cluster_n;
  bool stream_k;
  double rate;
}};
constexpr Tile kTiles[] = {{
{tiles}
}};

inline int64_t round_up(int64_t x, int64_t k) {{ return (x + k - 1) / k * k; }}

// w8a8_configs.wave_cost / select_config: among `candidates`, the config whose busiest SM has the
// least work (whole clusters of tiles dealt round-robin to the SMs; stream-K shares them out
// evenly); the first one on ties.
inline int fewest_waves(std::initializer_list<int> candidates, int m, int n, int num_sms) {{
  int best = -1;
  double best_cost = 0;
  for (const int c : candidates) {{
    const Tile& t = kTiles[c];
    const int64_t tiles = round_up((m + t.m - 1) / t.m, t.cluster_m) *
                          round_up((n + t.n - 1) / t.n, t.cluster_n);
    const double rounds = t.stream_k ? static_cast<double>(tiles) / num_sms
                                     : static_cast<double>((tiles + num_sms - 1) / num_sms);
    const double cost = rounds * t.m * t.n / t.rate;
    if (best < 0 || cost < best_cost) {{
      best = c;
      best_cost = cost;
    }}
  }}
  return best;
}}

// w8a8_configs.TUNED (cutlass_kernels/w8a8_tuned.json, measured by tools/tune_w8a8_gemm.py):
// per tuned (N, K), the config of each M bucket; -1 where the table does not apply.
struct TunedPick {{
  int max_m, config;
}};
struct TunedShape {{
  int n, k, first, count;  // picks kTunedPicks[first, first + count)
}};
constexpr int kTunedSms = {tuned_sms};
constexpr TunedPick kTunedPicks[] = {{
{tuned_picks}
}};
constexpr TunedShape kTunedShapes[] = {{
{tuned_shapes}
}};

inline int tuned_config(int m, int n, int k, int num_sms) {{
  if (num_sms != kTunedSms) return -1;
  for (const TunedShape& s : kTunedShapes) {{
    if (s.n != n || s.k != k || s.count == 0) continue;
    for (int i = s.first; i < s.first + s.count; ++i) {{
      if (m <= kTunedPicks[i].max_m) return kTunedPicks[i].config;
    }}
    return kTunedPicks[s.first + s.count - 1].config;
  }}
  return -1;
}}

inline int select_config(int m, int n, int k, int num_sms) {{
  (void)m; (void)n; (void)k;
  if (num_sms < 1) num_sms = 1;
  if (const int c = tuned_config(m, n, k, num_sms); c >= 0) return c;
{selection}
}}

}}  // namespace select
}}  // namespace {namespace}
}}  // namespace qops
"""


_GEMV_SHAPES_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// The decode GEMV's launch shapes (w8a8_configs.GEMV_SHAPES): each one a kernel build of
// gemm/w8a8_gemv.cu. Plain data, torch- and CUDA-free.
#pragma once

namespace qops {{
namespace w8a8_sm90 {{

// Rows of N per CTA, warps (K slices) per CTA, 64-byte K chunks each warp loads per batch.
struct GemvShape {{
  int rows_per_cta;
  int warps;
  int chunks;
}};

constexpr GemvShape kGemvShapes[] = {{
{shapes}
}};

}}  // namespace w8a8_sm90
}}  // namespace qops
"""


def _gemv_shapes_code() -> str:
    return "\n".join(f"    {{{r}, {w}, {c}}}," for r, w, c in table.gemv_launch_shapes())


def generate_headers() -> dict[str, str]:
    """File name -> content of the plain-data headers (no CUTLASS needed)."""
    table.check_table()
    return {
        "w8a8_select.h": _SELECT_TEMPLATE.format(
            family="w8a8", namespace="w8a8_sm90", selection=_selection_code(), tiles=_tiles_code(), **_tuned_code()
        ),
        "w8a8_sm80_select.h": _SELECT_TEMPLATE.format(
            family="w8a8_sm80",
            namespace="w8a8_sm80",
            selection=_selection_code("w8a8_sm80"),
            tiles=_tiles_code("w8a8_sm80"),
            tuned_sms=0,
            tuned_picks="    {0, 0},",
            tuned_shapes="    {0, 0, 0, 0},",
        ),
        "w4a16_select.h": _SELECT_TEMPLATE.format(
            family="w4a16",
            namespace="w4a16_sm90",
            selection=_selection_code("w4a16"),
            tiles=_tiles_code("w4a16"),
            tuned_sms=0,
            tuned_picks="    {0, 0},",
            tuned_shapes="    {0, 0, 0, 0},",
        ),
        "w8a8_gemv_shapes.h": _GEMV_SHAPES_TEMPLATE.format(shapes=_gemv_shapes_code()),
    }


def _selection_code(family: str = "w8a8") -> str:
    index = {n: i for i, n in enumerate(table.config_names(family=family))}
    lines = []
    for r in table.FAMILIES[family].selection:
        conds = [f"{v} <= {b}" for v, b in (("m", r.max_m), ("n", r.max_n), ("k", r.max_k)) if b is not None]
        if isinstance(r.pick, str):
            ret = f"return {index[r.pick]};  // {r.pick}"
        else:
            dims = "n, m" if table.FAMILIES[family].transposed else "m, n"
            ret = (
                f"return fewest_waves({{{', '.join(str(index[c]) for c in r.pick)}}}, {dims}, num_sms);"
                f"  // {' | '.join(r.pick)}"
            )
        lines.append(f"  if ({' && '.join(conds)}) {ret}" if conds else f"  {ret}")
    return "\n".join(lines)


def _tuned_code() -> dict[str, str]:
    index = {n: i for i, n in enumerate(table.config_names())}
    picks, shapes = [], []
    for (n, k), ps in table.TUNED.items():
        shapes.append(f"    {{{n}, {k}, {len(picks)}, {len(ps)}}},")
        picks += [f"    {{{m}, {index[c]}}},  // {c}" for m, c in ps]
    # C++ arrays cannot be empty: a sentinel that matches no problem
    return {
        "tuned_sms": table.TUNED_SMS or 0,
        "tuned_picks": "\n".join(picks) or "    {0, 0},",
        "tuned_shapes": "\n".join(shapes) or "    {0, 0, 0, 0},",
    }


def _tiles_code(family: str = "w8a8") -> str:
    return "\n".join(
        f"    {{{c.cta[0]}, {c.cta[1]}, {c.cluster[0]}, {c.cluster[1]}, "
        f"{'true' if c.stream_k else 'false'}, {c.rate!r}}},  // {c.name}"
        for c in table.FAMILIES[family].configs
    )


# ---- w4a16: the mixed-input GEMMs (cutlass_library) ----------------------------------------------
_W4A16_DTYPES = {  # torch name -> (DataType name, C++ element, API enum)
    "float16": ("f16", "cutlass::half_t", "w4a16::Dtype::kFloat16"),
    "bfloat16": ("bf16", "cutlass::bfloat16_t", "w4a16::Dtype::kBFloat16"),
}
_W4A16_REORDER = "qops::w4a16_sm90::compute_memory_reordering_atom"


def _emit_w4a16_kernel(cfg: table.TileConfig, dtype: str, mode: str) -> tuple[str, str]:
    """The emitted kernel type (C++ declarations) of one w4a16 table entry, and its type name."""
    from cutlass_library import library as lib
    from cutlass_library.gemm_operation import EmitGemmUniversal3xInstance, GemmOperation

    wide = getattr(lib.DataType, _W4A16_DTYPES[dtype][0])
    m, n, k = cfg.cta
    math = lib.MathInstruction(
        [64, n, 16], lib.DataType.s4, wide, lib.DataType.f32, lib.OpcodeClass.TensorOp, lib.MathOperation.multiply_add
    )
    warps = [4, 1, 1] if cfg.schedule != "cooperative" else [m // 64, 1, 1]
    tile = lib.TileDescription([m, n, k], 0, warps, math, 90, 90, list(cfg.cluster))
    kernel_schedule, epilogue_schedule = _SCHEDULES[cfg.schedule]
    operation = GemmOperation(
        lib.GemmKind.Universal3x,
        90,
        tile,
        lib.TensorDescription(lib.DataType.s4, lib.LayoutType.RowMajor, 32),  # weights [N, K], K-major
        lib.TensorDescription(wide, lib.LayoutType.ColumnMajor, 8),  # activations [M, K], K-major
        lib.TensorDescription(lib.DataType.void, lib.LayoutType.ColumnMajor, 8),
        lib.DataType.f32,
        lib.EpilogueFunctor3x.LinearCombination,
        lib.SwizzlingFunctor.Identity1,
        lib.TensorDescription(wide, lib.LayoutType.ColumnMajor, 8),  # D^T [N, M] = d [M, N] row-major
        getattr(lib.KernelScheduleType, kernel_schedule),
        getattr(lib.EpilogueScheduleType, epilogue_schedule),
        lib.TileSchedulerType.Default,
        mixed_input_mode=lib.MixedInputMode.ScaleWithZeroPoint if mode == "zero" else lib.MixedInputMode.ScaleOnly,
        mixed_input_shuffle=True,
    )
    source = EmitGemmUniversal3xInstance().emit(operation)
    name = operation.procedural_name()
    expect = (
        f"cute::Shape<cute::_{m}, cute::_{n}, cute::_{k}>",
        "cutlass::compute_memory_reordering_atom<",
        "_LayoutNarrowReordered, 32,",
        "cute::tuple<cutlass::int4b_t, ",
        f"cutlass::gemm::Kernel{kernel_schedule}",
    )
    for e in expect:
        if e not in source:
            raise RuntimeError(f"w4a16 {cfg.name}: emitted kernel lacks `{e}` (cutlass_library changed?)")
    # CUTLASS's reordering atom lives in a header that needs cuRAND; ours is the same function.
    return source.replace("cutlass::compute_memory_reordering_atom", _W4A16_REORDER), name


_W4A16_KERNEL_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// w4a16 mixed-input GEMM, tile config {config}, {dtype} activations, {mode_text}.
#include <cuda_runtime_api.h>

{includes}
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

#include "gemm/w4a16.h"
#include "gemm/w4a16_layout_sm90.cuh"

namespace {namespace} {{
// ---- emitted by cutlass_library (EmitGemmUniversal3xInstance) ------------------------------------
{kernel}
// ------------------------------------------------------------------------------------------------
using DeviceKernel = cutlass::gemm::device::GemmUniversalAdapter<{operation}>;
using LayoutAtom = {operation}_LayoutAtomQuant;
}}  // namespace {namespace}

namespace qops {{
namespace w4a16_sm90 {{
namespace kernels {{

// The GEMM runs transposed: D^T [N, M] = W [N, K] X^T, W (int4, shuffled) the A operand. With
// `workspace_bytes` set: stores the workspace this problem needs and launches nothing.
cudaError_t {function}(const w4a16::Problem& p, const w4a16::LaunchOptions&, int sm_count,
                       cudaStream_t stream, size_t* workspace_bytes) {{
  using namespace {namespace};
  using GemmKernel = DeviceKernel::GemmKernel;
  using Mainloop = GemmKernel::CollectiveMainloop;
  using Element = {element};
  auto layout_a = cute::tile_to_shape(LayoutAtom{{}}, cute::make_shape(p.n, p.k, 1));
  auto stride_b = cutlass::make_cute_packed_stride(GemmKernel::StrideB{{}}, cute::make_shape(p.m, p.k, 1));
  cute::get<0>(stride_b) = p.lda;
  auto stride_d = cutlass::make_cute_packed_stride(GemmKernel::StrideD{{}}, cute::make_shape(p.n, p.m, 1));
  auto stride_s = cutlass::make_cute_packed_stride(typename Mainloop::StrideScale{{}},
                                                   cute::make_shape(p.n, p.k / p.group_size, 1));
  cutlass::KernelHardwareInfo hw_info;
  hw_info.sm_count = sm_count;
  typename DeviceKernel::Arguments args{{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {{p.n, p.m, p.k, 1}},
      {{reinterpret_cast<const cutlass::int4b_t*>(p.w), layout_a, static_cast<const Element*>(p.a),
       stride_b, static_cast<const Element*>(p.scales), stride_s, p.group_size{zero_arg}}},
      {{{{1.0f, 0.0f}}, nullptr, stride_d, static_cast<Element*>(p.d), stride_d}},
      hw_info}};
{run_adapter}
}}  // namespace kernels
}}  // namespace w4a16_sm90
}}  // namespace qops
"""

_W4A16_DISPATCH_TEMPLATE = """\
// Generated by cutlass_kernels/gen_w8a8.py from cutlass_kernels/w8a8_configs.py: do not edit.
// Implements csrc/gemm/w4a16_sm90.h: the w4a16 family's config names, selection, kernel table.
#include "common/device_cache.h"
#include "gemm/w4a16_sm90.h"
#include "w4a16_select.h"
{hand_written_includes}

namespace qops {{
namespace w4a16_sm90 {{
namespace kernels {{
{declarations}
}}  // namespace kernels

namespace {{

struct Entry {{
  int config;
  w4a16::Dtype dtype;
  bool zeros;
  w4a16::LaunchFn launch;
}};

constexpr const char* kConfigNames[] = {{
{names}
}};

constexpr Entry kKernels[] = {{
{entries}
}};

cudaError_t find_and_call(const w4a16::Problem& p, int config, const w4a16::LaunchOptions& options,
                          cudaStream_t stream, size_t* workspace_bytes) {{
  qops::DeviceProps device;
  if (const cudaError_t err = qops::current_device_props(&device)) return err;
  if (device.cc_major != 9 || device.cc_minor != 0) return cudaErrorNoKernelImageForDevice;
  if (config < 0) config = select_config(p.m, p.n, p.k, device.sms);
  for (const Entry& e : kKernels) {{
    if (e.config == config && e.dtype == p.dtype && e.zeros == (p.zeros != nullptr)) {{
      return e.launch(p, options, device.sms, stream, workspace_bytes);
    }}
  }}
  return cudaErrorInvalidValue;
}}

}}  // namespace

int num_configs() {{ return {num_configs}; }}

const char* config_name(int config) {{
  return config >= 0 && config < num_configs() ? kConfigNames[config] : nullptr;
}}

int config_max_m(int config) {{
  switch (config) {{
{max_m_cases}
    default: return 0;
  }}
}}

int select_config(int m, int n, int k, int num_sms) {{ return select::select_config(m, n, k, num_sms); }}

cudaError_t workspace_size(const w4a16::Problem& p, int config, size_t* bytes) {{
  *bytes = 0;
  return find_and_call(p, config, w4a16::LaunchOptions{{}}, nullptr, bytes);
}}

cudaError_t gemm(const w4a16::Problem& p, int config, const w4a16::LaunchOptions& options,
                 cudaStream_t stream) {{
  return find_and_call(p, config, options, stream, nullptr);
}}

}}  // namespace w4a16_sm90
}}  // namespace qops
"""


def generate_w4a16(includes: str) -> dict[str, str]:
    """File name -> content of the w4a16 family's kernels and dispatch table."""
    files: dict[str, str] = {}
    declarations, entries, max_m_cases = [], [], []
    for ci, cfg in enumerate(table.W4A16_CONFIGS):
        for dtype in table.W4A16_DTYPES:
            for mode in table.W4A16_MODES:
                tag = re.sub(r"\W", "_", f"{cfg.name}_{dtype}_{mode}")
                function = f"w4a16_{tag}"
                kernel, operation = _emit_w4a16_kernel(cfg, dtype, mode)
                files[f"w4a16_{tag}.cu"] = _W4A16_KERNEL_TEMPLATE.format(
                    config=cfg.name,
                    dtype=dtype,
                    mode_text="scales and zeros" if mode == "zero" else "scales",
                    includes=includes,
                    namespace=f"qops_gen_{function}",
                    kernel=kernel.strip("\n"),
                    operation=operation,
                    function=function,
                    element=_W4A16_DTYPES[dtype][1],
                    zero_arg=", static_cast<const Element*>(p.zeros)" if mode == "zero" else "",
                    run_adapter=_RUN_ADAPTER,
                )
                declarations.append(
                    f"cudaError_t {function}(const w4a16::Problem&, const w4a16::LaunchOptions&, int, "
                    "cudaStream_t, size_t*);"
                )
                zeros = "true" if mode == "zero" else "false"
                entries.append(f"    {{{ci}, {_W4A16_DTYPES[dtype][2]}, {zeros}, &kernels::{function}}},")
    for hi, h in enumerate(table.W4A16_HAND_WRITTEN):
        ci = len(table.W4A16_CONFIGS) + hi
        max_m_cases.append(f"    case {ci}: return {h.max_m};  // {h.name}")
        for dtype in table.W4A16_DTYPES:
            for zeros in ("false", "true"):
                entries.append(f"    {{{ci}, {_W4A16_DTYPES[dtype][2]}, {zeros}, &{h.function}}},")
    names = table.config_names(family="w4a16")
    files["w4a16_dispatch.cu"] = _W4A16_DISPATCH_TEMPLATE.format(
        declarations="\n".join(declarations),
        hand_written_includes="\n".join(sorted({f'#include "{h.header}"' for h in table.W4A16_HAND_WRITTEN})),
        names="\n".join(f'    "{n}",' for n in names),
        entries="\n".join(entries),
        max_m_cases="\n".join(max_m_cases),
        num_configs=len(names),
    )
    return files


def generate(nvcc_version: str) -> dict[str, str]:
    """File name -> content of every generated file."""
    files = generate_headers()
    cutlass = cutlass_cppgen_for_sm90(nvcc_version)
    from cutlass_cppgen.backend.gemm_operation import EmitGemmUniversalInstance3x

    includes = "\n".join(f'#include "{h}"' for h in EmitGemmUniversalInstance3x().includes)
    declarations, entries = [], []
    for ci, cfg in enumerate(table.CONFIGS):
        for out_dtype in table.OUT_DTYPES:
            for scale_mode in table.SCALE_MODES:
                tag = re.sub(r"\W", "_", f"{cfg.name}_{out_dtype}_{scale_mode}")
                function = f"w8a8_{tag}"
                kernel, operation = _emit_kernel(cutlass, cfg, out_dtype, scale_mode)
                files[f"w8a8_{tag}.cu"] = _KERNEL_TEMPLATE.format(
                    config=cfg.name,
                    out_dtype=out_dtype,
                    scale_mode=scale_mode,
                    includes=includes,
                    namespace=f"qops_gen_{function}",
                    kernel=kernel.strip("\n"),
                    operation=operation,
                    function=function,
                    evt_arguments=_evt_arguments(kernel, _DTYPES[out_dtype][1]),
                    run_adapter=_RUN_ADAPTER,
                )
                declaration, entry = _table_row(ci, function, out_dtype, scale_mode)
                declarations.append(declaration)
                entries.append(entry)
    max_m_cases = []
    for hi, h in enumerate(table.HAND_WRITTEN):  # csrc/ kernels: one launcher for all variants
        ci = len(table.CONFIGS) + hi
        max_m_cases.append(f"    case {ci}: return {h.max_m};  // {h.name}")
        for out_dtype in table.OUT_DTYPES:
            for scale_mode in table.SCALE_MODES:
                entries.append(f"    {{{ci}, {_DTYPES[out_dtype][2]}, {_MODES[scale_mode]}, &{h.function}}},")
    files.update(generate_w4a16(includes))
    files.update(generate_sm80(cutlass))
    files["w8a8_dispatch.cu"] = _dispatch_file(
        "w8a8_sm90",
        "w8a8_select.h",
        declarations,
        entries,
        table.config_names(),
        max_m_cases,
        sorted({f'#include "{h.header}"' for h in table.HAND_WRITTEN}),
    )
    return files


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (in the build tree)")
    p.add_argument("--nvcc-version", default="13.0", help="CUDA version the kernels are built with")
    p.add_argument("--headers-only", action="store_true", help="write only the plain-data headers (no CUTLASS import)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.out = os.path.abspath(args.out)
    os.chdir(args.out)  # importing cutlass_cppgen creates its compile cache (a sqlite file) in the cwd
    files = generate_headers() if args.headers_only else generate(args.nvcc_version)
    for name, text in sorted(files.items()):
        path = os.path.join(args.out, name)
        try:
            with open(path) as f:
                unchanged = f.read() == text
        except OSError:
            unchanged = False
        if not unchanged:
            with open(path, "w") as f:
                f.write(text)
    stale = (
        []
        if args.headers_only
        else [
            n
            for n in os.listdir(args.out)
            if n.startswith(("w8a8_", "w4a16_")) and n.endswith(".cu") and n not in files
        ]
    )
    for name in stale:  # a config removed from the table
        os.remove(os.path.join(args.out, name))
    for name in sorted(files):
        print(os.path.join(args.out, name))


if __name__ == "__main__":
    main()
