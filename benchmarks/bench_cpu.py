"""pp512 / tg128 tokens per second: dasllama next to llama.cpp's llama-bench, interleaved in one run.

    python benchmarks/bench_cpu.py [--model NAME|PATH ...] [--threads 2] [--reps 3] [--llama-bench PATH]

llama-bench is built from the llama.cpp source inside the llama-cpp-python sdist
(outside this repo; see benchmarks/README.md). Without it, only our figures print.
Decode figures also print as a fraction of the bandwidth ceiling: bytes of weights
read per token over the memory bandwidth measured here by a numpy copy.
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

import dasllama as d
from dasllama.gguf import GGUFFile


DEFAULT_MODELS = ["smollm2-135m-instruct", "gemma3-270m"]


def bandwidth_gbs() -> float:
    a = np.ones(256 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def weight_bytes_per_token(path: str) -> int:
    f = GGUFFile(path)
    # Every matrix is read once per token; the embedding table only one row (the
    # output matrix, tied or not, is read whole).
    total = sum(t.nbytes for n, t in f.tensors.items() if n != "token_embd.weight")
    if "output.weight" not in f.tensors:
        total += f.tensors["token_embd.weight"].nbytes
    return total


def ours(path: str, threads: int, mode: str) -> tuple:
    m = d.load_model(path, mode=d.QuantMode[mode], n_threads=threads)
    vocab = m.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, vocab - 1, 512)]
    s = d.create_session(m, n_ctx=1024)
    t = time.perf_counter()
    d.eval(m, s, prompt)
    pp = 512 / (time.perf_counter() - t)
    s = d.create_session(m, n_ctx=1024)
    d.eval(m, s, [prompt[0]])
    t = time.perf_counter()
    for i in range(128):
        d.eval(m, s, [prompt[i + 1]])
    tg = 128 / (time.perf_counter() - t)
    return pp, tg


def transformers_tps(path: str, threads: int) -> tuple:
    """transformers loading the same GGUF (dequantized to fp32), torch on the CPU."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              torch_dtype=torch.float32).eval()
    ids = torch.randint(100, hf.config.vocab_size - 1, (1, 512))
    with torch.no_grad():
        t = time.perf_counter()
        hf(ids)
        pp = 512 / (time.perf_counter() - t)
        t = time.perf_counter()
        hf.generate(ids[:, :1], max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
        tg = 128 / (time.perf_counter() - t)
    return pp, tg


def llama_bench(exe: str, path: str, threads: int) -> tuple:
    out = subprocess.run([exe, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == 512)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == 128)
    return pp, tg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", default="q8")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--variants", default="", help="also bench SmolLM2 requantized by us, e.g. q8_0,f16")
    ap.add_argument("--transformers", action="store_true", help="add transformers (fp32, torch CPU) figures")
    a = ap.parse_args()
    models = a.model or list(DEFAULT_MODELS)
    for v in filter(None, a.variants.split(",")):
        from dasllama.convert import requantize

        dst = d.hub.home() / "requant" / f"SmolLM2-135M-Instruct.{v.upper()}.gguf"
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            requantize(d.hub.pull("smollm2-135m-instruct"), dst, v)
        models.append(str(dst))
    bw = bandwidth_gbs()
    print(f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {d.system_info()['isa_active']} threads={a.threads} "
          f"bandwidth~{bw:.1f} GB/s")
    print("| model | test | dasllama t/s | llama.cpp t/s | ratio | ceiling fraction (ours) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in models:
        path = str(d.hub.resolve(name))
        wb = weight_bytes_per_token(path)
        o, l = [], []
        for _ in range(a.reps):  # interleaved: ours, then theirs, each rep
            o.append(ours(path, a.threads, a.mode))
            if a.llama_bench:
                l.append(llama_bench(a.llama_bench, path, a.threads))
        op, ot = np.mean([x[0] for x in o]), np.mean([x[1] for x in o])
        lp = np.mean([x[0] for x in l]) if l else float("nan")
        lt = np.mean([x[1] for x in l]) if l else float("nan")
        if a.transformers:
            hp, ht = transformers_tps(path, a.threads)
            print(f"| {os.path.basename(path)} (transformers fp32) | pp512 / tg128 | {hp:.1f} / {ht:.1f} | | | |")
        ceil = bw * 1e9 / wb
        base = os.path.basename(path)
        print(f"| {base} | pp512 | {op:.1f} | {lp:.1f} | {op / lp:.2f} | |")
        print(f"| {base} | tg128 | {ot:.1f} | {lt:.1f} | {ot / lt:.2f} | {ot / ceil:.2f} of {ceil:.0f} t/s |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
