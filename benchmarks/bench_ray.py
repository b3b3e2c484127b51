"""Throughput and time to first token of `dasllama serve --ray` with 1 and 2 real replicas.

A local Ray cluster serves SmolLM2 (single-thread replicas, 2 streams each); ``--clients`` threads each
hold a multi-turn conversation through the openai client (streaming, greedy), all at once. Reported per
replica count: generated tokens per second over the run, mean and p90 TTFT, and the share of prompt
tokens served from the replicas' prefix caches.

    python benchmarks/bench_ray.py --replicas 1 2 --clients 8 --turns 3
"""
from __future__ import annotations

import argparse
import socket
import threading
import time

import openai
import ray
from ray import serve

from dasllama import hub
from dasllama.server.ray import build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(base: str, clients: int, turns: int, max_tokens: int):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=3, timeout=900)
    ttft, tokens = [], [0]
    lock = threading.Lock()
    system = "You are a helpful assistant who answers in one or two sentences. " * 6

    def conv(i):
        msgs = [{"role": "system", "content": system}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Question {t} of conversation {i}: name a fact about the number {i * 7 + t}."})
            t0 = time.perf_counter()
            first = None
            parts, n = [], 0
            for ch in oai.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=max_tokens,
                                                  stream=True, stream_options={"include_usage": True}):
                if ch.choices and ch.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    parts.append(ch.choices[0].delta.content)
                if ch.usage:
                    n = ch.usage.completion_tokens
            with lock:
                ttft.append(first if first is not None else time.perf_counter() - t0)
                tokens[0] += n
            msgs.append({"role": "assistant", "content": "".join(parts)})

    t0 = time.perf_counter()
    th = [threading.Thread(target=conv, args=(i,)) for i in range(clients)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    ttft.sort()
    return tokens[0] / wall, sum(ttft) / len(ttft), ttft[int(0.9 * (len(ttft) - 1))], wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    path = hub.pull("smollm2-135m-instruct")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    print("| replicas | tokens/s | TTFT mean s | TTFT p90 s | cached share | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    try:
        for n in args.replicas:
            serve.run(build_app(path, replicas=n, replica_cpus=1.0, streams=2, ctx=2048, n_threads=args.threads),
                      name=f"r{n}", route_prefix=f"/r{n}")
            base = f"http://127.0.0.1:{port}/r{n}"
            run(base, 1, 1, 4)  # warm-up
            import httpx

            def cached():
                m = {}
                for ln in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
                    if ln.startswith("dasllama_") and "{" not in ln:
                        k, v = ln.split()
                        m[k] = float(v)
                return m["dasllama_cached_tokens_total"], m["dasllama_prompt_tokens_total"]

            c0, p0 = cached()
            tps, mean, p90, wall = run(base, args.clients, args.turns, args.max_tokens)
            time.sleep(2)
            c1, p1 = cached()
            print(f"| {n} | {tps:.1f} | {mean:.2f} | {p90:.2f} | {(c1 - c0) / max(p1 - p0, 1):.2f} | {wall:.0f} |",
                  flush=True)
            serve.delete(f"r{n}")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
