"""Speech recognition: whisper models (encoder + decoder + tokenizer in one GGUF, as
``dasllama convert`` writes them) and ``transcribe``. Not audio chat (``audio.py`` and the
chat layer): this decodes text with whisper's own decoder.

Decoding follows whisper's transcribe (and faster-whisper's): whisper's prompt (start of
transcript, language and task on multilingual models, then no-timestamps or the timestamp
rules) and its token suppression, greedy at temperature 0 with the temperature fallback
(0.2, 0.4, ... sampled, seeded, best of 5) when a window's text compresses too well or its
average log-probability is too low, and the no-speech skip; the decode loop runs in C++
(``_core.WhisperDecoder.greedy``). Audio longer than 30 s runs in 30 s windows that follow
the timestamps. A model may be shared by threads; decodes on one model are serialized.
"""
from __future__ import annotations

import os
import threading
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import numpy as np

from . import _core
from ._core import UnsupportedModelError
from .audio import AudioEmbedder, encode_mel_window
from .audio_io import AudioInput, load_audio

PathLike = Union[str, "os.PathLike[str]"]
WINDOW_SAMPLES = 30 * 16000
WINDOW_FRAMES = 3000  # mel frames per 30 s window
FRAME = 0.01  # seconds per mel frame
TIME_PRECISION = 0.02  # seconds per timestamp token
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # whisper's and faster-whisper's default schedule


@dataclass
class Segment:
    """A stretch of the transcript: start and end in seconds from the clip's start."""
    start: float
    end: float
    text: str
    tokens: List[int] = field(default_factory=list)
    # How the window that gave this segment was decoded (whisper's verbose output).
    seek: float = 0.0              # the window's start, in seconds
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass
class Transcript:
    text: str
    segments: List[Segment]
    language: Optional[str] = None
    duration: float = 0.0  # of the audio, in seconds


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet inverted: the printable char each byte was mapped to -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


class ASRModel:
    """A whisper model for transcription: the encoder, the decoder and the vocabulary."""

    def __init__(self, path: str, n_threads: int, device: str):
        from .gguf import GGUFFile

        if not _core.WhisperDecoder.probe(path):
            raise UnsupportedModelError(
                f"{path}: no whisper decoder in this file (an encoder-only mmproj?); convert the whole model with "
                "`dasllama convert` (dasllama.convert_asr)")
        meta = GGUFFile(path).metadata
        try:
            self.tokens: List[str] = list(meta["tokenizer.ggml.tokens"])
            sp = {k.split(".")[-1]: int(v) for k, v in meta.items() if k.startswith("whisper.token.")}
            self.eot, self.sot, self.notimestamps = sp["eot"], sp["sot"], sp["notimestamps"]
        except KeyError as e:
            raise UnsupportedModelError(f"{path}: whisper metadata missing ({e})") from None
        self.transcribe_id, self.translate_id = sp.get("transcribe", -1), sp.get("translate", -1)
        self.timestamp_begin, self.no_speech = sp.get("timestamp_begin", self.notimestamps + 1), sp.get("no_speech", -1)
        self.sot_prev = sp.get("sot_prev", -1)
        self.suppress = [int(i) for i in meta.get("whisper.suppress_tokens", [])]
        self.begin_suppress = [int(i) for i in meta.get("whisper.begin_suppress_tokens", [])]
        self.multilingual = bool(meta.get("whisper.multilingual", False))
        self.languages = {str(c): int(i) for c, i in zip(meta.get("whisper.languages", []),
                                                          meta.get("whisper.language_tokens", []))}
        self.encoder = AudioEmbedder(_core.AudioEncoder(path, n_threads, device))
        self.decoder = _core.WhisperDecoder(path, n_threads, device)
        c = self.decoder.config
        if self.encoder.proj_dim != c["dim"]:
            raise UnsupportedModelError(f"{path}: encoder rows of {self.encoder.proj_dim} for a decoder of {c['dim']}")
        if len(self.tokens) != c["vocab"]:
            raise UnsupportedModelError(f"{path}: {len(self.tokens)} tokens for an embedding of {c['vocab']} rows")
        self.n_ctx: int = c["n_ctx"]
        self.path = path
        self._lock = threading.Lock()

    def decode(self, ids) -> str:
        """Text of token ids; special tokens (end of text and above) are dropped."""
        b = bytearray()
        for i in ids:
            if 0 <= int(i) < self.eot:
                b += bytes(_BYTES.get(ch, 32) for ch in self.tokens[int(i)])
        return b.decode("utf-8", "replace")

    def prompt(self, language: Optional[str], timestamps: bool, task: str = "transcribe") -> List[int]:
        """Whisper's forced prompt."""
        p = [self.sot]
        if self.multilingual:
            if language is None or language not in self.languages:
                raise ValueError(f"unknown language {language!r}; this model knows {sorted(self.languages)}")
            tid = self.transcribe_id if task == "transcribe" else self.translate_id
            if tid < 0:
                raise ValueError(f"this model has no {task} token")
            p += [self.languages[language], tid]
        if not timestamps:
            p.append(self.notimestamps)
        return p

    def __repr__(self) -> str:
        c = self.decoder.config
        return (f"ASRModel(layers={self.encoder.n_layers}+{c['n_layers']}, dim={c['dim']}, vocab={c['vocab']}, "
                f"multilingual={self.multilingual}, path={os.path.basename(self.path)!r})")


def resolve_asr_model(name_or_path: PathLike, progress: bool = True) -> str:
    """The ASR GGUF for a GGUF path, a CTranslate2 whisper directory, a transformers
    ParakeetForCTC directory or a registry name (``whisper-tiny.en``, pulled first). Directories are converted on first use, and again
    whenever their model.bin is newer, into the cache (``<home>/asr/``), never beside the
    source: the hub's directories hold only their artifacts."""
    import hashlib

    from . import hub

    s = os.fspath(name_or_path)
    if os.path.isfile(s):
        return s
    name = None
    if not os.path.isdir(s):
        if s.endswith(".gguf") or os.sep in s:
            raise FileNotFoundError(f"no such model file: {s}")
        name, s = s, os.fspath(hub.resolve(s))
        if os.path.isfile(s):
            return s
    from .convert_ctc import convert_hf_parakeet_ctc, is_hf_parakeet_ctc

    if is_hf_parakeet_ctc(s):  # a transformers ParakeetForCTC directory
        binf, convert = os.path.join(s, "model.safetensors"), convert_hf_parakeet_ctc
    else:
        from .convert_asr import convert_ct2_whisper_asr

        binf, convert = os.path.join(s, "model.bin"), convert_ct2_whisper_asr
    if not os.path.isfile(binf):
        raise FileNotFoundError(f"{s}: neither a GGUF, a CTranslate2 whisper directory (no model.bin) nor a "
                                "transformers ParakeetForCTC directory")
    key = name or f"{os.path.basename(os.path.abspath(s))}-{hashlib.sha1(os.path.abspath(s).encode()).hexdigest()[:10]}"
    out = hub.home() / "asr" / f"{key}.gguf"
    if not out.is_file() or out.stat().st_mtime < os.path.getmtime(binf):
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(s, out, progress=progress)
    return os.fspath(out)


def _family_modules() -> dict:
    """ASR families beside whisper, as data: a decoder GGUF plus an audio tower, keyed by the
    tower's family; each module has ``Model(decoder, mmproj, n_threads, device, mode)`` and
    ``transcribe(model, samples, language, timestamps, max_new_tokens) -> (text, language, ids)``."""
    from . import asr_qwen3

    return {"qwen3a": asr_qwen3}


def _load_family(path: str, mmproj: Optional[PathLike], n_threads: int, device: str, mode):
    """The family model of a decoder GGUF with an audio tower, or None for a whisper file."""
    from .gguf import GGUFFile

    if _core.WhisperDecoder.probe(path):
        return None
    with GGUFFile(path) as g:
        arch = g.arch
    if arch not in _core.registered_archs():
        return None
    from .asr_qwen3 import find_mmproj

    mm = os.fspath(mmproj) if mmproj is not None else find_mmproj(path)
    if mm is None:
        raise FileNotFoundError(f"{path}: a {arch} decoder with no audio mmproj beside it (a *mmproj*.gguf "
                                "holding an audio tower); pass mmproj=")
    fam = _core.AudioEncoder.probe_family(mm)
    mods = _family_modules()
    if fam not in mods:
        raise UnsupportedModelError(f"{mm}: no transcription prompt for the audio tower family {fam!r} "
                                    f"(served: {', '.join(sorted(mods))}); chat with it instead")
    return mods[fam].Model(path, mm, n_threads, device, mode)


def load_asr_model(path: PathLike, n_threads: int = 0, device: Optional[str] = None,
                   mmproj: Optional[PathLike] = None, mode=None):
    """A whisper model from the GGUF ``dasllama convert`` writes (encoder, decoder, tokenizer),
    or from a CTranslate2 whisper directory or registry name (``whisper-tiny.en``), converted
    on first use into the cache (see :func:`resolve_asr_model`). ``device`` as for
    :func:`~dasllama.load_model` (the mel front end stays on the CPU).

    A decoder GGUF whose audio tower transcribes (Qwen3-ASR: llama.cpp's converter writes the
    decoder and, with ``--mmproj``, the tower) loads too: ``mmproj`` names the tower's file,
    else the ``*mmproj*.gguf`` holding an audio tower beside the decoder is used; ``mode`` is
    the decoder's :class:`~dasllama.QuantMode` (default q8, as :func:`~dasllama.load_model`;
    whisper files ignore it).

    A FastConformer CTC GGUF (Parakeet CTC, written by :func:`dasllama.convert_ctc.convert_hf_parakeet_ctc`
    or ``dasllama convert`` from a transformers ``ParakeetForCTC`` directory) loads as a CTC model."""
    from .llm import resolve_device

    p, dev = resolve_asr_model(path), resolve_device(device)
    if _core.ConformerCTC.probe(p):
        from .asr_ctc import CTCModel

        return CTCModel(p, int(n_threads), dev)
    fam = _load_family(p, mmproj, int(n_threads), dev, mode)
    return fam if fam is not None else ASRModel(p, int(n_threads), dev)


def _detect_language(model: ASRModel) -> Optional[str]:
    """The language whose token is likeliest after <|startoftranscript|> (the encoder set)."""
    if not model.multilingual or not model.languages:
        return None
    lg = model.decoder.forward(np.array([model.sot], np.int32), 0, False)[0]
    codes = list(model.languages)
    ids = np.array([model.languages[c] for c in codes])
    return codes[int(np.argmax(lg[ids]))]


def _split(model: ASRModel, toks: List[int], seek: int, size: int, timestamps: bool):
    """A window's segments and how many mel frames to advance, as whisper's transcribe cuts
    them (``seek``, ``size``: the window's first frame and its frames of audio): text between
    consecutive timestamp pairs; a window that ends in a single timestamp (or has no pair) is
    consumed whole, else the next window starts at the last timestamp."""
    tb, offset, dur = model.timestamp_begin, seek * FRAME, size * FRAME
    if not timestamps:
        text = model.decode(toks)
        return ([Segment(offset, offset + dur, text, list(toks))] if text.strip() else []), size, list(toks)
    is_ts = [t >= tb for t in toks]

    def at(t):
        return offset + (t - tb) * TIME_PRECISION

    def seg(start, end, part):
        text_ids = [t for t in part if t < tb]
        return Segment(start, end, model.decode(text_ids), text_ids)

    single_ending = len(toks) >= 2 and not is_ts[-2] and is_ts[-1]
    cuts = [i for i in range(1, len(toks)) if is_ts[i - 1] and is_ts[i]]  # inside each timestamp pair
    segs: List[Segment] = []
    if cuts:
        if single_ending:
            cuts.append(len(toks))
        last = 0
        for cur in cuts:
            part = toks[last:cur]
            segs.append(seg(at(part[0]), at(part[-1]), part))
            last = cur
        # Resume at the last timestamp pair: what follows it is decoded again in the next window.
        advance = size if single_ending else (toks[last - 1] - tb) * 2
        kept = list(toks) if single_ending else toks[:last]
        if advance <= 0:  # a window that would not move: consumed whole instead of looping
            advance = size
    else:
        ts = [t for t in toks if t >= tb]
        end = at(ts[-1]) if ts and ts[-1] != tb else offset + dur
        segs.append(seg(offset, end, toks))
        advance, kept = size, list(toks)
    return [s for s in segs if s.text.strip() and s.start != s.end], advance, kept


def _window_mel(mel: np.ndarray, seek: int, size: int) -> np.ndarray:
    """Frames [seek, seek + size) of the clip's features, zero-padded to a 30 s window (as
    whisper's transcribe pads them: zeros of the normalized log-mel, not the mel of silence)."""
    w = np.zeros((mel.shape[0], WINDOW_FRAMES), np.float32)
    w[:, :size] = mel[:, seek:seek + size]
    return w


def _encode_window(model: ASRModel, window: np.ndarray) -> np.ndarray:
    """Encoder rows of one window of features."""
    return encode_mel_window(model.encoder, window)


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: UTF-8 bytes over their zlib-compressed size."""
    b = text.encode("utf-8")
    return len(b) / len(zlib.compress(b)) if b else 0.0


@dataclass
class _Decoded:
    tokens: List[int]
    sum_logprob: float
    no_speech_prob: float
    temperature: float
    avg_logprob: float
    compression_ratio: float


def _temperatures(temperature) -> tuple:
    ts = (float(temperature),) if isinstance(temperature, (int, float)) else tuple(float(t) for t in temperature)
    if not ts or any(not (0.0 <= t <= 2.0) for t in ts):
        raise ValueError(f"temperature must be a number or a non-empty sequence of numbers in [0, 2], got {temperature!r}")
    return ts


def _decode_with_fallback(model: "ASRModel", prompt: List[int], sot_index: int, max_new: int, use_ts: bool,
                          temps: tuple, best_of: int, seed: int, window: int, compression_ratio_threshold,
                          logprob_threshold, no_speech_threshold) -> _Decoded:
    """One window, as faster-whisper's generate_with_fallback decodes it: each temperature in
    turn until the text neither compresses above the threshold nor averages a log-probability
    below it (or the window looks like silence); when every temperature fails, the result of
    the highest average log-probability, preferring those under the compression threshold.
    Temperature 0 is greedy; above it, ``best_of`` seeded samples of which the likeliest per
    token is kept."""
    def run(t: float, s: int):
        toks, slp, ns = model.decoder.greedy(
            prompt, model.suppress, model.begin_suppress, model.eot, max_new,
            no_timestamps=model.notimestamps, timestamp_begin=model.timestamp_begin if use_ts else 0,
            no_speech_id=model.no_speech, sot_index=sot_index, temperature=t, seed=s)
        return list(toks), float(slp), float(ns)

    results: List[_Decoded] = []
    under_cr: List[_Decoded] = []
    for ti, t in enumerate(temps):
        if t > 0:
            # A seed per (call, window, temperature, candidate): the same call gives the same text.
            cands = [run(t, (seed * 1000003 + window * 64 + ti * 8 + k) & 0xFFFFFFFFFFFFFFFF) for k in range(best_of)]
            toks, slp, ns = max(cands, key=lambda c: c[1] / max(len(c[0]), 1))
        else:
            toks, slp, ns = run(0.0, 0)
        avg = slp / (len(toks) + 1)
        r = _Decoded(toks, slp, ns, t, avg, compression_ratio(model.decode(toks).strip()))
        results.append(r)
        fallback = False
        if compression_ratio_threshold is not None:
            if r.compression_ratio > compression_ratio_threshold:
                fallback = True  # too repetitive
            else:
                under_cr.append(r)
        if logprob_threshold is not None and avg < logprob_threshold:
            fallback = True
        if (no_speech_threshold is not None and ns > no_speech_threshold and logprob_threshold is not None
                and avg < logprob_threshold):
            fallback = False  # silence: skipped by the caller, not retried
        if not fallback:
            return r
    best = max(under_cr or results, key=lambda r: r.avg_logprob)
    best.temperature = temps[-1]  # as faster-whisper reports it (it drives the prompt reset)
    return best


def transcribe(model: ASRModel, audio: AudioInput, language: Optional[str] = None, timestamps: bool = False, *,
               temperature: Union[float, Sequence[float]] = FALLBACK_TEMPERATURES,
               compression_ratio_threshold: Optional[float] = 2.4, logprob_threshold: Optional[float] = -1.0,
               no_speech_threshold: Optional[float] = 0.6, best_of: int = 5, seed: int = 0,
               condition_on_previous_text: bool = False, prompt_reset_on_temperature: float = 0.5,
               max_new_tokens: Optional[int] = None, progress: bool = False) -> Transcript:
    """The words spoken in ``audio`` (a float32 16 kHz mono array, a path, or an audio file's
    bytes). ``language`` (a code such as ``"en"``) is detected on multilingual models
    when None; English-only models take None or ``"en"``. ``timestamps`` applies whisper's
    timestamp rules and gives one segment per timestamped stretch (else one per window).
    Audio longer than 30 s is always decoded with timestamps, in 30 s windows that follow
    them (the next window starts at the last complete segment's end), as whisper does.

    Each window is decoded greedily at ``temperature[0]`` (0) and again at the next
    temperature while its text's :func:`compression_ratio` is above
    ``compression_ratio_threshold`` or its average log-probability below
    ``logprob_threshold`` (a single number: that temperature only; sampling draws ``best_of``
    candidates from generators seeded by ``seed``, so the same call gives the same text).
    A window is dropped as silence when its no-speech probability is above
    ``no_speech_threshold`` and its average log-probability not above ``logprob_threshold``.
    ``condition_on_previous_text`` puts the text kept so far (after <|startofprev|>, at most
    half the context, and forgotten after a window decoded above
    ``prompt_reset_on_temperature``) before each window's prompt, as whisper does by default
    (off here, as faster-whisper's users often set it: a greedy loop can repeat itself).
    ``max_new_tokens`` caps each window's tokens (default: half the decoder's context).
    ``progress`` shows a bar (seconds of audio, on stderr) on clips longer than one window.
    Thresholds of None turn their check off, as in whisper.

    A FastConformer CTC model (Parakeet CTC, see :mod:`dasllama.convert_ctc`) takes each 80 ms
    row's likeliest class, merges repeats and drops the blank (greedy CTC); it names no language
    and gives no times: one segment spanning the clip.

    A Qwen3-ASR model (see :func:`load_asr_model`) decodes the whole clip greedily in one turn;
    ``language`` (a code or a name) forces it, else the model names it; it gives no times, so
    the transcript is one segment spanning the clip; the whisper guards do not apply.
    """
    from . import asr_ctc

    fam = next((m for m in (*_family_modules().values(), asr_ctc) if isinstance(model, m.Model)), None)
    if not isinstance(model, ASRModel) and fam is None:
        raise TypeError("transcribe takes a model of load_asr_model")
    if fam is not None:
        x = load_audio(audio)
        if x.size == 0:
            raise ValueError("audio clip is empty")
        text, lang, toks = fam.transcribe(model, x, language, timestamps, max_new_tokens)
        return Transcript(text, [Segment(0.0, x.size / 16000, text, toks)] if text else [], lang)
    temps = _temperatures(temperature)
    if int(best_of) < 1:
        raise ValueError("best_of must be at least 1")
    x = load_audio(audio)
    if x.size == 0:
        raise ValueError("audio clip is empty")
    if not model.multilingual and language not in (None, "en"):
        raise ValueError(f"this model is English-only; got language {language!r}")
    if language is not None and model.multilingual and language not in model.languages:
        raise ValueError(f"unknown language {language!r}")
    if condition_on_previous_text and model.sot_prev < 0:
        raise ValueError("this model has no <|startofprev|> token to condition on previous text")
    limit = model.n_ctx // 2 if max_new_tokens is None else int(max_new_tokens)
    if limit <= 0:
        raise ValueError("max_new_tokens must be positive")
    use_ts = timestamps or x.size > WINDOW_SAMPLES
    # The whole clip's features, normalized over the clip, cut into windows of frames: as
    # whisper's and faster-whisper's transcribe feed the encoder.
    mel = _core.log_mel(x, model.encoder.n_mel)
    content = x.size // 160  # frames of audio
    bar = None
    if progress and x.size > WINDOW_SAMPLES:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(content * FRAME, 2), unit="s", desc="transcribe", leave=False)
    with model._lock:
        segs: List[Segment] = []
        lang = language
        seek = 0
        window = 0
        history: List[int] = []  # tokens kept since the last prompt reset (timestamps included)
        while seek < content:
            size = min(WINDOW_FRAMES, content - seek)
            model.decoder.set_encoder(_encode_window(model, _window_mel(mel, seek, size)))
            if model.multilingual and lang is None:
                lang = _detect_language(model)
            prompt = model.prompt(lang, use_ts)
            sot_index = 0
            if condition_on_previous_text and history:
                prev = [model.sot_prev] + history[-(model.n_ctx // 2 - 1):]
                prompt, sot_index = prev + prompt, len(prev)
            r = _decode_with_fallback(model, prompt, sot_index, min(limit, model.n_ctx - len(prompt)), use_ts,
                                      temps, int(best_of), int(seed), window, compression_ratio_threshold,
                                      logprob_threshold, no_speech_threshold)
            window += 1
            if (no_speech_threshold is not None and r.no_speech_prob > no_speech_threshold
                    and not (logprob_threshold is not None and r.avg_logprob > logprob_threshold)):
                advance = size
            else:
                found, advance, kept = _split(model, r.tokens, seek, size, use_ts)
                for sg in found:
                    sg.seek, sg.temperature, sg.avg_logprob = seek * FRAME, r.temperature, r.avg_logprob
                    sg.compression_ratio, sg.no_speech_prob = r.compression_ratio, r.no_speech_prob
                segs += found
                history = [] if r.temperature > prompt_reset_on_temperature else history + kept
            seek += advance
            if bar is not None:
                bar.update(round(advance * FRAME, 2))
    if bar is not None:
        bar.close()
    text = "".join(s.text for s in segs).strip()
    return Transcript(text, segs, lang if model.multilingual else "en", duration=x.size / 16000)


def _stamp(t: float, sep: str) -> str:
    ms = int(round(t * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def format_transcript(t: Transcript, fmt: str = "txt") -> str:
    """The transcript as plain text, SubRip (srt), WebVTT (vtt) or JSON."""
    if fmt == "txt":
        return t.text + "\n"
    if fmt == "srt":
        return "".join(f"{i}\n{_stamp(s.start, ',')} --> {_stamp(s.end, ',')}\n{s.text.strip()}\n\n"
                       for i, s in enumerate(t.segments, 1))
    if fmt == "vtt":
        return "WEBVTT\n\n" + "".join(f"{_stamp(s.start, '.')} --> {_stamp(s.end, '.')}\n{s.text.strip()}\n\n"
                                        for s in t.segments)
    if fmt == "json":
        import json

        return json.dumps({"text": t.text, "language": t.language,
                           "segments": [{"start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
                                         "tokens": s.tokens} for s in t.segments]}, ensure_ascii=False) + "\n"
    raise ValueError(f"unknown format {fmt!r}: txt, srt, vtt or json")


__all__ = ["ASRModel", "Segment", "Transcript", "compression_ratio", "format_transcript", "load_asr_model", "resolve_asr_model",
           "transcribe"]
