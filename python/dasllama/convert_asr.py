"""Whole whisper models (encoder, decoder, tokenizer, special-token ids) -> one GGUF for
speech recognition. Not the requantizer nor the encoder-only mmproj (``convert.py``).

The file is the whisper-encoder mmproj ``convert_ct2_whisper`` writes (``clip.*`` keys,
``a.*`` tensors, so ``load_audio_embedder`` reads it unchanged) plus:

- ``d.*`` tensors: ``token_embd`` (tied output), ``position_embd``, ``output_norm``, and per
  block ``ln1`` / ``attn_{q,k,v,out}`` (causal self-attention), ``ln_cross`` /
  ``cross_{q,k,v,out}`` (over the encoder rows), ``ln2`` / ``ffn_{up,down}``;
- ``whisper.decoder.*`` hyperparameters, ``whisper.token.*`` special ids,
  ``whisper.suppress_tokens`` / ``whisper.begin_suppress_tokens``, ``whisper.languages``
  (codes) with ``whisper.language_tokens`` (their ids), ``whisper.multilingual``;
- ``tokenizer.ggml.model = gpt2`` and ``tokenizer.ggml.tokens`` (byte-level BPE strings).

Two sources: CTranslate2 directories (``dasllama pull whisper-tiny.en``) and transformers
checkpoints (``WhisperForConditionalGeneration.save_pretrained``); the latter are renamed
to CTranslate2's variables first, so both go through one writer.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np

from ._core import DasllamaError

PathLike = Union[str, "os.PathLike[str]"]


def _specials(tokens: List[str]) -> Dict[str, int]:
    """Special ids by their token strings (the same in every whisper vocabulary)."""
    ids = {t: i for i, t in enumerate(tokens)}
    need = {"eot": "<|endoftext|>", "sot": "<|startoftranscript|>", "notimestamps": "<|notimestamps|>"}
    out = {}
    for k, s in need.items():
        if s not in ids:
            raise DasllamaError(f"the vocabulary has no {s} token")
        out[k] = ids[s]
    for k, s in (("transcribe", "<|transcribe|>"), ("translate", "<|translate|>"), ("sot_prev", "<|startofprev|>"),
                 ("sot_lm", "<|startoflm|>")):
        out[k] = ids.get(s, -1)
    out["no_speech"] = ids.get("<|nospeech|>", ids.get("<|nocaptions|>", -1))
    out["timestamp_begin"] = ids.get("<|0.00|>", out["notimestamps"] + 1)
    return out


def _write(v: dict, tokens: List[str], suppress: List[int], suppress_begin: List[int], lang_ids: List[int],
           multilingual: bool, dst: Path, name: str, progress: bool) -> Path:
    """The ASR GGUF from CTranslate2-named variables ``v`` (encoder/..., decoder/...)."""
    import gguf

    from .convert import _finish, _progress, convert_ct2_whisper_tensors

    enc_meta, tensors = convert_ct2_whisper_tensors(v, name)
    if "decoder/embeddings/weight" not in v:
        raise DasllamaError(f"{name}: no decoder in this model")

    def get(n):
        if f"decoder/{n}" not in v:
            raise DasllamaError(f"{name}: missing decoder/{n}")
        a = v[f"decoder/{n}"]
        scale = v.get(f"decoder/{n}_scale")
        if a.dtype == np.int8:  # CTranslate2 int8: one scale per output row
            if scale is None:
                raise DasllamaError(f"{name}: int8 decoder/{n} without a scale")
            a = (a.astype(np.float32) / scale.reshape(-1, *([1] * (a.ndim - 1)))).astype(np.float16)
        return a

    def f32(a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def mat(a):
        return np.ascontiguousarray(a if a.dtype in (np.float16, np.float32) else a.astype(np.float32))

    emb = mat(get("embeddings/weight"))
    vocab, dim = emb.shape
    if len(tokens) != vocab:
        raise DasllamaError(f"{name}: the vocabulary has {len(tokens)} tokens, the embedding {vocab} rows")
    heads = int(np.asarray(v.get("decoder/num_heads", 0)).reshape(-1)[0]) if "decoder/num_heads" in v else 0
    if heads <= 0 or dim % heads:
        raise DasllamaError(f"{name}: decoder/num_heads {heads} does not divide width {dim}")
    n_layers = 0
    while f"decoder/layer_{n_layers}/self_attention/linear_0/weight" in v:
        n_layers += 1
    if n_layers == 0:
        raise DasllamaError(f"{name}: no decoder layers")
    pos = f32(get("position_encodings/encodings"))
    sp = _specials(tokens)

    tensors += [("d.token_embd.weight", emb), ("d.position_embd.weight", pos),
                ("d.output_norm.weight", f32(get("layer_norm/gamma"))),
                ("d.output_norm.bias", f32(get("layer_norm/beta")))]
    for il in range(n_layers):
        p, b = f"layer_{il}/", f"d.blk.{il}."
        qkv, qkv_b = get(p + "self_attention/linear_0/weight"), f32(get(p + "self_attention/linear_0/bias"))
        xkv, xkv_b = get(p + "attention/linear_1/weight"), f32(get(p + "attention/linear_1/bias"))
        if qkv.shape != (3 * dim, dim) or xkv.shape != (2 * dim, dim):
            raise DasllamaError(f"{name}: decoder layer {il} fused projections have shapes {qkv.shape}, {xkv.shape}")
        tensors += [
            (b + "ln1.weight", f32(get(p + "self_attention/layer_norm/gamma"))),
            (b + "ln1.bias", f32(get(p + "self_attention/layer_norm/beta"))),
            (b + "attn_q.weight", mat(qkv[:dim])), (b + "attn_q.bias", qkv_b[:dim]),
            (b + "attn_k.weight", mat(qkv[dim:2 * dim])),
            (b + "attn_v.weight", mat(qkv[2 * dim:])), (b + "attn_v.bias", qkv_b[2 * dim:]),
            (b + "attn_out.weight", mat(get(p + "self_attention/linear_1/weight"))),
            (b + "attn_out.bias", f32(get(p + "self_attention/linear_1/bias"))),
            (b + "ln_cross.weight", f32(get(p + "attention/layer_norm/gamma"))),
            (b + "ln_cross.bias", f32(get(p + "attention/layer_norm/beta"))),
            (b + "cross_q.weight", mat(get(p + "attention/linear_0/weight"))),
            (b + "cross_q.bias", f32(get(p + "attention/linear_0/bias"))),
            (b + "cross_k.weight", mat(xkv[:dim])),
            (b + "cross_v.weight", mat(xkv[dim:])), (b + "cross_v.bias", xkv_b[dim:]),
            (b + "cross_out.weight", mat(get(p + "attention/linear_2/weight"))),
            (b + "cross_out.bias", f32(get(p + "attention/linear_2/bias"))),
            (b + "ln2.weight", f32(get(p + "ffn/layer_norm/gamma"))),
            (b + "ln2.bias", f32(get(p + "ffn/layer_norm/beta"))),
            (b + "ffn_up.weight", mat(get(p + "ffn/linear_0/weight"))),
            (b + "ffn_up.bias", f32(get(p + "ffn/linear_0/bias"))),
            (b + "ffn_down.weight", mat(get(p + "ffn/linear_1/weight"))),
            (b + "ffn_down.bias", f32(get(p + "ffn/linear_1/bias"))),
        ]
        # Whisper's keys have no bias (CTranslate2 stores zeros); keep one only if it is real.
        if np.any(qkv_b[dim:2 * dim] != 0):
            tensors.append((b + "attn_k.bias", qkv_b[dim:2 * dim]))
        if np.any(xkv_b[:dim] != 0):
            tensors.append((b + "cross_k.bias", xkv_b[:dim]))

    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_string("general.name", f"whisper from {name}")
    for k, (kind, val) in enc_meta.items():
        getattr(w, f"add_{kind}")(k, val)
    w.add_uint32("whisper.decoder.block_count", n_layers)
    w.add_uint32("whisper.decoder.attention.head_count", heads)
    w.add_uint32("whisper.decoder.context_length", pos.shape[0])
    w.add_float32("whisper.decoder.attention.layer_norm_epsilon", 1e-5)
    w.add_bool("whisper.multilingual", bool(multilingual))
    for k, i in sp.items():
        w.add_int32(f"whisper.token.{k}", int(i))
    w.add_array("whisper.suppress_tokens", [int(i) for i in suppress])
    w.add_array("whisper.begin_suppress_tokens", [int(i) for i in suppress_begin])
    codes = [tokens[i][2:-2] for i in lang_ids]
    if codes:
        w.add_array("whisper.languages", codes)
        w.add_array("whisper.language_tokens", [int(i) for i in lang_ids])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", list(tokens))
    for n, a in _progress(tensors, "convert whisper", progress):
        w.add_tensor(n, np.ascontiguousarray(a))
    return _finish(w, tmp, dst)


def _vocab_ids(vocab: Dict[str, int], added: Dict[str, int], n: Optional[int] = None) -> List[str]:
    allv = dict(vocab)
    allv.update(added)
    size = n if n is not None else max(allv.values()) + 1
    tokens: List[Optional[str]] = [None] * size
    for t, i in allv.items():
        if 0 <= i < size:
            tokens[i] = t
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise DasllamaError(f"the vocabulary has no token for ids {missing[:5]}...")
    return tokens  # type: ignore[return-value]


def convert_ct2_whisper_asr(src: PathLike, dst: PathLike, progress: bool = True) -> Path:
    """Write ``dst``: a whole CTranslate2 whisper model (directory with model.bin, config.json
    and vocabulary.txt or tokenizer.json) as the ASR GGUF described above."""
    from .convert import _read_ct2

    src = Path(src)
    d = src if src.is_dir() else src.parent
    binf = d / "model.bin"
    if not binf.is_file():
        raise FileNotFoundError(f"{binf}: no CTranslate2 model.bin")
    v = _read_ct2(binf)
    if v["__spec__"] != "WhisperSpec":
        raise DasllamaError(f"{binf}: a {v['__spec__']}, not a whisper model")
    if (d / "vocabulary.txt").is_file():
        tokens = (d / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()
    elif (d / "tokenizer.json").is_file():
        tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        tokens = _vocab_ids(tj["model"]["vocab"], {a["content"]: a["id"] for a in tj.get("added_tokens", [])})
    else:
        raise FileNotFoundError(f"{d}: no vocabulary.txt or tokenizer.json")
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    vocab = v["decoder/embeddings/weight"].shape[0] if "decoder/embeddings/weight" in v else len(tokens)
    tokens = tokens[:vocab]
    return _write(v, tokens, cfg.get("suppress_ids", []), cfg.get("suppress_ids_begin", []),
                  cfg.get("lang_ids", []), vocab >= 51865, Path(dst), binf.parent.name, progress)


def convert_hf_whisper(src: PathLike, dst: PathLike, progress: bool = True) -> Path:
    """Write ``dst`` from a transformers whisper checkpoint directory (config.json,
    generation_config.json, model.safetensors, and vocab.json [+ added_tokens.json] or
    tokenizer.json)."""
    from safetensors.numpy import load_file

    d = Path(src)
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d}: no model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").is_file() else {}
    sd = {k.removeprefix("model."): a for k, a in load_file(str(d / "model.safetensors")).items()}
    v: dict = {"__spec__": "WhisperSpec",
               "encoder/num_heads": np.array(cfg["encoder_attention_heads"], np.int16),
               "decoder/num_heads": np.array(cfg["decoder_attention_heads"], np.int16)}

    def ln(dst_, src_):
        v[dst_ + "/gamma"], v[dst_ + "/beta"] = sd[src_ + ".weight"], sd[src_ + ".bias"]

    def lin(dst_, src_):
        v[dst_ + "/weight"], v[dst_ + "/bias"] = sd[src_ + ".weight"], sd[src_ + ".bias"]

    def fused(dst_, srcs):  # CTranslate2 fuses projections; keys have no bias (zeros)
        v[dst_ + "/weight"] = np.concatenate([sd[s + ".weight"] for s in srcs])
        v[dst_ + "/bias"] = np.concatenate(
            [sd[s + ".bias"] if s + ".bias" in sd else np.zeros(sd[s + ".weight"].shape[0], np.float32) for s in srcs])

    for part in ("encoder", "decoder"):
        n = cfg[f"{part}_layers"]
        v[f"{part}/position_encodings/encodings"] = sd[f"{part}.embed_positions.weight"]
        ln(f"{part}/layer_norm", f"{part}.layer_norm")
        for i in range(n):
            s, t = f"{part}.layers.{i}.", f"{part}/layer_{i}/"
            fused(t + "self_attention/linear_0", [s + "self_attn.q_proj", s + "self_attn.k_proj", s + "self_attn.v_proj"])
            lin(t + "self_attention/linear_1", s + "self_attn.out_proj")
            ln(t + "self_attention/layer_norm", s + "self_attn_layer_norm")
            lin(t + "ffn/linear_0", s + "fc1")
            lin(t + "ffn/linear_1", s + "fc2")
            ln(t + "ffn/layer_norm", s + "final_layer_norm")
            if part == "decoder":
                lin(t + "attention/linear_0", s + "encoder_attn.q_proj")
                fused(t + "attention/linear_1", [s + "encoder_attn.k_proj", s + "encoder_attn.v_proj"])
                lin(t + "attention/linear_2", s + "encoder_attn.out_proj")
                ln(t + "attention/layer_norm", s + "encoder_attn_layer_norm")
    for c in ("conv1", "conv2"):
        lin(f"encoder/{c}", f"encoder.{c}")
    v["decoder/embeddings/weight"] = sd["decoder.embed_tokens.weight"]

    if (d / "tokenizer.json").is_file():
        tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        vocab, added = tj["model"]["vocab"], {a["content"]: a["id"] for a in tj.get("added_tokens", [])}
    elif (d / "vocab.json").is_file():
        vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
        added = json.loads((d / "added_tokens.json").read_text()) if (d / "added_tokens.json").is_file() else {}
    else:
        raise FileNotFoundError(f"{d}: no tokenizer.json or vocab.json")
    tokens = _vocab_ids(vocab, added, cfg["vocab_size"])
    lang = sorted(gen.get("lang_to_id", {}).values())
    suppress = gen.get("suppress_tokens", cfg.get("suppress_tokens")) or []
    begin = gen.get("begin_suppress_tokens", cfg.get("begin_suppress_tokens")) or []
    multi = gen.get("is_multilingual", cfg["vocab_size"] >= 51865)
    return _write(v, tokens, suppress, begin, lang, multi, Path(dst), d.name, progress)
