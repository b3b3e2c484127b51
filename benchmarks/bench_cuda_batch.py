"""Batched decode steps alone (bench_cuda.py's batched loop, without its pp512 / tg256), for
host profiles and ncu: B sessions of one KV pool on a random Llama-1B-shaped file, a 16-token
prefill, then `steps` eval_batch steps of one token each.

    DASLLAMA_CUDA_HOSTPROF=1 python benchmarks/bench_cuda_batch.py --batch 64 --steps 64
    ncu --kernel-name regex:mma_tile_k --launch-skip 130 --launch-count 2 python benchmarks/bench_cuda_batch.py --batch 16 --steps 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cuda as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--file", default=None, help="the model file (written here once if missing)")
    args = ap.parse_args()
    import dasllama as d

    path = args.file or os.path.join("/tmp", f"llama1b-{args.type}.gguf")
    if not os.path.exists(path):
        B.write_model(path, "llama1b", args.type)
    m = d.load_model(path, device=args.device)
    pool = d.create_kv_pool(m, page_rows=16, max_pages=args.batch * ((16 + args.steps) // 16 + 2))
    ss = [d.create_session(m, pool) for _ in range(args.batch)]
    ws = d.create_batch_workspace(m)
    d.eval_batch(m, ws, ss, [list(range(3, 19))] * args.batch)
    t = time.perf_counter()
    for _ in range(args.steps):
        d.eval_batch(m, ws, ss, [5] * args.batch)
    print(f"B={args.batch} {args.type}: {args.batch * args.steps / (time.perf_counter() - t):.0f} t/s over {args.steps} steps")


if __name__ == "__main__":
    main()
