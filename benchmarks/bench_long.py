"""Long context: decode at depth D and prefill of N tokens, next to llama.cpp (and ik_llama.cpp), interleaved.

    python benchmarks/bench_long.py [--model NAME|PATH ...] [--depths 4096,16384] [--threads 2]
                                    [--reps 2] [--gen 32] [--llama-bench PATH] [--ik-bench PATH]

Ours: a session of depth + gen rows, one eval of `depth` random tokens (that is the
prefill figure for N = depth), then `gen` single-token evals timed (the decode figure at
that depth). llama.cpp: `llama-bench -p N -n gen -d depth` style runs (decode after a
depth-token prefill: `-n gen -d depth`; prefill: `-p N`). ik_llama.cpp takes `-rtr 1`
and `-gp depth,gen` (decode after a depth-token prompt). Depths past a model's context
are skipped. KV f16 everywhere (each tool's default).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import dasllama as d
from bench_cpu import DEFAULT_MODELS


def ours(m, depth: int, gen: int) -> tuple:
    rng = np.random.default_rng(0)
    toks = [int(x) for x in rng.integers(100, m.config.vocab_size - 1, depth + gen)]
    s = d.create_session(m, n_ctx=depth + gen)
    t = time.perf_counter()
    d.eval(m, s, toks[:depth])
    pp = depth / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(gen):
        d.eval(m, s, [toks[depth + i]])
    tg = gen / (time.perf_counter() - t)
    return pp, tg


def run_json(cmd: list) -> list:
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def llama(exe: str, path: str, threads: int, depth: int, gen: int) -> tuple:
    base = [exe, "-m", path, "-t", str(threads), "-r", "1", "-o", "json"]
    pp = run_json(base + ["-p", str(depth), "-n", "0"])[0]["avg_ts"]
    tg = run_json(base + ["-p", "0", "-n", str(gen), "-d", str(depth)])[0]["avg_ts"]
    return pp, tg


def ik(exe: str, path: str, threads: int, depth: int, gen: int) -> tuple:
    base = [exe, "-m", path, "-t", str(threads), "-r", "1", "-o", "json", "-rtr", "1"]
    pp = run_json(base + ["-p", str(depth), "-n", "0"])[0]["avg_ts"]
    rows = run_json(base + ["-p", "0", "-n", "0", "-gp", f"{depth},{gen}"])
    return pp, rows[0]["avg_ts"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--ik-bench", default=os.environ.get("IK_BENCH"))
    a = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} threads={a.threads} mode={a.mode} gen={a.gen} reps={a.reps} "
          "(mean of interleaved reps)")
    print("| model | test | dasllama t/s | llama.cpp t/s | ik_llama.cpp t/s | vs faster peer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.model or DEFAULT_MODELS:
        path = str(d.hub.resolve(name))
        m = d.load_model(path, mode=d.QuantMode[a.mode], n_threads=a.threads)
        for depth in (int(x) for x in a.depths.split(",")):
            if depth + a.gen > m.config.seq_len:
                continue
            o, l, k = [], [], []
            for _ in range(a.reps):
                o.append(ours(m, depth, a.gen))
                if a.llama_bench:
                    l.append(llama(a.llama_bench, path, a.threads, depth, a.gen))
                if a.ik_bench:
                    k.append(ik(a.ik_bench, path, a.threads, depth, a.gen))
            mean = lambda xs, i: float(np.mean([x[i] for x in xs])) if xs else float("nan")  # noqa: E731
            for i, test in ((0, f"pp{depth}"), (1, f"tg{a.gen} @ d{depth}")):
                ob, lb, kb = mean(o, i), mean(l, i), mean(k, i)
                peer = np.nanmax([lb, kb]) if (l or k) else float("nan")
                print(f"| {os.path.basename(path)} | {test} | {ob:.1f} | {lb:.1f} | {kb:.1f} | {ob / peer:.2f} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
