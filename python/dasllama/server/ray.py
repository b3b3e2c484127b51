"""Replicas of the OpenAI-compatible server on Ray Serve, routed to keep their prefix caches warm.

Needs the ``ray`` extra (``pip install 'dasllama[ray]'``); nothing else in dasllama imports this module.

- :class:`EngineReplica` (a Ray Serve deployment) runs the same Starlette app as ``dasllama serve``,
  one engine per replica, and answers requests forwarded to it as ASGI calls.
- :class:`Ingress` (the HTTP entry) parses a request body only to key it (routing.request_keys),
  forwards it to a replica through a handle whose request router is :class:`CacheAffinityRouter`,
  and streams the replica's answer back. A replica that dies mid-request answers its requests with
  a retryable 503 (Retry-After); Ray Serve starts a new replica in its place.
- :class:`CacheAffinityRouter` is Ray Serve's request-router API around routing.AffinityPolicy:
  replicas report the keys their prefix caches hold and their load through ``record_routing_stats``
  (every ``stats_period_s``); no token lists travel per request.
- ``/metrics`` sums the replicas' engine metrics and lists each replica's pool pages, from the
  reports the replicas post to a small board actor after each request and every second.

Compose :func:`build_app` into your own Serve application, or run :func:`serve_ray` (the command
``dasllama serve --ray --replicas N``).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any, Dict, List, Optional

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .protocol import APIError
from .routing import AffinityPolicy, KeyReport, Keys, body_of, decode_keys, encode_keys, reply_keys, request_keys

_NO_KEYS = Keys((), ())
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
BOARD = "dasllama-board"


# ---- the router ---------------------------------------------------------------------------------------

def _route_keys(pending_request: Optional[PendingRequest]) -> Keys:
    if pending_request is not None:
        for a in pending_request.args:
            if isinstance(a, dict) and isinstance(a.get("route"), Keys):
                return a["route"]
    return _NO_KEYS


class CacheAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router: the replica holding the longest prefix of a request's keys, unless
    its load is past ``max_load``; otherwise the least-loaded one (routing.AffinityPolicy decides)."""

    def initialize_state(self, max_load: int = 8, memory_s: float = 10.0, **_: Any) -> None:
        self.policy = AffinityPolicy(max_load=max_load, memory_s=memory_s)
        self._reports: Dict[str, str] = {}

    def _refresh(self, replicas: List[RunningReplica]) -> None:
        for r in replicas:
            enc = (r.routing_stats or {}).get("keys")
            rid = r.replica_id.unique_id
            if isinstance(enc, str) and self._reports.get(rid) != enc:
                self._reports[rid] = enc
                self.policy.report(rid, decode_keys(enc))

    def _load(self, r: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(r.replica_id)
        if q is None:
            q = int((r.routing_stats or {}).get("load", 0))
        return q

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._refresh(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = self.policy.rank(_route_keys(pending_request), {rid: self._load(r) for rid, r in by_id.items()})
        ranks = [[by_id[order[0]]]]
        if len(order) > 1:
            ranks.append([by_id[x] for x in order[1:]])
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        keys = _route_keys(pending_request)
        if keys.keys:
            self.policy.note_routed(replica_id.unique_id, keys)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self._reports.pop(replica_id.unique_id, None)


# ---- the metrics board ----------------------------------------------------------------------------------

@ray.remote(num_cpus=0)
class _Board:
    """Each replica's latest engine metrics, by replica id, with the time posted."""

    def __init__(self):
        self.m: Dict[str, tuple] = {}

    def put(self, rid: str, metrics: dict) -> None:
        self.m[rid] = (metrics, time.time())

    def drop(self, rid: str) -> None:
        self.m.pop(rid, None)

    def get(self, max_age_s: float) -> Dict[str, dict]:
        now = time.time()
        return {r: m for r, (m, t) in self.m.items() if now - t <= max_age_s}


def board_name(app_name: str) -> str:
    """The board actor's name for a Serve application (in the namespace ``serve``)."""
    return f"{BOARD}:{app_name}"


def _board():
    app = serve.get_replica_context().app_name
    return _Board.options(name=board_name(app), namespace="serve", get_if_exists=True, lifetime="detached").remote()


# ---- one replica: the plain server's app around one engine ----------------------------------------------

@serve.deployment
class EngineReplica:
    """One engine (the model, its towers, a KV pool and prefix cache) serving the plain server's app."""

    def __init__(self, model: Any, server_kwargs: Dict[str, Any]):
        from .app import create_app

        self.app = create_app(model, **server_kwargs)
        self.engine = self.app.state.engine
        self.report = KeyReport()
        self._inflight: Dict[str, int] = {}
        self._lock = threading.Lock()  # the report is written by requests and read by the stats call
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        self.board = _board()
        self._closing = threading.Event()
        threading.Thread(target=self._post_loop, name="dasllama-board", daemon=True).start()

    # The board sees each replica's metrics every second and right after each request.
    def snapshot(self) -> dict:
        return dict(self.engine.metrics(), replica=self.replica_id, pid=self.pid)

    def _post_loop(self) -> None:
        while not self._closing.wait(1.0):
            try:
                self.board.put.remote(self.replica_id, self.snapshot())
            except Exception:  # noqa: BLE001 - the board is best effort; routing never depends on it
                pass

    async def http(self, req: Dict[str, Any]):
        """Run one forwarded request through the app: yields (status, headers) first, then body chunks."""
        keys: Keys = req.get("route") or _NO_KEYS
        with self._lock:
            tag = self.report.add(keys) if keys.keys else ""
            if tag:
                self._inflight[tag] = self._inflight.get(tag, 0) + 1
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in req["headers"]
                   if k.lower() != "x-dasllama-cache-tag"]
        if tag:
            headers.append((b"x-dasllama-cache-tag", tag.encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req["method"],
                 "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(), "root_path": "",
                 "query_string": req.get("query", "").encode(), "headers": headers,
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
        body = req.get("body", b"")
        sent_body = False
        gone = asyncio.Event()
        out: asyncio.Queue = asyncio.Queue()

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # the app polls for a disconnect: only a cancelled call is one
            return {"type": "http.disconnect"}

        async def send(msg):
            await out.put(msg)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _t: out.put_nowait(None))
        status, chunks, kept = 500, [], 0
        try:
            while True:
                msg = await out.get()
                if msg is None:
                    break
                if msg["type"] == "http.response.start":
                    status = msg["status"]
                    hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in msg.get("headers", [])]
                    hdrs.append(("x-dasllama-replica", self.replica_id))
                    yield status, hdrs
                elif msg["type"] == "http.response.body":
                    piece = msg.get("body", b"")
                    if piece:
                        if status == 200 and kept < (1 << 20):  # enough for the reply's keys
                            chunks.append(piece)
                            kept += len(piece)
                        yield piece
            task.result()
        finally:
            gone.set()
            if not task.done():
                task.cancel()
            if tag:
                with self._lock:
                    self._inflight[tag] -= 1
                    if not self._inflight[tag]:
                        del self._inflight[tag]
            if status == 200 and tag:
                self._note_reply(keys, tag, req, b"".join(chunks))
            try:
                await self.board.put.remote(self.replica_id, self.snapshot())
            except Exception:  # noqa: BLE001
                pass

    def _note_reply(self, keys: Keys, tag: str, req: Dict[str, Any], raw: bytes) -> None:
        # A chat reply's pages were donated with the prompt's, so the next turn (which sends the reply
        # back as an assistant message) matches past it: its keys join the donation's.
        body = body_of(req.get("body", b""))
        try:
            if raw.startswith(b"data:"):  # a stream: the deltas' text
                text = "".join(
                    (json.loads(ln[5:]).get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                    for ln in raw.split(b"\n") if ln.startswith(b"data:") and ln[5:].strip() != b"[DONE]")
            else:
                text = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return
        if isinstance(text, str) and isinstance(body, dict):
            with self._lock:
                self.report.add(reply_keys(keys, body, text), tag=tag)

    def record_routing_stats(self) -> Dict[str, Any]:
        """What the router reads every stats period: the keys still cached, and the load."""
        from .. import kv

        rows = self.engine.pool.page_rows
        chains = kv.prefix_chain_list(self.engine.cache)
        with self._lock:
            live: Dict[str, float] = {t: 1.0 for t in self._inflight}
            for c in chains:
                if c.preview and c.tokens > 0:
                    live[c.preview] = max(live.get(c.preview, 0.0), min(1.0, c.live_pages * rows / c.tokens))
            keys = self.report.snapshot(live)
        m = self.engine.metrics()
        return {"keys": encode_keys(keys), "load": m["queue_depth"] + m["active_streams"]}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; an engine whose thread has stopped gets the replica replaced."""
        if not self.engine.alive():
            raise RuntimeError("the engine thread is not running")

    def metrics(self) -> dict:
        return self.snapshot()

    def __del__(self):
        # Ray Serve drains a replica (no new requests, in-flight ones finish) before deleting it.
        closing = getattr(self, "_closing", None)
        if closing is not None:
            closing.set()
            try:
                self.board.drop.remote(self.replica_id)
            except Exception:  # noqa: BLE001
                pass
            self.engine.stop()


# ---- the HTTP entry ---------------------------------------------------------------------------------------

def _retryable(message: str) -> Response:
    e = APIError(503, message, type="server_error", code="replica_unavailable", headers={"Retry-After": "1"})
    return JSONResponse(e.body(), status_code=503, headers=e.headers)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Ingress:
    """The HTTP entry: keys each generation request, forwards it to a replica and streams the answer."""

    def __init__(self, engine, api_key: Optional[str] = None, max_body_bytes: int = 64 << 20):
        self.engine = engine
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.board = _board()

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a route prefix
            path = path[len(root):] or "/"
        if path == "/health":
            return JSONResponse({"status": "ok"})
        if self.api_key is not None and path == "/metrics" and \
                request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            e = APIError(401, "a valid API key is required (Authorization: Bearer ...)",
                         type="authentication_error", code="invalid_api_key")
            return JSONResponse(e.body(), status_code=401)
        if path == "/metrics" and request.method == "GET":
            return await self.metrics()
        body = await request.body()
        if len(body) > self.max_body_bytes:
            e = APIError(413, f"the body is over the {self.max_body_bytes} byte limit")
            return JSONResponse(e.body(), status_code=413)
        keys = request_keys(body_of(body)) if request.method == "POST" and path in _GENERATION_PATHS else _NO_KEYS
        req = {"method": request.method, "path": path, "query": request.url.query, "body": body, "route": keys,
               "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]}
        gen = self.engine.options(stream=True).http.remote(req)
        try:
            status, headers = await gen.__anext__()
        except StopAsyncIteration:
            return _retryable("the replica ended the request without an answer; retry")
        except Exception as e:  # noqa: BLE001 - a replica that died or went away: the client may retry
            return _retryable(f"the replica serving this request failed ({type(e).__name__}); retry")
        sse = any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)

        async def rest():
            try:
                async for piece in gen:
                    yield piece
            except Exception as e:  # noqa: BLE001 - the replica died mid-stream: end with an error event
                if sse:
                    err = APIError(503, f"the replica serving this stream failed ({type(e).__name__}); retry",
                                   type="server_error", code="replica_unavailable")
                    yield f"data: {json.dumps(err.body())}\n\n".encode()

        keep = {k: v for k, v in headers if k.lower() != "content-length"}
        return StreamingResponse(rest(), status_code=status, headers=keep)

    async def metrics(self) -> Response:
        from .app import METRICS

        per = await self.board.get.remote(5.0)
        lines = ["# HELP dasllama_replicas replicas reporting in the last 5 s", "# TYPE dasllama_replicas gauge",
                 f"dasllama_replicas {len(per)}"]
        for key, kind_, help_ in METRICS:
            lines += [f"# HELP dasllama_{key} {help_} (all replicas; per replica with its label)",
                      f"# TYPE dasllama_{key} {kind_}",
                      f"dasllama_{key} {sum(m.get(key, 0) for m in per.values())}"]
            lines += [f'dasllama_{key}{{replica="{rid}"}} {m.get(key, 0)}' for rid, m in sorted(per.items())]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


# ---- composing and running ---------------------------------------------------------------------------------

def build_app(model: Any = "smollm2-135m-instruct", *, replicas: int = 2, replica_cpus: float = 1.0,
              replica_gpus: float = 0.0, api_key: Optional[str] = None, max_load: Optional[int] = None,
              stats_period_s: float = 1.0, health_check_period_s: float = 5.0,
              graceful_shutdown_timeout_s: float = 60.0, **server_kwargs: Any):
    """The Serve application (an ingress bound to ``replicas`` engine replicas), for ``serve.run`` or to
    compose into your own. ``server_kwargs`` go to each replica's :func:`~dasllama.server.app.create_app`
    (streams, ctx, mmproj, n_threads, device, ...). ``max_load``: requests in flight past which a replica
    loses its cache affinity (default: twice its streams)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    streams = int(server_kwargs.get("streams", 4))
    queue = int(server_kwargs.get("max_queue", 0)) or 4 * streams
    server_kwargs["api_key"] = api_key
    engine = EngineReplica.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        # The engine queues what its streams cannot take yet; Ray holds the rest.
        max_ongoing_requests=streams + queue,
        request_router_config=RequestRouterConfig(
            request_router_class=CacheAffinityRouter,
            request_router_kwargs={"max_load": max_load if max_load is not None else 2 * streams},
            request_routing_stats_period_s=stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 4 * stats_period_s)),
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=60.0,
        graceful_shutdown_wait_loop_s=1.0,
        graceful_shutdown_timeout_s=graceful_shutdown_timeout_s,
    ).bind(model, server_kwargs)
    return Ingress.bind(engine, api_key)


def serve_ray(model: Any = "smollm2-135m-instruct", host: str = "127.0.0.1", port: int = 8080, *,
              ray_address: Optional[str] = None, **kwargs: Any) -> None:
    """Run the replicated server until interrupted: on the Ray cluster at ``ray_address``, or on a
    local one started here."""
    ray.init(address=ray_address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(model, **kwargs), name="dasllama", route_prefix="/")
    print(f"dasllama: serving on http://{host}:{port}/v1 with {kwargs.get('replicas', 2)} replicas "
          f"(Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
