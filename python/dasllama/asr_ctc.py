"""Speech recognition by a FastConformer encoder with a CTC head (NVIDIA's Parakeet CTC models),
from the GGUF ``convert_ctc`` writes. Not whisper (``asr.py``) nor a decoder LM (``asr_qwen3.py``):
the encoder (C++, ``_core.ConformerCTC``) gives one row of class logits per 80 ms, and greedy CTC
decoding takes each row's best class, merges repeats and drops the blank, as transformers'
``ParakeetForCTC.generate`` and its tokenizer's ``decode`` do. The clip is encoded whole (the
attention is global over the clip). A model may be shared by threads; encodes are serialized in C++.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

import numpy as np

from . import _core
from ._core import UnsupportedModelError

SPACE = "\u2581"  # SentencePiece's word boundary
_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
FRAME_SECONDS = 0.01  # per feature frame


def greedy_ctc(logits: np.ndarray, blank: int) -> List[int]:
    """Each row's best class, repeats merged, blanks dropped."""
    if logits.shape[0] == 0:
        return []
    best = np.argmax(logits, axis=-1)
    keep = np.ones(best.shape[0], bool)
    keep[1:] = best[1:] != best[:-1]
    return [int(i) for i in best[keep] if i != blank]


class CTCModel:
    """A FastConformer CTC model for :func:`dasllama.transcribe`."""

    def __init__(self, path: str, n_threads: int, device: str):
        from .gguf import GGUFFile

        self.encoder = _core.ConformerCTC(path, n_threads, device)
        c = self.encoder.config
        with GGUFFile(path) as g:
            meta = g.metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise UnsupportedModelError(f"{path}: no tokenizer.ggml.tokens (the CTC classes' pieces)")
        self.tokens: List[str] = [str(t) for t in meta["tokenizer.ggml.tokens"]]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(self.tokens))]
        if len(self.tokens) != c["vocab"] or len(types) != len(self.tokens):
            raise UnsupportedModelError(f"{path}: {len(self.tokens)} tokens for a CTC head of {c['vocab']} classes")
        self.blank: int = c["blank"]
        # Special pieces (type 3) are not text: decode(skip_special_tokens=True) drops them.
        self.special = {i for i, t in enumerate(types) if t == 3} | {self.blank}
        self.path = path
        self.multilingual = False
        self.family = "fastconformer_ctc"
        self.frame_seconds = FRAME_SECONDS * (2 ** c["subsampling_convs"])

    def logits(self, samples: np.ndarray) -> np.ndarray:
        """(rows, classes) CTC logits of a 16 kHz mono clip."""
        return self.encoder.encode(np.ascontiguousarray(samples, np.float32))[1]

    def decode(self, ids) -> str:
        """Text of class ids (already collapsed): the pieces joined, '▁' as a space, the leading one
        dropped, <0xXX> pieces as bytes; special pieces and the blank skipped."""
        b = bytearray()
        for i in ids:
            i = int(i)
            if i in self.special or not 0 <= i < len(self.tokens):
                continue
            t = self.tokens[i]
            m = _BYTE.fullmatch(t)
            b += bytes([int(m.group(1), 16)]) if m else t.replace(SPACE, " ").encode("utf-8")
        s = b.decode("utf-8", "replace")
        return s[1:] if s.startswith(" ") else s

    def __repr__(self) -> str:
        c = self.encoder.config
        return (f"CTCModel(layers={c['n_layers']}, dim={c['dim']}, vocab={c['vocab']}, "
                f"path={os.path.basename(self.path)!r})")


def transcribe(model: CTCModel, x: np.ndarray, language: Optional[str], timestamps: bool,
               max_new_tokens: Optional[int]) -> Tuple[str, Optional[str], List[int]]:
    """asr.transcribe's CTC path: (text, language, ids). The model names no language; a language
    other than None is refused rather than ignored."""
    if language is not None:
        raise ValueError(f"this CTC model takes no language (got {language!r})")
    ids = greedy_ctc(model.logits(x), model.blank)
    if max_new_tokens is not None:
        if int(max_new_tokens) <= 0:
            raise ValueError("max_new_tokens must be positive")
        ids = ids[: int(max_new_tokens)]
    return model.decode(ids), None, ids


Model = CTCModel

__all__ = ["CTCModel", "greedy_ctc", "transcribe"]
