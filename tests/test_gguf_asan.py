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


def test_gguf_reader_under_asan(tmp_path, smollm2_path):
    cmake, ninja = _tool("cmake"), _tool("ninja")
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(BUILD), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
                    "-DDASLLAMA_TOOLS=ON", "-DDASLLAMA_SANITIZE=address", "-DDASLLAMA_CUDA=OFF", "-DCMAKE_BUILD_TYPE=RelWithDebInfo"],
                   check=True, capture_output=True)
    subprocess.run([ninja, "-C", str(BUILD), "gguf_fuzz"], check=True, capture_output=True)

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
    paths += [tmp_path / "missing.gguf"]  # an I/O error is dl::Error, not GGUFError: must exit 2
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1")
    r = subprocess.run([str(BUILD / "gguf_fuzz"), *map(str, paths[:-1])], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    ok, rejected = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert ok >= len(seeds) and rejected > 50, r.stdout  # both paths exercised
    r = subprocess.run([str(BUILD / "gguf_fuzz"), str(paths[-1])], env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
