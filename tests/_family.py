"""Checks every decoder family is held to, on its own files (the MoE and hybrid suites use them;
each compares our model with itself at the bit level, beside the suites' transformers checks)."""
from __future__ import annotations

import numpy as np

import dasllama as d


def ids(n, vocab, seed=0):
    """BOS and n - 1 random ids past the specials."""
    return [1] + np.random.default_rng(seed).integers(3, vocab, n - 1).tolist()


def ours_logits(model, tokens, kv=d.KVDtype.f32):
    """All-row logits of one prefill."""
    s = d.create_session(model, kv, n_ctx=len(tokens) + 8)
    d.eval(model, s, tokens, all_logits=True)
    return np.array(s.logits).reshape(len(tokens), -1)


def prefill_decode(model, s, tokens, n_first):
    """Prefill tokens[:n_first] (all logits), then one token at a time; all logits stacked."""
    d.eval(model, s, tokens[:n_first], all_logits=True)
    out = [np.array(s.logits).reshape(n_first, -1)]
    for t in tokens[n_first:]:
        d.eval(model, s, [t])
        out.append(np.array(s.logits)[None])
    return np.concatenate(out)


def batched_equals_alone(m, vocab):
    """Sessions stepped together (one prefilling 6-token chunks in the same steps) each get the
    logits a fresh session computes for their history alone, bitwise."""
    prompts = [ids(n, vocab, seed=10 + n) for n in (3, 7, 12)]
    late = ids(20, vocab, seed=99)
    chunks = [late[i:i + 6] for i in range(0, len(late), 6)]
    pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32)
    ss = [d.create_session(m, pool) for _ in range(4)]
    for s, p in zip(ss, prompts):
        d.eval(m, s, p)
    ws = d.create_batch_workspace(m)
    for step in range(len(chunks) + 3):
        group = [int(np.argmax(s.logits)) for s in ss[:3]]
        group.append(chunks[step] if step < len(chunks) else int(np.argmax(ss[3].logits)))
        ref = []
        for s, t in zip(ss, group):
            c = d.create_session(m, d.KVDtype.f32, n_ctx=64)
            d.eval(m, c, list(s.history) + ([t] if isinstance(t, int) else list(t)))
            ref.append(np.array(c.logits))
        d.eval_batch(m, ws, ss, group)
        for s, r in zip(ss, ref):
            assert np.array_equal(np.array(s.logits), r)
