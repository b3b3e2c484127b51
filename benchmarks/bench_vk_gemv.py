"""Vulkan q8-mode decode matmul per call, on Llama-3.2-1B's shapes: gemv_q.comp (x rounded in the
GEMV; its rows a workgroup picked, or forced to 4 / 8 / 16 / 32) against quant_act + gemv_i8
(DASLLAMA_VULKAN_GEMVQ=0), quant_act + gemv_i8x.comp (DASLLAMA_VULKAN_GEMVI8=2; 2r2 / 2r4 / 2r8:
2, 4 or 8 rows a workgroup; 3: q8_0 a block a lane; 4: two windows of k loaded ahead), and the
f32 GEMV (gemv.comp, DASLLAMA_VULKAN_I8=prefill); with --type f16, gemv.comp over f16 weights
(DASLLAMA_VULKAN_GEMV_KS=1 / 2 / 4: the subgroups a row is split over, forced). Run on the GPU:

    python benchmarks/bench_vk_gemv.py --settings GEMVQ=0,GEMVQ=1,GEMVQ=4,GEMVQ=8,GEMVQ=16,GEMVQ=32,I8=prefill
    python benchmarks/bench_vk_gemv.py --shapes qkv,o,gate_up,down \
        --settings GEMVI8=1,GEMVI8=2r2,GEMVI8=2r4,GEMVI8=2r8,GEMVI8=3r4,GEMVI8=4r4,I8=prefill

Each figure is (time of R2 products - time of R1 products) / (R2 - R1) through the op harness's
binding (`_core.Backend.matmul(..., repeat=)`: one weight upload, the products recorded back to
back, each behind a barrier, one submit), so it is a matmul stage's device time with its
barrier, plus the host's recording of it (microseconds; nothing is replayed here). The weights
are random q8_0 / q4_0 blocks made directly (no quantizer pass over 262M values). GB/s counts
the weight bytes read once per product. Settings are comma-separated NAME=VALUE pairs of
DASLLAMA_VULKAN_* variables, read at each matmul, so one process runs them all, interleaved
over --rounds; the best round is printed.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = {  # name: (rows, cols) of one matmul of a Llama-3.2-1B decode step
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "head": (128256, 2048),
}


def random_blocks(rng, wtype: str, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """rows x cols of q8_0 (f16 scale + 32 int8) or q4_0 (f16 scale + 16 nibble bytes) blocks, or
    of f16 values."""
    if wtype == "f16":
        return rng.standard_normal(rows * cols, dtype=np.float32).astype(np.float16).view(np.uint8), 1
    nb = rows * cols // 32
    scale = (rng.uniform(0.5, 1.5, nb) / 127).astype(np.float16).view(np.uint8).reshape(nb, 2)
    if wtype == "q8_0":
        q = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([scale, q], axis=1).reshape(-1), 8
    q = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
    return np.concatenate([scale, q], axis=1).reshape(-1), 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0", "f16"])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--settings", default="GEMVQ=0,GEMVQ=1")
    ap.add_argument("--n", type=int, default=1, help="tokens a product")
    ap.add_argument("--budget", type=float, default=0.15,
                    help="seconds of products a measurement aims at (against the upload's jitter)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import dasllama as d

    be = d._core.Backend(args.device, exact=False)  # q8 mode: weights not exact
    rng = np.random.default_rng(0)
    settings = [s for s in args.settings.split(",") if s]
    print(f"{args.device} {args.type} n={args.n}: us per product (weight GB/s), best of {args.rounds} rounds")
    for name in args.shapes.split(","):
        rows, cols = SHAPES[name]
        raw, qt = random_blocks(rng, args.type, rows, cols)
        x = rng.standard_normal((args.n, cols)).astype(np.float32)
        # R1 = 2 products (the first warms the pipeline), R2 enough for about --budget seconds
        # at 2 TB/s (at least 5 us a product: a stage's barrier).
        r1 = 2
        r2 = r1 + max(1, int(args.budget / max(raw.nbytes / 2e12, 5e-6)))
        best = {s: float("inf") for s in settings}
        for _ in range(args.rounds):
            for s in settings:
                k, v = s.split("=", 1)
                os.environ["DASLLAMA_VULKAN_" + k] = v
                t = []
                for r in (r1, r2):
                    t0 = time.perf_counter()
                    be.matmul(raw, qt, rows, cols, x, True, r)
                    t.append(time.perf_counter() - t0)
                os.environ.pop("DASLLAMA_VULKAN_" + k)
                best[s] = min(best[s], (t[1] - t[0]) / (r2 - r1))
        row = "  ".join(f"{s} {best[s] * 1e6:8.1f} ({raw.nbytes / best[s] / 1e9:5.0f})" for s in settings)
        print(f"  {name:8s} {rows:6d} x {cols:5d}  {row}", flush=True)


if __name__ == "__main__":
    main()
