"""The audio chat: spans, framing, embedding-row evaluation, media in the prefix cache, against transformers.

The pair is the tiny random Qwen2-Audio of tests/oracles/audio.py (fp32): its tower as an mmproj
and its language model as a qwen2 GGUF with a chatml template and the audio specials. Other
families' towers (voxtral, ultravox-style bare spans) are spliced onto the same decoder: their
rows are its width, and the framing is what is checked there.

Error bar of the whole-turn logits against transformers: 1e-4 of the largest |logit|, with an f32
KV cache (f16 KV alone moves them by ~3e-4). It is test_families.py's fp32 bar: the text decoder
measures 1e-6..5e-6 there; the tower's rows are within 1e-4 of their peak by test_audio_tower.py's
bar (observed ~2e-6 on these clips: the mel input and summation order), and the RMS-normed decoder
passes a relative input error through at about its size. A misplaced span, a wrong row count or a
missing marker moves the logits by > 1e-1 of the peak. Observed: 5.2e-7 (Qwen2-Audio, speech clip),
5.4e-7 (Qwen2-Audio, 0.1 s) and 4.9e-7 (Voxtral, 375 rows) of the peak.
"""
from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama.chat import media as M

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import audio as A  # noqa: E402
from speech import speak  # noqa: E402

SR = 16000
LOGIT_REL = 1e-4


def _assert_turn_matches(model, tower, chat, audio, n, turn, head, tail, ref):
    """The rendered audio turn, prefilled with our tower's rows, gives transformers' last logits
    (``ref``) within the bar, and respond's first piece is the reference's top token."""
    s = d.create_session(model, d.KVDtype.f32)
    body = d.media_body_rows(model, s, head, d.encode_audio_rows(tower, audio), n, model.config.dim, tail)
    d.eval_embd_body(model, s, body, len(turn), ids=turn)
    err = float(np.abs(s.logits - ref).max())
    assert err <= LOGIT_REL * float(np.abs(ref).max()), f"max abs error {err:.3g} of peak {np.abs(ref).max():.3g}"
    first = []
    d.respond(model, chat, None, first.append)
    top = int(np.argmax(ref))
    assert top in chat.stop_ids or first[0] == d.piece(model, top)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audiochat")
    m = A.qwen2_audio()
    mm = A.write_qwen2_audio(m, tmp / "mmproj-qwen2a.gguf")
    dec = A.write_decoder(m, tmp / "decoder-qwen2a.gguf")
    model = d.load_model(dec, d.QuantMode.fp32)
    tower = d.load_audio_tower(mm)
    return {"hf": m, "model": model, "tower": tower, "dir": tmp, "mmproj": mm, "decoder": dec}


@pytest.fixture(scope="module")
def clip():
    return speak("Hello there, how are you today?")


def _tok(model, s):
    ids = d.encode(model, s, add_special=False, parse_special=True)
    assert len(ids) == 1
    return ids[0]


# -- embedding-row evaluation -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [d.QuantMode.fp32, d.QuantMode.q8])
def test_generate_embd_is_generate(pair, mode):
    """The tutorial's identity: generate_embd over embed_text_rows(prompt) == generate(prompt), greedy."""
    model = d.load_model(pair["decoder"], mode)
    prompt = d.encode(model, "<|im_start|>user\nkato rimu sen la<|im_end|>\n<|im_start|>assistant\n",
                      add_special=False, parse_special=True)
    a, b = [], []
    s1 = d.create_session(model)
    d.generate(model, s1, prompt, d.SamplingParams(), 24, lambda i, p: a.append((i, p)), stop_ids=[])
    rows = d.embed_text_rows(model, prompt)
    assert rows.shape == (len(prompt), model.config.dim) and rows.dtype == np.float32
    s2 = d.create_session(model)
    d.generate_embd(model, s2, rows, len(prompt), d.SamplingParams(), 24, lambda i, p: b.append((i, p)), stop_ids=[])
    assert len(a) == 24 and a == b
    assert "".join(p for _, p in a).encode() == "".join(p for _, p in b).encode()
    assert np.array_equal(s1.logits, s2.logits)
    # out= form: rows written at an offset of a caller's array
    buf = np.zeros((len(prompt) + 2, model.config.dim), np.float32)
    d.embed_text_rows(model, prompt, buf, 2)
    assert np.array_equal(buf[2:], rows)


def test_eval_embd_body_records_ids_and_matches_token_prefill(pair):
    model = pair["model"]
    head = d.encode(model, "la po qui", add_special=False)
    tail = d.encode(model, " ver dan el", add_special=False)
    rows = np.random.default_rng(0).standard_normal((5, model.config.dim)).astype(np.float32)
    ids = d.media_ids("k", 5)
    s = d.create_session(model)
    body = d.media_body_rows(model, s, head, rows, 5, model.config.dim, tail)
    assert body.shape == (len(head) + 5 + len(tail), model.config.dim)
    d.eval_embd_body(model, s, body, body.shape[0], 0, 0, ids=head + ids + tail)
    assert s.history == head + ids + tail
    ref = d.create_session(model)
    d.eval(model, ref, head)
    d.eval_embd(model, ref, rows, 5, ids=ids)
    d.eval(model, ref, tail)
    np.testing.assert_allclose(s.logits, ref.logits, rtol=0, atol=1e-4 * np.abs(ref.logits).max())
    # Non-causal spans are served (tests/test_vision.py checks them); one outside the rows is refused.
    for lo, hi in ((3, 1), (0, body.shape[0] + 1), (-1, 2)):
        with pytest.raises(ValueError):
            d.eval_embd_body(model, s, body, body.shape[0], lo, hi)
    with pytest.raises(ValueError):
        d.media_body_rows(model, s, head, rows, 5, model.config.dim + 1, tail)
    with pytest.raises(TypeError):
        d.eval_embd(model, s, rows.astype(np.float64), 5)
    with pytest.raises(ValueError):
        d.eval_embd(model, s, rows[:, :10], 5)


# -- the chat ---------------------------------------------------------------------------------------------

def test_width_mismatch_and_bad_input(pair, tmp_path):
    model = pair["model"]
    wh = A.write_whisper(A.whisper_encoder(), tmp_path / "w.gguf")
    emb = d.load_audio_embedder(wh)  # 48-wide rows into a 64-wide decoder
    with pytest.raises(ValueError, match="width"):
        d.create_chat(model, emb)
    with pytest.raises(ValueError, match="no audio tower"):
        d.add_user_audio(d.create_chat(model), np.zeros(1600, np.float32))
    chat = d.create_chat(model, pair["tower"])
    with pytest.raises(ValueError, match="floating point"):
        d.add_user_audio(chat, np.zeros(1600, np.int16))
    with pytest.raises(ValueError, match="mono"):
        d.add_user_audio(chat, np.zeros((1600, 2), np.float32))
    with pytest.raises(ValueError, match="not a readable"):
        d.add_user_audio(chat, b"RIFF\x00\x00\x00\x00WAVEjunk" * 3)
    with pytest.raises(ValueError, match="not a readable"):
        d.add_user_audio(chat, b"")
    with pytest.raises(FileNotFoundError):
        d.add_user_audio(chat, str(tmp_path / "missing.wav"))
    with pytest.raises(TypeError):
        d.add_user_audio(chat, 12)
    with pytest.raises(ValueError, match="too short"):
        d.add_user_audio(chat, np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        d.add_user_audio(chat, np.full(160, np.nan, np.float32))
    with pytest.raises(ValueError, match="wide"):
        d.add_user_audio_rows(model, chat, np.zeros((3, 48), np.float32))
    with pytest.raises(TypeError):
        d.add_user_audio_rows(model, chat, np.zeros((3, 64), np.float64))
    assert not chat.pending  # nothing half-queued by the refusals


def test_turn_renders_framed_span_and_matches_the_processor(pair, clip):
    """Qwen framing, text runs broken at the span, and the same ids Qwen2AudioProcessor builds."""
    from transformers import AutoTokenizer, Qwen2AudioProcessor, WhisperFeatureExtractor

    model, tower = pair["model"], pair["tower"]
    chat = d.create_chat(model, tower)
    n = d.add_user_audio(chat, clip, "What is said?")
    ids = d.render_turn(model, chat)
    head, tail = d.render_turn_audio(model, chat)
    assert len(head) + n + len(tail) == len(ids)
    assert head[-1] == _tok(model, "<|audio_bos|>") and tail[0] == _tok(model, "<|audio_eos|>")
    assert all(d.is_media_position(t) for t in ids[len(head):len(head) + n])
    assert ids[len(head):len(head) + n] == d.media_ids(M.clip_key(tower, clip), n)

    tok = AutoTokenizer.from_pretrained(str(pair["dir"]), gguf_file=os.path.basename(pair["decoder"]))
    proc = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok)
    text = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is said?<|im_end|>\n<|im_start|>assistant\n"
    inp = proc(text=text, audio=[clip], sampling_rate=SR, return_tensors="pt", add_special_tokens=False)
    assert inp["input_ids"][0].tolist() == [A.AUDIO_TOKEN if t < 0 else t for t in ids]


def test_family_framing(pair, clip, tmp_path):
    model = pair["model"]
    vox = d.load_audio_tower(A.write_voxtral(A.voxtral(), tmp_path / "v.gguf"))
    ux = d.load_audio_tower(A.write_ultravox(A.ultravox(), tmp_path / "u.gguf"))
    assert not d.audio_span_bare(pair["tower"]) and not d.audio_span_bare(vox) and d.audio_span_bare(ux)
    for tower, before in ((vox, "[BEGIN_AUDIO]"), (ux, None)):
        chat = d.create_chat(model, tower)
        n = d.add_user_audio(chat, clip, "Hi")
        head, tail = d.render_turn_audio(model, chat)
        assert head == d.encode(model, "<|im_start|>user\n" + (before or ""), add_special=False, parse_special=True)
        assert tail == d.encode(model, "Hi<|im_end|>\n<|im_start|>assistant\n", add_special=False,
                                parse_special=True)
        assert n == tower.n_rows(len(clip))
    # Pre-encoded rows on a chat with no tower: the decoder's vocab picks qwen's markers; bare drops them.
    rows = d.encode_audio_rows(pair["tower"], clip)
    for bare in (False, True):
        chat = d.create_chat(model)
        d.add_user_audio_rows(model, chat, rows, rows.shape[0], bare)
        d.add_user(chat, "Hi")
        head, tail = d.render_turn_audio(model, chat)
        assert (head[-1] == _tok(model, "<|audio_bos|>")) != bare
        assert (tail[0] == _tok(model, "<|audio_eos|>")) != bare


def test_span_in_the_middle_of_a_message(pair, clip):
    model, tower = pair["model"], pair["tower"]
    rows = d.encode_audio_rows(tower, clip)
    n = rows.shape[0]
    lead = "Here is a recording. "
    r = d.create_chat_renderer(model)
    d.add_user(r, lead + "What is being said?")
    d.add_user_span(model, r, "clip-1", n, len(lead.encode()), False, False)
    turn = d.render_turn(model, r)
    lo = next(i for i, t in enumerate(turn) if d.is_media_position(t))
    head, tail = turn[:lo], turn[lo + n:]
    assert turn[lo:lo + n] == d.media_ids("clip-1", n)
    assert head == d.encode(model, "<|im_start|>user\n" + lead + "<|audio_bos|>", add_special=False,
                            parse_special=True)
    assert (head, tail) == tuple(d.render_turn_audio(model, r))
    # The one-body prefill of the tutorial, then greedy, equals the chat's own respond on that turn.
    s = d.create_session(model)
    body = d.media_body_rows(model, s, head, rows, n, model.config.dim, tail)
    d.eval_embd_body(model, s, body, len(turn), 0, 0, ids=turn)
    chat = d.create_chat(model, max_new=6)
    d.add_user(chat, lead + "What is being said?")
    d.add_user_span(model, chat, "clip-1", n, len(lead.encode()), False, False, rows=rows)
    reply = d.respond(model, chat)
    assert chat.session.history[:len(turn)] == turn
    first = int(np.argmax(s.logits))
    assert reply.startswith(d.piece(model, first)) or first in chat.stop_ids


def test_follow_ups_remember_and_a_second_clip(pair, clip):
    model, tower = pair["model"], pair["tower"]
    chat = d.create_chat(model, tower, max_new=6)
    n = d.add_user_audio(chat, clip, "What is said?")
    d.respond(model, chat)
    st = dict(chat.media_stats)
    assert st["media_rows_prefilled"] == n
    span = d.media_ids(M.clip_key(tower, clip), n)
    d.add_user(chat, "Say it again.")
    d.respond(model, chat)
    # The follow-up prefilled only its own text: the clip is still in the KV (and in the rendering).
    assert chat.media_stats["media_rows_prefilled"] == n and chat.media_stats["encodes"] == st["encodes"]
    h = chat.session.history
    assert any(h[i:i + n] == span for i in range(len(h) - n + 1))
    other = speak("Goodbye and thank you.")
    n2 = d.add_user_audio(chat, other, "And this one?")
    d.respond(model, chat)
    assert chat.media_stats["media_rows_prefilled"] == n + n2
    assert sum(d.is_media_position(t) for t in chat.session.history) == n + n2


@pytest.mark.parametrize("what", ["silence", "tenth", "ten_minutes"])
def test_edge_clips(pair, what):
    model, tower = pair["model"], pair["tower"]
    x = {"silence": np.zeros(3 * SR, np.float32), "tenth": speak("Hi")[:SR // 10].copy(),
         "ten_minutes": np.resize(speak("Ask not what your country can do for you."), 600 * SR)}[what]
    chat = d.create_chat(model, tower, max_new=3, n_ctx=20000)
    n = d.add_user_audio(chat, x, "What is said?")
    d.respond(model, chat)
    assert chat.media_stats["media_rows_prefilled"] == n
    assert sum(d.is_media_position(t) for t in chat.session.history) == n
    if what == "ten_minutes":
        assert n == 15000  # 20 windows of 750 rows: the processor's count for a 600 s clip


def test_audio_files_and_bytes(pair, clip, tmp_path):
    import soundfile as sf

    model, tower = pair["model"], pair["tower"]
    # A 16 kHz float WAV decodes to the very samples: the same content key, the same span.
    p = tmp_path / "a.wav"
    sf.write(p, clip, SR, subtype="FLOAT")
    assert np.array_equal(d.load_audio(str(p)), clip)
    assert np.array_equal(d.load_audio(p.read_bytes()), clip)
    # 44.1 kHz stereo FLAC / OGG / MP3: down-mixed and resampled to 16 kHz; close to the clip (lossy codecs).
    t = np.arange(int(1.5 * 44100)) / 44100
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    ref = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(1.5 * SR)) / SR)).astype(np.float32)
    for fmt, sub in (("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")):
        buf = io.BytesIO()
        sf.write(buf, np.stack([tone, tone], 1), 44100, format=fmt, subtype=sub)
        x = d.load_audio(buf.getvalue())
        assert x.dtype == np.float32 and x.ndim == 1 and abs(len(x) - len(ref)) <= SR // 10, fmt
        mid = slice(SR // 4, SR)  # away from codec priming / padding at the ends
        if fmt == "FLAC":
            assert np.abs(x[mid] - ref[mid]).max() < 2e-3
        else:  # lossy: the level survives
            assert abs(np.sqrt(np.mean(x[mid] ** 2)) - 0.3 / np.sqrt(2)) < 0.03, fmt
    chat = d.create_chat(model, tower, max_new=2)
    n = d.add_user_audio(chat, str(p), "What is said?")
    assert n == tower.n_rows(len(clip))
    d.respond(model, chat)


# -- media in the prefix cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("page_rows", [1, 16])
def test_second_question_on_a_clip_runs_no_encoder_and_no_media_prefill(pair, clip, page_rows):
    model, tower = pair["model"], pair["tower"]
    pool = d.create_kv_pool(model, page_rows=page_rows)
    cache = d.create_prefix_cache()
    M.ROW_CACHE.clear()
    a = d.create_chat(model, tower, max_new=8, pool=pool, cache=cache)
    n = d.add_user_audio(a, clip, "What is said?")
    d.respond(model, a)
    assert a.media_stats["encodes"] == 1 and a.media_stats["media_rows_prefilled"] == n
    enc0 = d.audio_cache_stats()["encodes"]

    # The tower-output cache emptied: a clip row left to prefill would need the encoder. The span is
    # attached whole instead, also where it ends mid-page (the page holding its end is hit in part).
    M.ROW_CACHE.clear()
    b = d.create_chat(model, tower, max_new=8, pool=pool, cache=cache)
    d.add_user_audio(b, clip, "Who is speaking?")
    reply = d.respond(model, b)
    end = max(i for i, t in enumerate(b.session.history) if t < 0) + 1
    assert page_rows == 1 or end % page_rows != 0
    assert b.media_stats["rows_attached"] >= end
    assert b.media_stats["media_rows_prefilled"] == 0 and b.media_stats["encodes"] == 0
    assert d.audio_cache_stats()["encodes"] == enc0

    cold = d.create_chat(model, tower, max_new=8)
    d.add_user_audio(cold, clip, "Who is speaking?")
    assert d.respond(model, cold) == reply
    assert cold.session.history == b.session.history


def test_row_cache_is_bounded_lru(pair):
    tower = pair["tower"]
    c = M.RowCache(max_bytes=1)  # one entry at a time
    x1, x2 = np.zeros(SR, np.float32), np.full(SR, 0.01, np.float32)
    k1, k2 = M.clip_key(tower, x1), M.clip_key(tower, x2)
    assert k1 != k2
    c.get(tower, k1, x1)
    c.get(tower, k1, x1)
    c.get(tower, k2, x2)
    c.get(tower, k1, x1)
    st = c.stats()
    assert st["hits"] == 1 and st["encodes"] == 3 and st["entries"] == 1


# -- against transformers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["tenth", "speech"])
def test_audio_turn_logits_match_transformers(pair, clip, text):
    """The whole turn through Qwen2AudioForConditionalGeneration's forward, its processor building the
    input (features, frame mask, the expanded <|AUDIO|> run), against the chat's rendered turn prefilled
    as one body; and the chat's greedy reply opens with transformers' argmax."""
    import torch
    from transformers import AutoTokenizer, Qwen2AudioProcessor, WhisperFeatureExtractor

    model, tower, hf = pair["model"], pair["tower"], pair["hf"]
    x = clip if text == "speech" else clip[:SR // 10].copy()
    tok = AutoTokenizer.from_pretrained(str(pair["dir"]), gguf_file=os.path.basename(pair["decoder"]))
    proc = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=tok)
    prompt = "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>What is said?<|im_end|>\n<|im_start|>assistant\n"
    inp = proc(text=prompt, audio=[x], sampling_rate=SR, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        ref = hf(**inp).logits[0, -1].numpy()

    chat = d.create_chat(model, tower, max_new=1, kv_dtype=d.KVDtype.f32)
    n = d.add_user_audio(chat, x, "What is said?")
    turn = d.render_turn(model, chat)
    assert [A.AUDIO_TOKEN if t < 0 else t for t in turn] == inp["input_ids"][0].tolist()
    head, tail = d.render_turn_audio(model, chat)
    _assert_turn_matches(model, tower, chat, x, n, turn, head, tail, ref)


# -- CLI and example --------------------------------------------------------------------------------------

def test_cli_chat_with_audio(pair, clip, tmp_path, capsys):
    import soundfile as sf

    from dasllama.cli import main

    wav = tmp_path / "clip.wav"
    sf.write(wav, clip, SR)
    assert main(["chat", "What is said?", "--model", str(pair["decoder"]), "--mmproj", str(pair["mmproj"]),
                 "--audio", str(wav), "--max-tokens", "4", "--mode", "fp32"]) == 0
    out = capsys.readouterr().out
    chat = d.create_chat(pair["model"], pair["tower"], max_new=4)
    d.add_user_audio(chat, str(wav), "What is said?")
    assert out == d.respond(pair["model"], chat) + "\n"
    assert main(["chat", "x", "--model", str(pair["decoder"]), "--audio", str(wav)]) == 2
    assert main(["chat", "x", "--model", str(pair["decoder"]), "--mmproj", str(pair["mmproj"]),
                 "--audio", str(tmp_path / "missing.wav")]) == 2


def test_example_runs(pair, clip, tmp_path):
    import runpy

    import soundfile as sf

    wav = tmp_path / "clip.wav"
    sf.write(wav, clip, SR)
    ex = os.path.join(os.path.dirname(__file__), "..", "examples", "audio_chat.py")
    mod = runpy.run_path(ex)
    assert mod["main"]([str(pair["decoder"]), str(pair["mmproj"]), str(wav)]) == 0


def test_scheduler_shape_render_attach_prefill(pair, clip):
    """What a server does per request: render with a renderer chat (history replayed, no KV), attach
    through the prefix cache, prefill the rest with prefill_media_body, decode, donate."""
    model, tower = pair["model"], pair["tower"]
    pool = d.create_kv_pool(model, page_rows=1)
    cache = d.create_prefix_cache()

    def request(question, history=()):
        r = d.create_chat_renderer(model, tower=tower)
        prompt = []
        for q, a in history:
            d.add_user_audio(r, clip, q)
            prompt += d.render_assistant(model, r, a)
        d.add_user(r, question)
        prompt += d.render_turn(model, r)
        s = d.create_session(model, pool)
        n = d.prefix_attach(cache, pool, s, prompt)
        c = d.prefill_media_body(model, s, r, prompt[n:-1])
        out = []
        d.generate(model, s, prompt[-1:], None, 6, lambda i, p: out.append(p), stop_ids=r.stop_ids)
        d.prefix_insert(cache, pool, s, s.history)
        d.release_kv_pages(s)
        return "".join(out), c, prompt

    M.ROW_CACHE.clear()
    enc0 = d.audio_cache_stats()["encodes"]
    r = d.create_chat_renderer(model, tower=tower)
    d.add_user_audio(r, clip, "What is said?")
    ids = d.render_turn(model, r)
    assert d.audio_cache_stats()["encodes"] == enc0  # rendering keys and counts the clip, encodes nothing
    # Request 1 carries the clip in its first user message.
    r1 = d.create_chat_renderer(model, tower=tower)
    d.add_user_audio(r1, clip, "What is said?")
    prompt1 = d.render_turn(model, r1)
    assert prompt1 == ids
    s = d.create_session(model, pool)
    c1 = d.prefill_media_body(model, s, r1, prompt1[:-1])
    out1 = []
    d.generate(model, s, prompt1[-1:], None, 6, lambda i, p: out1.append(p), stop_ids=r1.stop_ids)
    d.prefix_insert(cache, pool, s, s.history)
    d.release_kv_pages(s)
    assert c1["encodes"] == 1 and c1["media_rows_prefilled"] == sum(t < 0 for t in ids)
    # Request 2 replays that exchange and asks again: the clip is attached, not encoded nor prefilled.
    reply2, c2, prompt2 = request("And who speaks?", [("What is said?", "".join(out1))])
    assert c2["encodes"] == 0 and c2["media_rows_prefilled"] == 0
    chat = d.create_chat(model, tower, max_new=6)
    d.add_user_audio(chat, clip, "What is said?")
    d.add_assistant(model, chat, "".join(out1))
    d.add_user(chat, "And who speaks?")
    assert d.respond(model, chat) == reply2


def test_create_chat_keeps_the_text_only_positional_form(pair):
    model = pair["model"]
    c = d.create_chat(model, "Be brief.", 7, d.KVDtype.f32)
    assert c.system == "Be brief." and c.max_new == 7 and c.session.kv_dtype == d.KVDtype.f32 and c.tower is None
    c = d.create_chat(model, "Be brief.", 5)
    assert c.max_new == 5 and c.session.kv_dtype == d.KVDtype.f16
    c = d.create_chat(model, pair["tower"], "Be brief.", 3)
    assert c.tower is pair["tower"] and c.system == "Be brief." and c.max_new == 3
    with pytest.raises(TypeError):
        d.create_chat(model, object())
    with pytest.raises(ValueError, match="pool"):
        d.create_chat(model, cache=d.create_prefix_cache())


def test_voxtral_turn_logits_match_transformers(clip, tmp_path):
    """A Voxtral pair (its llama decoder + its tower): the chat's turn against VoxtralForConditionalGeneration.

    VoxtralProcessor needs mistral-common's tokenizer, which is not installed here, so the input is
    built as that processor lays it out -- [INST][BEGIN_AUDIO], 375 [AUDIO] ids per 30 s window, the
    text, [/INST] -- from our rendered ids, with WhisperFeatureExtractor's 30 s features. Bar as above."""
    import torch

    vm = A.voxtral()
    mm = A.write_voxtral(vm, tmp_path / "mmproj-voxtral.gguf")
    dec = A.write_decoder(vm, tmp_path / "decoder-voxtral.gguf", A.VOXTRAL_TEMPLATE, A.VOXTRAL_SPECIALS)
    model = d.load_model(dec, d.QuantMode.fp32)
    tower = d.load_audio_tower(mm)
    chat = d.create_chat(model, tower, max_new=1, kv_dtype=d.KVDtype.f32)
    n = d.add_user_audio(chat, clip, "What is said?")
    turn = d.render_turn(model, chat)
    head, tail = d.render_turn_audio(model, chat)
    assert n == 375 and head == [506, 505] and tail[-1] == 507
    ids = torch.tensor([[A.AUDIO_TOKEN if t < 0 else t for t in turn]])
    with torch.no_grad():
        ref = vm(input_ids=ids, input_features=A._features(clip, 128)).logits[0, -1].numpy()
    _assert_turn_matches(model, tower, chat, clip, n, turn, head, tail, ref)
