"""Per-step overhead of the server's step loop: the C++ BatchStepper against the Python loop it replaced.

B paged streams decode greedily in lockstep; each step is timed three ways on the same batch shape:
  forward   eval_batch alone (the ragged forward; the floor)
  python    the old engine step: eval_batch, then per stream llm.sample + the token's bytes from Python
  stepper   BatchStepper.step (forward, samples, stop checks and bytes in one C++ call, GIL released)
Both loops then decode the bytes as the engine does (incremental UTF-8). Overhead = step - forward.

    python benchmarks/bench_engine_step.py [--model NAME|PATH] [--device cpu|cuda] [--streams 1,8,64]
                                           [--steps 64] [--threads 0] [--shape tiny|smollm135m --type q8_0]
"""
from __future__ import annotations

import argparse
import codecs
import json
import time

import numpy as np

import dasllama as d
from dasllama import kv, llm


def _streams(m, B, n_ctx):
    pool = kv.create_kv_pool(m, page_rows=16, max_pages=B * ((n_ctx + 15) // 16) + 8)
    return pool, [llm.create_session(m, pool, n_ctx=n_ctx) for _ in range(B)]


def _prompts(m, B, n=8):
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(100, m.config.vocab_size - 1, n)] for _ in range(B)]


def run(m, B, steps, n_ctx):
    params = d.SamplingParams()
    prompts = _prompts(m, B)
    eog = set(m.eog_ids)
    decs = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(B)]
    ws = llm.create_batch_workspace(m)
    out = {}

    # python: the loop the engine ran before (prefill, then decode steps, all from Python).
    pool, ss = _streams(m, B, n_ctx)
    llm.eval_batch(m, ws, ss, prompts)
    nxt = [llm.sample(s, params) for s in ss]
    t_py, t_fw = [], []
    for _ in range(steps):
        live = [i for i in range(B) if nxt[i] >= 0]
        if len(live) < B:
            break
        t0 = time.perf_counter()
        llm.eval_batch(m, ws, [ss[i] for i in live], [nxt[i] for i in live])
        t1 = time.perf_counter()
        for i in live:
            tok = llm.sample(ss[i], params)
            if tok in eog:
                nxt[i] = -1
                continue
            decs[i].decode(m._m.render(tok, False))  # what the old engine called per token
            nxt[i] = tok
        t2 = time.perf_counter()
        t_fw.append(t1 - t0)
        t_py.append(t2 - t0)
    del ss, pool

    # stepper: the same streams through the C++ loop.
    pool, ss = _streams(m, B, n_ctx)
    st = llm.BatchStepper(ss, chunk=256)
    for i in range(B):
        st.start(i, prompts[i], params, n_ctx, [], float(i))
    while st.next_prefill() >= 0:  # one prompt per step, as the engine prefills
        st.step()
    t_st = []
    for _ in range(len(t_py)):
        t0 = time.perf_counter()
        ev, n_dec = st.step()
        for slot, kind, _tok, piece in ev:
            if kind != llm.BatchStepper.STOP:
                decs[slot].decode(piece)
        t_st.append(time.perf_counter() - t0)
        if n_dec < B or any(k != llm.BatchStepper.TOKEN for _, k, _, _ in ev):
            break
    n = min(len(t_py), len(t_st))
    med = lambda v: float(np.median(v[:n])) * 1e3  # noqa: E731
    out = {"streams": B, "steps": n, "forward_ms": med(t_fw), "python_step_ms": med(t_py),
           "stepper_step_ms": med(t_st)}
    out["python_overhead_ms"] = out["python_step_ms"] - out["forward_ms"]
    out["stepper_overhead_ms"] = out["stepper_step_ms"] - out["forward_ms"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None)
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--shape", default="", help="random weights of a bench_cuda.py shape instead of --model")
    ap.add_argument("--type", default="q8_0")
    a = ap.parse_args()
    path = a.model
    if a.shape:  # e.g. on a machine without the model files: gguf-py writes the random model
        import os
        import sys
        import tempfile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_cuda import SHAPES, write_model

        # A toy decoder with a real vocabulary: the forward is cheap, so what a step adds shows.
        SHAPES.setdefault("tiny", (128, 2, 4, 2, 32, 256, 49152))

        path = os.path.join(tempfile.mkdtemp(), f"{a.shape}-{a.type}.gguf")
        write_model(path, a.shape, a.type)
    m = d.load_model(path, n_threads=a.threads, device=a.device)
    print(m)
    for B in [int(x) for x in a.streams.split(",")]:
        run(m, B, 4, 128)  # warm-up (allocations, graphs)
        print(json.dumps(run(m, B, a.steps, 128 + a.steps + 16)), flush=True)


if __name__ == "__main__":
    main()
