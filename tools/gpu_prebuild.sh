#!/bin/bash
# Builds this tree here, with CUDA and Vulkan, for the GPU machine's Python (3.12), into
# .dlb/dl.tar.xz (a dl/ folder, what `pip install --target /tmp/dl .` leaves there) with
# .dlb/src.sha256 (tools/src_hash.sh). tools/gpu_machine.sh unpacks it into /tmp/dl instead of
# building when the carried tree hashes the same: a fresh lent machine's build took 95-190 s of
# its device time. Carry .dlb with .whl, .gl and .vkb. Needs nvcc, a Python 3.12 with
# scikit-build-core and pybind11 (PY; e.g. a venv made from .whl), and .vkb (glslc and the
# Vulkan headers; .vkb/glslang for the gemm_f16m variants). About 15 minutes on two cores.
set -euo pipefail
PY=${PY:-python3.12}
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version'
mkdir -p /tmp/vkb
for f in .vkb/*.deb; do dpkg -x "$f" /tmp/vkb; done
export PATH=/tmp/vkb/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/vkb/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CMAKE_PREFIX_PATH=/tmp/vkb/usr
if [ -f .vkb/glslang ]; then export DASLLAMA_GLSLANG=$PWD/.vkb/glslang; fi
hash=$(bash tools/src_hash.sh)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
t0=$SECONDS
"$PY" -m pip install -q --no-build-isolation --no-deps --target "$out/dl" .
mkdir -p .dlb
tar cJf .dlb/dl.tar.xz -C "$out" dl
[ "$(bash tools/src_hash.sh)" = "$hash" ] || { echo "the tree changed during the build" >&2; rm -f .dlb/*; exit 1; }
echo "$hash" > .dlb/src.sha256
echo "prebuilt in $((SECONDS - t0)) s: $(du -h .dlb/dl.tar.xz | cut -f1)"
