#!/usr/bin/env bash
# Installs and stages everything the build needs, on a fresh machine of the project's kind.
#  - Debian packages (compiler tools, GoogleTest, nlohmann-json, CLI11, zlib, ccache, clang + libFuzzer)
#    when missing and when apt-get is usable (we are root with a registry);
#  - CUTLASS 4.2 headers from PyPI into .deps/cutlass (git-ignored);
#  - a copy of the header-only/source dependencies into .deps/ so that the tree can be carried to
#    a GPU machine that has no package registry (see scripts/gpu_suite.sh).
# Idempotent: a second run does nothing that is already done.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
deps="$root/.deps"
mkdir -p "$deps"

need_pkgs=()
for p in cmake g++ ninja-build libgtest-dev nlohmann-json3-dev libcli11-dev zlib1g-dev ccache clang libclang-rt-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
  else
    echo "setup: missing packages ${need_pkgs[*]} and no apt-get as root; relying on .deps/" >&2
  fi
fi

# CUTLASS 4.2 (header-only) from PyPI.
if [ ! -f "$deps/cutlass/include/cutlass/cutlass.h" ]; then
  echo "setup: fetching CUTLASS 4.2 headers (nvidia-cutlass==4.2.0.0)"
  tmp="$(mktemp -d)"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$tmp" nvidia-cutlass==4.2.0.0
  mkdir -p "$deps/cutlass"
  rm -rf "$deps/cutlass/include" "$deps/cutlass/util_include"
  cp -r "$tmp/cutlass_library/source/include" "$deps/cutlass/include"
  cp -r "$tmp/cutlass_library/source/tools/util/include" "$deps/cutlass/util_include"
  rm -rf "$tmp"
fi

# Header-only libraries and GoogleTest sources, copied so the tree is self-contained.
if [ ! -f "$deps/include/nlohmann/json.hpp" ] && [ -f /usr/include/nlohmann/json.hpp ]; then
  mkdir -p "$deps/include"; cp -r /usr/include/nlohmann "$deps/include/"
fi
if [ ! -f "$deps/include/CLI/CLI.hpp" ] && [ -f /usr/include/CLI/CLI.hpp ]; then
  mkdir -p "$deps/include"; cp -r /usr/include/CLI "$deps/include/"
fi
# zlib (headers + static library) for a GPU machine without the Debian package.
if [ ! -f "$deps/zlib/include/zlib.h" ] && [ -f /usr/include/zlib.h ]; then
  lib="$(ls /usr/lib/*/libz.a /usr/lib/libz.a 2>/dev/null | head -1 || true)"
  if [ -n "$lib" ]; then
    mkdir -p "$deps/zlib/include" "$deps/zlib/lib"
    cp /usr/include/zlib.h /usr/include/zconf.h "$deps/zlib/include/"
    cp "$lib" "$deps/zlib/lib/"
  fi
fi
if [ ! -f "$deps/googletest/CMakeLists.txt" ] && [ -f /usr/src/googletest/CMakeLists.txt ]; then
  cp -r /usr/src/googletest "$deps/googletest"
fi
echo "setup: dependencies ready in $deps"
