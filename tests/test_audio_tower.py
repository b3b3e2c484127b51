"""Audio towers from llama.cpp-layout mmproj GGUFs against transformers' tiny random models.

Each family is a seeded fp32 transformers model (tests/oracles/audio.py) written the way
llama.cpp's converter writes it; its reference rows come from transformers' own
forward on its own processor's input (Qwen2-Audio: the masked 30 s window and the
processor's row count; Qwen2.5-Omni: its audio encoder on the frames the mask keeps,
in 200-frame chunks; Voxtral: get_audio_features over 30 s chunks; whisper: the
encoder; Ultravox: transformers' WhisperEncoder plus the projector module of
oracles/audio.py, since transformers has no Ultravox class).

Error bar: 1e-4 of the reference's largest magnitude (observed <= 7e-6 of it, the 35 s omni clip). Both sides run
in float32 with the same (f16-rounded) conv kernels; what differs is summation order
(our matmul / attention kernels vs torch), about 1e-6 relative per op over two blocks,
and the mel input, which may differ by up to 7e-5 of a unit-scale feature (see
test_audio_mel.py) -- through layer-normalized blocks that is a relative change of the
same order, so 1e-4 leaves room for both and still catches any wrong op (a skipped bias
or norm, a swapped SwiGLU half or an off-by-one frame moves rows by > 1e-2).
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import audio as A  # noqa: E402
from speech import speak  # noqa: E402

SR = 16000
REL = 1e-4
JFK = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."

FAMILIES = {
    "qwen2a": (A.qwen2_audio, A.write_qwen2_audio, A.qwen2_audio_rows),
    "voxtral": (A.voxtral, A.write_voxtral, A.voxtral_rows),
    "ultravox": (A.ultravox, A.write_ultravox, A.ultravox_rows),
    "whisper": (A.whisper_encoder, A.write_whisper, A.whisper_rows),
    "qwen2.5o": (A.qwen25_omni_audio, A.write_qwen25_omni, A.qwen25_omni_rows),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    tmp = tmp_path_factory.mktemp("mmproj")
    for fam, (make, write, _) in FAMILIES.items():
        m = make()
        out[fam] = (m, write(m, tmp / f"mmproj-{fam}.gguf"))
    return out


def _framed_window() -> np.ndarray:
    """One 30 s window: a second of silence, the JFK line, silence to the end."""
    s = np.zeros(30 * SR, np.float32)
    sp = speak(JFK)
    s[SR: SR + len(sp)] = sp
    return s


def _close(ours, ref, what):
    assert ours.shape == ref.shape, f"{what}: {ours.shape} vs {ref.shape}"
    err = float(np.abs(ours - ref).max())
    scale = float(np.abs(ref).max())
    assert err <= REL * scale, f"{what}: max abs error {err:.3g} vs bar {REL * scale:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_match_transformers_on_speech(built, family):
    m, path = built[family]
    emb = d.load_audio_embedder(path)
    x = speak(JFK)
    ours = d.encode_audio_rows(emb, x)
    ref = FAMILIES[family][2](m, x)
    if family == "ultravox":
        # 1500 frames stack to 187.5 rows: the last, half-padded row is not served (llama.cpp counts 187)
        assert ref.shape[0] == 188
        ref = ref[:187]
    _close(ours, ref, family)
    assert ours.dtype == np.float32 and ours.shape[1] == emb.proj_dim


@pytest.mark.parametrize("clip", ["tenth_of_a_second", "silence", "exactly_30s", "5.3s"])
def test_qwen2a_rows_follow_the_processor(built, clip):
    m, path = built["qwen2a"]
    tower = d.load_audio_tower(path)
    base = speak(JFK)
    x = {
        "tenth_of_a_second": base[SR: SR + SR // 10],
        "silence": np.zeros(2 * SR, np.float32),
        "exactly_30s": np.tile(base, 10)[: 30 * SR],
        "5.3s": np.tile(base, 2)[: int(5.3 * SR)],
    }[clip]
    ours = d.encode_audio_rows(tower, x)
    if clip == "5.3s":
        assert ours.shape == (132, 64)  # the DESIGN.md count for a 5.3 s clip
    _close(ours, A.qwen2_audio_rows(m, x), clip)


@pytest.mark.parametrize("seconds", [0.1, 35.3])
def test_qwen25_omni_short_and_past_30s(built, seconds):
    # The omni tower has no 30 s limit of its own (chunks of 200 frames); a long clip
    # goes on past the first window (the reference: its feature extractor, untruncated).
    m, path = built["qwen2.5o"]
    tower = d.load_audio_tower(path)
    x = np.tile(speak(JFK), 8)[: int(seconds * SR)]
    ours = d.encode_audio_rows(tower, x)
    assert ours.shape[0] == tower.n_rows(len(x))
    _close(ours, A.qwen25_omni_rows(m, x), f"omni {seconds} s")


def test_qwen2a_full_window_matches_unmasked_encoder(built):
    m, path = built["qwen2a"]
    tower = d.load_audio_tower(path)
    x = speak(JFK)
    ours = d.encode_audio_rows(tower, x, full_window=True)
    assert ours.shape == (750, 64)
    _close(ours, A.qwen2_audio_full_window_rows(m, x), "full window")


def test_long_clip_makes_several_windows(built):
    # Each window holds the same speech, led and trailed by silence, so the windows are
    # independent and each must equal transformers on one window.
    m, path = built["qwen2a"]
    tower = d.load_audio_tower(path)
    s = _framed_window()
    x = np.concatenate([s, s, s[: 5 * SR]])
    rows = d.encode_audio_rows(tower, x)
    one = A.qwen2_audio_rows(m, s)
    assert one.shape == (750, 64)
    assert rows.shape == (750 + 750 + 125, 64) == (tower.n_rows(len(x)), 64)
    _close(rows[:750], one, "window 0")
    _close(rows[750:1500], one, "window 1")
    # whisper-family windows: 1500 rows each
    enc, wpath = built["whisper"]
    emb = d.load_audio_embedder(wpath)
    wr = d.encode_audio_rows(emb, x)
    assert wr.shape == (4500, 48)
    _close(wr[:1500], A.whisper_rows(enc, s), "whisper window 0")


def test_voxtral_two_windows(built):
    m, path = built["voxtral"]
    emb = d.load_audio_embedder(path)
    x = np.tile(speak(JFK), 12)[: 40 * SR]
    _close(d.encode_audio_rows(emb, x), A.voxtral_rows(m, x), "voxtral 40 s")


def test_probes_and_summaries(built, tmp_path):
    _, qpath = built["qwen2a"]
    _, wpath = built["whisper"]
    assert d.audio_probe_proj_dim(qpath) == 64 and d.audio_tower_probe_proj_dim(qpath) == 64
    assert d.audio_probe_proj_dim(wpath) == 48 and d.audio_tower_probe_proj_dim(wpath) == 0
    with pytest.raises(d.UnsupportedModelError):
        d.load_audio_tower(wpath)
    t = d.load_audio_tower(qpath)
    assert isinstance(t, d.AudioTower) and t.family == "qwen2a" and t.n_mel == 128 and t.proj_dim == 64
    assert "\n" not in repr(t) and "qwen2a" in repr(t) and repr(d.AudioState()) == "AudioState()"
    # A GGUF with no audio tower answers 0; a file that is not GGUF raises.
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "lm.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert d.audio_probe_proj_dim(tmp_path / "lm.gguf") == 0
    assert d.audio_tower_probe_proj_dim(tmp_path / "lm.gguf") == 0
    with pytest.raises(d.UnsupportedModelError):
        d.load_audio_embedder(tmp_path / "lm.gguf")
    # A vision-only file of a family that also hears: no audio tower, so 0 as well.
    w = gguf.GGUFWriter(str(tmp_path / "vision.gguf"), "clip")
    w.add_string("clip.projector_type", "qwen2.5o")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert d.audio_probe_proj_dim(tmp_path / "vision.gguf") == 0
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(d.GGUFError):
        d.audio_probe_proj_dim(tmp_path / "junk.gguf")


def test_encode_audio_out_contract(built):
    _, path = built["qwen2a"]
    tower = d.load_audio_tower(path)
    st = d.AudioState()
    x = speak("Hello there.")
    n = tower.n_rows(len(x))
    out = np.full((n + 3, 64), 7.0, np.float32)
    assert d.encode_audio(tower, st, x, out) == n
    np.testing.assert_array_equal(out[:n], d.encode_audio_rows(tower, x))
    assert (out[n:] == 7.0).all()
    flat = np.zeros(n * 64, np.float32)
    assert d.encode_audio(tower, st, x, flat) == n
    with pytest.raises(ValueError):
        d.encode_audio(tower, st, x, np.zeros((n - 1, 64), np.float32))
    with pytest.raises(ValueError):
        d.encode_audio(tower, st, x, np.zeros((n, 64), np.float64))
    with pytest.raises(ValueError):
        d.encode_audio(tower, st, x, np.zeros((64, n), np.float32).T)
    with pytest.raises(ValueError):
        d.encode_audio(tower, st, np.zeros(0, np.float32), out)
    with pytest.raises(ValueError):
        d.encode_audio(tower, st, np.array([np.nan], np.float32), out)
    with pytest.raises(TypeError):
        d.encode_audio(tower, None, x, out)


def test_ten_minute_clip(built):
    # Twenty identical, silence-framed windows: each window's rows equal transformers' on one.
    m, path = built["qwen2a"]
    tower = d.load_audio_tower(path)
    s = _framed_window()
    x = np.tile(s, 20)
    rows = d.encode_audio_rows(tower, x)
    assert rows.shape == (20 * 750, 64) and np.isfinite(rows).all()
    one = A.qwen2_audio_rows(m, s)
    for w in (0, 7, 19):
        _close(rows[w * 750:(w + 1) * 750], one, f"window {w}")


def test_threads_share_an_embedder(built):
    from concurrent.futures import ThreadPoolExecutor

    _, path = built["voxtral"]
    emb = d.load_audio_embedder(path)
    clips = [speak(t) for t in ("One.", "Two and three.", "Four, five, six.", "Seven.")]
    serial = [d.encode_audio_rows(emb, c) for c in clips]
    with ThreadPoolExecutor(4) as ex:
        par = list(ex.map(lambda c: d.encode_audio_rows(emb, c, d.AudioState()), clips))
    for a, b in zip(serial, par):
        np.testing.assert_array_equal(a, b)
