"""The sampler alone: microseconds to draw one token from a vocabulary of logits, per setting.

    python benchmarks/bench_sampler.py [--vocab 128256] [--reps 200]

Two shapes of logits: "peaked" (a real model's: a few likely tokens over a long tail) and "flat"
(a random-weight model's: every token nearly alike, the worst case for top_p's cut). Median of
--reps draws, each on its own call into the C++ sampler (the logits read in place, as a session's are).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import dasllama as d
from dasllama import _core

SETTINGS = {
    "greedy": d.SamplingParams(),
    "temp 1 (server default)": d.SamplingParams(temp=1.0),
    "temp 0.7, top_p 0.9": d.SamplingParams(temp=0.7, top_p=0.9),
    "top_k 40, top_p 0.95, min_p 0.05": d.SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "temp 1, repeat 1.1 over 64": d.SamplingParams(temp=1.0, repeat_penalty=1.1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    V = a.vocab
    shapes = {
        "peaked": (rng.standard_normal(V) * 2.5 + np.where(rng.random(V) < 0.001, 10.0, 0.0)).astype(np.float32),
        "flat": (rng.standard_normal(V) * 0.5).astype(np.float32),
    }
    hist = list(range(64))
    print(f"vocab {V}, median of {a.reps} draws, us a draw")
    print(f"| setting | {' | '.join(shapes)} |\n| --- |{' --- |' * len(shapes)}")
    for name, p in SETTINGS.items():
        cells = []
        for lg in shapes.values():
            ts = []
            for i in range(a.reps):
                t = time.perf_counter()
                _core.sample_logits(lg, p, seed=i, n=1, history=hist)
                ts.append(time.perf_counter() - t)
            cells.append(f"{statistics.median(ts) * 1e6:.0f}")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
