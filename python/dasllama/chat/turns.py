"""Chat turns (reference §17.1.10): ChatSession, create_chat, add_user, respond, render_* and caps.

The KV is kept in step with the transcript by diffing token ids: every turn renders the whole
conversation, tokenizes it, keeps the longest prefix the session already holds and prefills only
the rest. A template that rewrites earlier turns therefore costs a re-prefill from the first
differing token, and the cache never answers for a prompt it does not hold.
Thinking and tool calls live in reasoning.py and tools.py; this file knows their wire formats not.
"""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

from .. import llm
from ..llm import KVDtype, Model, SamplingParams, Session
from .template import TemplateError, _meta, compile_template, model_template, render_messages

_SENTINEL = "\u2063dasllama-reply\u2063"


@dataclass
class LlmCaps:
    """What the model supports at the chat layer: system_prompt is False where the system prompt is folded
    into the first user turn (gemma); tools / thinking where the template speaks those formats."""

    system_prompt: bool = True
    tools: bool = False
    thinking: bool = False
    audio: bool = False
    vision: bool = False


@dataclass
class ChatSession:
    """A conversation over a model: its session (None for a renderer), the resolved template and ``history``.

    ``history`` is the transcript as chat-template messages (``{"role": ..., "content": ...}``), the
    system prompt first when there is one; it may be edited or replaced (a loaded transcript): the
    next turn re-syncs the KV to it. Use a chat from one thread at a time.
    """

    model: Model
    session: Optional[Session]
    template: str
    system: str = ""
    max_new: int = 256
    history: List[Dict[str, Any]] = field(default_factory=list)
    pending: List[Dict[str, Any]] = field(default_factory=list)
    thinking: bool = True
    tools: List[Dict[str, Any]] = field(default_factory=list)
    template_kwargs: Dict[str, Any] = field(default_factory=dict)
    stop_ids: List[int] = field(default_factory=list)
    fold_system: bool = False
    rendered: List[int] = field(default_factory=list)  # a renderer's stand-in for the KV's token history

    @property
    def compiled(self):
        c = self.__dict__.get("_compiled")
        if c is None or c[0] != self.template:
            c = (self.template, compile_template(self.template))
            self.__dict__["_compiled"] = c
        return c[1]

    def __repr__(self) -> str:
        kv = f"n_past={self.session.n_past}" if self.session is not None else "render-only"
        return (f"ChatSession(turns={sum(m['role'] == 'user' for m in self.history)}, pending={len(self.pending)}, "
                f"{kv}, thinking={self.thinking}, tools={len(self.tools)})")


# -- rendering --------------------------------------------------------------------------------------------

def _refresh(chat: ChatSession) -> None:
    """Re-derive what depends on the template (system folding, stop ids) when ``chat.template`` was replaced."""
    if chat.__dict__.get("_derived_for") == chat.template:
        return
    from .reasoning import _template_stops

    chat.__dict__["_derived_for"] = chat.template  # first: the stops below render through _messages
    chat.fold_system = not _template_caps(chat.model, chat.template).system_prompt
    chat.stop_ids = sorted(set(chat.model._m.eog_ids) | set(_template_stops(chat)))


def _messages(chat: ChatSession, extra: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    _refresh(chat)
    msgs = [dict(m) for m in chat.history + extra]
    if chat.fold_system and msgs and msgs[0]["role"] == "system":
        # No system role: the system prompt opens the first user turn.
        sys_msg = msgs.pop(0)
        for m in msgs:
            if m["role"] == "user":
                m["content"] = sys_msg["content"] + "\n\n" + m["content"]
                break
    return msgs


def _render_text(chat: ChatSession, msgs: List[Dict[str, Any]], add_generation_prompt: bool) -> str:
    from .reasoning import _gen_suffix

    m = _meta(chat.model)
    kw = dict(chat.template_kwargs)
    if chat.tools:
        kw["tools"] = chat.tools
    kw.setdefault("enable_thinking", chat.thinking)
    text = render_messages(chat.compiled, msgs, add_generation_prompt, bos_token=m["bos"], eos_token=m["eos"], **kw)
    if add_generation_prompt:
        text += _gen_suffix(chat, text)
    return text


def _tokens(chat: ChatSession, text: str) -> List[int]:
    # As transformers' apply_chat_template(tokenize=True): specials parsed, none added (the template has BOS).
    return llm.encode(chat.model, text, add_special=False, parse_special=True)


def _prompt_ids(chat: ChatSession) -> List[int]:
    if not chat.pending:
        raise ValueError("no pending message: call add_user (or add_tool_results) first")
    ids = _tokens(chat, _render_text(chat, _messages(chat, chat.pending), True))
    if not ids:
        raise TemplateError("chat template rendered an empty prompt")
    return ids


def _held(chat: ChatSession) -> List[int]:
    return chat.session._s.history if chat.session is not None else chat.rendered


def _common(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _sync(chat: ChatSession, ids: List[int], keep_last: bool) -> int:
    """Make the KV hold exactly ``ids`` (minus the last token with ``keep_last``, left for the caller to
    run); returns the position from which ``ids`` still has to be prefilled."""
    s = chat.session
    p = _common(s._s.history, ids)
    if keep_last:
        p = min(p, len(ids) - 1)
    if p < s.n_past:
        s._s.truncate(p)
    if not keep_last and p < len(ids):
        llm.eval(chat.model, s, ids[p:])
    return p


def _close_text(chat: ChatSession) -> str:
    """The text that terminates an assistant turn: what the template writes after a reply."""
    msgs = _messages(chat, [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
    text = render_messages(chat.compiled, msgs, False, bos_token=_meta(chat.model)["bos"],
                           eos_token=_meta(chat.model)["eos"], **dict(chat.template_kwargs))
    i = text.rfind(_SENTINEL)
    return text[i + len(_SENTINEL):] if i >= 0 else ""


def render_close(model: Model, chat: ChatSession) -> List[int]:
    """The tokens that terminate an assistant turn (what respond evals after the reply)."""
    _same(model, chat)
    return _tokens(chat, _close_text(chat))


def render_turn(model: Model, chat: ChatSession) -> List[int]:
    """The next turn's prefill ids without running the model: the rendered prompt past what is already held
    (BOS + system on the first turn, then the pending turn and the generation prompt)."""
    _same(model, chat)
    ids = _prompt_ids(chat)
    p = min(_common(_held(chat), ids), len(ids) - 1)
    return ids[p:]


def render_assistant(model: Model, chat: ChatSession, text: str) -> List[int]:
    """add_assistant's render half: the tokens a known reply prefills (pending turn + reply + close),
    advancing the transcript like add_assistant but running nothing."""
    return _assistant(model, chat, {"role": "assistant", "content": str(text)}, run=False)


def add_assistant(model: Model, chat: ChatSession, text: str) -> None:
    """Inject a known assistant reply: prefill the pending turn and ``text``, then close the turn."""
    _assistant(model, chat, {"role": "assistant", "content": str(text)}, run=True)


def _assistant(model: Model, chat: ChatSession, msg: Dict[str, Any], run: bool) -> List[int]:
    _same(model, chat)
    if not chat.pending:
        raise ValueError("no pending message: call add_user (or add_tool_results) first")
    if run and chat.session is None:
        raise ValueError("a render-only chat (create_chat_renderer) cannot run the model")
    ids = _tokens(chat, _render_text(chat, _messages(chat, chat.pending + [msg]), False))
    held = _held(chat)
    p = _common(held, ids)
    if run:
        _sync(chat, ids, keep_last=False)
    else:
        chat.rendered = list(ids)
    chat.history += chat.pending + [msg]
    chat.pending = []
    return ids[p:]


# -- turns ------------------------------------------------------------------------------------------------

def _same(model: Model, chat: ChatSession) -> None:
    if not isinstance(chat, ChatSession):
        raise TypeError(f"expected a ChatSession, got {type(chat).__name__}")
    if chat.model is not model:
        raise ValueError("chat belongs to another model")


def _new_chat(model: Model, session: Optional[Session], system: str, max_new: int) -> ChatSession:
    if not isinstance(model, Model):
        raise TypeError(f"expected a Model, got {type(model).__name__}")
    if int(max_new) < 1:
        raise ValueError("max_new must be at least 1")
    chat = ChatSession(model=model, session=session, template=model_template(model), system=str(system or ""),
                       max_new=int(max_new))
    if chat.system:
        chat.history.append({"role": "system", "content": chat.system})
    _refresh(chat)
    return chat


def create_chat(model: Model, system: str = "", max_new: int = 256, kv_dtype: KVDtype = KVDtype.f16) -> ChatSession:
    """Start a conversation over ``model``: its template (GGUF-embedded, else the family default) and a session.

    ``system`` is the system prompt (empty = none), ``max_new`` caps each reply, ``kv_dtype`` the KV codec.
    """
    return _new_chat(model, llm.create_session(model, KVDtype(kv_dtype)), system, max_new)


def create_chat_renderer(model: Model, system: str = "", max_new: int = 256) -> ChatSession:
    """create_chat's render-only twin: template, stops and turn close, but no KV session."""
    return _new_chat(model, None, system, max_new)


def add_user(chat: ChatSession, text: str) -> None:
    """Queue a user message for the next respond."""
    if not isinstance(text, str):
        raise TypeError(f"user message must be str, got {type(text).__name__}")
    chat.pending.append({"role": "user", "content": text})


def reset(chat: ChatSession) -> None:
    """Forget the conversation (the system prompt stays); the KV is re-synced on the next turn."""
    chat.history = [{"role": "system", "content": chat.system}] if chat.system else []
    chat.pending = []
    chat.rendered = []


def respond(model: Model, chat: ChatSession, params: Optional[SamplingParams] = None,
            on_piece: Optional[Callable[[str], Optional[bool]]] = None) -> str:
    """Generate the reply to the pending turn, streaming pieces to ``on_piece`` (return False to stop).

    Prefills only the rendered prompt past what the KV holds, decodes in C++, closes the turn in the KV
    and appends both turns to ``chat.history``; returns the reply text.
    """
    _same(model, chat)
    if chat.session is None:
        raise ValueError("a render-only chat (create_chat_renderer) cannot respond")
    from .reasoning import effective_stop_ids

    s = chat.session
    ids = _prompt_ids(chat)
    if len(ids) >= s.n_ctx:
        raise llm._core.ContextOverflowError(
            f"the conversation ({len(ids)} tokens) does not fit the context of {s.n_ctx}: reset the chat")
    p = _sync(chat, ids, keep_last=True)
    from .reasoning import _chat_format, split_reasoning

    stops = list(effective_stop_ids(chat))
    harmony = _chat_format(chat) == "harmony"
    if harmony:
        # Harmony ends each channel message with <|end|> (an end-of-generation id of gpt-oss files) and
        # the turn with <|return|> / <|call|>: run through <|end|>, and stream the channel markers as
        # text so the reasoning splitter and the tool parser see them.
        end = llm.encode(model, "<|end|>", add_special=False, parse_special=True)
        if len(end) == 1:
            stops = [t for t in stops if t != end[0]]
    pieces: List[str] = []

    def cb(tok: int, piece: str) -> bool:
        pieces.append(piece)
        return on_piece is None or on_piece(piece) is not False

    max_new = min(chat.max_new, s.n_ctx - len(ids))
    llm.generate(model, s, ids[p:], params or SamplingParams(), max_new, cb, stop_ids=stops, special=harmony)
    reply = "".join(pieces)
    # The transcript keeps what the template expects of an assistant turn: Harmony's final channel.
    content = split_reasoning(chat, reply).content if harmony else reply
    chat.history += chat.pending + [{"role": "assistant", "content": content}]
    chat.pending = []
    # Close the turn in the KV now, as the next turn will render it; a template that cannot render a
    # transcript ending in an assistant turn is synced lazily by the next turn instead.
    try:
        full = _tokens(chat, _render_text(chat, _messages(chat, []), False))
        if len(full) < s.n_ctx:
            _sync(chat, full, keep_last=False)
    except TemplateError:
        pass
    return reply


def stream_respond(model: Model, chat: ChatSession, params: Optional[SamplingParams] = None) -> Iterator[str]:
    """Generator form of :func:`respond`: yields pieces; closing the generator stops the reply."""
    q: "queue.Queue" = queue.Queue()
    stop = threading.Event()
    done = object()

    def on_piece(p: str) -> bool:
        q.put(p)
        return not stop.is_set()

    def run():
        try:
            respond(model, chat, params, on_piece)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            q.put(e)
        finally:
            q.put(done)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            if item:
                yield item
    finally:
        stop.set()
        t.join()


# -- capabilities -----------------------------------------------------------------------------------------

def caps(model: Model) -> LlmCaps:
    """What the model's template supports: a system role, tools, thinking (audio / vision not yet).

    ``system_prompt`` is False when the template refuses a system message, drops it, or writes it as the
    head of the first user turn (gemma); the chat layer then folds the system prompt into that turn itself.
    """
    if not isinstance(model, Model):
        raise TypeError(f"expected a Model, got {type(model).__name__}")
    return _template_caps(model, model_template(model))


def _template_caps(model: Model, tpl: str) -> LlmCaps:
    cache = model.__dict__.setdefault("_chat_caps", {})
    if tpl in cache:
        return cache[tpl]
    from .reasoning import _think_format
    from .tools import _tool_format

    m = _meta(model)
    kw = dict(bos_token=m["bos"], eos_token=m["eos"])
    user = [{"role": "user", "content": "U"}]
    sys_prompt = True
    try:
        with_sys = render_messages(tpl, [{"role": "system", "content": "S"}] + user, True, **kw)
        folded = render_messages(tpl, [{"role": "user", "content": "S\n\nU"}], True, **kw)
        # A template that writes the system prompt exactly as a prefix of the first user turn has no system role.
        sys_prompt = with_sys != folded and "S" in with_sys
    except TemplateError:
        sys_prompt = False  # it refuses a system message: we fold it
    c = LlmCaps(system_prompt=sys_prompt, tools=_tool_format(tpl) is not None,
                thinking=_think_format(model, tpl) is not None)
    cache[tpl] = c
    return c


def save_transcript(chat: ChatSession, path: str) -> None:
    """Write the transcript (system prompt and messages) as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"system": chat.system, "history": chat.history}, f, ensure_ascii=False, indent=1)


def load_transcript(chat: ChatSession, path: str) -> None:
    """Replace the transcript with one written by :func:`save_transcript`; the next turn re-syncs the KV."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    hist = data.get("history") if isinstance(data, dict) else None
    if not isinstance(hist, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content", ""), str) for m in hist):
        raise ValueError(f"{path}: not a dasllama chat transcript")
    chat.system = str(data.get("system") or "")
    chat.history = [dict(m) for m in hist]
    chat.pending = []
    chat.rendered = []
