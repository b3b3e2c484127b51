"""OpenAI response bodies (no HTTP): completions and chat completions, their stream chunks, usage and tool
calls, as plain dicts from what the engine finished and the chat layer shaped."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..chat.tools import ToolCall, ToolReply
from .engine import Finish


@dataclass
class Reply:
    """What names one response: its id, kind ("chat" or "completion") and the served model's name."""

    id: str
    kind: str
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> "Reply":
        return cls(("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24], kind, model)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object(self) -> str:
        return self.object + ".chunk" if self.kind == "chat" else self.object


def usage(f: Finish) -> Dict[str, Any]:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


def tool_calls(calls: List[ToolCall]) -> List[Dict[str, Any]]:
    """Calls as OpenAI's tool_calls; a family without wire ids gets fresh ones."""
    return [{"id": tc.id or "call_" + uuid.uuid4().hex[:24], "type": "function",
             "function": {"name": tc.name, "arguments": tc.args}} for tc in calls]


def chunk(r: Reply, delta: Optional[Dict[str, Any]] = None, text: Optional[str] = None,
          finish: Optional[str] = None) -> Dict[str, Any]:
    """One stream chunk: a chat delta, or a completion's text."""
    ch = ({"index": 0, "delta": delta or {}, "finish_reason": finish} if r.kind == "chat"
          else {"index": 0, "text": text or "", "finish_reason": finish})
    return {"id": r.id, "object": r.chunk_object, "created": int(time.time()), "model": r.model, "choices": [ch]}


def usage_chunk(r: Reply, f: Finish) -> Dict[str, Any]:
    """The stream's last chunk when the client asked for usage (stream_options.include_usage)."""
    return {"id": r.id, "object": r.chunk_object, "created": int(time.time()), "model": r.model, "choices": [],
            "usage": usage(f)}


def completion(r: Reply, text: str, shaped: Optional[ToolReply], f: Finish) -> Dict[str, Any]:
    """The whole response of a request that did not stream; ``shaped``: a chat reply's parts."""
    if r.kind == "chat":
        msg: Dict[str, Any] = {"role": "assistant", "content": shaped.content}
        if shaped.reasoning:
            msg["reasoning_content"] = shaped.reasoning
        calls = tool_calls(shaped.calls)
        if calls:
            msg["tool_calls"] = calls
        choice = {"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else f.reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": f.reason, "logprobs": None}
    return {"id": r.id, "object": r.object, "created": int(time.time()), "model": r.model,
            "choices": [choice], "usage": usage(f)}
