#!/usr/bin/env bash
# Assembles every cuda/*.cu for sm_75 (no GPU needed; a few minutes). The build ships sm_90 code
# and compute_75 PTX, which the driver assembles when a module loads on an older GPU (a T4, say):
# one instruction past sm_75 there (cp.async, tf32, ...) outside an `__CUDA_ARCH__ >= 800` guard
# fails the whole module, so every kernel of that file. Usage: cuda/tests/check_sm75.sh [ROOT]
set -uo pipefail
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
B=$(mktemp -d)
NVCC=${NVCC:-nvcc}
bad=0
for f in "$ROOT"/cuda/*.cu; do
  if ! out=$(nice "$NVCC" -std=c++17 -O1 -arch=sm_75 -I"$ROOT/cpp" -I"$ROOT/cuda" -c "$f" -o "$B/x.o" 2>&1); then
    echo "$(basename "$f"): does not assemble for sm_75"
    echo "$out" | grep -i error | sort -u | head -5
    bad=1
  fi
done
rm -rf "$B"
[ $bad = 0 ] && echo "every cuda/*.cu assembles for sm_75"
exit $bad
