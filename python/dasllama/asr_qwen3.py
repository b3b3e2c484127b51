"""Speech recognition by Qwen3-ASR: an audio tower (mmproj, family ``qwen3a``) whose rows are a
span in a Qwen3 decoder, as audio chat splices them; llama.cpp's converter writes both files
(the decoder as arch ``qwen3vl``, the tower with ``--mmproj``). Not whisper (``asr.py``) and not
the chat layer: the prompt is Qwen3-ASR's own, built here.

The turn, as Qwen3-ASR's processor renders it: an (empty or context) system message, the user
message holding only the clip between <|audio_start|> and <|audio_end|>, then the assistant's
turn. The model writes ``language <Name><asr_text>`` and the words; passing ``language`` puts
that prefix in the prompt (the processor's forced language), so only the words are generated.
Greedy; the decode loop runs in C++ (``generate``). The clip is encoded whole (the tower
attends within 8 s windows, so its cost is linear in the clip's length). A model may be shared by
threads; transcriptions on one model are serialized.
"""
from __future__ import annotations

import os
import threading
from typing import List, Optional, Tuple

import numpy as np

from ._core import UnsupportedModelError

# The names Qwen3-ASR was trained with in its "language <Name><asr_text>" prefix, by ISO code.
LANGUAGES = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
    "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}
_NAME_TO_CODE = {v.lower(): k for k, v in LANGUAGES.items()}
MARKERS = ("<|audio_start|>", "<|audio_end|>", "<asr_text>", "<|im_start|>", "<|im_end|>")


def find_mmproj(decoder_path: str) -> Optional[str]:
    """The audio mmproj beside a decoder GGUF: a file in its folder whose name has "mmproj" and
    that holds an audio tower, or None."""
    from .audio import audio_tower_probe_proj_dim

    folder = os.path.dirname(os.path.abspath(decoder_path))
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if "mmproj" in name.lower() and name.endswith(".gguf") and os.path.isfile(p):
            try:
                if audio_tower_probe_proj_dim(p):
                    return p
            except Exception:  # a broken neighbour is not ours to report: keep looking
                continue
    return None


class Qwen3ASRModel:
    """A Qwen3-ASR decoder and its audio tower, for :func:`dasllama.transcribe`."""

    def __init__(self, decoder_path: str, mmproj_path: Optional[str], n_threads: int, device: str, mode=None):
        from . import llm
        from .audio import load_audio_tower

        mm = mmproj_path or find_mmproj(decoder_path)
        if mm is None:
            raise FileNotFoundError(f"{decoder_path}: no audio mmproj beside it (a *mmproj*.gguf holding an audio "
                                    "tower); pass mmproj=")
        self.tower = load_audio_tower(mm, n_threads, device)
        self.model = llm.load_model(decoder_path, llm.QuantMode.q8 if mode is None else mode, n_threads,
                                    device=device)
        dim = self.model.config.dim
        if self.tower.proj_dim != dim:
            raise UnsupportedModelError(f"{mm}: tower rows of {self.tower.proj_dim} for a decoder of {dim}")
        self.ids = {}
        for m in MARKERS:
            ids = llm.encode(self.model, m, add_special=False, parse_special=True)
            if len(ids) != 1:
                raise UnsupportedModelError(f"{decoder_path}: the vocabulary has no {m} token")
            self.ids[m] = ids[0]
        self.path, self.mmproj_path = decoder_path, mm
        self.multilingual = True
        self.family = self.tower.family
        self._lock = threading.Lock()

    def prompt(self, language: Optional[str], context: str = "") -> Tuple[List[int], List[int]]:
        """The token ids before and after the clip's rows."""
        from . import llm

        tail = "<|audio_end|><|im_end|>\n<|im_start|>assistant\n"
        if language is not None:
            tail += f"language {LANGUAGES[language]}<asr_text>"
        enc = lambda s: llm.encode(self.model, s, add_special=False, parse_special=True)  # noqa: E731
        return enc(f"<|im_start|>system\n{context}<|im_end|>\n<|im_start|>user\n<|audio_start|>"), enc(tail)

    def greedy(self, samples: np.ndarray, language: Optional[str], max_new_tokens: int, context: str = ""
               ) -> Tuple[List[int], List[int]]:
        """(prompt ids with the clip's media ids, generated ids) of one greedy transcription."""
        from . import llm
        from .audio import encode_audio_rows
        from .kv import media_ids

        rows = encode_audio_rows(self.tower, samples)
        n = rows.shape[0]
        head, tail = self.prompt(language, context)
        s = llm.create_session(self.model, llm.KVDtype.f32, n_ctx=len(head) + n + len(tail) + max_new_tokens)
        body = llm.media_body_rows(self.model, s, head, rows, n, self.model.config.dim, tail)
        ids = head + media_ids(f"asr-{id(rows)}", n) + tail
        llm.eval_embd_body(self.model, s, body, len(ids), ids=ids)
        out: List[int] = []
        llm.generate(self.model, s, [], None, max_new_tokens, lambda i, p: out.append(int(i)),
                     stop_ids=sorted(set(self.model.eog_ids) | {self.ids["<|im_end|>"]}), special=True)
        return ids, out

    def parse(self, ids: List[int], language: Optional[str]) -> Tuple[str, Optional[str]]:
        """(text, language code) of generated ids: what follows <asr_text>, and the name before it."""
        from . import llm

        mark = self.ids["<asr_text>"]
        if language is not None:
            return llm.decode(self.model, [i for i in ids if i != mark]).strip(), language
        if mark not in ids:
            return llm.decode(self.model, ids).strip(), None
        k = ids.index(mark)
        prefix = llm.decode(self.model, ids[:k]).strip()
        name = prefix[len("language "):].strip() if prefix.lower().startswith("language ") else prefix
        return llm.decode(self.model, ids[k + 1:]).strip(), _NAME_TO_CODE.get(name.lower())

    def __repr__(self) -> str:
        return (f"Qwen3ASRModel(tower={self.tower.family}, layers={self.tower.n_layers}, dim={self.model.config.dim}, "
                f"path={os.path.basename(self.path)!r})")


def language_code(language: Optional[str]) -> Optional[str]:
    """An ISO code of LANGUAGES from a code or a full name (any case); None stays None."""
    if language is None:
        return None
    s = str(language).strip()
    if s.lower() in LANGUAGES:
        return s.lower()
    if s.lower() in _NAME_TO_CODE:
        return _NAME_TO_CODE[s.lower()]
    raise ValueError(f"unknown language {language!r}; Qwen3-ASR knows {sorted(LANGUAGES)}")


def transcribe(model: Qwen3ASRModel, x: np.ndarray, language: Optional[str], timestamps: bool,
               max_new_tokens: Optional[int], context: str = ""):
    """asr.transcribe's Qwen3-ASR path: (text, language code, generated ids)."""
    # Qwen3-ASR gives no times (its forced aligner is a separate model): with or without
    # ``timestamps`` the transcript is one segment spanning the clip.
    code = language_code(language)
    limit = 448 if max_new_tokens is None else int(max_new_tokens)
    if limit <= 0:
        raise ValueError("max_new_tokens must be positive")
    with model._lock:
        _, out = model.greedy(x, code, limit, context)
    text, lang = model.parse(out, code)
    return text, lang, out


Model = Qwen3ASRModel  # the name asr.py's family table loads

__all__ = ["LANGUAGES", "Qwen3ASRModel", "find_mmproj", "language_code", "transcribe"]
