"""CPU prefill attention alone: one layer's causal attention over N tokens, through the backend's
paged-attention op (the cache rows stored first, as a prefill does), timed in CPU seconds.

    python benchmarks/bench_attention.py [--tokens 4096] [--shape 9,3,64] [--kv f16] [--reps 4] [--chunk 256]
        [--threads 0]

--shape is heads,kv_heads,head_dim (9,3,64 is SmolLM2-135M; 4,1,256 Gemma-3-270M's global
layers). The figure is zmm FMAs (16 lanes) of the two products, QK and PV, over the causal half,
per CPU second of the process (all threads): on a machine shared with other work, CPU time
scatters far less than wall time. The best of --reps calls is printed. --chunk N issues the
prefill as the model does on the CPU: calls of N query rows, each against the keys up to its last
row (each call stores its keys first: that store is in the figure too).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from dasllama import _core


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shape", default="9,3,64")
    ap.add_argument("--kv", default="f16", choices=["f32", "f16"])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=0, help="query rows per call (0: all in one call)")
    ap.add_argument("--threads", type=int, default=0, help="backend threads (0: the physical cores)")
    a = ap.parse_args()
    n = a.tokens
    heads, kv_heads, hd = (int(x) for x in a.shape.split(","))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n, heads * hd), np.float32)
    k = rng.standard_normal((n, kv_heads * hd), np.float32)
    v = rng.standard_normal((n, kv_heads * hd), np.float32)
    be = _core.Backend("cpu", a.threads)
    pos = np.arange(n, dtype=np.int32)
    ids = np.zeros(1, np.int32)  # one page of n rows
    fmas = heads * hd / 16 * n * n / 2 * 2
    best = math.inf
    step = a.chunk or n
    for _ in range(a.reps):
        t = time.process_time()
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            be.paged_attention(q[c0:c1], k[:c1], v[:c1], pos[c0:c1], heads, kv_heads, hd, {"f32": 0, "f16": 1}[a.kv], n,
                               ids, 1, 0, 1 / math.sqrt(hd), 0.0, 512)
        best = min(best, time.process_time() - t)
    print(f"tokens={n} shape={a.shape} kv={a.kv} chunk={step}: {best:.3f} CPU s, {fmas / best / 1e9:.2f} G zmm FMA per CPU s "
          f"(load average {' '.join(open('/proc/loadavg').read().split()[:3])})")


if __name__ == "__main__":
    main()
