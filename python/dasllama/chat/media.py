"""Media spans in chat turns (reference §17.1.10 audio, tutorial 08): spans, framing, rows and their caches.

A span is a run of prompt positions filled with embedding rows (an audio clip's soft tokens). It
is keyed by the clip's content, and each of its positions carries a negative id derived from that
key (kv.media_ids), so the session history, the chat's prefix matching and the prefix cache treat
it like text: the same clip in a later turn or another conversation matches and is not prefilled.
The rows themselves are fetched lazily -- only when a span must be prefilled -- through a bounded
LRU of encoder outputs keyed by the same content key, so a cached span costs no encode either.

The template never sees the audio: a user message's content carries an invisible sentinel where
the span sits; after rendering, the text is cut at each sentinel and each run is tokenized on its
own (no merge crosses the boundary), the family's markers closing the run before and opening the
run after, as llama.cpp's mtmd does. This file knows no sessions beyond prefilling rows into one.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from .. import llm
from ..audio import encode_audio_rows
from ..vision import VisionEmbedder, encode_image_rows
from ..kv import media_ids

# A per-process nonce in the sentinel: text a user types cannot name a span.
_NONCE = secrets.token_hex(8)
_SENTINEL_RE = re.compile("\u2063dasllama-media-" + _NONCE + "-(\\d+)\u2063")


def sentinel(span_id: int) -> str:
    return f"\u2063dasllama-media-{_NONCE}-{int(span_id)}\u2063"

# Framing per tower family, as llama.cpp's mtmd writes it (tools/mtmd/mtmd.cpp: the audio begin / end
# strings per projector): qwen2a / qwen2.5o / qwen3a wrap the rows, voxtral opens them, ultravox splices bare.
FAMILY_FRAMING = {
    "qwen2a": ("<|audio_bos|>", "<|audio_eos|>"),
    "qwen2.5o": ("<|audio_bos|>", "<|audio_eos|>"),
    "voxtral": ("[BEGIN_AUDIO]", ""),
    "ultravox": ("", ""),
    "whisper": ("", ""),
    "qwen3a": ("<|audio_start|>", "<|audio_end|>"),
}


# Image framing per vision family, as each family's transformers processor writes it (Gemma-3: the
# image token expands to "\n\n<start_of_image>" + rows + "<end_of_image>\n\n").
IMAGE_FRAMING = {
    "gemma3v": ("\n\n<start_of_image>", "<end_of_image>\n\n"),
    # Qwen2.5-VL's and Qwen3-VL's templates write <|vision_start|><|image_pad|><|vision_end|>; the
    # processor expands the pad to the image's rows.
    "qwen25v": ("<|vision_start|>", "<|vision_end|>"),
    "qwen3v": ("<|vision_start|>", "<|vision_end|>"),
}


def audio_span_bare(e) -> bool:
    """True when the embedder's span sits bare in the template (ultravox, a bare whisper encoder): no markers."""
    fam = getattr(e, "family", e)
    if fam not in FAMILY_FRAMING:
        raise ValueError(f"unknown audio family {fam!r}")
    return FAMILY_FRAMING[fam] == ("", "")


def framing_for(model, family: Optional[str], bare: bool) -> Tuple[str, str]:
    """The (open, close) markers of an audio span: the tower family's, else what the decoder's vocab speaks."""
    if bare:
        return ("", "")
    if family in FAMILY_FRAMING:
        return FAMILY_FRAMING[family]
    # Pre-encoded rows with no tower: the decoder's own specials say which family it is.
    for open_, close in (("<|audio_bos|>", "<|audio_eos|>"), ("<|audio_start|>", "<|audio_end|>"), ("[BEGIN_AUDIO]", "")):
        if len(llm.encode(model, open_, add_special=False, parse_special=True)) == 1:
            return (open_, close)
    return ("", "")


@dataclass(eq=False)
class Span:
    """One media span: its content key, row count, framing and where its rows come from."""

    id: int
    key: str
    n: int
    open: str
    close: str
    is_image: bool = False
    rows: Optional[np.ndarray] = None  # pre-encoded rows (add_user_audio_rows), else fetched by `source`
    source: Optional[Tuple[object, object]] = None  # (embedder, samples or image): encoded on demand
    non_causal: bool = False  # the rows attend each other whole in the decoder (gemma vision)
    grid: Optional[Tuple[int, int]] = None  # M-RoPE: the rows as a (grid_h, grid_w) grid (qwen vision)

    @property
    def ids(self) -> List[int]:
        c = self.__dict__.get("_ids")
        if c is None:
            c = self.__dict__["_ids"] = media_ids(self.key, self.n)
        return c



# -- the tower's output, cached by content key ------------------------------------------------------------

class RowCache:
    """A bounded LRU of encoder outputs keyed by (embedder, content key); thread-safe."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = int(max_bytes)
        self._d: "OrderedDict[Tuple[int, str], np.ndarray]" = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = self.encodes = 0
        self.image_encodes = 0  # of encodes, the vision towers' runs

    def get(self, embedder, key: str, samples: np.ndarray) -> np.ndarray:
        k = (embedder.encoder_key, key)
        with self._lock:
            r = self._d.get(k)
            if r is not None:
                self._d.move_to_end(k)
                self.hits += 1
                return r
            self.misses += 1
        # An audio clip's samples, or an image.
        image = isinstance(embedder, VisionEmbedder)
        r = encode_image_rows(embedder, samples) if image else encode_audio_rows(embedder, samples)
        r.setflags(write=False)
        with self._lock:
            self.encodes += 1
            self.image_encodes += int(image)
            if k not in self._d:
                self._d[k] = r
                self._bytes += r.nbytes
            while self._bytes > self.max_bytes and len(self._d) > 1:
                _, old = self._d.popitem(last=False)
                self._bytes -= old.nbytes
        return r

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return {"entries": len(self._d), "bytes": self._bytes, "hits": self.hits, "misses": self.misses,
                    "encodes": self.encodes, "image_encodes": self.image_encodes}


ROW_CACHE = RowCache()


def audio_cache_stats() -> Dict[str, int]:
    """The tower-output cache: entries, bytes, hits, misses and encoder runs since start."""
    return ROW_CACHE.stats()


def media_cache_stats() -> Dict[str, int]:
    """The tower-output cache (audio clips and images alike): entries, bytes, hits, misses, encoder runs."""
    return ROW_CACHE.stats()


def clip_key(embedder, samples: np.ndarray) -> str:
    """The content key of a clip as an embedder hears it: its samples plus what shapes its rows."""
    h = hashlib.blake2b(digest_size=20, person=b"dasllama-audio")
    h.update(f"{embedder.family}|{embedder.path}|{embedder.proj_dim}|{embedder.full_window_default}|".encode())
    h.update(np.ascontiguousarray(samples, dtype=np.float32).tobytes())
    return "audio:" + h.hexdigest()


def rows_key(rows: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=20, person=b"dasllama-rows")
    h.update(f"{rows.shape}|".encode())
    h.update(np.ascontiguousarray(rows, dtype=np.float32).tobytes())
    return "rows:" + h.hexdigest()


def span_rows(span: Span) -> np.ndarray:
    """The span's rows (encoding the clip through the row cache if they are not at hand)."""
    if span.rows is not None:
        return span.rows
    emb, samples = span.source
    r = ROW_CACHE.get(emb, span.key, samples)
    if r.shape[0] != span.n:
        raise RuntimeError(f"the encoder made {r.shape[0]} rows where {span.n} were expected")
    return r


# -- rendering and prefill --------------------------------------------------------------------------------

def tokenize_with_spans(model, spans: Dict[int, Span], text: str) -> List[int]:
    """Token ids of rendered text whose media sentinels become the spans' media ids. Each text run is
    tokenized alone: the open marker ends the run before a span, the close marker starts the run after."""
    def enc(t: str, add_special: bool, parse_special: bool) -> List[int]:
        return llm.encode(model, t, add_special, parse_special)

    parts = _SENTINEL_RE.split(text)
    if len(parts) == 1:
        return enc(text, False, True)
    out: List[int] = []
    carry = ""
    for i in range(0, len(parts), 2):
        run = carry + parts[i]
        if i + 1 < len(parts):
            sid = int(parts[i + 1])
            sp = spans.get(sid)
            if sp is None:
                raise ValueError("a media span of this chat's history is unknown (a transcript loaded "
                                 "with media cannot be replayed without its clips)")
            run += sp.open
            if run:
                out += enc(run, False, True)
            out += sp.ids
            carry = sp.close
        elif run:
            out += enc(run, False, True)
    return out


def prefill(model, session, spans: Dict[int, Span], ids: List[int], counters: Dict[str, int]) -> None:
    """Prefill ``ids`` (tokens and media ids) at the session's position: one eval for plain text, else
    one body of rows (text rows embedded as eval would, media rows from their spans) named by ``ids``."""
    if not ids:
        return
    counters["rows_prefilled"] += len(ids)
    if all(t >= 0 for t in ids):
        llm.eval(model, session, ids)
        return
    K = model.config.n_deepstack
    deep = np.zeros((len(ids), K * model.config.dim), np.float32) if K else None
    body = body_rows(model, spans, ids, counters, deep)
    # One call per non-causal or M-RoPE span (the decoder takes one per call): each call ends where a
    # span ends. An M-RoPE span the call starts inside of (a prefix attach ended in it) goes on from
    # its grid row.
    index = _media_index(spans)
    start = i = 0
    while i < len(ids):
        hit = index.get(ids[i]) if ids[i] < 0 else None
        if hit is None or not (hit[0].non_causal or hit[0].grid):
            i += 1
            continue
        sp, lo, r0 = hit[0], i, hit[1]
        while i < len(ids) and ids[i] < 0 and (index.get(ids[i]) or (None,))[0] is sp:
            i += 1
        if sp.grid:
            if r0 > 0 and lo > start:  # text before a continued image: its own call first
                llm.eval_embd(model, session, body[start:lo], lo - start, ids=ids[start:lo])
                start = lo
            llm.eval_embd_span_mrope(model, session, body[start:i], i - start, lo - start, i - start, sp.grid,
                                     ids=ids[start:i], non_causal=sp.non_causal, first_row=r0,
                                     deepstack=deep[start:i] if deep is not None else None)
        else:
            llm.eval_embd_span(model, session, body[start:i], i - start, lo - start, i - start, ids=ids[start:i])
        start = i
    if start < len(ids):
        llm.eval_embd(model, session, body[start:], len(ids) - start, ids=ids[start:])


def body_rows(model, spans: Dict[int, Span], ids: List[int], counters: Dict[str, int],
              deep: Optional[np.ndarray] = None) -> np.ndarray:
    """The rows ``ids`` name (dim wide); a deepstack tower's extra features (its rows past dim) go into
    ``deep`` when given (zeros elsewhere)."""
    index = _media_index(spans)
    D = model.config.dim
    body = np.empty((len(ids), D), np.float32)
    i = 0
    while i < len(ids):
        j = i
        if ids[i] >= 0:
            while j < len(ids) and ids[j] >= 0:
                j += 1
            body[i:j] = llm.embed_text_rows(model, ids[i:j])
        else:
            hit = index.get(ids[i])
            if hit is None:
                raise ValueError("a media position of the prompt belongs to no span of this chat")
            sp, r0 = hit
            rows = span_rows(sp)
            while j < len(ids) and ids[j] < 0:
                h = index.get(ids[j])
                if h is None or h[0] is not sp or h[1] != r0 + j - i:
                    break
                j += 1
            body[i:j] = rows[r0:r0 + (j - i), :D]
            if deep is not None and rows.shape[1] > D:
                deep[i:j] = rows[r0:r0 + (j - i), D:]
            counters["media_rows_prefilled"] += j - i
        i = j
    return body


def rope_marks(spans: Dict[int, Span], ids: List[int]) -> List[Tuple[int, int]]:
    """The M-RoPE marks a session holding ``ids`` carries (Session.rope_marks): one after each whole
    M-RoPE image span, the rope position advance so far; restored after a prefix cache attach."""
    index = _media_index(spans)
    marks: List[Tuple[int, int]] = []
    delta = 0
    i = 0
    while i < len(ids):
        hit = index.get(ids[i]) if ids[i] < 0 else None
        if hit is None or not hit[0].grid or hit[1] != 0:
            i += 1
            continue
        sp = hit[0]
        j = i
        while j < len(ids) and ids[j] < 0 and (index.get(ids[j]) or (None,))[0] is sp:
            j += 1
        if j - i == sp.n:
            gh, gw = sp.grid
            delta += max(gh, gw) - sp.n
            marks.append((j, delta))
        i = j
    return marks


def _media_index(spans: Dict[int, Span]) -> Dict[int, Tuple[Span, int]]:
    idx: Dict[int, Tuple[Span, int]] = {}
    for sp in spans.values():
        for r, mid in enumerate(sp.ids):
            idx.setdefault(mid, (sp, r))
    return idx
