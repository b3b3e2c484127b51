"""``POST /v1/audio/transcriptions``: OpenAI's speech-to-text endpoint over the server's ASR model
(``create_app(asr_model=...)``, ``dasllama serve --asr-model NAME|PATH``).

The request is multipart/form-data as OpenAI takes it: ``file`` (WAV / FLAC / OGG / MP3), ``model``
(any name: the server has one ASR model), ``language``, ``temperature``, ``response_format`` (json,
text, srt, vtt, verbose_json) and ``timestamp_granularities[]`` (``segment``; ``word`` is refused).
Parsing and answering are here; transcription is :func:`dasllama.asr.transcribe`, run off the event loop.
Not here: the chat endpoints' input_audio (chats.py).
"""
from __future__ import annotations

import asyncio
import math
from typing import Any, Dict

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from .. import asr
from ..audio_io import load_audio
from .protocol import APIError, Limits, bad, read_body

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
KNOWN = {"file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
         "timestamp_granularities", "stream", "include[]", "chunking_strategy"}
LANGUAGE_NAMES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian", "ja": "japanese",
                  "zh": "chinese", "ru": "russian", "pt": "portuguese", "nl": "dutch", "ko": "korean", "pl": "polish"}


async def read_form(request: Request, lim: Limits):
    """The multipart body, refused past ``lim.max_body_bytes`` before it is all read."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise bad(f"the body must be multipart/form-data with a file part, got {ctype[:64] or 'no Content-Type'!r}")
    body = await read_body(request, lim)

    async def receive() -> Dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, receive).form(max_files=1, max_fields=32)
    except Exception as e:  # starlette's HTTPException / MultiPartException: a malformed body
        raise bad(f"the multipart body could not be read: {getattr(e, 'detail', None) or e}") from None


def _temperatures(v: Any) -> tuple:
    """OpenAI's ``temperature``: 0 (the default) lets the decoder raise it on failed windows (whisper's
    fallback, 0.0 to 1.0 by 0.2); a higher value starts the same schedule there, as whisper's CLI does."""
    if v is None or v == "":
        return asr.FALLBACK_TEMPERATURES
    try:
        t = float(v)
    except ValueError:
        raise bad(f"temperature must be a number, got {str(v)[:32]!r}", "temperature") from None
    if not (0.0 <= t <= 1.0):
        raise bad(f"temperature must be between 0 and 1, got {t}", "temperature")
    n = int(math.floor((1.0 - t) / 0.2 + 1e-6))
    return tuple(round(t + 0.2 * i, 6) for i in range(n + 1))


def _verbose(t: asr.Transcript) -> Dict[str, Any]:
    return {"task": "transcribe", "language": LANGUAGE_NAMES.get(t.language or "", t.language or ""),
            "duration": round(t.duration, 3), "text": t.text,
            "segments": [{"id": i, "seek": int(round(s.seek * 100)), "start": round(s.start, 3), "end": round(s.end, 3),
                          "text": s.text, "tokens": [int(x) for x in s.tokens], "temperature": s.temperature,
                          "avg_logprob": s.avg_logprob, "compression_ratio": s.compression_ratio,
                          "no_speech_prob": s.no_speech_prob} for i, s in enumerate(t.segments)],
            "usage": {"type": "duration", "seconds": int(math.ceil(t.duration))}}


async def transcriptions(request: Request) -> Response:
    st = request.app.state.server  # app.AppState
    if st.asr is None:
        raise APIError(404, "this server has no speech recognition model: start it with --asr-model NAME|PATH "
                            "(create_app(asr_model=...))", param="model", code="model_not_found")
    form = await read_form(request, st.limits)
    try:
        unknown = sorted(k for k in form.keys() if k not in KNOWN)
        if unknown:
            raise bad(f"unknown field {unknown[0]!r}", unknown[0])
        up = form.get("file")
        if up is None or isinstance(up, str):
            raise bad("a file part named 'file' is required (the audio to transcribe)", "file")
        data = await up.read()
        if not data:
            raise bad("the uploaded file is empty", "file")
        if len(data) > st.limits.max_media_bytes:
            raise bad(f"the file is over the {st.limits.max_media_bytes} byte limit", "file")
        fmt = str(form.get("response_format") or "json")
        if fmt not in FORMATS:
            raise bad(f"response_format must be one of {', '.join(FORMATS)}; got {fmt[:32]!r}", "response_format")
        grans = [str(g) for g in form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")]
        for g in grans:
            if g not in ("segment", "word"):
                raise bad(f"timestamp_granularities takes segment or word, got {g[:32]!r}", "timestamp_granularities")
            if fmt != "verbose_json":
                raise bad("timestamp_granularities needs response_format verbose_json", "timestamp_granularities")
            if g == "word":
                raise bad("word timestamps are not supported; ask for segment", "timestamp_granularities")
        if str(form.get("stream") or "false").lower() not in ("false", "0"):
            raise bad("streamed transcription is not supported", "stream")
        if form.get("prompt"):
            raise bad("a text prompt is not supported", "prompt")
        language = form.get("language") or None
        temps = _temperatures(form.get("temperature"))
    finally:
        await form.close()

    def run() -> asr.Transcript:
        try:
            x = load_audio(bytes(data))
        except ValueError as e:
            raise bad(str(e), "file") from None
        if x.size == 0:
            raise bad("the audio holds no samples", "file")
        if x.size / 16000 > st.limits.max_audio_seconds:
            raise bad(f"the audio is {x.size / 16000:.1f} s long; at most {st.limits.max_audio_seconds:g} s", "file")
        try:
            return asr.transcribe(st.asr, x, language=language, timestamps=fmt in ("srt", "vtt", "verbose_json"),
                                  temperature=temps)
        except ValueError as e:  # a language the model does not speak, ...
            raise bad(str(e), "language" if "language" in str(e) else None) from None

    t = await asyncio.to_thread(run)
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": {"type": "duration", "seconds": int(math.ceil(t.duration))}})
    if fmt == "verbose_json":
        return JSONResponse(_verbose(t))
    media = {"text": "text/plain", "srt": "application/x-subrip", "vtt": "text/vtt"}[fmt]
    return PlainTextResponse(asr.format_transcript(t, "txt" if fmt == "text" else fmt), media_type=media)
