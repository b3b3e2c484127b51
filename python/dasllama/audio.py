"""Audio towers and the mel front end (reference §17.1.9 and the AudioTower / AudioEmbedder /
AudioState types): 16 kHz mono float32 samples in, soft-token rows out.

Files are llama.cpp-layout mmproj GGUFs (``clip.*`` keys, ``a.*`` / ``mm.a.*`` tensors).
Families: ``qwen2a`` and ``qwen2.5o`` (avg-pool + linear), ``ultravox`` (stack 8 + RMSNorm
+ SwiGLU), ``voxtral`` (stack 4 + GELU MLP), and ``whisper`` (a bare encoder, as
``dasllama convert`` writes from whisper CTranslate2 files: rows are the encoder's own).

An embedder may be shared by threads (encodes on one embedder are serialized); an
:class:`AudioState` is used by one thread at a time. This module knows no chat: the
chat layer splices the rows ``encode_audio`` writes (``proj_dim`` wide, which must equal
the decoder's embedding width).
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np

from . import _core
from ._core import UnsupportedModelError

PathLike = Union[str, "os.PathLike[str]"]

# Families load_audio_tower serves (a projector into a decoder); load_audio_embedder
# serves these and the bare encoders. The C++ table (audio/tower.cpp) is the one list.
EMBEDDER_FAMILIES = tuple(_core.AudioEncoder.families())
TOWER_FAMILIES = tuple(k for k, tower in _core.AudioEncoder.families().items() if tower)


def log_mel(samples, n_mel: int = 80) -> np.ndarray:
    """Whisper log-mel features of 16 kHz mono ``samples``: float32 ``(n_mel, 3000 * chunks)``.

    A clip of up to 30 s makes exactly one 3000-frame chunk (zero-padded, as
    ``WhisperFeatureExtractor`` pads); a longer clip makes one chunk per 30 s started.
    Periodic Hann 400, hop 160, reflect-padded STFT, Slaney mel, log10 with the
    (max - 8) floor over the whole clip, then (x + 4) / 4.
    """
    return _core.log_mel(_samples(samples), int(n_mel))


def nemo_fbank(samples, n_mel: int = 80) -> np.ndarray:
    """NeMo's normalized log-mel filterbank (FastConformer models such as Parakeet) of 16 kHz mono
    ``samples``: float32 ``(n_mel, 1 + len // 160)``, as transformers' ParakeetFeatureExtractor
    gives it for one clip. Preemphasis 0.97, symmetric Hann 400 in a 512-point DFT, zero padding
    by 256 at both ends, Slaney mel, ln(x + 2^-24), each bin normalized over the clip's
    ``len // 160`` valid frames (mean, unbiased std + 1e-5); the last frame is 0.
    """
    return _core.nemo_fbank(_samples(samples), int(n_mel))


def _samples(samples) -> np.ndarray:
    x = np.asarray(samples)
    if x.dtype.kind != "f":  # int16 PCM passed as-is would be 32768x too loud: say so instead
        raise ValueError(f"samples must be floating point PCM in [-1, 1] (16 kHz mono), got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


class AudioState:
    """Caller-owned scratch for ``encode_audio``: buffers reused across calls, no clip state."""

    def __init__(self):
        self._s = _core.AudioScratch()

    def __repr__(self) -> str:
        return "AudioState()"


class AudioEmbedder:
    """A loaded audio encoder of whatever family the mmproj turned out to be."""

    def __init__(self, enc: "_core.AudioEncoder"):
        self._enc = enc
        c = enc.config
        self.family: str = c["family"]
        self.n_mel: int = c["n_mel"]
        self.dim: int = c["dim"]  # the encoder's width
        self.n_layers: int = c["n_layers"]
        self.proj_dim: int = c["proj_dim"]  # the width of the rows encode_audio writes
        self.full_window_default: bool = c["full_window_default"]
        self.path: str = enc.path

    @property
    def audio_proj_dim(self) -> int:
        return self.proj_dim

    @property
    def encoder_key(self) -> int:
        """Names the loaded encoder (not its file): the key of caches of its outputs (chat.media.RowCache)."""
        return id(self._enc)

    @property
    def config(self) -> dict:
        return dict(self._enc.config)

    def n_rows(self, n_samples: int, full_window: Optional[bool] = None) -> int:
        """Rows a clip of ``n_samples`` makes (see :func:`encode_audio` for ``full_window``)."""
        return self._enc.n_rows(int(n_samples), self._full(full_window))

    def _full(self, full_window: Optional[bool]) -> bool:
        return self.full_window_default if full_window is None else bool(full_window)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(family={self.family!r}, n_mel={self.n_mel}, dim={self.dim}, "
                f"layers={self.n_layers}, proj_dim={self.proj_dim}, path={os.path.basename(self.path)!r})")


class AudioTower(AudioEmbedder):
    """A whisper-family encoder plus its model's projector, for a chat that hears."""


def load_audio_embedder(path: PathLike, n_threads: int = 0, device: Optional[str] = None) -> AudioEmbedder:
    """Loads any audio family we serve from an mmproj GGUF (UnsupportedModelError otherwise).
    ``device`` as for :func:`~dasllama.load_model` (the mel front end stays on the CPU)."""
    from .llm import resolve_device

    return AudioEmbedder(_core.AudioEncoder(os.fspath(path), int(n_threads), resolve_device(device)))


def load_audio_tower(path: PathLike, n_threads: int = 0, device: Optional[str] = None) -> AudioTower:
    """Loads a chat audio tower (qwen2a, qwen2.5o, ultravox, voxtral) from an mmproj GGUF.
    ``device`` as for :func:`~dasllama.load_model`: the encoder and projector run there, the
    mel front end on the CPU."""
    from .llm import resolve_device

    fam = _core.AudioEncoder.probe_family(os.fspath(path))
    if fam and fam not in TOWER_FAMILIES:
        raise UnsupportedModelError(
            f"{os.fspath(path)}: the {fam!r} encoder has no projector into a decoder; "
            "load it with load_audio_embedder")
    return AudioTower(_core.AudioEncoder(os.fspath(path), int(n_threads), resolve_device(device)))


def audio_probe_proj_dim(path: PathLike) -> int:
    """The row width ``load_audio_embedder(path)`` would give, or 0 when no audio family we serve is in the file."""
    if not _core.AudioEncoder.probe_family(os.fspath(path)):
        return 0
    return load_audio_embedder(path, 1).proj_dim


def audio_tower_probe_proj_dim(path: PathLike) -> int:
    """The row width ``load_audio_tower(path)`` would give, or 0 when it serves no tower in the file."""
    if _core.AudioEncoder.probe_family(os.fspath(path)) not in TOWER_FAMILIES:
        return 0
    return load_audio_embedder(path, 1).proj_dim


def encode_audio(embedder: AudioEmbedder, scratch: AudioState, samples, out: np.ndarray,
                 full_window: Optional[bool] = None) -> int:
    """16 kHz mono ``samples`` through the embedder into ``out``; returns npos.

    ``out`` is a writable C-contiguous float32 array with room for at least
    ``embedder.n_rows(len(samples)) * embedder.proj_dim`` floats (flat or 2-D); rows are
    written token-major from its start. By default a clip makes as many rows as its
    family's processor gives: Qwen2-Audio keeps only the clip's rows of the 30 s window
    (5.3 s -> 132) and Qwen2.5-Omni encodes the clip's own frames in 2 s chunks, while
    Voxtral (375 per window), Ultravox (187, as llama.cpp counts) and whisper (1500)
    encode whole 30 s windows. ``full_window=True`` encodes whole windows for every family
    (qwen2a: 750 rows per window, llama.cpp's convention); ``False`` keeps only the clip's
    frames (stacked families pad their last group with zeros).
    The GIL is released while it runs.
    """
    if not isinstance(embedder, AudioEmbedder):
        raise TypeError("encode_audio takes an AudioEmbedder or AudioTower")
    if not isinstance(scratch, AudioState):
        raise TypeError("scratch must be an AudioState")
    if not isinstance(out, np.ndarray):
        raise TypeError("out must be a numpy float32 array")
    return embedder._enc.encode(_samples(samples), embedder._full(full_window), scratch._s, out)


def encode_audio_rows(embedder: AudioEmbedder, samples, scratch: Optional[AudioState] = None,
                      full_window: Optional[bool] = None) -> np.ndarray:
    """``encode_audio`` into a fresh float32 array of shape ``(npos, proj_dim)``."""
    x = _samples(samples)
    out = np.empty((embedder.n_rows(x.shape[0] if x.ndim == 1 else 0, full_window), embedder.proj_dim),
                   np.float32)
    n = encode_audio(embedder, scratch or AudioState(), x, out, full_window)
    return out[:n]


def encode_mel_window(embedder: AudioEmbedder, mel) -> np.ndarray:
    """Encoder rows ``(1500, dim)`` of one 30 s window of log-mel features ``(n_mel, 3000)``
    the caller cut (see :func:`log_mel`), for bare whisper encoders: speech recognition feeds
    windows of the whole clip's features, zero-padded past its end, as whisper's transcribe does."""
    if not isinstance(embedder, AudioEmbedder):
        raise TypeError("encode_mel_window takes an AudioEmbedder")
    return embedder._enc.encode_mel_window(np.ascontiguousarray(mel, dtype=np.float32))


__all__ = [
    "AudioEmbedder", "AudioState", "AudioTower", "audio_probe_proj_dim", "audio_tower_probe_proj_dim",
    "encode_audio", "encode_audio_rows", "encode_mel_window", "load_audio_embedder", "load_audio_tower",
    "log_mel", "nemo_fbank",
]
