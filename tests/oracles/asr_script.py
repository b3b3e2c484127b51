"""The speech the ASR tests and benchmarks/bench_asr.py transcribe (spoken by eSpeak NG, speech.py),
and the word error rate against its script.

Sentences are distinct (a repeated sentence compresses well, which trips whisper's
compression-ratio fallback on purpose) and free of numerals (no number normalizer needed).
"""
from __future__ import annotations

import re
from typing import List

import numpy as np

from speech import speak

SENTENCES = [
    "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country.",
    "We choose to go to the moon in this decade, not because it is easy, but because it is hard.",
    "A gentle breeze carried the smell of fresh bread through the open kitchen window.",
    "Please remember to bring your umbrella, because the forecast says it will rain all afternoon.",
    "The library closes early on holidays, so return your books before the weekend.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Our train was delayed by heavy snow, and we arrived in the city long after midnight.",
    "Good morning everyone, today we will talk about how computers understand human speech.",
]


def long_clip(sentences=SENTENCES, pause_s: float = 0.6) -> np.ndarray:
    """The sentences one after another with a pause after each: about 41 s."""
    pause = np.zeros(int(pause_s * 16000), np.float32)
    return np.concatenate([np.concatenate([speak(s), pause]) for s in sentences])


def words(text: str) -> List[str]:
    """Lower-case words without punctuation (apostrophes kept)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def wer(hypothesis: str, reference: str) -> float:
    """Word error rate: (substitutions + deletions + insertions) / reference words, by edit distance."""
    h, r = words(hypothesis), words(reference)
    if not r:
        return float(len(h) > 0)
    prev = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        cur = [i] + [0] * len(h)
        for j, hw in enumerate(h, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (rw != hw))
        prev = cur
    return prev[-1] / len(r)
