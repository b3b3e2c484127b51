"""Reasoning splitter and tool-call parsers on the vendors' documented reply formats, plus hypothesis fuzzing.

Replies below follow the examples in the Qwen function-calling docs, Meta's Llama-3.1 prompt-format page,
Mistral's function-calling docs and OpenAI's Harmony guide; malformed text must come back as content.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dasllama as d

from chat_templates import HARMONY, LLAMA31, MISTRAL, QWEN3

R1 = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")


@pytest.fixture(scope="module")
def model(smollm2_path):
    return d.load_model(smollm2_path)


def _chat(model, template=None):
    c = d.create_chat_renderer(model)
    if template is not None:
        c.template = template
    return c


# -- reasoning ----------------------------------------------------------------------------------------------

def test_think_pair_split(model):
    c = _chat(model, QWEN3)
    s = d.split_reasoning(c, "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.")
    assert (s.reasoning, s.content) == ("The user asks 2+2. That is 4.", "The answer is 4.")
    assert d.split_reasoning(c, "Just content  ") == d.ThinkSplit("", "Just content  ")
    # Truncated mid-thought: the unclosed span is reasoning.
    assert d.split_reasoning(c, "<think>\nstill thinking") == d.ThinkSplit("still thinking", "")


def test_r1_prompt_opens_the_think_block(model):
    c = _chat(model, R1)
    d.add_user(c, "Plan a trip.")
    ts = d.make_think_stream(c)
    assert d.think_drain(ts, "Consider trains.\n</think>\n\nTake the train.") == \
        d.ThinkSplit("Consider trains.", "Take the train.")
    d.set_thinking(c, False)  # the block is closed in the prompt: the reply is all content
    assert d.decode(model, d.render_turn(model, c)).endswith("<think>\n\n</think>\n\n")
    assert d.think_drain(d.make_think_stream(c), "Take the train.") == d.ThinkSplit("", "Take the train.")


def test_harmony_channels_split(model):
    c = _chat(model, HARMONY)
    reply = ("<|channel|>analysis<|message|>User asks: What is 2+2? Simple arithmetic.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    assert d.split_reasoning(c, reply) == d.ThinkSplit("User asks: What is 2+2? Simple arithmetic.", "2 + 2 = 4.")
    assert d.parse_calls(c, reply) == d.ToolReply("User asks: What is 2+2? Simple arithmetic.", "2 + 2 = 4.", [])


def test_stream_holds_partial_markers(model):
    c = _chat(model, QWEN3)
    ts = d.make_think_stream(c)
    out = [d.think_feed(ts, p) for p in ["<th", "ink>ab", "c</", "thi", "nk>", "\n\nhi <", "b>"]]
    assert out == [("", ""), ("ab", ""), ("c", ""), ("", ""), ("", ""), ("", "\n\nhi "), ("", "<b>")]
    assert d.think_finish(ts) == ("", "")


def test_non_thinking_template_passes_through(model):
    c = _chat(model)  # SmolLM2's own template
    assert d.caps(model).thinking is False
    ts = d.make_think_stream(c)
    assert d.think_feed(ts, "<think>x</think>y") == ("", "<think>x</think>y")
    assert d.split_reasoning(c, "<think>x</think>y") == d.ThinkSplit("", "<think>x</think>y")


def test_thinking_off_renders_the_empty_block(model):
    c = _chat(model, QWEN3)
    d.set_thinking(c, False)
    d.add_user(c, "hi")
    assert d.decode(model, d.render_turn(model, c)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert d.make_think_stream(c).markers == {}


THINK_BITS = ["<think>", "</think>", "<", "</", "th", "ink", ">", "/", "a", " ", "\n", "é", "🙂", "<thi", "nk>"]
HARMONY_BITS = ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
                "<|return|>", "<|call|>", "<|", "|>", "x", " ", "\n"]


def _chunks(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("template,bits", [(QWEN3, THINK_BITS), (R1, THINK_BITS), (HARMONY, HARMONY_BITS)],
                         ids=["think", "r1", "harmony"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_chunking_gives_the_drain(model, template, bits, data):
    c = _chat(model, template)
    d.add_user(c, "q")
    text = "".join(data.draw(st.lists(st.sampled_from(bits), max_size=30)))
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12))
    ts = d.make_think_stream(c)
    r, k = [], []
    for piece in _chunks(text, cuts):
        a, b = d.think_feed(ts, piece)
        r.append(a)
        k.append(b)
    a, b = d.think_finish(ts)
    r.append(a)
    k.append(b)
    reasoning, content = "".join(r), "".join(k)
    if ts.consumed:
        reasoning, content = reasoning.strip(), content.strip()
    assert d.ThinkSplit(reasoning, content) == d.think_drain(d.make_think_stream(c), text)


# -- tool calls ---------------------------------------------------------------------------------------------

def _calls(reply):
    return [(c.name, json.loads(c.args), c.id) for c in reply.calls]


def test_hermes_calls(model):
    c = _chat(model, QWEN3)
    reply = ('<think>\nI need both.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_current_temperature", '
             '"arguments": {"location": "San Francisco, CA, USA"}}\n</tool_call>\n<tool_call>\n'
             '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
             '"date": "2024-10-01"}}\n</tool_call>')
    r = d.parse_calls(c, reply)
    assert r.reasoning == "I need both." and r.content == "Let me check."
    assert _calls(r) == [("get_current_temperature", {"location": "San Francisco, CA, USA"}, ""),
                         ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}, "")]
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>'
    assert d.parse_calls(c, bad) == d.ToolReply("", bad, [])
    # Arguments given as a JSON string (OpenAI style) are normalized to the object text.
    r = d.parse_calls(c, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _calls(r) == [("f", {"a": 1}, "")]


def test_llama3_calls(model):
    c = _chat(model, LLAMA31)
    r = d.parse_calls(c, '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                         '"unit": "Fahrenheit"}}')
    assert _calls(r) == [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"}, "")]
    assert r.content == ""
    r = d.parse_calls(c, '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")')
    assert _calls(r) == [("brave_search", {"query": "current weather in Menlo Park, California"}, "")]
    r = d.parse_calls(c, "<|python_tag|>print(sum(range(10)))")
    assert _calls(r) == [("python", {"code": "print(sum(range(10)))"}, "")]
    plain = "The weather is {sunny}; enjoy."
    assert d.parse_calls(c, plain) == d.ToolReply("", plain, [])


def test_mistral_calls(model):
    c = _chat(model, MISTRAL)
    r = d.parse_calls(c, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                         '"format": "celsius"}, "id": "VvvODy9mT"}]')
    assert _calls(r) == [("get_current_weather", {"location": "Paris, France", "format": "celsius"}, "VvvODy9mT")]
    r = d.parse_calls(c, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}')
    assert _calls(r) == [("get_weather", {"city": "Paris"}, ""), ("get_time", {}, "")]
    bad = '[TOOL_CALLS] [{"name": "get_weather", "arguments": ["Paris"]}]'
    assert d.parse_calls(c, bad) == d.ToolReply("", bad, [])


def test_harmony_calls(model):
    c = _chat(model, HARMONY)
    r = d.parse_calls(c, "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
                         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                         '<|message|>{"location":"San Francisco"}<|call|>')
    assert r.reasoning == "Need to use function get_weather." and r.content == ""
    assert _calls(r) == [("get_weather", {"location": "San Francisco"}, "")]
    r = d.parse_calls(c, '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>')
    assert _calls(r) == [("lookup", {"q": 1}, "")]


def test_family_without_tool_format(model):
    c = _chat(model)
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert d.parse_calls(c, text) == d.ToolReply("", text, [])
    assert d.caps(model).tools is False


def test_rendered_calls_parse_back(model):
    for tpl in (QWEN3, MISTRAL, HARMONY, LLAMA31):
        c = _chat(model, tpl)
        d.add_user(c, "weather?")
        call = {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}
        ids = d.render_assistant_calls(model, c, "", [json.dumps(call)])
        # What the template wrote for the call, between the turn opening and its close, parses back.
        text = d.decode(model, ids)
        start = {QWEN3: "<tool_call>", MISTRAL: "[TOOL_CALLS]", HARMONY: "<|start|>assistant to=",
                 LLAMA31: '{"name"'}[tpl]
        # (SmolLM2's vocabulary has no <|eot_id|> special, so Llama's turn end decodes as text: cut it.)
        r = d.parse_calls(c, text[text.index(start):].replace("<|eot_id|>", ""))
        assert [(x.name, json.loads(x.args)) for x in r.calls] == [("get_weather", {"city": "Paris"})], text


FUZZ_BITS = ["<tool_call>", "</tool_call>", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",",
             '"f"', "1", "null", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", ".call(", "q=", '"x"', ")", ";",
             "<|channel|>", "commentary", "analysis", "final", " to=functions.g", "<|message|>", "<|call|>",
             "<|end|>", "<|start|>", "assistant", "<think>", "</think>", "\\", " ", "\n", "é"]


@pytest.mark.parametrize("template", [QWEN3, LLAMA31, MISTRAL, HARMONY, None],
                         ids=["hermes", "llama3", "mistral", "harmony", "none"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_replies_never_raise(model, template, data):
    c = _chat(model, template)
    text = data.draw(st.one_of(st.lists(st.sampled_from(FUZZ_BITS), max_size=40).map("".join), st.text(max_size=80)))
    r = d.parse_calls(c, text)
    assert isinstance(r, d.ToolReply) and isinstance(r.content, str) and isinstance(r.reasoning, str)
    for call in r.calls:
        assert call.name and isinstance(json.loads(call.args), dict)
