"""End-to-end checks shared by every device backend's test file (test_cuda.py, test_vulkan.py).

Each takes the device string and compares the device with the CPU backend on the same file:
the CPU in fp32 mode decodes weights exactly and is itself checked against transformers
(tests/test_families.py), so it is the reference here.
"""
from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

import dasllama as d

LOGIT_BAR = 1e-8  # measured 1e-13..2e-11 on every device; a wrong op gives 1e-2 or more


def nmse(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(a).all()
    return float(np.sum((a - ref) ** 2) / np.sum(ref ** 2))


def built_once(out_dir, name: str, make) -> tuple:
    """make(folder) -> file paths, run in out_dir/name unless an earlier call (in this run, or in
    the pytest run that started this one and shares out_dir) left its files there."""
    import json
    import os

    folder = os.path.join(str(out_dir), name)
    meta = os.path.join(folder, "files.json")
    if os.path.exists(meta):
        with open(meta) as f:
            return tuple(json.load(f))
    os.makedirs(folder, exist_ok=True)
    files = tuple(make(folder))
    with open(meta + ".tmp", "w") as f:
        json.dump(files, f)
    os.replace(meta + ".tmp", meta)  # written last: a listed file is whole
    return files


def q8_steps(path: str, device: str, ids: list, n_prefill: int) -> list:
    """A fresh q8-mode model's logits: after prefilling ids[:n_prefill], then after each later
    token decoded alone (the full-device tests' reference)."""
    m = d.load_model(path, d.QuantMode.q8, device=device)
    t = d.create_session(m, n_ctx=64)
    d.eval(m, t, ids[:n_prefill])
    out = [np.array(t.logits)]
    for tok in ids[n_prefill:]:
        d.eval(m, t, [tok])
        out.append(np.array(t.logits))
    return out


def paged_prefix_cache_and_ragged_batch(path: str, device: str, prompt: list) -> None:
    """A prompt's cold logits match the CPU's; attaching its cached pages gives the cold logits;
    a ragged step (one 9-token prefill beside two decodes) gives each session its logits alone."""
    ref = d.load_model(path, d.QuantMode.fp32)
    rs = d.create_session(ref, d.KVDtype.f16)
    d.eval(ref, rs, prompt)
    m = d.load_model(path, d.QuantMode.fp32, device=device)
    pool = d.create_kv_pool(m, page_rows=16)
    cache = d.create_prefix_cache()
    a = d.create_session(m, pool)
    d.eval(m, a, prompt)
    cold = np.array(a.logits)
    assert nmse(cold, rs.logits) <= LOGIT_BAR
    d.prefix_insert(cache, pool, a, a.history)
    b = d.create_session(m, pool)
    n = d.prefix_attach(cache, pool, b, prompt)
    assert n == (len(prompt) - 1) // 16 * 16  # whole pages, capped one token short of the prompt
    d.eval(m, b, prompt[n:])
    # The attached tail runs through the decode GEMV, the cold prompt through the prefill
    # tile: equal to rounding (LOGIT_BAR), where a wrong page would be O(1).
    e = nmse(b.logits, cold)
    assert e <= LOGIT_BAR, f"attached tail against the cold prompt: NMSE {e:.3g}"
    ss = [d.create_session(m, pool) for _ in range(3)]
    alone = []
    step = [prompt[10:19], [7], [7]]
    for i, s in enumerate(ss):
        d.eval(m, s, prompt[:10 + i])
        # Alone: the same two evals. (One eval of both parts is a longer prefill, which a
        # device may run on other kernels, e.g. tensor-core tiles, with other rounding.)
        t = d.create_session(m, pool)
        d.eval(m, t, prompt[:10 + i])
        d.eval(m, t, step[i])
        alone.append(np.array(t.logits))
        d.release_kv_pages(t)
    d.eval_batch(m, d.create_batch_workspace(m), ss, [step[0], 7, 7])
    for s, want in zip(ss, alone):
        e = nmse(s.logits, want)
        assert e <= 1e-12, f"a ragged step's session against itself alone: NMSE {e:.3g}"


def f16_q8_mode_prefill(f16_path: str, q8_path: str, device: str, vocab: int) -> None:
    """A 100-token prefill of an f16 file in q8 mode, where a GPU on f16 tensor cores rounds each
    token's x to f16 once (11 bits, where q8 mode's int8 blocks keep about 8): its all-row logits
    are no farther from the CPU's fp32 ones than the CPU's own q8 mode is on the q8_0 file of the
    same model (a wrong op gives 1e-2 or more). q8_path: that file."""
    ids = [1] + np.random.default_rng(9).integers(3, vocab, 99).tolist()

    def rows(path, mode, dev):
        m = d.load_model(path, mode, device=dev)
        s = d.create_session(m, d.KVDtype.f32, n_ctx=len(ids))
        d.eval(m, s, ids, all_logits=True)
        return np.array(s.logits).reshape(len(ids), -1)

    e = nmse(rows(f16_path, d.QuantMode.q8, device), rows(f16_path, d.QuantMode.fp32, "cpu"))
    e_q8 = nmse(rows(q8_path, d.QuantMode.q8, "cpu"), rows(q8_path, d.QuantMode.fp32, "cpu"))
    print(f"f16 prefill in q8 mode on {device}: NMSE {e:.3g}, the CPU's q8 mode on q8_0 {e_q8:.3g}")
    assert e_q8 > LOGIT_BAR, "the CPU's q8 mode should round activations"
    assert e <= e_q8, f"f16 prefill in q8 mode on {device}: NMSE {e:.3g} against fp32, the CPU's q8 {e_q8:.3g}"


def family_logits(path_of, name: str, device: str) -> None:
    """A family's random files on the device: all-row logits of the f32 and q8_0 files in fp32
    mode against the CPU in fp32 mode and a few greedy tokens alike; the q8_0 file in the default
    q8 mode too. A device rounds activations for fewer matmuls than the CPU's q8 mode does (CUDA
    for its split dense layouts, not for expert stacks or the recurrent ops), so its logits must
    be about as far from fp32 as the CPU's q8 mode's are. path_of(ft) writes the file."""
    ids = [1] + np.random.default_rng(5).integers(3, 512, 30).tolist()

    def run(path, mode, dev):
        model = d.load_model(path, mode, device=dev)
        s = d.create_session(model, d.KVDtype.f32, n_ctx=64)
        d.eval(model, s, ids, all_logits=True)
        rows = np.array(s.logits)
        toks = []
        for _ in range(6):
            toks.append(int(np.argmax(np.asarray(s.logits).reshape(-1, 512)[-1])))
            d.eval(model, s, [toks[-1]])
        return rows, toks

    for ft in ("f32", "q8_0"):
        path = path_of(ft)
        ref_rows, ref_toks = run(path, d.QuantMode.fp32, "cpu")
        dev_rows, dev_toks = run(path, d.QuantMode.fp32, device)
        e = nmse(dev_rows, ref_rows)
        assert e <= LOGIT_BAR, f"{name} {ft} on {device}: NMSE {e:.3g}"
        assert dev_toks == ref_toks, f"{name} {ft} on {device}: greedy tokens differ"
        if ft == "q8_0":
            cpu_q8 = nmse(run(path, d.QuantMode.q8, "cpu")[0], ref_rows)
            dev_q8 = nmse(run(path, d.QuantMode.q8, device)[0], ref_rows)
            assert cpu_q8 > LOGIT_BAR, "the CPU's q8 mode should round activations"
            # The device rounds the same activations as the CPU or fewer (CUDA leaves expert stacks
            # and the recurrent ops in f32). Where it rounds the same ones in another order of float
            # sums, the activations that order tips over a rounding edge differ, so the two q8
            # errors are two draws of one noise (qwen35 on the H200: 9.47e-5 and 9.7e-5, their
            # logits 1e-5 apart): the device's may be up to twice the CPU's, where a wrong op
            # gives 1e-2 or more.
            assert dev_q8 <= 2 * cpu_q8, \
                f"{name} q8 mode on {device}: NMSE {dev_q8:.3g} against fp32, the CPU's {cpu_q8:.3g}"


def moe_family(tmp_dir: str, name: str, device: str) -> None:
    """A mixture-of-experts family (tests/oracles/moe.py's random file: routing, matmul_id, moe_sum;
    gpt-oss's MXFP4 experts, sinks and clamped SwiGLU) on the device: family_logits, then the
    paged / prefix-cache / ragged-batch checks on each file."""
    import moe as M  # tests/oracles/moe.py

    ids = [1] + np.random.default_rng(5).integers(3, 512, 30).tolist()
    family_logits(lambda ft: M.random_gguf(name, f"{tmp_dir}/{name}-{ft}.gguf", ft), name, device)
    for ft in ("f32", "q8_0"):
        paged_prefix_cache_and_ragged_batch(f"{tmp_dir}/{name}-{ft}.gguf", device, ids)


def gemma4_family(tmp_dir: str, name: str, device: str, wide: bool = False) -> None:
    """A Gemma-4 shape (tests/oracles/gemma4.py's random file: per-layer head dims and kv heads, global
    layers with V = K, the unweighted V norm, per-layer embeddings and shared KV for the E-series;
    wide: the released head sizes, 256 and 512) on the device: family_logits, then the paged
    session's logits against the flat one's."""
    import gemma4 as G4  # tests/oracles/gemma4.py

    tag = name + ("-wide" if wide else "")
    family_logits(lambda ft: G4.random_gguf(name, f"{tmp_dir}/gemma4-{tag}-{ft}.gguf", ft, wide=wide), f"gemma4 {tag}",
                  device)
    ids = [1] + np.random.default_rng(6).integers(3, 512, 30).tolist()
    m = d.load_model(f"{tmp_dir}/gemma4-{tag}-q8_0.gguf", d.QuantMode.fp32, device=device)
    flat = d.create_session(m, d.KVDtype.f32, n_ctx=64)
    d.eval(m, flat, ids)
    pool = d.create_kv_pool(m, page_rows=8, kv_dtype=d.KVDtype.f32)
    paged = d.create_session(m, pool)
    d.eval(m, paged, ids[:13])
    d.eval(m, paged, ids[13:])
    e = nmse(paged.logits, flat.logits)
    assert e <= LOGIT_BAR, f"gemma4 {tag} paged against flat on {device}: NMSE {e:.3g}"


def hybrid_family(tmp_dir: str, name: str, device: str) -> None:
    """A hybrid family (tests/oracles/hybrid.py's random Qwen3.5 file: conv1d_causal, delta_rule,
    the output-gated attention) on the device: family_logits; then a prefix-cache
    hit (pages and the state snapshot at their end) against the cold prompt, a ragged step
    (sessions with their own recurrent states) against each session alone, and a 140-token
    prefill (the chunked delta rule) with decode steps after it against the CPU."""
    import hybrid as H  # tests/oracles/hybrid.py

    ids = [1] + np.random.default_rng(5).integers(3, 512, 30).tolist()
    family_logits(lambda ft: H.random_gguf(name, f"{tmp_dir}/{name}-{ft}.gguf", ft), name, device)
    path = f"{tmp_dir}/{name}-q8_0.gguf"
    m = d.load_model(path, d.QuantMode.fp32, device=device)
    pool = d.create_kv_pool(m, page_rows=8)
    cache = d.create_prefix_cache()
    a = d.create_session(m, pool)
    d.eval(m, a, ids)
    cold = np.array(a.logits)
    d.prefix_insert(cache, pool, a, a.history)
    b = d.create_session(m, pool)
    n = d.prefix_attach(cache, pool, b, ids)
    assert n == 24 and cache.states_held == 1  # the last page boundary the prefill crossed
    d.eval(m, b, ids[n:])
    e = nmse(b.logits, cold)
    assert e <= LOGIT_BAR, f"attached pages and state against the cold prompt: NMSE {e:.3g}"
    ss = [d.create_session(m, pool) for _ in range(3)]
    alone = []
    for i, s in enumerate(ss):
        d.eval(m, s, ids[:10 + i])
        t = d.create_session(m, pool)
        if i:
            d.eval(m, t, ids[:10 + i] + [7])
        else:  # the same two evals as batched: 19 rows in one eval would take a device's tiled prefill attention
            d.eval(m, t, ids[:10])
            d.eval(m, t, ids[10:19])
        alone.append(np.array(t.logits))
        d.release_kv_pages(t)
    d.eval_batch(m, d.create_batch_workspace(m), ss, [ids[10:19], 7, 7])
    for s, want in zip(ss, alone):
        e = nmse(s.logits, want)
        assert e <= 1e-12, f"a ragged step's session against itself alone: NMSE {e:.3g}"
    # A prefill of 150 tokens takes the chunked delta rule (runs of 64 rows or more): all-row
    # logits against the CPU's (fp32 mode both), then decode steps after it.
    long = [1] + np.random.default_rng(6).integers(3, 512, 149).tolist()
    rows = {}
    for dev in ("cpu", device):
        mm = d.load_model(path, d.QuantMode.fp32, device=dev)
        s = d.create_session(mm, d.KVDtype.f32, n_ctx=200)
        d.eval(mm, s, long[:140], all_logits=True)
        out = [np.array(s.logits)]
        for t in long[140:]:
            d.eval(mm, s, [t])
            out.append(np.array(s.logits))
        rows[dev] = np.concatenate(out)
    e = nmse(rows[device], rows["cpu"])
    assert e <= LOGIT_BAR, f"{name}: a chunked prefill and decode on {device} against the CPU: NMSE {e:.3g}"


def errors_leave_the_process_usable(path: str, device: str) -> None:
    """A missing device index and a pool too big for the device are refused; the model still runs."""
    kind = device.split(":")[0]
    with pytest.raises(d.DeviceError, match=f"{kind}:99"):
        d.load_model(path, device=f"{kind}:99")
    m = d.load_model(path, device=device)
    with pytest.raises(d.DeviceError, match="KV pool"):
        d.create_kv_pool(m, page_rows=16, max_pages=1 << 29)
    s = d.create_session(m)
    d.eval(m, s, [1, 2, 3])
    assert np.isfinite(s.logits).all()


def audio_tower_and_turn(tmp_path, device: str, seconds: int, max_new: int) -> None:
    """A Qwen2-Audio tower's rows, and a whole greedy audio chat turn, equal to the CPU's."""
    import audio as A  # tests/oracles/audio.py

    model = A.qwen2_audio(seed=0)
    mm = str(tmp_path / "mmproj.gguf")
    A.write_qwen2_audio(model, mm)
    x = np.random.default_rng(0).standard_normal(16000 * seconds).astype(np.float32) * 0.1
    rows = {dev: d.encode_audio_rows(d.load_audio_tower(mm, device=dev), x) for dev in ("cpu", device)}
    assert nmse(rows[device], rows["cpu"]) <= 1e-9
    dec = str(tmp_path / "dec.gguf")
    A.write_decoder(model, dec)
    replies = {}
    for dev in ("cpu", device):
        m = d.load_model(dec, d.QuantMode.fp32, device=dev)
        chat = d.create_chat(m, d.load_audio_tower(mm, device=dev), max_new=max_new)
        d.add_user_audio(chat, x)
        d.add_user(chat, "What is said?")
        replies[dev] = d.respond(m, chat, d.SamplingParams(temp=0))
    assert replies[device] == replies["cpu"]


def qwen3_asr_tower_and_transcribe(files: dict, device: str, max_new: int) -> None:
    """A Qwen3-ASR tower's rows (the conv2d stem, 8 s attention windows) and a greedy transcription,
    equal to the CPU's; the files come from llama.cpp's converter (conftest.py's qwen3_asr_files)."""
    dec, mm = files["decoder"], files["mmproj"]
    x = np.random.default_rng(0).standard_normal(16000 * 11).astype(np.float32) * 0.1
    rows = {dev: d.encode_audio_rows(d.load_audio_tower(mm, device=dev), x) for dev in ("cpu", device)}
    assert nmse(rows[device], rows["cpu"]) <= 1e-9
    out = {dev: d.transcribe(d.load_asr_model(dec, device=dev, mode=d.QuantMode.fp32), x,
                             max_new_tokens=max_new).segments
           for dev in ("cpu", device)}
    assert [s.tokens for s in out[device]] == [s.tokens for s in out["cpu"]]


def vision_tower_and_turn(tmp_path, device: str, max_new: int) -> None:
    """A Gemma-3 SigLIP tower's rows, the teacher-forced logits of an image prompt (its rows one
    non-causal span) and a whole greedy image chat turn, equal to the CPU's. The files come from
    llama.cpp's converter (tests/oracles/vision.py)."""
    import vision as V  # tests/oracles/vision.py

    # A window of 8 with the image ending past it: the span's sliding layers attend row by row too.
    dec, mm = built_once(tmp_path, "gemma3v-sw8", lambda out: V.convert_gemma3(V.gemma3(sliding_window=8), out))
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
    rows = {dev: d.encode_image_rows(d.load_vision_embedder(mm, device=dev), img) for dev in ("cpu", device)}
    assert nmse(rows[device], rows["cpu"]) <= 1e-9
    logits, replies = {}, {}
    for dev in ("cpu", device):
        m = d.load_model(dec, d.QuantMode.fp32, device=dev)
        head = [1] + d.encode(m, "ka to ri", add_special=False) + [500]
        tail = [501] + d.encode(m, "mu sen la po", add_special=False)
        n = rows["cpu"].shape[0]
        s = d.create_session(m, d.KVDtype.f32)
        body = d.media_body_rows(m, None, head, rows["cpu"], n, m.config.dim, [])
        d.eval_embd_body(m, s, body, len(head) + n, len(head), len(head) + n)
        d.eval(m, s, tail, all_logits=True)
        logits[dev] = np.array(s.logits)
        chat = d.create_chat(m, d.load_vision_embedder(mm, device=dev), max_new=max_new)
        d.add_user_image(chat, img, "ka to ri")
        replies[dev] = d.respond(m, chat, d.SamplingParams(temp=0))
        if dev == device:
            _image_second_question(m, d.load_vision_embedder(mm, device=dev), img, max_new)
    assert nmse(logits[device], logits["cpu"]) <= LOGIT_BAR
    assert replies[device] == replies["cpu"]


def _image_second_question(m, emb, img, max_new: int) -> None:
    """On the device: a second conversation about the same image over a 16-row-page pool and prefix cache,
    the tower-output cache emptied first. The image (ending mid-page) is attached whole -- its last page
    in part, copied on the device before the new question is written -- so no encoder runs and no image
    row is prefilled, and the reply is the device's cold one."""
    from dasllama.chat import media as M

    pool, cache = d.create_kv_pool(m, page_rows=16, kv_dtype=d.KVDtype.f32), d.create_prefix_cache()
    a = d.create_chat(m, emb, max_new=max_new, pool=pool, cache=cache)
    d.add_user_image(a, img, "ka to ri")
    d.respond(m, a, d.SamplingParams(temp=0))
    M.ROW_CACHE.clear()
    b = d.create_chat(m, emb, max_new=max_new, pool=pool, cache=cache)
    d.add_user_image(b, img, "mu sen la")
    got = d.respond(m, b, d.SamplingParams(temp=0))
    assert b.media_stats["encodes"] == 0 and b.media_stats["media_rows_prefilled"] == 0, b.media_stats
    cold = d.create_chat(m, emb, max_new=max_new, kv_dtype=d.KVDtype.f32)
    d.add_user_image(cold, img, "mu sen la")
    assert got == d.respond(m, cold, d.SamplingParams(temp=0))


def qwen_vision_tower_and_turn(tmp_path, device: str, family: str, max_new: int) -> None:
    """A Qwen2.5-VL (window attention) or Qwen3-VL (deepstack) tower's rows, the teacher-forced logits
    of an image prompt (its rows at M-RoPE grid positions, the position advance carried to the text
    after it) and a whole greedy image chat turn, equal to the CPU's. The files come from llama.cpp's
    converter (tests/oracles/vision.py)."""
    import vision as V  # tests/oracles/vision.py

    if family == "qwen25v":
        dec, mm = built_once(tmp_path, family, lambda out: V.convert_qwen25vl(V.qwen25vl(), out))
        lo, hi = V.QWEN_MIN_PIXELS, V.QWEN_MAX_PIXELS
    else:
        dec, mm = built_once(tmp_path, family, lambda out: V.convert_qwen3vl(V.qwen3vl(), out))
        lo, hi = V.QWEN3_MIN_PIXELS, V.QWEN3_MAX_PIXELS
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (200, 290, 3), dtype=np.uint8)  # several 112-pixel windows for qwen25v
    embs = {dev: d.load_vision_embedder(mm, device=dev, min_pixels=lo, max_pixels=hi) for dev in ("cpu", device)}
    rows = {dev: d.encode_image_rows(e, img) for dev, e in embs.items()}
    assert nmse(rows[device], rows["cpu"]) <= 1e-9
    e = embs["cpu"]
    grid = e.image_grid(img)
    n, P = rows["cpu"].shape[0], e.proj_dim
    main = np.ascontiguousarray(rows["cpu"][:, :P])
    deep = np.ascontiguousarray(rows["cpu"][:, P:]) if e.n_deepstack else None
    logits, replies = {}, {}
    for dev in ("cpu", device):
        m = d.load_model(dec, d.QuantMode.fp32, device=dev)
        head = [1] + d.encode(m, "ka to ri", add_special=False) + [500]
        tail = [501] + d.encode(m, "mu sen la po", add_special=False)
        s = d.create_session(m, d.KVDtype.f32)
        d.eval(m, s, head)
        d.eval_embd_span_mrope(m, s, main, n, 0, n, grid, deepstack=deep)
        d.eval(m, s, tail, all_logits=True)
        logits[dev] = np.array(s.logits)
        chat = d.create_chat(m, embs[dev], max_new=max_new)
        d.add_user_image(chat, img, "ka to ri")
        replies[dev] = d.respond(m, chat, d.SamplingParams(temp=0))
        if dev == device:
            _image_second_question(m, embs[dev], img, max_new)
    assert nmse(logits[device], logits["cpu"]) <= LOGIT_BAR
    assert replies[device] == replies["cpu"]


def pipelined_greedy_equals_plain(path: str, device: str, prompt: list, mode=d.QuantMode.fp32) -> None:
    """Greedy generate with its steps issued ahead of the host (DASLLAMA_PIPELINE=1, the default
    where a backend's steps are asynchronous) against the step-by-step loop (=0), on every way a
    stream ends: max_tokens, a stop id (the step issued ahead is taken back), the callback, a
    full context, and a page pool too small for the step ahead. Equal tokens, count, position,
    history and logits, and the same continuation from the session left behind."""
    import os

    m = d.load_model(path, mode, device=device)
    plain_first = None

    def run(pipe: str, max_tokens: int, stop_ids=None, stop_after=None, n_ctx=0, pool_pages=0):
        old = os.environ.get("DASLLAMA_PIPELINE")
        os.environ["DASLLAMA_PIPELINE"] = pipe
        try:
            if pool_pages:
                s = d.create_session(m, d.create_kv_pool(m, page_rows=16, max_pages=pool_pages))
            else:
                s = d.create_session(m, d.KVDtype.f16, n_ctx=n_ctx) if n_ctx else d.create_session(m, d.KVDtype.f16)
            got, seen = [], []

            def cb(i, p):
                got.append(i)
                seen.append(s.n_past)
                return stop_after is None or len(got) < stop_after

            err = None
            try:
                n = d.generate(m, s, prompt, d.SamplingParams(), max_tokens, cb, stop_ids=stop_ids)
            except d.DasllamaError as e:  # a full pool: refused after the token's callback either way
                n, err = -1, type(e).__name__
            state = (got, n, err, s.n_past, list(s.history), np.array(s.logits))
            more = []
            if err is None and s.n_past < (n_ctx or 10 ** 9):
                d.generate(m, s, [], d.SamplingParams(), 3, lambda i, p: more.append(i), stop_ids=[])
            return state, more, np.array(s.logits), seen
        finally:
            if old is None:
                del os.environ["DASLLAMA_PIPELINE"]
            else:
                os.environ["DASLLAMA_PIPELINE"] = old

    plain_first = run("0", 12, stop_ids=[])[0][0]
    # The pipelined loop ran: from the second token on, a token's callback finds the token's own
    # step issued already (in the plain loop it runs after the callback).
    ahead, plain = run("1", 12, stop_ids=[])[3], run("0", 12, stop_ids=[])[3]
    assert [a - b for a, b in zip(ahead, plain)] == [0] + [1] * 11, (ahead, plain)
    cases = {
        "max_tokens": dict(max_tokens=12, stop_ids=[]),
        "stop id": dict(max_tokens=12, stop_ids=[plain_first[5]]),
        "callback": dict(max_tokens=12, stop_ids=[], stop_after=4),
        "full context": dict(max_tokens=12, stop_ids=[], n_ctx=len(prompt) + 6),
        "full pool": dict(max_tokens=40, stop_ids=[], pool_pages=(len(prompt) + 20) // 16 + 1),
    }
    for name, kw in cases.items():
        (a, more_a, la, _), (b, more_b, lb, _) = run("1", **kw), run("0", **kw)
        assert a[:5] == b[:5], f"{name}: pipelined {a[:5]} against plain {b[:5]}"
        assert np.array_equal(a[5], b[5]), f"{name}: the session's logits differ: NMSE {nmse(a[5], b[5]):.3g}"
        assert more_a == more_b and np.array_equal(la, lb), f"{name}: the continuation differs"
    assert len(plain_first) == 12


@contextlib.contextmanager
def _env(name: str, value: str):
    """os.environ[name] = value inside the block, as before it after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def speculated_batch_steps_equal_plain(path: str, device: str, mode=d.QuantMode.q8) -> None:
    """Speculated steps (the default; DASLLAMA_SPECULATE=0 turns them off): an eval_batch decode
    step records the next one (the same sessions, one token each) for the device to run from, so the next call only uploads its ids. The
    logits, positions and histories must be those of the plain steps bit for bit, however the
    next call differs from the one recorded: a session left out, one rewound inside its page, an
    eval of another session or of one of theirs between steps, token embeddings made between
    steps, a ragged step, a new session; and where a page is to be
    taken (page_rows 4) nothing is recorded. Each of those calls comes while a recording waits
    (the speculated run finds the moment, the plain run takes as many steps), and must not be
    taken for it; the plain steps between them must."""
    rng = np.random.default_rng(11)
    prompts = [[1] + rng.integers(3, 500, n).tolist() for n in (5, 9, 14)]
    toks = rng.integers(3, 500, 400).tolist()

    def run(spec: str, plan: list):
        with _env("DASLLAMA_SPECULATE", spec):
            m = d.load_model(path, mode, device=device)
            pool = d.create_kv_pool(m, page_rows=4)
            ws = d.create_batch_workspace(m)
            ss = [d.create_session(m, pool) for _ in prompts]
            for s, p in zip(ss, prompts):
                d.eval(m, s, p)
            seen = []
            it = iter(toks)
            k = iter(range(len(plan))) if plan and spec == "0" else None

            def step(group, tokens=None):
                d.eval_batch(m, ws, group, tokens or [next(it) for _ in group])
                seen.append([(s.n_past, list(s.history), np.array(s.logits)) for s in ss])

            def until_pending():
                # Steady steps of every session until a recording waits (speculated run); as many
                # in the plain run.
                if k is not None:
                    for _ in range(plan[next(k)]):
                        step(ss)
                    return
                step(ss)  # (one at least: what waits is then a step of every session)
                n = 1
                while not m._m.speculation_pending:
                    step(ss)
                    n += 1
                    assert n <= 8, "no step was recorded ahead"
                plan.append(n)

            def not_taken(call):
                before = m._m.speculated_steps
                call()
                assert spec == "0" or m._m.speculated_steps == before, "a different call ran the recorded step"

            until_pending()
            for _ in range(8):  # steady steps across page boundaries
                step(ss)
            until_pending()
            not_taken(lambda: step([ss[0], ss[2]]))  # one left out
            until_pending()

            def rewind():
                # One rewound by a row inside its last page, so its pages stay as recorded.
                r = next(s for s in ss if s.n_past % 4 != 1)
                pages = r.n_pages
                r.truncate(r.n_past - 1)
                assert r.n_pages == pages
                step(ss)
            not_taken(rewind)
            until_pending()
            other = d.create_session(m, pool)
            not_taken(lambda: (d.eval(m, other, prompts[1]), step(ss)))  # another session's eval between
            until_pending()
            not_taken(lambda: (d.eval(m, ss[0], [next(it)]), step(ss)))  # one of theirs
            until_pending()
            # Token embeddings for a media turn (their ids go where the waiting step's metadata is).
            not_taken(lambda: (d.embed_text_rows(m, toks[:40]), step(ss)))
            until_pending()
            not_taken(lambda: step(ss, [next(it), [next(it), next(it)], next(it)]))  # ragged
            until_pending()

            def grow():
                ss.append(d.create_session(m, pool))  # a new session
                d.eval(m, ss[3], prompts[0])
                step(ss)
            not_taken(grow)
            for _ in range(6):
                step(ss)
            return seen, m._m.speculated_steps

    plan: list = []
    spec, n1 = run("1", plan)
    plain, n0 = run("0", plan)
    assert n0 == 0
    assert 0 < n1 < len(spec), f"{n1} speculated steps of {len(spec)}"
    assert len(plain) == len(spec)
    for j, (a, b) in enumerate(zip(plain, spec)):
        for i, ((pa, ha, la), (pb, hb, lb)) in enumerate(zip(a, b)):
            assert pa == pb and ha == hb, f"step {j}, session {i}: position or history differs"
            assert np.array_equal(la, lb), f"step {j}, session {i}: logits differ"


def _stepper_streams(m, page_rows: int, prompts: list, params: list, lens: list) -> list:
    """BatchStepper over paged sessions of m: streams 0-2 start at once, stream 3 joins at the
    fourth step, stream i stopping after lens[i] tokens; each stream's tokens."""
    from dasllama.llm import BatchStepper

    pool = d.create_kv_pool(m, page_rows=page_rows)
    ss = [d.create_session(m, pool) for _ in params]
    st = BatchStepper(ss)
    got = [[] for _ in params]
    for i in (0, 1, 2):
        st.start(i, prompts[i], params[i], lens[i])
    steps = 0
    while any(st.active(i) for i in range(len(params))) or steps < 3:
        if steps == 3:
            st.start(3, prompts[3], params[3], lens[3])  # joins later
        events, _ = st.step()
        steps += 1
        for e in events:
            if e[1] != BatchStepper.STOP:
                got[e[0]].append(e[2])
    return got


def speculated_stepper_streams_equal_plain(path: str, device: str) -> None:
    """The serving loop (BatchStepper) over paged sessions with speculated steps (the default):
    streams of different lengths, greedy and sampled, started at different steps, give the tokens of the
    plain loop, and some of its steps ran from their speculated recording."""
    rng = np.random.default_rng(12)
    prompts = [[1] + rng.integers(3, 500, n).tolist() for n in (3, 8, 12, 5)]
    params = [d.SamplingParams(), d.SamplingParams(temp=0.8, top_p=0.9, seed=7), d.SamplingParams(),
              d.SamplingParams(temp=1.1, seed=3)]

    def run(spec: str):
        with _env("DASLLAMA_SPECULATE", spec):
            m = d.load_model(path, device=device)
            return _stepper_streams(m, 4, prompts, params, [10, 15, 20, 12]), m._m.speculated_steps

    plain, n0 = run("0")
    spec, n1 = run("1")
    assert n0 == 0 and n1 > 0, (n0, n1)
    assert spec == plain


def greedy_batch_steps_equal_logits_argmax(path: str, device: str, mode=d.QuantMode.q8) -> None:
    """eval_batch(greedy=True) takes each session's argmax on the backend and copies back only the
    ids: they must be numpy's argmax (the first of equal maxima) of the logits the plain steps give,
    over 3 and 12 sessions (a GPU's GEMV and tile ranges), steady decode steps (speculated, the
    default: a greedy recording must serve only a greedy call), a subset, a ragged step, and a
    ragged step of 540+ rows, past a chunk (256 rows on the CPU, 512 on a GPU: its ids come from
    two or three chunks' argmaxes). The plain run's argmaxes feed both runs, so a wrong id shows
    at its own step. Then the serving loop
    (BatchStepper) with greedy streams gives the tokens of the same loop sampling on the host
    (DASLLAMA_DEVICE_GREEDY=0)."""
    rng = np.random.default_rng(21)
    prompts = [[1] + rng.integers(3, 500, 3 + i).tolist() for i in range(12)]
    long = rng.integers(3, 500, 179).tolist()
    for B in (3, 12):
        ids_of = {}

        def run(greedy: bool):
            m = d.load_model(path, mode, device=device)
            pool = d.create_kv_pool(m, page_rows=16)
            ws = d.create_batch_workspace(m)
            ss = [d.create_session(m, pool) for _ in range(B)]
            for s, p in zip(ss, prompts):
                d.eval(m, s, p)
            plan = [("all", None)] * 6 + [("sub", None)] + [("all", None)] * 2 + [("ragged", None)] + \
                [("all", None)] * 3 + [("long", None)] + [("all", None)] * 2
            got = []
            nxt = [int(np.argmax(s.logits)) for s in ss]
            for j, (kind, _) in enumerate(plan):
                group = ss if kind != "sub" else ss[::2]
                toks = [nxt[ss.index(s)] for s in group]
                if kind == "ragged":
                    toks[1] = [toks[1], 7, 9]
                if kind == "long":
                    for i in range(3):
                        toks[i] = [toks[i]] + long
                out = d.eval_batch(m, ws, group, toks, greedy=greedy)
                if greedy:
                    assert len(out) == len(group) and all(len(s.logits) == 0 for s in group)
                    got.append(out)
                else:
                    assert out is None
                    got.append([int(np.argmax(s.logits)) for s in group])
                ids = ids_of.setdefault(j, got[-1])  # the plain run's ids feed both runs
                for s, t in zip(group, ids):
                    nxt[ss.index(s)] = t
            return got, m._m.speculated_steps

        plain, _ = run(False)
        greedy, n_spec = run(True)
        for j, (a, b) in enumerate(zip(plain, greedy)):
            assert a == b, f"B={B} step {j}: device argmax {b} against the logits' {a}"
        assert device == "cpu" or n_spec > 0, "no greedy step ran from its recording"

    params = [d.SamplingParams(), d.SamplingParams(seed=4), d.SamplingParams(), d.SamplingParams()]

    def streams(on: str):
        with _env("DASLLAMA_DEVICE_GREEDY", on):
            return _stepper_streams(d.load_model(path, mode, device=device), 16, prompts, params, [8, 12, 16, 10])

    assert streams("1") == streams("0")


# A tiny llama whose matrices are in the block formats a GPU's q8-mode prefill decodes to f16
# (q4_K, q5_K, q6_K: random blocks with sane scales, as no quantizer writes them here; q4_1,
# q5_0, q5_1: gguf-py's quantizer): layer 0 laid out as a Q4_K_M file is (Q6_K for V and
# down), layer 1 taking the others. Its widths are multiples of 256 (a K-quant's block).
BLOCK_MODEL = {"dim": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "vocab": 512,
               "layers": [{"q": "q4_K", "k": "q4_K", "v": "q6_K", "o": "q4_K", "gate": "q4_K", "up": "q4_K",
                           "down": "q6_K"},
                          {"q": "q5_K", "k": "q5_K", "v": "q6_K", "o": "q4_1", "gate": "q5_0", "up": "q5_1",
                           "down": "q5_K"}]}


def block_matrix(rng, name: str, rows: int, cols: int) -> np.ndarray:
    """rows x cols in format `name` (raw bytes a row)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
    from gguf.quants import quantize

    t = T[name.upper()]
    if name in ("q4_1", "q5_0", "q5_1"):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, t)
    bs, ts = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    # Scales: q4_K / q5_K d and dmin (weights up to d * 63 * 15 or 31), q6_K d (up to d * 127 * 32).
    fields = {"q4_K": [(0, 2e-5, 1e-4), (2, 1e-5, 5e-5)], "q5_K": [(0, 1e-5, 5e-5), (2, 1e-5, 5e-5)],
              "q6_K": [(208, 1e-5, 5e-5)]}[name]
    for off, lo, hi in fields:
        sc = rng.uniform(lo, hi, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, off:off + 2] = sc.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_block_model(path: str) -> str:
    import gguf

    c = BLOCK_MODEL
    D, F, H, KVH, V = c["dim"], c["ffn"], c["heads"], c["kv_heads"], c["vocab"]
    hd = D // H
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(1024)
    w.add_embedding_length(D)
    w.add_block_count(len(c["layers"]))
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] +
                     [f"\u2581t{i}" for i in range(V - 259)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (V - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", (rng.standard_normal((V, D)) * 0.5).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    shapes = {"q": (H * hd, D), "k": (KVH * hd, D), "v": (KVH * hd, D), "o": (D, H * hd), "gate": (F, D),
              "up": (F, D), "down": (D, F)}
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    from gguf.constants import GGMLQuantizationType as T

    for i, layer in enumerate(c["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
        for k, ft in layer.items():
            w.add_tensor(p + names[k] + ".weight", block_matrix(rng, ft, *shapes[k]), raw_dtype=T[ft.upper()])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def block_formats_q8_mode_prefill(path: str, device: str, kv=d.KVDtype.f32) -> None:
    """A 100-token prefill in q8 mode of write_block_model's file, whose block-format matrices a
    GPU decodes to f16 for an f16 GEMM and whose x it rounds to f16 once (and, over an f16 cache,
    whose attention may round Q and the probabilities to f16): all-row logits no farther from the
    CPU's fp32 ones (weights decoded exactly, f32 math) than the CPU's own q8 mode is on the same
    file and cache (a wrong op gives 1e-2 or more)."""
    ids = [1] + np.random.default_rng(9).integers(3, BLOCK_MODEL["vocab"], 99).tolist()

    def rows(mode, dev):
        m = d.load_model(path, mode, device=dev)
        s = d.create_session(m, kv, n_ctx=len(ids))
        d.eval(m, s, ids, all_logits=True)
        return np.array(s.logits).reshape(len(ids), -1)

    ref = rows(d.QuantMode.fp32, "cpu")
    e = nmse(rows(d.QuantMode.q8, device), ref)
    e_q8 = nmse(rows(d.QuantMode.q8, "cpu"), ref)
    print(f"block formats' prefill in q8 mode on {device}: NMSE {e:.3g}, the CPU's q8 mode {e_q8:.3g}")
    assert e_q8 > LOGIT_BAR, "the CPU's q8 mode should round activations"
    assert e <= e_q8, f"block formats' prefill in q8 mode on {device}: NMSE {e:.3g} against fp32, the CPU's q8 {e_q8:.3g}"
