"""Audio input for the chat layer: float32 16 kHz mono arrays, or WAV / FLAC / MP3 / OGG paths and bytes.

Decoding goes through soundfile (libsndfile, whose PyPI wheels bundle the library with FLAC,
Ogg Vorbis / Opus and MP3 since 1.1: no system packages, no ffmpeg subprocess), and resampling
through scipy's resample_poly (a polyphase FIR with a Kaiser window: exact rational ratios such
as 44.1 kHz -> 16 kHz, well kept, and already what the test oracles use). Both are imported only
when a file or bytes are given, and come with the ``audio`` extra (pip install dasllama[audio]).
"""
from __future__ import annotations

import io
import os
from fractions import Fraction
from typing import Union

import numpy as np

SAMPLE_RATE = 16000
AudioInput = Union[np.ndarray, str, bytes, bytearray, "os.PathLike[str]"]


def load_audio(src: AudioInput, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """``src`` as float32 mono PCM at ``sample_rate``: an array passes through (checked: float,
    1-D, finite); a path or the bytes of an audio file are decoded, down-mixed and resampled."""
    if isinstance(src, np.ndarray) or (isinstance(src, (list, tuple))):
        x = np.asarray(src)
        if x.dtype.kind != "f":
            raise ValueError(f"samples must be floating point PCM in [-1, 1] (16 kHz mono), got dtype {x.dtype}")
        if x.ndim != 1:
            raise ValueError(f"samples must be mono (1-D), got shape {x.shape}: pass a file, or down-mix first")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            raise ValueError("samples contain NaN or infinity")
        return x
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, what = io.BytesIO(bytes(src)), "audio bytes"
    elif isinstance(src, (str, os.PathLike)):
        p = os.fspath(src)
        if not os.path.isfile(p):
            raise FileNotFoundError(f"no such audio file: {p}")
        data, what = p, p
    else:
        raise TypeError(f"audio must be a float32 array, a path or bytes, got {type(src).__name__}")
    try:
        import soundfile as sf
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("decoding audio files needs soundfile and scipy: pip install 'dasllama[audio]'") from e
    try:
        x, sr = sf.read(data, dtype="float32", always_2d=True)
    except Exception as e:  # libsndfile's errors (sf.LibsndfileError, RuntimeError, ...) -> one clear type
        raise ValueError(f"{what}: not a readable WAV / FLAC / MP3 / OGG file ({e})") from None
    x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    return resample(x, int(sr), sample_rate)


def resample(x: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling by the exact rational ratio ``sr_out / sr_in`` (scipy.signal.resample_poly)."""
    if sr_in <= 0:
        raise ValueError(f"bad sample rate {sr_in}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if sr_in == sr_out or x.size == 0:
        return x
    from scipy.signal import resample_poly

    r = Fraction(sr_out, sr_in)
    return np.ascontiguousarray(resample_poly(x, r.numerator, r.denominator), dtype=np.float32)
