"""Whisper tiny.en on real speech: `dasllama convert` of the CTranslate2 files (pulled through
the hub) into the ASR GGUF, then our greedy tokens against CTranslate2's own Whisper.generate
(greedy, beam 1) on clips eSpeak NG speaks, with and without timestamps.

CTranslate2 runs compute_type float32 over the same f16 weights and applies whisper's
suppression and timestamp rules itself; its input is transformers' WhisperFeatureExtractor
(within 2e-4 of our mel, test_audio_mel.py). Token ids must be equal.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama import cli, hub

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402

JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."
CLIPS = {
    "jfk": JFK,
    "numbers": "The meeting moved from three fifteen to four thirty on Tuesday, the twelfth of March.",
}


@pytest.fixture(scope="module")
def ct2_dir():
    return str(hub.pull("whisper-tiny.en"))


@pytest.fixture(scope="module")
def asr_gguf(ct2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("asr") / "whisper-tiny.en.gguf"
    assert cli.main(["convert", "whisper-tiny.en", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def model(asr_gguf):
    return d.load_asr_model(asr_gguf)


@pytest.fixture(scope="module")
def ct2(ct2_dir):
    import ctranslate2

    return ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32")


def _ct2_tokens(ct2, x, prompt):
    import ctranslate2
    from transformers import WhisperFeatureExtractor

    f = WhisperFeatureExtractor()(x, sampling_rate=16000, return_tensors="np").input_features
    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(f))
    return ct2.generate(sv, [prompt], beam_size=1, max_length=448)[0].sequences_ids[0]


def _fw_windows(x):
    """faster-whisper's features of the whole clip (its own extractor: normalized over the clip),
    and a function giving frames [seek, seek + size) zero-padded to 3000, as its transcribe cuts them."""
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.feature_extractor import FeatureExtractor

    f = FeatureExtractor()(x)
    return f.shape[-1] - 1, lambda seek, size: pad_or_trim(f[:, seek:seek + size])[None].astype(np.float32)


def _ct2_tokens_feats(ct2, feats, prompt):
    import ctranslate2

    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats))
    return ct2.generate(sv, [prompt], beam_size=1, max_length=448)[0].sequences_ids[0]


def test_converted_whole_model(model, asr_gguf):
    c = model.decoder.config
    assert (c["dim"], c["n_layers"], c["n_heads"], c["n_ctx"], c["vocab"]) == (384, 4, 6, 448, 51864)
    assert (model.sot, model.eot, model.notimestamps, model.timestamp_begin, model.no_speech) == (
        50257, 50256, 50362, 50363, 50361)
    assert not model.multilingual and model.prompt(None, False) == [50257, 50362]
    # The same file is the whisper-encoder mmproj audio chat reads.
    assert d.load_audio_embedder(asr_gguf).family == "whisper"


@pytest.mark.parametrize("timestamps", [False, True], ids=["text", "timestamps"])
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_tokens_equal_ctranslate2(model, ct2, clip, timestamps):
    x = speak(CLIPS[clip])
    prompt = model.prompt(None, timestamps)
    ref = _ct2_tokens(ct2, x, prompt)
    model.decoder.set_encoder(d.encode_audio_rows(model.encoder, x, full_window=True))
    ours, _, _ = model.decoder.greedy(prompt, model.suppress, model.begin_suppress, model.eot, 224,
                                      no_timestamps=model.notimestamps,
                                      timestamp_begin=model.timestamp_begin if timestamps else 0)
    assert ours == ref
    # transcribe cuts windows from the whole clip's features, zero-padded past its end, as
    # whisper's and faster-whisper's transcribe do: CTranslate2 on faster-whisper's features.
    n, window = _fw_windows(x)
    ref = _ct2_tokens_feats(ct2, window(0, n), prompt)
    t = d.transcribe(model, x, timestamps=timestamps)
    assert t.text == model.decode([i for i in ref if i < model.eot]).strip()
    if timestamps:
        assert len(t.segments) >= 1
        # Every boundary is one of CTranslate2's timestamps (which may pass the clip's end a
        # little: the window past it is zero-padded features, as faster-whisper's also is).
        stamps = {round((i - model.timestamp_begin) * 0.02, 2) for i in ref if i >= model.timestamp_begin}
        assert all(0 <= s.start < s.end and {round(s.start, 2), round(s.end, 2)} <= stamps for s in t.segments)


def test_hard_clips_do_not_crash(model):
    rng = np.random.default_rng(0)
    sp = speak("hello world")
    for x in (np.zeros(32000, np.float32), rng.normal(0, 0.1, 32000).astype(np.float32),
              np.clip(sp * 20, -1, 1).astype(np.float32), sp[4000:5600]):
        t = d.transcribe(model, x)
        assert isinstance(t.text, str)


def test_cli_transcribe(asr_gguf, tmp_path, capsys):
    import json

    import soundfile as sf

    x = speak(JFK)
    p = tmp_path / "jfk.wav"
    sf.write(p, x, 16000)
    assert cli.main(["transcribe", "--model", str(asr_gguf), str(p), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "fellow Americans" in out["text"] and out["segments"]
    assert cli.main(["transcribe", "--model", str(asr_gguf), str(p), "--format", "srt"]) == 0
    srt = capsys.readouterr().out
    assert srt.startswith("1\n00:00:00,000 --> ") and "fellow Americans" in srt


def test_registry_name_converts_on_first_use(ct2_dir, tmp_path, monkeypatch):
    import shutil

    # A private cache holding a copy of the pulled directory: the shared one stays as pulled.
    home = tmp_path / "home"
    shutil.copytree(ct2_dir, home / "whisper-tiny.en")
    monkeypatch.setenv("DASLLAMA_HOME", str(home))
    p = d.resolve_asr_model("whisper-tiny.en", progress=False)
    assert p == str(home / "asr" / "whisper-tiny.en.gguf") and os.path.isfile(p)
    mtime = os.path.getmtime(p)
    assert d.resolve_asr_model("whisper-tiny.en") == p and os.path.getmtime(p) == mtime  # converted once
    assert sorted(x.name for x in (home / "whisper-tiny.en").iterdir()) == sorted(os.listdir(ct2_dir))
    # A CTranslate2 directory of the user's converts into the cache, not beside its files.
    q = d.resolve_asr_model(home / "whisper-tiny.en", progress=False)
    assert os.path.dirname(q) == str(home / "asr") and q != p
    assert d.load_asr_model(q).decoder.config["vocab"] == 51864


def test_long_clip_follows_timestamps(model, ct2, monkeypatch):
    """A 50 s clip: windows follow the timestamps (the second starts where the first window's
    last complete segment ended), and each window's kept text is CTranslate2's on that window
    of faster-whisper's features."""
    sentences = [JFK, CLIPS["numbers"],
                 "We choose to go to the moon in this decade, not because it is easy, but because it is hard.",
                 "Four score and seven years ago our fathers brought forth on this continent a new nation."]
    pause = np.zeros(16000, np.float32)
    x = np.concatenate([np.concatenate([speak(s), pause]) for s in sentences * 2])
    assert len(x) > 45 * 16000
    import dasllama.asr as asr

    windows = []  # (first frame, frames) of each window the encoder is given
    real = asr._window_mel
    monkeypatch.setattr(asr, "_window_mel", lambda mel, seek, size: (windows.append((seek, size)),
                                                                      real(mel, seek, size))[1])
    t = d.transcribe(model, x, temperature=0.0)  # greedy only: CTranslate2's greedy is the reference
    starts = [s.start for s in t.segments]
    assert starts == sorted(starts) and all(s.end <= len(x) / 16000 + 0.02 for s in t.segments)
    for word in ("Americans", "moon", "seven years"):
        assert t.text.count(word) == 2, (word, t.text)
    n, window = _fw_windows(x)
    assert len(windows) >= 2 and windows[0] == (0, 3000)
    seeks = [w[0] for w in windows]
    assert seeks == sorted(seeks) and all(s_ % 2 == 0 for s_ in seeks) and windows[-1][0] + windows[-1][1] == n
    # Each window's kept text (its complete timestamp pairs) starts CTranslate2's decode of that window.
    for (w0, size), w1 in zip(windows, seeks[1:] + [n]):
        ref = [i for i in _ct2_tokens_feats(ct2, window(w0, size), model.prompt(None, True)) if i < model.eot]
        ours = [i for s in t.segments if w0 / 100 <= s.start < w1 / 100 for i in s.tokens]
        assert ours and ref[:len(ours)] == ours, (w0, w1)


class _Recorder:
    """The model's decoder, recording each window's prompt and greedy tokens."""

    def __init__(self, dec):
        self._dec, self.calls = dec, []

    def __getattr__(self, name):
        return getattr(self._dec, name)

    def greedy(self, prompt, *a, **kw):
        r = self._dec.greedy(prompt, *a, **kw)
        self.calls.append((list(prompt), list(r[0])))
        return r


def test_long_clip_conditioned_on_previous_text(asr_gguf, ct2, monkeypatch):
    """With condition_on_previous_text, each window's prompt is <|startofprev|>, the text kept
    so far, then the usual prompt; the tokens equal CTranslate2's under the same prompt."""
    import dasllama.asr as asr

    model = d.load_asr_model(asr_gguf)
    rec = model.decoder = _Recorder(model.decoder)
    windows = []
    real = asr._window_mel
    monkeypatch.setattr(asr, "_window_mel", lambda mel, seek, size: (windows.append((seek, size)),
                                                                      real(mel, seek, size))[1])
    x = np.concatenate([np.concatenate([speak(s), np.zeros(16000, np.float32)]) for s in (JFK, CLIPS["numbers"]) * 3])
    assert len(x) > 35 * 16000
    t = d.transcribe(model, x, condition_on_previous_text=True, temperature=0.0)
    _, window = _fw_windows(x)
    assert len(rec.calls) == len(windows) >= 2
    assert rec.calls[0][0] == [50257]
    for i, ((prompt, ours), (seek, size)) in enumerate(zip(rec.calls, windows)):
        if i:
            assert prompt[0] == 50360 and prompt[-1] == 50257  # <|startofprev|> ... <|startoftranscript|>
        assert ours == [j for j in _ct2_tokens_feats(ct2, window(seek, size), prompt) if j != model.eot], i
    assert t.text.count("Americans") == 3
