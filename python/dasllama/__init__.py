"""dasllama: local LLM inference that hears and remembers.

The public API lives here in one place; submodules hold the parts
(``dasllama.gguf``, ``dasllama.hub``, ``dasllama.cli``).
"""
from __future__ import annotations

from . import _core
from ._cuda_libs import point_at_cublas as _point_at_cublas
from . import gguf
from ._core import (
    ContextOverflowError,
    DasllamaError,
    DeviceError,
    GGUFError,
    PoolExhaustedError,
    UnsupportedModelError,
)
from . import quant
from ._system import get_isa, set_isa, system_info
from . import hub
from .llm import (
    BatchWorkspace,
    KVDtype,
    Model,
    ModelConfig,
    QuantMode,
    SamplingParams,
    Session,
    Stats,
    create_batch_workspace,
    create_session,
    decode,
    embed,
    encode,
    eval,
    eval_batch,
    eval_embd,
    eval_embd_body,
    eval_embd_span,
    eval_embd_span_mrope,
    embed_text_rows,
    generate,
    generate_embd,
    media_body_rows,
    load_model,
    piece,
    sample,
    set_seed,
    stats,
    stream_generate,
)
from .memory import MemoryEstimate, estimate_memory
from .kv import (
    KVPool,
    PoolStats,
    PrefixCache,
    PrefixChain,
    create_kv_pool,
    create_prefix_cache,
    is_media_position,
    media_ids,
    prefix_attach,
    prefix_chain_list,
    prefix_held_groups,
    prefix_insert,
    prefix_release,
    release_kv_pages,
)

# The media towers, ASR and the chat layer load on first use (PEP 562): a program that only
# generates text does not pay their modules' (and their imports') memory.
_LAZY = {
    "audio": (
        "AudioEmbedder", "AudioState", "AudioTower", "audio_probe_proj_dim", "audio_tower_probe_proj_dim",
        "encode_audio", "encode_audio_rows", "load_audio_embedder", "load_audio_tower", "log_mel"
    ),
    "audio_io": (
        "load_audio",
    ),
    "vision": (
        "ImageError", "VisionEmbedder", "VisionImage", "VisionState", "encode_image", "encode_image_rows",
        "load_image_rgb", "load_vision_embedder", "vision_probe_family"
    ),
    "chat": (
        "ChatSession", "LlmCaps", "TemplateError", "ThinkSplit", "ThinkStream", "ToolCall", "ToolReply",
        "add_assistant", "add_assistant_calls", "add_tool_results", "add_user", "add_user_audio",
        "add_user_audio_rows", "add_user_image", "add_user_span", "audio_cache_stats", "media_cache_stats",
        "audio_span_bare", "caps", "create_chat", "create_chat_renderer", "default_template",
        "effective_stop_ids", "load_transcript", "make_think_stream", "parse_calls", "render_assistant",
        "render_assistant_calls", "render_close", "render_messages", "render_prompt", "render_turn",
        "render_turn_audio", "render_turn_image", "prefill_media_body", "reset", "respond", "save_transcript",
        "set_thinking", "set_tools", "split_reasoning", "stream_respond", "think_drain", "think_feed",
        "think_finish"
    ),
    "asr": (
        "ASRModel", "Segment", "Transcript", "format_transcript", "load_asr_model", "resolve_asr_model",
        "transcribe"
    ),
}
_LAZY_NAMES = {n: m for m, ns in _LAZY.items() for n in ns}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:  # the submodule itself (dasllama.chat)
        return importlib.import_module(f".{name}", __name__)
    mod = _LAZY_NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_NAMES) | set(_LAZY))


from ._version import __version__

__all__ = [
    "ASRModel", "Segment", "Transcript", "format_transcript", "load_asr_model", "resolve_asr_model", "transcribe",
    "KVDtype", "Model", "ModelConfig", "QuantMode", "SamplingParams", "Session", "Stats",
    "BatchWorkspace", "create_batch_workspace", "eval_batch", "create_session", "decode", "embed", "encode", "eval", "eval_embd", "generate", "load_model",
    "piece", "sample", "set_seed", "stats", "stream_generate",
    "AudioEmbedder", "AudioState", "AudioTower", "audio_probe_proj_dim", "audio_tower_probe_proj_dim",
    "encode_audio", "encode_audio_rows", "load_audio_embedder", "load_audio_tower", "log_mel", "load_audio",
    "embed_text_rows", "eval_embd_body", "eval_embd_span", "eval_embd_span_mrope", "generate_embd", "media_body_rows",
    "ImageError", "VisionEmbedder", "VisionImage", "VisionState", "encode_image", "encode_image_rows",
    "load_image_rgb", "load_vision_embedder", "vision_probe_family",
    "add_user_image", "render_turn_image", "media_cache_stats",
    "add_user_audio", "add_user_audio_rows", "add_user_span", "audio_cache_stats", "audio_span_bare",
    "render_turn_audio", "prefill_media_body",
    "chat", "ChatSession", "LlmCaps", "TemplateError", "ThinkSplit", "ThinkStream", "ToolCall", "ToolReply",
    "add_assistant", "add_assistant_calls", "add_tool_results", "add_user", "caps", "create_chat",
    "create_chat_renderer", "default_template", "effective_stop_ids", "load_transcript", "make_think_stream", "parse_calls",
    "render_assistant", "render_assistant_calls", "render_close", "render_messages", "render_prompt", "render_turn", "reset", "respond",
    "save_transcript", "set_thinking", "set_tools", "split_reasoning", "stream_respond", "think_drain",
    "think_feed", "think_finish",
    "KVPool", "PoolStats", "PrefixCache", "PrefixChain", "create_kv_pool", "create_prefix_cache",
    "is_media_position", "media_ids", "prefix_attach", "prefix_chain_list", "prefix_held_groups",
    "prefix_insert", "prefix_release", "release_kv_pages",
    "ContextOverflowError",
    "DasllamaError",
    "DeviceError",
    "MemoryEstimate",
    "estimate_memory",
    "GGUFError",
    "PoolExhaustedError",
    "UnsupportedModelError",
    "get_isa",
    "quant",
    "set_isa",
    "system_info",
    "__version__",
]

_point_at_cublas()
