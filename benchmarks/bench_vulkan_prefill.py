"""Vulkan prefill matmuls alone: Llama-3.2-1B's matrices over 512 tokens in q8 mode, per DASLLAMA_VULKAN_I8
(or another switch: --var; f16 weights on NVIDIA's f16 cooperative matrices per DASLLAMA_VULKAN_F16C).

    python benchmarks/bench_vulkan_prefill.py --types q8_0,q4_0 --modes 0,1,plain,coop
    python benchmarks/bench_vulkan_prefill.py --types f16 --var DASLLAMA_VULKAN_F16C --modes 0,1,k32,w

Each product runs through dasllama._core.Backend("vulkan:N", exact=False) (weights loaded as a
q8-mode model loads them: the split layouts) and is timed as the difference between 1 and
1 + --reps repeats after one upload, so the host transfers drop out. Modes (the switch is read at
each matmul, so one process serves them all; rounds interleave them): 0 = matmul_tile.comp's f32
tiles, 1 = the int8 GEMM (packed dot product where the device has it), plain = int8 without it,
coop = NV int8 cooperative matrices (1's shaders where the device has none: see the features
line printed first). Prints the median ms per product, its GOP/s (2 rows cols n / t),
and a layer's seven products summed (q, k, v, o, gate, up, down) with the LM head: the
matmul-only ceiling of pp512 for 16 layers. On a GPU the subgroup path must be on (the
default there); on lavapipe set DASLLAMA_VULKAN_SUBGROUP=1 and use --quick (q and k only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from gguf.constants import GGMLQuantizationType as T

import dasllama
from dasllama import _core
from bench_cuda import random_blocks

# (name, rows, cols, per layer): Llama-3.2-1B.
MATS = [("q", 2048, 2048, 1), ("k", 512, 2048, 1), ("v", 512, 2048, 1), ("o", 2048, 2048, 1),
        ("gate", 8192, 2048, 1), ("up", 8192, 2048, 1), ("down", 2048, 8192, 1), ("head", 128256, 2048, 0)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="vulkan:0")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--modes", default="0,1,plain,coop")
    ap.add_argument("--var", default="DASLLAMA_VULKAN_I8", help="the switch --modes sets")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="q and k only (lavapipe)")
    args = ap.parse_args()
    info = dasllama.system_info()["devices"]["vulkan"]["devices"]
    idx = int(args.device.split(":")[1]) if ":" in args.device else 0
    print(f"{info[idx]['name']}: {info[idx]['features']}; {info[idx]['driver']}", flush=True)
    be = _core.Backend(args.device, exact=False)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.n, 8192)).astype(np.float32)
    mats = MATS[:2] if args.quick else MATS
    modes = [m for m in args.modes.split(",") if m]
    for ft in args.types.split(","):
        t = {}
        for name, rows, cols, _ in mats:
            raw = random_blocks(rng, ft, rows, cols)
            xs = np.ascontiguousarray(x[:, :cols])
            for _ in range(args.rounds):
                for m in modes:
                    os.environ[args.var] = m
                    t0 = time.perf_counter()
                    be.matmul(raw, int(T[ft.upper()]), rows, cols, xs)
                    t1 = time.perf_counter()
                    be.matmul(raw, int(T[ft.upper()]), rows, cols, xs, repeat=1 + args.reps)
                    t2 = time.perf_counter()
                    t.setdefault((name, m), []).append(max(1e-9, ((t2 - t1) - (t1 - t0)) / args.reps))
        os.environ.pop(args.var, None)
        for m in modes:
            cells, layer, head = [], 0.0, 0.0
            for name, rows, cols, per in mats:
                s = statistics.median(t[(name, m)])
                cells.append(f"{name} {s * 1e3:.3f} ms ({2 * rows * cols * args.n / s / 1e9:.1f} GOP/s)")
                layer += per * s
                head += (1 - per) * s
            whole = "" if args.quick else f"; 16 layers + head {16 * layer + head:.2f} ms = " \
                f"{args.n / (16 * layer + head):.0f} t/s of matmuls alone"
            print(f"{ft} {args.var.replace('DASLLAMA_VULKAN_', '')}={m}: " + ", ".join(cells) + whole, flush=True)


if __name__ == "__main__":
    main()
