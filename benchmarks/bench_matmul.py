"""Matmul kernel speed on SmolLM2-shaped matrices: decode GEMV (GB/s of weights) and 512-token prefill (GFLOP/s).

    python benchmarks/bench_matmul.py [--types q4_0,q8_0] [--threads 1,2] [--isa avx512] [--quick]
                                      [--layouts file,packed] [--gemma]

--layouts: the file layout and/or the one Backend::prepare packs at load (where the ISA has
one; otherwise "packed" runs the file layout too). --gemma: Gemma-3-270M's k-quant matrices
(attn_output 640x1024, ffn_down 640x2048) instead of the SmolLM2 shapes.

Timings go through the CPU backend (dasllama._core.Backend("cpu", n): its thread pool and row
split, as in a forward pass) and leave out the weight's upload and packing (timed as the
difference between 1 and 1 + n repeats of the product); the activation quantization each
product does is in the figure (before 2026-11-30 a private _matmul entry left it out). Decode on the small matrices runs from cache (they fit in
L2/L3); the "big" rows stream from memory and are the bandwidth figure.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

import dasllama
from dasllama import _core, quant

# (rows, k): attn q/o, ffn gate/up, ffn down, lm head; big = larger than the L3 cache.
DECODE_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (65536, 1536)]
PREFILL_SHAPES = [(576, 576), (1536, 576), (576, 1536)]
GEMMA_SHAPES = [(640, 1024), (640, 2048)]
TYPES = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q6_K", "f16", "f32"]


def make_weights(name: str, rows: int, k: int, rng) -> np.ndarray:
    if name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "f32", "bf16"):
        w = rng.standard_normal((rows, k)).astype(np.float32)
        return quant.quantize(w, name).reshape(rows, -1)
    bs, ts = GGML_QUANT_SIZES[T[name.upper()]]
    raw = rng.integers(0, 256, size=(rows * k // bs, ts), dtype=np.uint8)
    off = {"q4_K": [0, 2], "q6_K": [208], "q5_K": [0, 2], "q2_K": [80, 82], "q3_K": [108]}[name]
    for o in off:
        raw[:, o:o + 2] = np.full(len(raw), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def best_time(fn, min_time=0.3, max_reps=200) -> float:
    fn()
    best, total, reps = float("inf"), 0.0, 0
    while total < min_time and reps < max_reps:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, total, reps = min(best, dt), total + dt, reps + 1
    return best


_BACKENDS = {}


def kernel_time(w, tid, k, x, nt, packed, reps, max_reps=200) -> float:
    """Seconds of one backend product, without the upload and packing each harness call does
    first (the loader does both once per weight)."""
    be = _BACKENDS.setdefault(nt, _core.Backend("cpu", nt))
    rows = w.shape[0]
    t1 = best_time(lambda: be.matmul(w, tid, rows, k, x, packed=packed, repeat=1), max_reps=max_reps)
    tr = best_time(lambda: be.matmul(w, tid, rows, k, x, packed=packed, repeat=reps + 1), max_reps=max_reps)
    return max(tr - t1, 1e-9) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--quick", action="store_true", help="skip the big decode matrix")
    ap.add_argument("--n-tok", type=int, default=512)
    ap.add_argument("--layouts", default="file,packed")
    ap.add_argument("--gemma", action="store_true")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    decode_shapes = GEMMA_SHAPES if args.gemma else DECODE_SHAPES
    prefill_shapes = GEMMA_SHAPES if args.gemma else PREFILL_SHAPES
    if args.isa:
        dasllama.set_isa(args.isa)
    print(f"isa {dasllama.get_isa()}")
    rng = np.random.default_rng(0)
    threads = [int(t) for t in args.threads.split(",")]
    for name in args.types.split(","):
        bs = GGML_QUANT_SIZES[T[name.upper()]][0]
        tid = int(T[name.upper()])
        for rows, k in decode_shapes:
            if k % bs or (args.quick and rows * k > 40e6):
                continue
            w = make_weights(name, rows, k, rng)
            x = rng.standard_normal((1, k)).astype(np.float32)
            for lay in layouts:
                cols = []
                for nt in threads:
                    t = kernel_time(w, tid, k, x, nt, lay == "packed", 20)
                    cols.append(f"{nt}t {w.nbytes / t / 1e9:6.1f} GB/s {t * 1e6:8.1f} us")
                print(f"decode  {name:5s} {lay:6s} {rows:6d}x{k:<5d} " + "  ".join(cols))
        for rows, k in prefill_shapes:
            if k % bs:
                continue
            w = make_weights(name, rows, k, rng)
            x = rng.standard_normal((args.n_tok, k)).astype(np.float32)
            for lay in layouts:
                cols = []
                for nt in threads:
                    t = kernel_time(w, tid, k, x, nt, lay == "packed", 2, max_reps=10)
                    cols.append(f"{nt}t {2 * rows * k * args.n_tok / t / 1e9:6.1f} GFLOP/s")
                print(f"prefill {name:5s} {lay:6s} {rows:6d}x{k:<5d} n={args.n_tok} " + "  ".join(cols))


if __name__ == "__main__":
    main()
