"""Load to first token for a cached model: dasllama next to llama.cpp, interleaved in one run.

    python benchmarks/bench_load.py [--model NAME|PATH ...] [--threads 2] [--reps 5] [--llama-completion PATH]

Each run is a fresh process with the file in the page cache: ours is `python -c` importing
dasllama, `load_model`, then one greedy token of "Hello"; llama.cpp's is `llama-completion
-p Hello -n 1` (built beside llama-bench, see README.md). Both wall times include starting
the process. Ours also prints the in-process part, load_model to the first token.
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

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import dasllama as d
t1 = time.perf_counter()
m = d.load_model(sys.argv[1], n_threads=int(sys.argv[2]))
t2 = time.perf_counter()
s = d.create_session(m, n_ctx=512)
d.eval(m, s, d.encode(m, "Hello"))
int(s.logits.argmax())
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first": t3 - t2}))
"""


def ours(path: str, threads: int) -> tuple:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(threads)], capture_output=True, text=True,
                         check=True).stdout
    wall = time.perf_counter() - t
    return wall, json.loads(out.strip().splitlines()[-1])


def theirs(exe: str, path: str, threads: int) -> float:
    t = time.perf_counter()
    subprocess.run([exe, "-m", path, "-p", "Hello", "-n", "1", "-t", str(threads), "--no-warmup", "-no-cnv",
                    "--temp", "0"], capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    default_exe = os.path.join(os.path.dirname(os.environ.get("LLAMA_BENCH", "")), "llama-completion")
    ap.add_argument("--llama-completion", default=default_exe if os.environ.get("LLAMA_BENCH") else None)
    a = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')} threads={a.threads}, median of {a.reps}, file in the page cache")
    print("| model | dasllama process s | of which load_model -> first token s | llama.cpp process s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for name in a.model or ["smollm2-135m-instruct", "gemma3-270m"]:
        path = str(d.hub.resolve(name))
        ours(path, a.threads)  # page cache warm-up
        o, inner, l = [], [], []
        for _ in range(a.reps):
            w, parts = ours(path, a.threads)
            o.append(w)
            inner.append(parts["load"] + parts["first"])
            if a.llama_completion:
                l.append(theirs(a.llama_completion, path, a.threads))
        om, im = float(np.median(o)), float(np.median(inner))
        lm = float(np.median(l)) if l else float("nan")
        print(f"| {os.path.basename(path)} | {om:.3f} | {im:.3f} | {lm:.3f} | {lm / om:.2f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
