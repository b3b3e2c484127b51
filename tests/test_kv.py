"""Paged KV pool, prefix cache, ragged batches and media ids.

The reference for paged attention is the flat session (itself held to transformers in
test_llm.py): with f32 KV the same rows are read in the same order, so logits are
bitwise equal, on every kernel ISA. Attach + tail prefill is held to a cold prefill of
the same prompt; batched steps to each session decoded alone.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dasllama as d  # noqa: E402

PROMPT = ("The history of the Roman Empire spans many centuries, and historians often divide it into "
          "periods: the Republic, the Principate and the Dominate.")


def _same(a, b) -> bool:
    """Bitwise: every matmul computes a row the same whatever the rows around it (decode GEMV and
    tiled prefill agree bit for bit), attention reads the same rows in the same order paged or
    flat, so attach + tail, batched rows and decode steps reproduce a cold run exactly."""
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def m32(smollm2_path):
    return d.load_model(smollm2_path, mode=d.QuantMode.fp32)


@pytest.fixture(scope="module")
def mq8(smollm2_path):
    return d.load_model(smollm2_path)


def _prefill_decode(model, s, ids, n_first):
    """Prefill ids[:n_first] (all logits), then one token at a time; all logits stacked."""
    d.eval(model, s, ids[:n_first], all_logits=True)
    out = [np.array(s.logits).reshape(n_first, -1)]
    for t in ids[n_first:]:
        d.eval(model, s, [t])
        out.append(np.array(s.logits)[None])
    return np.concatenate(out)


@pytest.mark.parametrize("isa", d.system_info()["isa_supported"])
@pytest.mark.parametrize("kv", [d.KVDtype.f32, d.KVDtype.f16])
def test_paged_equals_flat_bitwise(m32, isa, kv):
    ids = d.encode(m32, PROMPT)
    before = d.get_isa()
    d.set_isa(isa)
    try:
        flat = _prefill_decode(m32, d.create_session(m32, kv, n_ctx=64), ids, 11)
        for page_rows in (1, 4, 16, 64):
            pool = d.create_kv_pool(m32, page_rows=page_rows, kv_dtype=kv, max_pages=64)
            s = d.create_session(m32, pool)
            got = _prefill_decode(m32, s, ids, 11)
            assert s.paged and s._s.n_pages == -(-len(ids) // page_rows)
            assert np.array_equal(got, flat), (isa, kv, page_rows)
    finally:
        d.set_isa(before)


@pytest.mark.parametrize("kv", [d.KVDtype.f32, d.KVDtype.f16, d.KVDtype.q8_0])
def test_decode_steps_equal_one_prefill(mq8, kv):
    """Token by token (a quantized cache decoded inside each attention task) equals one prefill of
    the same ids (the layer's cache decoded once for all query blocks), paged and flat."""
    ids = d.encode(mq8, PROMPT)
    pool = d.create_kv_pool(mq8, page_rows=8, kv_dtype=kv)
    for s in (d.create_session(mq8, kv, n_ctx=64), d.create_session(mq8, pool)):
        one = d.create_session(mq8, kv, n_ctx=64)
        d.eval(mq8, one, ids, all_logits=True)
        assert _same(_prefill_decode(mq8, s, ids, 1), np.array(one.logits).reshape(len(ids), -1))


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_batched_decode_quantized_cache_equals_alone(mq8, kv):
    """A batched step decodes each quantized cache inside its attention tasks; a lone session has
    it decoded by all threads first. Same bits."""
    prompts = [d.encode(mq8, PROMPT)[:k] for k in (5, 19, 33)]
    pool = d.create_kv_pool(mq8, page_rows=16, kv_dtype=kv)
    ss = [d.create_session(mq8, pool) for _ in prompts]
    alone = [d.create_session(mq8, kv, n_ctx=64) for _ in prompts]
    for s, a, p in zip(ss, alone, prompts):
        d.eval(mq8, s, p)
        d.eval(mq8, a, p)
    ws = d.create_batch_workspace(mq8)
    for _ in range(6):
        toks = [int(np.argmax(a.logits)) for a in alone]
        d.eval_batch(mq8, ws, ss, toks)
        for a, t in zip(alone, toks):
            d.eval(mq8, a, [t])
        for s, a in zip(ss, alone):
            assert _same(s.logits, a.logits)


@pytest.mark.parametrize("isa", d.system_info()["isa_supported"])
def test_f16_cache_rows_convert_exactly(m32, isa):
    """Each ISA's f16 -> f32 cache conversion (the F16C instruction where there is one, plain C
    on the baseline) through logits: the f16 session within test_llm's f16 bar of the f32 one,
    and the same greedy tokens as the baseline ISA."""
    ids = d.encode(m32, PROMPT)
    before = d.get_isa()
    try:
        d.set_isa("baseline")
        base = _prefill_decode(m32, d.create_session(m32, d.KVDtype.f16, n_ctx=64), ids, 3)
        d.set_isa(isa)
        got = _prefill_decode(m32, d.create_session(m32, d.KVDtype.f16, n_ctx=64), ids, 3)
        ref = _prefill_decode(m32, d.create_session(m32, d.KVDtype.f32, n_ctx=64), ids, 3)
    finally:
        d.set_isa(before)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3
    assert (got.argmax(1) == base.argmax(1)).all()  # other ISAs reassociate the matmuls


def test_paged_matches_transformers(m32, smollm2_hf_model):
    """The paged path against the oracle directly (pages of 8 rows, f32 KV)."""
    import torch

    hf = smollm2_hf_model
    ids = d.encode(m32, PROMPT)
    pool = d.create_kv_pool(m32, page_rows=8, kv_dtype=d.KVDtype.f32)
    got = _prefill_decode(m32, d.create_session(m32, pool), ids, 5)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() < 1e-3


def test_truncate_and_copy_on_write(m32):
    """Rewinding a paged session (into a page it shares with the cache) then going on equals a flat
    session doing the same, and the cached page is left as it was."""
    ids = d.encode(m32, PROMPT)
    alt = d.encode(m32, " Then came the fall of the West.", add_special=False)
    pool = d.create_kv_pool(m32, page_rows=8, kv_dtype=d.KVDtype.f32, max_pages=32)
    cache = d.create_prefix_cache()
    s, f = d.create_session(m32, pool), d.create_session(m32, d.KVDtype.f32, n_ctx=128)
    for x in (s, f):
        d.eval(m32, x, ids)
    d.prefix_insert(cache, pool, s, s.history)
    held = d.prefix_held_groups(cache)
    assert held == len(ids) // 8
    cached_pages = set(d._core.session_pages(s._s)[:held])
    for x in (s, f):
        x.truncate(13)  # inside the second page, which the cache holds too
        d.eval(m32, x, alt)
    assert s.history == f.history
    assert np.array_equal(np.array(s.logits), np.array(f.logits))
    # The page row 13 sits in was copied before the write; the cache kept the original.
    assert d._core.session_pages(s._s)[1] not in cached_pages
    # A fresh session attaching the original prompt still sees the original rows.
    t = d.create_session(m32, pool)
    n = d.prefix_attach(cache, pool, t, ids)
    assert n == held * 8
    d.eval(m32, t, ids[n:])
    cold = d.create_session(m32, d.KVDtype.f32, n_ctx=128)
    d.eval(m32, cold, ids)
    assert _same(t.logits, cold.logits)
    # Rewinding to 0 drops every page the session held.
    for x in (s, t):
        x.truncate(0)
        assert x._s.n_pages == 0
    st = pool.stats()
    assert st.by_sessions == 0 and st.used == st.by_cache == held


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_attach_plus_tail_equals_cold(m32, extra):
    """A donated prefix attached to a new prompt, then the tail prefilled, equals a cold prefill."""
    ids = d.encode(m32, PROMPT)
    P = 8
    pool = d.create_kv_pool(m32, page_rows=P, kv_dtype=d.KVDtype.f32, max_pages=64)
    cache = d.create_prefix_cache()
    a = d.create_session(m32, pool)
    d.eval(m32, a, ids)
    d.prefix_insert(cache, pool, a, a.history, preview="roman")
    d.release_kv_pages(a)
    assert a.n_past == 0 and a._s.n_pages == 0
    # The new prompt shares 3 full pages, then goes elsewhere; extra=0 is the cap case
    # (the prompt is exactly the cached pages: one token is left to prefill).
    shared = 3 * P
    prompt = ids[:shared] + d.encode(m32, " And so on and so forth.", add_special=False)[:extra]
    b = d.create_session(m32, pool)
    n = d.prefix_attach(cache, pool, b, prompt)
    assert n == (shared if extra else shared - 1)
    assert b.n_past == n and b.history == prompt[:n]
    d.eval(m32, b, prompt[n:], all_logits=True)
    cold = d.create_session(m32, d.KVDtype.f32, n_ctx=128)
    d.eval(m32, cold, prompt, all_logits=True)
    V = m32.config.vocab_size
    got = np.array(b.logits).reshape(-1, V)
    want = np.array(cold.logits).reshape(-1, V)[n:]
    assert _same(got, want)
    chains = d.prefix_chain_list(cache)
    assert len(chains) == 1 and chains[0].preview == "roman" and chains[0].hits == 1
    assert chains[0].tokens == (len(ids) // P) * P
    # A miss attaches nothing.
    c = d.create_session(m32, pool)
    assert d.prefix_attach(cache, pool, c, d.encode(m32, "Completely different text here, long enough.")) == 0
    assert c.n_past == 0


def test_attach_rejects_bad_use(m32, mq8):
    pool = d.create_kv_pool(m32, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=16)
    cache = d.create_prefix_cache()
    flat = d.create_session(m32, d.KVDtype.f32)
    with pytest.raises(ValueError):
        d.prefix_attach(cache, pool, flat, [1, 2, 3])
    d.eval(m32, flat, [1, 2])
    d.release_kv_pages(flat)  # no-op on a flat session
    assert flat.n_past == 2
    s = d.create_session(m32, pool)
    d.eval(m32, s, [1, 2, 3, 4, 5])
    with pytest.raises(d.DasllamaError):
        d.prefix_attach(cache, pool, s, [1, 2, 3, 4, 5, 6])  # not fresh
    with pytest.raises(d.DasllamaError):
        d.prefix_insert(cache, pool, s, [1, 2, 9, 4, 5])  # not what was evaluated
    other = d.create_kv_pool(m32, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=16)
    with pytest.raises(ValueError):
        d.prefix_insert(cache, other, s, s.history)
    d.prefix_insert(cache, pool, s, s.history)
    t = d.create_session(m32, other)
    d.eval(m32, t, [1, 2, 3, 4, 5])
    with pytest.raises(d.DasllamaError):  # a cache serves one pool
        d.prefix_insert(cache, other, t, t.history)
    with pytest.raises(ValueError):
        d.create_kv_pool(m32, page_rows=48)
    with pytest.raises(ValueError):
        d.create_kv_pool(m32, max_pages=-1)
    with pytest.raises(ValueError):
        d.create_session(mq8, pool)  # the pool belongs to another model
    with pytest.raises(ValueError):
        d.create_prefix_cache(-1)


def test_pool_exhaustion_refuses_only_the_asker(mq8):
    pool = d.create_kv_pool(mq8, page_rows=4, max_pages=6)
    a, b = d.create_session(mq8, pool), d.create_session(mq8, pool)
    d.eval(mq8, a, list(range(100, 116)))  # 4 pages
    d.eval(mq8, b, list(range(200, 205)))  # 2 pages: the pool is full
    assert pool.stats().free == 0
    ha, la = list(a.history), np.array(a.logits)
    with pytest.raises(d.PoolExhaustedError):
        d.eval(mq8, b, [1, 2, 3, 4])  # needs a third page
    assert b.n_past == 5 and b._s.n_pages == 2 and a.history == ha
    assert np.array_equal(np.array(a.logits), la)
    d.eval(mq8, b, [7, 8, 9])  # fits in its second page: still usable
    assert b.n_past == 8
    ws = d.create_batch_workspace(mq8)
    with pytest.raises(d.PoolExhaustedError) as e:
        d.eval_batch(mq8, ws, [a, b], [5, 6])  # both need a fresh page; a asks first
    assert e.value.session_index == 0
    assert a.n_past == 16 and b.n_past == 8 and pool.stats().free == 0
    d.release_kv_pages(b)
    d.eval_batch(mq8, ws, [a], [5])
    assert a.n_past == 17
    assert pool.stats().used == 5


@pytest.mark.parametrize("page_rows", [4, 64])
def test_eval_batch_paged_equals_each_alone(m32, page_rows):
    """B paged sessions at different lengths stepped together (one of them prefilling a chunk in
    the same steps) give each session's own logits, bitwise with f32 KV."""
    prompts = ["The cat sat on", "Paris is the capital of", "def main():\n    ", "1, 2, 3, 4, 5, 6, 7,"]
    ids = [d.encode(m32, p) for p in prompts]
    pool = d.create_kv_pool(m32, page_rows=page_rows, kv_dtype=d.KVDtype.f32)
    ss = [d.create_session(m32, pool) for _ in prompts]
    for s, x in zip(ss, ids[:3]):
        d.eval(m32, s, x)
    late = d.encode(m32, PROMPT)  # the fourth session prefills in chunks while the others decode
    chunks = [late[i:i + 9] for i in range(0, len(late), 9)]
    ws = d.create_batch_workspace(m32)
    for step in range(len(chunks) + 4):
        group = [int(np.argmax(s.logits)) for s in ss[:3]]
        group.append(chunks[step] if step < len(chunks) else int(np.argmax(ss[3].logits)))
        ref = []
        for s, t in zip(ss, group):  # each one alone on a copy of its history, same paging
            c = d.create_session(m32, d.create_kv_pool(m32, page_rows=page_rows, kv_dtype=d.KVDtype.f32))
            d.eval(m32, c, list(s.history) + ([t] if isinstance(t, int) else list(t)))
            ref.append(np.array(c.logits))
        d.eval_batch(m32, ws, ss, group)
        for s, r in zip(ss, ref):
            assert _same(s.logits, r)
    assert ss[3].history[:len(late)] == late
    with pytest.raises(d.DasllamaError):
        d.eval_batch(m32, ws, [ss[0], d.create_session(m32, d.KVDtype.f32)], [1, 2])  # flat + paged
    with pytest.raises(ValueError):
        d.eval_batch(m32, ws, [ss[0]], [[]])


def test_ragged_long_chunk_crosses_model_chunks(mq8):
    """A prefill chunk longer than the model's internal chunk (256 rows) inside a batch."""
    rng = np.random.default_rng(1)
    long = [int(x) for x in rng.integers(100, 20000, 300)]
    pool = d.create_kv_pool(mq8, page_rows=64)
    a, b = d.create_session(mq8, pool), d.create_session(mq8, pool)
    d.eval(mq8, a, [1, 2, 3])
    d.eval_batch(mq8, d.create_batch_workspace(mq8), [a, b], [4, long])
    alone = d.create_session(mq8, d.KVDtype.f16)
    d.eval(mq8, alone, long)
    assert b.n_past == 300 and a.n_past == 4
    assert _same(b.logits, alone.logits)


def test_threads_share_one_pool_and_cache(mq8):
    """Sessions of one pool driven from several threads (attach, generate, donate, release) give
    the tokens each gives alone, and every page comes back."""
    import threading

    prompts = [PROMPT + x for x in (" First,", " Second,", " Third,", " Fourth,")]
    want = []
    for p in prompts:
        got = []
        d.generate(mq8, d.create_session(mq8), p, d.SamplingParams(), 12, lambda i, t: got.append(i))
        want.append(got)
    pool = d.create_kv_pool(mq8, page_rows=8)
    cache = d.create_prefix_cache()
    results, errors = [None] * len(prompts), []

    def worker(k):
        try:
            for _ in range(2):  # the second round attaches what the first donated
                ids = d.encode(mq8, prompts[k])
                s = d.create_session(mq8, pool)
                n = d.prefix_attach(cache, pool, s, ids)
                d.eval(mq8, s, ids[n:])
                got = []
                d.generate(mq8, s, [], d.SamplingParams(), 12, lambda i, t: got.append(i))
                d.prefix_insert(cache, pool, s, s.history)
                d.release_kv_pages(s)
                results[k] = got
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for got, w in zip(results, want):
        assert got == w
    assert sum(c.hits for c in d.prefix_chain_list(cache)) >= len(prompts)
    d.prefix_release(cache, pool)
    assert pool.stats().free == pool.stats().total


def test_media_span_ending_mid_page_is_attached_whole(m32):
    """A page whose first rows hold media rows is hit in part (copy-on-write), and a session's last,
    partly filled page is donated when it holds media rows: a clip ending mid-page is attached whole.
    A partial page of text only is not (the whole-page contract stays for text)."""
    P = 16
    pool = d.create_kv_pool(m32, page_rows=P, kv_dtype=d.KVDtype.f32)
    cache = d.create_prefix_cache()
    head = d.encode(m32, "Listen to this:")
    ids = d.media_ids(b"clip-mid", 9)
    rows = m32._m.embed_tokens(list(range(300, 309)))
    end = len(head) + len(ids)
    assert end % P != 0

    def run(s, tail):
        d.eval(m32, s, head)
        d.eval_embd(m32, s, rows, len(ids), ids=ids)
        d.eval(m32, s, tail)

    def cold_logits(tail):
        f = d.create_session(m32, d.KVDtype.f32)
        run(f, tail)
        return f.logits

    # The donor's whole history is one partial page: it is kept, and hit in part by another question.
    short = d.encode(m32, " Who?", add_special=False)
    assert end + len(short) < P
    a = d.create_session(m32, pool)
    run(a, short)
    held = d.prefix_held_groups(cache)
    d.prefix_insert(cache, pool, a, a.history)
    assert d.prefix_held_groups(cache) == held + 1
    other = d.encode(m32, " What was said here?", add_special=False)
    b = d.create_session(m32, pool)
    n = d.prefix_attach(cache, pool, b, head + ids + other)
    assert end <= n < P  # through the clip, into the shared text after it
    assert b.history == (head + ids + other)[:n]
    d.eval(m32, b, (head + ids + other)[n:])
    assert _same(b.logits, cold_logits(other))
    # The donor goes on writing its page: a copy of it, the cached page unchanged for the next hit.
    d.eval(m32, a, d.encode(m32, " And then a much longer question about it all?", add_special=False))
    c = d.create_session(m32, pool)
    n = d.prefix_attach(cache, pool, c, head + ids + other)
    assert end <= n < P
    d.eval(m32, c, (head + ids + other)[n:])
    assert _same(c.logits, cold_logits(other))
    # Donated again with that page now full: the full page supersedes the partial one.
    for s in (b, c):
        d.release_kv_pages(s)
    held = d.prefix_held_groups(cache)
    d.prefix_insert(cache, pool, a, a.history)
    assert d.prefix_held_groups(cache) == held - 1 + a.n_past // P
    # Text only: a page shared in part is not hit, whole pages only.
    t = d.encode(m32, "The quick brown fox jumps over the lazy dog and runs far away into the woods, where "
                      "it finds a river, a bridge, an old mill and a field of tall yellow grass by the hills.")
    assert len(t) >= 2 * P  # the page past the first is full and cached
    e = d.create_session(m32, pool)
    d.eval(m32, e, t)
    d.prefix_insert(cache, pool, e, e.history)
    g = d.create_session(m32, pool)
    assert d.prefix_attach(cache, pool, g, t[:P + 3] + [7, 8, 9]) == P


def test_media_ids_and_cached_media_span(m32):
    ids = d.media_ids(b"clip-1", 12)
    assert ids == d.media_ids(b"clip-1", 12) and ids != d.media_ids(b"clip-2", 12)
    assert all(i <= -2 for i in ids) and all(d.is_media_position(i) for i in ids)
    assert not d.is_media_position(5) and d.is_media_position(-1)
    # Rows of a fake clip (embeddings of some tokens) spliced between text, keyed by ids.
    head = d.encode(m32, "Listen:")
    rows = m32._m.embed_tokens(list(range(300, 312)))
    tail = d.encode(m32, " What was said?", add_special=False)
    P = 4
    pool = d.create_kv_pool(m32, page_rows=P, kv_dtype=d.KVDtype.f32)
    cache = d.create_prefix_cache()

    def run(s):
        d.eval(m32, s, head)
        d.eval_embd(m32, s, rows, len(ids), ids=ids)
        d.eval(m32, s, tail)

    a = d.create_session(m32, pool)
    run(a)
    assert a.history == head + ids + tail
    d.prefix_insert(cache, pool, a, a.history)
    full = head + ids + tail
    b = d.create_session(m32, pool)
    n = d.prefix_attach(cache, pool, b, full)
    assert n == (len(full) - 1) // P * P and n > len(head) + len(ids)  # matched through the clip
    d.eval(m32, b, full[n:])
    assert _same(b.logits, a.logits)
    # Anonymous rows (no ids) are recorded as -1 and never cached.
    c = d.create_session(m32, pool)
    d.eval(m32, c, list(range(500, 508)))
    d.eval_embd(m32, c, rows, 12)
    assert c.history[8:] == [-1] * 12
    before = d.prefix_held_groups(cache)
    d.prefix_insert(cache, pool, c, c.history)
    assert d.prefix_held_groups(cache) == before + 2  # the two token pages only
    with pytest.raises(ValueError):  # a row id is a media id (< 0) or a token id of the vocab
        d.eval_embd(m32, c, rows, 12, ids=[m32.config.vocab_size] * 12)
    with pytest.raises(ValueError):
        d.eval_embd(m32, c, rows, 12, ids=[-3] * 11)


def test_lru_budget_evicts_unreferenced_leaves(mq8):
    P = 4
    pool = d.create_kv_pool(mq8, page_rows=P, max_pages=40)
    cache = d.create_prefix_cache(max_groups=6)
    held = []
    for k in range(3):
        s = d.create_session(mq8, pool)
        d.eval(mq8, s, [1000 + k] + list(range(10, 22)))  # 13 rows: 3 full pages each
        d.prefix_insert(cache, pool, s, s.history, preview=f"p{k}")
        held.append(s)
    # 9 pages offered, budget 6: all are referenced by live sessions, so none can go yet.
    assert d.prefix_held_groups(cache) == 9
    for s in held:
        d.release_kv_pages(s)
    s = d.create_session(mq8, pool)
    d.eval(mq8, s, [2000] + list(range(10, 22)))
    d.prefix_insert(cache, pool, s, s.history)  # over budget with nothing held: LRU chains go
    assert d.prefix_held_groups(cache) == 6
    previews = [c.preview for c in d.prefix_chain_list(cache)]
    assert "p0" not in previews  # the oldest donation went first
    st = pool.stats()
    assert st.by_cache == 6 and st.free + st.used == st.total
    # When the pool runs dry, cached pages nobody holds are given back to the asker.
    big = d.create_session(mq8, pool)
    d.eval(mq8, big, list(range(100, 100 + 4 * (40 - 4))))  # s holds 4 pages, 3 of them cached
    assert pool.stats().free == 0 and d.prefix_held_groups(cache) == 3
    d.prefix_release(cache, pool)
    d.release_kv_pages(s)
    d.release_kv_pages(big)
    assert pool.stats().free == pool.stats().total


# ---- a state machine over attach / insert / decode / truncate / release / evict ------------------

from hypothesis import event, settings, strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test)

_MODEL = {}


class PrefixMachine(RuleBasedStateMachine):
    """Random use of one small pool (pages of 2 rows, 12 pages) and its prefix cache (budget 8),
    with a 4-token alphabet so prefixes repeat. Page accounting is checked after every step;
    every attach is checked against a cold prefill of the same prompt."""

    P, PAGES = 2, 12

    def __init__(self):
        super().__init__()
        self.m = _MODEL["m"]
        self.pool = d.create_kv_pool(self.m, page_rows=self.P, kv_dtype=d.KVDtype.f32, max_pages=self.PAGES)
        self.cache = d.create_prefix_cache(max_groups=8)
        self.live = []
        self.donated = []

    def _pick(self, i):
        return self.live[i % len(self.live)] if self.live else None

    @initialize(prompt=st.lists(st.integers(1, 4), min_size=3, max_size=9))
    def seed_cache(self, prompt):
        self.start(prompt)
        self.insert(0)

    @rule(j=st.integers(0, 7), cut=st.integers(1, 12), extra=st.lists(st.integers(1, 4), max_size=3))
    def start_from_donated(self, j, cut, extra):
        """A prompt that begins like something donated earlier: the hits."""
        if self.donated:
            self.start(self.donated[j % len(self.donated)][:cut] + extra or [1])

    @rule(prompt=st.lists(st.integers(1, 4), min_size=1, max_size=9))
    def start(self, prompt):
        if len(self.live) >= 4:
            return
        s = d.create_session(self.m, self.pool)
        self.live.append(s)
        n = d.prefix_attach(self.cache, self.pool, s, prompt)
        assert 0 <= n < len(prompt) and n % self.P == 0 or n == len(prompt) - 1
        assert s.history == prompt[:n]
        event("attach hit" if n else "attach miss")
        try:
            d.eval(self.m, s, prompt[n:])
        except d.PoolExhaustedError:
            event("pool exhausted")
            assert s.n_past == n  # refused with nothing changed
            return
        if n:
            cold = d.create_session(self.m, d.KVDtype.f32, n_ctx=32)
            d.eval(self.m, cold, prompt)
            assert _same(s.logits, cold.logits)

    @rule(i=st.integers(0, 7), toks=st.lists(st.integers(1, 4), min_size=1, max_size=3))
    def decode(self, i, toks):
        s = self._pick(i)
        if s is None or s.n_past + len(toks) > 30:
            return
        n = s.n_past
        try:
            d.eval(self.m, s, toks)
        except d.PoolExhaustedError:
            assert s.n_past == n

    @rule(i=st.integers(0, 7))
    def insert(self, i):
        s = self._pick(i)
        if s is not None:
            d.prefix_insert(self.cache, self.pool, s, s.history)
            self.donated.append(list(s.history))

    @rule(i=st.integers(0, 7), k=st.integers(0, 9))
    def truncate(self, i, k):
        s = self._pick(i)
        if s is not None:
            s.truncate(min(k, s.n_past))

    @rule(i=st.integers(0, 7))
    def release(self, i):
        s = self._pick(i)
        if s is not None:
            d.release_kv_pages(s)
            self.live.remove(s)

    @rule()
    def evict(self):
        self.cache._c.evict_one()

    @rule()
    def release_cache(self):
        d.prefix_release(self.cache, self.pool)

    @invariant()
    def accounting(self):
        st_ = self.pool.stats()
        assert st_.free + st_.used == st_.total == self.PAGES
        held = d.prefix_held_groups(self.cache)
        assert st_.by_cache == held <= self.PAGES
        in_sessions = {}
        for s in self.live:
            pages = d._core.session_pages(s._s)
            assert len(pages) == -(-s.n_past // self.P) and len(s.history) == s.n_past
            for p in pages:
                in_sessions[p] = in_sessions.get(p, 0) + 1
        extra = 0
        for p in range(st_.allocated):
            rc = self.pool._p.refcount(p)
            # Never freed while referenced; beyond the sessions' references, at most the cache's one.
            assert rc - in_sessions.get(p, 0) in (0, 1)
            extra += rc - in_sessions.get(p, 0)
        assert extra == held
        assert st_.used == sum(1 for p in range(st_.allocated) if self.pool._p.refcount(p) > 0)

    def teardown(self):
        for s in self.live:
            d.release_kv_pages(s)
        d.prefix_release(self.cache, self.pool)
        st_ = self.pool.stats()
        assert st_.free == st_.total and st_.by_cache == 0 and st_.by_sessions == 0


def test_prefix_cache_state_machine(m32):
    _MODEL["m"] = m32
    run_state_machine_as_test(PrefixMachine, settings=settings(max_examples=40, stateful_step_count=30,
                                                               deadline=None))


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    """Every registered family as a tiny random f32 GGUF (sliding window 8 where the family has one)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
    import export as E

    out = str(tmp_path_factory.mktemp("tiny-kv"))
    proto = E.spm_model_proto()
    paths = {}
    for name, fam in E.FAMILIES.items():
        paths[name] = os.path.join(out, f"{name}-f32.gguf")
        E.write_gguf(fam, fam.make(), paths[name], "f32", proto)
    return paths, E.VOCAB


@pytest.mark.parametrize("mode", [d.QuantMode.fp32, d.QuantMode.q8])
def test_greedy_batch_steps_equal_logits_argmax(tiny_f32, mode):
    """eval_batch(greedy=True) and greedy BatchStepper streams on the CPU: the ids are numpy's argmax
    of the logits the plain steps give (tests/_device_checks.py says what it covers)."""
    import _device_checks as C

    paths, _ = tiny_f32
    C.greedy_batch_steps_equal_logits_argmax(paths["llama"], "cpu", mode)


def test_paged_equals_flat_every_family(tiny_f32):
    """Sliding windows, softcaps, biases and QK norms read through pages of 4 rows (the window of 8
    is crossed many times): bitwise equal to the flat session, prefill and incremental decode."""
    paths, vocab = tiny_f32
    ids = [1] + np.random.default_rng(0).integers(3, vocab, 40).tolist()
    for name, path in paths.items():
        m = d.load_model(path, mode=d.QuantMode.fp32)
        flat = _prefill_decode(m, d.create_session(m, d.KVDtype.f32, n_ctx=64), ids, 13)
        pool = d.create_kv_pool(m, page_rows=4, kv_dtype=d.KVDtype.f32, max_pages=32)
        got = _prefill_decode(m, d.create_session(m, pool), ids, 13)
        assert np.array_equal(got, flat), name
