"""Chat templates: the GGUF's Jinja template run in jinja2's immutable sandbox."""
from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Optional

from .._core import DasllamaError


class TemplateError(DasllamaError):
    """A chat template that fails to render (its own message, or a sandbox refusal)."""


def _raise(msg: str):
    raise TemplateError(msg)


def _env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # The helpers the HF ecosystem gives templates.
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda v, indent=None, **kw: json.dumps(v, indent=indent, ensure_ascii=False)
    return env


def render_messages(template: str, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                    bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render ``messages`` with ``template``; raises :class:`TemplateError` on any failure."""
    import jinja2

    try:
        tpl = _env().from_string(template)
        return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                          eos_token=eos_token, **kwargs)
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def render_prompt(model, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                  template: Optional[str] = None, **kwargs: Any) -> str:
    """The model's own template (``tokenizer.chat_template``) applied to ``messages``."""
    from ..gguf import GGUFFile

    meta = GGUFFile(model.path).metadata
    tpl = template or meta.get("tokenizer.chat_template")
    if not tpl:
        raise TemplateError("the model has no chat template (tokenizer.chat_template); pass one")
    toks = meta.get("tokenizer.ggml.tokens", [])

    def tok(key: str) -> str:
        i = meta.get(key)
        return toks[i] if isinstance(i, int) and 0 <= i < len(toks) else ""

    return render_messages(tpl, messages, add_generation_prompt, bos_token=tok("tokenizer.ggml.bos_token_id"),
                           eos_token=tok("tokenizer.ggml.eos_token_id"), **kwargs)
