"""Chat turns (reference §17.1.10): ChatSession, create_chat, add_user, respond, render_* and caps.

The KV is kept in step with the transcript by diffing token ids: every turn renders the whole
conversation, tokenizes it, keeps the longest prefix the session already holds and prefills only
the rest. A template that rewrites earlier turns therefore costs a re-prefill from the first
differing token, and the cache never answers for a prompt it does not hold.
This file holds the conversation state and every call that takes a ChatSession (the thinking and tool
calls included); the formats themselves are pure functions in template.py, reasoning.py and tools.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import weakref

import numpy as np

from .. import kv, llm
from ..audio import AudioEmbedder
from ..vision import VisionEmbedder, load_image_rgb
from ..audio_io import load_audio
from .._core import ContextOverflowError
from ..llm import KVDtype, Model, SamplingParams, Session
from . import media, reasoning
from .reasoning import ThinkSplit, ThinkStream
from .template import REPLY_SENTINEL, TemplateError, close_text, compile_template, model_template, render_messages
from .tools import ToolReply, call_message, check_tools, parse_reply, result_messages, tool_format


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
    tower: Any = None  # an AudioTower / AudioEmbedder: add_user_audio encodes through it
    vision: Any = None  # a VisionEmbedder: add_user_image encodes through it
    pool: Any = None  # with cache: the session is paged over pool and turns attach / donate through cache
    cache: Any = None
    spans: Dict[int, Any] = field(default_factory=dict)  # media spans by id (chat/media.py)
    # Work counters: rows prefilled (all / media only), rows attached from the prefix cache, encoder runs.
    media_stats: Dict[str, int] = field(default_factory=lambda: {
        "rows_prefilled": 0, "media_rows_prefilled": 0, "rows_attached": 0, "encodes": 0})
    # What derives from ``template`` (recomputed when it is replaced): its compiled form, and the
    # template the fold / stops / reasoning format below were derived for.
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)
    _derived_for: Optional[str] = field(default=None, init=False, repr=False, compare=False)
    _think_fmt: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    @property
    def compiled(self):
        c = self._compiled
        if c is None or c[0] != self.template:
            c = self._compiled = (self.template, compile_template(self.template))
        return c[1]

    def __repr__(self) -> str:
        kv = f"n_past={self.session.n_past}" if self.session is not None else "render-only"
        audio = f", audio={self.tower.family}" if self.tower is not None else ""
        return (f"ChatSession(turns={sum(m['role'] == 'user' for m in self.history)}, pending={len(self.pending)}, "
                f"{kv}, thinking={self.thinking}, tools={len(self.tools)}{audio})")


# -- rendering --------------------------------------------------------------------------------------------

def _refresh(chat: ChatSession) -> None:
    """Re-derive what depends on the template (system folding, stop ids) when ``chat.template`` was replaced."""
    if chat._derived_for == chat.template:
        return
    chat._derived_for = chat.template  # first: the stops below render through _messages
    chat._think_fmt = reasoning.think_format(chat.model, chat.template)
    chat.fold_system = not _template_caps(chat.model, chat.template).system_prompt
    chat.stop_ids = sorted(set(chat.model.eog_ids) | set(_template_stops(chat)))


def _fmt(chat: ChatSession) -> Optional[str]:
    """The reasoning format of the chat's template ('harmony', 'think' or None)."""
    _refresh(chat)
    return chat._think_fmt


def _template_stops(chat: ChatSession) -> List[int]:
    """Single-token specials the template closes assistant turns with (what generation must stop at)."""
    try:
        close = _close_text(chat)
    except Exception:  # noqa: BLE001 - a template that cannot close a turn just adds no stop
        close = ""
    out: List[int] = []
    for w in reasoning.stop_words(chat._think_fmt, close):
        ids = llm.encode(chat.model, w, add_special=False, parse_special=True)
        # A control token decodes to nothing: the close text opens with a special, generation stops there.
        if ids and llm.decode(chat.model, ids[:1]) == "":
            out.append(ids[0])
    for w in reasoning.stop_tokens(chat._think_fmt):
        ids = llm.encode(chat.model, w, add_special=False, parse_special=True)
        if len(ids) == 1:
            out.append(ids[0])
    return out


def _messages(chat: ChatSession, extra: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    _refresh(chat)
    msgs = [_with_sentinels(m) for m in chat.history + extra]
    if chat.fold_system and msgs and msgs[0]["role"] == "system":
        # No system role: the system prompt opens the first user turn.
        sys_msg = msgs.pop(0)
        for m in msgs:
            if m["role"] == "user":
                m["content"] = sys_msg["content"] + "\n\n" + m["content"]
                break
    return msgs


def _with_sentinels(m: Dict[str, Any]) -> Dict[str, Any]:
    """A message copy for the template: its media spans become sentinels in its text (chat/media.py)."""
    m = {k: v for k, v in m.items() if not k.startswith("_")}
    spans = m.pop("media", None)
    if spans:
        text = m.get("content") or ""
        raw = text.encode("utf-8")
        out, last = [], 0
        for sp in sorted(spans, key=lambda x: x["at"]):  # stable: clips at one offset keep their order
            at = min(int(sp["at"]), len(raw))
            out.append(raw[last:at].decode("utf-8", errors="replace"))
            out.append(media.sentinel(sp["span"]))
            last = at
        out.append(raw[last:].decode("utf-8", errors="replace"))
        m["content"] = "".join(out)
    return m


def _render_text(chat: ChatSession, msgs: List[Dict[str, Any]], add_generation_prompt: bool) -> str:
    m = chat.model.chat_meta
    kw = dict(chat.template_kwargs)
    if chat.tools:
        kw["tools"] = chat.tools
    kw.setdefault("enable_thinking", chat.thinking)
    text = render_messages(chat.compiled, msgs, add_generation_prompt, bos_token=m["bos"], eos_token=m["eos"], **kw)
    if add_generation_prompt:
        text += reasoning.gen_suffix(_fmt(chat), chat.thinking, chat.template, text)
    return text


def _tokens(chat: ChatSession, text: str) -> List[int]:
    # As transformers' apply_chat_template(tokenize=True): specials parsed, none added (the template has BOS).
    # Media sentinels become their spans' media ids, each text run tokenized alone.
    return media.tokenize_with_spans(chat.model, chat.spans, text)


def prompt_ids(chat: ChatSession) -> List[int]:
    """The whole rendered prompt of the pending turn (the conversation so far + the generation prompt) as
    ids: tokens, and media ids for its spans. For schedulers that attach and prefill it themselves."""
    if not chat.pending:
        raise ValueError("no pending message: call add_user (or add_tool_results) first")
    ids = _tokens(chat, _render_text(chat, _messages(chat, chat.pending), True))
    if not ids:
        raise TemplateError("chat template rendered an empty prompt")
    return ids


def _held(chat: ChatSession) -> List[int]:
    return chat.session.history if chat.session is not None else chat.rendered


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
    p = _common(s.history, ids)
    if keep_last:
        p = min(p, len(ids) - 1)
    if p < s.n_past:
        p = s.rewind_point(p)  # a hybrid model's recurrent state rewinds only to where it was kept
        s.truncate(p)
    if not keep_last and p < len(ids):
        _prefill(chat, ids[p:])
    return p


def _prefill(chat: ChatSession, ids: List[int]) -> None:
    before = media.ROW_CACHE.encodes
    media.prefill(chat.model, chat.session, chat.spans, ids, chat.media_stats)
    chat.media_stats["encodes"] += media.ROW_CACHE.encodes - before


def _attach(chat: ChatSession, ids: List[int]) -> None:
    """A fresh paged session of a chat with a prefix cache takes the cached pages of its prompt."""
    if chat.cache is None or chat.session.n_past != 0:
        return
    n = kv.prefix_attach(chat.cache, chat.pool, chat.session, ids)
    chat.media_stats["rows_attached"] += n
    if n and chat.model.config.rope_sections:  # M-RoPE images inside the attached prefix
        chat.session.rope_marks = media.rope_marks(chat.spans, ids[:n])


def _donate(chat: ChatSession) -> None:
    if chat.cache is not None and chat.session.n_past > 0:
        kv.prefix_insert(chat.cache, chat.pool, chat.session, chat.session.history)


def _close_text(chat: ChatSession) -> str:
    """The text that terminates an assistant turn: what the template writes after a reply."""
    msgs = _messages(chat, [{"role": "user", "content": "x"}, {"role": "assistant", "content": REPLY_SENTINEL}])
    m = chat.model.chat_meta
    return close_text(chat.compiled, msgs, m["bos"], m["eos"], **dict(chat.template_kwargs))


def render_close(model: Model, chat: ChatSession) -> List[int]:
    """The tokens that terminate an assistant turn (what respond evals after the reply)."""
    _same(model, chat)
    return _tokens(chat, _close_text(chat))


def render_turn(model: Model, chat: ChatSession) -> List[int]:
    """The next turn's prefill ids without running the model: the rendered prompt past what is already held
    (BOS + system on the first turn, then the pending turn and the generation prompt)."""
    _same(model, chat)
    ids = prompt_ids(chat)
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
        _attach(chat, ids)
        _sync(chat, ids, keep_last=False)
        _donate(chat)
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


def create_chat(model: Model, tower: Any = None, system: str = "", max_new: int = 256,
                kv_dtype: KVDtype = KVDtype.f16, pool: Any = None, cache: Any = None, n_ctx: int = 0) -> ChatSession:
    """Start a conversation over ``model``: its template (GGUF-embedded, else the family default) and a session.

    ``tower`` (an AudioTower / AudioEmbedder whose rows are the decoder's width) lets the chat hear:
    :func:`add_user_audio`. ``system`` is the system prompt (empty = none), ``max_new`` caps each
    reply, ``kv_dtype`` the KV codec. With ``pool`` (a KVPool) the session is paged over it, and
    with ``cache`` (its PrefixCache) each turn attaches what the cache holds of its prompt -- media
    spans included -- and donates its pages when it ends, so another conversation with the same
    clip neither encodes nor prefills it. ``n_ctx`` sizes the session (0: the session default; a
    ten-minute clip is ~15000 rows on qwen2a). ``create_chat(model, "system prompt")`` still works.
    """
    if isinstance(tower, str):  # the text-only positional form create_chat(model, system, max_new, kv_dtype)
        tower, sys_prompt = None, tower
        if not isinstance(system, str):  # positional max_new (and maybe kv_dtype) shifted one place right
            max_new, kv_dtype = system, (max_new if isinstance(max_new, KVDtype) else kv_dtype)
        system = sys_prompt
    vision = None
    if isinstance(tower, VisionEmbedder):
        vision, tower = _check_vision(model, tower), None
    if tower is not None:
        if not isinstance(tower, AudioEmbedder):
            raise TypeError(f"tower must be an AudioTower, AudioEmbedder or VisionEmbedder, got {type(tower).__name__}")
        if isinstance(model, Model) and tower.proj_dim != model.config.dim:
            raise ValueError(f"the audio tower writes {tower.proj_dim}-wide rows but the decoder's embedding width "
                             f"is {model.config.dim}: this mmproj belongs to another model")
    if cache is not None and pool is None:
        raise ValueError("a prefix cache needs the pool its pages live in (pool=)")
    if pool is not None:
        if pool.model is not model:
            raise ValueError("the pool was made for another model")
        session = llm.create_session(model, pool=pool, n_ctx=n_ctx)
    else:
        session = llm.create_session(model, KVDtype(kv_dtype), n_ctx)
    chat = _new_chat(model, session, system, max_new)
    chat.tower, chat.vision, chat.pool, chat.cache = tower, vision, pool, cache
    return chat


def _check_vision(model: Model, e: VisionEmbedder) -> VisionEmbedder:
    if isinstance(model, Model) and e.proj_dim != model.config.dim:
        raise ValueError(f"the vision embedder writes {e.proj_dim}-wide rows but the decoder's embedding width "
                         f"is {model.config.dim}: this mmproj belongs to another model")
    return e


def create_chat_renderer(model: Model, system: str = "", max_new: int = 256, tower: Any = None) -> ChatSession:
    """create_chat's render-only twin: template, stops and turn close, but no KV session.

    With ``tower`` it renders audio turns too (add_user_audio keys and counts a clip without encoding
    it); a scheduler then prefills the rendered ids with :func:`prefill_media_body`."""
    chat = _new_chat(model, None, system, max_new)
    if isinstance(tower, VisionEmbedder):
        chat.vision = _check_vision(model, tower)
    elif tower is not None:
        if not isinstance(tower, AudioEmbedder):
            raise TypeError(f"tower must be an AudioTower or AudioEmbedder, got {type(tower).__name__}")
        if tower.proj_dim != model.config.dim:
            raise ValueError(f"the audio tower writes {tower.proj_dim}-wide rows but the decoder's embedding width "
                             f"is {model.config.dim}: this mmproj belongs to another model")
        chat.tower = tower
    return chat


def prefill_media_body(model: Model, session: Session, chat: ChatSession, ids: List[int]) -> Dict[str, int]:
    """Prefill ``ids`` -- a slice of a rendered prompt of ``chat`` (tokens and its spans' media ids) --
    at ``session``'s position in one call, encoding a span's clip only if its rows are needed (through
    the tower-output cache). For schedulers: render with a renderer chat, ``prefix_attach`` the prompt
    (with an M-RoPE model, then ``session.rope_marks = media.rope_marks(chat.spans, prompt[:matched])``),
    then prefill ``ids[matched:]`` here. Returns this call's counters (rows, media rows, encodes)."""
    _same(model, chat)
    llm.check_session(model, session)
    c = {"rows_prefilled": 0, "media_rows_prefilled": 0, "rows_attached": 0, "encodes": 0, "image_encodes": 0}
    before, before_img = media.ROW_CACHE.encodes, media.ROW_CACHE.image_encodes
    media.prefill(model, session, chat.spans, [int(t) for t in ids], c)
    c["encodes"] = media.ROW_CACHE.encodes - before
    c["image_encodes"] = media.ROW_CACHE.image_encodes - before_img
    return c


def add_user(chat: ChatSession, text: str) -> None:
    """Queue a user message for the next respond."""
    if not isinstance(text, str):
        raise TypeError(f"user message must be str, got {type(text).__name__}")
    last = chat.pending[-1] if chat.pending else None
    if last is not None and last.get("_audio_head"):
        # Audio queued by add_user_audio opens this turn; the text follows it.
        del last["_audio_head"]
        last["content"] = text
        return
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
    s = chat.session
    ids = prompt_ids(chat)
    if len(ids) >= s.n_ctx:
        raise ContextOverflowError(
            f"the conversation ({len(ids)} tokens) does not fit the context of {s.n_ctx}: reset the chat")
    _attach(chat, ids)
    p = _sync(chat, ids, keep_last=True)
    stops = list(effective_stop_ids(chat))
    harmony = _fmt(chat) == "harmony"
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
    prompt = ids[p:]
    if any(t < 0 for t in prompt):
        # Media to prefill: everything but the generation prompt's last token as one body of rows
        # (named by their ids in the history), then the decode loop from that token.
        _prefill(chat, prompt[:-1])
        prompt = prompt[-1:]
    chat.media_stats["rows_prefilled"] += len(prompt)
    llm.generate(model, s, prompt, params or SamplingParams(), max_new, cb, stop_ids=stops, special=harmony)
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
    _donate(chat)
    return reply


def stream_respond(model: Model, chat: ChatSession, params: Optional[SamplingParams] = None) -> Iterator[str]:
    """Generator form of :func:`respond`: yields pieces; closing the generator stops the reply."""
    return llm.stream_pieces(lambda cb: respond(model, chat, params, cb))


# -- capabilities -----------------------------------------------------------------------------------------

def caps(model: Model) -> LlmCaps:
    """What the model's template supports: a system role, tools, thinking (audio / vision come with a tower).

    ``system_prompt`` is False when the template refuses a system message, drops it, or writes it as the
    head of the first user turn (gemma); the chat layer then folds the system prompt into that turn itself.
    """
    if not isinstance(model, Model):
        raise TypeError(f"expected a Model, got {type(model).__name__}")
    return _template_caps(model, model_template(model))


# Capabilities by template, per model: they depend on the model's vocab and bos / eos texts.
_CAPS: "weakref.WeakKeyDictionary[Model, Dict[str, LlmCaps]]" = weakref.WeakKeyDictionary()


def _template_caps(model: Model, tpl: str) -> LlmCaps:
    cache = _CAPS.setdefault(model, {})
    if tpl in cache:
        return cache[tpl]
    m = model.chat_meta
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
    c = LlmCaps(system_prompt=sys_prompt, tools=tool_format(tpl) is not None,
                thinking=reasoning.think_format(model, tpl) is not None)
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


# -- audio turns (tutorial 08) ----------------------------------------------------------------------------

def _new_span(chat: ChatSession, key: str, n: int, open_: str, close: str, is_image: bool = False,
              rows=None, source=None):
    sid = max(chat.spans, default=-1) + 1
    sp = media.Span(id=sid, key=str(key), n=int(n), open=open_, close=close, is_image=bool(is_image), rows=rows,
              source=source)
    chat.spans[sid] = sp
    return sp


def _queue_head(chat: ChatSession, sp) -> None:
    """Put a span at the head of the pending user turn (before its text), opening one if needed."""
    last = chat.pending[-1] if chat.pending else None
    if last is None or last.get("role") != "user":
        last = {"role": "user", "content": "", "_audio_head": True}
        chat.pending.append(last)
    last.setdefault("media", []).append({"span": sp.id, "at": 0})


def add_user_audio(chat: ChatSession, audio, text: str = "") -> int:
    """Queue a clip at the head of the next user turn; returns the rows it takes.

    ``audio`` is float32 16 kHz mono PCM, or a path or the bytes of a WAV / FLAC / MP3 / OGG file
    (decoded and resampled, see dasllama.audio_io). The clip is keyed by its content: its rows
    are encoded when a turn first needs them (through a bounded cache of encoder outputs), and
    a span the KV or the prefix cache already holds is neither encoded nor prefilled. ``text``,
    if given, is the turn's text after the clip (as a following :func:`add_user` would be).
    Needs a chat made with ``create_chat(model, tower)``.
    """
    if not isinstance(chat, ChatSession):
        raise TypeError(f"expected a ChatSession, got {type(chat).__name__}")
    if chat.tower is None:
        raise ValueError("this chat has no audio tower: create it with create_chat(model, tower)")
    x = load_audio(audio)
    tower = chat.tower
    n = tower.n_rows(x.shape[0])
    if n < 1:  # an empty span would leave bare markers; the processor's count is 0 here too
        raise ValueError(f"the clip ({x.shape[0]} samples) is too short to make any {tower.family} rows")
    open_, close = media.FAMILY_FRAMING.get(tower.family, ("", ""))
    sp = _new_span(chat, media.clip_key(tower, x), n, open_, close, source=(tower, x))
    _queue_head(chat, sp)
    if text:
        add_user(chat, text)
    return n


def add_user_image(chat: ChatSession, image, text: str = "") -> int:
    """Queue an image at the head of the next user turn; returns the rows it takes.

    ``image`` is a path, the bytes of a JPEG / PNG / WebP / GIF file, a PIL image, an H x W x 3 uint8
    array or a VisionImage (see :func:`~dasllama.load_image_rgb`; a bad image raises ImageError and
    leaves the chat as it was). The image is keyed by its pixels: its rows are encoded when a turn
    first needs them (through the bounded cache of encoder outputs), and a span the KV or the prefix
    cache already holds is neither encoded nor prefilled. ``text``, if given, is the turn's text after
    the image. Needs a chat made with ``create_chat(model, embedder)``.
    """
    if not isinstance(chat, ChatSession):
        raise TypeError(f"expected a ChatSession, got {type(chat).__name__}")
    e = chat.vision
    if e is None:
        raise ValueError("this chat has no vision embedder: create it with create_chat(model, embedder)")
    img = load_image_rgb(image)
    open_, close = media.IMAGE_FRAMING.get(e.family, ("", ""))
    grid = e.image_grid(img)
    n = grid[0] * grid[1]
    if e.mrope and not chat.model.config.rope_sections:
        raise ValueError(f"the {e.family} tower's rows take M-RoPE positions, but the {chat.model.arch} "
                         "decoder has no rope.dimension_sections: this mmproj belongs to another model")
    if e.n_deepstack != chat.model.config.n_deepstack:
        raise ValueError(f"the {e.family} tower makes {e.n_deepstack} deepstack features a row but the decoder "
                         f"takes {chat.model.config.n_deepstack}: this mmproj belongs to another model")
    sp = _new_span(chat, e.image_key(img), n, open_, close, is_image=True, source=(e, img))
    sp.non_causal = bool(e.non_causal)
    sp.grid = tuple(grid) if e.mrope else None
    _queue_head(chat, sp)
    if text:
        add_user(chat, text)
    return n


def render_turn_image(model: Model, chat: ChatSession):
    """render_turn's image twin: ``(head, tail)``, the turn's token ids before and after its first image
    span (the rows a scheduler splices between them come from encode_image). Render-only."""
    ids = render_turn(model, chat)
    lo = next((i for i, t in enumerate(ids) if t < 0), None)
    if lo is None:
        raise ValueError("the pending turn has no image span")
    hi = lo
    while hi < len(ids) and ids[hi] < 0:
        hi += 1
    return ids[:lo], ids[hi:]


def add_user_audio_rows(model: Model, chat: ChatSession, rows, n: Optional[int] = None, bare: bool = False) -> None:
    """Queue pre-encoded audio rows (``n`` x dim float32, e.g. from encode_audio) at the head of the next
    user turn; the chat needs no tower. ``bare`` (see :func:`audio_span_bare`) drops the span's markers;
    otherwise the decoder's vocab picks the framing (qwen's audio_bos / eos, voxtral's [BEGIN_AUDIO])."""
    _same(model, chat)
    r = np.asarray(rows)
    if r.dtype != np.float32:
        raise TypeError(f"audio rows must be float32, got dtype {r.dtype}")
    D = model.config.dim
    if r.ndim == 2 and r.shape[1] != D:
        raise ValueError(f"audio rows are {r.shape[1]} wide but the decoder's embedding width is {D}")
    if r.size % D:
        raise ValueError(f"{r.size} floats are not whole rows of width {D}")
    r = r.reshape(-1, D)
    n = r.shape[0] if n is None else int(n)
    if n < 1 or n > r.shape[0]:
        raise ValueError(f"n={n} rows asked of {r.shape[0]}")
    r = np.array(r[:n], dtype=np.float32)  # a copy: the chat owns its rows ("moves the rows in")
    r.setflags(write=False)
    fam = chat.tower.family if chat.tower is not None else None
    open_, close = media.framing_for(model, fam, bool(bare))
    _queue_head(chat, _new_span(chat, media.rows_key(r), n, open_, close, rows=r))


def add_user_span(model: Model, chat: ChatSession, key, n_rows: int, text_before: int, is_image: bool = False,
                  bare: bool = False, rows=None) -> None:
    """Put a media span inside the pending user message, ``text_before`` bytes (UTF-8) into its text.

    The span is ``n_rows`` positions named by ``media_ids(key, n_rows)``; render_turn writes those ids.
    ``rows`` (optional, ``n_rows`` x dim) are what a respond prefills if the KV lacks the span; a
    render-only chat needs none. Audio spans take the decoder's markers unless ``bare``."""
    _same(model, chat)
    if not chat.pending or chat.pending[-1].get("role") != "user":
        raise ValueError("no pending user message: call add_user first")
    msg = chat.pending[-1]
    nb = len((msg.get("content") or "").encode("utf-8"))
    if not 0 <= int(text_before) <= nb:
        raise ValueError(f"text_before={text_before} is outside the message's {nb} bytes")
    if int(n_rows) < 1:
        raise ValueError("a span needs at least one row")
    if is_image:  # framed (and non-causal) as the chat's vision family wants; bare without one
        fam = chat.vision.family if chat.vision is not None else None
        open_, close = ("", "") if bare else media.IMAGE_FRAMING.get(fam, ("", ""))
    else:
        open_, close = media.framing_for(model, chat.tower.family if chat.tower is not None else None, bool(bare))
    r = None
    if rows is not None:
        r = np.asarray(rows)
        if r.dtype != np.float32 or r.size != int(n_rows) * model.config.dim:
            raise ValueError(f"rows must be float32 {n_rows} x {model.config.dim}")
        r = np.array(r.reshape(int(n_rows), -1))
    k = key.hex() if isinstance(key, (bytes, bytearray)) else str(key)
    sp = _new_span(chat, k, int(n_rows), open_, close, is_image=is_image, rows=r)
    sp.non_causal = bool(is_image and chat.vision is not None and chat.vision.non_causal)
    msg.setdefault("media", []).append({"span": sp.id, "at": int(text_before)})


def render_turn_audio(model: Model, chat: ChatSession):
    """render_turn's audio twin: ``(head, tail)``, the turn's token ids before and after its first media
    span (the rows a scheduler splices between them come from encode_audio). Render-only."""
    ids = render_turn(model, chat)
    lo = next((i for i, t in enumerate(ids) if t < 0), None)
    if lo is None:
        raise ValueError("the pending turn has no audio span")
    hi = lo
    while hi < len(ids) and ids[hi] < 0:
        hi += 1
    return ids[:lo], ids[hi:]


# -- thinking and tool calls over a chat (the formats are in reasoning.py and tools.py) --------------------

def set_thinking(chat: ChatSession, on: bool) -> None:
    """Toggle reasoning for a hybrid thinking model: off renders the template's empty think block (its
    enable_thinking switch, else ours) so the model answers directly. No-op for other families."""
    chat.thinking = bool(on)


def effective_stop_ids(chat: ChatSession) -> List[int]:
    """The stop ids in force for the next generation: the model's end-of-generation ids and the template's."""
    _refresh(chat)
    return list(chat.stop_ids)


def make_think_stream(chat: ChatSession) -> ThinkStream:
    """The splitter for chat's next turn; armed only when the turn thinks, else a pass-through stream."""
    fmt = _fmt(chat)
    prompt = ""
    if fmt == "think" and chat.thinking:
        pending = chat.pending or [{"role": "user", "content": "x"}]
        try:
            prompt = _render_text(chat, _messages(chat, pending), True)
        except Exception:  # noqa: BLE001 - the turn itself will report the template's error
            prompt = ""
    return reasoning.think_stream(fmt, chat.thinking, prompt)


def split_reasoning(chat: ChatSession, reply: str) -> ThinkSplit:
    """Split a complete reply at its reasoning boundary per the family's format; both halves are stripped
    when a reasoning span is found, and a reply without one passes through untouched."""
    fmt = _fmt(chat)
    if fmt is None:
        return ThinkSplit("", reply)
    return reasoning.split_text(fmt, make_think_stream(chat), reply)


def set_tools(chat: ChatSession, tools) -> None:
    """Declare the conversation's tools (OpenAI tools[] objects, as dicts or JSON text) for the template.

    Families whose template has no tool format ignore them (the template never reads them).
    """
    chat.tools = check_tools(tools)


def add_tool_results(chat: ChatSession, results, names=None, ids=None) -> None:
    """Queue tool results as the next pending turn (in place of add_user), one ``tool`` message each;
    ``names`` are the called functions, ``ids`` the call ids for families that carry them (mistral)."""
    chat.pending.extend(result_messages(results, names, ids))


def render_assistant_calls(model: Model, chat: ChatSession, text: str, calls) -> List[int]:
    """render_assistant's tool-calling twin: an assistant turn that made ``calls`` (``{"name", "arguments"}``
    objects or their JSON text) with ``text`` beside them; returns its tokens and advances the transcript."""
    return _assistant(model, chat, call_message(text, calls), run=False)


def add_assistant_calls(model: Model, chat: ChatSession, text: str, calls) -> None:
    """add_assistant's tool-calling twin: prefill an assistant turn that made ``calls``."""
    _assistant(model, chat, call_message(text, calls), run=True)


def parse_calls(chat: ChatSession, reply: str) -> ToolReply:
    """Classify a complete reply per the family's wire format: reasoning, content, and the calls with their
    arguments as JSON object text. A family without a tool format gets the reasoning split alone."""
    if not isinstance(reply, str):
        raise TypeError(f"reply must be str, got {type(reply).__name__}")
    fmt = tool_format(chat.template)
    if fmt == "harmony":
        return parse_reply(fmt, reply)
    return parse_reply(fmt, reply, split_reasoning(chat, reply))
