#!/usr/bin/env bash
# The GPU suite's kernel tests under compute-sanitizer, one tool after the other, in one call:
# memcheck (out-of-bounds and misaligned accesses, leaks of device errors), racecheck (shared-memory
# hazards) and synccheck (barrier misuse). Run it on the GPU machine, after a build, before a kernel
# change is called done; it prints one line per tool and exits non-zero if any tool found an error.
#
#   bash tools/sanitize.sh [--tools memcheck,racecheck,synccheck] [--out DIR] [-- PYTEST ARGS]
#
# The default selection covers every hand-written kernel with small problems: the property tests
# (random shapes, --hypothesis-profile=sanitize: a few examples each), the bad-call contracts, the
# PDL chains (norm, SiLU, quant, GEMV, cache write, decode attention back to back), the int8 KV write,
# the decode attention's small cases, the decode GEMV at every launch shape, and the int4 KV
# writes (bit-exact cases) and decode (every merge path, with and without SKVQ's side tokens), the
# float-output norms, SiLU-and-mul and RoPE, and the W4A16 GEMV (strided input, graph reuse).
set -uo pipefail
TOOLS=memcheck,racecheck,synccheck
OUT=${OUT:-$PWD/sanitize_out}
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) TOOLS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; ARGS=("$@"); break ;;
    *) echo "sanitize.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ ${#ARGS[@]} -eq 0 ]; then
  ARGS=(-q -m gpu -p no:cacheprovider --hypothesis-profile=sanitize
        tests/test_properties.py tests/test_contracts.py tests/test_pdl.py tests/test_kv_cache.py
        "tests/test_attention.py::test_gpu_small_fused_merge_matches_unfused"
        "tests/test_attention.py::test_gpu_small_forced_warps"
        "tests/test_w8a8_gemm.py::test_gemv_every_launch_shape"
        "tests/test_int4_kv_cuda.py::test_quantize_kv_int4_bit_exact"
        "tests/test_int4_kv_cuda.py::test_reshape_and_cache_int4_bit_exact"
        "tests/test_int4_kv_cuda.py::test_skvq_cache_write_bit_exact"
        "tests/test_int4_kv_cuda.py::test_int4_decode_skvq_merges"
        "tests/test_int4_kv_cuda.py::test_int4_decode_merges"
        "tests/test_float_out_ops.py::test_cuda_rms_norm_strided"
        "tests/test_float_out_ops.py::test_cuda_silu_and_mul"
        "tests/test_float_out_ops.py::test_cuda_rope"
        "tests/test_float_out_ops.py::test_cuda_rope_matches_cpu_op_and_bad_position"
        "tests/test_float_out_ops.py::test_cuda_float_ops_graph_and_empty"
        "tests/test_w4a16_cuda.py::test_gemm_strided_and_unaligned_a"
        "tests/test_w4a16_cuda.py::test_gemm_cuda_graph_and_reuse"
        "tests/test_w4a16_cuda.py::test_gemv_partitions[1-16x64g64]"
        "tests/test_w4a16_cuda.py::test_gemv_partitions[9-80x4096g128]"
        "tests/test_w4a16_cuda.py::test_gemv_partitions[16-208x8192g64]"
        "tests/test_w4a16_cuda.py::test_gemv_partitions[7-8192x1024g128]"
        "tests/test_rope_cache.py::test_cuda_bad_position_and_unaligned"
        "tests/test_rope_cache.py::test_cuda_matches_reference"
        "tests/test_comm.py::test_cuda_world1")
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rc_all=0
summary=()
IFS=, read -ra tools <<< "$TOOLS"
for tool in "${tools[@]}"; do
  t0=$SECONDS
  # --error-exitcode: any reported error fails the run even when pytest itself passed.
  compute-sanitizer --tool "$tool" --error-exitcode 9 --target-processes all \
    python3 -m pytest "${ARGS[@]}" > "$OUT/$tool.log" 2>&1
  rc=$?
  errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error|RACECHECK SUMMARY: [0-9]+ hazard" "$OUT/$tool.log" | tail -1)
  result=$(grep -E "passed|failed" "$OUT/$tool.log" | tail -1)
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s | %s' "$tool" "$rc" "$((SECONDS - t0))" "${errors:-no summary}" "$result")")
  [ "$rc" = 0 ] || rc_all=1
done
printf '%s\n' "${summary[@]}" | tee "$OUT/sanitize_summary.txt"
exit $rc_all
