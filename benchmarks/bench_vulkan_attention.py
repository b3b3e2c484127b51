"""Vulkan prefill attention alone: one layer's causal attention over N query rows, per kernel.

    python benchmarks/bench_vulkan_attention.py [--tokens 512] [--shape 32,8,64] [--kv f16] [--reps 20]

Each call goes through dasllama._core.Backend("vulkan:N").paged_attention (the rows stored into a
paged cache, then one attention call over them, as a prefill chunk does) and is timed as the
difference between 1 and 1 + --reps attention calls after the same upload and store, so the host
transfers drop out. The kernels (the switches are read at each call, so one process serves them
all; rounds interleave them): row = attention.comp, a workgroup per (head, row)
(DASLLAMA_VULKAN_FLASH=0); flash = flash.comp's tiles (DASLLAMA_VULKAN_FLASHK=1); flash2 =
flash2.comp (the default for heads up to 64), with its 64-row workgroups (br64) or its reductions
through shared memory (sg0). Prints the median microseconds a call and the FMA rate of QK and PV
over the causal half. --shape is heads,kv_heads,head_dim (32,8,64: Llama-3.2-1B).
--scale S multiplies q and k by S (scores' spread S^2): bench_cuda.py's random files give
Llama-1B-shaped scores of std ~0.8 (F16, weights N(0, 0.02): S 1) or ~45 (Q8_0, every weight
+-0.26: S ~7), a flat or a one-hot softmax; the same instructions and addresses either way, so
a time that moves with S is the data's (clocks, power), not the kernel's.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np

import dasllama
from dasllama import _core

KERNELS = {"row": {"DASLLAMA_VULKAN_FLASH": "0"}, "flash": {"DASLLAMA_VULKAN_FLASHK": "1"}, "flash2": {},
           "flash2-br64": {"DASLLAMA_VULKAN_FLASH_BR": "64"}, "flash2-sg0": {"DASLLAMA_VULKAN_FLASH_SG": "0"}}
SWITCHES = ("DASLLAMA_VULKAN_FLASH", "DASLLAMA_VULKAN_FLASHK", "DASLLAMA_VULKAN_FLASH_BR", "DASLLAMA_VULKAN_FLASH_SG")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="vulkan:0")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--shape", default="32,8,64")
    ap.add_argument("--kv", default="f16", choices=["f32", "f16", "q8_0"])
    ap.add_argument("--page-rows", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernels", default=",".join(KERNELS), help="from: " + ", ".join(KERNELS))
    ap.add_argument("--scale", type=float, default=1.0, help="q and k multiplied by this")
    a = ap.parse_args()
    info = dasllama.system_info()["devices"]["vulkan"]["devices"]
    idx = int(a.device.split(":")[1]) if ":" in a.device else 0
    print(f"{info[idx]['name']}: {info[idx]['features']}; {info[idx]['driver']}", flush=True)
    n = a.tokens
    heads, kv_heads, hd = (int(x) for x in a.shape.split(","))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((n, heads * hd), np.float32) * np.float32(a.scale)
    k = rng.standard_normal((n, kv_heads * hd), np.float32) * np.float32(a.scale)
    v = rng.standard_normal((n, kv_heads * hd), np.float32)
    pos = np.arange(n, dtype=np.int32)
    pages = -(-n // a.page_rows)
    ids = np.arange(pages, dtype=np.int32)
    kvt = {"f32": 0, "f16": 1, "q8_0": 8}[a.kv]
    be = _core.Backend(a.device)
    names = [x for x in a.kernels.split(",") if x]
    times: dict = {x: [] for x in names}

    def call(rep: int) -> float:
        t = time.perf_counter()
        be.paged_attention(q, k, v, pos, heads, kv_heads, hd, kvt, a.page_rows, ids, pages, 0, 1 / math.sqrt(hd),
                           0.0, n, repeat=rep)
        return time.perf_counter() - t

    for _ in range(a.rounds):
        for x in names:
            for s in SWITCHES:
                os.environ.pop(s, None)
            os.environ.update(KERNELS[x])
            call(1)  # the pipelines made
            t1 = call(1)
            t2 = call(1 + a.reps)
            times[x].append(max(1e-9, (t2 - t1) / a.reps))
    for s in SWITCHES:
        os.environ.pop(s, None)
    fma = 2 * heads * hd * n * (n + 1) / 2  # QK and PV over the causal half
    print(f"{n} rows, {heads} heads / {kv_heads} KV heads, head {hd}, {a.kv} cache, q and k x{a.scale:g}; "
          f"medians of {a.rounds} rounds:")
    for x in names:
        s = statistics.median(times[x])
        print(f"  {x:12s} {s * 1e6:9.1f} us a call  ({fma / s / 1e9:8.1f} G FMA/s)", flush=True)


if __name__ == "__main__":
    main()
