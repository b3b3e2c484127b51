"""llama2.c checkpoints against transformers: a tiny random LlamaForCausalLM written into llama2.c's
documented legacy layout (7-int header, the weights in run.c's order with queries and keys in Meta's
adjacent-pair rope layout, the RoPE tables, the classifier when not shared -- the sign of the
vocabulary size says which), its tokenizer.bin written as llama2.c's tokenizer.py exports a
SentencePiece model. load_model converts both to GGUF on first use: logits and greedy tokens in fp32
equal transformers' on the same weights, tokens equal SentencePiece's, malformed files raise GGUFError.
"""
from __future__ import annotations

import os
import struct
import sys

import numpy as np
import pytest

import dasllama as d
import torch  # the oracle; never skipped

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import export as E  # noqa: E402

FP32_BAR = 1e-4


def _hf(shared: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    m = LlamaForCausalLM(LlamaConfig(
        vocab_size=E.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.08,
        tie_word_embeddings=shared, bos_token_id=1, eos_token_id=2, attn_implementation="eager"))
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m.float().eval()


def write_llama2c(m, path: str, shared: bool):
    """llama2.c export.py's legacy_export of an HF model (q and k back to adjacent rope pairs)."""
    c = m.config
    D, H, KVH, S = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.max_position_embeddings
    hd = D // H
    sd = {k: v.detach().float() for k, v in m.state_dict().items()}
    L = c.num_hidden_layers
    lay = lambda n: [sd[f"model.layers.{i}.{n}"] for i in range(L)]  # noqa: E731
    parts = [sd["model.embed_tokens.weight"]]
    parts += lay("input_layernorm.weight")
    parts += [E.permute(w, H, H) for w in lay("self_attn.q_proj.weight")]
    parts += [E.permute(w, H, KVH) for w in lay("self_attn.k_proj.weight")]
    parts += lay("self_attn.v_proj.weight") + lay("self_attn.o_proj.weight")
    parts += lay("post_attention_layernorm.weight")
    parts += lay("mlp.gate_proj.weight") + lay("mlp.down_proj.weight") + lay("mlp.up_proj.weight")
    parts.append(sd["model.norm.weight"])
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    ang = torch.outer(torch.arange(S).float(), freqs)
    parts += [torch.cos(ang), torch.sin(ang)]
    if not shared:
        parts.append(sd["lm_head.weight"])
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", D, c.intermediate_size, L, H, KVH, c.vocab_size if shared else -c.vocab_size, S))
        for p in parts:
            f.write(p.numpy().astype("<f4").tobytes())
    return path


def write_tokenizer_bin(proto: bytes, path: str):
    """llama2.c tokenizer.py's export: per piece its score, length and text ("\u2581" as space; BOS / EOS
    as "\\n<s>\\n" / "\\n</s>\\n"), after the longest piece's length."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    toks, scores = [], []
    for i in range(sp.vocab_size()):
        t = sp.id_to_piece(i)
        if i == sp.bos_id():
            t = "\n<s>\n"
        elif i == sp.eos_id():
            t = "\n</s>\n"
        toks.append(t.replace("\u2581", " ").encode())
        scores.append(sp.get_score(i))
    with open(path, "wb") as f:
        f.write(struct.pack("<I", max(len(t) for t in toks)))
        for b, s in zip(toks, scores):
            f.write(struct.pack("<fI", s, len(b)))
            f.write(b)
    return sp


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    proto = E.spm_model_proto()
    for shared in (True, False):
        dd = tmp_path_factory.mktemp("shared" if shared else "own")
        m = _hf(shared)
        sp = write_tokenizer_bin(proto, str(dd / "tokenizer.bin"))
        out[shared] = (m, write_llama2c(m, str(dd / "model.bin"), shared), sp)
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["shared-classifier", "own-classifier"])
def test_logits_and_greedy_match_transformers(ckpts, shared, monkeypatch, tmp_path):
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path))
    hf, path, _ = ckpts[shared]
    m = d.load_model(path, mode=d.QuantMode.fp32)
    assert m.arch == "llama"
    ids = [1] + np.random.default_rng(0).integers(3, E.VOCAB, 40).tolist()
    s = d.create_session(m, d.KVDtype.f32, n_ctx=64)
    d.eval(m, s, ids, all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().numpy()
    err = float(np.abs(np.array(s.logits).reshape(len(ids), -1) - ref).max())
    assert err < FP32_BAR, err
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:6]]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, 6:].tolist()
    got = []
    d.generate(m, d.create_session(m, d.KVDtype.f32, n_ctx=64), ids[:6], d.SamplingParams(), 20,
               lambda i, p: got.append(i))
    assert got == want[:len(got)] and len(got) >= 10
    # Converted once, into the cache.
    assert len(list((tmp_path / "llama2c").glob("*.gguf"))) == 1


def test_tokens_match_sentencepiece(ckpts, monkeypatch, tmp_path):
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path))
    _, path, sp = ckpts[True]
    m = d.load_model(path)
    # Single spaces, no newlines: this SentencePiece model normalizes both (its trainer's default nmt_nfkc), which
    # neither run.c nor llama.cpp does.
    for text in ["kato rimu senla", " lead space", "quiver dan el or", "bytes: \u00e9\u4e2d\U0001f999 7"]:
        assert d.encode(m, text) == [1] + sp.encode(text), text
        assert d.decode(m, sp.encode(text)) == sp.decode(sp.encode(text)), text


def test_convert_cli(ckpts, tmp_path):
    from dasllama import cli

    _, path, _ = ckpts[False]
    out = str(tmp_path / "x.gguf")
    assert cli.main(["convert", path, out]) == 0
    assert d.load_model(out).arch == "llama"


def test_malformed_files_raise(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path))
    _, path, _ = ckpts[True]
    data = open(path, "rb").read()
    tok = open(os.path.join(os.path.dirname(path), "tokenizer.bin"), "rb").read()
    cases = {"truncated": data[:-4], "header only": data[:20], "ak42": struct.pack("<Ii", 0x616B3432, 2) + data[8:],
             "bad heads": struct.pack("<7i", 64, 96, 2, 5, 2, 512, 128) + data[28:],
             "zero layers": struct.pack("<7i", 64, 96, 0, 4, 2, 512, 128) + data[28:]}
    for name, blob in cases.items():
        p = tmp_path / name.replace(" ", "_") / "model.bin"
        p.parent.mkdir()
        p.write_bytes(blob)
        (p.parent / "tokenizer.bin").write_bytes(tok)
        with pytest.raises(d.GGUFError):
            d.load_model(str(p))
    p = tmp_path / "notok" / "model.bin"
    p.parent.mkdir()
    p.write_bytes(data)
    with pytest.raises(d.GGUFError, match="tokenizer.bin"):
        d.load_model(str(p))
    (p.parent / "tokenizer.bin").write_bytes(tok[:100])
    with pytest.raises(d.GGUFError):
        d.load_model(str(p))
