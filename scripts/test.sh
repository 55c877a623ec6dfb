#!/usr/bin/env bash
# The README's test command: set up, build everything (all CUDA sources for sm_90a), run every test.
# Without a GPU the GPU tests report SKIPPED; with one they run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${MOE_BUILD_DIR:-$root/build}"
jobs="${MOE_JOBS:-$(nproc)}"
bash "$root/scripts/setup.sh"
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${MOE_BUILD_TYPE:-Release}" "${launcher[@]}"
cmake --build "$build" -j "$jobs"
cd "$build"
ctest --output-on-failure -j "$jobs" "$@"
