"""Hybrid families against transformers: tiny random Qwen3.5 (gated-DeltaNet layers between
output-gated full-attention layers) and Qwen3-Next (the same with experts; tests/oracles/hybrid.py)
written to GGUF by llama.cpp's own convert_hf_to_gguf.py (--no-mtp).

fp32 mode on the f32 file is held to the HF model in fp32 (eager attention; its chunked delta rule
for a prefill, its recurrent step for decode in generate). The recurrent layers' state lives in the
session beside the KV: decode steps equal one prefill bitwise (the delta rule runs token by token in
both: a prefill takes the chunked form only for runs of 64 rows or more, checked on its own), paged equals flat, a batched step (sessions prefilling and decoding together) equals each
session alone, and a session rewinds only where its recurrent state is kept.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dasllama as d  # noqa: E402
import _family as F  # noqa: E402
from dasllama.chat import turns  # noqa: E402
import torch  # noqa: E402  (the oracle; never skipped)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import hybrid as H  # noqa: E402
import moe as M  # noqa: E402

FP32_BAR = 1e-4


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory, smollm2_path):
    out = str(tmp_path_factory.mktemp("hybrid-gguf"))
    tok = M.tokenizer(str(smollm2_path))
    return {name: H.build(name, tok, out) for name in H.FAMILIES}


def test_converter_layout(hybrid_models):
    """The file carries what the decoder reads: recurrent layers flagged per layer, the ssm shapes,
    the gated query (2 head_dim rows per head) and the FFN norm stored as post_attention_norm."""
    from gguf import GGUFReader

    r = GGUFReader(hybrid_models["qwen35"][1]["f32"])
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("qwen35.")}
    assert f["qwen35.attention.recurrent_layers"] == [True, False, True, False]
    assert (f["qwen35.ssm.group_count"], f["qwen35.ssm.time_step_rank"], f["qwen35.ssm.state_size"]) == (2, 4, 16)
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert names["blk.0.attn_qkv.weight"] == (64, 2 * 2 * 16 + 4 * 16)
    assert names["blk.0.ssm_conv1d.weight"] == (4, 128)
    assert names["blk.1.attn_q.weight"] == (64, 2 * 4 * 16)
    assert "blk.1.post_attention_norm.weight" in names and "blk.1.ffn_norm.weight" not in names
    assert not any(n.startswith("blk.0.attn_k") for n in names)  # recurrent layers keep no KV


@pytest.mark.parametrize("name", list(H.FAMILIES))
def test_fp32_logits_match_transformers(hybrid_models, name):
    hf, paths = hybrid_models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    assert m.arch == name
    ids = F.ids(41, hf.config.vocab_size)
    a, b = F.ours_logits(m, ids), M.hf_logits(hf, ids)
    err = float(np.abs(a - b).max())
    print(f"{name}: max |Δlogit| {err:.2e} (|logit| up to {np.abs(b).max():.2f})")
    assert err < FP32_BAR


@pytest.mark.parametrize("name", list(H.FAMILIES))
def test_chunked_prefill_matches_transformers(hybrid_models, name):
    """A prefill of 150 tokens runs the delta rule in its chunked form (runs of 64 rows or more: two
    whole chunks and a partial one), as transformers' own prefill does: fp32 logits held to it. Decode
    steps after a 100-token (chunked) prefill agree with one prefill to the same bar, not bitwise (the
    two forms round differently)."""
    hf, paths = hybrid_models[name]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    ids = F.ids(150, hf.config.vocab_size, seed=11)
    one = F.ours_logits(m, ids)
    err = float(np.abs(one - M.hf_logits(hf, ids)).max())
    print(f"{name}: chunked prefill max |Δlogit| {err:.2e}")
    assert err < FP32_BAR
    steps = F.prefill_decode(m, d.create_session(m, d.KVDtype.f32, n_ctx=160), ids[:106], 100)
    assert float(np.abs(steps - one[:106]).max()) < FP32_BAR


@pytest.mark.parametrize("isa", d.system_info()["isa_supported"])
def test_every_isa(hybrid_models, isa):
    """The kernels of every ISA variant the CPU runs (the output gate's sigmoid GLU among them): fp32
    mode held to transformers, and q8 mode's decode steps equal to one prefill, bitwise."""
    before = d.get_isa()
    d.set_isa(isa)
    try:
        hf, paths = hybrid_models["qwen35"]
        ids = F.ids(25, hf.config.vocab_size, seed=4)
        m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
        assert float(np.abs(F.ours_logits(m, ids) - M.hf_logits(hf, ids)).max()) < FP32_BAR, isa
        q = d.load_model(paths["q8_0"])
        flat = F.prefill_decode(q, d.create_session(q, d.KVDtype.f32, n_ctx=64), ids, 3)
        assert np.array_equal(flat, F.ours_logits(q, ids)), isa
    finally:
        d.set_isa(before)


@pytest.mark.parametrize("name", list(H.FAMILIES))
def test_fp32_greedy_tokens_match_transformers(hybrid_models, name):
    hf, paths = hybrid_models[name]
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
@pytest.mark.parametrize("name", list(H.FAMILIES))
def test_decode_paged_and_flat_equal_one_prefill(hybrid_models, name, mode, ft):
    """Token-by-token decode (the recurrent step) equals one prefill, bitwise, flat and through pages
    of 4 rows (the recurrent layers take no pages: the pool's geometry has the attention layers only)."""
    hf, paths = hybrid_models[name]
    m = d.load_model(paths[ft], mode=mode)
    ids = F.ids(33, hf.config.vocab_size, seed=2)
    one = F.ours_logits(m, ids)
    flat = F.prefill_decode(m, d.create_session(m, d.KVDtype.f32, n_ctx=64), ids, 5)
    pool = d.create_kv_pool(m, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=32)
    paged = F.prefill_decode(m, d.create_session(m, pool), ids, 5)
    assert np.array_equal(flat, one)
    assert np.array_equal(paged, one)


@pytest.mark.parametrize("mode,ft", [(d.QuantMode.fp32, "f32"), (d.QuantMode.q8, "q8_0")])
def test_batched_equals_alone(hybrid_models, mode, ft):
    """Sessions stepped together (one prefilling chunks in the same steps) keep their own recurrent
    state: each gets its own logits, bitwise."""
    hf, paths = hybrid_models["qwen35"]
    F.batched_equals_alone(d.load_model(paths[ft], mode=mode), hf.config.vocab_size)


def test_rewind_only_where_state_is_kept(hybrid_models):
    """A recurrent state cannot be rewound like KV rows: truncate goes to 0 (a fresh state) or stays
    put; elsewhere it says so, and rewind_point names where it can go."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    ids = F.ids(12, hf.config.vocab_size, seed=5)
    s = d.create_session(m, d.KVDtype.f32, n_ctx=32)
    d.eval(m, s, ids)
    assert s.rewind_point(12) == 12 and s.rewind_point(7) == 0
    with pytest.raises(d.DasllamaError, match="recurrent"):
        s.truncate(7)
    assert s.n_past == 12
    s.truncate(0)
    d.eval(m, s, ids)
    assert np.array_equal(np.array(s.logits), F.ours_logits(m, ids)[-1])


# -- the recurrent state in the prefix cache and across chat turns --------------------------------------

def _cold(m, ids):
    s = d.create_session(m, d.KVDtype.f32, n_ctx=len(ids) + 8)
    d.eval(m, s, ids)
    return np.array(s.logits)


def test_prefix_cache_hit_restores_the_state(hybrid_models):
    """A donated prefill leaves a state snapshot at the last page boundary it crossed; a new session
    attaches the pages up to that boundary, the state is restored there, and its tail gives the cold
    prefill's logits bitwise. Pages and snapshots are freed together."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    V = hf.config.vocab_size
    prompt = F.ids(30, V, seed=7)
    pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32, max_pages=64)
    cache = d.create_prefix_cache()
    a = d.create_session(m, pool)
    d.eval(m, a, prompt)
    d.prefix_insert(cache, pool, a, a.history)
    assert cache.states_held == 1  # the boundary at 24 (the prefill's end, 30, is not a page's)
    longer = prompt + F.ids(9, V, seed=8)[1:]
    b = d.create_session(m, pool)
    assert d.prefix_attach(cache, pool, b, longer) == 24
    d.eval(m, b, longer[24:])
    assert np.array_equal(np.array(b.logits), _cold(m, longer))
    # A prompt that diverges inside the snapshot's page attaches nothing: no page before it has a state.
    c = d.create_session(m, pool)
    assert d.prefix_attach(cache, pool, c, prompt[:20] + [5] * 10) == 0
    for s in (a, b, c):
        d.release_kv_pages(s)
    d.prefix_release(cache, pool)
    assert cache.states_held == 0 and pool.stats().used == 0


def test_snapshot_budget(hybrid_models):
    """The cache keeps at most max_states snapshots (least recently used pages give theirs up first)."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    pool = d.create_kv_pool(m, page_rows=4, kv_dtype=d.KVDtype.f32)
    cache = d.create_prefix_cache()
    cache.max_states = 2
    for seed in range(4):
        s = d.create_session(m, pool)
        d.eval(m, s, F.ids(10, hf.config.vocab_size, seed=20 + seed))
        d.prefix_insert(cache, pool, s, s.history)
        d.release_kv_pages(s)
        assert cache.states_held == min(seed + 1, 2)
    d.prefix_release(cache, pool)
    assert cache.states_held == 0 and pool.stats().used == 0


@pytest.mark.parametrize("paged", [False, True])
def test_second_chat_turn_prefills_only_its_new_tokens(hybrid_models, paged):
    """A chat on the hybrid: the turn's close re-syncs the KV to the rendered transcript (rewinding the
    recurrent state to the snapshot at the prompt's end when the reply re-tokenizes differently), so
    the second turn prefills only its new tokens; its logits equal a cold prefill of the same ids. A
    second conversation over the same cache attaches the first one's pages with their state."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    kw = {}
    if paged:
        kw["pool"] = pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32)
        kw["cache"] = cache = d.create_prefix_cache()
    chat = d.create_chat(m, system="You are terse.", max_new=6, kv_dtype=d.KVDtype.f32, **kw)
    d.add_user(chat, "What is the capital of France?")
    d.respond(m, chat)
    held = chat.session.n_past
    d.add_user(chat, "And of Italy?")
    ids2 = turns.prompt_ids(chat)
    assert list(chat.session.history) == ids2[:held]  # the closed first turn is what the KV holds
    before = chat.media_stats["rows_prefilled"]
    seen = {}

    def first(piece):
        if not seen:
            seen["prefilled"] = chat.media_stats["rows_prefilled"] - before
            seen["logits"] = np.array(chat.session.logits)
            seen["n_past"] = chat.session.n_past
        return True

    d.respond(m, chat, on_piece=first)
    assert seen["prefilled"] == len(ids2) - held
    assert seen["n_past"] >= len(ids2)
    assert np.array_equal(seen["logits"], _cold(m, list(chat.session.history)[:seen["n_past"]]))
    if paged:
        other = d.create_chat(m, system="You are terse.", max_new=4, **kw)
        d.add_user(other, "What is the capital of France?")
        d.respond(m, other)
        assert other.media_stats["rows_attached"] > 0


def test_truncate_to_a_snapshot(hybrid_models):
    """eval snapshots the state at a prefill's end: a session rewinds there after decoding (as a chat
    does when a reply re-renders differently) and continues as a cold prefill would."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    ids = F.ids(14, hf.config.vocab_size, seed=11)
    s = d.create_session(m, d.KVDtype.f32, n_ctx=40)
    d.eval(m, s, ids)
    for t in (5, 6, 7):
        d.eval(m, s, [t])
    assert s.rewind_point(16) == 14 and s.rewind_point(13) == 0
    s.truncate(14)
    d.eval(m, s, [9, 10])
    assert np.array_equal(np.array(s.logits), _cold(m, ids + [9, 10]))


# -- a state machine over attach, eval, rewind, donate and release --------------------------------------

from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

_SM = {}


class HybridSnapshots(RuleBasedStateMachine):
    """Sessions of a hybrid over one pool and prefix cache (pages of 4 rows, 3 snapshots at most):
    every evaluation's logits equal a cold prefill of the session's history, bitwise, whatever was
    attached, rewound or released before; at the end every page and snapshot is back."""

    def __init__(self):
        super().__init__()
        self.m = _SM["model"]
        self.pool = d.create_kv_pool(self.m, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=256)
        self.cache = d.create_prefix_cache()
        self.cache.max_states = 3
        self.sessions = []

    def _check(self, s):
        assert np.array_equal(np.array(s.logits), _cold(self.m, list(s.history)))

    @precondition(lambda self: len(self.sessions) < 3)
    @rule(prompt=st.lists(st.integers(10, 13), min_size=2, max_size=18))
    def open_and_prefill(self, prompt):
        s = d.create_session(self.m, self.pool)
        n = d.prefix_attach(self.cache, self.pool, s, prompt)
        assert n % 4 == 0 and n < len(prompt)
        d.eval(self.m, s, prompt[n:])
        self._check(s)
        self.sessions.append(s)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 2), toks=st.lists(st.integers(10, 13), min_size=1, max_size=6))
    def extend(self, i, toks):
        s = self.sessions[i % len(self.sessions)]
        if s.n_past + len(toks) > 60:
            return
        d.eval(self.m, s, toks)
        self._check(s)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 2), back=st.integers(0, 12), tok=st.integers(10, 13))
    def rewind(self, i, back, tok):
        s = self.sessions[i % len(self.sessions)]
        p = s.rewind_point(max(0, s.n_past - back))
        s.truncate(p)
        assert s.n_past == p
        d.eval(self.m, s, [tok])
        self._check(s)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 2))
    def donate(self, i):
        s = self.sessions[i % len(self.sessions)]
        d.prefix_insert(self.cache, self.pool, s, s.history)

    @precondition(lambda self: self.sessions)
    @rule(i=st.integers(0, 2))
    def release(self, i):
        d.release_kv_pages(self.sessions.pop(i % len(self.sessions)))

    @invariant()
    def within_budget(self):
        assert self.cache.states_held <= 3

    def teardown(self):
        for s in self.sessions:
            d.release_kv_pages(s)
        d.prefix_release(self.cache, self.pool)
        assert self.cache.states_held == 0 and self.pool.stats().used == 0


def test_snapshot_state_machine(hybrid_models):
    _SM["model"] = d.load_model(hybrid_models["qwen35"][1]["f32"], mode=d.QuantMode.fp32)
    run = settings(max_examples=25, stateful_step_count=12, deadline=None)(HybridSnapshots).TestCase
    run("runTest").runTest()


def test_batched_prefill_snapshots_for_the_cache(hybrid_models):
    """eval_batch (the server's step) snapshots a hybrid session as eval does: a prefill in a ragged
    step beside a decoding session leaves its page-boundary snapshot, which a later session attaches."""
    hf, paths = hybrid_models["qwen35"]
    m = d.load_model(paths["f32"], mode=d.QuantMode.fp32)
    V = hf.config.vocab_size
    prompt, other = F.ids(30, V, seed=12), F.ids(5, V, seed=13)
    pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32)
    cache = d.create_prefix_cache()
    a, b = d.create_session(m, pool), d.create_session(m, pool)
    d.eval(m, b, other)
    d.eval_batch(m, d.create_batch_workspace(m), [b, a], [7, prompt])
    assert np.array_equal(np.array(a.logits), _cold(m, prompt))
    d.prefix_insert(cache, pool, a, a.history)
    assert cache.states_held == 1
    c = d.create_session(m, pool)
    assert d.prefix_attach(cache, pool, c, prompt + [9]) == 24
    d.eval(m, c, (prompt + [9])[24:])
    assert np.array_equal(np.array(c.logits), _cold(m, prompt + [9]))
