"""The OpenAI-compatible HTTP layer (Starlette): the app's state, its route handlers, auth and body limits.

Generation is the engine's (engine.py), request parsing protocol.py's, renderers chats.py's, response
bodies responses.py's and stream framing sse.py's; a reply's reasoning and tool calls are shaped by the
chat layer (chat/shaping.py).
"""
from __future__ import annotations

import os

import asyncio
import base64
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, List, Optional, Union

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .. import chat, llm
from ..chat.shaping import ReplyShaper, shape_reply
from ..chat.template import TemplateError
from ..llm import KVDtype, SamplingParams
from . import responses, sse
from .chats import Chats
from .engine import Engine, Job
from .protocol import APIError, GenRequest, Limits, bad, parse_chat, parse_completion, parse_embeddings, read_body
from .responses import Reply
from .transcriptions import transcriptions


@dataclass
class AppState:
    """What the handlers serve from (``app.state.server``): the model, its tower, the engine, the
    per-request renderers, the limits, the served name, the API key and the ASR model."""

    model: llm.Model
    tower: Any
    engine: Engine
    chats: Chats
    limits: Limits
    name: str
    api_key: Optional[str] = None
    asr: Any = None                 # the speech recognition model (dasllama.asr.ASRModel), if served
    asr_name: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))


def _state(request: Request) -> AppState:
    return request.app.state.server


def _sampling(r: GenRequest) -> SamplingParams:
    s = r.sampling
    # seed -1: the engine seeds each stream once (from the request's seed or at random).
    return SamplingParams(temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                          repeat_penalty=s.repeat_penalty, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, seed=-1)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: Request, lim: Limits) -> Any:
    """The body as JSON, refused past ``lim.max_body_bytes`` before it is all read."""
    buf = await read_body(request, lim)
    try:
        return json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}") from None


def _tokenize(st: AppState, text: str, special: bool) -> List[int]:
    return llm.encode(st.model, text, add_special=special, parse_special=not special)


class _ToLoop:
    """Events from the engine thread into one event loop's queues, the loop woken once for as many as
    arrive before it runs (a step's tokens for every stream), not once an event: each wake-up is a
    write to the loop's self-pipe, 64 of them a step at 64 streams. DASLLAMA_SERVE_COALESCE=0: a
    wake-up an event, as before."""

    _by_loop: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_ToLoop":
        t = cls._by_loop.get(loop)
        if t is None:
            t = cls._by_loop[loop] = cls(loop)
        return t

    def put(self, q: asyncio.Queue, item: object) -> None:
        with self.lock:
            self.items.append((q, item))
            first = len(self.items) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop closed (shutdown): nobody waits for these
                with self.lock:
                    self.items.clear()

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for q, item in items:
            q.put_nowait(item)


_COALESCE = os.environ.get("DASLLAMA_SERVE_COALESCE", "1") != "0"


async def run_job(request: Request, r: GenRequest, prompt: List[int], kind: str, c=None,
                  stop_ids=(), media=None) -> Response:
    """Queue one generation and answer it plainly or as SSE. ``c``: the chat renderer of a chat request
    (reasoning split into reasoning_content, tool calls parsed when tools were offered)."""
    st = _state(request)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    if _COALESCE:
        to_loop = _ToLoop.of(loop)

        def on_event(kind_: str, payload: object) -> None:
            to_loop.put(q, (kind_, payload))
    else:
        def on_event(kind_: str, payload: object) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (kind_, payload))

    job = Job(prompt=prompt, params=_sampling(r), max_tokens=r.max_tokens, on_event=on_event, stop=r.stop,
              stop_ids=set(stop_ids), seed=r.sampling.seed, media_chat=media,
              tag=request.headers.get("x-dasllama-cache-tag", "")[:64],
              deadline=(time.monotonic() + r.timeout_s) if r.timeout_s else None)
    st.engine.submit(job)
    reply = Reply.new(kind, st.name)
    tools = kind == "chat" and bool(r.tools)
    if r.stream:
        shaper = ReplyShaper(c, tools) if c is not None else None
        return sse.response(sse.events(reply, q, job, shaper, r.include_usage))

    async def watch():
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancel()

    watcher = asyncio.ensure_future(watch())
    parts: List[str] = []
    try:
        while True:
            ev, payload = await q.get()
            if ev == "text":
                parts.append(payload)
            elif ev == "done":
                fin = payload
                break
            else:
                raise payload
    finally:
        watcher.cancel()
        job.cancel()
    text = "".join(parts)
    shaped = shape_reply(c, text, tools) if kind == "chat" else None
    return JSONResponse(responses.completion(reply, text, shaped, fin))


# -- handlers ----------------------------------------------------------------------------------------------

async def chat_completions(request: Request) -> Response:
    st = _state(request)
    r = parse_chat(await read_json(request, st.limits), st.limits)
    if r.audio and st.tower is None:
        raise bad("this server has no audio tower: start it with --mmproj to send input_audio", "messages")
    if r.images and st.chats.vision is None:
        raise bad("this server has no vision tower: start it with a vision --mmproj to send image_url", "messages")
    media = bool(r.audio or r.images)

    def render():
        c = st.chats.build(r)  # audio and images: decoded and keyed here, off the event loop
        if media:
            return c, chat.prompt_ids(c), chat.effective_stop_ids(c)
        return c, chat.render_turn(st.model, c), chat.effective_stop_ids(c)

    try:
        c, prompt, stops = await asyncio.to_thread(render)
    except TemplateError as e:
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None
    return await run_job(request, r, prompt, "chat", c, stops, media=c if media else None)


async def completions(request: Request) -> Response:
    st = _state(request)
    r = parse_completion(await read_json(request, st.limits), st.limits)
    prompt = await asyncio.to_thread(_tokenize, st, r.prompt, True)
    return await run_job(request, r, prompt, "completion")


async def embeddings(request: Request) -> Response:
    st = _state(request)
    inputs, fmt = parse_embeddings(await read_json(request, st.limits), st.limits)
    n_tok = 0
    data = []
    for i, text in enumerate(inputs):
        ids = await asyncio.to_thread(_tokenize, st, text, True)
        if len(ids) > st.engine.n_ctx:
            raise bad(f"input[{i}] has {len(ids)} tokens; at most {st.engine.n_ctx}", "input")
        n_tok += len(ids)
        v = await asyncio.to_thread(llm.embed, st.model, text)
        emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
               else [float(x) for x in v])
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return JSONResponse({"object": "list", "data": data, "model": st.name,
                         "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})


async def models(request: Request) -> Response:
    st = _state(request)
    names = [st.name] + ([st.asr_name] if st.asr is not None else [])
    return JSONResponse({"object": "list", "data": [{"id": n, "object": "model", "created": st.created,
                                                     "owned_by": "dasllama"} for n in names]})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


METRICS = (
    ("queue_depth", "gauge", "requests waiting for a stream"),
    ("active_streams", "gauge", "streams generating now"),
    ("streams", "gauge", "streams the engine steps"),
    ("requests_total", "counter", "generation requests accepted"),
    ("prompt_tokens_total", "counter", "prompt tokens of accepted requests"),
    ("cached_tokens_total", "counter", "prompt tokens served from the KV without prefill"),
    ("generated_tokens_total", "counter", "tokens generated"),
    ("tokens_per_second", "gauge", "tokens generated per second over the last 10 s"),
    ("cache_hits_total", "counter", "requests that attached a cached prefix"),
    ("media_rows_prefilled_total", "counter", "audio and image rows prefilled (not attached from the cache)"),
    ("audio_encodes_total", "counter", "audio tower runs"),
    ("image_encodes_total", "counter", "vision tower runs"),
    ("kv_pages_total", "gauge", "pages of the KV pool"),
    ("kv_pages_free", "gauge", "free pages of the KV pool"),
    ("kv_pages_sessions", "gauge", "pages held by running streams"),
    ("kv_pages_cache", "gauge", "pages held by the prefix cache"),
)


async def metrics(request: Request) -> Response:
    x = _state(request).engine.metrics()
    lines = []
    for key, kind_, help_ in METRICS:
        lines += [f"# HELP dasllama_{key} {help_}", f"# TYPE dasllama_{key} {kind_}", f"dasllama_{key} {x[key]}"]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def guarded(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The API key checked first; an APIError answered as OpenAI-shaped JSON, anything else as a 500."""
    async def handler(request: Request) -> Response:
        try:
            key = _state(request).api_key
            if key is not None:
                auth = request.headers.get("authorization", "")
                if auth != f"Bearer {key}":
                    raise APIError(401, "a valid API key is required (Authorization: Bearer ...)",
                                   type="authentication_error", code="invalid_api_key")
            return await fn(request)
        except APIError as e:
            return _error(e)
        except Exception as e:  # noqa: BLE001 - answer, keep serving
            return _error(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
    return handler


async def not_found(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    return _error(APIError(status, f"{request.method} {request.url.path}: "
                                   f"{'not found' if status == 404 else 'method not allowed'}"))


ROUTES = [
    Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
    Route("/v1/completions", guarded(completions), methods=["POST"]),
    Route("/v1/embeddings", guarded(embeddings), methods=["POST"]),
    Route("/v1/audio/transcriptions", guarded(transcriptions), methods=["POST"]),
    Route("/v1/models", guarded(models), methods=["GET"]),
    Route("/metrics", guarded(metrics), methods=["GET"]),
    Route("/health", health, methods=["GET"]),
]


def create_app(model: Union[str, llm.Model] = "smollm2-135m-instruct", *, mmproj: Optional[str] = None,
               streams: int = 4, ctx: int = 0, api_key: Optional[str] = None, chunk: int = 0,
               max_queue: int = 0, kv_dtype: KVDtype = KVDtype.f16, n_threads: int = 0, cache_pages: int = 0,
               model_name: Optional[str] = None, limits: Optional[Limits] = None,
               chat_template: Optional[str] = None, device: Optional[str] = None,
               asr_model: Any = None) -> Starlette:
    """An ASGI app serving ``model`` (a hub name, a GGUF path or a loaded :class:`~dasllama.Model`).

    ``chat_template`` (Jinja source) replaces the model's own. ``device`` places a model (and tower)
    loaded here, as for :func:`~dasllama.load_model`; a loaded model's tower goes where it is.
    ``asr_model`` (a whisper registry name, a GGUF or CTranslate2 path, or a model
    :func:`~dasllama.load_asr_model` gave: whisper, Qwen3-ASR, Parakeet CTC) serves ``POST /v1/audio/transcriptions``; its name is listed by
    ``/v1/models`` beside the chat model's. Mount the app in another Starlette/FastAPI
    app or run it with uvicorn. The engine thread starts here;
    ``app.state.engine.stop()`` ends it (the ``dasllama serve`` command does so at shutdown).
    """
    m = model if isinstance(model, llm.Model) else llm.load_model(model, n_threads=n_threads, device=device)
    tower = vision = None
    if mmproj is not None:
        from .. import _core as _c
        from ..audio import TOWER_FAMILIES, load_audio_tower
        from ..vision import load_vision_embedder, vision_probe_family

        # One mmproj may carry an audio tower, a vision tower or both.
        if vision_probe_family(mmproj):
            vision = load_vision_embedder(mmproj, n_threads=n_threads, device=m.device)
            if vision.proj_dim != m.config.dim:
                raise ValueError(f"{mmproj}: the vision tower writes {vision.proj_dim}-wide rows; the model takes "
                                 f"{m.config.dim}")
        if vision is None or _c.AudioEncoder.probe_family(mmproj) in TOWER_FAMILIES:
            tower = load_audio_tower(mmproj, n_threads=n_threads, device=m.device)
            if tower.proj_dim != m.config.dim:
                raise ValueError(f"{mmproj}: the tower writes {tower.proj_dim}-wide rows; the model takes {m.config.dim}")
    name = model_name or (model if isinstance(model, str) else m.path.rsplit("/", 1)[-1])
    lim = limits or Limits()
    engine = Engine(m, streams=streams, n_ctx=ctx, kv_dtype=kv_dtype, chunk=chunk, max_queue=max_queue,
                    cache_pages=cache_pages).start()
    asr_m = asr_name = None
    if asr_model is not None:
        from ..asr import load_asr_model

        # A name or a path loads; anything else is a model load_asr_model gave (whisper, Qwen3-ASR, CTC).
        named = isinstance(asr_model, (str, os.PathLike))
        asr_m = load_asr_model(asr_model, n_threads=n_threads, device=device) if named else asr_model
        asr_name = os.fspath(asr_model if named else asr_m.path).rsplit("/", 1)[-1]
    app = Starlette(routes=ROUTES, exception_handlers={404: not_found, 405: not_found})
    app.state.server = AppState(model=m, tower=tower, engine=engine, chats=Chats(m, chat_template, tower, lim, vision=vision),
                                limits=lim, name=name, api_key=api_key, asr=asr_m, asr_name=asr_name)
    app.state.engine = engine
    app.state.model = m
    return app
