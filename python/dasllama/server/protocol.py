"""OpenAI request parsing and validation: JSON bodies in, checked plain records out (no HTTP, no model)."""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


class APIError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def bad(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class Limits:
    """Bounds on what one request may ask for; each breach is a 400 naming it."""

    max_body_bytes: int = 32 << 20
    max_messages: int = 1024
    max_media_bytes: int = 25 << 20      # decoded audio and image file bytes per request
    max_audio_seconds: float = 600.0
    max_images: int = 8                  # image_url parts per request
    max_image_pixels: int = 32 << 20     # per image (width x height, read from the header before decoding)
    # http(s) image URLs: fetched by the server only when the operator allows it (server/remote.py)
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0       # per fetch: connect, each read and the whole transfer
    max_stop: int = 16
    max_embedding_inputs: int = 256


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None


@dataclass
class AudioPart:
    data: bytes
    format: str


@dataclass
class ImagePart:
    data: bytes  # the image file's bytes (from a data: URL; empty for a remote one until fetched)
    url: str = ""  # a remote http(s) URL, fetched when the conversation is built (allow_remote_media)


@dataclass
class GenRequest:
    """A chat or completion request after validation."""

    kind: str                                  # "chat" or "completion"
    model: Optional[str]
    stream: bool
    include_usage: bool
    max_tokens: Optional[int]
    sampling: Sampling
    stop: List[str]
    messages: List[Dict[str, Any]] = field(default_factory=list)  # chat: text-only messages for the template
    audio: List[AudioPart] = field(default_factory=list)
    images: List[ImagePart] = field(default_factory=list)
    prompt: str = ""                           # completion
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Any = None
    enable_thinking: Optional[bool] = None
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    timeout_s: Optional[float] = None


_ROLES = {"system", "developer", "user", "assistant", "tool"}
_AUDIO_FORMATS = {"wav", "mp3", "flac", "ogg"}


def _num(body: Dict[str, Any], key: str, lo: float, hi: float, default, integer: bool = False):
    v = body.get(key, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{key}' must be finite", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' = {v} is outside [{lo}, {hi}]", key)
    return v


def _bool(body: Dict[str, Any], key: str, default: Optional[bool]) -> Optional[bool]:
    v = body.get(key, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def _common(body: Dict[str, Any], kind: str, limits: Limits) -> GenRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    n = _num(body, "n", 1, 1, 1, integer=True)
    del n
    if body.get("logprobs") not in (None, False):
        raise bad("'logprobs' is not supported", "logprobs")
    stream = bool(_bool(body, "stream", False))
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    include_usage = bool((so or {}).get("include_usage", False))
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        mt = _num({"max_tokens": mt}, "max_tokens", 1, 1 << 30, None, integer=True)
    elif kind == "completion":
        mt = 16  # OpenAI's default for /v1/completions
    s = Sampling(
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0),
        top_k=_num(body, "top_k", 0, 1 << 20, 0, integer=True),
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        repeat_penalty=_num(body, "repeat_penalty", 0.01, 10.0, 1.0),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        seed=_num(body, "seed", -(1 << 63), (1 << 64) - 1, None, integer=True),
    )
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > limits.max_stop:
        raise bad(f"'stop' has {len(stop)} entries; at most {limits.max_stop}", "stop")
    stop = [x for x in stop if x]
    timeout = _num(body, "timeout", 0.001, 86400.0, None)
    return GenRequest(kind=kind, model=model, stream=stream, include_usage=include_usage, max_tokens=mt, sampling=s,
                      stop=stop, timeout_s=timeout)


def _decode_audio_part(part: Dict[str, Any], i: int, limits: Limits, budget: List[int]) -> AudioPart:
    ia = part.get("input_audio")
    if not isinstance(ia, dict):
        raise bad(f"messages[{i}]: an input_audio part needs an 'input_audio' object", "messages")
    fmt, data = ia.get("format"), ia.get("data")
    if fmt not in _AUDIO_FORMATS:
        raise bad(f"messages[{i}]: input_audio format {fmt!r} is not one of {sorted(_AUDIO_FORMATS)}", "messages")
    if not isinstance(data, str):
        raise bad(f"messages[{i}]: input_audio 'data' must be a base64 string", "messages")
    if len(data) // 4 * 3 > limits.max_media_bytes:
        raise bad(f"messages[{i}]: audio is over the {limits.max_media_bytes} byte limit", "messages")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"messages[{i}]: input_audio 'data' is not valid base64", "messages") from None
    budget[0] += len(raw)
    if budget[0] > limits.max_media_bytes:
        raise bad(f"the request's audio is over the {limits.max_media_bytes} byte limit", "messages")
    return AudioPart(raw, fmt)


def _decode_image_part(part: Dict[str, Any], i: int, limits: Limits, budget: List[int]) -> ImagePart:
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, dict) else iu
    if not isinstance(url, str):
        raise bad(f"messages[{i}]: an image_url part needs an 'image_url' object with a string 'url'", "messages")
    head, comma, data = url.partition(",")
    if not head.lower().startswith("data:"):
        scheme = url.split(":", 1)[0][:16].lower() if ":" in url else "a bare path"
        if limits.allow_remote_media and scheme in ("http", "https"):
            if len(url) > 8192:
                raise bad(f"messages[{i}]: the image URL is over 8192 characters", "messages")
            return ImagePart(b"", url)  # fetched off the event loop, with the rest of the conversation
        if limits.allow_remote_media:
            raise bad(f"messages[{i}]: image_url must be a data: URL or an http(s) URL, not {scheme}", "messages")
        raise bad(f"messages[{i}]: image_url must be a data: URL (base64); remote URLs ({scheme}) are off "
                  "on this server", "messages")
    if not comma or not head.lower().endswith(";base64"):
        raise bad(f"messages[{i}]: an image data: URL must be base64 (data:image/png;base64,...)", "messages")
    if len(data) // 4 * 3 > limits.max_media_bytes:
        raise bad(f"messages[{i}]: the image is over the {limits.max_media_bytes} byte limit", "messages")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"messages[{i}]: the image data: URL is not valid base64", "messages") from None
    budget[0] += len(raw)
    if budget[0] > limits.max_media_bytes:
        raise bad(f"the request's media are over the {limits.max_media_bytes} byte limit", "messages")
    return ImagePart(raw)


def parse_chat(body: Dict[str, Any], limits: Limits) -> GenRequest:
    r = _common(body, "chat", limits)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(msgs) > limits.max_messages:
        raise bad(f"{len(msgs)} messages; at most {limits.max_messages}", "messages")
    budget = [0]
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"messages[{i}]: role {role!r} is not one of {sorted(_ROLES)}", "messages")
        content = m.get("content")
        out: Dict[str, Any] = {"role": "system" if role == "developer" else role}
        if content is None:
            if role != "assistant" or not m.get("tool_calls"):
                raise bad(f"messages[{i}]: 'content' is required", "messages")
            out["content"] = ""
        elif isinstance(content, str):
            out["content"] = content
        elif isinstance(content, list):
            texts = []
            for p in content:
                if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                    raise bad(f"messages[{i}]: each content part must be an object with a 'type'", "messages")
                if p["type"] == "text":
                    if not isinstance(p.get("text"), str):
                        raise bad(f"messages[{i}]: a text part needs a string 'text'", "messages")
                    texts.append(p["text"])
                elif p["type"] == "input_audio":
                    if role != "user":
                        raise bad(f"messages[{i}]: input_audio parts belong to user messages", "messages")
                    a = _decode_audio_part(p, i, limits, budget)
                    r.audio.append(a)
                    out.setdefault("_audio", []).append(a)
                elif p["type"] == "image_url":
                    if role != "user":
                        raise bad(f"messages[{i}]: image_url parts belong to user messages", "messages")
                    if len(r.images) >= limits.max_images:
                        raise bad(f"more than {limits.max_images} images in the request", "messages")
                    im = _decode_image_part(p, i, limits, budget)
                    r.images.append(im)
                    out.setdefault("_images", []).append(im)
                else:
                    raise bad(f"messages[{i}]: content part type {p['type']!r} is not supported", "messages")
            out["content"] = "".join(texts)
        else:
            raise bad(f"messages[{i}]: 'content' must be a string or a list of parts", "messages")
        if m.get("tool_calls") is not None:
            tc = m["tool_calls"]
            if not isinstance(tc, list) or not all(isinstance(c, dict) for c in tc):
                raise bad(f"messages[{i}]: 'tool_calls' must be a list of objects", "messages")
            out["tool_calls"] = tc
        for k in ("tool_call_id", "name", "reasoning_content"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise bad(f"messages[{i}]: '{k}' must be a string", "messages")
                out[k] = m[k]
        r.messages.append(out)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("'tools' must be a list of objects", "tools")
        r.tools = tools or None
    r.tool_choice = body.get("tool_choice")
    if r.tool_choice is not None and not isinstance(r.tool_choice, (str, dict)):
        raise bad("'tool_choice' must be a string or an object", "tool_choice")
    r.enable_thinking = _bool(body, "enable_thinking", None)
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        r.template_kwargs = dict(kw)
        if r.enable_thinking is None and isinstance(kw.get("enable_thinking"), bool):
            r.enable_thinking = kw["enable_thinking"]
    # OpenAI's own knob; templates that read it (gpt-oss's Harmony) take it as a variable, as
    # llama-server does. chat_template_kwargs names it explicitly and wins.
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        r.template_kwargs.setdefault("reasoning_effort", effort)
    return r


def parse_completion(body: Dict[str, Any], limits: Limits) -> GenRequest:
    r = _common(body, "completion", limits)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if not isinstance(p, str):
        raise bad("'prompt' must be a string (or a list holding one string)", "prompt")
    if body.get("echo") or body.get("suffix") is not None or body.get("best_of") not in (None, 1):
        raise bad("'echo', 'suffix' and 'best_of' are not supported", "prompt")
    r.prompt = p
    return r


def parse_embeddings(body: Dict[str, Any], limits: Limits):
    """(inputs, encoding_format): 'float' gives lists, 'base64' little-endian float32 bytes (the OpenAI SDK's default)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    x = body.get("input")
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list) or not x or not all(isinstance(s, str) for s in x):
        raise bad("'input' must be a string or a non-empty list of strings", "input")
    if len(x) > limits.max_embedding_inputs:
        raise bad(f"{len(x)} inputs; at most {limits.max_embedding_inputs}", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    return x, fmt


async def read_body(request: Any, lim: Limits) -> bytes:
    """The body's bytes, refused past ``lim.max_body_bytes`` before it is all read."""
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
    return bytes(buf)
