"""Models, sessions, tokenizer, evaluation, sampling and generation (reference §17.1.3–17.1.8).

A :class:`Model` may be shared by threads (compute on one model is serialized);
a :class:`Session` is used by one thread at a time.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from numbers import Integral
from typing import Callable, Iterator, List, Optional, Sequence, Union

from . import _core, hub
from .handles import KVDtype, KVPool, Model, ModelConfig, QuantMode, Session  # noqa: F401 - re-exported

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class SamplingParams:
    """Sampling knobs; the defaults are greedy (``temp <= 0`` selects argmax)."""

    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1


@dataclass
class Stats:
    """Timing of the last generate call of a session."""

    n_prompt: int = 0
    n_gen: int = 0
    ttft_s: float = 0.0
    prefill_tps: float = 0.0
    gen_tps: float = 0.0


def resolve_device(device: Optional[str]) -> str:
    """``device``, else ``$DASLLAMA_DEVICE``, else ``"cpu"``."""
    if device is None or device == "":
        device = os.environ.get("DASLLAMA_DEVICE", "") or "cpu"
    return str(device)


def load_model(path: PathLike, mode: QuantMode = QuantMode.q8, n_threads: int = 0,
               device: Optional[str] = None) -> Model:
    """Load a model and its tokenizer from a GGUF file, a llama2.c ``.bin`` checkpoint (with
    ``tokenizer.bin`` beside it; converted to GGUF in the cache on first use) or a hub name.

    ``mode`` picks the weights: ``fp32`` dequantizes everything (the reference),
    ``q8`` (default) requantizes float weights to q8_0 and keeps quantized planes,
    ``q4_0`` requantizes float weights to q4_0. ``n_threads`` 0 means the physical cores.

    ``device`` is ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` or ``"vulkan"`` / ``"vulkan:N"``
    (default: ``$DASLLAMA_DEVICE``, else the CPU). On a GPU the weights, activations and KV
    cache live in device memory and the file's block formats are kept; ``mode`` picks the
    numerics there: ``fp32`` computes in f32 (logits as the CPU's fp32 mode), ``q8`` rounds
    the activations of q8_0 / q4_0 matmuls to 8-bit blocks as the CPU's q8 mode does, and a
    prefill's f16 tensor-core products round them to f16 (README.md, "On a GPU"). A device
    that is not built, not present or too small raises :class:`~dasllama.DeviceError` before
    anything is allocated on it.
    """
    from . import llama2c

    p = llama2c.cached_gguf(path) if llama2c.is_llama2c(path) else str(hub.resolve(path))
    mode = QuantMode(mode)
    return Model(_core.Model(p, int(mode), resolve_device(device), int(n_threads)), p, mode)


def create_session(model: Model, kv_dtype: Union[KVDtype, KVPool] = KVDtype.f16, n_ctx: int = 0,
                   pool: Optional[KVPool] = None) -> Session:
    """A fresh session: ``create_session(model, kv_dtype, n_ctx)`` or ``create_session(model, pool)``.

    Flat: ``n_ctx`` 0 means min(model.config.seq_len, 4096) positions, allocated up front.
    Paged (a :class:`~dasllama.KVPool` as second argument or ``pool=``): the pool's codec,
    ``n_ctx`` 0 means model.config.seq_len, and pages come from the pool as rows are
    written (:class:`~dasllama.PoolExhaustedError` when it is full).
    """
    if isinstance(kv_dtype, KVPool):
        pool, kv_dtype = kv_dtype, KVDtype.f16
    if pool is not None:
        return Session(model, n_ctx=n_ctx, pool=pool)
    return Session(model, KVDtype(kv_dtype), n_ctx)


def encode(model: Model, text: str, add_special: bool = True, parse_special: bool = False) -> List[int]:
    return model._m.encode(text, add_special, parse_special)


def decode(model: Model, ids: Sequence[int]) -> str:
    return model._m.decode([int(i) for i in ids])


def piece(model: Model, id: int) -> str:
    """One token's text (raw bytes decoded leniently; streaming should use generate's pieces)."""
    return model._m.piece(int(id)).decode("utf-8", errors="replace")


def eval(model: Model, session: Session, tokens: Sequence[int], all_logits: bool = False) -> None:  # noqa: A001
    """Run tokens at the session's position and advance it; logits land in ``session.logits``.

    With ``all_logits`` the logits of every row are kept (``len(tokens) * vocab`` floats).
    """
    check_session(model, session)
    _core.eval(session._s, [int(t) for t in tokens], bool(all_logits))


class BatchWorkspace:
    """Caller-owned handle for :func:`eval_batch` steps of one model.

    It holds no session state (positions, caches and logits stay in the
    sessions). The batched scratch buffers are kept by the model today, whose
    compute is serialized, so one workspace per concurrent batch costs nothing.
    """

    def __init__(self, model: Model):
        self.model = model

    def __repr__(self) -> str:
        return f"BatchWorkspace(model={os.path.basename(self.model.path)!r})"


def create_batch_workspace(model: Model) -> BatchWorkspace:
    return BatchWorkspace(model)


def eval_batch(model: Model, ws: BatchWorkspace, sessions: Sequence[Session],
               tokens: Sequence[Union[int, Sequence[int]]], greedy: bool = False) -> Optional[List[int]]:
    """One batched step, one pass over the weights for every row of every session.

    ``tokens[i]`` is an int (a decode step: one token at ``sessions[i]``'s position) or a
    sequence of ints (a chunk: ``sessions[i]`` prefills them in order). So a scheduler can
    prefill a chunk of one session in the same step as others decode (a ragged batch);
    each session advances by its own count and gets the logits of its last row. Keep
    chunks to a few hundred tokens so decoding sessions are not held up.

    Sessions must be distinct sessions of ``model``, all flat or all of one pool. On a
    paged batch, pages for every session are taken before any compute: if the pool
    cannot serve one, :class:`~dasllama.PoolExhaustedError` is raised with
    ``session_index`` naming it, and no session has moved.

    With ``greedy=True`` each session's next token, the argmax of its last row's logits
    (the first of equal maxima, as ``temp=0`` sampling picks), is taken on the model's device
    and returned, one id per session; the logits stay there (``session.logits`` is empty
    after it), so a GPU step copies B ids back instead of B x vocab floats.
    """
    if ws.model is not model:
        raise ValueError("workspace belongs to another model")
    if len(sessions) != len(tokens):
        raise ValueError(f"eval_batch: {len(sessions)} sessions but {len(tokens)} token groups")
    for s in sessions:
        check_session(model, s)
    flat: List[int] = []
    counts: List[int] = []
    for t in tokens:
        if isinstance(t, Integral):
            flat.append(int(t))
            counts.append(1)
        else:
            g = [int(x) for x in t]
            if not g:
                raise ValueError("eval_batch: an empty token group")
            flat.extend(g)
            counts.append(len(g))
    return _core.eval_batch([s._s for s in sessions], flat, counts, bool(greedy))


class BatchStepper:
    """The serving step loop in C++: streams over ``sessions`` (distinct sessions of one model, flat or of
    one pool), one :meth:`step` per ragged batch, with the GIL released for the forward, the samples and
    the stop checks. Used by one thread; text, stop strings and caching stay with the caller.
    A step whose streams all sample greedily (temperature 0, no penalties) takes their argmaxes on
    the model's device and copies back only the ids (``DASLLAMA_DEVICE_GREEDY=0``: the logits).
    """

    TOKEN, STOP, LENGTH = 0, 1, 2  # event kinds: a token; the stream ended at a stop id / at its length

    def __init__(self, sessions: Sequence[Session], chunk: int = 256):
        self.sessions = list(sessions)
        if self.sessions and any(s.model is not self.sessions[0].model for s in self.sessions):
            raise ValueError("BatchStepper: sessions of different models")
        self._st = _core.Stepper([s._s for s in self.sessions], int(chunk))

    def start(self, slot: int, prompt: Sequence[int], params: Optional[SamplingParams], max_tokens: int,
              stop_ids: Sequence[int] = (), priority: float = 0.0) -> None:
        """A job on ``sessions[slot]``, which holds ``prompt[:n_past]`` already (an attached prefix); the
        rest is prefilled a chunk per step, the lowest ``priority`` first. ``stop_ids`` end the reply beside
        the model's end-of-generation ids; a reply ends after ``max_tokens`` or one short of ``n_ctx``."""
        self._st.start(int(slot), [int(t) for t in prompt], params or SamplingParams(), int(max_tokens),
                       [int(t) for t in stop_ids], float(priority))

    def end(self, slot: int) -> None:
        """Stop ``slot``'s job (idempotent); its session's pages stay for the caller to donate or release."""
        self._st.end(int(slot))

    def active(self, slot: int) -> bool:
        """Whether ``slot`` has a job that has not ended."""
        return bool(self._st.active(int(slot)))

    def next_prefill(self) -> int:
        """The slot the next step prefills (-1: none). A caller that prefills it itself (media rows, with
        :func:`eval_embd`) then calls ``step(prefill=False)``."""
        return self._st.next_prefill()

    def step(self, prefill: bool = True):
        """One ragged batch: ``([(slot, kind, token, piece bytes)], decode rows run)``. A full pool raises
        :class:`~dasllama.PoolExhaustedError` with ``session_index`` = the slot asking, no session moved."""
        return self._st.step(bool(prefill))


def eval_embd(model: Model, session: Session, embd: np.ndarray, npos: int, non_causal: bool = False,
              ids: Optional[Sequence[int]] = None) -> None:
    """eval's embedding-row twin: prefill ``npos`` rows of ``dim`` floats (token-major) and advance.

    ``ids`` (one per row) name the rows in ``session.history``: negative media ids (see
    :func:`~dasllama.media_ids`) for media rows, or the token id a text row was embedded from,
    so the prefix cache and the chat layer match them later; without them the rows are recorded
    as -1, which is never cached. Audio rows are causal; ``non_causal`` marks the whole call as one
    image span, every row of which attends the whole span (gemma vision).
    """
    if non_causal:
        eval_embd_span(model, session, embd, npos, 0, npos, ids=ids)
    else:
        eval_embd_span(model, session, embd, npos, 0, 0, ids=ids)


def eval_embd_span(model: Model, session: Session, embd: np.ndarray, npos: int, span_lo: int, span_hi: int,
                   ids: Optional[Sequence[int]] = None) -> None:
    """eval_embd for rows carrying one non-causal image span: rows ``[span_lo, span_hi)`` each attend
    the whole span (mtmd's non-causal media chunk, transformers' image blocks); the rows around them
    stay causal. ``span_lo == span_hi`` is a causal call. The span is prefilled in one chunk."""
    check_session(model, session)
    x = _rows(model, embd, npos)
    lo, hi = int(span_lo), int(span_hi)
    if not 0 <= lo <= hi <= int(npos):
        raise ValueError(f"span [{lo}, {hi}) is not within the {int(npos)} rows")
    _core.eval_embd(session._s, x, int(npos), [int(i) for i in ids] if ids is not None else [], lo, hi)


def eval_embd_span_mrope(model: Model, session: Session, embd: np.ndarray, npos: int, span_lo: int, span_hi: int,
                         grid, ids: Optional[Sequence[int]] = None, non_causal: bool = False,
                         first_row: int = 0, deepstack: Optional[np.ndarray] = None) -> None:
    """eval_embd_span's M-RoPE twin (Qwen-VL decoders, whose file carries ``rope.dimension_sections``):
    rows ``[span_lo, span_hi)`` are an image merged to ``grid = (grid_h, grid_w)`` (row-major), roped at
    (t, h, w) = (p, p + y, p + x) from the rope position p its first row would take; every later row --
    in this call and in the session's later evals -- continues at p + max(grid_h, grid_w), which the
    session tracks (``session.rope_marks``). Image rows stay causal, as transformers' Qwen-VL runs them,
    unless ``non_causal``. ``first_row`` > 0 (with ``span_lo`` 0): the call continues an image whose first
    rows the session already holds (a prefix attach that ended inside it). ``deepstack`` (a Qwen3-VL
    decoder: ``config.n_deepstack`` > 0): float32 ``(npos, n_deepstack * dim)``, each row's features for
    the first decoder layers' outputs (zeros for text rows; the tower's rows past the first ``dim``).
    Raises ValueError on a model without M-RoPE."""
    check_session(model, session)
    if not model.config.rope_sections:
        raise ValueError(f"eval_embd_span_mrope: the {model.arch} model has no M-RoPE sections "
                         "(rope.dimension_sections); use eval_embd_span")
    x = _rows(model, embd, npos)
    lo, hi = int(span_lo), int(span_hi)
    if not 0 <= lo <= hi <= int(npos):
        raise ValueError(f"span [{lo}, {hi}) is not within the {int(npos)} rows")
    try:
        gh, gw = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise ValueError(f"grid must be (grid_h, grid_w), got {grid!r}") from None
    first = int(first_row)
    if gh < 1 or gw < 1 or first < 0 or (first == 0 and gh * gw != hi - lo) or first + hi - lo > gh * gw:
        raise ValueError(f"the span holds {hi - lo} rows from grid row {first}, which do not fit a {gh} x {gw} grid")
    deep = None
    if deepstack is not None:
        import numpy as np  # here, not at import: a text-only program need not load numpy

        k = model.config.n_deepstack
        deep = np.asarray(deepstack)
        if deep.dtype != np.float32:
            raise TypeError(f"deepstack rows must be float32, got dtype {deep.dtype}")
        if k == 0:
            raise ValueError(f"the {model.arch} model takes no deepstack rows")
        if deep.size != int(npos) * k * model.config.dim:
            raise ValueError(f"deepstack holds {deep.size} floats; npos x n_deepstack x dim = "
                             f"{int(npos) * k * model.config.dim}")
        deep = np.ascontiguousarray(deep).reshape(-1)
    _core.eval_embd_mrope(session._s, x, int(npos), [int(i) for i in ids] if ids is not None else [], lo, hi,
                          gh, gw, bool(non_causal), first, deep)


def _rows(model: Model, embd, npos: int) -> np.ndarray:
    import numpy as np  # here, not at import: a text-only program need not load numpy

    x = np.asarray(embd)
    if x.dtype != np.float32:
        raise TypeError(f"embedding rows must be float32, got dtype {x.dtype}")
    if int(npos) < 0:
        raise ValueError("npos must be >= 0")
    if x.ndim == 2 and x.shape[1] != model.config.dim:
        raise ValueError(f"rows are {x.shape[1]} wide but the model's embedding width is {model.config.dim}")
    if x.size < int(npos) * model.config.dim:
        raise ValueError(f"embd holds {x.size} floats; npos x dim = {int(npos) * model.config.dim}")
    return np.ascontiguousarray(x).reshape(-1)


def embed_text_rows(model: Model, tokens: Sequence[int], out: Optional[np.ndarray] = None,
                    offset: int = 0) -> np.ndarray:
    """The embedding rows ``eval`` would prefill for ``tokens``: float32 ``(len(tokens), dim)``
    (with gemma's sqrt(dim) scale). With ``out`` they are written into it from row ``offset``."""
    import numpy as np  # here, not at import: a text-only program need not load numpy

    rows = model._m.embed_tokens([int(t) for t in tokens])
    if out is None:
        return rows
    view = np.asarray(out).reshape(-1, model.config.dim)
    view[int(offset):int(offset) + rows.shape[0]] = rows
    return out


def media_body_rows(model: Model, session: Optional[Session], head: Sequence[int], rows: np.ndarray, n: int,
                    dim: int, tail: Sequence[int], out: Optional[np.ndarray] = None) -> np.ndarray:
    """One body of rows for a turn with one media span: ``head``'s text rows, the ``n`` media
    ``rows`` (``dim`` wide, which must be the model's width), then ``tail``'s text rows:
    float32 ``(len(head) + n + len(tail), dim)``. ``session`` is unused (kept for the reference's
    signature: a per-layer-input family would record ids on it). Prefill with :func:`eval_embd_body`."""
    import numpy as np  # here, not at import: a text-only program need not load numpy

    if session is not None:
        check_session(model, session)
    if int(dim) != model.config.dim:
        raise ValueError(f"media rows are {dim} wide but the model's embedding width is {model.config.dim}")
    r = _rows(model, rows, n).reshape(-1, model.config.dim)[:int(n)]
    body = np.concatenate([embed_text_rows(model, head), r, embed_text_rows(model, tail)]) \
        if (len(head) or len(tail)) else r.copy()
    if out is not None:
        np.asarray(out).reshape(-1, model.config.dim)[:body.shape[0]] = body
        return out
    return body


def eval_embd_body(model: Model, session: Session, body: np.ndarray, n_total: int, span_lo: int = 0,
                   span_hi: int = 0, ids: Optional[Sequence[int]] = None) -> None:
    """Prefill a body of :func:`media_body_rows` in one call. ``(span_lo, span_hi)`` is a non-causal
    image span; (0, 0) keeps every row causal, as audio wants. ``ids`` (the rendered turn: token ids
    and media ids) name the rows in the session's history."""
    eval_embd_span(model, session, body, n_total, span_lo, span_hi, ids=ids)


def generate_embd(model: Model, session: Session, embd: np.ndarray, npos: int,
                  params: Optional[SamplingParams] = None, max_tokens: int = 256,
                  on_token: Optional[Callable[[int, str], Optional[bool]]] = None,
                  stop_ids: Optional[Sequence[int]] = None, special: bool = False,
                  ids: Optional[Sequence[int]] = None) -> int:
    """generate's embedding-prefill twin: prefill ``npos`` rows (see :func:`eval_embd`), then sample
    exactly as :func:`generate` does. Over :func:`embed_text_rows` of a prompt it is the same
    computation as ``generate(prompt)``: the rows are the ones the token path embeds.
    ``stats(session).n_prompt`` counts only what the sampling call prefilled (0 here)."""
    if int(npos) < 1:
        raise ValueError("generate_embd needs at least one row")
    eval_embd(model, session, embd, npos, ids=ids)
    return generate(model, session, [], params, max_tokens, on_token, stop_ids, special)


def sample(session: Session, params: Optional[SamplingParams] = None) -> int:
    return _core.sample(session._s, params or SamplingParams())


def set_seed(session: Session, seed: int) -> None:
    session._s.set_seed(int(seed))


def stats(session: Session) -> Stats:
    return Stats(**session._s.stats())


def generate(model: Model, session: Session, prompt: Union[str, Sequence[int]], params: Optional[SamplingParams] = None,
             max_tokens: int = 256, on_token: Optional[Callable[[int, str], Optional[bool]]] = None,
             stop_ids: Optional[Sequence[int]] = None, special: bool = False) -> int:
    """Prefill ``prompt`` then sample up to ``max_tokens``; ``on_token(id, piece)`` may return False to stop.

    The decode loop runs in C++ with the GIL released. Pieces are whole UTF-8:
    bytes of a split character are held until it completes. Generation stops at the
    model's end-of-generation ids, or at ``stop_ids`` instead when given; ``special``
    streams control tokens as their text. Returns the count emitted.
    """
    check_session(model, session)
    ids = encode(model, prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    cb = None
    if on_token is not None:
        def cb(i: int, b: bytes) -> bool:
            return on_token(i, b.decode("utf-8", errors="replace")) is not False
    stops = None if stop_ids is None else [int(t) for t in stop_ids]
    return _core.generate(session._s, ids, params or SamplingParams(), int(max_tokens), cb, stops, bool(special))


def stream_pieces(run: Callable[[Callable[[str], bool]], object]) -> Iterator[str]:
    """Turn a callback-streaming call into a generator: ``run(on_piece)`` runs on a worker thread;
    closing the generator makes ``on_piece`` return False, which stops the call."""
    q: "queue.Queue" = queue.Queue()
    stop = threading.Event()
    done = object()

    def on_piece(p: str) -> bool:
        q.put(p)
        return not stop.is_set()

    def work():
        try:
            run(on_piece)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            q.put(e)
        finally:
            q.put(done)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            if item:
                yield item
    finally:
        stop.set()
        t.join()


def stream_generate(model: Model, session: Session, prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None, max_tokens: int = 256) -> Iterator[str]:
    """Generator form of :func:`generate`: yields text pieces as they come."""
    return stream_pieces(lambda cb: generate(model, session, prompt, params, max_tokens, lambda i, p: cb(p)))


def embed(model: Model, text: str) -> np.ndarray:
    """Mean-pooled, L2-normalized final hidden state of ``text`` (``dim`` floats)."""
    return model._m.embed(text)


def check_session(model: Model, session: Session) -> None:
    """ValueError unless ``session`` was made for ``model``."""
    if session.model is not model:
        raise ValueError("session belongs to another model")
