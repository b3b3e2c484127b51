"""Where a CUDA decode step's time goes: host wall time per step against the GPU's own
timeline (kernels, gaps, copies), read from CUPTI through torch's profiler, which sees
every kernel of the process, ours included. Run on the GPU machine:

    python benchmarks/profile_cuda.py --shape llama1b --type q8_0 [--steps 32] [--trace out.json]
    python benchmarks/profile_cuda.py --shape llama1b --type q8_0 --prefill 512 --steps 4   # prefills
    python benchmarks/profile_cuda.py --shape llama1b --type q8_0 --batch 64                # batched steps
    BENCH_MODE=fp32 python benchmarks/profile_cuda.py ...                                    # another QuantMode

Prints, per decode step: host wall time, GPU span (first kernel start to last end), the
sum of kernel times, the gaps between them, and the kernels grouped by name, each with its own
share of the timeline (where dependent launches overlap, the part no earlier kernel covers).
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import tempfile
import time

from bench_cuda import SHAPES, load, write_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama1b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16, help="prompt tokens before the profiled steps")
    ap.add_argument("--trace", default=None, help="write a chrome trace here")
    ap.add_argument("--prefill", type=int, default=0,
                    help="profile prefills of this many tokens (one a 'step') instead of decode steps")
    ap.add_argument("--batch", type=int, default=0,
                    help="profile batched decode steps of this many sessions (eval_batch over a KV pool)")
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import dasllama as d

    torch.zeros(1, device="cuda")  # CUPTI and the context up before the model
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        write_model(path, args.shape, args.type)
        m = load(path, "cuda")
        if args.prefill:
            prompt = list(range(3, 3 + args.prefill))

            def step():
                d.eval(m, d.create_session(m, n_ctx=args.prefill + 16), prompt)
        elif args.batch:
            pool = d.create_kv_pool(m, page_rows=16, max_pages=args.batch * ((args.ctx + 3 * args.steps + 64) // 16 + 2))
            ss = [d.create_session(m, pool) for _ in range(args.batch)]
            ws = d.create_batch_workspace(m)
            d.eval_batch(m, ws, ss, [list(range(3, 3 + args.ctx))] * args.batch)

            def step():
                d.eval_batch(m, ws, ss, [5] * args.batch)
        else:
            s = d.create_session(m, n_ctx=args.ctx + 3 * args.steps + 64)
            d.eval(m, s, list(range(3, 3 + args.ctx)))

            def step():
                d.eval(m, s, [5])
        for _ in range(min(args.steps, 4) if args.prefill else args.steps):  # warm: graphs captured
            step()
        wall = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                wall.append(time.perf_counter() - t)
        if args.trace:
            prof.export_chrome_trace(args.trace)
    kernels, api = [], []
    for e in prof.events():
        if e.device_type.name == "CUDA" or str(e.device_type).endswith("CUDA"):
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif e.name.startswith("cuda"):  # the host's CUDA runtime calls (CUPTI's runtime activity)
            api.append((e.time_range.start, e.time_range.end, e.name))
    kernels.sort()
    api.sort()
    print(f"{args.shape} {args.type}: {len(kernels)} GPU activities over {args.steps} steps "
          f"({len(kernels) / args.steps:.0f} per step)")
    print(f"host wall per step: median {statistics.median(wall) * 1e3:.3f} ms, min {min(wall) * 1e3:.3f} ms")
    if not kernels:
        print("no GPU activity recorded (CUPTI did not see this process's kernels)")
        return
    span = (kernels[-1][1] - kernels[0][0]) / args.steps
    busy = sum(b - a for a, b, _ in kernels) / args.steps
    gaps = []
    for (a0, b0, _), (a1, b1, _) in zip(kernels, kernels[1:]):
        gaps.append(a1 - b0)
    small = [g for g in gaps if g < 200] or [0.0]  # within a step (us); larger ones are between steps
    print(f"GPU per step: span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f} ms, "
          f"in-step gaps {sum(small) / args.steps / 1e3:.3f} ms (median gap {statistics.median(small):.2f} us), "
          f"between-step gaps {sum(g for g in gaps if g >= 200) / args.steps / 1e3:.3f} ms")
    # The device idle between steps (gaps of 20 us or more), and the host's runtime calls that
    # ran inside those gaps: what the host was doing while the device waited for it.
    idle = [(b0, a1) for (_, b0, _), (a1, _, _) in zip(kernels, kernels[1:]) if a1 - b0 >= 20]
    if idle:
        inside = collections.defaultdict(list)
        for g0, g1 in idle:
            for a, b, n in api:
                if b > g0 and a < g1:
                    inside[n].append(min(b, g1) - max(a, g0))
        print(f"device idle >= 20 us: {len(idle)} gaps, mean {statistics.mean(g1 - g0 for g0, g1 in idle):.1f} us; "
              "runtime calls inside them (us of the gaps they cover, per gap):")
        for n, ts in sorted(inside.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {n:40s} {len(ts) / len(idle):5.1f} calls {sum(ts) / len(idle):8.1f} us")
    calls = collections.defaultdict(list)
    for a, b, n in api:
        calls[n].append(b - a)
    print("runtime calls per step (all of them): " + ", ".join(
        f"{n} {len(ts) / args.steps:.1f} x {statistics.mean(ts):.1f} us"
        for n, ts in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:6]))
    # With dependent launches a kernel starts while the one before still runs, so durations
    # overlap. Its own share of the timeline: from where every earlier activity had ended (or its
    # start, if later) to its end. These shares sum to the busy span.
    by, own = collections.defaultdict(list), collections.defaultdict(float)
    done = kernels[0][0]
    for a, b, n in kernels:
        n = n.replace("dl::cuda::(anonymous namespace)::", "").replace("void ", "")
        n = n.split("(")[0][:80]
        by[n].append(b - a)
        own[n] += max(0.0, b - max(a, done))
        done = max(done, b)
    print(f"{'kernel':80s} {'per step':>8s} {'mean us':>8s} {'max us':>8s} {'ms/step':>8s} {'own us':>8s} {'own ms':>8s}")
    for n, ts in sorted(by.items(), key=lambda kv: -own[kv[0]]):
        print(f"{n:80s} {len(ts) / args.steps:8.1f} {statistics.mean(ts):8.2f} {max(ts):8.2f} {sum(ts) / args.steps / 1e3:8.3f}"
              f" {own[n] / len(ts):8.2f} {own[n] / args.steps / 1e3:8.3f}")


if __name__ == "__main__":
    main()
