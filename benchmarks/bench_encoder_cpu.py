"""The whisper tiny.en encoder's CPU time alone in a process: mel + encoder of a 30 s window
(``encode_audio_rows`` with a reused ``AudioState``), ``time.process_time`` and wall per encode.

    python benchmarks/bench_encoder_cpu.py [--threads 1] [--reps 7] [--core DIR]

bench_asr.py times CTranslate2 in the same process, whose idle threads then count in our process
time (and ours in its); this script holds only dasllama, so with ``--threads 1`` its CPU time is
the steady single-thread measure on a shared machine. ``--core DIR`` loads ``dasllama._core`` from
DIR (another build's extension): an A/B runs it alternately with and without.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--core", default=None)
    args = ap.parse_args()
    if args.core:
        from bench_asr import load_core

        load_core(args.core)

    import dasllama as d
    from dasllama import cli

    gguf = os.path.join(tempfile.mkdtemp(), "whisper-tiny.en.gguf")
    cli.main(["convert", "whisper-tiny.en", gguf])
    model = d.load_asr_model(gguf, n_threads=args.threads)
    x30 = (0.1 * np.random.default_rng(0).standard_normal(30 * 16000)).astype(np.float32)
    state = d.AudioState()
    d.encode_audio_rows(model.encoder, x30, state, full_window=True)  # warm-up
    cpu, wall = [], []
    for _ in range(args.reps):
        c, w = time.process_time(), time.perf_counter()
        d.encode_audio_rows(model.encoder, x30, state, full_window=True)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    print(f"encoder 30 s window, {args.threads} threads{' (' + args.core + ')' if args.core else ''}: "
          f"CPU median {np.median(cpu) * 1e3:.1f} ms (min {min(cpu) * 1e3:.1f}), wall median "
          f"{np.median(wall) * 1e3:.1f} ms (min {min(wall) * 1e3:.1f}) "
          f"(load average {' '.join(open('/proc/loadavg').read().split()[:3])})", flush=True)


if __name__ == "__main__":
    main()
