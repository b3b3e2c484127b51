"""The serving engine: one thread steps up to ``streams`` sessions through chunked prefill and batched decode.

No HTTP here: jobs come in through :meth:`Engine.submit` and report through a thread-safe callback.
Each step is at most one prefill chunk of one job plus one batched decode of every running job, so a
new request delays the running streams by at most one chunk.
"""
from __future__ import annotations

import codecs
import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Set

import numpy as np

from .. import llm
from ..llm import KVDtype, SamplingParams
from .protocol import APIError

Event = Callable[[str, object], None]  # ("text", str) / ("done", Finish) / ("error", APIError)


@dataclass
class Finish:
    reason: str          # "stop" or "length"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Job:
    """One generation: prompt ids in, text pieces out through ``on_event`` (called from the engine thread)."""

    prompt: List[int]
    params: SamplingParams
    max_tokens: int
    on_event: Event
    stop: List[str] = field(default_factory=list)
    stop_ids: Set[int] = field(default_factory=set)  # end the reply (beside the model's end-of-generation ids)
    seed: Optional[int] = None
    deadline: Optional[float] = None     # time.monotonic() limit
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


class _Slot:
    def __init__(self, session: llm.Session):
        self.s = session
        self.tokens: List[int] = []   # mirror of what the KV holds
        self.job: Optional[Job] = None
        self.pos = 0                  # prompt tokens prefilled so far
        self.next_tok = -1            # sampled, not yet evaluated
        self.n_gen = 0
        self.cached = 0
        self.text = ""                # generated text so far (after UTF-8 assembly)
        self.sent = 0                 # chars of text already sent
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.last_used = 0.0


class Engine:
    """Continuous batching over ``streams`` sessions of one model.

    A free slot is given to the waiting job whose prompt shares the longest prefix with the slot's KV,
    so a conversation that resends its history prefills only the new turn.
    """

    def __init__(self, model: llm.Model, streams: int = 4, n_ctx: int = 0, kv_dtype: KVDtype = KVDtype.f16,
                 chunk: int = 256, max_queue: int = 0):
        if streams < 1:
            raise ValueError("streams must be >= 1")
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        self.model = model
        self.n_ctx = n_ctx or min(model.config.seq_len, 4096)
        self.slots = [_Slot(llm.create_session(model, kv_dtype, self.n_ctx)) for _ in range(streams)]
        self.ws = llm.create_batch_workspace(model)
        self.chunk = chunk
        self.max_queue = max_queue or 4 * streams
        self.eog = set(model._m.eog_ids)
        self._waiting: Deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        # counters for /metrics
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self._recent: Deque[tuple] = collections.deque()  # (time, tokens) of recent decode steps

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dasllama-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- API for the HTTP side ---------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        n = len(job.prompt)
        if n == 0:
            raise APIError(400, "the prompt is empty")
        if n >= self.n_ctx:
            raise APIError(400, f"the prompt has {n} tokens; the context holds {self.n_ctx}",
                           code="context_length_exceeded")
        if job.max_tokens is None:
            job.max_tokens = self.n_ctx - n
        elif n + job.max_tokens > self.n_ctx:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({job.max_tokens}) exceeds the context of "
                           f"{self.n_ctx} tokens", param="max_tokens", code="context_length_exceeded")
        with self._cv:
            if self._stop:
                raise APIError(503, "the server is shutting down", type="server_error")
            if len(self._waiting) >= self.max_queue:
                raise APIError(503, "the queue is full; retry shortly", type="server_error",
                               headers={"Retry-After": "1"})
            self._waiting.append(job)
            self.requests_total += 1
            self._cv.notify_all()

    def metrics(self) -> dict:
        now = time.monotonic()
        with self._cv:
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            return {
                "queue_depth": len(self._waiting),
                "active_streams": sum(1 for s in self.slots if s.job is not None),
                "streams": len(self.slots),
                "requests_total": self.requests_total,
                "prompt_tokens_total": self.prompt_tokens_total,
                "cached_tokens_total": self.cached_tokens_total,
                "generated_tokens_total": self.generated_tokens_total,
                "tokens_per_second": recent / 10.0,
                "kv_tokens_held": sum(len(s.tokens) for s in self.slots),
                "kv_tokens_total": self.n_ctx * len(self.slots),
            }

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._waiting and all(s.job is None for s in self.slots):
                    self._cv.wait()
                if self._stop:
                    break
                self._admit()
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - one bad step must not take the server down
                for s in self.slots:
                    if s.job is not None:
                        self._fail(s, APIError(500, f"engine error: {type(e).__name__}: {e}", type="server_error"))
                        s.s._s.truncate(0)  # the KV may be half written: trust none of it
                        s.tokens.clear()
        for s in self.slots:
            if s.job is not None:
                self._fail(s, APIError(503, "the server is shutting down", type="server_error"))
        for j in self._waiting:
            j.on_event("error", APIError(503, "the server is shutting down", type="server_error"))
        self._waiting.clear()

    def _admit(self) -> None:
        """Give free slots to waiting jobs (FIFO), each to the free slot sharing its longest prefix."""
        while self._waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                continue
            p = np.asarray(job.prompt, dtype=np.int64)

            def common(s: _Slot) -> int:
                m = min(len(s.tokens), len(p))
                if m == 0:
                    return 0
                d = np.flatnonzero(np.asarray(s.tokens[:m], dtype=np.int64) != p[:m])
                return int(d[0]) if d.size else m

            best = max(free, key=lambda s: (common(s), -s.last_used))
            keep = min(common(best), len(p) - 1)  # the last prompt token is always evaluated: it gives the logits
            self._start(best, job, keep)

    def _start(self, s: _Slot, job: Job, keep: int) -> None:
        s.s._s.truncate(keep)
        del s.tokens[keep:]
        s.job, s.pos, s.cached, s.n_gen, s.next_tok = job, keep, keep, 0, -1
        s.text, s.sent = "", 0
        s.dec.reset()
        seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        llm.set_seed(s.s, seed % (1 << 63))
        self.prompt_tokens_total += len(job.prompt)
        self.cached_tokens_total += keep

    def _step(self) -> None:
        now = time.monotonic()
        for s in self.slots:
            j = s.job
            if j is None:
                continue
            if j.cancelled.is_set():
                self._release(s)
            elif j.deadline is not None and now > j.deadline:
                self._fail(s, APIError(504, "the request's deadline passed", type="timeout"))
        # One chunk of prefill for the oldest job still prefilling.
        pre = [s for s in self.slots if s.job is not None and s.next_tok < 0]
        if pre:
            s = min(pre, key=lambda x: x.job.submitted)
            j = s.job
            chunk = j.prompt[s.pos:s.pos + self.chunk]
            self._eval(s, chunk)
            if s.job is not None:
                s.pos += len(chunk)
                if s.pos == len(j.prompt):
                    self._sampled(s, llm.sample(s.s, j.params))
        # One batched decode step for every job that has a token to feed.
        dec = [s for s in self.slots if s.job is not None and s.next_tok >= 0]
        if not dec:
            return
        toks = [s.next_tok for s in dec]
        if len(dec) == 1:
            self._eval(dec[0], toks)
        else:
            llm.eval_batch(self.model, self.ws, [s.s for s in dec], toks)
            for s, t in zip(dec, toks):
                s.tokens.append(t)
        for s in dec:
            if s.job is not None:
                self._sampled(s, llm.sample(s.s, s.job.params))
        with self._cv:
            self._recent.append((time.monotonic(), len(dec)))

    def _eval(self, s: _Slot, toks: List[int]) -> None:
        try:
            llm.eval(self.model, s.s, toks)
        except Exception as e:  # noqa: BLE001
            s.s._s.truncate(len(s.tokens))
            self._fail(s, APIError(500, f"evaluation failed: {e}", type="server_error"))
            return
        s.tokens.extend(toks)

    def _sampled(self, s: _Slot, tok: int) -> None:
        j = s.job
        if tok in self.eog or tok in j.stop_ids:
            return self._finish(s, "stop")
        s.n_gen += 1
        self.generated_tokens_total += 1
        s.text += s.dec.decode(self.model._m.piece(tok))
        if self._emit_text(s):
            return
        if s.n_gen >= j.max_tokens or len(s.tokens) + 1 >= self.n_ctx:
            s.text += s.dec.decode(b"", final=True)
            if not self._emit_text(s, final=True):
                self._finish(s, "length")
            return
        s.next_tok = tok

    def _emit_text(self, s: _Slot, final: bool = False) -> bool:
        """Send what is safe to send; True when a stop string ended the job."""
        j = s.job
        text = s.text
        if j.stop:
            lo = max(0, s.sent - max(len(x) for x in j.stop))
            hits = [i for i in (text.find(x, lo) for x in j.stop) if i >= 0]
            if hits:
                cut = min(hits)
                if cut > s.sent:
                    j.on_event("text", text[s.sent:cut])
                s.sent = cut
                self._finish(s, "stop")
                return True
        end = len(text)
        if not final:
            # Hold back a tail that may still become a stop string, and an undecided replacement char.
            for x in j.stop:
                for k in range(min(len(x) - 1, end - s.sent), 0, -1):
                    if text.endswith(x[:k]):
                        end = min(end, len(text) - k)
                        break
        if end > s.sent:
            j.on_event("text", text[s.sent:end])
            s.sent = end
        return False

    def _finish(self, s: _Slot, reason: str) -> None:
        j = s.job
        j.on_event("done", Finish(reason, len(j.prompt), s.cached, s.n_gen))
        self._release(s)

    def _fail(self, s: _Slot, err: APIError) -> None:
        s.job.on_event("error", err)
        self._release(s)

    def _release(self, s: _Slot) -> None:
        # The KV keeps what it holds, so the next turn of this conversation can reuse it.
        s.job, s.next_tok = None, -1
        s.last_used = time.monotonic()
