#!/usr/bin/env bash
# The README's main job: build the moe-engine tool and run the layer benchmark on its default shape
# (qwen3-30b-a3b-ep8). Extra arguments go to `moe-engine bench` (e.g. --list, --all, --shape NAME,
# --shape T,H,F,E,k, --json, --png chart.png; see docs/shapes.md).
# Needs a CUDA GPU; without one it exits non-zero with a one-line message.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${MOE_BUILD_DIR:-$root/build}"
[ -f "$root/.deps/cutlass/include/cutlass/cutlass.h" ] && [ -f "$root/.deps/include/CLI/CLI.hpp" ] || bash "$root/scripts/setup.sh"
gen=(); command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "${MOE_JOBS:-$(nproc)}" --target moe-engine
exec "$build/tools/moe-engine" bench "$@"
