"""Peak RSS of a load + 8 generated tokens: dasllama next to llama.cpp's llama-simple, interleaved.

    python benchmarks/bench_memory.py [--model NAME|PATH ...] [--reps 3] [--n-ctx 256]
                                      [--llama-simple PATH] [--mode q8]

Each measurement is a fresh process under `/usr/bin/time -v` (its "Maximum resident set
size"). llama-simple runs with its own context (prompt + 8 tokens, rounded up by
llama.cpp to 256); ours loads, makes a session of --n-ctx rows (256: the same), evals the
same prompt and 8 greedy tokens (`dasllama.sample`), once as a text-only program and once with
numpy imported first (a program that reads logits). `import dasllama` alone is measured too, and
the estimate `dasllama.estimate_memory` gave before the load.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

import dasllama as d
from bench_cpu import DEFAULT_MODELS

PROMPT = "Hello there"

# What llama-simple does: greedy sampling of 8 tokens after the prompt. A text-only program
# (no numpy: `import dasllama` does not load it); the NUMPY variant also imports numpy first,
# as a program that reads logits does.
OURS = """
import sys, dasllama as d
m = d.load_model(sys.argv[1], mode=d.QuantMode[sys.argv[2]], n_threads=2)
s = d.create_session(m, n_ctx=int(sys.argv[3]))
d.eval(m, s, d.encode(m, sys.argv[4]))
for _ in range(8):
    d.eval(m, s, [d.sample(s)])
"""
NUMPY = "import numpy\n" + OURS


def peak_rss_mb(cmd: list) -> float:
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {r.stderr[-2000:]}")
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return kb * 1024 / 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--llama-simple", default=os.environ.get("LLAMA_SIMPLE"))
    a = ap.parse_args()
    models = a.model or DEFAULT_MODELS
    py = [sys.executable, "-c"]
    base = min(peak_rss_mb(py + ["import dasllama"]) for _ in range(a.reps))
    print(f"# {time.strftime('%Y-%m-%d')} peak RSS (MB = 1e6 bytes), mode={a.mode}, n_ctx={a.n_ctx}, "
          f"min of {a.reps} interleaved runs; `import dasllama` alone: {base:.0f} MB")
    print("| model | file MB | estimate MB | dasllama MB | llama.cpp MB | ratio | with numpy MB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in models:
        path = str(d.hub.resolve(name))
        est = d.estimate_memory(path, d.QuantMode[a.mode], a.n_ctx)
        o, n, l = [], [], []
        for _ in range(a.reps):
            o.append(peak_rss_mb(py + [OURS, path, a.mode, str(a.n_ctx), PROMPT]))
            n.append(peak_rss_mb(py + [NUMPY, path, a.mode, str(a.n_ctx), PROMPT]))
            if a.llama_simple:
                l.append(peak_rss_mb([a.llama_simple, "-m", path, "-n", "8", PROMPT]))
        ob, nb, lb = min(o), min(n), (min(l) if l else float("nan"))
        print(f"| {os.path.basename(path)} | {os.path.getsize(path) / 1e6:.0f} | {est.total / 1e6:.0f} "
              f"(+{base:.0f} python) | {ob:.0f} | {lb:.0f} | {ob / lb:.2f} | {nb:.0f} | {nb / lb:.2f} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
