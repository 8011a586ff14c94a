#!/usr/bin/env bash
# One command for the lent GPU machine: install the carried wheels, build qops with CUDA, run the
# GPU tests and the chosen benchmarks, and leave logs and CSVs under $OUT.
#
#   bash tools/device_run.sh [-t PYTEST_ARGS] [-b "BENCH_MODULE ARGS"]... [-x "CMD"]... [--no-sm90]
#                            [--sanitize "ARGS"] [--no-build]
#
#   -t ARGS      pytest arguments (default: "-m gpu tests"); "none" skips the tests
#   -b "M ARGS"  run `python -m M ARGS --out $OUT` (repeatable), e.g. -b "bench.bench_quant"
#   --no-sm90    skip the sm_90a CUTLASS kernels (much faster build when working on other kernels)
#   --sanitize A run tools/sanitize.sh A (compute-sanitizer memcheck, racecheck, synccheck over the
#                kernel tests; A: its arguments, e.g. "--tools memcheck" or "" for the defaults)
#   -x "CMD"     run CMD with bash (repeatable; logged as cmdN.log), e.g. an ncu profile:
#                -x "ncu --clock-control none -k regex:rms_norm --launch-skip 2 --launch-count 1
#                    --set full python3 -m tools.probe_memory_bound --ncu norm"
#   --no-build   reuse the extension an earlier call on the same warm machine built (the copy of the
#                tree gets fresh timestamps, so a rebuild recompiles everything: ~3 minutes); only
#                valid when no C++/CUDA source changed since that call
#
# Prepare the wheels once on your machine with `bash ../shared/tools/device_wheels.sh` and name
# `.whl` in the device call's carry. Prints a short summary last.
set -uo pipefail
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
TESTS="-m gpu tests"
BENCHES=()
CMDS=()
SANITIZE=""
RUN_SANITIZE=0
BUILD=1
export QOPS_ENABLE_SM90=${QOPS_ENABLE_SM90:-ON}
while [ $# -gt 0 ]; do
  case "$1" in
    -t) TESTS="$2"; shift 2 ;;
    -b) BENCHES+=("$2"); shift 2 ;;
    -x) CMDS+=("$2"); shift 2 ;;
    --no-sm90) export QOPS_ENABLE_SM90=OFF; shift ;;
    --sanitize) SANITIZE="$2"; RUN_SANITIZE=1; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    *) echo "device_run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1
summary=()
step() {  # step NAME LOGFILE CMD...: run, tee into $OUT/LOGFILE, remember the outcome
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-40s rc=%-3s %4ss  (%s)' "$name" "$rc" "$((SECONDS - t0))" "$log")")
  return "$rc"
}

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export QOPS_NVCC_THREADS=${QOPS_NVCC_THREADS:-1}
export QOPS_CUDA_ARCHS=${QOPS_CUDA_ARCHS:-90}
if [ "$BUILD" = 1 ]; then
  step build build.log python3 -m pip install --no-build-isolation --no-deps -v -e . || {
    printf '%s\n' "${summary[@]}"; exit 1; }
else
  python3 -c "import qops._C" || { echo "--no-build: no earlier build on this machine" >&2; exit 1; }
fi
# Which C++ toolchain built the extension, and did libstdc++ get linked dynamically (it must:
# a static copy inside _C.so crashed on number formatting, see ops/common.h).
so=$(python3 -c "import qops._C as c; print(c.__file__)")
{ echo "c++: $(command -v c++) $(c++ --version | head -1)"
  echo "libstdc++ linked by _C: $(ldd "$so" | grep -E 'stdc|gcc_s' | tr -s ' ' | tr '\n' ';')"
  echo "compilers: $(ls /usr/bin/g++* /usr/bin/c++ 2>/dev/null | tr '\n' ' ') libstdc++ files: $(ls $(dirname $(dirname $(readlink -f $(command -v c++))))/lib*/libstdc++* 2>/dev/null | tr '\n' ' ')"
  echo "stream code defined inside _C (0 expected): $(nm -C --defined-only "$so" | grep -c 'basic_ostream<char, std::char_traits<char> >::_M_insert')"
} | tee "$OUT/toolchain.txt"
# Binary size per kernel object (STYLE: track it; CUTLASS instantiations dominate).
{ echo "_C: $(du -h "$so" | cut -f1)"
  find build -name '*.cu.o' -printf '%s\t%p\n' 2>/dev/null | sort -rn | awk '{printf "%8.1f KiB  %s\n", $1/1024, $2}'
} > "$OUT/binary_sizes.txt" || true
python3 -c "import qops, torch; print('ops:', qops.op_names()); print('cuda kernels:', [n for n in qops.op_names() if qops.has_cuda_kernel(n)])" | tee "$OUT/ops.txt"

rc_all=0
if [ "$TESTS" != "none" ]; then
  # shellcheck disable=SC2086
  step "pytest $TESTS" tests.log python3 -m pytest -q -rs $TESTS || rc_all=1
fi
if [ "$RUN_SANITIZE" = 1 ]; then
  # bash -c keeps the quoting of SANITIZE (e.g. a pytest -k expression after --)
  step "sanitize" sanitize.log bash -c "bash tools/sanitize.sh --out '$OUT' $SANITIZE" || rc_all=1
fi
for b in "${BENCHES[@]}"; do
  name=${b%% *}; name=${name##*.}
  # shellcheck disable=SC2086
  step "bench $b" "$name.log" python3 -m $b --out "$OUT" || rc_all=1
done
i=0
for c in "${CMDS[@]}"; do
  i=$((i + 1))
  step "cmd$i: ${c:0:60}" "cmd$i.log" bash -c "$c" || rc_all=1
done
echo "==== summary"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
# The device tool returns at most 8 files: bundle the logs into one archive.
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null) || true
exit $rc_all
