"""Qwen3-ASR against transformers: a tiny random Qwen3ASRForConditionalGeneration (fp32) written to GGUF
by llama.cpp's own converter (the decoder, arch qwen3vl, and the mmproj, projector qwen3a; see
tests/oracles/qwen3asr.py). Checked: the tower's rows equal get_audio_features on the processor's
input (the clip's own mel frames, 100-frame chunks, 8 s attention windows, the 0.5 s minimum), the
audio turn's logits and the greedy tokens equal the model's, and transcribe / the CLI run on it.

Error bars: rows 1e-5 of the largest |row| (f32; observed ~2e-7); logits 1e-4 of the peak (as
test_audio_chat; observed ~4e-7); greedy tokens identical.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import dasllama as d

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import qwen3asr as Q  # noqa: E402
from speech import speak  # noqa: E402

SR = 16000


@pytest.fixture(scope="module")
def built(qwen3_asr_files):
    f = qwen3_asr_files
    return dict(f, tower=d.load_audio_tower(f["mmproj"]), asr=d.load_asr_model(f["decoder"], mode=d.QuantMode.fp32))


@pytest.fixture(scope="module")
def clip():
    return speak("The quick brown fox jumps over the lazy dog.")


def test_converter_layout(built):
    emb = built["tower"]
    assert (emb.family, emb.n_mel, emb.dim, emb.n_layers, emb.proj_dim) == ("qwen3a", 128, 48, 4, 64)
    with d.gguf.GGUFFile(built["decoder"]) as g:
        assert g.arch == "qwen3vl"


@pytest.mark.parametrize("n", [1600, 8000, 16000, 88000, 12 * SR + 777, 40 * SR + 5])
def test_tower_rows_match_transformers(built, clip, n):
    """0.1 s (padded to 0.5 s), one chunk, a partial chunk, past one 8 s attention window, past 30 s."""
    x = np.resize(clip, n).astype(np.float32)
    ref = Q.tower_rows(built["hf"], x)
    ours = d.encode_audio_rows(built["tower"], x)
    assert ours.shape == ref.shape == (built["tower"].n_rows(n), 64)
    err = float(np.abs(ours - ref).max())
    assert err <= 1e-5 * float(np.abs(ref).max()), err


def _hf_inputs(built, x, head, tail, n):
    pad = built["tok"].convert_tokens_to_ids("<|audio_pad|>")
    ids = torch.tensor([head + [pad] * n + tail])
    f, mask = Q.features(x)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=f, input_features_mask=mask)


@pytest.mark.parametrize("language", [None, "en"])
def test_logits_and_greedy_tokens_match_transformers(built, clip, language):
    asr = built["asr"]
    head, tail = asr.prompt(language)
    prompt, out = asr.greedy(clip, language, 24)
    n = len(prompt) - len(head) - len(tail)
    assert n == built["tower"].n_rows(len(clip))
    inp = _hf_inputs(built, clip, head, tail, n)
    with torch.no_grad():
        g = built["hf"].generate(**inp, max_new_tokens=24, do_sample=False)
    ref = g[0, inp["input_ids"].shape[1]:].tolist()
    stop = asr.ids["<|im_end|>"]
    ref = ref[:ref.index(stop)] if stop in ref else ref
    assert out == ref and len(set(out)) > 4  # a varied run, not one token repeated
    # The turn's last logits, from the chat layer's prefill path.
    s = d.create_session(asr.model, d.KVDtype.f32)
    rows = d.encode_audio_rows(built["tower"], clip)
    body = d.media_body_rows(asr.model, s, head, rows, n, asr.model.config.dim, tail)
    d.eval_embd_body(asr.model, s, body, len(prompt), ids=prompt)
    with torch.no_grad():
        lg = built["hf"](**inp).logits[0, -1].numpy()
    assert float(np.abs(s.logits - lg).max()) <= 1e-4 * float(np.abs(lg).max())


def test_transcribe_and_parse(built, clip):
    asr = built["asr"]
    t = d.transcribe(asr, clip, language="English")
    _, out = asr.greedy(clip, "en", 448)
    assert t.text == d.decode(asr.model, out).strip() and t.language == "en"
    assert len(t.segments) <= 1 and (not t.segments or t.segments[0].end == pytest.approx(len(clip) / SR))
    # The model's own "language <Name><asr_text>" prefix is parsed off.
    mark = asr.ids["<asr_text>"]
    ids = d.encode(asr.model, "language German", add_special=False) + [mark] + d.encode(asr.model, " hallo",
                                                                                        add_special=False)
    assert asr.parse(ids, None) == ("hallo", "de")
    for bad in ("xx", "Klingon"):
        with pytest.raises(ValueError):
            d.transcribe(asr, clip, language=bad)
    with pytest.raises(ValueError):
        d.transcribe(asr, np.zeros(0, np.float32))
    for edge in (np.zeros(SR, np.float32), np.zeros(1600, np.float32),
                 np.clip(clip * 50, -1, 1), np.random.default_rng(0).standard_normal(SR).astype(np.float32) * 0.3):
        assert isinstance(d.transcribe(asr, edge, max_new_tokens=8).text, str)


def test_load_errors(built, tmp_path):
    lone = tmp_path / "decoder.gguf"
    shutil.copy(built["decoder"], lone)
    with pytest.raises(FileNotFoundError):
        d.load_asr_model(lone)  # no mmproj beside it
    wh = tmp_path / "other" / "mmproj-whisper.gguf"
    wh.parent.mkdir()
    import audio as A

    A.write_whisper(A.whisper_encoder(), wh)
    with pytest.raises(d.UnsupportedModelError):
        d.load_asr_model(lone, mmproj=wh)  # a bare encoder: no projector, no prompt
    # The default is load_model's q8: the same run within q8's error of fp32, on the same turn.
    q8 = d.load_asr_model(built["decoder"])
    assert q8.model.mode == d.QuantMode.q8 and q8.tower.family == "qwen3a"


def test_cli_transcribe(built, clip, tmp_path):
    import soundfile as sf

    wav = tmp_path / "c.wav"
    sf.write(wav, clip, SR)
    r = subprocess.run([sys.executable, "-m", "dasllama", "transcribe", "--model", built["decoder"], str(wav),
                        "--language", "en"], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    # The CLI loads as load_asr_model does by default (q8 decoder) and reads the file (16-bit PCM).
    # Bytes, not text mode: the random model's text may hold a "\r", which universal newlines rewrite.
    want = d.transcribe(d.load_asr_model(built["decoder"]), str(wav), language="en").text
    assert r.stdout.decode("utf-8") == want + "\n"


def test_audio_chat_frames_the_span(built, clip):
    """The same tower in audio chat: the span between <|audio_start|> and <|audio_end|> (llama.cpp's
    mtmd framing for qwen3a)."""
    asr = built["asr"]
    chat = d.create_chat(asr.model, built["tower"], max_new=1)
    n = d.add_user_audio(chat, clip)
    head, tail = d.render_turn_audio(asr.model, chat)
    assert n == built["tower"].n_rows(len(clip))
    assert head[-1] == asr.ids["<|audio_start|>"] and tail[0] == asr.ids["<|audio_end|>"]
