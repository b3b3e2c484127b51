"""Reasoning (reference §17.1.12): the thinking toggle, stop ids, and the reasoning/content splitter.

Pure formats over a template, the vocabulary and text: no chat state (turns.py holds that).
Three reply formats: the <think>...</think> pair (Qwen3, DeepSeek-R1 distills), gpt-oss Harmony
channels (analysis = reasoning, final / commentary = content), and the <|channel>thought ... <channel|>
span (Gemma-4, "channel"). The splitter is one marker machine
for both; it holds back a possible partial marker at the end of each piece, so any chunking of a
reply splits the same way. Tool-call formats live in tools.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .. import llm

REASONING, CONTENT, DROP = "reasoning", "content", None

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # the "answer directly" form Qwen3's template writes

# marker -> the state it switches to (DROP: removed, state unchanged)
_THINK_MARKERS: Dict[str, Optional[str]] = {THINK_OPEN: REASONING, THINK_CLOSE: CONTENT}
_HARMONY_MARKERS: Dict[str, Optional[str]] = {
    "<|channel|>analysis<|message|>": REASONING,
    "<|channel|>final<|message|>": CONTENT,
    "<|channel|>commentary<|message|>": CONTENT,
    "<|start|>assistant": DROP, "<|end|>": DROP, "<|return|>": DROP, "<|call|>": DROP,
}

# <|channel>thought\n ... <channel|>: the reasoning span; what follows the close is the answer.
_CHANNEL_MARKERS: Dict[str, Optional[str]] = {"<|channel>thought": REASONING, "<channel|>": CONTENT}


def _markers(fmt: Optional[str]) -> Dict[str, Optional[str]]:
    return dict(_CHANNEL_MARKERS if fmt == "channel" else _THINK_MARKERS)


@dataclass
class ThinkSplit:
    """One reply split at its reasoning boundary: ``reasoning`` (empty when none) and ``content``."""

    reasoning: str = ""
    content: str = ""


@dataclass
class ThinkStream:
    """The incremental splitter of one streamed reply (make_think_stream); pass-through when not armed."""

    markers: Dict[str, Optional[str]] = field(default_factory=dict)
    state: str = CONTENT
    buf: str = ""
    consumed: bool = False  # a reasoning span was seen: the drained halves are stripped

    def __post_init__(self):
        if self.state == REASONING:
            self.consumed = True


def think_format(model, template: str) -> Optional[str]:
    """'harmony', 'channel', 'think' or None: which reasoning format the template / vocabulary speaks."""
    if "<|channel|>" in template:
        return "harmony"
    if "<|channel>" in template:
        return "channel"
    if THINK_OPEN in template or THINK_CLOSE in template:
        return "think"
    if model is not None and len(llm.encode(model, THINK_CLOSE, add_special=False, parse_special=True)) == 1:
        return "think"
    return None


def gen_suffix(fmt: Optional[str], thinking: bool, template: str, text: str) -> str:
    """What we add after the template's generation prompt ``text``: the empty think block when thinking is
    off and the template has no enable_thinking switch of its own."""
    if thinking or fmt != "think" or "enable_thinking" in template:
        return ""
    if text.rstrip().endswith(THINK_OPEN):  # an R1-style prompt that opens the think block itself
        return "\n</think>\n\n"
    return EMPTY_THINK


def stop_words(fmt: Optional[str], close: str) -> List[str]:
    """The texts generation must stop at: Harmony's turn ends, and the template's close text."""
    words = ["<|return|>", "<|call|>"] if fmt == "harmony" else []
    if close.strip():
        words.append(close.strip())
    return words


def stop_tokens(fmt: Optional[str]) -> List[str]:
    """Texts that stop generation when the vocabulary has them as one token, visible or not: Gemma-4's
    model turn pauses at <|tool_response> after a call (the converter keeps it visible, so it is no
    control token llama.cpp-style end-of-generation would catch)."""
    return ["<|tool_response>"] if fmt == "channel" else []


def think_stream(fmt: Optional[str], thinking: bool, prompt: str) -> ThinkStream:
    """The splitter for a reply to ``prompt`` (the rendered generation prompt): armed only when the turn
    thinks, else a pass-through stream."""
    if fmt == "harmony":
        return ThinkStream(markers=dict(_HARMONY_MARKERS), state=CONTENT)
    if fmt == "channel":  # armed either way: with thinking off the prompt closes an empty span, a reply may still open one
        return ThinkStream(markers=_markers(fmt), state=CONTENT)
    if fmt is None or not thinking:
        return ThinkStream()  # thinking off: the empty think block is in the prompt, the reply is content
    # An R1-style generation prompt opens <think> itself: the reply starts inside the reasoning.
    return ThinkStream(markers=dict(_THINK_MARKERS),
                       state=REASONING if prompt.rstrip().endswith(THINK_OPEN) else CONTENT)


def _step(ts: ThinkStream, final: bool) -> Tuple[str, str]:
    out = {REASONING: [], CONTENT: []}
    buf = ts.buf
    firsts = {m[0] for m in ts.markers}
    i = 0
    start = 0
    while i < len(buf):
        if buf[i] in firsts:
            rest = buf[i:]
            hit = next((m for m in ts.markers if rest.startswith(m)), None)
            if hit is not None:
                out[ts.state].append(buf[start:i])
                nxt = ts.markers[hit]
                if nxt is not None:
                    ts.state = nxt
                    if nxt == REASONING:
                        ts.consumed = True
                i += len(hit)
                start = i
                continue
            if not final and any(m.startswith(rest) for m in ts.markers):
                break  # a marker may be completing in the next piece: hold from here
        i += 1
    out[ts.state].append(buf[start:i])
    ts.buf = buf[i:]
    if final and ts.buf:
        out[ts.state].append(ts.buf)
        ts.buf = ""
    return "".join(out[REASONING]), "".join(out[CONTENT])


def think_feed(ts: ThinkStream, piece: str) -> Tuple[str, str]:
    """Feed one streamed piece; returns this piece's (reasoning, content) deltas (either may be empty while a
    partial marker is held). The reference's out-strings are the returned pair."""
    if not ts.markers:
        return "", piece
    ts.buf += piece
    return _step(ts, False)


def think_finish(ts: ThinkStream) -> Tuple[str, str]:
    """Flush at end of generation: the held tail; an unclosed reasoning span stays reasoning."""
    if not ts.markers:
        return "", ""
    return _step(ts, True)


def _strip(ts: ThinkStream, reasoning: str, content: str) -> ThinkSplit:
    if ts.consumed:
        return ThinkSplit(reasoning.strip(), content.strip())
    return ThinkSplit(reasoning, content)


def think_drain(ts: ThinkStream, full: str) -> ThinkSplit:
    """A complete reply through the splitter in one call: feed + finish + the strip rule."""
    r1, c1 = think_feed(ts, full)
    r2, c2 = think_finish(ts)
    return _strip(ts, r1 + r2, c1 + c2)


def split_text(fmt: Optional[str], ts: ThinkStream, reply: str) -> ThinkSplit:
    """Split a complete reply at its reasoning boundary with ``ts`` (see :func:`think_stream`); both halves
    are stripped when a reasoning span is found, a reply without one passes through untouched."""
    if fmt is None:
        return ThinkSplit("", reply)
    if not ts.markers:  # thinking off: still split a reply that thinks anyway
        ts = ThinkStream(markers=_markers(fmt))
    return think_drain(ts, reply)
