"""Gemma-4 against transformers: tiny random text models (tests/oracles/gemma4.py) written to GGUF by
llama.cpp's own convert_hf_to_gguf.py -- a dense one shaped as the 31B (sliding and global layers of
different head dims and kv heads, global layers without a V projection, proportional rope on a
quarter of the global head) and an E-series one (per-layer embeddings, the last layers reading an
earlier layer's KV, a double-wide FFN there).

fp32 mode on the f32 file is held to the HF model in fp32 (eager attention): teacher-forced logits
and greedy tokens. Decode equals one prefill, paged equals flat, batched equals alone (bitwise), and
the KV-sharing layers take no rows of the pool. The tokenizer of the "gemma4" format is held to
transformers' on the tiny vocabulary and to llama.cpp's own tokenizations on the real Gemma-4
vocabulary (models/ggml-vocab-gemma-4.gguf in llama.cpp's source).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dasllama as d  # noqa: E402
import _family as F  # noqa: E402
import torch  # noqa: E402  (the oracle; never skipped)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import gemma4 as G  # noqa: E402
import moe as M  # noqa: E402

FP32_BAR = 1e-4
SHAPES = list(G.FAMILIES)


@pytest.fixture(scope="session")
def gemma4_models(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gemma4-gguf"))
    tok = G.tokenizer()
    return tok, {name: G.build(name, tok, out) for name in G.FAMILIES}


def test_converter_layout(gemma4_models):
    """The files carry what the loader reads: per-layer kv heads, both head dims and rope dims, the
    sliding pattern as flags, no attn_v on the dense model's global layers, the shared layers without
    K/V, the per-layer embedding tensors."""
    from gguf import GGUFReader

    _, models = gemma4_models
    r = GGUFReader(models["dense"][1]["f32"])
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("gemma4.")}
    assert f["gemma4.attention.head_count_kv"] == [2, 2, 1, 2, 2, 1]
    assert (f["gemma4.attention.key_length"], f["gemma4.attention.key_length_swa"]) == (32, 16)
    assert (f["gemma4.rope.dimension_count"], f["gemma4.rope.dimension_count_swa"]) == (32, 16)
    assert f["gemma4.attention.sliding_window_pattern"] == [True, True, False] * 2
    names = {t.name for t in r.tensors}
    assert "blk.2.attn_v.weight" not in names and "blk.1.attn_v.weight" in names
    assert "rope_freqs.weight" in names and "blk.0.layer_output_scale.weight" in names
    r = GGUFReader(models["eseries"][1]["f32"])
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("gemma4.")}
    assert f["gemma4.attention.shared_kv_layers"] == 2 and f["gemma4.embedding_length_per_layer_input"] == 8
    assert f["gemma4.feed_forward_length"] == [96] * 4 + [192] * 2
    names = {t.name for t in r.tensors}
    assert "blk.4.attn_k.weight" not in names and "blk.3.attn_k.weight" in names
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "blk.0.inp_gate.weight"} <= names


@pytest.mark.parametrize("name", SHAPES)
def test_fp32_logits_match_transformers(gemma4_models, name):
    """41 rows: past the sliding window of 8, so both kinds of layer mask and rope as they must."""
    _, models = gemma4_models
    hf, paths = models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    assert m.arch == "gemma4"
    ids = F.ids(41, hf.config.vocab_size)
    a, b = F.ours_logits(m, ids), M.hf_logits(hf, ids)
    err = float(np.abs(a - b).max())
    print(f"gemma4 {name}: max |dlogit| {err:.2e} (|logit| up to {np.abs(b).max():.2f})")
    assert err < FP32_BAR


@pytest.mark.parametrize("name", SHAPES)
def test_fp32_greedy_tokens_match_transformers(gemma4_models, name):
    _, models = gemma4_models
    hf, paths = models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    prompt = F.ids(9, hf.config.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    s = d.create_session(m, d.KVDtype.f32, n_ctx=64)
    got = []
    d.generate(m, s, prompt, d.SamplingParams(), 24, lambda i, p: got.append(i))
    assert len(got) >= 12 and got == ref[:len(got)]


@pytest.mark.parametrize("mode,ft", [(d.QuantMode.fp32, "f32"), (d.QuantMode.q8, "q8_0")])
@pytest.mark.parametrize("name", SHAPES)
def test_decode_paged_and_flat_equal_one_prefill(gemma4_models, name, mode, ft):
    _, models = gemma4_models
    hf, paths = models[name]
    m = d.load_model(paths[ft], mode=mode)
    ids = F.ids(33, hf.config.vocab_size, seed=2)
    one = F.ours_logits(m, ids)
    flat = F.prefill_decode(m, d.create_session(m, d.KVDtype.f32, n_ctx=64), ids, 5)
    pool = d.create_kv_pool(m, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=32)
    paged = F.prefill_decode(m, d.create_session(m, pool), ids, 5)
    assert np.array_equal(flat, one)
    assert np.array_equal(paged, one)


@pytest.mark.parametrize("name", SHAPES)
def test_batched_equals_alone(gemma4_models, name):
    _, models = gemma4_models
    hf, paths = models[name]
    F.batched_equals_alone(d.load_model(paths["q8_0"]), hf.config.vocab_size)


@pytest.mark.parametrize("name", ["eseries", "dense"])
def test_prefix_cache_hit_equals_cold_prefill(gemma4_models, name):
    """A donated prefill's full pages attached by a longer prompt: its tail's logits equal a cold
    prefill's bitwise (the sharing layers read the attached pages of the layers they share)."""
    _, models = gemma4_models
    hf, paths = models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    V = hf.config.vocab_size
    prompt = F.ids(30, V, seed=7)
    pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32, max_pages=64)
    cache = d.create_prefix_cache()
    a = d.create_session(m, pool)
    d.eval(m, a, prompt)
    d.prefix_insert(cache, pool, a, a.history)
    longer = prompt + F.ids(9, V, seed=8)[1:]
    b = d.create_session(m, pool)
    assert d.prefix_attach(cache, pool, b, longer) == 24
    d.eval(m, b, longer[24:])
    cold = d.create_session(m, d.KVDtype.f32, n_ctx=64)
    d.eval(m, cold, longer)
    assert np.array_equal(np.array(b.logits), np.array(cold.logits))
    for s in (a, b):
        d.release_kv_pages(s)
    d.prefix_release(cache, pool)
    assert pool.stats().used == 0


def test_shared_kv_layers_take_no_pool_rows(gemma4_models):
    """The E-series model's 6 layers keep 4 caches: a page holds rows of 4 layers, K and V, each row as
    wide as the widest cached layer (the global layers' 2 x 32); the dense model's 6 layers keep 6."""
    _, models = gemma4_models
    for name, layers, kv_dim in (("eseries", 4, 64), ("dense", 6, 32)):
        m = d.load_model(models[name][1]["f32"], mode=d.QuantMode.fp32)
        pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32, max_pages=4)
        assert pool.stats().page_bytes == layers * 2 * 8 * kv_dim * 4, name


# -- the tokenizer ---------------------------------------------------------------------------------------

TEXTS = ["Hello world", " Hello  world!\n\nthe fox", "def add(a, b):\n    return a + b\n", "\u00c4pfel 1234",
         "<|turn>user\nhi<turn|>\n", "tabs\tand\n\n\n\nnewlines", "unseen \u4e2d\u6587 \U0001f999 chars"]


def test_tokenizer_matches_transformers(gemma4_models):
    tok, models = gemma4_models
    m = d.load_model(models["dense"][1]["f32"], mode=d.QuantMode.fp32)
    for t in TEXTS:
        ref = tok(t, add_special_tokens=False).input_ids
        assert d.encode(m, t, add_special=False, parse_special=True) == ref, t
        assert d.decode(m, ref) == tok.decode(ref, skip_special_tokens=True), t


def test_real_vocabulary_matches_llama_cpp():
    """llama.cpp's own tokenizations of its test text on the real Gemma-4 vocabulary (262144 tokens,
    514906 merges): every one equal, BOS added as the file says."""
    path = G.llama_cpp_file("models/ggml-vocab-gemma-4.gguf")
    texts = open(path + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outs = open(path + ".out", encoding="utf-8").read().split("\n")
    assert len(outs) >= len(texts)
    from dasllama import _core

    tok = _core.Tokenizer.from_gguf(path)
    bad = []
    for t, o in zip(texts, outs):
        want = [int(x) for x in o.split()]
        got = list(tok.encode(t, add_special=False))
        if got != want:
            bad.append((t, got, want))
    assert not bad, bad[:3]


# -- the chat template and its reply formats ---------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def _hf_ids(tok, messages, **kw):
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"])


def _whole(model, chat):
    from dasllama.chat import turns

    tail = d.render_turn(model, chat)
    full = turns.prompt_ids(chat)
    assert full[len(full) - len(tail):] == tail
    return full


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_template_matches_transformers(gemma4_models, thinking):
    """Gemma-4's own template (the file carries it: llama.cpp's copy of google/gemma-4-31B-it's) rendered
    by our chat layer token-identical with apply_chat_template: a system turn, a tool call with its
    result inside the model turn, an answer, a second question; thinking on and off."""
    tok, models = gemma4_models
    m = d.load_model(models["dense"][1]["f32"], mode=d.QuantMode.fp32)
    chat = d.create_chat_renderer(m, system="You help with weather.")
    d.set_thinking(chat, thinking)
    d.set_tools(chat, [json.dumps(WEATHER)])
    d.add_user(chat, "Weather in Paris?")
    kw = dict(tools=[WEATHER], add_generation_prompt=True, enable_thinking=thinking)
    msgs = [{"role": "system", "content": "You help with weather."}, {"role": "user", "content": "Weather in Paris?"}]
    assert _whole(m, chat) == _hf_ids(tok, msgs, **kw)
    d.render_assistant_calls(m, chat, "", [json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}})])
    d.add_tool_results(chat, ['{"temp_c": 21}'], names=["get_weather"])
    tc = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    msgs += [{"role": "assistant", "content": "", "tool_calls": [tc]},
             {"role": "tool", "content": '{"temp_c": 21}', "name": "get_weather"}]
    assert _whole(m, chat) == _hf_ids(tok, msgs, **kw)
    d.render_assistant(m, chat, "It is 21 °C in Paris.")
    d.add_user(chat, "Thanks!")
    msgs += [{"role": "assistant", "content": "It is 21 °C in Paris."}, {"role": "user", "content": "Thanks!"}]
    assert _whole(m, chat) == _hf_ids(tok, msgs, **kw)


def test_generation_stops(gemma4_models):
    """A model turn ends at <turn|> (end of generation for the model, as llama.cpp has it) and a chat
    also stops at <|tool_response> (the template's pause after a tool call)."""
    tok, models = gemma4_models
    m = d.load_model(models["dense"][1]["f32"], mode=d.QuantMode.fp32)
    turn_end, tool_resp = tok.convert_tokens_to_ids(["<turn|>", "<|tool_response>"])
    assert turn_end in m.eog_ids
    chat = d.create_chat_renderer(m)
    d.add_user(chat, "hi")
    d.render_turn(m, chat)
    assert {turn_end, tool_resp} <= set(chat.stop_ids)


def test_reply_parsers():
    """Gemma-4's wire formats: the thought span as reasoning, <|tool_call>call:NAME{...}<tool_call|> as calls
    with <|"|>-quoted strings, numbers, booleans, lists and nested objects; a malformed call stays content."""
    from dasllama.chat import reasoning, tools

    reply = ('<|channel>thought\nNeed the weather.<channel|>Let me check.'
             '<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:2,metric:true,'
             'hours:[9,12],opts:{lang:<|"|>en<|"|>,x:null}}<tool_call|>')
    fmt = reasoning.think_format(None, "<|channel>thought")
    assert fmt == "channel" and tools.tool_format("<|tool_call>call:") == "dsl"
    split = reasoning.split_text(fmt, reasoning.think_stream(fmt, True, ""), reply)
    assert split.reasoning == "Need the weather."
    r = tools.parse_reply("dsl", reply, split)
    assert r.content == "Let me check." and len(r.calls) == 1 and r.calls[0].name == "get_weather"
    assert json.loads(r.calls[0].args) == {"city": "Paris, FR", "days": 2, "metric": True, "hours": [9, 12],
                                           "opts": {"lang": "en", "x": None}}
    # Streamed in pieces that cut the markers, the split is the same.
    ts = reasoning.think_stream(fmt, True, "")
    parts = [reasoning.think_feed(ts, reply[i:i + 3]) for i in range(0, len(reply), 3)] + [reasoning.think_finish(ts)]
    assert "".join(p[0] for p in parts).strip() == "Need the weather."
    bad = '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'
    r = tools.parse_reply("dsl", bad)
    assert r.calls == [] and r.content == bad
