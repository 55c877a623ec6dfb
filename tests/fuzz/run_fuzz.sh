#!/usr/bin/env bash
# Builds the safetensors libFuzzer target with clang (AddressSanitizer + UBSan) and runs it for a
# bounded time on a copy of the seed corpus. Exit status: 0 clean, 1 a finding (the crashing input
# is kept under the work directory and printed), 77 when clang/libFuzzer is not installed (the
# script installs nothing; Debian needs the packages clang and libclang-rt-dev).
#
#   tests/fuzz/run_fuzz.sh [seconds=60] [work dir=build-fuzz]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
seconds="${1:-60}"
work="${2:-$root/build-fuzz}"
cxx="${MOE_FUZZ_CXX:-clang++}"

if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "run_fuzz: $cxx not found (Debian: apt-get install clang libclang-rt-dev); fuzzing skipped" >&2
  exit 77
fi
json_inc="$root/.deps/include"
[ -f "$json_inc/nlohmann/json.hpp" ] || json_inc=/usr/include
mkdir -p "$work"
probe="$work/probe.cpp"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe"
if ! "$cxx" -fsanitize=fuzzer "$probe" -o "$work/probe" >/dev/null 2>&1; then
  echo "run_fuzz: $cxx cannot link -fsanitize=fuzzer (Debian: apt-get install libclang-rt-dev); fuzzing skipped" >&2
  exit 77
fi

# The target and everything it reaches: the checkpoint library, the host-only core, and the part of
# the reference that decodes quantized weights (convert's dequantize).
srcs=("$root/tests/fuzz/fuzz_safetensors.cpp" "$root"/src/checkpoint/*.cpp "$root"/src/core/*.cpp
      "$root/src/reference/quantize_ref.cpp")
flags=(-std=c++17 -O1 -g -pthread -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
       -fno-sanitize-recover=undefined -I"$root/include" -I"$root/src" -isystem "$json_inc")
echo "run_fuzz: building $work/fuzz_safetensors"
"$cxx" "${flags[@]}" "${srcs[@]}" -o "$work/fuzz_safetensors"

# Run on a copy: new inputs the fuzzer finds stay out of the committed corpus.
rm -rf "$work/corpus" "$work/artifacts"
mkdir -p "$work/corpus" "$work/artifacts"
cp "$root"/tests/fuzz/corpus/* "$work/corpus/"
echo "run_fuzz: fuzzing for ${seconds}s"
set +e
"$work/fuzz_safetensors" "$work/corpus" -max_total_time="$seconds" -max_len=8192 -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$work/artifacts/" \
  -dict="$root/tests/fuzz/safetensors.dict" 2>&1 | tail -n 40
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "run_fuzz: FINDING (exit $status); inputs:" >&2
  ls -la "$work/artifacts" >&2
  exit 1
fi
echo "run_fuzz: no findings in ${seconds}s"
