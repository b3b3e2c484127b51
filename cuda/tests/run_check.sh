#!/usr/bin/env bash
# Builds and runs the standalone CUDA op check: cuda/*.cu + cpp/quant + the test stubs.
# Usage: cuda/tests/run_check.sh [ROOT] [--no-bench]  (ROOT holds cpp/ and cuda/; default: this repo)
set -euo pipefail
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
shift || true
B=${BUILD:-/tmp/dl_cuda_check}
mkdir -p "$B"
NVCC=${NVCC:-nvcc}
FL="-std=c++17 -O3 -arch=sm_90 -I$ROOT/cpp -I$ROOT/cuda"
pids=()
for f in "$ROOT"/cuda/*.cu; do
  $NVCC $FL -c "$f" -o "$B/$(basename "$f").o" & pids+=($!)
done
for f in "$ROOT"/cpp/quant/quant.cpp "$ROOT"/cpp/quant/types.cpp "$ROOT"/cuda/tests/stubs.cpp "$ROOT"/cuda/tests/ops_check.cpp; do
  $NVCC $FL -Xcompiler -ffp-contract=off -c "$f" -o "$B/$(basename "$f").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
$NVCC -arch=sm_90 "$B"/*.o -o "$B/ops_check"
"$B/ops_check" "$@"
