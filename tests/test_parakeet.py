"""Parakeet CTC (a FastConformer encoder and a CTC head) against transformers' ParakeetForCTC on
tiny random models, converted by our own writer (``dasllama.convert_ctc``: llama.cpp's converter has
no layout for this model).

- The encoder's rows and the CTC logits equal the model's on the same features (no attention mask:
  every frame is the clip's), for lengths from one frame to 25 s (the stem's convs run in 3 tiles of
  output rows on the last two, odd and even): within 1e-5 of the peak |value| (f32; observed ~7e-7).
- Greedy CTC ids equal ``generate``'s (argmax, the processor's attention mask) merged and without
  the blank, and ``transcribe``'s text equals the processor's ``batch_decode`` of those ids, on an
  eSpeak clip, noise and a 0.1 s clip; with silu and relu activations.
- A malformed file raises our errors.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama import _core

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
from speech import speak  # noqa: E402

torch = pytest.importorskip("torch")
SR = 16000
PIECES = ["<unk>", "\u2581the", "\u2581a", "s", "\u2581cat", "\u2581dog", "ing", "\u2581qu", "ick", "\u2581b", "r",
          "own", "\u2581f", "o", "x", "\u2581j", "u", "m", "p", "\u2581over", "\u2581l", "azy", "e", "t", "\u2581",
          "h", "i", "n", "\u2581is", "d", "c", "k"]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import ParakeetTokenizer

    tk = Tokenizer(models.Unigram([(p, -1.0 - 0.1 * i) for i, p in enumerate(PIECES)], unk_id=0))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tok = ParakeetTokenizer(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>")
    assert tok.pad_token_id == len(PIECES)
    return tok


def _model(act: str, seed: int):
    from transformers import ParakeetCTCConfig, ParakeetForCTC

    torch.manual_seed(seed)
    enc = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, conv_kernel_size=9,
               subsampling_factor=8, subsampling_conv_channels=64, num_mel_bins=128, hidden_act=act)
    m = ParakeetForCTC(ParakeetCTCConfig(vocab_size=len(PIECES) + 1, pad_token_id=len(PIECES), encoder_config=enc))
    m.eval()
    # Weights of unit-scale activations (the default init's 0.02 leaves the attention's terms tiny),
    # and batch-norm statistics that are not the identity, so every folded term matters.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight") or "norm_" in n and n.endswith(".weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1 or n.endswith("bias_u") or n.endswith("bias_v"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p[0].numel()))
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm1d):
                mod.running_mean.copy_(0.3 * torch.randn_like(mod.running_mean))
                mod.running_var.copy_(0.5 + torch.rand_like(mod.running_var))
    return m


@pytest.fixture(scope="module", params=["silu", "relu"])
def built(request, tmp_path_factory):
    from transformers import ParakeetFeatureExtractor, ParakeetProcessor

    from dasllama.convert_ctc import convert_hf_parakeet_ctc

    root = tmp_path_factory.mktemp(f"parakeet-{request.param}")
    m = _model(request.param, seed=1 if request.param == "silu" else 2)
    tok = _tokenizer()
    src = root / "hf"
    m.save_pretrained(src)
    tok.save_pretrained(src)
    out = convert_hf_parakeet_ctc(src, root / "parakeet.gguf", progress=False)
    proc = ParakeetProcessor(feature_extractor=ParakeetFeatureExtractor(feature_size=128), tokenizer=tok)
    return {"model": m, "proc": proc, "src": src, "gguf": str(out), "asr": d.load_asr_model(out, n_threads=2)}


@pytest.fixture(scope="module")
def clip():
    return speak("The quick brown fox jumps over the lazy dog.")


def _near(ours, ref, bar=1e-5):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float(np.abs(ours - ref).max())
    assert err <= bar * float(np.abs(ref).max()), err


@pytest.mark.parametrize("frames", [1, 9, 100, 1998, 2501])
def test_rows_and_logits_match_transformers(built, frames):
    x = np.random.default_rng(frames).standard_normal((128, frames)).astype(np.float32)
    with torch.no_grad():
        r = built["model"](input_features=torch.from_numpy(x.T.copy())[None], output_hidden_states=True)
        enc = built["model"].encoder(input_features=torch.from_numpy(x.T.copy())[None]).last_hidden_state[0].numpy()
    hid, lg = built["asr"].encoder.encode_features(x, hidden=True)
    _near(hid, enc)
    _near(lg, r.logits[0].numpy())


@pytest.mark.parametrize("which", ["speech", "noise", "short"])
def test_greedy_ids_and_text_match_generate(built, clip, which):
    x = {"speech": clip, "noise": np.random.default_rng(3).standard_normal(SR * 2).astype(np.float32) * 0.3,
         "short": clip[SR // 2: SR // 2 + 1600]}[which]
    proc, m, asr = built["proc"], built["model"], built["asr"]
    inputs = proc(x, sampling_rate=SR, return_tensors="pt")
    with torch.no_grad():
        seq = m.generate(**inputs)[0].tolist()
    blank = m.config.pad_token_id
    want_ids = [t for t, _ in itertools.groupby(seq) if t != blank]
    want_text = proc.batch_decode([seq], skip_special_tokens=True)[0]
    t = d.transcribe(asr, x)
    got_ids = [i for s in t.segments for i in s.tokens]
    assert got_ids == want_ids
    assert t.text == want_text
    if which == "speech":
        assert len(set(want_ids)) >= 3, "the random model should say something on speech"
        assert t.segments[0].end == pytest.approx(x.size / SR)


def test_greedy_ctc_rule():
    from dasllama.asr_ctc import greedy_ctc

    lg = np.full((9, 4), -1.0, np.float32)
    for r, c in enumerate([3, 1, 1, 3, 1, 2, 2, 3, 3]):
        lg[r, c] = 1.0
    assert greedy_ctc(lg, 3) == [1, 1, 2]
    assert greedy_ctc(lg[:0], 3) == []


def test_config_and_silence(built):
    c = built["asr"].encoder.config
    assert (c["dim"], c["n_layers"], c["n_heads"], c["subsampling_convs"], c["blank"]) == (64, 2, 4, 3, len(PIECES))
    assert c["activation"] == built["model"].config.encoder_config.hidden_act
    t = d.transcribe(built["asr"], np.zeros(100, np.float32))  # under two hops: no frames
    assert t.text == "" and t.segments == []
    with pytest.raises(ValueError):
        d.transcribe(built["asr"], np.zeros(SR, np.float32), language="en")


def _rewrite(src, dst, meta=None, drop=()):
    """src's metadata (with `meta` overriding keys) and tensors (less `drop`) rewritten to dst by gguf-py."""
    import gguf

    meta = dict(meta or {})
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "fastconformer_ctc")
    for f in r.fields.values():
        if f.name.startswith("fastconformer_ctc.") or f.name.startswith("tokenizer."):
            v = meta.pop(f.name, f.contents())
            if isinstance(v, list):
                w.add_array(f.name, v)
            elif isinstance(v, str):
                w.add_string(f.name, v)
            elif isinstance(v, float):
                w.add_float32(f.name, v)
            else:
                w.add_uint32(f.name, int(v))
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data).reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_malformed_files(built, tmp_path):
    import gguf

    src = built["gguf"]
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read()[: os.path.getsize(src) // 2])
    with pytest.raises(d.DasllamaError):
        d.load_asr_model(cut)
    with pytest.raises(d.UnsupportedModelError, match="conv_dw"):
        d.load_asr_model(_rewrite(src, tmp_path / "missing.gguf", drop={"blk.1.conv_dw.weight"}))
    other = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "llama")
    other.add_tensor("x", np.zeros((2, 2), np.float32))
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    assert not _core.ConformerCTC.probe(str(tmp_path / "other.gguf"))
    with pytest.raises(d.UnsupportedModelError, match="FastConformer"):
        _core.ConformerCTC(str(tmp_path / "other.gguf"))


A = "fastconformer_ctc."


@pytest.mark.parametrize("meta", [
    {A + "attention.head_count": 3}, {A + "attention.head_count": 0}, {A + "subsampling.conv_count": 2},
    {A + "subsampling.conv_count": 4}, {A + "conv_kernel_size": 8}, {A + "conv_kernel_size": 7},
    {A + "num_mel_bins": 80}, {A + "block_count": 1}, {A + "block_count": 3}, {A + "blank_id": 99},
    {A + "embedding_length": 32}, {A + "activation": "tanh"}, {A + "input_scale": -1.0},
    {"tokenizer.ggml.tokens": ["a", "b"]},
], ids=lambda m: "-".join(f"{k.split('.')[-1]}={v if not isinstance(v, list) else len(v)}" for k, v in m.items()))
def test_inconsistent_metadata_is_refused(built, tmp_path, meta):
    """Metadata that disagrees with the tensors (or is out of range) raises our errors at load."""
    with pytest.raises(d.DasllamaError):
        d.load_asr_model(_rewrite(built["gguf"], tmp_path / "bad.gguf", meta=meta))


def test_cli_convert_and_transcribe(built, clip, tmp_path):
    import soundfile as sf

    out = tmp_path / "cli.gguf"
    r = subprocess.run([sys.executable, "-m", "dasllama", "convert", str(built["src"]), str(out)], capture_output=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    wav = tmp_path / "c.wav"
    sf.write(wav, clip, SR)
    r = subprocess.run([sys.executable, "-m", "dasllama", "transcribe", "--model", str(out), str(wav)],
                       capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert r.stdout.decode("utf-8") == d.transcribe(built["asr"], str(wav)).text + "\n"


_DEV = d.system_info()["devices"]


def _present(backend):
    info = _DEV.get(backend, {})
    return pytest.mark.skipif(not info.get("devices"), reason=f"no {backend} device here: "
                              + (info.get("error") or "none found"))


@pytest.mark.parametrize("device", [pytest.param("vulkan", marks=_present("vulkan")),
                                    pytest.param("cuda", marks=_present("cuda"))])
def test_on_device(built, clip, device):
    """The same encoder on a device backend (heads of d + head_dim = 80 fit its attention kernels):
    logits within 1e-4 of the peak of transformers', greedy ids equal generate's."""
    dev = d.load_asr_model(built["gguf"], n_threads=2, device=device)
    x = np.random.default_rng(7).standard_normal((128, 777)).astype(np.float32)
    with torch.no_grad():
        ref = built["model"](input_features=torch.from_numpy(x.T.copy())[None]).logits[0].numpy()
    _near(dev.encoder.encode_features(x)[1], ref, 1e-4)
    inputs = built["proc"](clip, sampling_rate=SR, return_tensors="pt")
    with torch.no_grad():
        seq = built["model"].generate(**inputs)[0].tolist()
    want = [t for t, _ in itertools.groupby(seq) if t != built["model"].config.pad_token_id]
    assert [i for s in d.transcribe(dev, clip).segments for i in s.tokens] == want


def test_transformers_directory_converts_on_first_use(built, clip, tmp_path, monkeypatch):
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path / "home"))
    m = d.load_asr_model(built["src"], n_threads=2)
    assert str(m.path).startswith(str(tmp_path / "home"))
    assert d.transcribe(m, clip).text == d.transcribe(built["asr"], clip).text


def test_server_transcriptions(built, clip, smollm2_path):
    """POST /v1/audio/transcriptions with a loaded CTC model: the text transcribe gives on the file."""
    import io

    import soundfile as sf
    from starlette.testclient import TestClient

    from dasllama.server import create_app

    b = io.BytesIO()
    sf.write(b, clip, SR, format="WAV", subtype="PCM_16")
    app = create_app(d.load_model(smollm2_path), streams=1, ctx=256, asr_model=built["asr"])
    try:
        with TestClient(app) as c:
            r = c.post("/v1/audio/transcriptions", files={"file": ("c.wav", b.getvalue(), "audio/wav")},
                       data={"model": "parakeet", "response_format": "json"})
            bad = c.post("/v1/audio/transcriptions", files={"file": ("c.wav", b.getvalue(), "audio/wav")},
                         data={"model": "parakeet", "language": "de"})
    finally:
        app.state.engine.stop()
    assert r.status_code == 200, r.text
    assert r.json()["text"] == d.transcribe(built["asr"], b.getvalue()).text
    assert bad.status_code == 400 and "language" in bad.text


def test_f16_matrices(built, tmp_path):
    """--outtype f16: the matrices in f16 (the oracle's rounded through f16 the same way), the
    vectors and the folded convs in f32; logits within 1e-4 of the peak."""
    from dasllama.convert_ctc import convert_hf_parakeet_ctc

    m = built["model"]
    out = convert_hf_parakeet_ctc(built["src"], tmp_path / "f16.gguf", progress=False, outtype="f16")
    from dasllama.gguf import GGUFFile

    with GGUFFile(out) as g:
        assert g.tensor("blk.0.ffn1_up.weight", typed=True).dtype == np.float16
        assert g.tensor("blk.0.conv_dw.weight", typed=True).dtype == np.float32
    ref_model = type(m)(m.config).eval()
    ref_model.load_state_dict(m.state_dict())
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            if n.startswith("encoder.layers.") and p.dim() >= 2 and "depthwise" not in n or n in (
                    "encoder.subsampling.linear.weight", "ctc_head.weight"):
                p.copy_(p.half().float())
    x = np.random.default_rng(5).standard_normal((128, 400)).astype(np.float32)
    with torch.no_grad():
        ref = ref_model(input_features=torch.from_numpy(x.T.copy())[None]).logits[0].numpy()
    _near(d.load_asr_model(out, n_threads=2).encoder.encode_features(x)[1], ref, 1e-4)


def test_q8_0_requantized(built, tmp_path):
    """`dasllama quantize --type q8_0` over our file: the wide matrices in q8_0 (narrow ones, whose
    rows do not fill 32-blocks, stay as they were); logits within q8's error of the model's
    (3e-2 of the peak; observed ~1.3e-2), the row argmaxes mostly the same."""
    from dasllama import cli
    from dasllama.gguf import GGUFFile

    out = tmp_path / "q8.gguf"
    assert cli.main(["quantize", built["gguf"], str(out), "--type", "q8_0"]) == 0
    with GGUFFile(out) as g:
        assert g.tensors["blk.0.ffn1_up.weight"].type_name == "q8_0"
    x = np.random.default_rng(1).standard_normal((128, 500)).astype(np.float32)
    with torch.no_grad():
        ref = built["model"](input_features=torch.from_numpy(x.T.copy())[None]).logits[0].numpy()
    lg = d.load_asr_model(out, n_threads=2).encoder.encode_features(x)[1]
    _near(lg, ref, 3e-2)
    assert (lg.argmax(1) == ref.argmax(1)).mean() >= 0.8
