"""Cache-affine routing at scale, in simulation: a synthetic trace of multi-turn conversations replayed
through the router's real code (dasllama.server.routing: request_keys, AffinityPolicy) against simulated
replicas, beside round-robin and least-loaded routing.

The trace: conversations arrive as a Poisson process (the rate grows with the replica count, so each
replica sees the same offered load); each picks one of a few shared system prompts (Zipf), has 1-8
turns with lognormal user-turn and reply lengths and exponential think times between turns, and a
share of them opens with an audio clip drawn from a pool of repeated clips (Zipf). Each request is the
OpenAI chat body a client would send (the whole conversation so far), so the keys are the router's own.

A simulated replica: ``streams`` requests at a time, FIFO beyond; a request costs a prefill of its
uncached weight (characters ~ tokens x 4; an uncached clip also costs an encode) plus its reply's decode;
its cache is an LRU over prefix keys with a budget in weight, filled with the prompt and the reply when
a request ends. Replicas report their cached keys every ``period`` seconds, as record_routing_stats does.

Reported: the cache hit rate (cached prompt weight / prompt weight), the load imbalance (busiest
replica's work / mean work), and mean / p99 time to first token, per policy and replica count.

    python benchmarks/sim_routing.py                       # 2..64 replicas, 4000 conversations
    python benchmarks/sim_routing.py --replicas 2 8 --conversations 1000
"""
from __future__ import annotations

import argparse
import base64
import collections
import heapq
import math
import random
import time
from typing import Dict, List, Optional

from dasllama.server.routing import AffinityPolicy, Keys, reply_keys, request_keys

PREFILL_S_PER_CHAR = 0.25e-3   # ~1 ms a token at 4 characters a token
ENCODE_S = 0.3                 # an audio clip through the tower
DECODE_S_PER_CHAR = 5e-3       # ~20 ms a token


_LETTERS = bytes((b"abcdefghijklmnopqrstuvwxyz      " * 8)[:256])


def words(rng: random.Random, n: int) -> str:
    return rng.randbytes(n).translate(_LETTERS).decode()


class Trace:
    def __init__(self, n_conv: int, seed: int = 0, n_system: int = 8, n_clips: int = 200, clip_share: float = 0.3):
        rng = random.Random(seed)
        self.systems = [words(rng, rng.randint(400, 3000)) for _ in range(n_system)]
        self.clips = [base64.b64encode(rng.randbytes(64)).decode() for _ in range(n_clips)]
        self.convs = []
        zipf_s = [1 / (i + 1) for i in range(n_system)]
        zipf_c = [1 / (i + 1) ** 1.1 for i in range(n_clips)]
        for _ in range(n_conv):
            sys_prompt = rng.choices(self.systems, zipf_s)[0]
            clip = rng.choices(self.clips, zipf_c)[0] if rng.random() < clip_share else None
            turns = []
            for _t in range(min(8, 1 + int(rng.expovariate(1 / 2.5)))):
                turns.append((words(rng, int(rng.lognormvariate(5.0, 0.8))),
                              words(rng, int(rng.lognormvariate(5.5, 0.6))),
                              rng.expovariate(1 / 20.0)))
            self.convs.append((sys_prompt, clip, turns))

    def bodies(self, c: int):
        """The chat bodies of conversation c's turns, with each turn's reply and think time."""
        sys_prompt, clip, turns = self.convs[c]
        msgs = [{"role": "system", "content": sys_prompt}]
        for i, (q, a, think) in enumerate(turns):
            if i == 0 and clip is not None:
                msgs.append({"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
                    {"type": "text", "text": q}]})
            else:
                msgs.append({"role": "user", "content": q})
            body = {"messages": list(msgs)}
            yield body, a, think
            msgs.append({"role": "assistant", "content": a})


class SimReplica:
    def __init__(self, streams: int, budget: int):
        self.streams = streams
        self.budget = budget
        self.cache: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # key -> its weight
        self.used = 0
        self.running = 0
        self.queue: collections.deque = collections.deque()
        self.work = 0.0

    def load(self) -> int:
        return self.running + len(self.queue)

    def hit(self, keys: Keys, clip_at: List[int]) -> (int, bool):
        """(cached weight of the longest cached prefix, whether an uncached clip must be encoded)."""
        n = 0
        for i in range(len(keys.keys) - 1, -1, -1):
            if keys.keys[i] in self.cache:
                n = i + 1
                break
        for k in reversed(keys.keys[:n]):  # the root touched last: leaves go first, as in the real cache
            if k in self.cache:
                self.cache.move_to_end(k)
        w = keys.weights[n - 1] if n else 0
        return w, any(i >= n for i in clip_at)

    def insert(self, keys: Keys) -> None:
        for i in range(len(keys.keys) - 1, -1, -1):  # leaf first, root last (most recent)
            k = keys.keys[i]
            if k in self.cache:
                self.cache.move_to_end(k)
            else:
                w = keys.weights[i] - (keys.weights[i - 1] if i else 0)
                self.cache[k] = w
                self.used += w
        while self.used > self.budget and self.cache:
            _, w = self.cache.popitem(last=False)
            self.used -= w


def simulate(trace: Trace, keys_of, n_rep: int, policy: str, rate_per_replica: float, streams: int,
             budget: int, period: float, seed: int = 1, n_conv: Optional[int] = None) -> Dict[str, float]:
    rng = random.Random(seed)
    reps = [SimReplica(streams, budget) for _ in range(n_rep)]
    aff = AffinityPolicy(max_load=2 * streams, memory_s=2 * period, clock=lambda: now)
    now = 0.0
    ev: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, payload))

    t = 0.0
    n_conv = n_conv or len(trace.convs)
    for c in range(n_conv):
        t += rng.expovariate(rate_per_replica * n_rep)
        push(t, "turn", (c, 0))
    for r in range(n_rep):
        push(period * rng.random(), "report", r)
    rr = 0
    prompt_w = cached_w = 0
    encodes = clips = 0
    ttft: List[float] = []
    pending = n_conv

    def start(r: int, req) -> None:
        rep = reps[r]
        c, i, keys, clip_at, reply, t_arr = req
        w, enc = rep.hit(keys, clip_at)
        nonlocal prompt_w, cached_w, encodes, clips
        prompt_w += keys.total
        cached_w += w
        clips += bool(clip_at)
        encodes += enc
        pre = (keys.total - w) * PREFILL_S_PER_CHAR + (ENCODE_S if enc else 0.0)
        dec = len(reply) * DECODE_S_PER_CHAR
        rep.running += 1
        rep.work += pre + dec
        ttft.append(now + pre - t_arr)
        push(now + pre + dec, "done", (r, req))

    while ev:
        now, _, kind, payload = heapq.heappop(ev)
        if kind == "report":
            aff.report(payload, reps[payload].cache.keys())
            if pending:
                push(now + period, "report", payload)
        elif kind == "turn":
            c, i = payload
            keys, clip_at, reply, think, body = keys_of(c, i)
            if policy == "affinity":
                r = aff.choose(keys, {j: reps[j].load() for j in range(n_rep)})
                aff.note_routed(r, keys)
            elif policy == "round-robin":
                r, rr = rr % n_rep, rr + 1
            else:
                low = min(rep.load() for rep in reps)
                r = rng.choice([j for j in range(n_rep) if reps[j].load() == low])
            req = (c, i, keys, clip_at, reply, now)
            if reps[r].running < streams:
                start(r, req)
            else:
                reps[r].queue.append(req)
        else:
            r, req = payload
            rep = reps[r]
            rep.running -= 1
            c, i, keys, clip_at, reply, _ = req
            rep.insert(keys_of(c, i, reply_too=True))
            if rep.queue:
                start(r, rep.queue.popleft())
            nxt = keys_of.turns(c)
            if i + 1 < nxt:
                push(now + keys_of(c, i)[3], "turn", (c, i + 1))
            else:
                pending -= 1
    works = [rep.work for rep in reps]
    ttft.sort()
    return {"hit": cached_w / max(prompt_w, 1), "imbalance": max(works) / (sum(works) / n_rep),
            "ttft_mean": sum(ttft) / len(ttft), "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
            "encodes_per_clip_turn": encodes / max(clips, 1), "requests": len(ttft)}


class KeyBook:
    """Each turn's keys, computed once with the router's own request_keys and shared by all runs."""

    def __init__(self, trace: Trace):
        self.k: Dict[tuple, tuple] = {}
        self.n: Dict[int, int] = {}
        for c in range(len(trace.convs)):
            n = 0
            for i, (body, reply, think) in enumerate(trace.bodies(c)):
                keys = request_keys(body)
                # which segments are clips: the audio part's key index (a media segment weighs 256 alone)
                clip_at = [j for j, m in enumerate(body["messages"][1:2]) if isinstance(m.get("content"), list)]
                clip_idx = []
                if clip_at:
                    # the clip follows the system message and the user role marker
                    sys_keys = request_keys({"messages": body["messages"][:1]})
                    clip_idx = [len(sys_keys.keys) + 1]
                self.k[(c, i)] = (keys, clip_idx, reply, think, reply_keys(keys, body, reply))
                n += 1
            self.n[c] = n

    def __call__(self, c: int, i: int, reply_too: bool = False):
        keys, clip_idx, reply, think, full = self.k[(c, i)]
        if reply_too:
            return full
        return keys, clip_idx, reply, think, None

    def turns(self, c: int) -> int:
        return self.n[c]


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--per-replica", type=int, default=250,
                    help="at least this many conversations per replica (so the trace outlasts its ramp)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--budget", type=int, default=200_000, help="cache budget per replica, in characters")
    ap.add_argument("--rate", type=float, default=0.4, help="new conversations per second per replica")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between replica reports")
    args = ap.parse_args(argv)
    t0 = time.time()
    trace = Trace(max(args.conversations, args.per_replica * max(args.replicas)))
    book = KeyBook(trace)
    print(f"trace: {len(trace.convs)} conversations; keys in {time.time() - t0:.1f} s")
    print("| replicas | conversations | policy | hit rate | imbalance (max/mean work) | TTFT mean s | TTFT p99 s | clip encodes per clip turn |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for n in args.replicas:
        n_conv = max(args.conversations, args.per_replica * n)
        for pol in ("affinity", "least-loaded", "round-robin"):
            r = simulate(trace, book, n, pol, args.rate, args.streams, args.budget, args.period, n_conv=n_conv)
            print(f"| {n} | {n_conv} | {pol} | {r['hit']:.3f} | {r['imbalance']:.2f} | {r['ttft_mean']:.2f} | "
                  f"{r['ttft_p99']:.2f} | {r['encodes_per_clip_turn']:.2f} |", flush=True)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
