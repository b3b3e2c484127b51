"""A/B of CUDA (or Vulkan) backend switches on bench_cuda.py's measurements, interleaved on one machine.

    python benchmarks/ab_cuda.py --shapes llama1b,smollm135m --types q8_0,q4_0 \
        DASLLAMA_CUDA_FUSED=0 DASLLAMA_CUDA_FUSED=1,DASLLAMA_CUDA_FUSED_PF=0
    python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 DASLLAMA_VULKAN_I8=0 DASLLAMA_VULKAN_I8=1

(A switch compared this way must be read when a model loads or at each call, not once a process.)

Each random-weight file (bench_cuda.py's shapes) is written once; every setting (comma-separated
VAR=VALUE pairs, applied on top of the environment; the backend reads them when a model loads)
then runs bench_cuda's pp512 / tg256 / batched decode in turn, for --rounds rounds, so a machine's
drift hits them alike. The best of the rounds is printed per setting.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cuda as B  # noqa: E402
from gpu_clocks import ClockLog, clock_range  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama1b")
    ap.add_argument("--types", default="q8_0")
    ap.add_argument("--batches", default="", help="batched decode sizes (llama1b only), e.g. 4,16")
    ap.add_argument("--device", default="cuda", help="cuda or vulkan (cuda:N / vulkan:N)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-tg", action="store_true", help="pp512 (and batches) only")
    ap.add_argument("--greedy", action="store_true", help="batches also as greedy streams (G<B>)")
    ap.add_argument("settings", nargs="+", help="VAR=VALUE[,VAR=VALUE...]")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    gpu = int(args.device.split(":")[1]) if ":" in args.device else 0
    base = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            for ft in args.types.split(","):
                path = os.path.join(tmp, f"{shape}-{ft}.gguf")
                B.write_model(path, shape, ft)
                best: dict = {}
                mhz: dict = {st: [] for st in args.settings}  # the SM clock's samples over each setting's runs
                for _ in range(args.rounds):
                    for st in args.settings:
                        os.environ.clear()
                        os.environ.update(base)
                        os.environ.update(kv.split("=", 1) for kv in st.split(",") if kv)
                        with ClockLog(gpu) as clk:
                            r = B.bench(path, args.device, batches if shape == "llama1b" else [], tg=not args.no_tg,
                                        greedy=args.greedy)
                        mhz[st] += [m for _, m in clk.samples]
                        for k, v in r.items():
                            if k != "weight_bytes":
                                best[(st, k)] = max(best.get((st, k), 0.0), v)
                for st in args.settings:
                    row = " ".join(f"{k}={v:.0f}" for (s, k), v in best.items() if s == st)
                    if mhz[st]:
                        row += f" (SM clock {clock_range(mhz[st])})"
                    print(f"{shape} {ft} [{st}]: {row}", flush=True)
                os.remove(path)
    os.environ.clear()
    os.environ.update(base)


if __name__ == "__main__":
    main()
