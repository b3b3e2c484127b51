"""The GGUF reader under AddressSanitizer: builds tests/native/gguf_fuzz.cpp and feeds it seeded mutants."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import _gguf_helpers as h

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "asan"


def _tool(name):
    path = shutil.which(name)
    assert path, f"{name} is needed to build the ASan harness"  # fail, never skip
    return path


def build(target: str) -> None:
    """One harness of tests/native under ASan (both share the build). The harnesses run the CPU
    code only, so no device backend is built: Vulkan's ~200 shaders and its backend would be
    compiled for nothing."""
    cmake, ninja = _tool("cmake"), _tool("ninja")
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(BUILD), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    "-DDASLLAMA_TOOLS=ON", "-DDASLLAMA_SANITIZE=address", "-DDASLLAMA_CUDA=OFF", "-DDASLLAMA_VULKAN=OFF",
                    "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
                   check=True, capture_output=True)
    subprocess.run([ninja, "-C", str(BUILD), target], check=True, capture_output=True)


def test_gguf_reader_under_asan(tmp_path, smollm2_path):
    build("gguf_fuzz")

    seeds = [h.writer_file(tmp_path / f"seed{al}.gguf", al).read_bytes() for al in (None, 1, 256)]
    seeds.append(h.smollm2_seed(smollm2_path))
    rng = random.Random(1234)
    paths = []
    for i, buf in enumerate(seeds):
        p = tmp_path / f"ok{i}.gguf"
        p.write_bytes(buf)
        paths.append(p)
    for i in range(400):
        buf = seeds[i % len(seeds)]
        lengths, end = h.length_fields(buf)
        p = tmp_path / f"m{i}.gguf"
        p.write_bytes(h.mutate(buf, h.random_ops(rng, rng.randint(1, 4)), lengths, end))
        paths.append(p)
    # Split models: mutants of a later part behind an intact first part (joined on open).
    import gguf as gguf_py
    import numpy as np

    w = gguf_py.GGUFWriter(str(tmp_path / "split.gguf"), "llama", split_max_tensors=2)
    for i in range(5):
        w.add_tensor(f"t{i}", np.arange(8 * (i + 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    names = [f"split-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    split = [(tmp_path / n).read_bytes() for n in names]
    for i in range(60):
        sd = tmp_path / f"s{i}"
        sd.mkdir()
        k = 1 + i % 2
        lengths, end = h.length_fields(split[k])
        for j, n in enumerate(names):
            buf = split[j] if j != k else h.mutate(split[j], h.random_ops(rng, rng.randint(1, 3)), lengths, end)
            (sd / n).write_bytes(buf)
        paths.append(sd / names[0])
    paths.append(tmp_path / names[0])
    paths += [tmp_path / "missing.gguf"]  # an I/O error is dl::Error, not GGUFError: must exit 2
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1")
    r = subprocess.run([str(BUILD / "gguf_fuzz"), *map(str, paths[:-1])], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    ok, rejected = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert ok >= len(seeds) and rejected > 50, r.stdout  # both paths exercised
    r = subprocess.run([str(BUILD / "gguf_fuzz"), str(paths[-1])], env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
