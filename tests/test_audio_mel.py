"""dasllama.log_mel against transformers' WhisperFeatureExtractor on speech, tones, silence and noise.

Error bar: 2e-4 absolute on the (x + 4) / 4 scale (observed <= 7e-5: speech and chirps). Both sides are
float32: transformers runs torch.stft (an FFT) and a float32 mel matmul; we run the
400-point DFT as a float32 matmul against a window-folded DFT matrix rounded once from
double. A DFT coefficient then carries an absolute error of about eps32 * sqrt(400) *
rms(frame); the (max - 8) floor keeps only bins with power >= 1e-8 of the loudest, whose
amplitude is >= 1e-4 of the loudest coefficient (~100x the frame rms for a pure tone),
so the worst relative power error is ~2.5e-4, i.e. 1e-4 in log10 and 2.6e-5 after the
/ 4 -- which a 440 Hz tone hits (2.6e-5 observed). Everything louder is far tighter.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402

BAR = 2e-4
SR = 16000


def _reference(x, n_mel, max_length=None):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=n_mel)
    kw = {} if max_length is None else {"max_length": max_length, "truncation": False}
    return fe(x, sampling_rate=SR, return_tensors="np", padding="max_length", **kw).input_features[0]


_rng = np.random.default_rng(7)
_t = np.arange(3 * SR) / SR
SIGNALS = {
    "speech": lambda: speak("And so my fellow Americans, ask not what your country can do for you."),
    "speech_other_voice": lambda: speak("Seven hundred and forty two point five.", "en"),
    "tone_440": lambda: (0.5 * np.sin(2 * np.pi * 440 * _t)).astype(np.float32),
    "tone_7900_quiet": lambda: (1e-3 * np.sin(2 * np.pi * 7900 * _t)).astype(np.float32),
    "chirp": lambda: (0.3 * np.sin(2 * np.pi * (100 + 1200 * _t) * _t)).astype(np.float32),
    "silence": lambda: np.zeros(2 * SR, np.float32),
    "clipped_noise": lambda: np.clip(_rng.standard_normal(4 * SR) * 3.0, -1, 1).astype(np.float32),
    "tenth_of_a_second": lambda: (0.2 * _rng.standard_normal(SR // 10)).astype(np.float32),
    "one_sample": lambda: np.array([0.5], np.float32),
}


@pytest.mark.parametrize("n_mel", [80, 128])
@pytest.mark.parametrize("name", list(SIGNALS))
def test_log_mel_matches_whisper_feature_extractor(name, n_mel):
    x = SIGNALS[name]()
    ours = d.log_mel(x, n_mel)
    ref = _reference(x, n_mel)
    assert ours.dtype == np.float32 and ours.shape == (n_mel, 3000) == ref.shape
    err = float(np.abs(ours - ref).max())
    assert err <= BAR, f"{name}: max abs error {err:.3g}"


def test_exactly_30s_is_one_chunk_and_longer_is_several():
    x = np.tile(speak("Testing one two three."), 60)
    assert len(x) >= 45 * SR
    x30 = x[: 30 * SR]
    assert d.log_mel(x30).shape == (80, 3000)
    assert np.abs(d.log_mel(x30) - _reference(x30, 80)).max() <= BAR
    x45 = x[: 45 * SR]
    ours = d.log_mel(x45)
    assert ours.shape == (80, 6000)
    # The whole clip padded to two windows, one STFT and one (max - 8) floor, as whisper does.
    ref = _reference(x45, 80, max_length=60 * SR)
    assert ref.shape == (80, 6000)
    assert np.abs(ours - ref).max() <= BAR


def test_accepts_other_dtypes_and_lists():
    x = speak("Hello.")
    ref = d.log_mel(x)
    np.testing.assert_array_equal(d.log_mel(x.astype(np.float64)), ref)
    np.testing.assert_array_equal(d.log_mel(list(x[:1000])), d.log_mel(x[:1000]))
    with pytest.raises(ValueError):  # int16 PCM must be scaled by the caller
        d.log_mel((x * 32767).astype(np.int16))


@pytest.mark.parametrize("bad,exc", [
    (np.zeros(0, np.float32), ValueError),
    (np.zeros((2, 100), np.float32), ValueError),
    (np.array([0.0, np.nan], np.float32), ValueError),
    (np.array([0.0, np.inf], np.float32), ValueError),
    (np.array(["a", "b"]), ValueError),
])
def test_bad_samples_raise(bad, exc):
    with pytest.raises(exc):
        d.log_mel(bad)


@pytest.mark.parametrize("n_mel", [0, -1, 100000])
def test_bad_n_mel_raises(n_mel):
    with pytest.raises(ValueError):
        d.log_mel(np.zeros(100, np.float32), n_mel)
