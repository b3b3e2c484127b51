"""Text inference against the oracle: transformers loading the same GGUF in fp32.

Bars: in fp32 mode both sides run the same dequantized weights in float32, so the
only differences are summation order and rope angle rounding; measured max |Δlogit|
is ~4e-5 on logits of magnitude ~30 (SmolLM2 and Gemma-3), so the bar is 1e-3
absolute (25x the measurement, still 4 orders below a logit gap that flips a
token). q8 mode quantizes activations to 8 bits, so it is held to top-1 agreement.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dasllama as d  # noqa: E402
from dasllama.llm import BatchStepper  # noqa: E402

import torch  # noqa: E402  (the oracle; never skipped)
from transformers import AutoModelForCausalLM  # noqa: E402

PROMPTS = [
    "The history of the Roman Empire spans many centuries, and historians often divide it into",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is 17 times 23?\nA:",
]
FP32_BAR = 1e-3


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    path = request.getfixturevalue(request.param + "_path")
    ours = d.load_model(path, mode=d.QuantMode.fp32)
    if request.param == "smollm2":
        hf = request.getfixturevalue("smollm2_hf_model")
    else:
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  torch_dtype=torch.float32).eval()
    return request.param, path, ours, hf


def _ours_logits(model, ids, kv=d.KVDtype.f32):
    s = d.create_session(model, kv, n_ctx=len(ids) + 8)
    d.eval(model, s, ids, all_logits=True)
    return np.array(s.logits).reshape(len(ids), -1)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_logits_match_transformers(pair, prompt):
    _, _, ours, hf = pair
    ids = d.encode(ours, prompt)
    a, b = _ours_logits(ours, ids), _hf_logits(hf, ids)
    assert a.shape == b.shape
    assert np.abs(a - b).max() < FP32_BAR


def test_fp32_greedy_continuation_identical(pair):
    """64 greedy tokens, ours (incremental decode through the KV cache) vs transformers' generate."""
    _, _, ours, hf = pair
    for prompt in PROMPTS[:2]:
        ids = d.encode(ours, prompt)
        s = d.create_session(ours, d.KVDtype.f32)
        got = []
        d.generate(ours, s, ids, d.SamplingParams(), 64, lambda i, p: got.append(i) if i >= 0 else None)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                              eos_token_id=ours._m.eog_ids, pad_token_id=0)
        want = [t for t in out[0, len(ids):].tolist()]
        want = want[:next((k for k, t in enumerate(want) if t in ours._m.eog_ids), len(want))]
        n = min(len(got), len(want))
        if got[:n] != want[:n]:
            # A divergence is acceptable only at a measured near-tie of the reference.
            k = next(k for k in range(n) if got[k] != want[k])
            ref = _hf_logits(hf, ids + want[:k])[-1]
            gap = abs(ref[got[k]] - ref[want[k]])
            assert gap < 1e-3, f"diverged at {k} with a reference gap of {gap}"
        else:
            assert len(got) == len(want)


def test_q8_top1_agreement(pair):
    name, path, ours, hf = pair
    q8 = d.load_model(path, mode=d.QuantMode.q8)
    agree = total = 0
    for prompt in PROMPTS:
        ids = d.encode(q8, prompt)
        a, b = _ours_logits(q8, ids, d.KVDtype.f16), _hf_logits(hf, ids)
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        total += len(ids)
    rate = agree / total
    print(f"{name}: q8 top-1 agreement with transformers fp32 = {rate:.3f} over {total} positions")
    assert rate >= 0.9


def test_embed_matches_mean_of_final_hidden_states(pair):
    _, _, ours, hf = pair
    text = PROMPTS[0]
    ids = d.encode(ours, text)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    ref = h.mean(0)
    ref /= np.linalg.norm(ref)
    got = d.embed(ours, text)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 1e-4


def test_kv_codecs_and_incremental_eval_agree(smollm2_path):
    m = d.load_model(smollm2_path, mode=d.QuantMode.fp32)
    ids = d.encode(m, PROMPTS[0])
    full = _ours_logits(m, ids)[-1]
    # Relative L2 error of the logits: f32 KV only reorders sums; f16 rounds K/V to
    # 11 bits (~5e-4 relative each); q8_0 to 8-bit blocks (~4e-3 each), compounding
    # over 30 layers. Bars are ~5x the measured errors; the argmax must not move.
    for kv, bar in ((d.KVDtype.f32, 1e-5), (d.KVDtype.f16, 5e-3), (d.KVDtype.q8_0, 5e-2)):
        s = d.create_session(m, kv)
        d.eval(m, s, ids[:5])
        for t in ids[5:]:
            d.eval(m, s, [t])
        assert s.n_past == len(ids)
        last = np.array(s.logits)
        rel = np.linalg.norm(last - full) / np.linalg.norm(full)
        print(f"KV {kv.name}: relative logit error {rel:.2e}")
        assert rel < bar, kv
        assert last.argmax() == full.argmax()


def test_context_overflow_leaves_session_usable(smollm2_path):
    m = d.load_model(smollm2_path)
    s = d.create_session(m, n_ctx=8)
    d.eval(m, s, d.encode(m, "one two three"))
    n = s.n_past
    with pytest.raises(d.ContextOverflowError):
        d.eval(m, s, list(range(100, 110)))
    assert s.n_past == n
    d.eval(m, s, [100])
    assert s.n_past == n + 1


def test_generate_stops_streams_and_reports_stats(smollm2_path):
    m = d.load_model(smollm2_path)
    prompt = "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
    ids = d.encode(m, prompt, parse_special=True)
    seen = []
    n = d.generate(m, d.create_session(m), ids, d.SamplingParams(), 40, lambda i, p: seen.append(p) or len(seen) < 3)
    assert n == 3 and len(seen) == 3
    full = []
    d.generate(m, d.create_session(m), ids, d.SamplingParams(), 40, lambda i, p: full.append(p))
    streamed = list(d.stream_generate(m, d.create_session(m), ids, d.SamplingParams(), 40))
    assert "".join(streamed) == "".join(full) and "".join(full).strip()
    s = d.create_session(m)
    d.generate(m, s, ids, d.SamplingParams(temp=0.8, top_k=40, top_p=0.9, seed=7), 20)
    st = d.stats(s)
    assert st.n_prompt == len(ids) and 0 < st.n_gen <= 20 and st.ttft_s > 0


def test_pipelined_greedy_generate_equals_the_plain_loop(smollm2_path):
    """The greedy loop that issues each step before the host reads the id before it (a GPU's
    default), forced on the CPU, gives the plain loop's tokens, logits and session state on
    every way a stream ends (tests/_device_checks.py)."""
    import _device_checks as C

    text = "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"
    prompt = d.encode(d.load_model(smollm2_path), text, parse_special=True)
    C.pipelined_greedy_equals_plain(smollm2_path, "cpu", prompt, d.QuantMode.q8)


def test_seeded_sampling_is_reproducible(smollm2_path):
    m = d.load_model(smollm2_path)
    p = d.SamplingParams(temp=1.0, top_k=50, top_p=0.95, min_p=0.02, repeat_penalty=1.1, seed=1234)
    outs = []
    for _ in range(2):
        got = []
        d.generate(m, d.create_session(m), "Once upon a time", p, 24, lambda i, t: got.append(i))
        outs.append(got)
    assert outs[0] == outs[1]


def test_bad_inputs_raise_clearly(smollm2_path, tmp_path):
    m = d.load_model(smollm2_path)
    s = d.create_session(m)
    with pytest.raises(ValueError):
        d.eval(m, s, [10 ** 9])
    with pytest.raises(ValueError):
        d.sample(s)  # no logits yet
    with pytest.raises(ValueError):
        d.generate(m, s, "hi", d.SamplingParams(top_p=0.0), 4)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(d.GGUFError):
        d.load_model(bad)
    with pytest.raises(d.DasllamaError):
        d.load_model(tmp_path / "missing.gguf")


def test_eval_batch_equals_each_session_alone(smollm2_path):
    """B sessions at different lengths, stepped together, give each one's own logits and greedy tokens."""
    m = d.load_model(smollm2_path, mode=d.QuantMode.fp32)
    prompts = ["The cat sat on", "Paris is the capital of", "def main():\n    ", "1, 2, 3, 4, 5, 6, 7,"]
    alone = []
    for p in prompts:
        got = []
        d.generate(m, d.create_session(m, d.KVDtype.f32), p, d.SamplingParams(), 10, lambda i, t: got.append(i))
        alone.append(got)
    ss = [d.create_session(m, d.KVDtype.f32) for _ in prompts]
    for s, p in zip(ss, prompts):
        d.eval(m, s, d.encode(m, p))
    ws = d.create_batch_workspace(m)
    batched = [[] for _ in prompts]
    for _ in range(10):
        toks = [int(np.argmax(s.logits)) for s in ss]
        ref = []
        for s, t in zip(ss, toks):  # each session's next logits computed alone, on a copy of its state
            c = d.create_session(m, d.KVDtype.f32)
            d.eval(m, c, list(s._s.history) + [t])
            ref.append(np.array(c.logits))
        for b, t in zip(batched, toks):
            b.append(t)
        d.eval_batch(m, ws, ss, toks)
        for s, r in zip(ss, ref):
            assert np.abs(np.array(s.logits) - r).max() < 1e-3
    for a, b in zip(alone, batched):
        n = len(a)  # alone stops at an end-of-generation token
        assert b[:n] == a
    with pytest.raises(d.DasllamaError):
        d.eval_batch(m, ws, [ss[0], ss[0]], [1, 2])


def test_eval_batch_logits_outlive_later_steps(smollm2_path):
    """A batch step's logits stay each session's own while later steps run without it: rows read
    only after four more steps (more than the host blocks the model keeps for them, so the last
    step takes the copying path) equal each session's logits computed alone."""
    m = d.load_model(smollm2_path, mode=d.QuantMode.fp32)
    prompts = ["The cat sat on", "Paris is the capital of", "def main():\n    ", "1, 2, 3,", "Once upon a"]
    ss = [d.create_session(m, d.KVDtype.f32) for _ in prompts]
    for s, p in zip(ss, prompts):
        d.eval(m, s, d.encode(m, p))
    ws = d.create_batch_workspace(m)
    d.eval_batch(m, ws, ss, [7] * len(ss))
    for s in ss[1:]:
        d.eval_batch(m, ws, [s], [11])
    for s in ss:
        c = d.create_session(m, d.KVDtype.f32)
        d.eval(m, c, list(s._s.history))
        assert np.abs(np.array(s.logits) - np.array(c.logits)).max() < 1e-3


def _drain(st, got):
    """Steps until every stream has ended, appending each stream's tokens to got[slot]."""
    while any(st.active(i) for i in range(len(got))):
        events, _ = st.step()
        for e in events:
            if e[1] != BatchStepper.STOP:
                got[e[0]].append(e[2])


def test_stepper_packs_short_prompts_into_one_step(smollm2_path):
    """Prompts arriving together start in one step while their rows fit the chunk (a queue of
    short requests is not one step each), a prompt past the chunk's rest goes on in the next
    step, and every stream's greedy tokens equal its own generation alone."""
    m = d.load_model(smollm2_path)
    prompts = ["The cat sat on", "Paris is the capital of", "def main():\n    ", "1, 2, 3, 4, 5, 6, 7,"]
    ids = [d.encode(m, p) for p in prompts]
    alone = []
    for p in prompts:
        got = []
        d.generate(m, d.create_session(m, n_ctx=256), p, d.SamplingParams(), 6, lambda i, t: got.append(i))
        alone.append(got)
    ss = [d.create_session(m, n_ctx=256) for _ in prompts]
    first3 = sum(len(x) for x in ids[:3])
    st = BatchStepper(ss, chunk=first3 + 2)  # the fourth prompt does not fit whole
    for i, x in enumerate(ids):
        st.start(i, x, d.SamplingParams(), 6, priority=float(i))
    events, n_dec = st.step()
    assert n_dec == 0 and sorted(e[0] for e in events) == [0, 1, 2]
    assert ss[3].n_past == 2  # the chunk's last two rows went to the fourth
    got = [[] for _ in prompts]
    for e in events:
        got[e[0]].append(e[2])
    _drain(st, got)
    assert got == alone


def test_stepper_sampled_streams_draw_as_alone(smollm2_path):
    """Five sampled streams stepped together (their draws made on the host threads at once) give
    each stream the tokens its own generation gives from the same seed: a session's draws depend
    only on its logits and its own generator."""
    m = d.load_model(smollm2_path)
    prompts = ["Once upon a time", "The weather today", "My favourite food", "In the year 2050", "Dear diary,"]
    p = d.SamplingParams(temp=0.9, top_p=0.95)
    alone = []
    for k, text in enumerate(prompts):
        s = d.create_session(m, n_ctx=256)
        d.set_seed(s, 100 + k)
        got = []
        d.generate(m, s, text, p, 8, lambda i, t: got.append(i))
        alone.append(got)
    ss = [d.create_session(m, n_ctx=256) for _ in prompts]
    st = BatchStepper(ss, chunk=512)
    for k, text in enumerate(prompts):
        d.set_seed(ss[k], 100 + k)
        st.start(k, d.encode(m, text), p, 8)
    got = [[] for _ in prompts]
    _drain(st, got)
    assert got == alone
    assert len({tuple(g) for g in got}) == len(prompts)


@pytest.fixture(scope="module")
def smollm2_ref(smollm2_path, smollm2_hf_model):
    return d.load_model(smollm2_path, mode=d.QuantMode.fp32), smollm2_hf_model


@pytest.mark.parametrize("isa", d.system_info()["isa_supported"])
def test_every_isa_matches_transformers(smollm2_ref, isa):
    """Each kernel variant (forced like DASLLAMA_ISA does) against the fp32 reference."""
    m, hf = smollm2_ref
    ids = d.encode(m, PROMPTS[1])
    before = d.get_isa()
    d.set_isa(isa)
    try:
        a = _ours_logits(m, ids)
    finally:
        d.set_isa(before)
    assert np.abs(a - _hf_logits(hf, ids)).max() < FP32_BAR


def test_generate_stop_ids_and_special_pieces(smollm2_path):
    """stop_ids replaces the end-of-generation set; special streams control tokens as their text."""
    m = d.load_model(smollm2_path)
    prompt = d.encode(m, "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", add_special=False,
                      parse_special=True)
    im_end = d.encode(m, "<|im_end|>", add_special=False, parse_special=True)[0]
    assert im_end in m._m.eog_ids

    def run(**kw):
        s = d.create_session(m)
        got = []
        d.generate(m, s, prompt, d.SamplingParams(), 40, lambda i, p: got.append((i, p)), **kw)
        return got

    plain = run()
    assert plain and all(i != im_end for i, _ in plain)  # stopped at <|im_end|>, not emitted
    through = run(stop_ids=[], special=True)  # nothing stops it: it runs past its turn end
    ids = [i for i, _ in through]
    assert ids[:len(plain)] == [i for i, _ in plain] and len(through) == 40
    if im_end in ids:
        assert dict(through)[im_end] == "<|im_end|>"
    first = plain[0][0]
    assert run(stop_ids=[first]) == []  # a stop id is never emitted
