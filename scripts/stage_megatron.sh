#!/usr/bin/env bash
# Stages megatron-core 0.19 from PyPI as wheels in .wheels/megatron/ (git-ignored), for a GPU machine
# that has torch and numpy but no package registry; bindings/torch/tests/test_megatron_core.py runs
# Megatron's own MoE layer against moe_engine's experts there. There:
#   python3 -m pip install --no-index --no-deps --target /tmp/mc .wheels/megatron/*.whl
#   export PYTHONPATH=/tmp/mc${PYTHONPATH:+:$PYTHONPATH}
#
# Why these wheels and no others: megatron-core 0.19 requires torch, numpy and packaging (its
# Requires-Dist without extras). Everything else it imports on the path the test takes
# (megatron.core, parallel_state, transformer_config, tensor_parallel, moe_layer, experts,
# token_dispatcher, router, the local MoE spec) is either a dependency of torch's Linux wheels
# (typing_extensions, triton) or imported inside try/except or behind HAVE_TE-style flags
# (transformer_engine, apex, einops, flashinfer, emerging_optimizers, ...). packaging is not a torch
# dependency, so it is staged. megatron-core 0.19 wheels are cp312 manylinux only (a compiled
# dataset helper), hence the fixed target interpreter.
# Idempotent: wheels already present are kept (pip download skips them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/.wheels/megatron"
mkdir -p "$out"

target=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any)
for req in 'megatron-core>=0.19,<0.20' 'packaging>=24.2'; do
  python3 -m pip download -q --disable-pip-version-check "${target[@]}" -d "$out" "$req"
done

# One version of each: a later run after a new release would otherwise leave two wheels behind.
for name in megatron_core packaging; do
  n=$(find "$out" -maxdepth 1 -name "${name}-*.whl" | wc -l)
  if [ "$n" -ne 1 ]; then
    echo "stage_megatron: expected one ${name} wheel in $out, found $n; remove the stale ones" >&2
    exit 1
  fi
done

bytes=$(du -cb "$out"/*.whl | tail -n 1 | cut -f1)
if [ "$bytes" -gt $((30 * 1024 * 1024)) ]; then
  echo "stage_megatron: $out holds $bytes bytes, over the 30 MiB budget" >&2
  exit 1
fi
ls -l "$out"
echo "stage_megatron: $(basename -a "$out"/*.whl | tr '\n' ' ')($bytes bytes)"
