"""The OpenAI-compatible HTTP layer (Starlette): routes, auth, limits, SSE; generation is the engine's."""
from __future__ import annotations

import asyncio
import base64
import copy
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import chat, llm
from ..chat.template import TemplateError
from ..llm import KVDtype, SamplingParams
from .engine import Engine, Finish, Job
from .protocol import APIError, GenRequest, Limits, bad, parse_chat, parse_completion, parse_embeddings


class _Chats:
    """Per-request chat renderers over one model: the chat layer's template (the GGUF's, else the family
    default), system folding, thinking switch, stop ids, reasoning splitter and tool-call parser."""

    def __init__(self, model: llm.Model, template: Optional[str], tower=None, limits: Optional[Limits] = None):
        self.model, self.template, self.tower, self.limits = model, template, tower, limits or Limits()
        self.base = chat.create_chat_renderer(model)
        if template:
            self.base.template = template
        chat.effective_stop_ids(self.base)  # derive once; copies share the compiled template

    def _options(self, c, r: GenRequest):
        c.tools = list(r.tools or [])
        kw = dict(r.template_kwargs)
        kw.pop("enable_thinking", None)
        c.template_kwargs = kw
        if r.enable_thinking is not None:
            c.thinking = r.enable_thinking

    def build(self, r: GenRequest):
        msgs = [_template_message(m) for m in r.messages]
        if msgs[-1]["role"] not in ("user", "tool"):
            raise bad("the last message must be from the user or a tool", "messages")
        if r.audio:
            return self._build_audio(r, msgs)
        c = copy.copy(self.base)
        c.history, c.pending, c.rendered = msgs[:-1], msgs[-1:], []
        self._options(c, r)
        return c

    def _build_audio(self, r: GenRequest, msgs):
        """A renderer with the tower: the history replayed turn by turn, each clip a content-keyed span, so a
        clip the prefix cache or the tower-output cache already holds costs no encode and no prefill."""
        from ..audio_io import SAMPLE_RATE, load_audio

        if self.tower is None:
            raise bad("this server has no audio tower: start it with --mmproj to send input_audio", "messages")
        system = ""
        while msgs and msgs[0]["role"] == "system":
            system += ("\n\n" if system else "") + msgs.pop(0)["content"]
        if not msgs:
            raise bad("no user message", "messages")
        c = chat.create_chat_renderer(self.model, system=system, tower=self.tower)
        if self.template:
            c.template = self.template
        self._options(c, r)
        seconds = 0.0
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user":
                for a in m.get("_audio", []):
                    try:
                        x = load_audio(a.data)
                    except (ValueError, TypeError) as e:
                        raise bad(f"input_audio ({a.format}): {e}", "messages") from None
                    seconds += len(x) / SAMPLE_RATE
                    if seconds > self.limits.max_audio_seconds:
                        raise bad(f"the request's audio is over {self.limits.max_audio_seconds:g} s", "messages")
                    try:
                        chat.add_user_audio(c, x)
                    except ValueError as e:
                        raise bad(f"input_audio: {e}", "messages") from None
                chat.add_user(c, m["content"])
            elif role == "assistant":
                if i == len(msgs) - 1 or not c.pending:
                    raise bad("an assistant message must follow a user turn", "messages")
                chat.render_assistant(self.model, c, m["content"])
            else:
                raise bad(f"role {role!r} is not supported in a conversation with audio", "messages")
        return c


def _template_message(m: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI's assistant tool_calls carry arguments as JSON text; chat templates expect a mapping."""
    if "tool_calls" not in m:
        return m
    m = dict(m)
    calls = []
    for tc in m["tool_calls"]:
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        call = {"type": "function", "function": {"name": str(fn.get("name", "")), "arguments": args}}
        if tc.get("id"):
            call["id"] = tc["id"]
        calls.append(call)
    m["tool_calls"] = calls
    return m


def _sampling(r: GenRequest) -> SamplingParams:
    s = r.sampling
    # seed -1: the engine seeds each stream once (from the request's seed or at random).
    return SamplingParams(temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                          repeat_penalty=s.repeat_penalty, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, seed=-1)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(model: Union[str, llm.Model] = "smollm2-135m-instruct", *, mmproj: Optional[str] = None,
               streams: int = 4, ctx: int = 0, api_key: Optional[str] = None, chunk: int = 256,
               max_queue: int = 0, kv_dtype: KVDtype = KVDtype.f16, n_threads: int = 0, cache_pages: int = 0,
               model_name: Optional[str] = None, limits: Optional[Limits] = None,
               chat_template: Optional[str] = None, device: Optional[str] = None) -> Starlette:
    """An ASGI app serving ``model`` (a hub name, a GGUF path or a loaded :class:`~dasllama.Model`).

    ``chat_template`` (Jinja source) replaces the model's own. ``device`` places a model (and tower)
    loaded here, as for :func:`~dasllama.load_model`; a loaded model's tower goes where it is. Mount the app in another Starlette/FastAPI
    app or run it with uvicorn. The engine thread starts here;
    ``app.state.engine.stop()`` ends it (the ``dasllama serve`` command does so at shutdown).
    """
    m = model if isinstance(model, llm.Model) else llm.load_model(model, n_threads=n_threads, device=device)
    tower = None
    if mmproj is not None:
        from ..audio import load_audio_tower

        tower = load_audio_tower(mmproj, n_threads=n_threads, device=m.device)
        if tower.proj_dim != m.config.dim:
            raise ValueError(f"{mmproj}: the tower writes {tower.proj_dim}-wide rows; the model takes {m.config.dim}")
    name = model_name or (model if isinstance(model, str) else m.path.rsplit("/", 1)[-1])
    lim = limits or Limits()
    engine = Engine(m, streams=streams, n_ctx=ctx, kv_dtype=kv_dtype, chunk=chunk, max_queue=max_queue,
                    cache_pages=cache_pages).start()
    chats = _Chats(m, chat_template, tower, lim)
    created = int(time.time())

    async def read_json(request: Request) -> Any:
        n = request.headers.get("content-length")
        if n is not None and not n.isdigit():
            raise bad(f"bad Content-Length {n[:32]!r}")
        if n is not None and int(n) > lim.max_body_bytes:
            raise APIError(413, f"the body is over the {lim.max_body_bytes} byte limit")
        buf = bytearray()
        async for piece in request.stream():
            buf += piece
            if len(buf) > lim.max_body_bytes:
                raise APIError(413, f"the body is over the {lim.max_body_bytes} byte limit")
        try:
            return json.loads(bytes(buf))
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON: {e}") from None

    def tokenize(text: str, special: bool) -> List[int]:
        return llm.encode(m, text, add_special=special, parse_special=not special)

    async def run_job(request: Request, r: GenRequest, prompt: List[int], kind: str, c=None,
                      stop_ids=(), media=None) -> Response:
        """Queue one generation and answer it plainly or as SSE. ``c``: the chat renderer of a chat request
        (reasoning split into reasoning_content, tool calls parsed when tools were offered)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(kind_: str, payload: object) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (kind_, payload))

        job = Job(prompt=prompt, params=_sampling(r), max_tokens=r.max_tokens, on_event=on_event, stop=r.stop,
                  stop_ids=set(stop_ids), seed=r.sampling.seed, media_chat=media,
                  deadline=(time.monotonic() + r.timeout_s) if r.timeout_s else None)
        engine.submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if kind == "chat" else "text_completion"
        tools = kind == "chat" and bool(r.tools)

        def usage(f: Finish) -> Dict[str, Any]:
            return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                    "total_tokens": f.prompt_tokens + f.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}

        def shaped(text: str):
            """(reasoning, content, tool_calls) of a complete chat reply."""
            if c is None:
                return "", text, []
            tr = chat.parse_calls(c, text) if tools else chat.split_reasoning(c, text)
            calls = [{"id": tc.id or "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": tc.name, "arguments": tc.args}} for tc in getattr(tr, "calls", [])]
            return tr.reasoning, tr.content, calls

        if r.stream:
            async def sse():
                def event(body: Dict[str, Any]) -> str:
                    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

                def chunk(delta: Optional[Dict[str, Any]], text: Optional[str], finish: Optional[str]) -> str:
                    ch = ({"index": 0, "delta": delta or {}, "finish_reason": finish} if kind == "chat"
                          else {"index": 0, "text": text or "", "finish_reason": finish})
                    return event({"id": rid, "object": obj + ".chunk" if kind == "chat" else obj,
                                  "created": int(time.time()), "model": name, "choices": [ch]})

                ts = chat.make_think_stream(c) if c is not None else None
                held: List[str] = []  # with tools, content waits for the end: it may be a call
                try:
                    if kind == "chat":
                        yield chunk({"role": "assistant", "content": ""}, None, None)
                    while True:
                        ev, payload = await q.get()
                        if ev == "text":
                            if kind != "chat":
                                yield chunk(None, payload, None)
                                continue
                            rs, ct = chat.think_feed(ts, payload)
                            if rs:
                                yield chunk({"reasoning_content": rs}, None, None)
                            if ct:
                                if tools:
                                    held.append(ct)
                                else:
                                    yield chunk({"content": ct}, None, None)
                        elif ev == "done":
                            reason = payload.reason
                            if kind == "chat":
                                rs, ct = chat.think_finish(ts)
                                if rs:
                                    yield chunk({"reasoning_content": rs}, None, None)
                                if tools:
                                    _, content, calls = shaped("".join(held) + ct)
                                    if content:
                                        yield chunk({"content": content}, None, None)
                                    if calls:
                                        yield chunk({"tool_calls": [dict(tc, index=i) for i, tc in enumerate(calls)]},
                                                    None, None)
                                        reason = "tool_calls"
                                elif ct:
                                    yield chunk({"content": ct}, None, None)
                            yield chunk({}, None, reason)
                            if r.include_usage:
                                yield event({"id": rid, "object": obj + ".chunk" if kind == "chat" else obj,
                                             "created": int(time.time()), "model": name, "choices": [],
                                             "usage": usage(payload)})
                            break
                        else:
                            yield event(payload.body())
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    job.cancel()  # a client that went away frees its stream at the next step

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

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
        if kind == "chat":
            reasoning, content, calls = shaped(text)
            msg: Dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = calls
            choice = {"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else fin.reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": fin.reason, "logprobs": None}
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": name,
                             "choices": [choice], "usage": usage(fin)})

    async def chat_completions(request: Request) -> Response:
        r = parse_chat(await read_json(request), lim)
        if r.audio and tower is None:
            raise bad("this server has no audio tower: start it with --mmproj to send input_audio", "messages")

        def render():
            c = chats.build(r)  # audio: decoded and keyed here, off the event loop
            if r.audio:
                return c, chat.prompt_ids(c), chat.effective_stop_ids(c)
            return c, chat.render_turn(m, c), chat.effective_stop_ids(c)

        try:
            c, prompt, stops = await asyncio.to_thread(render)
        except TemplateError as e:
            raise bad(f"the chat template failed on these messages: {e}", "messages") from None
        return await run_job(request, r, prompt, "chat", c, stops, media=c if r.audio else None)

    async def completions(request: Request) -> Response:
        r = parse_completion(await read_json(request), lim)
        prompt = await asyncio.to_thread(tokenize, r.prompt, True)
        return await run_job(request, r, prompt, "completion")

    async def embeddings(request: Request) -> Response:
        inputs, fmt = parse_embeddings(await read_json(request), lim)
        n_tok = 0
        data = []
        for i, text in enumerate(inputs):
            ids = await asyncio.to_thread(tokenize, text, True)
            if len(ids) > engine.n_ctx:
                raise bad(f"input[{i}] has {len(ids)} tokens; at most {engine.n_ctx}", "input")
            n_tok += len(ids)
            v = await asyncio.to_thread(llm.embed, m, text)
            emb = (base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
                   else [float(x) for x in v])
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return JSONResponse({"object": "list", "data": data, "model": name,
                             "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                         "owned_by": "dasllama"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        x = engine.metrics()
        lines = []
        for key, kind_, help_ in (
                ("queue_depth", "gauge", "requests waiting for a stream"),
                ("active_streams", "gauge", "streams generating now"),
                ("streams", "gauge", "streams the engine steps"),
                ("requests_total", "counter", "generation requests accepted"),
                ("prompt_tokens_total", "counter", "prompt tokens of accepted requests"),
                ("cached_tokens_total", "counter", "prompt tokens served from the KV without prefill"),
                ("generated_tokens_total", "counter", "tokens generated"),
                ("tokens_per_second", "gauge", "tokens generated per second over the last 10 s"),
                ("cache_hits_total", "counter", "requests that attached a cached prefix"),
                ("media_rows_prefilled_total", "counter", "audio rows prefilled (not attached from the cache)"),
                ("audio_encodes_total", "counter", "audio tower runs"),
                ("kv_pages_total", "gauge", "pages of the KV pool"),
                ("kv_pages_free", "gauge", "free pages of the KV pool"),
                ("kv_pages_sessions", "gauge", "pages held by running streams"),
                ("kv_pages_cache", "gauge", "pages held by the prefix cache")):
            lines += [f"# HELP dasllama_{key} {help_}", f"# TYPE dasllama_{key} {kind_}", f"dasllama_{key} {x[key]}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def guarded(fn):
        async def handler(request: Request) -> Response:
            try:
                if api_key is not None:
                    auth = request.headers.get("authorization", "")
                    if auth != f"Bearer {api_key}":
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

    routes = [
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/embeddings", guarded(embeddings), methods=["POST"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.engine = engine
    app.state.model = m
    return app
