"""The qwen25v and qwen3v towers and M-RoPE image turns against transformers' tiny random Qwen-VLs.

The models are seeded fp32 Qwen2_5_VLForConditionalGeneration (tests/oracles/vision.py: a 4-block
window-attention ViT, the patch merger, a 2-layer decoder with M-RoPE sections [2, 3, 3]) and
Qwen3VLForConditionalGeneration (a 4-block ViT with resampled learned positions and two deepstack
mergers, a 3-layer qwen3 decoder with interleaved M-RoPE taking the deepstack features after its
first two layers), each turned into a decoder GGUF (arch qwen2vl / qwen3vl) and an mmproj GGUF by
llama.cpp's own convert_hf_to_gguf.py. Checked against transformers: the pixel values
(Qwen2VLImageProcessorPil on a real photo, llama.cpp's test-1.jpeg, with a small pixel budget so it
makes a few dozen rows -- over several attention windows for qwen25v), the image rows and deepstack
features (``get_image_features``), and the logits of a prompt with an image (the model's forward with
``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``, which computes its own M-RoPE
positions: ``get_rope_index``).

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


# family -> (model, converter, processor, min / max pixels, patch, decoder arch)
FAMILIES = {
    "qwen25v": (V.qwen25vl, V.convert_qwen25vl, V.qwen_image_processor, V.QWEN_MIN_PIXELS, V.QWEN_MAX_PIXELS, 14,
                "qwen2vl"),
    "qwen3v": (V.qwen3vl, V.convert_qwen3vl, V.qwen3_image_processor, V.QWEN3_MIN_PIXELS, V.QWEN3_MAX_PIXELS, 16,
               "qwen3vl"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request, tmp_path_factory):
    fam = request.param
    build, convert = FAMILIES[fam][:2]
    m = build()
    dec, mm = convert(m, str(tmp_path_factory.mktemp(fam)))
    return m, dec, mm, fam


@pytest.fixture(scope="module")
def photo():
    return (moe.llama_cpp_dir() / "tools" / "mtmd" / "test-1.jpeg").read_bytes()


def _emb(mm, fam):
    lo, hi = FAMILIES[fam][3:5]
    return d.load_vision_embedder(mm, min_pixels=lo, max_pixels=hi)


def _ref_inputs(photo, fam):
    from PIL import Image

    out = FAMILIES[fam][2]()(images=[Image.open(io.BytesIO(photo)).convert("RGB")], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _split(rows, e):
    """The tower's rows: the decoder's rows and the deepstack features (None without them)."""
    return np.ascontiguousarray(rows[:, :e.proj_dim]), (np.ascontiguousarray(rows[:, e.proj_dim:])
                                                        if e.n_deepstack else None)


def _close(ours, ref, what, rel=REL):
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs {ref.shape}"
    err = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} vs bar {rel * scale:.3g}"
    return err / scale


def test_load_detects_family(built):
    _, dec, mm, fam = built
    assert d.vision_probe_family(mm) == fam
    e = _emb(mm, fam)
    n_ds = 2 if fam == "qwen3v" else 0
    assert (e.family, e.mrope, e.non_causal, e.proj_dim, e.n_rows, e.n_deepstack) == (fam, True, False, 64, 0, n_ds)
    model = d.load_model(dec, d.QuantMode.fp32)
    assert model.arch == FAMILIES[fam][6] and model.config.rope_sections[:3] == (2, 3, 3)
    assert model.config.n_deepstack == n_ds


def test_pixel_values_match_processor(built, photo):
    _, _, mm, fam = built
    e = _emb(mm, fam)
    ref, grid = _ref_inputs(photo, fam)
    ours = e.pixel_values(photo)
    gh, gw = int(grid[0, 1]), int(grid[0, 2])
    p = FAMILIES[fam][5]
    assert ours.shape == (3, gh * p, gw * p)
    assert e.image_grid(photo) == (gh // 2, gw // 2)
    # the processor's own patch layout of our pixels
    flat, _, _ = FAMILIES[fam][2]().patchify(ours, patch_size=p, merge_size=2, temporal_patch_size=2)
    assert float(np.abs(flat - ref.numpy()).max()) <= 1e-6


def test_rows_match_get_image_features(built, photo):
    m, _, mm, fam = built
    e = _emb(mm, fam)
    px, grid = _ref_inputs(photo, fam)
    gh, gw = e.image_grid(photo)
    assert gh > 4 or gw > 4, "the photo must span several 112-pixel windows"
    with torch.no_grad():
        o = m.model.get_image_features(px, grid)
    ours = d.encode_image_rows(e, photo)
    assert ours.shape == (gh * gw, 64 * (1 + e.n_deepstack))
    rows, deep = _split(ours, e)
    _close(rows, o.pooler_output[0].numpy(), f"{fam} rows")
    if e.n_deepstack:
        for k, feat in enumerate(o.deepstack_features):
            _close(deep[:, 64 * k:64 * (k + 1)], feat[0].numpy(), f"{fam} deepstack features {k}")


def test_image_turn_logits_match_transformers(built, photo):
    """head, <|vision_start|>, the image rows at M-RoPE grid positions, <|vision_end|>, tail: teacher-forced
    logits against transformers' forward, the tail after the image in a later eval (the session carries
    the image's position advance)."""
    m, dec, mm, fam = built
    model = d.load_model(dec, d.QuantMode.fp32)
    e = _emb(mm, fam)
    head = [1] + d.encode(model, "ka to ri mu", add_special=False) + [500]
    tail = [501] + d.encode(model, "sen la po qui ver dan el", add_special=False)
    gh, gw = e.image_grid(photo)
    n = gh * gw
    ids = head + [502] * n + tail
    px, grid = _ref_inputs(photo, fam)
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), pixel_values=px, image_grid_thw=grid,
                mm_token_type_ids=torch.tensor([[1 if t == 502 else 0 for t in ids]]))
    ref = out.logits[0].numpy()

    rows, deep = _split(d.encode_image_rows(e, photo), e)
    s = d.create_session(model, d.KVDtype.f32)
    d.eval(model, s, head)
    d.eval_embd_span_mrope(model, s, rows, n, 0, n, (gh, gw), deepstack=deep)
    _close(np.asarray(s.logits).reshape(-1), ref[len(head) + n - 1], "logits of the last image row")
    assert s.rope_marks == [(len(head) + n, max(gh, gw) - n)]
    d.eval(model, s, tail, all_logits=True)
    ours = np.asarray(s.logits).reshape(len(tail), -1)
    rel = _close(ours, ref[len(head) + n:], "logits after the image")

    # Plain positions for the image rows (eval_embd_span, causal): far off transformers.
    s2 = d.create_session(model, d.KVDtype.f32)
    d.eval(model, s2, head)
    if deep is None:
        d.eval_embd_span(model, s2, rows, n, 0, 0)
    else:  # the image as one 1 x n row instead of its grid, the deepstack features kept
        d.eval_embd_span_mrope(model, s2, rows, n, 0, n, (1, n), deepstack=deep)
        s2.rope_marks = []
    d.eval(model, s2, tail, all_logits=True)
    plain = np.asarray(s2.logits).reshape(len(tail), -1)
    ref_t = ref[len(head) + n:]
    assert float(np.abs(plain - ref_t).max()) > 100 * rel * float(np.abs(ref_t).max())

    # One call: head, image and tail rows as one body.
    s3 = d.create_session(model, d.KVDtype.f32)
    body = d.media_body_rows(model, None, head, rows, n, model.config.dim, tail)
    body_deep = None
    if deep is not None:
        body_deep = np.zeros((len(ids), deep.shape[1]), np.float32)
        body_deep[len(head):len(head) + n] = deep
    d.eval_embd_span_mrope(model, s3, body, len(ids), len(head), len(head) + n, (gh, gw), deepstack=body_deep)
    _close(np.asarray(s3.logits).reshape(-1), ref[-1], "logits of a one-call body")
    # Rewinding past the image drops its mark.
    s.truncate(len(head) + 1)
    assert s.rope_marks == []


def test_a_span_that_is_not_its_grid_is_refused(built):
    _, dec, mm, _ = built
    model = d.load_model(dec, d.QuantMode.fp32)
    s = d.create_session(model, d.KVDtype.f32)
    rows = np.zeros((6, model.config.dim), np.float32)
    with pytest.raises(ValueError, match="grid"):
        d.eval_embd_span_mrope(model, s, rows, 6, 0, 6, (2, 2))
    assert s.n_past == 0


# -- the chat and the prefix cache -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(built):
    _, dec, mm, fam = built
    return d.load_model(dec), _emb(mm, fam)


def test_image_chat_equals_the_rows_spliced_by_hand(pair, photo):
    model, e = pair
    chat = d.create_chat(model, e, max_new=6, kv_dtype=d.KVDtype.f32)
    n = d.add_user_image(chat, photo, "ka to ri")
    assert n == e.image_rows(photo)
    head, tail = d.render_turn_image(model, chat)
    assert head[-1] == 500 and tail[0] == 501
    reply = d.respond(model, chat, d.SamplingParams())

    s = d.create_session(model, d.KVDtype.f32)
    rows, deep = _split(d.encode_image_rows(e, photo), e)
    body = d.media_body_rows(model, s, head, rows, n, model.config.dim, tail[:-1])
    body_deep = None
    if deep is not None:
        body_deep = np.zeros((body.shape[0], deep.shape[1]), np.float32)
        body_deep[len(head):len(head) + n] = deep
    d.eval_embd_span_mrope(model, s, body, body.shape[0], len(head), len(head) + n, e.image_grid(photo),
                           deepstack=body_deep)
    stops = set(d.effective_stop_ids(chat))
    pieces = []
    d.generate(model, s, tail[-1:], d.SamplingParams(), 6,
               lambda t, p: pieces.append("" if t in stops else p) or True, stop_ids=list(stops))
    assert reply.strip() == "".join(pieces).strip()


@pytest.mark.parametrize("page_rows", [1, 16])
def test_second_question_on_an_image_runs_no_encoder_and_no_image_prefill(pair, photo, page_rows):
    """A second conversation about the same image attaches its rows from the prefix cache (M-RoPE marks
    restored), also where the image ends mid-page: no encode, no image rows prefilled, and its reply equals
    a cold run's."""
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

    # The tower-output cache emptied: an image row left to prefill (the image ends mid-page) would need
    # the encoder. The image is attached whole instead, its last page in part.
    M.ROW_CACHE.clear()
    b = d.create_chat(model, e, max_new=6, pool=pool, cache=cache)
    d.add_user_image(b, photo, "mu sen la")
    reply = d.respond(model, b)
    ids = b.session.history
    end = max(i for i, t in enumerate(ids) if t < 0) + 1
    assert page_rows == 1 or end % page_rows != 0
    assert b.media_stats["rows_attached"] >= end and b.media_stats["encodes"] == 0
    assert b.media_stats["media_rows_prefilled"] == 0
    assert d.media_cache_stats()["image_encodes"] == enc0

    cold = d.create_chat(model, e, max_new=6, pool=d.create_kv_pool(model, page_rows=page_rows))
    d.add_user_image(cold, photo, "mu sen la")
    assert reply == d.respond(model, cold)
    # the attached session carries the image's position advance, as the cold one does
    gh, gw = e.image_grid(photo)
    assert b.session.rope_marks == cold.session.rope_marks
    assert [dl for _, dl in cold.session.rope_marks] == [max(gh, gw) - n]


# -- the server and the CLI (the embedder's default pixel budget, as they load it) ----------------------------

def test_server_image_turn_equals_the_library_chat(built, photo):
    """An image_url turn through the server (its engine's batched decode, M-RoPE marks restored on attach) is
    the library chat's greedy reply; a resent conversation runs no encoder and prefills no image rows."""
    import base64

    from starlette.testclient import TestClient

    from dasllama.server import create_app

    _, dec, mm, _ = built
    model = d.load_model(dec, d.QuantMode.fp32)
    ch = d.create_chat(model, d.load_vision_embedder(mm), max_new=6, kv_dtype=d.KVDtype.f32)
    d.add_user_image(ch, photo, "ka to ri")
    want = d.respond(model, ch, d.SamplingParams())

    app = create_app(model, mmproj=mm, streams=2, ctx=1024, kv_dtype=d.KVDtype.f32)
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()

    def metric(client, key):
        for ln in client.get("/metrics").text.splitlines():
            if ln.startswith(f"dasllama_{key} "):
                return float(ln.split()[1])

    try:
        with TestClient(app) as client:
            msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "ka to ri"}]}]
            r1 = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 6})
            assert r1.status_code == 200, r1.text
            assert r1.json()["choices"][0]["message"]["content"] == want
            enc, rows = metric(client, "image_encodes_total"), metric(client, "media_rows_prefilled_total")
            msgs += [{"role": "assistant", "content": want}, {"role": "user", "content": "mu sen"}]
            r2 = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 6})
            assert r2.status_code == 200, r2.text
            assert metric(client, "image_encodes_total") == enc
            assert metric(client, "media_rows_prefilled_total") == rows
            d.add_user(ch, "mu sen")
            assert r2.json()["choices"][0]["message"]["content"] == d.respond(model, ch, d.SamplingParams())
    finally:
        app.state.engine.stop()


def test_cli_chat_with_an_image(built, photo, tmp_path, capsys):
    from dasllama.cli import main

    _, dec, mm, _ = built
    jpg = tmp_path / "photo.jpg"
    jpg.write_bytes(photo)
    assert main(["chat", "ka to ri", "--model", dec, "--mmproj", mm, "--image", str(jpg), "--max-tokens", "4",
                 "--mode", "fp32", "-q"]) == 0
    out = capsys.readouterr().out
    model = d.load_model(dec, d.QuantMode.fp32)
    chat = d.create_chat(model, d.load_vision_embedder(mm), max_new=4)
    d.add_user_image(chat, photo, "ka to ri")
    assert out == d.respond(model, chat) + "\n"
