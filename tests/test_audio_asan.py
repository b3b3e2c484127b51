"""The audio tower loader and encoder under AddressSanitizer: builds tests/native/audio_fuzz.cpp
and feeds it mmproj files with mutated tensors and keys (as test_audio_fuzz.py makes them)
plus byte-level mutants of the whole file (as test_gguf_asan.py makes them)."""
from __future__ import annotations

import os
import random
import subprocess

import _gguf_helpers as h
import test_audio_fuzz as F
from test_gguf_asan import BUILD, build


def test_audio_loader_under_asan(tmp_path):
    build("audio_fuzz")

    rng = random.Random(99)
    paths = []
    seed = tmp_path / "seed.gguf"
    F._write(seed, dict(F.BASE), dict(F.KEYS))
    paths.append(seed)
    for fam in ("qwen2.5o", "whisper"):
        p = tmp_path / f"seed-{fam}.gguf"
        F._write(p, dict(F.BASE), dict(F.KEYS, **{"clip.projector_type": fam}))
        paths.append(p)
    kinds = ["drop", "transpose", "shrink", "flatten", "add_dim", "retype", "extra_block"]
    for i in range(150):  # structural mutants: tensors and keys
        tensors, keys = dict(F.BASE), dict(F.KEYS)
        for _ in range(rng.randint(1, 3)):
            kind = rng.choice(kinds + ["key"])
            if kind == "key":
                k = rng.choice(sorted(F.KEYS))
                F._apply(tensors, keys, ("key", k, rng.choice([0, 3, 7, 16, 1 << 33, -1.0, 1e30, "voxtral",
                                                               "ultravox", "qwen2.5o", "whisper", ""])))
            elif kind == "extra_block":
                F._apply(tensors, keys, (kind, rng.choice(["ln1.weight", "attn_q.weight"])))
            else:
                F._apply(tensors, keys, (kind, rng.choice(F.NAMES), rng.choice([1, 3, 8]) if kind == "shrink"
                                         else rng.choice(["f16", "i32", "i8", "f64"])))
        p = tmp_path / f"s{i}.gguf"
        F._write(p, tensors, keys)
        paths.append(p)
    buf = seed.read_bytes()
    lengths, end = h.length_fields(buf)
    for i in range(150):  # byte-level mutants of the header
        p = tmp_path / f"b{i}.gguf"
        p.write_bytes(h.mutate(buf, h.random_ops(rng, rng.randint(1, 4)), lengths, end))
        paths.append(p)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=1")
    r = subprocess.run([str(BUILD / "audio_fuzz"), *map(str, paths)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    ok, rejected = int(r.stdout.split()[1]), int(r.stdout.split()[3])
    assert ok >= 3 and rejected > 50, r.stdout  # both paths exercised
