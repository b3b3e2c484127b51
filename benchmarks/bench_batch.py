"""Batched decode and prefix-cache figures: tokens/s of eval_batch at B sessions over one
paged pool, time to first token for a long shared prefix cold and on a prefix hit, and
single-stream decode on flat against paged sessions (the paging overhead).

    python benchmarks/bench_batch.py [--model NAME|PATH] [--threads 2] [--batch 1,4,8,16]
                                     [--prefix 1000] [--compare-site DIR]

--compare-site DIR also runs the single-stream decode figures with the dasllama
installed in DIR (e.g. a build of main: pip install --target DIR), interleaved with
ours, so "before" and "after" come from the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

if os.environ.get("DASLLAMA_BENCH_SITE"):
    # The --compare-site child: import dasllama from that folder, not from an editable
    # install (whose import hook would otherwise win over sys.path).
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
    sys.path.insert(0, os.environ["DASLLAMA_BENCH_SITE"])
import dasllama as d  # noqa: E402


def _prompt(rng, vocab, n):
    return [int(x) for x in rng.integers(100, vocab - 1, n)]


def tg(m, make_session, ctx: int, n: int = 128) -> float:
    """Decode tokens/s of one session, n steps after a prefill of ctx tokens."""
    rng = np.random.default_rng(0)
    toks = _prompt(rng, m.config.vocab_size, ctx + n + 1)
    s = make_session()
    d.eval(m, s, toks[:ctx + 1])
    t = time.perf_counter()
    for i in range(n):
        d.eval(m, s, [toks[ctx + 1 + i]])
    return n / (time.perf_counter() - t)


def single_stream(path: str, threads: int, mode: str, paged: bool) -> dict:
    m = d.load_model(path, mode=d.QuantMode[mode], n_threads=threads)
    out = {}
    for ctx in (1, 1000):
        out[f"flat tg128 @{ctx}"] = tg(m, lambda: d.create_session(m, n_ctx=2048), ctx)
        if paged:
            pool = d.create_kv_pool(m, page_rows=64)
            out[f"paged tg128 @{ctx}"] = tg(m, lambda: d.create_session(m, pool), ctx)
    return out


def batched(m, B: int, steps: int, paged: bool) -> float:
    rng = np.random.default_rng(B)
    pool = d.create_kv_pool(m, page_rows=64, max_pages=16 * B + 16) if paged else None
    ss = []
    for i in range(B):
        s = d.create_session(m, pool) if paged else d.create_session(m, n_ctx=512)
        d.eval(m, s, _prompt(rng, m.config.vocab_size, 8 + 7 * i))  # different lengths
        ss.append(s)
    ws = d.create_batch_workspace(m)
    toks = [int(np.argmax(s.logits)) for s in ss]
    t = time.perf_counter()
    for _ in range(steps):
        d.eval_batch(m, ws, ss, toks)
        toks = [int(np.argmax(s.logits)) for s in ss]
    return B * steps / (time.perf_counter() - t)


def ttft(m, prefix_len: int, reps: int) -> tuple:
    """Seconds to the first token of prefix + a short question: cold, and attached to the cached prefix."""
    rng = np.random.default_rng(7)
    prefix = _prompt(rng, m.config.vocab_size, prefix_len)
    pool = d.create_kv_pool(m, page_rows=64)
    cache = d.create_prefix_cache()
    cold, hit, matched = [], [], 0
    for r in range(reps):
        q = _prompt(rng, m.config.vocab_size, 16)
        s = d.create_session(m, pool)
        t = time.perf_counter()
        d.eval(m, s, prefix + q)
        d.sample(s)
        cold.append(time.perf_counter() - t)
        if r == 0:
            d.prefix_insert(cache, pool, s, s.history)
        d.release_kv_pages(s)
        q = _prompt(rng, m.config.vocab_size, 16)
        s = d.create_session(m, pool)
        t = time.perf_counter()
        matched = d.prefix_attach(cache, pool, s, prefix + q)
        d.eval(m, s, (prefix + q)[matched:])
        d.sample(s)
        hit.append(time.perf_counter() - t)
        d.release_kv_pages(s)
    return float(np.median(cold)), float(np.median(hit)), matched


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--batch", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare-site", default="")
    ap.add_argument("--sections", default="batch,ttft,single", help="which figures: batch, ttft, single")
    ap.add_argument("--single-stream-json", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    path = str(d.hub.resolve(a.model))
    if a.single_stream_json:  # the child run for --compare-site (an older build: flat sessions only)
        print(json.dumps({**single_stream(path, a.threads, a.mode, hasattr(d, "create_kv_pool")),
                          "module": d.__file__}))
        return 0

    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {platform.machine()} {d.system_info()['isa_active']} "
          f"threads={a.threads} mode={a.mode} {os.path.basename(path)}")
    m = d.load_model(path, mode=d.QuantMode[a.mode], n_threads=a.threads)

    sections = set(a.sections.split(","))
    if "batch" in sections:
        batch_table(m, a)
    if "ttft" in sections:
        c, h, n = ttft(m, a.prefix, a.reps)
        print(f"\nTTFT, {a.prefix}-token shared prefix + 16-token question (median of {a.reps}):")
        print(f"| cold | prefix hit ({n} rows attached) | speedup |\n| --- | --- | --- |")
        print(f"| {c * 1e3:.0f} ms | {h * 1e3:.0f} ms | {c / h:.1f}x |")
        sys.stdout.flush()
    if "single" in sections:
        single_table(path, a)
    return 0


def batch_table(m, a) -> None:
    print("\n| B | paged t/s | flat t/s | paged vs B = 1 |")
    print("| --- | --- | --- | --- |")
    base = None
    for B in [int(x) for x in a.batch.split(",")]:
        p = float(np.median([batched(m, B, a.steps, True) for _ in range(a.reps)]))
        f = float(np.median([batched(m, B, a.steps, False) for _ in range(a.reps)]))
        base = base or p
        print(f"| {B} | {p:.1f} | {f:.1f} | {p / base:.2f} |")
        sys.stdout.flush()


def single_table(path: str, a) -> None:
    # Single stream: flat vs paged here, and the build in --compare-site, interleaved.
    ours, theirs = [], []
    for rep in range(a.reps):
        ours.append(single_stream(path, a.threads, a.mode, True))
        if a.compare_site:
            env = dict(os.environ, DASLLAMA_BENCH_SITE=os.path.abspath(a.compare_site))
            cmd = [sys.executable, os.path.abspath(__file__), "--model", path, "--threads", str(a.threads),
                   "--mode", a.mode, "--single-stream-json"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd="/").stdout
            theirs.append(json.loads(out.strip().splitlines()[-1]))
            if rep == 0:
                print(f"(--compare-site build: {theirs[0].pop('module')})")
            theirs[-1].pop("module", None)
    print(f"\nSingle-stream decode t/s (mean of {a.reps}, f16 KV, pages of 64 rows):")
    print("| test | this build | " + ("--compare-site build |" if theirs else "") + "\n| --- | --- |" +
          (" --- |" if theirs else ""))
    for k in ours[0]:
        row = f"| {k} | {np.mean([o[k] for o in ours]):.1f} |"
        if theirs and k in theirs[0]:
            row += f" {np.mean([t[k] for t in theirs]):.1f} |"
        elif theirs:
            row += " |"
        print(row)


if __name__ == "__main__":
    sys.exit(main())
