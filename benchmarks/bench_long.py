"""Long context: decode at depth D and prefill of N tokens, next to llama.cpp and ik_llama.cpp, interleaved.

    python benchmarks/bench_long.py [--model NAME|PATH ...] [--depths 4096,16384] [--threads 2]
                                    [--reps 5] [--gen 32] [--llama-bench PATH] [--ik-bench PATH]
                                    [--llama-poll 0] [--raw]

Every round runs each tool once per test, A B C A B C ..., and the table gives the median
of the rounds (the machine this was written on is shared, so single runs scatter); the
load average is printed before and after.

Ours: one model load per file; per round a session of depth + gen rows, one eval of
`depth` random tokens (the prefill figure, pp<depth>), then `gen` single-token evals
timed in the same session (the decode figure at that depth, tg<gen> @ d<depth>). llama.cpp's llama-bench:
`-p N -n 0` (prefill) and `-p 0 -n gen -d N` (decode after an N-token prefill). ik_llama.cpp's
llama-bench has no `-d`: `-p N -n 0` and `-gp N,gen` (decode after an N-token prompt), both
with `-rtr 1` (its run-time repacking, its fastest CPU layout). Each peer call is `-r 1`, a
fresh process that loads the file (not timed by the tool). Depths past a model's context are
skipped. KV cache f16 everywhere (each tool's default); flash attention is each tool's default.
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


def ours(m, depth: int, gen: int, toks: list) -> tuple:
    """(prefill t/s of `depth` tokens, decode t/s of `gen` tokens after them), one session."""
    s = d.create_session(m, n_ctx=depth + gen)
    t = time.perf_counter()
    d.eval(m, s, toks[:depth])
    pp = depth / (time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(gen):
        d.eval(m, s, [toks[depth + i]])
    return pp, gen / (time.perf_counter() - t)


def run_json(cmd: list) -> list:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def peer(kind: str, exe: str, path: str, threads: int, depth: int, gen: int, extra: list) -> tuple:
    base = [exe, "-m", path, "-t", str(threads), "-r", "1", "-o", "json"] + extra
    if kind == "ik":
        base += ["-rtr", "1"]
    pp = run_json(base + ["-p", str(depth), "-n", "0"])[0]["avg_ts"]
    if kind == "ik":
        return pp, run_json(base + ["-p", "0", "-n", "0", "-gp", f"{depth},{gen}"])[0]["avg_ts"]
    return pp, run_json(base + ["-p", "0", "-n", str(gen), "-d", str(depth)])[0]["avg_ts"]


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--llama-poll", default=None,
                    help="llama.cpp's --poll (its threads' spin before sleeping; 0 suits a busy machine)")
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--ik-bench", default=os.environ.get("IK_BENCH"))
    ap.add_argument("--raw", action="store_true", help="print every round's figures too")
    a = ap.parse_args()
    tools = [("llama.cpp", "llama", a.llama_bench), ("ik_llama.cpp", "ik", a.ik_bench)]
    tools = [t for t in tools if t[2]]
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')} threads={a.threads} mode={a.mode} gen={a.gen} "
          f"rounds={a.reps} (median of interleaved rounds), load average {loadavg()} at the start")
    print("| model | test | dasllama t/s | llama.cpp t/s | ik_llama.cpp t/s | vs faster peer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.model or DEFAULT_MODELS:
        path = str(d.hub.resolve(name))
        m = d.load_model(path, mode=d.QuantMode[a.mode], n_threads=a.threads)
        for depth in (int(x) for x in a.depths.split(",")):
            if depth + a.gen > m.config.seq_len:
                continue
            rng = np.random.default_rng(0)
            toks = [int(x) for x in rng.integers(100, m.config.vocab_size - 1, depth + a.gen)]
            res = {"ours": []} | {t[0]: [] for t in tools}
            for _ in range(a.reps):  # A B C A B C ...
                res["ours"].append(ours(m, depth, a.gen, toks))
                for label, kind, exe in tools:
                    extra = ["--poll", a.llama_poll] if kind == "llama" and a.llama_poll is not None else []
                    res[label].append(peer(kind, exe, path, a.threads, depth, a.gen, extra))
            for i, test in ((0, f"pp{depth}"), (1, f"tg{a.gen} @ d{depth}")):
                med = {k: float(np.median([x[i] for x in v])) if v else float("nan") for k, v in res.items()}
                peers = [med[t[0]] for t in tools]
                ratio = med["ours"] / max(peers) if peers else float("nan")
                print(f"| {os.path.basename(path)} | {test} | {med['ours']:.1f} | {med.get('llama.cpp', float('nan')):.1f} "
                      f"| {med.get('ik_llama.cpp', float('nan')):.1f} | {ratio:.2f} |")
                if a.raw:
                    print("  rounds: " + "; ".join(f"{k} " + ", ".join(f"{x[i]:.1f}" for x in v) for k, v in res.items()))
            sys.stdout.flush()
        del m
    print(f"# load average {loadavg()} at the end, {time.strftime('%H:%M %Z')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
