"""Long context: decode at depth D and prefill of N tokens, next to llama.cpp and ik_llama.cpp, interleaved.

    python benchmarks/bench_long.py [--model NAME|PATH ...] [--depths 4096,16384] [--threads 2]
                                    [--reps 5] [--gen 64] [--llama-bench PATH] [--ik-bench PATH]
                                    [--peer-threads 1,2] [--llama-args "--poll 0,50"] [--ik-args ...]
                                    [--raw]

Every round runs each tool once per test, A B C A B C ..., and the table gives the median
of the rounds (the machine this was written on is shared, so single runs scatter); the
load average is printed before and after.

Ours: one model load per file and thread count; per round and thread count a session of
depth + gen rows, one eval of `depth` random tokens (at --threads: the prefill figure,
pp<depth>), then `gen` single-token evals timed in the same session (the decode figure at
that depth, tg<gen> @ d<depth>). llama.cpp's llama-bench:
`-p N -n 0` (prefill) and `-p 0 -n gen -d N` (decode after an N-token prefill). ik_llama.cpp's
llama-bench has no `-d`: `-p N -n 0` and `-gp N,gen` (decode after an N-token prompt, only
the decode timed), both with `-rtr 1` (its run-time repacking, its fastest CPU layout). Each
peer call is `-r 1`, a fresh process that loads the file (not timed by the tool). Depths past
a model's context are skipped. KV cache f16 everywhere (each tool's default); flash attention
is each tool's default (on for both peers' CPU decode).

Every tool at its best: decode runs at every thread count in --tg-threads (default 1 up to
--threads; the peers in one call, with every value of --llama-args / --ik-args lists, e.g.
llama.cpp's `--poll 0,50` in a build without OpenMP) and each round keeps each tool's fastest
setting, the same rule for all three. The peers' decode splits each op statically over its
threads and meets at a barrier after it, so on a shared 2-core machine where another process
holds a core, 2 threads wait on each other at every op and run several times slower than 1.
Prefill runs at --threads (its matmuls are long between syncs).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

import dasllama as d
from bench_cpu import DEFAULT_MODELS


def ours(models: dict, threads: int, depth: int, gen: int, toks: list) -> tuple:
    """(prefill t/s of `depth` tokens at `threads`, the best decode t/s of `gen` tokens after them
    over the thread counts in `models`, its thread count); one session per thread count."""
    pp, tg, what = 0.0, 0.0, ""
    for t, m in models.items():
        s = d.create_session(m, n_ctx=depth + gen)
        t0 = time.perf_counter()
        d.eval(m, s, toks[:depth])
        if t == threads:
            pp = depth / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(gen):
            d.eval(m, s, [toks[depth + i]])
        r = gen / (time.perf_counter() - t0)
        if r > tg:
            tg, what = r, f"t{t}"
        del s
    return pp, tg, what


def run_json(cmd: list) -> list:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def best(rows: list, poll: bool = False) -> tuple:
    """(fastest avg_ts of a call's settings, that setting in words)."""
    r = max(rows, key=lambda r: r["avg_ts"])
    return r["avg_ts"], f"t{r['n_threads']}" + (f" poll{r['poll']}" if poll else "")


def peer(kind: str, exe: str, path: str, threads: int, tg_threads: str, depth: int, gen: int,
         extra: list) -> tuple:
    """(prefill t/s, decode t/s at depth, the decode's winning setting)."""
    base = [exe, "-m", path, "-r", "1", "-o", "json"] + extra
    if kind == "ik":
        base += ["-rtr", "1"]
    pp, _ = best(run_json(base + ["-t", str(threads), "-p", str(depth), "-n", "0"]))
    if kind == "ik":  # its prompt is not cached across settings: each one prefills again
        tg, what = best(run_json(base + ["-t", tg_threads, "-p", "0", "-n", "0", "-gp", f"{depth},{gen}"]))
    else:  # the depth is filled once a call, then every setting decodes from it
        tg, what = best(run_json(base + ["-t", tg_threads, "-p", "0", "-n", str(gen), "-d", str(depth)]),
                        "--poll" in extra)
    return pp, tg, what


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--tg-threads", default=None, help="decode thread counts, every tool (default 1..threads)")
    ap.add_argument("--llama-poll", default=None,
                    help="llama.cpp's --poll (its threads' spin before sleeping; a list tries each; "
                         "no effect in an OpenMP build)")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments for llama.cpp")
    ap.add_argument("--ik-args", default="", help="more llama-bench arguments for ik_llama.cpp")
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--ik-bench", default=os.environ.get("IK_BENCH"))
    ap.add_argument("--raw", action="store_true", help="print every round's figures too")
    a = ap.parse_args()
    tools = [("llama.cpp", "llama", a.llama_bench), ("ik_llama.cpp", "ik", a.ik_bench)]
    tools = [t for t in tools if t[2]]
    tg_threads = a.tg_threads or ",".join(str(t) for t in range(1, a.threads + 1))
    extra = {"llama": shlex.split(a.llama_args) + (["--poll", a.llama_poll] if a.llama_poll is not None else []),
             "ik": shlex.split(a.ik_args)}
    for label, kind, exe in tools:
        print(f"# {label}: {exe} {' '.join(extra[kind])} (decode at -t {tg_threads})")
    print(f"# {time.strftime('%Y-%m-%d %H:%M %Z')} threads={a.threads} mode={a.mode} gen={a.gen} "
          f"rounds={a.reps} (median of interleaved rounds), load average {loadavg()} at the start")
    print("| model | test | dasllama t/s | llama.cpp t/s | ik_llama.cpp t/s | vs faster peer |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in a.model or DEFAULT_MODELS:
        path = str(d.hub.resolve(name))
        ms = {t: d.load_model(path, mode=d.QuantMode[a.mode], n_threads=t)
              for t in sorted({int(x) for x in tg_threads.split(",")} | {a.threads})}
        m = ms[a.threads]
        for depth in (int(x) for x in a.depths.split(",")):
            if depth + a.gen > m.config.seq_len:
                continue
            rng = np.random.default_rng(0)
            toks = [int(x) for x in rng.integers(100, m.config.vocab_size - 1, depth + a.gen)]
            res = {"ours": []} | {t[0]: [] for t in tools}
            loads = []
            for _ in range(a.reps):  # A B C A B C ...
                loads.append(loadavg().split()[0])
                res["ours"].append(ours(ms, a.threads, depth, a.gen, toks))
                for label, kind, exe in tools:
                    res[label].append(peer(kind, exe, path, a.threads, tg_threads, depth, a.gen, extra[kind]))
            for i, test in ((0, f"pp{depth}"), (1, f"tg{a.gen} @ d{depth}")):
                med = {k: float(np.median([x[i] for x in v])) if v else float("nan") for k, v in res.items()}
                peers = [med[t[0]] for t in tools]
                ratio = med["ours"] / max(peers) if peers else float("nan")
                print(f"| {os.path.basename(path)} | {test} | {med['ours']:.1f} | {med.get('llama.cpp', float('nan')):.1f} "
                      f"| {med.get('ik_llama.cpp', float('nan')):.1f} | {ratio:.2f} |")
                if a.raw:
                    print("  rounds: " + "; ".join(
                        f"{k} " + ", ".join(f"{x[i]:.1f}" + (f" ({x[2]})" if i == 1 and len(x) > 2 else "") for x in v)
                        for k, v in res.items()) + f"; load at each round's start {', '.join(loads)}")
            sys.stdout.flush()
        del m, ms
    print(f"# load average {loadavg()} at the end, {time.strftime('%H:%M %Z')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
