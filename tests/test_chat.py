"""The chat layer against transformers: rendered ids, incremental prefill vs a cold prefill, hostile templates.

Oracles: transformers' apply_chat_template (tokenize=True) with the tokenizer it builds from the same GGUF,
for the same template; a cold session prefilling the whole rendered conversation for the KV.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dasllama as d  # noqa: E402
from dasllama.chat import turns  # noqa: E402

from chat_templates import HARMONY, LLAMA31, MISTRAL, QWEN3  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _hf_ids(tok, messages, template=None, **kw):
    out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return d.load_model(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path, hf_tokenizer):
    return hf_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_path):
    return d.load_model(smollm2_path, mode=d.QuantMode.fp32)


# -- rendering: token-identical with transformers -----------------------------------------------------------

def test_smollm2_multiturn_matches_transformers(smollm2, smollm2_hf):
    for system in ("You are a concise assistant.", ""):
        chat = d.create_chat_renderer(smollm2, system=system)
        d.add_user(chat, "What is the capital of France?")
        first = d.render_turn(smollm2, chat)
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is the capital of France?"}]
        # With no system prompt SmolLM2's own template writes its default one: rendered, not assumed.
        assert first == _hf_ids(smollm2_hf, msgs, add_generation_prompt=True)
        turn1 = d.render_assistant(smollm2, chat, "Paris.")
        assert turn1 == _hf_ids(smollm2_hf, msgs + [{"role": "assistant", "content": "Paris."}])
        d.add_user(chat, "And of Italy? Answer in one word, émoji welcome 🇮🇹.")
        nxt = d.render_turn(smollm2, chat)
        msgs += [{"role": "assistant", "content": "Paris."},
                 {"role": "user", "content": "And of Italy? Answer in one word, émoji welcome 🇮🇹."}]
        # The second turn renders only what the first did not: together they are the whole conversation.
        assert turn1 + nxt == _hf_ids(smollm2_hf, msgs, add_generation_prompt=True)
        assert chat.session is None


def test_hf_template_extensions(smollm2, smollm2_hf):
    # loop controls, {% generation %} spans, tojson options and strftime_now, as transformers provides them
    tpl = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
           "{{ '<|im_start|>' + m.role + '\n' }}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
           "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
           "{{ {'b': 1, 'a': [1, 2]} | tojson(sort_keys=true) }}{{ strftime_now('%Y') | length }}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = d.create_chat_renderer(smollm2)
    chat.template = tpl
    d.add_user(chat, "Hi")
    d.render_assistant(smollm2, chat, "Hello")
    d.add_user(chat, "Bye")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    assert _whole(smollm2, chat) == _hf_ids(smollm2_hf, msgs, tpl, add_generation_prompt=True)


def test_render_close_is_the_templates_turn_end(smollm2, smollm2_hf):
    chat = d.create_chat_renderer(smollm2)
    assert d.render_close(smollm2, chat) == smollm2_hf("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    # <|im_end|> is what generation stops at.
    assert smollm2_hf.convert_tokens_to_ids("<|im_end|>") in d.effective_stop_ids(chat)


def test_gemma3_family_default_folds_system(gemma3_path, hf_tokenizer):
    model = d.load_model(gemma3_path)
    hf = hf_tokenizer(gemma3_path)
    assert not hf.chat_template  # the file carries no template: ours is the family default
    c = d.caps(model)
    assert c.system_prompt is False and c.audio is False and c.vision is False
    chat = d.create_chat_renderer(model, system="Answer in French.")
    d.add_user(chat, "Hello")
    d.render_assistant(model, chat, "Bonjour")
    d.add_user(chat, "How are you?")
    ids = _whole(model, chat)
    # Google's published Gemma turn format: the system prompt opens the first user turn.
    want = ("<bos><start_of_turn>user\nAnswer in French.\n\nHello<end_of_turn>\n"
            "<start_of_turn>model\nBonjour<end_of_turn>\n"
            "<start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n")
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    assert hf.convert_tokens_to_ids("<end_of_turn>") in d.effective_stop_ids(chat)


def _whole(model, chat):
    """The pending turn's whole prompt: what is held up to where the new rendering departs, then render_turn."""
    tail = d.render_turn(model, chat)
    full = turns.prompt_ids(chat)
    assert full[len(full) - len(tail):] == tail
    return full


def test_replaced_template_rederives_folding_and_stops(smollm2, smollm2_hf):
    chat = d.create_chat_renderer(smollm2, system="Be brief.")
    assert not chat.fold_system
    chat.template = d.default_template("gemma3")  # a template with no system role, on SmolLM2's vocabulary
    d.add_user(chat, "Hi")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _whole(smollm2, chat) == _hf_ids(smollm2_hf, msgs, chat.template, add_generation_prompt=True)
    assert chat.fold_system
    assert chat.history[0] == {"role": "system", "content": "Be brief."}  # the transcript keeps it as said


def _tool_conversation(model, template, ids_for_calls=False):
    chat = d.create_chat_renderer(model, system="You help with weather.")
    chat.template = template
    d.set_tools(chat, [json.dumps(WEATHER)])
    d.add_user(chat, "Weather in Paris?")
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    if ids_for_calls:
        call["id"] = "abcDEF123"
    d.render_assistant_calls(model, chat, "", [json.dumps(call)])
    d.add_tool_results(chat, ['{"temp_c": 21}'], names=["get_weather"], ids=["abcDEF123"] if ids_for_calls else None)
    tc = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    tool_msg = {"role": "tool", "content": '{"temp_c": 21}', "name": "get_weather"}
    if ids_for_calls:
        tc["id"] = "abcDEF123"
        tool_msg["tool_call_id"] = "abcDEF123"
    msgs = [{"role": "system", "content": "You help with weather."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [tc]}, tool_msg]
    return chat, msgs


@pytest.mark.parametrize("name,template", [("qwen3", QWEN3), ("llama31", LLAMA31), ("harmony", HARMONY),
                                           ("mistral", MISTRAL)], ids=["qwen3", "llama31", "harmony", "mistral"])
def test_wire_format_templates_match_transformers(smollm2, smollm2_hf, name, template):
    chat, msgs = _tool_conversation(smollm2, template, ids_for_calls=(name == "mistral"))
    got = _whole(smollm2, chat)
    assert got == _hf_ids(smollm2_hf, msgs, template, tools=[WEATHER], add_generation_prompt=True,
                          enable_thinking=True)
    if name == "mistral":
        return
    # A final answer, then a second question: the whole conversation still matches.
    d.render_assistant(smollm2, chat, "It is 21 °C in Paris.")
    d.add_user(chat, "Thanks!")
    msgs += [{"role": "assistant", "content": "It is 21 °C in Paris."}, {"role": "user", "content": "Thanks!"}]
    got = _whole(smollm2, chat)
    assert got == _hf_ids(smollm2_hf, msgs, template, tools=[WEATHER], add_generation_prompt=True,
                          enable_thinking=True)


def test_qwen3_thinking_off_and_reasoning_dropped_from_earlier_turns(smollm2, smollm2_hf):
    chat = d.create_chat_renderer(smollm2)
    chat.template = QWEN3
    assert d.caps(smollm2).thinking is False  # SmolLM2's own template does not think
    d.set_thinking(chat, False)
    d.add_user(chat, "2+2?")
    d.render_assistant(smollm2, chat, "<think>\nadd them\n</think>\n\n4")
    d.add_user(chat, "3+3?")
    got = _whole(smollm2, chat)
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"}]
    assert got == _hf_ids(smollm2_hf, msgs, QWEN3, add_generation_prompt=True, enable_thinking=False)


# -- incremental prefill ------------------------------------------------------------------------------------

def _cold(model, ids):
    s = d.create_session(model, d.KVDtype.f32)
    d.eval(model, s, ids)
    return s, np.array(s.logits)


def test_three_turns_kv_equals_cold_prefill(smollm2_fp32):
    m = smollm2_fp32
    chat = d.create_chat(m, system="You are a helpful assistant.", max_new=16, kv_dtype=d.KVDtype.f32)
    for q in ("Name a fruit.", "Name a colour.", "Name an animal."):
        d.add_user(chat, q)
        d.respond(m, chat, d.SamplingParams())
    # The KV holds exactly the rendered transcript, closed.
    whole = d.encode(m, d.chat.render_prompt(m, chat.history, add_generation_prompt=False), add_special=False,
                     parse_special=True)
    assert chat.session._s.history == whole
    _, cold_logits = _cold(m, whole)
    np.testing.assert_allclose(np.array(chat.session.logits), cold_logits, atol=1e-3, rtol=0)
    # The fourth reply equals greedy generation after a cold prefill of the whole prompt.
    d.add_user(chat, "Name a city.")
    prompt = turns.prompt_ids(chat)
    cold = d.create_session(m, d.KVDtype.f32)
    pieces = []
    d.generate(m, cold, prompt, d.SamplingParams(), 16, lambda i, p: pieces.append(p))
    assert d.respond(m, chat, d.SamplingParams()) == "".join(pieces)


def test_rewritten_turn_reprefills_from_first_difference(smollm2_fp32):
    m = smollm2_fp32
    chat = d.create_chat(m, max_new=8, kv_dtype=d.KVDtype.f32)
    chat.template = QWEN3  # drops reasoning from assistant turns before the last user query
    d.add_user(chat, "2+2?")
    d.add_assistant(m, chat, "<think>\nadd two and two\n</think>\n\n4")
    held = list(chat.session._s.history)
    assert d.decode(m, held).count("add two and two") == 1
    d.add_user(chat, "3+3?")
    prompt = turns.prompt_ids(chat)
    assert "add two and two" not in d.decode(m, prompt)
    first_diff = turns._common(held, prompt)
    assert 0 < first_diff < len(held)
    reply = d.respond(m, chat, d.SamplingParams())
    # Exactly the tokens from the first difference on were prefilled; the KV holds the new rendering.
    assert d.stats(chat.session).n_prompt == len(prompt) - first_diff
    assert chat.session._s.history[:len(prompt)] == prompt
    cold = d.create_session(m, d.KVDtype.f32)
    pieces = []
    d.generate(m, cold, prompt, d.SamplingParams(), 8, lambda i, p: pieces.append(p))
    assert reply == "".join(pieces)


def test_edited_history_is_never_answered_from_a_stale_cache(smollm2):
    chat = d.create_chat(smollm2, max_new=4)
    d.add_user(chat, "Say hello.")
    d.respond(smollm2, chat)
    chat.history[0]["content"] = "Say goodbye."  # an edited transcript
    d.add_user(chat, "Again.")
    prompt = turns.prompt_ids(chat)
    d.respond(smollm2, chat)
    assert chat.session._s.history[:len(prompt)] == prompt


def test_load_transcript_resyncs(smollm2, tmp_path):
    chat = d.create_chat(smollm2, system="Be brief.", max_new=6)
    d.add_user(chat, "Hi")
    d.respond(smollm2, chat)
    d.save_transcript(chat, str(tmp_path / "t.json"))
    other = d.create_chat(smollm2, max_new=6)
    d.load_transcript(other, str(tmp_path / "t.json"))
    assert other.history == chat.history and other.system == "Be brief."
    d.add_user(other, "Bye")
    d.add_user(chat, "Bye")
    assert d.respond(smollm2, other) == d.respond(smollm2, chat)
    (tmp_path / "bad.json").write_text('{"history": 3}')
    with pytest.raises(ValueError):
        d.load_transcript(other, str(tmp_path / "bad.json"))


def test_stream_respond_and_early_stop(smollm2):
    a = d.create_chat(smollm2, max_new=12)
    b = d.create_chat(smollm2, max_new=12)
    for c in (a, b):
        d.add_user(c, "Tell me about the sea.")
    streamed = "".join(d.stream_respond(smollm2, a))
    assert streamed == d.respond(smollm2, b) and streamed
    assert a.history == b.history
    got = []
    d.add_user(a, "More.")
    reply = d.respond(smollm2, a, d.SamplingParams(), lambda p: got.append(p) or len(got) < 3)
    assert len(got) == 3 and reply == "".join(got)
    assert a.history[-1] == {"role": "assistant", "content": reply}


def test_closing_the_stream_stops_and_keeps_the_chat_usable(smollm2):
    chat = d.create_chat(smollm2, max_new=64)
    d.add_user(chat, "Count from one to fifty in words.")
    gen = d.stream_respond(smollm2, chat)
    first = [next(gen), next(gen)]
    gen.close()
    reply = chat.history[-1]["content"]
    assert chat.history[-1]["role"] == "assistant" and reply.startswith("".join(first))
    assert d.stats(chat.session).n_gen < 64
    d.add_user(chat, "Thanks.")
    prompt = turns.prompt_ids(chat)
    d.respond(smollm2, chat)
    assert chat.session._s.history[:len(prompt)] == prompt


def test_bad_input_raises(smollm2, gemma3_path):
    chat = d.create_chat(smollm2)
    with pytest.raises(ValueError):
        d.respond(smollm2, chat)  # nothing pending
    with pytest.raises(TypeError):
        d.add_user(chat, 42)
    with pytest.raises(ValueError):
        d.create_chat(smollm2, max_new=0)
    r = d.create_chat_renderer(smollm2)
    d.add_user(r, "x")
    with pytest.raises(ValueError):
        d.respond(smollm2, r)
    with pytest.raises(ValueError):
        d.set_tools(chat, ["not json"])
    other = d.load_model(gemma3_path)
    with pytest.raises(ValueError):
        d.render_turn(other, r)
    small = d.create_chat(smollm2)
    small.session = d.create_session(smollm2, n_ctx=16)
    d.add_user(small, "word " * 40)
    with pytest.raises(d.ContextOverflowError):
        d.respond(smollm2, small)


# -- hostile templates --------------------------------------------------------------------------------------

HOSTILE = {
    "escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "mutation": "{% set x = messages.append(1) %}{{ x }}",
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "bomb": "{{ 'a' * 10000000000 }}",
    "raise": "{{ raise_exception('roles must alternate') }}",
    "syntax": "{% for %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_template_is_template_error_and_chat_survives(smollm2, kind):
    chat = d.create_chat(smollm2, max_new=4)
    good = chat.template
    chat.template = HOSTILE[kind]
    d.add_user(chat, "Hello")
    with pytest.raises(d.TemplateError) as e:
        d.respond(smollm2, chat)
    if kind == "raise":
        assert "roles must alternate" in str(e.value)
    chat.template = good
    assert isinstance(d.respond(smollm2, chat), str)
    assert [m["role"] for m in chat.history] == ["user", "assistant"]
