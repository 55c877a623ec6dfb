#!/usr/bin/env bash
# The whole GPU suite, on a machine with a CUDA GPU: build with all cores, run every test (CPU and
# GPU), optionally again under compute-sanitizer (memcheck + racecheck), print a summary.
# The GPU machine has no package registry: run scripts/setup.sh where one exists and carry .deps/.
#
# usage: scripts/gpu_suite.sh [--sanitize] [--regex R] [--target T ...]
#   --sanitize   also run each GPU test executable under compute-sanitizer memcheck and racecheck
#   --regex R    only ctest tests matching R (and only matching GPU executables when sanitizing)
#   --target T   build only these targets (default: everything)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${MOE_BUILD_DIR:-$root/build-gpu}"
sanitize=0; regex=""; targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=1 ;;
    --regex) regex="$2"; shift ;;
    --target) targets+=("$2"); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
[ -f "$root/.deps/cutlass/include/cutlass/cutlass.h" ] || bash "$root/scripts/setup.sh"
gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null || exit 1
tgt=(); for t in "${targets[@]}"; do tgt+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${tgt[@]}" || { echo "BUILD FAILED"; exit 1; }

device="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
cd "$build"
ctest_args=(--output-on-failure -j 4); [ -n "$regex" ] && ctest_args+=(-R "$regex")
ctest "${ctest_args[@]}" 2>&1 | tee ctest.log
rc=${PIPESTATUS[0]}

san_fail=0; san_runs=0
if [ $sanitize = 1 ]; then
  for exe in "$build"/tests/gpu_test_*; do
    [ -x "$exe" ] || continue
    [ -n "$regex" ] && ! [[ "$(basename "$exe")" =~ $regex ]] && continue
    for tool in memcheck racecheck; do
      san_runs=$((san_runs + 1))
      if compute-sanitizer --tool "$tool" --error-exitcode 99 "$exe" --gtest_brief=1 >"san_$(basename "$exe")_$tool.log" 2>&1; then
        echo "sanitizer $tool $(basename "$exe"): clean"
      else
        echo "sanitizer $tool $(basename "$exe"): FAILED"; tail -30 "san_$(basename "$exe")_$tool.log"; san_fail=$((san_fail + 1))
      fi
    done
  done
fi

# Per-test status lines look like " 12/141 Test  #12: cpu.Name ....   Passed    0.01 sec".
passed=$(grep -cE "Test +#[0-9]+: .* +Passed +[0-9.]+ sec" ctest.log || true)
skipped=$(grep -cE "Test +#[0-9]+: .* +Skipped +[0-9.]+ sec|Test +#[0-9]+: .*\*\*\*Skipped" ctest.log || true)
failed=$(grep -cE "Test +#[0-9]+: .*(\*\*\*Failed|\*\*\*Exception|\*\*\*Timeout|Not Run)" ctest.log || true)
echo "==== GPU suite summary ===="
echo "device: ${device:-none}"
echo "tests: $passed passed, $failed failed, $skipped skipped"
[ $sanitize = 1 ] && echo "compute-sanitizer: $san_runs runs, $san_fail with findings"
[ -n "${OUT:-}" ] && cp ctest.log "$OUT/" 2>/dev/null
[ $rc = 0 ] && [ $san_fail = 0 ]
