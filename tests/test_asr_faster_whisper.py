"""Whisper tiny.en transcription against faster-whisper (CTranslate2 underneath, the same pulled
files) on speech eSpeak NG speaks: the text must be equal, short clips and a clip over 30 s.

Settings, the same on both sides: greedy at temperature 0 with whisper's fallback schedule
(0.2 ... 1.0, best of 5 when sampling) on compression ratio > 2.4 or average log-probability
< -1.0, no-speech threshold 0.6, beam 1, condition_on_previous_text off, no VAD, English.
A fallback samples, and two samplers never draw alike, so the test also checks that no
window of these clips needed one (each segment's temperature is 0 on both sides).
Word error rates against the script are asserted loosely (tiny.en on synthetic speech) and
reported in benchmarks/RESULTS.md by benchmarks/bench_asr.py.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama import cli, hub

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from asr_script import SENTENCES, long_clip, wer  # noqa: E402
from speech import speak  # noqa: E402

SETTINGS = dict(compression_ratio_threshold=2.4, logprob_threshold=-1.0, no_speech_threshold=0.6,
                condition_on_previous_text=False)


@pytest.fixture(scope="module")
def ct2_dir():
    return str(hub.pull("whisper-tiny.en"))


@pytest.fixture(scope="module")
def model(ct2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("asr") / "whisper-tiny.en.gguf"
    assert cli.main(["convert", "whisper-tiny.en", str(out)]) == 0
    return d.load_asr_model(out)


@pytest.fixture(scope="module")
def fw(ct2_dir):
    from faster_whisper import WhisperModel

    return WhisperModel(ct2_dir, device="cpu", compute_type="float32", cpu_threads=2)


def faster_whisper(fw, x, timestamps=True):
    segs, _ = fw.transcribe(x, language="en", beam_size=1, best_of=5, vad_filter=False,
                            log_prob_threshold=SETTINGS["logprob_threshold"],
                            without_timestamps=not timestamps, **{k: v for k, v in SETTINGS.items()
                                                                   if k != "logprob_threshold"})
    segs = list(segs)
    return "".join(s.text for s in segs).strip(), segs


@pytest.mark.parametrize("i", range(4))
def test_short_clips_equal_faster_whisper(model, fw, i):
    x = speak(SENTENCES[i])
    want, fsegs = faster_whisper(fw, x)
    t = d.transcribe(model, x, timestamps=True, **SETTINGS)
    assert all(s.temperature == 0 for s in fsegs) and all(s.temperature == 0 for s in t.segments)
    assert t.text == want
    assert wer(t.text, SENTENCES[i]) <= 0.35, t.text


def test_long_clip_equals_faster_whisper(model, fw):
    x = long_clip()
    assert len(x) > 40 * 16000
    want, fsegs = faster_whisper(fw, x)
    t = d.transcribe(model, x, **SETTINGS)
    assert all(s.temperature == 0 for s in fsegs) and all(s.temperature == 0 for s in t.segments)
    assert t.text == want
    assert [round(s.start, 2) for s in t.segments] == [round(s.start, 2) for s in fsegs]
    assert wer(t.text, " ".join(SENTENCES)) <= 0.25, t.text


def test_silence_is_empty(model, fw):
    x = np.zeros(5 * 16000, np.float32)
    assert faster_whisper(fw, x)[0] == ""
    assert d.transcribe(model, x).text == ""


def test_fallback_on_repetition_is_seeded(model):
    """A clip of one sentence said five times: greedy text repeats, compresses past 2.4 and falls back to
    sampling (as faster-whisper does on it); the same call gives the same text."""
    x = np.concatenate([np.concatenate([speak(SENTENCES[0]), np.zeros(16000, np.float32)])] * 5)
    a = d.transcribe(model, x, **SETTINGS)
    assert any(s.temperature > 0 for s in a.segments)
    b = d.transcribe(model, x, **SETTINGS)
    assert a.text == b.text and [s.tokens for s in a.segments] == [s.tokens for s in b.segments]
    # Without the fallback the repetitive greedy text stays.
    g = d.transcribe(model, x, temperature=0.0, **SETTINGS)
    assert all(s.temperature == 0 for s in g.segments)
    assert g.text.count("Americans") >= 2


def test_hard_inputs_do_not_crash(model):
    rng = np.random.default_rng(1)
    sp = speak(SENTENCES[1])
    for x in (rng.normal(0, 0.3, 16000 * 3).astype(np.float32),               # noise
              np.clip(sp * 30, -1, 1).astype(np.float32),                     # hard clipping
              sp[8000:9600],                                                  # 0.1 s
              np.full(16000, 1.0, np.float32)):                               # DC at full scale
        t = d.transcribe(model, x, **SETTINGS)
        assert isinstance(t.text, str)
