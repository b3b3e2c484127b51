"""Chat templates: the GGUF's Jinja template run in jinja2's immutable sandbox, and family defaults.

Holds rendering only (messages -> text, the close of a turn included); the template and bos / eos texts
come from the loaded model (Model.chat_meta). Turns, tokens and the KV live in turns.py.
"""
from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Any, Dict, List, Optional

from .._core import DasllamaError


class TemplateError(DasllamaError):
    """A chat template that fails to render (its own message, or a sandbox refusal)."""


# A template gets this long to render before it counts as looping; chat templates take milliseconds.
RENDER_BUDGET_S = 2.0
# Strings and lists a template builds with * or ** are capped (an allocation bomb is no loop).
MAX_BUILT = 1 << 20


def _raise(msg: str):
    raise TemplateError(msg)


def _tojson(v, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping, unicode kept.
    return json.dumps(v, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


_ENV = None


def _generation_tag():
    """{% generation %}...{% endgeneration %}: transformers marks assistant spans with it (for training masks);
    rendering just writes the body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


def _env():
    global _ENV
    if _ENV is not None:
        return _ENV
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and right > 64:
                raise TemplateError("chat template: exponent too large")
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > MAX_BUILT:
                        raise TemplateError("chat template: builds a sequence over 1 MiB")
            return super().call_binop(context, operator, left, right)

    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_tag()])
    # The helpers the HF ecosystem gives templates.
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    _ENV = env
    return env


class _Deadline:
    """Stops a template that runs past RENDER_BUDGET_S: line events in compiled template code check the clock.

    Only frames of template code are traced (their file is "<template>"), so library code runs untraced;
    a tracer already installed (a debugger, coverage) keeps seeing every other frame.
    """

    def __init__(self, budget: float):
        self.end = time.monotonic() + budget
        self.n = 0

    def _local(self, frame, event, arg):
        self.n += 1
        if (self.n & 255) == 0 and time.monotonic() > self.end:
            raise TemplateError(f"chat template ran past {RENDER_BUDGET_S:.0f} s (a runaway loop?)")
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return self._local
        return self.old(frame, event, arg) if self.old is not None else None

    def __enter__(self):
        self.old = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.old)
        return False


def compile_template(template: str):
    """The compiled template; a syntax error is a TemplateError."""
    import jinja2

    try:
        return _env().from_string(template)
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e


def render_messages(template: Any, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                    bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render ``messages`` with ``template`` (source text or compiled); raises :class:`TemplateError` on any failure."""
    tpl = compile_template(template) if isinstance(template, str) else template
    try:
        with _Deadline(RENDER_BUDGET_S):
            return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                              eos_token=eos_token, **kwargs)
    except TemplateError:
        raise
    except RecursionError as e:
        raise TemplateError("chat template recursed too deep") from e
    except MemoryError as e:
        raise TemplateError("chat template ran out of memory") from e
    except Exception as e:  # noqa: BLE001 - whatever a hostile template raises, the chat stays usable
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


# -- family defaults ---------------------------------------------------------------------------------------
# A model whose GGUF has no tokenizer.chat_template gets its family's published turn format:
#   gemma, gemma2, gemma3      Gemma turns (<start_of_turn>user / model, <end_of_turn>); no system role: the
#                              system prompt is folded into the first user turn, as Google's template does
#   phi3                       Phi-3 turns (<|system|> / <|user|> / <|assistant|>, <|end|>)
#   everything else            ChatML (<|im_start|>role ... <|im_end|>), the Qwen / SmolLM turn format

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

FAMILY_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE,
                    "phi3": PHI3_TEMPLATE}


def default_template(arch: str) -> str:
    """The family default for a model whose file carries no chat template (see the table above)."""
    return FAMILY_TEMPLATES.get(arch, CHATML_TEMPLATE)


def model_template(model) -> str:
    """The model's template: the GGUF's tokenizer.chat_template, else its family default."""
    return model.chat_meta["template"] or default_template(model.arch)


def render_prompt(model, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                  template: Optional[str] = None, **kwargs: Any) -> str:
    """The model's own template (or its family default, or ``template``) applied to ``messages``."""
    m = model.chat_meta
    return render_messages(template or model_template(model), messages, add_generation_prompt,
                           bos_token=m["bos"], eos_token=m["eos"], **kwargs)


# An assistant reply's stand-in: what the template writes after it is the text that closes a turn.
REPLY_SENTINEL = "\u2063dasllama-reply\u2063"


def close_text(template: Any, messages: List[Dict[str, Any]], bos_token: str = "", eos_token: str = "",
               **kwargs: Any) -> str:
    """The text that terminates an assistant turn: ``messages`` end with an assistant turn whose content
    is :data:`REPLY_SENTINEL`; returns what the template writes after it ("" when it drops the reply)."""
    text = render_messages(template, messages, False, bos_token=bos_token, eos_token=eos_token, **kwargs)
    i = text.rfind(REPLY_SENTINEL)
    return text[i + len(REPLY_SENTINEL):] if i >= 0 else ""
