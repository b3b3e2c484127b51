"""The mmproj loader on mutated files: every load either works (and then encodes) or raises
a clean Python exception (UnsupportedModelError, GGUFError, ValueError) -- never a crash."""
from __future__ import annotations

import gguf
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dasllama as d

D, FFN, MEL, PROJ = 16, 32, 8, 24


def _base():
    rng = np.random.default_rng(0)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    t = {
        "a.conv1d.1.weight": r(D, MEL, 3).astype(np.float16), "a.conv1d.1.bias": r(D, 1),
        "a.conv1d.2.weight": r(D, D, 3).astype(np.float16), "a.conv1d.2.bias": r(D, 1),
        "a.position_embd.weight": r(1500, D), "a.post_ln.weight": r(D), "a.post_ln.bias": r(D),
        "mm.a.fc.weight": r(PROJ, D), "mm.a.fc.bias": r(PROJ),
    }
    for n in ("attn_q", "attn_v", "attn_out"):
        t[f"a.blk.0.{n}.weight"], t[f"a.blk.0.{n}.bias"] = r(D, D), r(D)
    t["a.blk.0.attn_k.weight"] = r(D, D)
    for n in ("ln1", "ln2"):
        t[f"a.blk.0.{n}.weight"], t[f"a.blk.0.{n}.bias"] = r(D), r(D)
    t["a.blk.0.ffn_up.weight"], t["a.blk.0.ffn_up.bias"] = r(FFN, D), r(FFN)
    t["a.blk.0.ffn_down.weight"], t["a.blk.0.ffn_down.bias"] = r(D, FFN), r(D)
    return t


def _base_qwen3a():
    """Qwen3-ASR's tower: the conv2d stem (4 channels over 16 mel bins: 2 left after three stride-2
    convs), sinusoid positions of one chunk (13 rows), one block, the GELU MLP projector."""
    rng = np.random.default_rng(1)
    r = lambda *s: (rng.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    t = {k: v for k, v in _base().items() if k.startswith("a.blk.") or k.startswith("a.post_ln.")}
    t.update({
        "a.conv2d.1.weight": r(C3, 1, 3, 3).astype(np.float16), "a.conv2d.1.bias": r(C3, 1, 1),
        "a.conv2d.2.weight": r(C3, C3, 3, 3).astype(np.float16), "a.conv2d.2.bias": r(C3, 1, 1),
        "a.conv2d.3.weight": r(C3, C3, 3, 3).astype(np.float16), "a.conv2d.3.bias": r(C3, 1, 1),
        "a.conv_out.weight": r(D, C3 * 2).astype(np.float16), "a.position_embd.weight": r(13, D),
        "mm.a.mlp.1.weight": r(D, D), "mm.a.mlp.1.bias": r(D), "mm.a.mlp.2.weight": r(PROJ, D), "mm.a.mlp.2.bias": r(PROJ),
    })
    return t


C3, MEL3 = 4, 16
BASE = _base()
NAMES = sorted(BASE)
KEYS = {"clip.projector_type": "qwen2a", "clip.audio.attention.head_count": 2,
        "clip.audio.attention.layer_norm_epsilon": 1e-5}
BASE3 = _base_qwen3a()
NAMES3 = sorted(BASE3)
KEYS3 = {"clip.audio.projector_type": "qwen3a", "clip.audio.attention.head_count": 2,
         "clip.audio.attention.layer_norm_epsilon": 1e-5, "clip.audio.num_mel_bins": MEL3}

mutation = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(NAMES)),
    st.tuples(st.just("transpose"), st.sampled_from(NAMES)),
    st.tuples(st.just("shrink"), st.sampled_from(NAMES), st.integers(1, 8)),
    st.tuples(st.just("flatten"), st.sampled_from(NAMES)),
    st.tuples(st.just("add_dim"), st.sampled_from(NAMES)),
    st.tuples(st.just("retype"), st.sampled_from(NAMES), st.sampled_from(["f16", "i32", "i8", "f64"])),
    st.tuples(st.just("key"), st.sampled_from(sorted(KEYS)),
              st.one_of(st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=8),
                        st.sampled_from(["ultravox", "voxtral", "whisper", "qwen2.5o", "llava"]))),
    st.tuples(st.just("extra_block"), st.sampled_from(["ln1.weight", "attn_q.weight"])),
)


def _write(path, tensors, keys):
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_audio_encoder", True)
    for k, v in keys.items():
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float64(k, v)
        elif 0 <= v < 1 << 32:
            w.add_uint32(k, v)
        else:
            w.add_int64(k, v)
    for n, x in tensors.items():
        w.add_tensor(n, np.ascontiguousarray(x))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def _apply(tensors, keys, m):
    kind, name = m[0], m[1]
    if kind == "key":
        keys[name] = m[2]
        return
    if kind == "extra_block":
        tensors[f"a.blk.1.{name}"] = np.ones(D, np.float32)
        return
    x = tensors.get(name)
    if x is None:
        return
    if kind == "drop":
        del tensors[name]
    elif kind == "transpose":
        tensors[name] = np.ascontiguousarray(x.T)
    elif kind == "shrink":
        tensors[name] = x[: max(1, x.shape[0] - m[2])]
    elif kind == "flatten":
        tensors[name] = x.reshape(-1)
    elif kind == "add_dim":
        tensors[name] = x[None]
    elif kind == "retype":
        tensors[name] = x.astype({"f16": np.float16, "i32": np.int32, "i8": np.int8, "f64": np.float64}[m[2]])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(mutation, min_size=1, max_size=3))
def test_mutated_mmproj_loads_or_raises_cleanly(tmp_path, muts):
    tensors, keys = dict(BASE), dict(KEYS)
    for m in muts:
        _apply(tensors, keys, m)
    path = tmp_path / "m.gguf"
    _write(path, tensors, keys)
    try:
        emb = d.load_audio_embedder(path)
    except (d.UnsupportedModelError, d.GGUFError, ValueError):
        return
    x = np.sin(np.arange(8000) / 7.0).astype(np.float32)
    rows = d.encode_audio_rows(emb, x)
    assert rows.shape == (emb.n_rows(len(x)), emb.proj_dim) and np.isfinite(rows).all()


mutation3 = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(NAMES3)),
    st.tuples(st.just("transpose"), st.sampled_from(NAMES3)),
    st.tuples(st.just("shrink"), st.sampled_from(NAMES3), st.integers(1, 8)),
    st.tuples(st.just("flatten"), st.sampled_from(NAMES3)),
    st.tuples(st.just("add_dim"), st.sampled_from(NAMES3)),
    st.tuples(st.just("retype"), st.sampled_from(NAMES3), st.sampled_from(["f16", "i32", "i8", "f64"])),
    st.tuples(st.just("key"), st.sampled_from(sorted(KEYS3)),
              st.one_of(st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=8),
                        st.sampled_from(["qwen2a", "voxtral", "whisper", "qwen3a"]))),
    st.tuples(st.just("extra_block"), st.sampled_from(["ln1.weight", "attn_q.weight"])),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(mutation3, min_size=1, max_size=3))
def test_mutated_qwen3a_mmproj_loads_or_raises_cleanly(tmp_path, muts):
    tensors, keys = dict(BASE3), dict(KEYS3)
    for m in muts:
        _apply(tensors, keys, m)
    path = tmp_path / "m.gguf"
    _write(path, tensors, keys)
    try:
        emb = d.load_audio_embedder(path)
    except (d.UnsupportedModelError, d.GGUFError, ValueError):
        return
    for n in (100, 8000, 12345):
        x = np.sin(np.arange(n) / 7.0).astype(np.float32)
        rows = d.encode_audio_rows(emb, x)
        assert rows.shape == (emb.n_rows(len(x)), emb.proj_dim) and np.isfinite(rows).all()


def test_unmutated_qwen3a_base_loads(tmp_path):
    _write(tmp_path / "m.gguf", dict(BASE3), dict(KEYS3))
    emb = d.load_audio_embedder(tmp_path / "m.gguf")
    assert (emb.family, emb.n_mel, emb.dim, emb.proj_dim) == ("qwen3a", MEL3, D, PROJ)
    assert d.encode_audio_rows(emb, np.zeros(100, np.float32)).shape == (7, PROJ)  # padded to 0.5 s


def test_unmutated_base_loads(tmp_path):
    _write(tmp_path / "m.gguf", dict(BASE), dict(KEYS))
    emb = d.load_audio_embedder(tmp_path / "m.gguf")
    assert (emb.family, emb.n_mel, emb.dim, emb.proj_dim) == ("qwen2a", MEL, D, PROJ)
