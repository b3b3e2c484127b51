"""Mixture-of-experts families against transformers: tiny random Qwen3-MoE, Qwen2-MoE and gpt-oss
models (tests/oracles/moe.py) written to GGUF by llama.cpp's own convert_hf_to_gguf.py; gpt-oss's
experts come from an MXFP4 checkpoint (blocks and scales, as openai's files ship) and stay MXFP4 in
the GGUF, as real gpt-oss files carry them.

fp32 mode on the f32 file is held to the HF model in fp32 eager attention: measured max |Δlogit|
1.5e-6..1.7e-6 on logits up to ~3.4 (gpt-oss's MXFP4 experts included); the bar 1e-4 is 60x that, while flipping the top-k
renormalization (0.5..1.2), routing to one expert fewer (0.3..1.5), dropping qwen2moe's shared
expert (0.9), or in gpt-oss dropping the sinks (1.6), truncating YaRN's range (0.7), unclamping
the SwiGLU (3.1) or the sliding window (4.8) moves them far more (measured by mutating the reference). The
bitwise guarantees of the dense families hold here too (every expert's rows are computed by the
dense kernels, whatever other tokens share the expert): decode steps equal one prefill, paged
equals flat, a batched step equals each session alone -- on the f32 file in fp32 mode and on the
converter's q8_0 file in the default q8 mode.
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
from dasllama.chat import turns  # noqa: E402
import torch  # noqa: E402,F401  (the oracle; never skipped)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import moe as M  # noqa: E402

FP32_BAR = 1e-4
FAMILIES = list(M.FAMILIES)


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory, smollm2_path):
    """{family: (hf_model, {outtype: path})}, converted once per session."""
    out = str(tmp_path_factory.mktemp("moe-gguf"))
    tok = M.tokenizer(str(smollm2_path))
    return {name: M.build(name, tok, out) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_logits_match_transformers(moe_models, name):
    hf, paths = moe_models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    assert m.arch == name
    ids = F.ids(41, hf.config.vocab_size)
    a, b = F.ours_logits(m, ids), M.hf_logits(hf, ids)
    err = float(np.abs(a - b).max())
    print(f"{name}: max |Δlogit| {err:.2e} (|logit| up to {np.abs(b).max():.2f})")
    assert err < FP32_BAR


@pytest.mark.parametrize("isa", d.system_info()["isa_supported"])
def test_every_isa(moe_models, isa):
    """The expert kernels of every ISA variant the CPU runs (picked at run time): fp32 mode held to
    transformers, and the q8 mode's in-place quantized experts (q8_0, gpt-oss's MXFP4) bitwise between
    decode steps and one prefill."""
    before = d.get_isa()
    d.set_isa(isa)
    try:
        for name in FAMILIES:
            hf, paths = moe_models[name]
            ids = F.ids(25, hf.config.vocab_size, seed=4)
            m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
            assert float(np.abs(F.ours_logits(m, ids) - M.hf_logits(hf, ids)).max()) < FP32_BAR, (isa, name)
            q = d.load_model(paths["q8_0"])
            flat = F.prefill_decode(q, d.create_session(q, d.KVDtype.f32, n_ctx=64), ids, 3)
            assert np.array_equal(flat, F.ours_logits(q, ids)), (isa, name)
    finally:
        d.set_isa(before)


@pytest.mark.parametrize("name", FAMILIES)
def test_fp32_greedy_tokens_match_transformers(moe_models, name):
    hf, paths = moe_models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    prompt = F.ids(9, hf.config.vocab_size, seed=1)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    s = d.create_session(m, d.KVDtype.f32, n_ctx=64)
    got = []
    d.generate(m, s, prompt, d.SamplingParams(), 24, lambda i, p: got.append(i))
    # Ours stops at an end-of-generation id (HF was told not to): the same tokens up to there.
    assert len(got) >= 12 and got == ref[:len(got)]


@pytest.mark.parametrize("mode,ft", [(d.QuantMode.fp32, "f32"), (d.QuantMode.q8, "q8_0")])
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_paged_and_flat_equal_one_prefill(moe_models, name, mode, ft):
    """Token-by-token decode (k experts streamed per token) equals one prefill (tokens grouped by
    expert), bitwise, flat and through pages of 4 rows."""
    hf, paths = moe_models[name]
    m = d.load_model(paths[ft], mode=mode)
    ids = F.ids(33, hf.config.vocab_size, seed=2)
    one = F.ours_logits(m, ids)
    flat = F.prefill_decode(m, d.create_session(m, d.KVDtype.f32, n_ctx=64), ids, 5)
    pool = d.create_kv_pool(m, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=32)
    paged = F.prefill_decode(m, d.create_session(m, pool), ids, 5)
    assert np.array_equal(flat, one)
    assert np.array_equal(paged, one)


@pytest.mark.parametrize("mode,ft", [(d.QuantMode.fp32, "f32"), (d.QuantMode.q8, "q8_0")])
@pytest.mark.parametrize("name", FAMILIES)
def test_batched_equals_alone(moe_models, name, mode, ft):
    """Sessions stepped together (one prefilling a chunk in the same steps, so experts see tokens of
    several sessions at once) give each session's own logits, bitwise."""
    hf, paths = moe_models[name]
    F.batched_equals_alone(d.load_model(paths[ft], mode=mode), hf.config.vocab_size)


def test_gpt_oss_mxfp4_in_place_q8(moe_models):
    """In the default q8 mode the MXFP4 experts are read in place (no conversion: the resident bytes
    are the file's), the rest is q8_0; logits stay near the reference and greedy picks agree."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GT

    hf, paths = moe_models["gpt-oss"]
    m = d.load_model(paths["q8_0"])
    r = GGUFReader(paths["q8_0"])
    want = 0
    for t in r.tensors:
        if len(t.shape) < 2 or t.name.endswith(".bias"):  # vectors (the expert biases are [n_expert][rows])
            continue
        if t.tensor_type in (GT.MXFP4, GT.Q8_0):
            want += int(t.n_bytes)
        else:  # kept f32 by the converter (the router), q8_0 at load
            bs, ts = GGML_QUANT_SIZES[GT.Q8_0]
            want += int(t.n_elements) // bs * ts
        if "_exps" in t.name:
            assert t.tensor_type == GT.MXFP4, t.name
    assert m._m.weight_bytes == want
    ids = F.ids(41, hf.config.vocab_size)
    a, b = F.ours_logits(m, ids), M.hf_logits(hf, ids)
    err = np.abs(a - b).max(1)
    print(f"q8: per-row max |Δlogit| median {np.median(err):.3g}, max {err.max():.3g}; "
          f"top-1 agreement {(a.argmax(1) == b.argmax(1)).mean():.3f}")
    # Quantized activations may flip a near-tie routing choice on a few rows (a discrete jump);
    # most rows stay close and greedy picks agree.
    assert np.median(err) < 0.1
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.9


def test_converter_layout_and_shared_expert(moe_models):
    """The files carry what the decoder reads: stacked experts, qwen2moe's shared expert and its
    gate (a matrix of one row; older files hold it 1-D, read the same), the converter's q8_0 stacks."""
    from gguf import GGUFReader

    r = GGUFReader(moe_models["qwen2moe"][1]["f32"])
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert names["blk.0.ffn_gate_exps.weight"] == (64, 32, 8)
    assert names["blk.0.ffn_down_exps.weight"] == (32, 64, 8)
    assert names["blk.0.ffn_gate_inp_shexp.weight"] == (64, 1)
    assert names["blk.2.ffn_down_shexp.weight"] == (64, 64)
    r3 = GGUFReader(moe_models["qwen3moe"][1]["q8_0"])
    types = {t.name: t.tensor_type.name for t in r3.tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "Q8_0"
    ro = GGUFReader(moe_models["gpt-oss"][1]["f32"])
    oss = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in ro.tensors}
    assert oss["blk.0.ffn_gate_exps.weight"][0] == "MXFP4" and oss["blk.0.attn_sinks.weight"] == ("F32", (4,))
    assert oss["blk.0.ffn_down_exps.bias"] == ("F32", (64, 8))


# -- gpt-oss chat: Harmony with gpt-oss's own template ---------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def oss_chat(moe_models):
    from transformers import AutoTokenizer

    path = moe_models["gpt-oss"][1]["q8_0"]
    hf_tok = AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(path), "gpt-oss-hf"))
    return d.load_model(path), hf_tok


def _hf_ids(tok, msgs, **kw):
    return list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)["input_ids"])


@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_gpt_oss_template_matches_transformers(oss_chat, effort):
    """The file's own template (gpt-oss's, embedded by the converter) renders token-identically to
    transformers' apply_chat_template: system, tools, a tool call and its result, a final answer and a
    second question; reasoning effort is a template argument (default medium)."""
    m, tok = oss_chat
    chat = d.create_chat_renderer(m, system="You help with weather.")
    assert "<|channel|>" in chat.template and "reasoning_effort" in chat.template
    kw = {} if effort is None else {"reasoning_effort": effort}
    chat.template_kwargs = dict(kw)
    chat.tools = [WEATHER]
    d.add_user(chat, "Weather in Paris?")
    msgs = [{"role": "system", "content": "You help with weather."}, {"role": "user", "content": "Weather in Paris?"}]
    first = d.render_turn(m, chat)
    assert first == _hf_ids(tok, msgs, tools=[WEATHER], add_generation_prompt=True, **kw)
    assert f"Reasoning: {effort or 'medium'}" in d.decode(m, first)
    d.render_assistant_calls(m, chat, "", [json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})])
    d.add_tool_results(chat, ['{"temp_c": 21}'], names=["get_weather"])
    d.render_assistant(m, chat, "It is 21 °C in Paris.")
    d.add_user(chat, "Thanks!")
    msgs += [{"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": '{"temp_c": 21}', "name": "get_weather"},
             {"role": "assistant", "content": "It is 21 °C in Paris."}, {"role": "user", "content": "Thanks!"}]
    tail = d.render_turn(m, chat)
    whole = turns.prompt_ids(chat)  # the whole prompt; render_turn is its part past what is held
    assert whole[len(whole) - len(tail):] == tail
    assert whole == _hf_ids(tok, msgs, tools=[WEATHER], add_generation_prompt=True, **kw)


def test_gpt_oss_reasoning_and_calls_split(oss_chat):
    """Replies in Harmony come apart into reasoning, content and tool calls; the turn-ending control
    tokens end generation."""
    m, _ = oss_chat
    chat = d.create_chat_renderer(m)
    reply = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
    assert d.split_reasoning(chat, reply) == d.ThinkSplit("User asks 2+2. Simple.", "2 + 2 = 4.")
    r = d.parse_calls(chat, "<|channel|>analysis<|message|>Need the weather.<|end|>"
                            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                            '<|message|>{"city":"Paris"}<|call|>')
    assert r.reasoning == "Need the weather." and r.content == ""
    assert [(c.name, json.loads(c.args)) for c in r.calls] == [("get_weather", {"city": "Paris"})]
    for t in ("<|return|>", "<|call|>"):
        assert d.encode(m, t, parse_special=True)[0] in m.eog_ids


PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Colors of the rainbow:"]


@pytest.mark.parametrize("name", FAMILIES)
def test_served_completions_equal_the_library(moe_models, name):
    """Each family behind the OpenAI-compatible server, driven by the OpenAI SDK: four concurrent
    greedy completions on two streams (batched steps, a queue) equal the library's greedy generation
    of each prompt alone, which the tests above tie to transformers."""
    import threading

    import openai
    from starlette.testclient import TestClient

    from dasllama.server import create_app

    m = d.load_model(moe_models[name][1]["q8_0"])
    want = []
    for p in PROMPTS:
        s = d.create_session(m, n_ctx=256)
        out = []
        d.generate(m, s, d.encode(m, p), d.SamplingParams(), 12, lambda i, piece: out.append(piece))
        want.append("".join(out))
    app = create_app(m, streams=2, ctx=256)
    got = [None] * len(PROMPTS)
    try:
        with TestClient(app) as c:
            cl = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)

            def ask(i):
                r = cl.completions.create(model="m", prompt=PROMPTS[i], max_tokens=12, temperature=0)
                got[i] = r.choices[0].text

            ts = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
    finally:
        app.state.engine.stop()
    assert got == want


@pytest.mark.parametrize("effort", ["low", "high"])
def test_gpt_oss_served_with_reasoning_effort(oss_chat, effort):
    """The OpenAI SDK's reasoning_effort reaches gpt-oss's template: the served prompt is token for
    token transformers' apply_chat_template with that effort; a value outside OpenAI's set is a 400."""
    import openai
    from starlette.testclient import TestClient

    from dasllama.server import create_app

    m, tok = oss_chat
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    want = _hf_ids(tok, msgs, add_generation_prompt=True, reasoning_effort=effort)
    app = create_app(m, streams=1, ctx=512)
    seen, real = [], app.state.engine.submit

    def spy(job):  # the prompt ids the engine is given
        seen.append(list(job.prompt))
        return real(job)

    app.state.engine.submit = spy
    try:
        with TestClient(app) as c:
            cl = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0)
            r = cl.chat.completions.create(model="m", messages=msgs, max_tokens=1, temperature=0,
                                           reasoning_effort=effort)
            assert seen == [want] and r.usage.prompt_tokens == len(want)
            assert f"Reasoning: {effort}" in d.decode(m, seen[0])
            with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
                cl.chat.completions.create(model="m", messages=msgs, max_tokens=1, reasoning_effort="extreme")
    finally:
        app.state.engine.stop()
