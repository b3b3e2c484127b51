"""OpenAI chat messages to the chat layer's renderers: one per request, over the server's model, template
and audio / vision towers (no HTTP: a bad message is an APIError for the app to answer)."""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, Optional

from .. import chat, llm
from .protocol import GenRequest, Limits, bad


class Chats:
    """Per-request chat renderers over one model: the chat layer's template (the GGUF's, else the family
    default), system folding, thinking switch, stop ids, reasoning splitter and tool-call parser."""

    def __init__(self, model: llm.Model, template: Optional[str], tower=None, limits: Optional[Limits] = None,
                 vision=None):
        self.model, self.template, self.tower, self.limits = model, template, tower, limits or Limits()
        self.vision = vision
        self.base = chat.create_chat_renderer(model)
        if template:
            self.base.template = template
        chat.effective_stop_ids(self.base)  # derive once; copies share the compiled template

    def _options(self, c, r: GenRequest):
        c.tools = list(r.tools or [])
        kw = dict(r.template_kwargs)
        kw.pop("enable_thinking", None)
        c.template_kwargs = kw
        if r.enable_thinking is not None:
            c.thinking = r.enable_thinking

    def build(self, r: GenRequest):
        msgs = [template_message(m) for m in r.messages]
        if msgs[-1]["role"] not in ("user", "tool"):
            raise bad("the last message must be from the user or a tool", "messages")
        if r.audio or r.images:
            return self._build_audio(r, msgs)
        c = copy.copy(self.base)
        c.history, c.pending, c.rendered = msgs[:-1], msgs[-1:], []
        self._options(c, r)
        return c

    def _build_audio(self, r: GenRequest, msgs):
        """A renderer with the towers: the history replayed turn by turn, each clip and image a content-keyed
        span, so media the prefix cache or the tower-output cache already holds cost no encode and no prefill."""
        from ..audio_io import SAMPLE_RATE, load_audio
        from ..vision import ImageError, load_image_rgb

        if r.audio and self.tower is None:
            raise bad("this server has no audio tower: start it with --mmproj to send input_audio", "messages")
        if r.images and self.vision is None:
            raise bad("this server has no vision tower: start it with a vision --mmproj to send image_url",
                      "messages")
        system = ""
        while msgs and msgs[0]["role"] == "system":
            system += ("\n\n" if system else "") + msgs.pop(0)["content"]
        if not msgs:
            raise bad("no user message", "messages")
        c = chat.create_chat_renderer(self.model, system=system, tower=self.tower)
        c.vision = self.vision
        if self.template:
            c.template = self.template
        self._options(c, r)
        seconds = 0.0
        fetched = sum(len(p.data) for p in list(r.images) + list(r.audio))  # the request's inline media
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user":
                for a in m.get("_audio", []):
                    try:
                        x = load_audio(a.data)
                    except (ValueError, TypeError) as e:
                        raise bad(f"input_audio ({a.format}): {e}", "messages") from None
                    seconds += len(x) / SAMPLE_RATE
                    if seconds > self.limits.max_audio_seconds:
                        raise bad(f"the request's audio is over {self.limits.max_audio_seconds:g} s", "messages")
                    try:
                        chat.add_user_audio(c, x)
                    except ValueError as e:
                        raise bad(f"input_audio: {e}", "messages") from None
                for im in m.get("_images", []):
                    if im.url:  # a remote image (allow_remote_media): its bytes join the request's media budget
                        from .remote import fetch_image

                        im.data = fetch_image(im.url, self.limits, self.limits.max_media_bytes - fetched)
                        fetched += len(im.data)
                    try:
                        img = load_image_rgb(im.data, max_pixels=self.limits.max_image_pixels)
                        chat.add_user_image(c, img)
                    except ImageError as e:
                        raise bad(f"image_url: {e}", "messages") from None
                chat.add_user(c, m["content"])
            elif role == "assistant":
                if i == len(msgs) - 1 or not c.pending:
                    raise bad("an assistant message must follow a user turn", "messages")
                chat.render_assistant(self.model, c, m["content"])
            else:
                raise bad(f"role {role!r} is not supported in a conversation with audio or images", "messages")
        return c


def template_message(m: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI's assistant tool_calls carry arguments as JSON text; chat templates expect a mapping."""
    if "tool_calls" not in m:
        return m
    m = dict(m)
    calls = []
    for tc in m["tool_calls"]:
        fn = tc.get("function") if isinstance(tc.get("function"), dict) else tc
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        call = {"type": "function", "function": {"name": str(fn.get("name", "")), "arguments": args}}
        if tc.get("id"):
            call["id"] = tc["id"]
        calls.append(call)
    m["tool_calls"] = calls
    return m
