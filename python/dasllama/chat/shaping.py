"""A generated reply shaped for a client: reasoning apart from content, and tool calls parsed when tools
were offered, for a reply streamed piece by piece or given whole. No HTTP and no wire format: a server
frames what these return (server/responses.py); the formats themselves are reasoning.py's and tools.py's.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from .reasoning import think_feed, think_finish
from .tools import ToolReply
from .turns import ChatSession, make_think_stream, parse_calls, split_reasoning


def shape_reply(chat: Optional[ChatSession], text: str, tools: bool) -> ToolReply:
    """A complete reply as (reasoning, content, calls): calls parsed when ``tools`` were offered, otherwise
    only the reasoning split off. Without a chat (a plain completion) the text is all content."""
    if chat is None:
        return ToolReply("", text, [])
    if tools:
        return parse_calls(chat, text)
    tr = split_reasoning(chat, text)
    return ToolReply(tr.reasoning, tr.content, [])


class ReplyShaper:
    """Shapes a streamed reply of ``chat``'s next turn. ``feed`` gives each piece's (reasoning, content)
    deltas to send now; with ``tools`` the content is held to the end, since it may turn out to be a call,
    and ``finish`` gives it with the calls parsed from it."""

    def __init__(self, chat: ChatSession, tools: bool):
        self.chat, self.tools = chat, tools
        self._ts = make_think_stream(chat)
        self._held: List[str] = []

    def feed(self, piece: str) -> Tuple[str, str]:
        reasoning, content = think_feed(self._ts, piece)
        if content and self.tools:
            self._held.append(content)
            content = ""
        return reasoning, content

    def finish(self) -> ToolReply:
        """The rest: the last reasoning delta, the content not sent yet, and the calls (with tools)."""
        reasoning, content = think_finish(self._ts)
        if not self.tools:
            return ToolReply(reasoning, content, [])
        tr = parse_calls(self.chat, "".join(self._held) + content)
        return ToolReply(reasoning, tr.content, list(tr.calls))


__all__ = ["ReplyShaper", "shape_reply"]
