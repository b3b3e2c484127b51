"""Server-sent events: a job's events (text pieces, then done or an error) framed as OpenAI's stream
(``data: {json}`` lines, ``data: [DONE]`` last). The pieces are shaped by the chat layer's ReplyShaper."""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Dict, Optional

from starlette.responses import StreamingResponse

from ..chat.shaping import ReplyShaper
from . import responses
from .engine import Job
from .responses import Reply

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


def frame(body: Dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def events(r: Reply, q: asyncio.Queue, job: Job, shaper: Optional[ReplyShaper],
                 include_usage: bool) -> AsyncIterator[str]:
    """The frames of one job: queue items are ("text", piece), ("done", Finish) or ("error", APIError).
    A client that goes away (the generator closed) cancels the job: its stream is freed at the next step."""
    chat = r.kind == "chat"

    def delta(**d: Any) -> str:
        return frame(responses.chunk(r, d))

    try:
        if chat:
            yield delta(role="assistant", content="")
        while True:
            ev, payload = await q.get()
            if ev == "text":
                if not chat:
                    yield frame(responses.chunk(r, text=payload))
                    continue
                rs, ct = shaper.feed(payload)
                if rs:
                    yield delta(reasoning_content=rs)
                if ct:
                    yield delta(content=ct)
            elif ev == "done":
                reason = payload.reason
                if chat:
                    rest = shaper.finish()
                    if rest.reasoning:
                        yield delta(reasoning_content=rest.reasoning)
                    if rest.content:
                        yield delta(content=rest.content)
                    if rest.calls:
                        calls = responses.tool_calls(rest.calls)
                        yield delta(tool_calls=[dict(tc, index=i) for i, tc in enumerate(calls)])
                        reason = "tool_calls"
                yield frame(responses.chunk(r, {}, None, reason))
                if include_usage:
                    yield frame(responses.usage_chunk(r, payload))
                break
            else:
                yield frame(payload.body())
                break
        yield DONE
    finally:
        job.cancel()


def response(frames: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers=HEADERS)
