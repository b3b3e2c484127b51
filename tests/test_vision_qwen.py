"""The qwen25v tower and M-RoPE image turns against transformers' tiny random Qwen2.5-VL.

The model is a seeded fp32 Qwen2_5_VLForConditionalGeneration (tests/oracles/vision.py: a 4-block
window-attention ViT, the patch merger, a 2-layer decoder with M-RoPE sections [2, 3, 3]), turned
into a decoder GGUF (arch qwen2vl) and an mmproj GGUF by llama.cpp's own convert_hf_to_gguf.py.
Checked against transformers: the pixel values (Qwen2VLImageProcessorPil on a real photo, llama.cpp's
test-1.jpeg, with a small pixel budget so it makes a few dozen rows over several attention windows),
the image rows (``get_image_features``), and the logits of a prompt with an image (the model's
forward with ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``, which computes its own
M-RoPE positions: ``get_rope_index``).

Error bars as tests/test_vision.py: pixels 1e-6 (the same PIL resize, one multiply and one divide);
rows and logits 1e-4 of the reference's largest magnitude (fp32 both sides). The same prompt with
plain rope positions moves the logits by > 100x the bar here (checked), so the bar separates the two.
"""
from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
import torch

import dasllama as d

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import moe  # noqa: E402
import vision as V  # noqa: E402

REL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    m = V.qwen25vl()
    dec, mm = V.convert_qwen25vl(m, str(tmp_path_factory.mktemp("qwen25v")))
    return m, dec, mm


@pytest.fixture(scope="module")
def photo():
    return (moe.llama_cpp_dir() / "tools" / "mtmd" / "test-1.jpeg").read_bytes()


def _emb(mm):
    return d.load_vision_embedder(mm, min_pixels=V.QWEN_MIN_PIXELS, max_pixels=V.QWEN_MAX_PIXELS)


def _ref_inputs(photo):
    from PIL import Image

    out = V.qwen_image_processor()(images=[Image.open(io.BytesIO(photo)).convert("RGB")], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _close(ours, ref, what, rel=REL):
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs {ref.shape}"
    err = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} vs bar {rel * scale:.3g}"
    return err / scale


def test_load_detects_family(built):
    _, dec, mm = built
    assert d.vision_probe_family(mm) == "qwen25v"
    e = _emb(mm)
    assert (e.family, e.mrope, e.non_causal, e.proj_dim, e.n_rows) == ("qwen25v", True, False, 64, 0)
    model = d.load_model(dec, d.QuantMode.fp32)
    assert model.arch == "qwen2vl" and model.config.rope_sections[:3] == (2, 3, 3)


def test_pixel_values_match_processor(built, photo):
    _, _, mm = built
    e = _emb(mm)
    ref, grid = _ref_inputs(photo)
    ours = e.pixel_values(photo)
    gh, gw = int(grid[0, 1]), int(grid[0, 2])
    assert ours.shape == (3, gh * 14, gw * 14)
    assert e.image_grid(photo) == (gh // 2, gw // 2)
    # the processor's own patch layout of our pixels
    flat, _, _ = V.qwen_image_processor().patchify(ours, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert float(np.abs(flat - ref.numpy()).max()) <= 1e-6


def test_rows_match_get_image_features(built, photo):
    m, _, mm = built
    e = _emb(mm)
    px, grid = _ref_inputs(photo)
    gh, gw = e.image_grid(photo)
    assert gh > 4 or gw > 4, "the photo must span several 112-pixel windows"
    with torch.no_grad():
        ref = m.get_image_features(px, grid).pooler_output[0].numpy()
    ours = d.encode_image_rows(e, photo)
    assert ours.shape == (gh * gw, 64)
    _close(ours, ref, "qwen25v rows")


def test_image_turn_logits_match_transformers(built, photo):
    """head, <|vision_start|>, the image rows at M-RoPE grid positions, <|vision_end|>, tail: teacher-forced
    logits against transformers' forward, the tail after the image in a later eval (the session carries
    the image's position advance)."""
    m, dec, mm = built
    model = d.load_model(dec, d.QuantMode.fp32)
    e = _emb(mm)
    head = [1] + d.encode(model, "ka to ri mu", add_special=False) + [500]
    tail = [501] + d.encode(model, "sen la po qui ver dan el", add_special=False)
    gh, gw = e.image_grid(photo)
    n = gh * gw
    ids = head + [502] * n + tail
    px, grid = _ref_inputs(photo)
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), pixel_values=px, image_grid_thw=grid,
                mm_token_type_ids=torch.tensor([[1 if t == 502 else 0 for t in ids]]))
    ref = out.logits[0].numpy()

    rows = d.encode_image_rows(e, photo)
    s = d.create_session(model, d.KVDtype.f32)
    d.eval(model, s, head)
    d.eval_embd_span_mrope(model, s, rows, n, 0, n, (gh, gw))
    _close(np.asarray(s.logits).reshape(-1), ref[len(head) + n - 1], "logits of the last image row")
    assert s.rope_marks == [(len(head) + n, max(gh, gw) - n)]
    d.eval(model, s, tail, all_logits=True)
    ours = np.asarray(s.logits).reshape(len(tail), -1)
    rel = _close(ours, ref[len(head) + n:], "logits after the image")

    # Plain positions for the image rows (eval_embd_span, causal): far off transformers.
    s2 = d.create_session(model, d.KVDtype.f32)
    d.eval(model, s2, head)
    d.eval_embd_span(model, s2, rows, n, 0, 0)
    d.eval(model, s2, tail, all_logits=True)
    plain = np.asarray(s2.logits).reshape(len(tail), -1)
    ref_t = ref[len(head) + n:]
    assert float(np.abs(plain - ref_t).max()) > 100 * rel * float(np.abs(ref_t).max())

    # One call: head, image and tail rows as one body.
    s3 = d.create_session(model, d.KVDtype.f32)
    body = d.media_body_rows(model, None, head, rows, n, model.config.dim, tail)
    d.eval_embd_span_mrope(model, s3, body, len(ids), len(head), len(head) + n, (gh, gw))
    _close(np.asarray(s3.logits).reshape(-1), ref[-1], "logits of a one-call body")
    # Rewinding past the image drops its mark.
    s.truncate(len(head) + 1)
    assert s.rope_marks == []


def test_a_span_that_is_not_its_grid_is_refused(built):
    _, dec, mm = built
    model = d.load_model(dec, d.QuantMode.fp32)
    s = d.create_session(model, d.KVDtype.f32)
    rows = np.zeros((6, model.config.dim), np.float32)
    with pytest.raises(ValueError, match="grid"):
        d.eval_embd_span_mrope(model, s, rows, 6, 0, 6, (2, 2))
    assert s.n_past == 0


# -- the chat and the prefix cache -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(built):
    _, dec, mm = built
    return d.load_model(dec), _emb(mm)


def test_image_chat_equals_the_rows_spliced_by_hand(pair, photo):
    model, e = pair
    chat = d.create_chat(model, e, max_new=6, kv_dtype=d.KVDtype.f32)
    n = d.add_user_image(chat, photo, "ka to ri")
    assert n == e.image_rows(photo)
    head, tail = d.render_turn_image(model, chat)
    assert head[-1] == 500 and tail[0] == 501
    reply = d.respond(model, chat, d.SamplingParams())

    s = d.create_session(model, d.KVDtype.f32)
    rows = d.encode_image_rows(e, photo)
    body = d.media_body_rows(model, s, head, rows, n, model.config.dim, tail[:-1])
    d.eval_embd_span_mrope(model, s, body, body.shape[0], len(head), len(head) + n, e.image_grid(photo))
    toks = []
    d.generate(model, s, tail[-1:], d.SamplingParams(), 6, lambda t, p: toks.append(t) or True,
               stop_ids=list(d.effective_stop_ids(chat)))
    # (decode drops the leading space of the first SentencePiece piece; the streamed reply keeps it)
    assert reply.lstrip() == d.decode(model, [t for t in toks if t not in d.effective_stop_ids(chat)]).lstrip()


@pytest.mark.parametrize("page_rows", [1, 16])
def test_second_question_on_an_image_runs_no_encoder_and_no_image_prefill(pair, photo, page_rows):
    """A second conversation about the same image attaches its rows from the prefix cache (M-RoPE marks
    restored): no encode, no image rows prefilled (page_rows 1), and its reply equals a cold run's."""
    from dasllama.chat import media as M

    model, e = pair
    pool = d.create_kv_pool(model, page_rows=page_rows)
    cache = d.create_prefix_cache()
    M.ROW_CACHE.clear()
    a = d.create_chat(model, e, max_new=6, pool=pool, cache=cache)
    n = d.add_user_image(a, photo, "ka to ri")
    d.respond(model, a)
    assert a.media_stats["encodes"] == 1 and a.media_stats["media_rows_prefilled"] == n
    enc0 = d.media_cache_stats()["image_encodes"]

    b = d.create_chat(model, e, max_new=6, pool=pool, cache=cache)
    d.add_user_image(b, photo, "mu sen la")
    reply = d.respond(model, b)
    assert b.media_stats["rows_attached"] > 0 and b.media_stats["encodes"] == 0
    if page_rows == 1:
        assert b.media_stats["media_rows_prefilled"] == 0
    assert d.media_cache_stats()["image_encodes"] == enc0

    cold = d.create_chat(model, e, max_new=6, pool=d.create_kv_pool(model, page_rows=page_rows))
    d.add_user_image(cold, photo, "mu sen la")
    assert reply == d.respond(model, cold)
    # the attached session carries the image's position advance, as the cold one does
    gh, gw = e.image_grid(photo)
    assert b.session.rope_marks == cold.session.rope_marks
    assert [dl for _, dl in cold.session.rope_marks] == [max(gh, gw) - n]
