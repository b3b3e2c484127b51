"""dasllama: local LLM inference that hears and remembers.

The public API lives here in one place; submodules hold the parts
(``dasllama.gguf``, ``dasllama.hub``, ``dasllama.cli``).
"""
from __future__ import annotations

from . import _core
from . import gguf
from ._core import (
    ContextOverflowError,
    DasllamaError,
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
    generate,
    load_model,
    piece,
    sample,
    set_seed,
    stats,
    stream_generate,
)
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

__version__ = "0.1.0"

__all__ = [
    "KVDtype", "Model", "ModelConfig", "QuantMode", "SamplingParams", "Session", "Stats",
    "BatchWorkspace", "create_batch_workspace", "eval_batch", "create_session", "decode", "embed", "encode", "eval", "eval_embd", "generate", "load_model",
    "piece", "sample", "set_seed", "stats", "stream_generate",
    "KVPool", "PoolStats", "PrefixCache", "PrefixChain", "create_kv_pool", "create_prefix_cache",
    "is_media_position", "media_ids", "prefix_attach", "prefix_chain_list", "prefix_held_groups",
    "prefix_insert", "prefix_release", "release_kv_pages",
    "ContextOverflowError",
    "DasllamaError",
    "GGUFError",
    "PoolExhaustedError",
    "UnsupportedModelError",
    "get_isa",
    "quant",
    "set_isa",
    "system_info",
    "__version__",
]
