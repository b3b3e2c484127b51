"""Whisper transcription against transformers' tiny random WhisperForConditionalGeneration.

The model is seeded fp32 (tiny widths, but the real 80 mel bins and 1500 encoder
positions), saved with save_pretrained plus a byte-level vocabulary of our own (256 byte
tokens, whisper's specials, 60 timestamps), and converted by ``convert_hf_whisper`` into
the ASR GGUF, so the converter, the encoder, the decoder and the decode loop are all ours
while the reference is transformers' forward and ``generate``.

Error bar: teacher-forced logits within NMSE 1e-6 of transformers'. Both sides run in
float32 with the same (f16-rounded) conv kernels; what differs is summation order (about
1e-6 relative per op) and the mel input (ours vs WhisperFeatureExtractor, within 7e-5 of
a unit-scale feature, test_audio_mel.py), giving NMSE around 1e-9 here; a skipped bias
or norm, a wrong causal mask or cross-attention over the wrong rows moves it above 1e-2.
Greedy ids must equal ``generate``'s exactly with the same forced prompt and suppression.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama.asr import _byte_decoder

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402

NMSE = 1e-6
SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
N_TS = 60
EOT, SOT, EN, DE, TRANSLATE, TRANSCRIBE, SOT_LM, SOT_PREV, NO_SPEECH, NO_TS = range(256, 266)
TS0 = 266
VOCAB = TS0 + N_TS
SUPPRESS = [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93]
BEGIN_SUPPRESS = [32, EOT]  # the space ('Ġ') and the end of text


def nmse(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-30))


def _tokens():
    inv = {b: ch for ch, b in _byte_decoder().items()}
    return [inv[b] for b in range(256)] + SPECIALS + [f"<|{i * 0.02:.2f}|>" for i in range(N_TS)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=64, decoder_start_token_id=SOT, eos_token_id=EOT,
        pad_token_id=EOT, bos_token_id=EOT)
    m = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger random weights than the init's: greedy ids vary instead of repeating
        for name, p in m.named_parameters():
            if p.ndim == 2 and "embed_positions" not in name:
                p.normal_(0, 0.5)
        m.model.decoder.embed_positions.weight.normal_(0, 1.0)
        for conv in (m.model.encoder.conv1, m.model.encoder.conv2):  # the converter keeps conv kernels f16
            conv.weight.copy_(conv.weight.half().float())
    m.generation_config = GenerationConfig(
        decoder_start_token_id=SOT, eos_token_id=EOT, pad_token_id=EOT, bos_token_id=EOT,
        no_timestamps_token_id=NO_TS, prev_sot_token_id=SOT_PREV, is_multilingual=True,
        lang_to_id={"<|en|>": EN, "<|de|>": DE}, task_to_id={"transcribe": TRANSCRIBE, "translate": TRANSLATE},
        suppress_tokens=SUPPRESS, begin_suppress_tokens=BEGIN_SUPPRESS, max_initial_timestamp_index=50,
        max_length=64)
    out = tmp_path_factory.mktemp("hf_whisper")
    m.save_pretrained(out)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(_tokens())}))
    return out


@pytest.fixture(scope="module")
def hf(hf_dir):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()


@pytest.fixture(scope="module")
def gguf_path(hf_dir, tmp_path_factory):
    from dasllama.convert_asr import convert_hf_whisper

    return convert_hf_whisper(hf_dir, tmp_path_factory.mktemp("asr") / "tiny-whisper.gguf", progress=False)


@pytest.fixture(scope="module")
def model(gguf_path):
    return d.load_asr_model(gguf_path, n_threads=2)


@pytest.fixture(scope="module")
def clip():
    return speak("Ask not what your country can do for you.")


def _features(x):
    import torch
    from transformers import WhisperFeatureExtractor

    f = WhisperFeatureExtractor()(x, sampling_rate=16000, return_tensors="np").input_features
    return torch.from_numpy(f)


def test_converted_file(model, gguf_path):
    c = model.decoder.config
    assert (c["dim"], c["n_layers"], c["n_heads"], c["ffn_dim"], c["n_ctx"], c["vocab"]) == (64, 2, 4, 128, 64, VOCAB)
    assert (model.sot, model.eot, model.notimestamps, model.timestamp_begin) == (SOT, EOT, NO_TS, TS0)
    assert model.no_speech == NO_SPEECH and model.multilingual
    assert model.languages == {"en": EN, "de": DE}
    assert model.suppress == SUPPRESS and model.begin_suppress == BEGIN_SUPPRESS
    # The encoder half is the whisper-encoder mmproj audio chat reads.
    assert d.load_audio_embedder(gguf_path).family == "whisper"
    assert "ASRModel(" in repr(model)


def test_teacher_forced_logits(model, hf, clip):
    import torch

    rng = np.random.default_rng(1)
    ids = [SOT, EN, TRANSCRIBE, NO_TS] + rng.integers(0, EOT, 20).tolist()
    with torch.no_grad():
        ref = hf(input_features=_features(clip), decoder_input_ids=torch.tensor([ids])).logits[0].numpy()
    rows = d.encode_audio_rows(model.encoder, clip, full_window=True)
    model.decoder.set_encoder(rows)
    ours = model.decoder.forward(np.array(ids, np.int32), 0, True)
    assert ours.shape == ref.shape
    e = nmse(ours, ref)
    assert e < NMSE, e
    # Fed in pieces through the self-attention cache: the same logits.
    a = model.decoder.forward(np.array(ids[:7], np.int32), 0, True)
    b = model.decoder.forward(np.array(ids[7:], np.int32), 7, True)
    assert nmse(np.concatenate([a, b]), ref) < NMSE


def _fw_features(x):
    """faster-whisper's features of a clip under 30 s as its transcribe feeds them: normalized
    over the clip, zero-padded to 3000 frames."""
    from faster_whisper.audio import pad_or_trim
    from faster_whisper.feature_extractor import FeatureExtractor

    f = FeatureExtractor()(x)
    return pad_or_trim(f[:, :f.shape[-1] - 1])[None].astype(np.float32)


def _hf_generate_features(hf, feats, n):
    import torch

    return _hf_generate(hf, None, n, feats=torch.from_numpy(feats))


def _hf_generate(hf, x, n, feats=None, **kw):
    import torch

    with torch.no_grad():
        seq = hf.generate(_features(x) if feats is None else feats, language="en", task="transcribe", max_new_tokens=n, do_sample=False,
                          num_beams=1, **kw)
    seq = seq[0].tolist() if hasattr(seq, "tolist") else seq["sequences"][0].tolist()
    prompt = [SOT, EN, TRANSCRIBE] + ([] if kw.get("return_timestamps") else [NO_TS])
    if seq[:len(prompt)] == prompt:
        seq = seq[len(prompt):]
    while seq and seq[-1] == EOT:
        seq.pop()
    return seq


def _hf_forced_greedy(hf, x, n):
    """transformers' forward, one token at a time, with whisper's suppression: argmax after each step."""
    import torch

    ids = [SOT, EN, TRANSCRIBE, NO_TS]
    with torch.no_grad():
        enc = hf.model.encoder(_features(x))
        for step in range(n):
            lg = hf(encoder_outputs=enc, decoder_input_ids=torch.tensor([ids])).logits[0, -1].clone()
            lg[SUPPRESS] = -float("inf")
            if step == 0:
                lg[BEGIN_SUPPRESS] = -float("inf")
            t = int(lg.argmax())
            if t == EOT:
                break
            ids.append(t)
    return ids[4:]


def _clip(which, clip):
    return clip if which == "speech" else np.random.default_rng(3).uniform(-0.3, 0.3, 24000).astype(np.float32)


def _ours(model, x, n):
    model.decoder.set_encoder(d.encode_audio_rows(model.encoder, x, full_window=True))
    toks, _, _ = model.decoder.greedy(model.prompt("en", False), model.suppress, model.begin_suppress, model.eot, n,
                                      no_timestamps=model.notimestamps)
    return toks


@pytest.mark.parametrize("which", ["speech", "noise"])
def test_greedy_equals_generate(model, hf, clip, which):
    # 16 new tokens: from 20 on (a 24-token window), transformers 5.24's generate re-decodes
    # the window when it ends without <|endoftext|> (its output then no longer follows its own
    # forward's argmax); test_greedy_long_run checks longer runs against that forward.
    x = _clip(which, clip)
    ref = _hf_generate(hf, x, 16)
    assert len(ref) >= 8
    toks = _ours(model, x, 16)
    assert toks == ref, f"{toks} {ref}"
    # transcribe feeds the whole clip's features zero-padded past its end (whisper's and
    # faster-whisper's transcribe): generate on those features, greedy without the fallback.
    ref = _hf_generate_features(hf, _fw_features(x), 16)
    t = d.transcribe(model, x, language="en", max_new_tokens=16, temperature=0.0, logprob_threshold=None,
                     no_speech_threshold=None)
    assert t.text == model.decode(ref).strip()
    assert t.language == "en"


@pytest.mark.parametrize("which", ["speech", "noise"])
def test_greedy_long_run(model, hf, clip, which):
    x = _clip(which, clip)
    n = 40
    assert _ours(model, x, n) == _hf_forced_greedy(hf, x, n)


def test_audio_as_path_and_bytes(model, clip, tmp_path):
    import soundfile as sf

    p = tmp_path / "clip.wav"
    sf.write(p, clip, 16000, subtype="FLOAT")
    a = d.transcribe(model, clip, language="en", max_new_tokens=8)
    assert d.transcribe(model, str(p), language="en", max_new_tokens=8).text == a.text
    assert d.transcribe(model, p.read_bytes(), language="en", max_new_tokens=8).text == a.text


def test_bad_inputs(model, gguf_path, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        d.transcribe(model, np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="floating point"):
        d.transcribe(model, np.zeros(1600, np.int16))
    with pytest.raises(ValueError, match="mono"):
        d.transcribe(model, np.zeros((2, 1600), np.float32))
    with pytest.raises(ValueError, match="language"):
        d.transcribe(model, np.zeros(1600, np.float32), language="xx")
    with pytest.raises(TypeError):
        d.transcribe("not a model", np.zeros(1600, np.float32))
    with pytest.raises(FileNotFoundError):
        d.load_asr_model(tmp_path / "nowhere.gguf")
    with pytest.raises(ValueError):
        model.decoder.forward(np.array([VOCAB], np.int32), 0, True)  # id out of range
    with pytest.raises(ValueError):
        model.decoder.forward(np.array([SOT], np.int32), 64, True)  # past the context


def test_encoder_only_file_is_refused(tmp_path):
    """An mmproj with the encoder only (what audio chat loads) is not an ASR model."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "enc.gguf"), "clip")
    w.add_string("clip.projector_type", "whisper")
    w.add_tensor("a.dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(d.UnsupportedModelError, match="no whisper decoder"):
        d.load_asr_model(tmp_path / "enc.gguf")


@pytest.mark.parametrize("which", ["speech", "noise"])
def test_language_detection_equals_transformers(model, hf, clip, which):
    import torch

    from dasllama.asr import _detect_language

    x = _clip(which, clip)
    with torch.no_grad():
        ref = int(hf.detect_language(_features(x))[0])
    model.decoder.set_encoder(d.encode_audio_rows(model.encoder, x, full_window=True))
    lang = _detect_language(model)
    assert model.languages[lang] == ref
    with torch.no_grad():
        ref = int(hf.detect_language(torch.from_numpy(_fw_features(x)))[0])
    assert model.languages[d.transcribe(model, x, max_new_tokens=4).language] == ref
