"""`dasllama convert`: whisper tiny.en (CTranslate2 files, pulled through the hub) -> a
whisper-encoder mmproj, checked against CTranslate2's own Whisper.encode.

Error bar: 1e-4 of the reference's largest magnitude (observed ~3e-6 of it). CTranslate2
runs compute_type float32 over the same f16 weights we keep, so what differs is float32
summation order across 4 blocks of width 384 and our mel against transformers'
WhisperFeatureExtractor (which feeds CTranslate2 here, as faster-whisper's own extractor
would), itself within 2e-4 (test_audio_mel.py). As an end-to-end check, CTranslate2's
decoder must produce the same greedy tokens from our rows as from its own encoder.
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

REL = 1e-4
PROMPT = [50257, 50362]  # <|startoftranscript|><|notimestamps|> (tiny.en)


@pytest.fixture(scope="module")
def ct2_dir():
    return str(hub.pull("whisper-tiny.en"))


@pytest.fixture(scope="module")
def mmproj(ct2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "whisper-tiny.en-encoder.gguf"
    assert cli.main(["convert", "whisper-tiny.en", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def ct2(ct2_dir):
    import ctranslate2

    return ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32")


def _ct2_encode(model, x):
    import ctranslate2
    from transformers import WhisperFeatureExtractor

    f = WhisperFeatureExtractor()(x, sampling_rate=16000, return_tensors="np").input_features
    return np.array(model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(f)), to_cpu=True))[0]


def _greedy(model, rows):
    import ctranslate2

    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(rows[None], dtype=np.float32))
    return model.generate(sv, [PROMPT], beam_size=1, max_length=64)[0].sequences_ids[0]


def test_converted_file_is_a_whisper_embedder(mmproj):
    emb = d.load_audio_embedder(mmproj)
    assert (emb.family, emb.n_mel, emb.dim, emb.n_layers, emb.proj_dim) == ("whisper", 80, 384, 4, 384)
    assert d.audio_probe_proj_dim(mmproj) == 384
    assert d.audio_tower_probe_proj_dim(mmproj) == 0  # no projector into a decoder: not a chat tower
    with pytest.raises(d.UnsupportedModelError):
        d.load_audio_tower(mmproj)


@pytest.mark.parametrize("clip", ["speech", "silence", "tenth_of_a_second"])
def test_rows_match_ctranslate2_encode(mmproj, ct2, clip):
    sp = speak("And so my fellow Americans, ask not what your country can do for you, "
               "ask what you can do for your country.")
    x = {"speech": sp, "silence": np.zeros(32000, np.float32), "tenth_of_a_second": sp[8000:9600]}[clip]
    emb = d.load_audio_embedder(mmproj)
    ours = d.encode_audio_rows(emb, x)
    ref = _ct2_encode(ct2, x)
    assert ours.shape == ref.shape == (1500, 384)
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= REL * scale, f"{clip}: {err:.3g} > {REL * scale:.3g}"
    if clip == "speech":
        assert _greedy(ct2, ours) == _greedy(ct2, ref)


def test_convert_rejects_what_is_not_a_whisper_model(tmp_path):
    from dasllama.convert import convert_ct2_whisper

    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00\x05\x00abc")
    with pytest.raises(d.DasllamaError):
        convert_ct2_whisper(tmp_path, tmp_path / "out.gguf")
    with pytest.raises(FileNotFoundError):
        convert_ct2_whisper(tmp_path / "nowhere", tmp_path / "out.gguf")
