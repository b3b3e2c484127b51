"""NeMo's filterbank front end (the first piece of Parakeet) against transformers' ParakeetFeatureExtractor.

Error bar: 1e-4 absolute on features normalized to unit variance (observed ~5e-5 at 128 bins: f32
DFT and log against torch's FFT)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from dasllama.audio import nemo_fbank

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402


@pytest.fixture(scope="module")
def clip():
    return speak("The quick brown fox jumps over the lazy dog.")


@pytest.mark.parametrize("n_mel", [80, 128])
@pytest.mark.parametrize("n", [320, 1600, 16000 * 3 + 77, 16000 * 35])
def test_matches_parakeet_feature_extractor(clip, n_mel, n):
    from transformers import ParakeetFeatureExtractor

    x = np.resize(clip, n).astype(np.float32)
    r = ParakeetFeatureExtractor(feature_size=n_mel)(x, sampling_rate=16000, return_tensors="np")
    ref = r["input_features"][0].T
    ours = nemo_fbank(x, n_mel)
    assert ours.shape == ref.shape == (n_mel, 1 + n // 160) and int(r["attention_mask"][0].sum()) == n // 160
    assert float(np.abs(ours - ref).max()) <= 1e-4


def test_bad_input():
    for bad in (np.zeros(100, np.float32), np.array([0.0] * 400 + [np.nan], np.float32), np.zeros((2, 400), np.float32),
                np.zeros(400, np.int16)):
        with pytest.raises(ValueError):
            nemo_fbank(bad)
    with pytest.raises(ValueError):
        nemo_fbank(np.zeros(400, np.float32), 0)
