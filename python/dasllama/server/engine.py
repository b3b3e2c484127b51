"""The serving engine: admission, the prefix cache, text and stop strings around the C++ step loop.

No HTTP here: jobs come in through :meth:`Engine.submit` and report through a thread-safe callback.
One thread calls :class:`~dasllama.llm.BatchStepper` once per step (batching, sampling, stop ids and
lengths run in C++ with the GIL released); this file turns its tokens into text. Each step is one
ragged batch over the weights: at most one prefill chunk of one job plus a decode
token of every running job, so a new request delays the running streams by at most one chunk.
A finished stream donates its full pages to the prefix cache; a new job attaches the longest cached
prefix of its prompt and prefills only the rest (a client resending its conversation pays for the
new turn alone).
"""
from __future__ import annotations

import codecs
import collections
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Set

from .. import kv, llm
from .._core import PoolExhaustedError
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
    media_chat: object = None            # a renderer whose spans the prompt's negative ids name (audio)
    tag: str = ""                        # labels its donation to the prefix cache (a router's prefix key)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


class _Slot:
    def __init__(self, i: int, session: llm.Session):
        self.i = i                    # its index in the stepper
        self.s = session
        self.job: Optional[Job] = None
        self.n_gen = 0
        self.cached = 0
        self.text = ""                # generated text so far (after UTF-8 assembly)
        self.sent = 0                 # chars of text already sent
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.last_used = 0.0


def default_chunk(model: llm.Model) -> int:
    """Prefill rows a step takes by default: 256 on the CPU (a new request holds the running streams
    up by one such chunk: ~0.2 s there for a 1B model), 1024 on a GPU, where that chunk costs ~20 ms
    (H200, Llama-1B) and fewer, fuller prefill steps cut the time to first token of requests that
    arrive together (64 clients: p90 672 -> 278 ms, RESULTS.md)."""
    return 256 if str(model.device).startswith("cpu") else 1024


class Engine:
    """Continuous batching over ``streams`` paged sessions of one model, with a prefix cache across requests.

    ``cache_pages`` bounds what the prefix cache keeps (0: as many pages as the streams' contexts);
    the pool holds the streams' contexts plus that budget.
    """

    def __init__(self, model: llm.Model, streams: int = 4, n_ctx: int = 0, kv_dtype: KVDtype = KVDtype.f16,
                 chunk: int = 0, max_queue: int = 0, page_rows: int = 16, cache_pages: int = 0):
        if streams < 1:
            raise ValueError("streams must be >= 1")
        if chunk < 0:
            raise ValueError("chunk must be >= 1 (0: the device's default)")
        chunk = chunk or default_chunk(model)
        self.model = model
        self.n_ctx = n_ctx or min(model.config.seq_len, 4096)
        ctx_pages = (self.n_ctx + page_rows - 1) // page_rows
        cache_pages = cache_pages or streams * ctx_pages
        self.pool = kv.create_kv_pool(model, page_rows=page_rows, kv_dtype=kv_dtype,
                                      max_pages=streams * ctx_pages + cache_pages)
        self.cache = kv.create_prefix_cache(max_groups=cache_pages)
        self.slots = [_Slot(i, llm.create_session(model, self.pool, n_ctx=self.n_ctx)) for i in range(streams)]
        # The per-token work (batching, sampling, stop ids, lengths) runs in C++, one call per step.
        self.stepper = llm.BatchStepper([s.s for s in self.slots], chunk)
        self.chunk = chunk
        self.max_queue = max_queue or 4 * streams
        self._waiting: Deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        # counters for /metrics
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.cache_hits_total = 0
        self.media_rows_total = 0      # audio rows prefilled (not attached from the cache)
        self.encodes_total = 0         # audio tower runs
        self.image_encodes_total = 0   # vision tower runs
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

    def alive(self) -> bool:
        """Whether the engine thread runs (a health check's question)."""
        return self._thread is not None and self._thread.is_alive()

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
        st = self.pool.stats()
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
                "cache_hits_total": self.cache_hits_total,
                "media_rows_prefilled_total": self.media_rows_total,
                "audio_encodes_total": self.encodes_total,
                "image_encodes_total": self.image_encodes_total,
                "tokens_per_second": recent / 10.0,
                "kv_pages_total": st.total,
                "kv_pages_free": st.free,
                "kv_pages_sessions": st.by_sessions,
                "kv_pages_cache": st.by_cache,
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
                        # The KV may be half written: answer, and donate none of it.
                        self._fail(s, APIError(500, f"engine error: {type(e).__name__}: {e}", type="server_error"),
                                   donate=False)
        for s in self.slots:
            if s.job is not None:
                self._fail(s, APIError(503, "the server is shutting down", type="server_error"))
        for j in self._waiting:
            j.on_event("error", APIError(503, "the server is shutting down", type="server_error"))
        self._waiting.clear()

    def _admit(self) -> None:
        """Give free slots to waiting jobs (FIFO); each attaches the longest cached prefix of its prompt."""
        while self._waiting:
            free = [s for s in self.slots if s.job is None]
            if not free:
                return
            job = self._waiting.popleft()
            if job.cancelled.is_set():
                continue
            self._start(free[0], job)

    def _start(self, s: _Slot, job: Job) -> None:
        kv.release_kv_pages(s.s)
        # whole pages (and a page's part holding media rows), one token short at most
        keep = kv.prefix_attach(self.cache, self.pool, s.s, job.prompt)
        if keep and job.media_chat is not None and self.model.config.rope_sections:
            from ..chat import media  # M-RoPE images inside the attached prefix: their position advance

            s.s.rope_marks = media.rope_marks(job.media_chat.spans, job.prompt[:keep])
        s.job, s.cached, s.n_gen = job, keep, 0
        s.text, s.sent = "", 0
        s.dec.reset()
        seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        llm.set_seed(s.s, seed % (1 << 63))
        try:  # prefills go oldest submission first
            self.stepper.start(s.i, job.prompt, job.params, job.max_tokens, sorted(job.stop_ids), job.submitted)
        except (ValueError, TypeError) as e:  # sampling knobs the protocol let through
            s.job = None
            kv.release_kv_pages(s.s)
            job.on_event("error", APIError(400, str(e)))
            return
        self.prompt_tokens_total += len(job.prompt)
        self.cached_tokens_total += keep
        self.cache_hits_total += keep > 0

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
        # One ragged batch in C++: up to a chunk of prefill rows (oldest jobs first), a token of every decoder.
        prefill = True
        p = self.stepper.next_prefill()
        if p >= 0:
            s = self.slots[p]
            if s.job.media_chat is not None and s.s.n_past < len(s.job.prompt) - 1:
                # Media turns prefill in one body (text runs and the spans' rows; a clip is encoded
                # only if neither the KV nor the tower-output cache has it); this is the step's prefill.
                self._media_prefill(s)
                prefill = False
        try:
            events, n_dec = self.stepper.step(prefill)
        except PoolExhaustedError as e:
            # No session moved: the one that could not get a page is answered, the others go on next step.
            i = getattr(e, "session_index", -1)
            victim = self.slots[i] if 0 <= i < len(self.slots) and self.slots[i].job is not None else \
                next(s for s in self.slots if s.job is not None)
            self._fail(victim, APIError(503, f"the KV pool is full: {e}", type="server_error",
                                        headers={"Retry-After": "1"}))
            return
        for slot, kind, _tok, piece in events:
            s = self.slots[slot]
            if kind == llm.BatchStepper.STOP:
                self._finish(s, "stop")
                continue
            s.n_gen += 1
            self.generated_tokens_total += 1
            s.text += s.dec.decode(piece)
            if self._emit_text(s):
                continue
            if kind == llm.BatchStepper.LENGTH:
                s.text += s.dec.decode(b"", final=True)
                if not self._emit_text(s, final=True):
                    self._finish(s, "length")
        if n_dec:
            with self._cv:
                self._recent.append((time.monotonic(), n_dec))

    def _media_prefill(self, s: _Slot) -> None:
        from ..chat import turns

        body = s.job.prompt[s.s.n_past:-1]
        try:
            c = turns.prefill_media_body(self.model, s.s, s.job.media_chat, body)
        except PoolExhaustedError as e:
            return self._fail(s, APIError(503, f"the KV pool is full: {e}", type="server_error",
                                          headers={"Retry-After": "1"}), donate=False)
        except Exception as e:  # noqa: BLE001 - a bad clip fails its request only
            return self._fail(s, APIError(500, f"media prefill failed: {type(e).__name__}: {e}",
                                          type="server_error"), donate=False)
        self.media_rows_total += c.get("media_rows_prefilled", 0)
        self.encodes_total += c.get("encodes", 0) - c.get("image_encodes", 0)
        self.image_encodes_total += c.get("image_encodes", 0)

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

    def _fail(self, s: _Slot, err: APIError, donate: bool = True) -> None:
        s.job.on_event("error", err)
        self._release(s, donate)

    def _release(self, s: _Slot, donate: bool = True) -> None:
        """End a slot's job: its full pages go to the prefix cache, the rest back to the pool."""
        self.stepper.end(s.i)
        hist = s.s.history if donate else []
        if hist:
            try:
                kv.prefix_insert(self.cache, self.pool, s.s, hist, preview=s.job.tag)
            except Exception:  # noqa: BLE001 - caching is an optimization: never fail a reply over it
                pass
        kv.release_kv_pages(s.s)
        s.job = None
        s.last_used = time.monotonic()
