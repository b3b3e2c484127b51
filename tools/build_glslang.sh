#!/bin/bash
# glslang 15 (GL_NV_cooperative_matrix2) for the Vulkan build's gemm_f16m variants, which Debian
# 12's glslc cannot compile: Debian 13's source of it, built here (about 3 minutes on two cores;
# no SPIR-V optimizer, no HLSL), static libstdc++ so the binary runs on the GPU machines too.
# Writes .vkb/glslang (or the path given as the first argument), which tools/gpu_machine.sh hands
# to the build (DASLLAMA_GLSLANG); for a local build: DASLLAMA_GLSLANG=$PWD/.vkb/glslang pip
# install . (vulkan/CMakeLists.txt). tools/build_wheels.py builds one for the wheels.
set -euo pipefail
out=${1:-.vkb/glslang}
ver=15.1.0+1.4.309.0
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
curl -sfL -o "$dir/src.tar.gz" "http://deb.debian.org/debian/pool/main/g/glslang/glslang_${ver}.orig.tar.gz"
tar xzf "$dir/src.tar.gz" -C "$dir"
cmake -S "$dir/glslang-$ver" -B "$dir/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DENABLE_OPT=OFF -DGLSLANG_TESTS=OFF \
  -DBUILD_SHARED_LIBS=OFF -DENABLE_HLSL=OFF -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" > /dev/null
ninja -C "$dir/b" glslang-standalone > /dev/null
mkdir -p "$(dirname "$out")"
cp "$dir/b/StandAlone/glslang" "$out"
"$out" --version | head -1
