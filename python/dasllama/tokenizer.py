"""Building the C++ tokenizer (``_core.Tokenizer``) from a GGUF's metadata as a dict of Python values."""
from __future__ import annotations

from typing import Any, Mapping

from . import _core

__all__ = ["Tokenizer", "Detokenizer", "tokenizer_from_gguf_metadata"]

Tokenizer = _core.Tokenizer
Detokenizer = _core.Detokenizer


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any]) -> _core.Tokenizer:
    """The tokenizer a GGUF describes, from its metadata (key -> str, int, float, bool or list).

    The policy follows llama.cpp and transformers: a SentencePiece ("llama") vocabulary adds BOS
    and a space prefix unless the file says otherwise; Gemma files rank merges by token order.
    """
    def get(key, default=None):
        v = metadata.get("tokenizer.ggml." + key)
        return default if v is None else v

    model = get("model")
    if model is None:
        raise _core.UnsupportedModelError("GGUF has no tokenizer (tokenizer.ggml.model missing)")
    spm = model == "llama"
    arch = str(metadata.get("general.architecture", ""))
    return _core.Tokenizer(
        tokens=list(get("tokens", [])),
        scores=[float(x) for x in get("scores", [])],
        types=[int(x) for x in get("token_type", [])],
        merges=list(get("merges", [])),
        model=str(model),
        pre=str(get("pre", "default")),
        bos=int(get("bos_token_id", -1)),
        eos=int(get("eos_token_id", -1)),
        unk=int(get("unknown_token_id", -1)),
        pad=int(get("padding_token_id", -1)),
        add_bos=bool(get("add_bos_token", spm)),
        add_eos=bool(get("add_eos_token", False)),
        add_space_prefix=bool(get("add_space_prefix", spm)),
        gemma_style=spm and arch.startswith("gemma"),
    )
