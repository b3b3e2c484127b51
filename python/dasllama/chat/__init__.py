"""The chat layer: templates, turns, reasoning and tool calls (reference §17.1.10-17.1.12).

Layers one way: template.py (rendering) <- reasoning.py, tools.py (pure formats) <- turns.py (the state)
<- shaping.py (a reply shaped for a client: reasoning, content, calls); media.py (spans, the tower-output
cache) serves turns.py."""
from .reasoning import ThinkSplit, ThinkStream, think_drain, think_feed, think_finish
from .template import TemplateError, default_template, render_messages, render_prompt
from .tools import ToolCall, ToolReply
from .media import audio_cache_stats, audio_span_bare, media_cache_stats
from .turns import (ChatSession, LlmCaps, add_assistant, add_assistant_calls, add_tool_results, add_user,
                    add_user_audio, add_user_audio_rows, add_user_image, add_user_span, caps, create_chat, create_chat_renderer,
                    effective_stop_ids, load_transcript, make_think_stream, parse_calls, prefill_media_body,
                    prompt_ids, render_assistant, render_assistant_calls, render_close, render_turn,
                    render_turn_audio, render_turn_image, reset, respond, save_transcript, set_thinking, set_tools, split_reasoning,
                    stream_respond)
from .shaping import ReplyShaper, shape_reply

__all__ = [
    "add_user_audio", "add_user_audio_rows", "add_user_span", "audio_cache_stats", "audio_span_bare",
    "render_turn_audio", "prefill_media_body", "add_user_image", "render_turn_image", "media_cache_stats",
    "ChatSession", "LlmCaps", "TemplateError", "ThinkSplit", "ThinkStream", "ToolCall", "ToolReply",
    "add_assistant", "add_assistant_calls", "add_tool_results", "add_user", "caps", "create_chat",
    "create_chat_renderer", "default_template", "effective_stop_ids", "load_transcript", "make_think_stream",
    "parse_calls", "prompt_ids", "render_assistant", "render_assistant_calls", "render_close", "render_messages",
    "render_prompt", "render_turn", "reset", "respond", "save_transcript", "set_thinking", "set_tools",
    "split_reasoning", "stream_respond", "think_drain", "think_feed", "think_finish",
    "ReplyShaper", "shape_reply",
]
