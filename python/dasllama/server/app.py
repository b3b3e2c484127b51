"""The OpenAI-compatible HTTP layer (Starlette): routes, auth, limits, SSE; generation is the engine's."""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import llm
from ..chat.template import TemplateError, render_messages
from ..llm import KVDtype, SamplingParams
from .engine import Engine, Finish, Job
from .protocol import APIError, GenRequest, Limits, bad, parse_chat, parse_completion, parse_embeddings


class _Template:
    """The model's chat template and its bos/eos strings, read from the GGUF once."""

    def __init__(self, model: llm.Model):
        from ..gguf import GGUFFile

        meta = GGUFFile(model.path).metadata
        self.source = meta.get("tokenizer.chat_template") or ""
        toks = meta.get("tokenizer.ggml.tokens", [])

        def tok(key: str) -> str:
            i = meta.get(key)
            return toks[i] if isinstance(i, int) and 0 <= i < len(toks) else ""

        self.bos, self.eos = tok("tokenizer.ggml.bos_token_id"), tok("tokenizer.ggml.eos_token_id")

    def render(self, r: GenRequest) -> str:
        if not self.source:
            raise APIError(400, "the model has no chat template; use /v1/completions")
        kw: Dict[str, Any] = dict(r.template_kwargs)
        if r.tools:
            kw["tools"] = r.tools
        if r.enable_thinking is not None:
            kw["enable_thinking"] = r.enable_thinking
        return render_messages(self.source, r.messages, True, bos_token=self.bos, eos_token=self.eos, **kw)


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
               max_queue: int = 0, kv_dtype: KVDtype = KVDtype.f16, n_threads: int = 0,
               model_name: Optional[str] = None, limits: Optional[Limits] = None) -> Starlette:
    """An ASGI app serving ``model`` (a hub name, a GGUF path or a loaded :class:`~dasllama.Model`).

    Mount it in another Starlette/FastAPI app or run it with uvicorn. The engine thread starts here;
    ``app.state.engine.stop()`` ends it (the ``dasllama serve`` command does so at shutdown).
    """
    m = model if isinstance(model, llm.Model) else llm.load_model(model, n_threads=n_threads)
    if mmproj is not None:
        raise NotImplementedError("audio towers (mmproj) are not served by this build yet")
    name = model_name or (model if isinstance(model, str) else m.path.rsplit("/", 1)[-1])
    lim = limits or Limits()
    engine = Engine(m, streams=streams, n_ctx=ctx, kv_dtype=kv_dtype, chunk=chunk, max_queue=max_queue).start()
    tpl = _Template(m)
    created = int(time.time())

    async def read_json(request: Request) -> Any:
        n = request.headers.get("content-length")
        if n is not None and (not n.isdigit() or int(n) > lim.max_body_bytes):
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

    async def run_job(request: Request, r: GenRequest, prompt: List[int], kind: str) -> Response:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_event(kind_: str, payload: object) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (kind_, payload))

        job = Job(prompt=prompt, params=_sampling(r), max_tokens=r.max_tokens, on_event=on_event, stop=r.stop,
                  seed=r.sampling.seed, deadline=(time.monotonic() + r.timeout_s) if r.timeout_s else None)
        engine.submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def usage(f: Finish) -> Dict[str, Any]:
            return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                    "total_tokens": f.prompt_tokens + f.completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}

        if r.stream:
            async def sse():
                def chunk(delta: Optional[str], finish: Optional[str], first: bool = False) -> str:
                    if kind == "chat":
                        d: Dict[str, Any] = {}
                        if first:
                            d["role"] = "assistant"
                        if delta is not None:
                            d["content"] = delta
                        ch = {"index": 0, "delta": d, "finish_reason": finish}
                    else:
                        ch = {"index": 0, "text": delta or "", "finish_reason": finish}
                    body = {"id": rid, "object": obj + ".chunk" if kind == "chat" else obj, "created": int(time.time()),
                            "model": name, "choices": [ch]}
                    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

                try:
                    if kind == "chat":
                        yield chunk(None, None, first=True)
                    while True:
                        ev, payload = await q.get()
                        if ev == "text":
                            yield chunk(payload, None)
                        elif ev == "done":
                            yield chunk(None, payload.reason)
                            if r.include_usage:
                                body = {"id": rid, "object": obj + ".chunk" if kind == "chat" else obj,
                                        "created": int(time.time()), "model": name, "choices": [],
                                        "usage": usage(payload)}
                                yield f"data: {json.dumps(body)}\n\n"
                            break
                        else:
                            yield f"data: {json.dumps(payload.body())}\n\n"
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
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin.reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": fin.reason, "logprobs": None}
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": name,
                             "choices": [choice], "usage": usage(fin)})

    async def chat_completions(request: Request) -> Response:
        r = parse_chat(await read_json(request), lim)
        if r.audio:
            raise bad("this server has no audio tower: start it with --mmproj to send input_audio", "messages")
        try:
            text = await asyncio.to_thread(tpl.render, r)
        except TemplateError as e:
            raise bad(f"the chat template failed on these messages: {e}", "messages") from None
        prompt = await asyncio.to_thread(tokenize, text, False)
        return await run_job(request, r, prompt, "chat")

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
                ("kv_tokens_held", "gauge", "KV positions held by the streams"),
                ("kv_tokens_total", "gauge", "KV positions of all streams")):
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
