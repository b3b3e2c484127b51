"""``POST /v1/audio/transcriptions``, driven through the official OpenAI SDK (the protocol's
reference: ``client.audio.transcriptions.create``) and raw multipart HTTP for bad uploads.

The served words are checked against ``dasllama.transcribe`` on the same decoded file, whose
words test_asr_whisper.py / test_asr_faster_whisper.py check against CTranslate2 and
faster-whisper; here the question is the protocol: fields, formats, errors.
"""
from __future__ import annotations

import io
import os
import sys

import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

import dasllama as d
from dasllama import hub
from dasllama.server import create_app
from dasllama.server.protocol import Limits

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


def wav_bytes(x: np.ndarray) -> bytes:
    import soundfile as sf

    b = io.BytesIO()
    sf.write(b, x, 16000, format="WAV", subtype="PCM_16")
    return b.getvalue()


@pytest.fixture(scope="module")
def asr_model(tmp_path_factory):
    from dasllama import cli

    hub.pull("whisper-tiny.en")
    out = tmp_path_factory.mktemp("asr") / "whisper-tiny.en.gguf"
    assert cli.main(["convert", "whisper-tiny.en", str(out)]) == 0
    return d.load_asr_model(out)


@pytest.fixture(scope="module")
def chat_model(smollm2_path):
    return d.load_model(smollm2_path)


@pytest.fixture(scope="module")
def client(chat_model, asr_model):
    app = create_app(chat_model, streams=1, ctx=512, asr_model=asr_model,
                     limits=Limits(max_body_bytes=4 << 20, max_media_bytes=2 << 20, max_audio_seconds=60))
    with TestClient(app) as c:
        yield c
    app.state.engine.stop()


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


@pytest.fixture(scope="module")
def jfk():
    x = speak(JFK)
    data = wav_bytes(x)
    import soundfile as sf

    return data, sf.read(io.BytesIO(data), dtype="float32")[0]  # what the server decodes: 16-bit PCM


def test_json_and_text_equal_library(oai, asr_model, jfk):
    data, x = jfk
    want = d.transcribe(asr_model, x)
    assert "fellow Americans" in want.text
    r = oai.audio.transcriptions.create(model="whisper-tiny.en", file=("jfk.wav", data))
    assert r.text == want.text
    r = oai.audio.transcriptions.create(model="whisper-tiny.en", file=("jfk.wav", data), response_format="text")
    assert r.strip() == want.text


@pytest.mark.parametrize("fmt", ["srt", "vtt"])
def test_subtitles_equal_library(oai, asr_model, jfk, fmt):
    data, x = jfk
    want = d.format_transcript(d.transcribe(asr_model, x, timestamps=True), fmt)
    r = oai.audio.transcriptions.create(model="whisper-tiny.en", file=("jfk.wav", data), response_format=fmt)
    assert r == want
    assert ("fellow Americans" in r) and (r.startswith("WEBVTT") if fmt == "vtt" else r.startswith("1\n00:00:00,000"))


def test_verbose_json_segments(oai, asr_model, jfk):
    data, x = jfk
    want = d.transcribe(asr_model, x, timestamps=True)
    r = oai.audio.transcriptions.create(model="whisper-tiny.en", file=("jfk.wav", data),
                                        response_format="verbose_json", timestamp_granularities=["segment"],
                                        language="en", temperature=0.0)
    assert r.text == want.text and r.language == "english"
    assert abs(r.duration - len(x) / 16000) < 1e-3
    assert [(s.start, s.end, s.text) for s in r.segments] == [(round(s.start, 3), round(s.end, 3), s.text)
                                                              for s in want.segments]
    s = r.segments[0]
    assert s.temperature == 0.0 and s.avg_logprob > -1.0 and 0 < s.compression_ratio < 2.4 and 0 <= s.no_speech_prob < 1


def test_temperature_is_seeded(oai, jfk):
    """A temperature above 0 samples, from seeded generators: the same request gives the same text."""
    data, _ = jfk
    a = oai.audio.transcriptions.create(model="m", file=("a.wav", data), temperature=0.8)
    b = oai.audio.transcriptions.create(model="m", file=("a.wav", data), temperature=0.8)
    assert a.text == b.text and a.text


def test_models_lists_asr(oai):
    assert "whisper-tiny.en.gguf" in [m.id for m in oai.models.list().data]


@pytest.mark.parametrize("kwargs, needle", [
    ({"file": ("x.wav", b"this is not audio")}, "not a readable"),
    ({"file": ("x.wav", b"")}, "empty"),
    ({"response_format": "docx"}, "response_format"),
    ({"temperature": 1.5}, "temperature"),
    ({"language": "de"}, "English-only"),
    ({"timestamp_granularities": ["word"], "response_format": "verbose_json"}, "word"),
    ({"timestamp_granularities": ["segment"]}, "verbose_json"),
    ({"prompt": "Kennedy"}, "prompt"),
])
def test_bad_requests_are_400(oai, jfk, kwargs, needle):
    args = {"model": "m", "file": ("jfk.wav", jfk[0]), **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        oai.audio.transcriptions.create(**args)
    assert needle in str(e.value)


def test_bad_bodies(client, jfk):
    r = client.post("/v1/audio/transcriptions", json={"model": "m"})
    assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
    r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"other": ("a.wav", jfk[0])})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]
    r = client.post("/v1/audio/transcriptions", data={"model": "m"})
    assert r.status_code == 400
    r = client.post("/v1/audio/transcriptions", content=b"--zz\r\ngarbage", headers={
        "content-type": "multipart/form-data; boundary=zz"})
    assert r.status_code == 400
    # Over the body limit: refused before transcription.
    big = wav_bytes(np.zeros(16000 * 140, np.float32))
    r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("big.wav", big)})
    assert r.status_code == 413
    # Past max_audio_seconds (under the byte limits: 8-bit samples).
    import soundfile as sf

    b = io.BytesIO()
    sf.write(b, np.zeros(16000 * 61, np.float32), 8000, format="WAV", subtype="PCM_U8")
    r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("long.wav", b.getvalue())})
    assert r.status_code == 400 and "at most 60" in r.json()["error"]["message"]
    # Silence: an empty transcript, not an error.
    r = client.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("s.wav", wav_bytes(np.zeros(32000, np.float32)))})
    assert r.status_code == 200 and r.json()["text"] == ""


def test_server_without_asr_says_so(chat_model, jfk):
    app = create_app(chat_model, streams=1, ctx=256)
    try:
        with TestClient(app) as c:
            r = c.post("/v1/audio/transcriptions", data={"model": "m"}, files={"file": ("a.wav", jfk[0])})
            assert r.status_code == 404 and "--asr-model" in r.json()["error"]["message"]
    finally:
        app.state.engine.stop()
