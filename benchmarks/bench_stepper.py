"""The server's engine without HTTP: B streams on one BatchStepper (the C++ step loop `serve` runs).

    python benchmarks/bench_stepper.py MODEL.gguf [B] [--device cuda] [--prompt 138] [--gen 128] [--chunk 256]

Every stream starts at once with its own prompt; steps run until all have generated --gen tokens,
greedy and then sampled (top_k 40, top_p 0.95, min_p 0.05). Prints tokens/s over the whole run
(prefill included) and the median step in which all B streams decoded. Set beside bench_server.py's
figures, the difference is what HTTP and the event loop cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import dasllama as d
from dasllama import kv, llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("B", type=int, nargs="?", default=64)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=138)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    a = ap.parse_args()
    m = d.load_model(a.model, device=a.device)
    pages = (a.prompt + a.gen + 15) // 16 + 1
    pool = d.create_kv_pool(m, page_rows=16, max_pages=a.B * pages)
    for name, p in (("greedy", d.SamplingParams()),
                    ("sampled", d.SamplingParams(temp=1.0, top_k=40, top_p=0.95, min_p=0.05))):
        ss = [d.create_session(m, pool) for _ in range(a.B)]
        st = llm.BatchStepper(ss, a.chunk)
        for i in range(a.B):
            st.start(i, [3 + (i * 7 + k) % 1000 for k in range(a.prompt)], p, a.gen, [])
        t0, steps, toks, full = time.perf_counter(), 0, 0, []
        while any(st.active(i) for i in range(a.B)):
            t = time.perf_counter()
            ev, n_dec = st.step(True)
            if n_dec == a.B:
                full.append(time.perf_counter() - t)
            steps += 1
            toks += sum(1 for e in ev if e[1] != llm.BatchStepper.STOP)
        wall = time.perf_counter() - t0
        med = f"{statistics.median(full) * 1e3:.2f} ms" if full else "-"
        print(f"{name}: B={a.B} {steps} steps, {toks} tokens in {wall:.2f} s = {toks / wall:.0f} t/s; "
              f"full decode step median {med}", flush=True)
        for s in ss:
            kv.release_kv_pages(s)


if __name__ == "__main__":
    main()
