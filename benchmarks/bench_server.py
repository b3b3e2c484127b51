"""The server under load: `dasllama serve` against `llama-server -np N`, N concurrent streaming clients.

Each server runs alone as a subprocess (ours, then the peer; with --rounds 2: ours, peer, ours, peer),
is polled on /health until it answers, warmed up with one short request per client, then N client
threads post /v1/completions at once (stream=true, greedy, a fixed max_tokens, ignore_eos, a prompt
of their own per round so no prefix cache helps). One line per measurement, printed as it lands:
aggregate generated tokens/s over the wall (first request sent to last token received), time to
first token p50 / p90 / max, and each client's own decode tokens/s (median). Tokens are counted
from the stream's usage chunk (both servers send one with stream_options.include_usage), else
from the text chunks.

Stdlib only on the client side (http.client, threads), so it runs on a machine without network:

    # a local random-weight GGUF in Llama-3.2-1B's shape (bench_cuda's writer; needs gguf)
    python benchmarks/bench_server.py --shape llama1b --type q8_0 --device cuda --clients 64 \\
        --peer-cmd "/tmp/lcpp/bin/llama-server -m {model} -np {np} -c {ctx_total} --port {port} -ngl 99"

    # on the CPU, small: a model from the hub, ours only
    python benchmarks/bench_server.py --model smollm2-135m-instruct --clients 4 --max-tokens 32

--ours-cmd and --peer-cmd are templates: {python} {model} {port} {np} (= --clients) {ctx} (per
stream) {ctx_total} (= np x ctx) {device} {threads}. Every wait has a limit (--start-timeout,
--request-timeout, --round-timeout) and no round starts that could run past --budget; what was
measured is printed (and saved to --json) also when the run is stopped. A server is killed with
its process group when its round ends or fails; its log (stdout + stderr) is kept in --log-dir
and its tail printed when it does not come up.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

OURS = ("{python} -m dasllama serve --model {model} --port {port} --streams {np} --ctx {ctx} "
        "--queue {queue} --device {device} --threads {threads}")


def say(*a) -> None:
    print(*a, flush=True)


def load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # not every sandbox has it
        return "?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the server process ---------------------------------------------------------------------------

class Server:
    """A server subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: str, port: int, log_path: str):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.log = open(log_path, "wb")
        # A new session: killing the group also takes anything the command started (a shell, workers).
        self.proc = subprocess.Popen(shlex.split(cmd), stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answers 200; raises with the log's tail if it exits or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.tail()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                c.close()
                if r.status == 200:  # llama-server answers 503 while it loads
                    return time.monotonic() - t0
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    | " + ln for ln in lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.log.close()


# -- the clients ----------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool = False
    error: str = ""
    t_send: float = 0.0
    t_first: Optional[float] = None
    t_last: Optional[float] = None
    chunks: int = 0           # stream chunks that carried text
    usage: Optional[int] = None  # completion_tokens from the usage chunk
    prompt: Optional[int] = None  # prompt_tokens from the usage chunk
    finish: str = ""

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.chunks


def stream_completion(port: int, body: dict, timeout: float, t0: float, deadline: float, res: Result) -> None:
    """POST /v1/completions with stream=true at monotonic time ``t0`` and read its SSE frames into
    ``res``. ``timeout``: per socket read; ``deadline``: when the stream is abandoned. The connection
    is opened before ``t0``: a listen backlog smaller than the clients (Python's socketserver keeps 5)
    drops SYNs, and their one-second retransmits would land in the time to first token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode()
        conn.connect()
        if time.monotonic() > t0:
            res.error = "connect took past the start time (raise --connect-slack)"
            return
        time.sleep(max(0.0, t0 - time.monotonic()))
        res.t_send = time.monotonic()
        conn.request("POST", "/v1/completions", body=data,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = conn.getresponse()
        if r.status != 200:
            res.error = f"HTTP {r.status}: {r.read(300).decode('utf-8', 'replace')}"
            return
        while True:
            if time.monotonic() > deadline:
                res.error = "deadline passed mid-stream"
                return
            line = r.readline()
            if not line:
                res.error = res.error or "stream ended without [DONE]"
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                res.ok = True
                return
            ev = json.loads(payload)
            if "error" in ev:
                res.error = json.dumps(ev["error"])[:300]
                return
            now = time.monotonic()
            for ch in ev.get("choices") or ():
                if ch.get("text"):
                    res.chunks += 1
                    res.t_last = now
                    if res.t_first is None:
                        res.t_first = now
                if ch.get("finish_reason"):
                    res.finish = ch["finish_reason"]
            u = ev.get("usage")
            if u and u.get("completion_tokens") is not None:
                res.usage = int(u["completion_tokens"])
                if u.get("prompt_tokens") is not None:
                    res.prompt = int(u["prompt_tokens"])
    except (OSError, http.client.HTTPException, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def prompt_text(rng: random.Random, n: int) -> str:
    # The same text for both servers, tokenized by each from the same GGUF (usage.prompt_tokens says
    # how many: the random-weight vocabulary has no pieces to build "\u2581t<k>" from, so its SPM
    # falls back to bytes, ~9 tokens a word).
    return " ".join(f"t{rng.randrange(10, 30000)}" for _ in range(n))


# Request fields that choose the sampler (--sampling); greedy unless asked.
SAMPLING: dict = {"temperature": 0.0}


def _request(i: int, max_tokens: int, prompt_words: int, salt: int) -> dict:
    rng = random.Random(salt * 100003 + i)
    # ignore_eos and cache_prompt are llama-server's; ours ignores fields it does not know.
    return {"prompt": prompt_text(rng, prompt_words), "max_tokens": max_tokens, **SAMPLING,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "cache_prompt": False, "seed": i}


def _threads(ids: List[int], port: int, max_tokens: int, prompt_words: int, salt: int, t0: float,
             deadline: float, read_timeout: float) -> List[Result]:
    """One thread per client in ``ids``; all send at monotonic time ``t0`` (the same clock in every process)."""
    results = [Result() for _ in ids]

    def client(k: int) -> None:
        body = _request(ids[k], max_tokens, prompt_words, salt)
        stream_completion(port, body, read_timeout, t0, deadline, results[k])

    th = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(len(ids))]
    for t in th:
        t.start()
    for t in th:
        t.join(max(0.0, deadline - time.monotonic()) + 5)
    for k, t in enumerate(th):
        if t.is_alive():  # a daemon thread left behind: counted as failed, not waited for
            results[k].error = results[k].error or "client thread still running at the round's deadline"
            results[k].ok = False
    return results


def _worker(conn, *args) -> None:
    try:
        conn.send(_threads(*args))
    finally:
        conn.close()


def run_clients(port: int, n: int, max_tokens: int, prompt_words: int, salt: int, a) -> List[Result]:
    """n clients at once, each with its own prompt, spread over --client-procs processes: one Python
    process parsing every stream of a fast server would be the bottleneck (the GIL), not the server."""
    procs = max(1, min(a.client_procs, n))
    t0 = time.monotonic() + a.connect_slack + 0.05 * procs  # for processes, threads and connections to start
    deadline = t0 + a.round_timeout
    args = (max_tokens, prompt_words, salt, t0, deadline, a.request_timeout)
    if procs == 1:
        return _threads(list(range(n)), port, *args)
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # no threads run in this process here; the children only use the stdlib
    parts = [list(range(p, n, procs)) for p in range(procs)]
    jobs = []
    for ids in parts:
        rx, tx = ctx.Pipe(duplex=False)
        pr = ctx.Process(target=_worker, args=(tx, ids, port) + args, daemon=True)
        pr.start()
        tx.close()
        jobs.append((ids, rx, pr))
    results: List[Optional[Result]] = [None] * n
    for ids, rx, pr in jobs:
        got = None
        try:
            if rx.poll(max(0.0, deadline - time.monotonic()) + 15):
                got = rx.recv()
        except (EOFError, OSError):
            pass
        pr.join(5)
        if pr.is_alive():
            pr.kill()
            pr.join(5)
        for k, i in enumerate(ids):
            results[i] = got[k] if got else Result(error=f"client process {pr.pid} gave no results (exit {pr.exitcode})")
    return results  # type: ignore[return-value]


def pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


@dataclass
class Round:
    server: str
    round: int
    clients: int
    ok: int
    tokens: int
    wall: float
    tps: float
    ttft_p50: float
    ttft_p90: float
    ttft_max: float
    decode_p50: float
    startup: float
    tok_min: int = 0
    tok_max: int = 0
    prompt_tokens: Optional[int] = None
    errors: List[str] = field(default_factory=list)


def summarize(server: str, rnd: int, res: List[Result], startup: float) -> Round:
    # Streams cut short (an error, the deadline) still count what they received; ok= says how many finished.
    good = [r for r in res if r.t_first is not None]
    tokens = sum(r.tokens for r in good)
    if good:
        wall = max(r.t_last for r in good) - min(r.t_send for r in res if r.t_send)
    else:
        wall = float("nan")
    ttft = [r.t_first - r.t_send for r in good]
    dec = [(r.tokens - 1) / (r.t_last - r.t_first) for r in good if r.tokens > 1 and r.t_last > r.t_first]
    errs = sorted({r.error for r in res if r.error})
    counts = [r.tokens for r in good] or [0]
    prompts = [r.prompt for r in good if r.prompt is not None]
    return Round(server, rnd, len(res), sum(r.ok for r in res), tokens, wall, tokens / wall if good else 0.0,
                 pct(ttft, 0.5), pct(ttft, 0.9), max(ttft) if ttft else float("nan"),
                 statistics.median(dec) if dec else float("nan"), startup, min(counts), max(counts),
                 int(statistics.median(prompts)) if prompts else None, errs)


# -- one server's round ---------------------------------------------------------------------------

def one_round(name: str, template: str, rnd: int, model: str, a) -> Optional[Round]:
    port = free_port()
    fmt = dict(python=shlex.quote(sys.executable), model=shlex.quote(model), port=port, np=a.clients,
               ctx=a.ctx, ctx_total=a.ctx * a.clients, device=a.device, threads=a.threads,
               queue=4 * a.clients)
    cmd = template.format(**fmt)
    log = os.path.join(a.log_dir, f"{name}-r{rnd}.log")
    say(f"[{name} r{rnd}] start: {cmd}")
    try:
        srv = Server(name, cmd, port, log)
    except OSError as e:  # a wrong path in the template
        say(f"[{name} r{rnd}] FAILED to start: {e}")
        return None
    try:
        startup = srv.wait_healthy(a.start_timeout)
        say(f"[{name} r{rnd}] healthy after {startup:.1f} s (log {log})")
        # Warm-up: every client once, a few tokens (graphs, allocations, the batch shapes of N streams).
        w = summarize(name, rnd, run_clients(port, a.clients, a.warmup_tokens, a.prompt_words, 1000 + rnd, a), startup)
        say(f"[{name} r{rnd}] warm-up: {w.ok}/{w.clients} ok, {w.tokens} tokens in {w.wall:.2f} s"
            + (f"; errors: {w.errors[:3]}" if w.errors else ""))
        if w.ok == 0:
            say(srv.tail())
            return None
        r = summarize(name, rnd, run_clients(port, a.clients, a.max_tokens, a.prompt_words, rnd, a), startup)
        say(f"[{name} r{rnd}] clients={r.clients} ok={r.ok} tokens={r.tokens} wall={r.wall:.2f}s "
            f"aggregate={r.tps:.1f} t/s ttft p50={r.ttft_p50 * 1e3:.0f} ms p90={r.ttft_p90 * 1e3:.0f} ms "
            f"max={r.ttft_max * 1e3:.0f} ms per-client decode p50={r.decode_p50:.1f} t/s "
            f"tokens/client {r.tok_min}..{r.tok_max} prompt={r.prompt_tokens}"
            + (f"; errors: {r.errors[:3]}" if r.errors else ""))
        if r.ok < r.clients:
            say(srv.tail(10))
        return r
    except RuntimeError as e:
        say(f"[{name} r{rnd}] FAILED: {e}")
        return None
    finally:
        srv.stop()


def make_model(a) -> str:
    if not a.shape:
        if os.path.exists(a.model):
            return a.model
        from dasllama import hub  # a registry name: resolved (pulled if missing) by the hub

        return str(hub.resolve(a.model or hub.DEFAULT_MODEL))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_cuda import write_model  # the random-weight writer in the shapes (needs gguf)

    path = a.model or os.path.join(tempfile.gettempdir(), f"bench_server-{a.shape}-{a.type}.gguf")
    if not os.path.exists(path):
        t = time.monotonic()
        write_model(path + ".part", a.shape, a.type)
        os.replace(path + ".part", path)
        say(f"wrote {path} ({os.path.getsize(path) / 2**20:.0f} MiB) in {time.monotonic() - t:.1f} s")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="",
                    help="GGUF path or registry name (default: the hub's default model); with --shape: where to write it")
    ap.add_argument("--shape", default="", help="write a random-weight GGUF of bench_cuda's shape "
                                                "(llama1b, gemma270m, smollm135m)")
    ap.add_argument("--type", default="q8_0", help="with --shape: f16, q8_0 or q4_0")
    ap.add_argument("--device", default="cpu", help="ours: --device (cpu, cuda, cuda:N)")
    ap.add_argument("--threads", type=int, default=0, help="ours: --threads (0: its default)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streams; also the slots of both servers")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sampling", default="temperature=0",
                    help="request fields, e.g. temperature=1,top_k=40,top_p=0.95,min_p=0.05 (both servers "
                         "get the same; give every field, as their defaults differ)")
    ap.add_argument("--prompt-words", type=int, default=16,
                    help="words ' t<k>' per prompt (the random vocabulary makes ~9 tokens of each: prompt= in the output)")
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024, help="context per stream")
    ap.add_argument("--rounds", type=int, default=1, help="ours, peer, ours, peer, ...")
    ap.add_argument("--ours-cmd", default=OURS, help="template for our server (see the module doc)")
    ap.add_argument("--peer-cmd", default="", help="template for the peer, e.g. llama-server ... -np {np}")
    ap.add_argument("--servers", default="", help="which: ours,peer (default: ours, and peer if --peer-cmd)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to become healthy")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds a socket read may wait")
    ap.add_argument("--round-timeout", type=float, default=300.0, help="seconds one batch of clients may take")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="processes the client threads are spread over (0: min(8, cores // 2, clients // 8) or 1)")
    ap.add_argument("--connect-slack", type=float, default=2.5,
                    help="seconds the clients have to connect before they all send")
    ap.add_argument("--budget", type=float, default=3600.0,
                    help="seconds for the whole run (model writing included): no round starts that could pass it")
    ap.add_argument("--log-dir", default="", help="server logs (default: a temporary folder, kept)")
    ap.add_argument("--json", default="", help="write every round's figures here")
    a = ap.parse_args()
    SAMPLING.clear()
    for kv in filter(None, a.sampling.split(",")):
        k, _, v = kv.partition("=")
        try:
            SAMPLING[k.strip()] = int(v) if k.strip() == "top_k" else float(v)
        except ValueError:
            ap.error(f"--sampling: {kv!r} is not NAME=NUMBER")
    if a.clients < 1 or a.rounds < 1 or a.max_tokens < 2:
        ap.error("--clients and --rounds must be >= 1, --max-tokens >= 2")
    if a.ctx < a.max_tokens + 64:
        ap.error(f"--ctx {a.ctx} leaves too little room for a prompt beside {a.max_tokens} tokens")
    servers = a.servers.split(",") if a.servers else (["ours", "peer"] if a.peer_cmd else ["ours"])
    if "peer" in servers and not a.peer_cmd:
        ap.error("--servers peer needs --peer-cmd")
    if a.client_procs <= 0:
        a.client_procs = max(1, min(8, (os.cpu_count() or 1) // 2, a.clients // 8))
    a.log_dir = a.log_dir or tempfile.mkdtemp(prefix="bench_server-")
    os.makedirs(a.log_dir, exist_ok=True)
    # A `timeout` around us sends SIGTERM: unwind through the finally blocks, which kill the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    t_end = time.monotonic() + a.budget
    start_timeout, round_timeout = a.start_timeout, a.round_timeout
    model = make_model(a)
    say(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} model={model} device={a.device} clients={a.clients} "
        f"max_tokens={a.max_tokens} prompt_words={a.prompt_words} ctx/stream={a.ctx} rounds={a.rounds} "
        f"cores={os.cpu_count()} load={load()}")
    rounds: List[Round] = []
    try:
        for rnd in range(a.rounds):
            for name in servers:
                left = t_end - time.monotonic()
                if left < 60:  # a round needs a start, a warm-up and the clients: do not begin one that cannot end
                    say(f"[{name} r{rnd}] skipped: {left:.0f} s of --budget left")
                    continue
                # Every wait of this round ends inside the budget.
                a.start_timeout, a.round_timeout = min(start_timeout, left - 40), min(round_timeout, (left - 30) / 2)
                r = one_round(name, a.ours_cmd if name == "ours" else a.peer_cmd, rnd, model, a)
                if r is not None:
                    rounds.append(r)
    finally:  # also on SIGTERM / Ctrl-C: what was measured is printed and saved
        report(servers, rounds, model, a)
    return 0 if rounds and all(r.ok == r.clients for r in rounds) else 1


def report(servers: List[str], rounds: List[Round], model: str, a) -> None:
    say("\n| server | rounds | aggregate t/s | TTFT p50 ms | TTFT p90 ms | per-client decode t/s | ok |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for name in servers:
        rs = [r for r in rounds if r.server == name]
        if not rs:
            say(f"| {name} | 0 | failed | | | | |")
            continue
        med = lambda k: statistics.median(getattr(r, k) for r in rs)  # noqa: E731
        say(f"| {name} | {len(rs)} | {med('tps'):.1f} | {med('ttft_p50') * 1e3:.0f} | {med('ttft_p90') * 1e3:.0f} | "
            f"{med('decode_p50'):.1f} | {sum(r.ok for r in rs)}/{sum(r.clients for r in rs)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "model": model, "rounds": [r.__dict__ for r in rounds]}, f, indent=1)

if __name__ == "__main__":
    sys.exit(main())
