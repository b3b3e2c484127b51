"""Vision towers (gemma3v) and image turns against transformers' tiny random Gemma-3.

The model is a seeded fp32 Gemma3ForConditionalGeneration (tests/oracles/vision.py: SigLIP
tower, pooled projector, two decoder layers), turned into a decoder GGUF and an mmproj GGUF by
llama.cpp's own convert_hf_to_gguf.py. Three things are checked against transformers: the pixel
values (Gemma3ImageProcessorPil on a real photo, llama.cpp's test-1.jpeg), the image rows
(``get_image_features``), and the logits of a whole prompt with an image (the model's forward
with ``pixel_values`` and ``token_type_ids``, whose image block attends itself bidirectionally).

Error bars: pixels are exact up to float rounding (1e-6: the same PIL resize, then one multiply
and one divide). Rows: 1e-4 of the reference's largest magnitude, as the audio towers (fp32 both
sides; the projection matrix is f16 in the file, so the reference uses the same rounded matrix).
Logits: 1e-4 of their largest magnitude; a causal image span instead of the bidirectional one
moves them by > 1e-2 of it here (checked below, so the bar is known to separate the two).
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
    m = V.gemma3()
    with torch.no_grad():  # the file stores the projection as f16: the reference uses the same values
        w = m.model.multi_modal_projector.mm_input_projection_weight
        w.copy_(w.half().float())
    dec, mm = V.convert_gemma3(m, str(tmp_path_factory.mktemp("gemma3v")))
    return m, dec, mm


@pytest.fixture(scope="module")
def photo():
    return (moe.llama_cpp_dir() / "tools" / "mtmd" / "test-1.jpeg").read_bytes()


def _close(ours, ref, what, rel=REL):
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs {ref.shape}"
    err = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} vs bar {rel * scale:.3g}"
    return err / scale


def test_load_detects_family(built):
    _, _, mm = built
    assert d.vision_probe_family(mm) == "gemma3v"
    e = d.load_vision_embedder(mm)
    assert (e.family, e.image_size, e.n_rows, e.proj_dim, e.non_causal) == ("gemma3v", V.IMAGE_SIZE, V.TOKENS, 64, True)
    assert "gemma3v" in repr(e)


def test_pixel_values_match_processor(built, photo):
    _, _, mm = built
    e = d.load_vision_embedder(mm)
    ref = V.image_processor()(images=[__import__("PIL.Image").Image.open(io.BytesIO(photo)).convert("RGB")],
                              return_tensors="np")["pixel_values"][0]
    ours = e.pixel_values(photo)
    assert ours.shape == ref.shape == (3, V.IMAGE_SIZE, V.IMAGE_SIZE)
    assert float(np.abs(ours - ref).max()) <= 1e-6


def test_rows_match_get_image_features(built, photo):
    m, _, mm = built
    e = d.load_vision_embedder(mm)
    px = e.pixel_values(photo)
    with torch.no_grad():
        ref = m.get_image_features(torch.from_numpy(px)[None]).pooler_output[0].numpy()
    ours = d.encode_image_rows(e, photo)
    _close(ours, ref, "gemma3v rows")
    # encode_image into a caller's buffer: the same rows, npos returned
    out = np.zeros(e.n_rows * e.proj_dim, np.float32)
    assert d.encode_image(e, d.VisionState(), photo, "t", out) == e.n_rows
    np.testing.assert_array_equal(out.reshape(e.n_rows, -1), ours)


def test_image_turn_logits_match_transformers(built, photo):
    """A prompt with an image, teacher-forced: our rows spliced as one non-causal span vs transformers' forward."""
    _image_turn_logits(*built, photo)


def test_image_deep_in_the_sliding_window(tmp_path, photo):
    """Sliding layers of window 8 with the image ending past it: each image row sees its own window back
    and the whole image (transformers' sliding mask OR the image block), not its last row's window."""
    m = V.gemma3(seed=1, sliding_window=8)
    with torch.no_grad():
        w = m.model.multi_modal_projector.mm_input_projection_weight
        w.copy_(w.half().float())
    _image_turn_logits(m, *V.convert_gemma3(m, str(tmp_path)), photo)


def _image_turn_logits(m, dec, mm, photo):
    model = d.load_model(dec, d.QuantMode.fp32)
    e = d.load_vision_embedder(mm)
    head = [1] + d.encode(model, "ka to ri mu", add_special=False) + [500]
    tail = [501] + d.encode(model, "sen la po qui ver dan el", add_special=False)
    n = e.n_rows
    ids = head + [502] * n + tail
    px = e.pixel_values(photo)
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(px)[None],
                token_type_ids=torch.tensor([[1 if t == 502 else 0 for t in ids]]))
    ref = out.logits[0].numpy()

    rows = d.encode_image_rows(e, photo)
    # Head and image as one body (the image the non-causal span), then the tail's tokens with all logits.
    s = d.create_session(model, d.KVDtype.f32)
    body = d.media_body_rows(model, None, head, rows, n, model.config.dim, [])
    d.eval_embd_body(model, s, body, len(head) + n, len(head), len(head) + n)
    _close(np.asarray(s.logits).reshape(-1)[-ref.shape[1]:], ref[len(head) + n - 1], "logits of the last image row")
    d.eval(model, s, tail, all_logits=True)
    ours = np.asarray(s.logits).reshape(len(tail), -1)
    rel = _close(ours, ref[len(head) + n:], "logits after the image")

    # The same prompt with the image rows causal: transformers' bidirectional block is what we match.
    s2 = d.create_session(model, d.KVDtype.f32)
    d.eval_embd_body(model, s2, body, len(head) + n, 0, 0)
    d.eval(model, s2, tail, all_logits=True)
    causal = np.asarray(s2.logits).reshape(len(tail), -1)
    ref_t = ref[len(head) + n:]
    assert float(np.abs(causal - ref_t).max()) > 100 * rel * float(np.abs(ref_t).max())


# -- image turns in the chat, the prefix cache and the tower-output cache -------------------------------------

def _png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pair(built):
    _, dec, mm = built
    return d.load_model(dec), d.load_vision_embedder(mm)


def test_image_chat_equals_the_rows_spliced_by_hand(pair, photo):
    """respond() over add_user_image is the greedy continuation of the rendered turn with the image rows as
    one non-causal span (eval_embd_span), the layout render_turn_image gives."""
    from dasllama.chat import media as M

    model, e = pair
    chat = d.create_chat(model, e, max_new=6, kv_dtype=d.KVDtype.f32)
    assert d.add_user_image(chat, photo, "ka to ri") == e.n_rows
    head, tail = d.render_turn_image(model, chat)
    assert d.decode(model, head[-3:]).endswith("<start_of_image>") or 500 in head
    reply = d.respond(model, chat, d.SamplingParams())

    s = d.create_session(model, d.KVDtype.f32)
    rows = d.encode_image_rows(e, photo)
    body = d.media_body_rows(model, s, head, rows, e.n_rows, model.config.dim, tail[:-1])
    d.eval_embd_body(model, s, body, body.shape[0], len(head), len(head) + e.n_rows)
    toks = []
    d.generate(model, s, tail[-1:], d.SamplingParams(), 6, lambda t, p: toks.append(t) or True,
               stop_ids=list(d.effective_stop_ids(chat)))
    assert reply == d.decode(model, [t for t in toks if t not in d.effective_stop_ids(chat)])
    assert M.ROW_CACHE.stats()["image_encodes"] >= 1


def _image_end(ids):
    """The position after a prompt's last image row (media rows carry negative ids)."""
    return max(i for i, t in enumerate(ids) if t < 0) + 1


@pytest.mark.parametrize("page_rows", [1, 16, 256])
def test_second_question_on_an_image_runs_no_encoder_and_no_image_prefill(pair, photo, page_rows):
    """Another conversation about the same image attaches the image whole, also where it ends mid-page
    (16: in a page the first chat filled; 256: in the first chat's one, partly filled page): no encoder
    (the tower-output cache is emptied first, so any image row to prefill would need it), no image row
    prefilled, and the reply is a cold run's."""
    from dasllama.chat import media as M
    from dasllama.chat.turns import prompt_ids

    model, e = pair
    pool = d.create_kv_pool(model, page_rows=page_rows)
    cache = d.create_prefix_cache()
    M.ROW_CACHE.clear()
    a = d.create_chat(model, e, max_new=6, pool=pool, cache=cache)
    n = d.add_user_image(a, photo, "ka to ri")
    end = _image_end(prompt_ids(a))
    assert page_rows == 1 or end % page_rows != 0  # the case under test: the image ends mid-page
    if page_rows == 16:
        assert len(prompt_ids(a)) > (end // 16 + 1) * 16  # that page is full when the first chat donates
    if page_rows == 256:
        assert len(prompt_ids(a)) + 6 < 256  # the first chat's whole history is one partial page
    d.respond(model, a)
    assert a.media_stats["encodes"] == 1 and a.media_stats["media_rows_prefilled"] == n
    enc0 = d.media_cache_stats()["image_encodes"]

    # The same image (decoded again from the same bytes) in another conversation.
    M.ROW_CACHE.clear()
    b = d.create_chat(model, e, max_new=6, pool=pool, cache=cache)
    d.add_user_image(b, photo, "mu sen la")
    reply = d.respond(model, b)
    assert b.media_stats["rows_attached"] >= end and b.media_stats["encodes"] == 0
    assert b.media_stats["media_rows_prefilled"] == 0
    assert d.media_cache_stats()["image_encodes"] == enc0

    # A second question in the same chat: the image is in the KV already.
    d.add_user(b, "po qui")
    before = dict(b.media_stats)
    d.respond(model, b)
    assert b.media_stats["encodes"] == before["encodes"]
    assert b.media_stats["media_rows_prefilled"] == before["media_rows_prefilled"]

    cold = d.create_chat(model, e, max_new=6)
    d.add_user_image(cold, photo, "mu sen la")
    assert d.respond(model, cold) == reply


def test_image_inputs_and_bad_images(pair, photo, tmp_path):
    from PIL import Image

    model, e = pair
    rgb = np.asarray(Image.open(io.BytesIO(photo)).convert("RGB"))
    want = d.encode_image_rows(e, photo)
    for src in (rgb, Image.open(io.BytesIO(photo)), d.load_image_rgb(photo)):
        np.testing.assert_array_equal(d.encode_image_rows(e, src), want)
    chat = d.create_chat(model, e, max_new=2)
    bad = [photo[: len(photo) // 2], b"GIF89a" + b"\0" * 20, b"not an image", _png(rgb)[:60],
           np.zeros((0, 4, 3), np.uint8), np.zeros((4, 4), np.uint8), np.zeros((4, 4, 3), np.float32)]
    for b in bad:
        with pytest.raises(d.ImageError):
            d.add_user_image(chat, b)
    with pytest.raises(d.ImageError, match="over the limit"):
        d.load_image_rgb(_png(np.zeros((64, 64, 3), np.uint8)), max_pixels=1000)
    # Samples wider than 8 bits (a 16-bit grayscale PNG, a float image): Pillow's RGB conversion would clip
    # them, so they are refused by name.
    wide = Image.fromarray(np.full((6, 8), 40000, np.uint16))
    buf = io.BytesIO()
    wide.save(buf, "PNG")
    assert Image.open(io.BytesIO(buf.getvalue())).mode.startswith("I")
    for b in (buf.getvalue(), wide, Image.fromarray(np.full((6, 8), 0.5, np.float32))):
        with pytest.raises(d.ImageError, match="wider than 8 bits"):
            d.add_user_image(chat, b)
    # Every other mode Pillow opens converts to RGB: palette, gray + alpha, CMYK, 1-bit.
    for mode in ("P", "LA", "CMYK", "1", "L"):
        assert d.load_image_rgb(Image.new(mode, (8, 6))).rgb.shape == (6, 8, 3)
    # A path and the file's bytes are the same image.
    jpg = tmp_path / "photo.jpg"
    jpg.write_bytes(photo)
    np.testing.assert_array_equal(d.encode_image_rows(e, str(jpg)), want)
    np.testing.assert_array_equal(d.encode_image_rows(e, jpg), want)
    with pytest.raises(FileNotFoundError):
        d.add_user_image(chat, "/no/such/image.png")
    with pytest.raises(TypeError):
        d.add_user_image(chat, 3.5)
    # The chat is unchanged and still answers.
    assert chat.pending == [] and chat.spans == {}
    d.add_user_image(chat, photo, "ka")
    d.respond(model, chat)


def test_decompression_bomb_is_refused_before_decoding(pair):
    """A small PNG whose header claims a huge image: refused from its header (no pixel buffer allocated)."""
    import struct
    import zlib

    def chunk(t, data):
        return struct.pack(">I", len(data)) + t + data + struct.pack(">I", zlib.crc32(t + data) & 0xffffffff)

    for side in (9000, 50000):  # over our limit (64 Mpx); over Pillow's own (179 Mpx), caught at open
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)) + \
            chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
        with pytest.raises(d.ImageError, match="over the limit"):
            d.load_image_rgb(png)


def test_exif_orientation_is_applied(pair):
    from PIL import Image

    rgb = np.zeros((8, 16, 3), np.uint8)
    rgb[:, :8] = 255  # left half white
    im = Image.fromarray(rgb)
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90 CW to display
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif, quality=95)
    got = d.load_image_rgb(buf.getvalue())
    assert (got.width, got.height) == (8, 16)  # displayed upright: portrait
    assert got.rgb[:4].mean() > 200 and got.rgb[-4:].mean() < 50  # white on top after rotation


def test_mmproj_files_that_are_not_vision_towers(tmp_path, built):
    _, dec, mm = built
    with pytest.raises(d.UnsupportedModelError, match="no vision tower"):
        d.load_vision_embedder(dec)
    assert d.vision_probe_family(dec) == ""
    model = d.load_model(dec)
    with pytest.raises(ValueError, match="no vision embedder"):
        d.add_user_image(d.create_chat(model), b"x")


def test_fuzzed_mmproj_files_raise_clean_errors(tmp_path, built):
    """Byte flips and truncations of the mmproj: every load either works or raises a dasllama error."""
    _, _, mm = built
    raw = open(mm, "rb").read()
    rng = np.random.default_rng(0)
    for i in range(40):
        b = bytearray(raw)
        if i % 4 == 0:
            b = b[: int(rng.integers(8, len(b)))]
        else:
            for _ in range(int(rng.integers(1, 16))):
                # the header and metadata, where a flip changes shapes, counts and keys
                b[int(rng.integers(0, min(len(b), 4096)))] = int(rng.integers(0, 256))
        p = tmp_path / f"f{i}.gguf"
        p.write_bytes(bytes(b))
        try:
            e = d.load_vision_embedder(p)
        except (d.GGUFError, d.UnsupportedModelError, ValueError):
            continue
        rows = d.encode_image_rows(e, np.full((8, 8, 3), 128, np.uint8))
        assert rows.shape == (e.n_rows, e.proj_dim)


# -- the server: image_url parts ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vision_app(built):
    from starlette.testclient import TestClient

    from dasllama.server import create_app
    from dasllama.server.protocol import Limits

    _, dec, mm = built
    model = d.load_model(dec, d.QuantMode.fp32)
    app = create_app(model, mmproj=mm, streams=2, ctx=1024, kv_dtype=d.KVDtype.f32,
                     limits=Limits(max_images=2, max_image_pixels=1 << 20))
    with TestClient(app) as c:
        yield {"client": c, "model": model, "mmproj": mm}
    app.state.engine.stop()


def _data_url(raw: bytes, mime="image/jpeg") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def _img_msg(raw, text, mime="image/jpeg"):
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(raw, mime)}},
                                        {"type": "text", "text": text}]}


def _metric(client, key):
    for ln in client.get("/metrics").text.splitlines():
        if ln.startswith(f"dasllama_{key} "):
            return float(ln.split()[1])


def test_server_image_turn_equals_the_library_chat(vision_app, photo):
    """The server's greedy reply to an image_url turn is the library chat's; a resent conversation with the
    same image runs no vision encoder and prefills no image rows (the span comes from the prefix cache)."""
    client, model = vision_app["client"], vision_app["model"]
    ch = d.create_chat(model, d.load_vision_embedder(vision_app["mmproj"]), max_new=6, kv_dtype=d.KVDtype.f32)
    d.add_user_image(ch, photo, "ka to ri")
    want = d.respond(model, ch, d.SamplingParams())

    msgs = [_img_msg(photo, "ka to ri")]
    r1 = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 6})
    assert r1.status_code == 200, r1.text
    assert r1.json()["choices"][0]["message"]["content"] == want
    enc, rows = _metric(client, "image_encodes_total"), _metric(client, "media_rows_prefilled_total")
    assert enc >= 1 and rows >= 16
    msgs += [{"role": "assistant", "content": want}, {"role": "user", "content": "mu sen"}]
    r2 = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 6})
    assert r2.status_code == 200, r2.text
    assert _metric(client, "image_encodes_total") == enc
    assert _metric(client, "media_rows_prefilled_total") == rows
    d.add_user(ch, "mu sen")
    assert r2.json()["choices"][0]["message"]["content"] == d.respond(model, ch, d.SamplingParams())

    # Another conversation about the same image (16-row pages, the image ending mid-page), the tower-output
    # cache emptied: attached from the prefix cache, no encoder, no image row; the library's cold reply.
    from dasllama.chat import media as M

    M.ROW_CACHE.clear()
    r3 = client.post("/v1/chat/completions", json={"messages": [_img_msg(photo, "po qui ver")], "temperature": 0,
                                                   "max_tokens": 6})
    assert r3.status_code == 200, r3.text
    assert _metric(client, "image_encodes_total") == enc
    assert _metric(client, "media_rows_prefilled_total") == rows
    cold = d.create_chat(model, d.load_vision_embedder(vision_app["mmproj"]), max_new=6, kv_dtype=d.KVDtype.f32)
    d.add_user_image(cold, photo, "po qui ver")
    from dasllama.chat.turns import prompt_ids

    assert _image_end(prompt_ids(cold)) % 16 != 0
    assert r3.json()["choices"][0]["message"]["content"] == d.respond(model, cold, d.SamplingParams())


def test_server_bad_images_are_400_and_the_server_goes_on(vision_app, photo):
    client = vision_app["client"]
    big = _png(np.zeros((1100, 1000, 3), np.uint8))  # 1.1 Mpx, over this app's 1 Mpx
    cases = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "remote"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        ({"type": "image_url", "image_url": {"url": _data_url(photo[:2000])}}, "image_url"),
        ({"type": "image_url", "image_url": {"url": _data_url(b"hello world")}}, "image_url"),
        ({"type": "image_url", "image_url": {"url": _data_url(big, "image/png")}}, "over the limit"),
        ({"type": "image_url", "image_url": 7}, "image_url"),
    ]
    for part, word in cases:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}],
                                                      "max_tokens": 2})
        assert r.status_code == 400 and word in r.json()["error"]["message"], (part, r.text)
    three = [{"type": "image_url", "image_url": {"url": _data_url(photo)}}] * 3
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": three}], "max_tokens": 2})
    assert r.status_code == 400 and "more than 2 images" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _data_url(photo)}}]},
        {"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"messages": [_img_msg(photo, "ka")], "max_tokens": 2})
    assert r.status_code == 200


def test_cli_chat_with_an_image(built, photo, tmp_path, capsys):
    from dasllama.cli import main

    _, dec, mm = built
    jpg = tmp_path / "photo.jpg"
    jpg.write_bytes(photo)
    assert main(["chat", "ka to ri", "--model", dec, "--mmproj", mm, "--image", str(jpg), "--max-tokens", "4",
                 "--mode", "fp32", "-q"]) == 0
    out = capsys.readouterr().out
    model = d.load_model(dec, d.QuantMode.fp32)
    chat = d.create_chat(model, d.load_vision_embedder(mm), max_new=4)
    d.add_user_image(chat, photo, "ka to ri")
    assert out == d.respond(model, chat) + "\n"
    assert main(["chat", "x", "--model", dec, "--image", str(jpg)]) == 2  # no --mmproj
    assert main(["chat", "x", "--model", dec, "--mmproj", mm, "--image", str(tmp_path / "missing.jpg")]) == 2
    (tmp_path / "bad.jpg").write_bytes(photo[:100])
    assert main(["chat", "x", "--model", dec, "--mmproj", mm, "--image", str(tmp_path / "bad.jpg")]) == 2


def test_formats_and_fuzzed_image_bytes(photo):
    """WebP, GIF (first frame), palette and RGBA PNGs decode to RGB; byte flips and cuts of a real JPEG and
    PNG either decode or raise ImageError, never anything else."""
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(photo)).convert("RGB").resize((64, 48)))
    for fmt, kw in (("WEBP", {"lossless": True}), ("PNG", {})):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, fmt, **kw)
        got = d.load_image_rgb(buf.getvalue())
        np.testing.assert_array_equal(got.rgb, rgb)
    frames = [Image.fromarray(np.full((8, 8, 3), c, np.uint8)) for c in (10, 200)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    g = d.load_image_rgb(buf.getvalue())
    assert g.rgb.shape == (8, 8, 3) and abs(int(g.rgb.mean()) - 10) <= 2
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[..., 3] = 255
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    assert d.load_image_rgb(buf.getvalue()).rgb[..., 0].min() == 255
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, "PNG")
    rng = np.random.default_rng(1)
    for src in (photo, png.getvalue()):
        for i in range(40):
            b = bytearray(src)
            if i % 3 == 0:
                b = b[: int(rng.integers(1, len(b)))]
            else:
                for _ in range(int(rng.integers(1, 8))):
                    b[int(rng.integers(0, min(len(b), 2048)))] = int(rng.integers(0, 256))
            try:
                im = d.load_image_rgb(bytes(b))
            except d.ImageError:
                continue
            assert im.rgb.dtype == np.uint8 and im.rgb.ndim == 3


def test_example_runs(built, photo, tmp_path, capsys):
    import runpy

    _, dec, mm = built
    jpg = tmp_path / "photo.jpg"
    jpg.write_bytes(photo)
    ex = os.path.join(os.path.dirname(__file__), "..", "examples", "vision_chat.py")
    main = runpy.run_path(ex)["main"]
    assert main([dec, mm, str(jpg), "ka to ri"]) == 0
    out = capsys.readouterr().out
    assert "second chat:" in out and "'encodes': 0" in out.split("second chat:")[1]


# -- remote image URLs (off unless the operator allows them) --------------------------------------------------

@pytest.fixture(scope="module")
def image_host(photo):
    """A local HTTP server: the photo, a 404, a body over the limit (declared and undeclared), a slow body and
    a redirect to a file: URL."""
    import http.server
    import threading
    import time

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/photo.jpg":
                self.send_response(200)
                self.send_header("Content-Length", str(len(photo)))
                self.end_headers()
                self.wfile.write(photo)
            elif self.path == "/huge.jpg":  # declared over the limit
                self.send_response(200)
                self.send_header("Content-Length", str(10 << 20))
                self.end_headers()
            elif self.path == "/endless.jpg":  # no length, more bytes than the limit
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(64):
                        self.wfile.write(b"\0" * (64 << 10))
                except OSError:
                    pass
            elif self.path == "/slow.jpg":
                self.send_response(200)
                self.send_header("Content-Length", str(len(photo)))
                self.end_headers()
                try:
                    self.wfile.write(photo[:100])
                    self.wfile.flush()
                    time.sleep(3)
                    self.wfile.write(photo[100:])
                except OSError:
                    pass
            elif self.path == "/to-file":
                self.send_response(302)
                self.send_header("Location", "file:///etc/passwd")
                self.end_headers()
            else:
                self.send_error(404)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_server_remote_image_urls_behind_the_switch(built, photo, image_host):
    """--allow-remote-media: an http(s) image_url is fetched and answered as the same image inline; 404s, bodies
    over the byte limit (declared or not), a transfer past the time limit and a redirect off http(s) are 400s
    naming the host, and the server goes on."""
    from starlette.testclient import TestClient

    from dasllama.server import create_app
    from dasllama.server.protocol import Limits

    _, dec, mm = built
    model = d.load_model(dec, d.QuantMode.fp32)
    app = create_app(model, mmproj=mm, streams=1, ctx=1024, kv_dtype=d.KVDtype.f32,
                     limits=Limits(allow_remote_media=True, remote_timeout_s=1.0, max_media_bytes=1 << 20))
    try:
        with TestClient(app) as client:
            def ask(url, text="ka to ri"):
                return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}],
                    "temperature": 0, "max_tokens": 4})

            inline = ask(_data_url(photo))
            remote = ask(image_host + "/photo.jpg")
            assert inline.status_code == remote.status_code == 200, remote.text
            assert remote.json()["choices"][0]["message"]["content"] == inline.json()["choices"][0]["message"]["content"]
            for path, word in [("/missing.jpg", "404"), ("/huge.jpg", "over the limit"),
                               ("/endless.jpg", "over the limit"), ("/slow.jpg", "within 1 s"),
                               ("/to-file", "file:")]:
                r = ask(image_host + path)
                assert r.status_code == 400, (path, r.text)
                msg = r.json()["error"]["message"]
                assert word in msg and "127.0.0.1" in msg, (path, msg)
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "ftp://127.0.0.1/x.jpg"}}]}], "max_tokens": 2})
            assert r.status_code == 400 and "not ftp" in r.json()["error"]["message"]
            assert ask(image_host + "/photo.jpg").status_code == 200
    finally:
        app.state.engine.stop()


def test_mrope_calls_need_a_model_with_sections(built):
    """eval_embd_span_mrope on a decoder without rope.dimension_sections is a clear error, the session unmoved."""
    _, dec, _ = built
    model = d.load_model(dec, d.QuantMode.fp32)
    s = d.create_session(model, d.KVDtype.f32)
    rows = np.zeros((4, model.config.dim), np.float32)
    with pytest.raises(ValueError, match="M-RoPE"):
        d.eval_embd_span_mrope(model, s, rows, 4, 0, 4, (2, 2))
    assert s.n_past == 0 and model.config.rope_sections == ()
