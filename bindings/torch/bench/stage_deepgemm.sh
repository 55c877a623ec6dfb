#!/usr/bin/env bash
# Stages DeepGEMM (deepseek-ai/DeepGEMM, grouped FP8 GEMMs for Hopper) with the two submodules its
# build needs into one source tarball, for deepgemm_side.py on a GPU machine without network access.
# Run anywhere; nothing is built here (DeepGEMM's extension must be built against the GPU machine's
# own PyTorch, and it compiles its kernels at run time with that machine's nvcc).
#
# usage: bash stage_deepgemm.sh DEEPGEMM_GIT_DIR CUTLASS_GIT_DIR FMT_GIT_DIR [OUT]
#   *_GIT_DIR: git directories (clones or mirrors) of deepseek-ai/DeepGEMM, NVIDIA/cutlass and
#   fmtlib/fmt.   OUT defaults to deepgemm-src.tar.xz (about 1.3 MiB).
# Pinned: DeepGEMM 54e2261 (version 2.6.1, the commit deepgemm_side.py is written against) with the
# submodule commits it names: cutlass f3fde58 (only include/), fmt 553ec11 (only include/).
#
# The staged source carries one change, deepgemm_no_regex.patch (beside this script): DeepGEMM's JIT
# host code scans its kernels' #include lines and nvcc's version with plain string searches instead
# of std::regex. Kernels and heuristics are untouched.
#
# On the GPU machine (PyTorch with CUDA, nvcc under CUDA_HOME), build the extension with the system
# g++. Built with a g++ that links libstdc++ statically into the extension (/opt/gcc on our H200
# machine: the .so then needs no libstdc++.so.6), the extension's own copy of the C++ runtime
# crashed (segmentation fault) in its first std::regex, and with the patch in its first stream
# output, at the first JIT compile:
#   mkdir -p /tmp/dg && tar xJf deepgemm-src.tar.xz -C /tmp/dg
#   CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" \
#     python3 -m pip install --no-build-isolation --no-cache-dir /tmp/dg/DeepGEMM   # about 80 s
#   python3 bindings/torch/bench/deepgemm_side.py --ours-json OURS.json
set -euo pipefail
deepgemm=$1; cutlass=$2; fmt=$3; out=${4:-deepgemm-src.tar.xz}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/DeepGEMM/third-party/cutlass" "$stage/DeepGEMM/third-party/fmt"
git --git-dir="$deepgemm" archive 54e2261 | tar -x -C "$stage/DeepGEMM"
git --git-dir="$cutlass" archive f3fde58372d33e9a5650ba7b80fc48b3b49d40c8 include | tar -x -C "$stage/DeepGEMM/third-party/cutlass"
git --git-dir="$fmt" archive 553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28 include | tar -x -C "$stage/DeepGEMM/third-party/fmt"
# The submodules' headers are all the build reads (setup.py: third-party/{cutlass,fmt}/include). A
# mirror that lacks cutlass's large media files makes git report them; include/ is checked here.
test -f "$stage/DeepGEMM/third-party/cutlass/include/cute/tensor.hpp"
test -f "$stage/DeepGEMM/third-party/fmt/include/fmt/format.h"
patch -s -d "$stage/DeepGEMM" -p1 < "$(dirname "$0")/deepgemm_no_regex.patch"
tar -C "$stage" -cf - DeepGEMM | xz -6 -T0 > "$out"
du -h "$out"
