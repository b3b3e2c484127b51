"""llama2.c checkpoints: karpathy's legacy ``.bin`` (version 0) and its ``tokenizer.bin``, written to GGUF.

The checkpoint is a header of 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
seq_len; a negative vocab_size says the classifier is not shared with the embeddings), then float32
weights in this order: the embedding table, per-layer stacks of the attention norms, wq, wk, wv, wo,
the FFN norms, w1 (gate), w2 (down), w3 (up), the final norm, the RoPE tables (seq_len x head_dim/2,
real then imaginary; recomputed, not read), and the classifier when not shared. Matrices are row-major
(out x in); queries and keys rotate adjacent pairs, as the llama GGUF layout does, so they are written
as they are. The tokenizer is an int32 max token length, then per token a float32 score, an int32
length and the UTF-8 text (spaces as spaces; ids 0 / 1 / 2 are unk / bos / eos), as llama.cpp's
convert-llama2c-to-ggml reads it.

``load_model`` converts a ``.bin`` (with ``tokenizer.bin`` beside it) on first use into the cache
(<home>/llama2c/), keyed by the two files' sizes and modification times.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Tuple

from ._core import GGUFError

_HEADER = struct.Struct("<7i")
_V1_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export versions


def is_llama2c(path) -> bool:
    """Whether path looks like a llama2.c checkpoint (not a GGUF): a .bin whose first bytes are not GGUF's."""
    p = os.fspath(path)
    if not p.endswith(".bin") or not os.path.isfile(p):
        return False
    with open(p, "rb") as f:
        return f.read(4) != b"GGUF"


def read_config(path) -> Tuple[dict, bool]:
    """The header as a dict and whether the classifier is shared; GGUFError on a malformed file."""
    p = os.fspath(path)
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise GGUFError(f"{p}: too short for a llama2.c header ({size} bytes)")
    if struct.unpack("<I", head[:4])[0] == _V1_MAGIC:
        raise GGUFError(f"{p}: a llama2.c version-1+ export ('ak42'); only the legacy (version 0) layout is read")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = _HEADER.unpack(head)
    shared = vocab > 0
    vocab = abs(vocab)
    c = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
             vocab_size=vocab, seq_len=seq_len)
    if min(c.values()) <= 0 or max(c.values()) > 1 << 24:
        raise GGUFError(f"{p}: implausible llama2.c header {c}")
    if dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise GGUFError(f"{p}: heads do not divide the model: {c}")
    want = _HEADER.size + 4 * _n_floats(c, shared)
    if size != want:
        raise GGUFError(f"{p}: {size} bytes, but a llama2.c checkpoint of {c} "
                        f"({'shared' if shared else 'own'} classifier) has {want}")
    return c, shared


def _n_floats(c: dict, shared: bool) -> int:
    D, F, L, V, S = c["dim"], c["hidden_dim"], c["n_layers"], c["vocab_size"], c["seq_len"]
    kv = D // c["n_heads"] * c["n_kv_heads"]
    hd = D // c["n_heads"]
    per_layer = 2 * D + D * D + 2 * kv * D + D * D + 3 * F * D
    return V * D + L * per_layer + D + S * hd + (0 if shared else V * D)


def read_tokenizer(path, vocab_size: int):
    """(tokens, scores, types) of a tokenizer.bin, as GGUF's SentencePiece vocabulary spells them."""
    import gguf

    p = os.fspath(path)
    data = Path(p).read_bytes()
    if len(data) < 4:
        raise GGUFError(f"{p}: too short for a llama2.c tokenizer")
    off = 4
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if off + 8 > len(data):
            raise GGUFError(f"{p}: ends at token {i} of {vocab_size}")
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if n < 0 or off + n > len(data):
            raise GGUFError(f"{p}: token {i} has a bad length {n}")
        text = data[off:off + n]
        off += n
        t = gguf.TokenType.NORMAL
        if i == 0:
            text, t = b"<unk>", gguf.TokenType.UNKNOWN
        elif i in (1, 2):
            text, t = (b"<s>", b"</s>")[i - 1], gguf.TokenType.CONTROL
        elif not text:
            t = gguf.TokenType.CONTROL
        elif len(text) == 6 and text.startswith(b"<0x") and text.endswith(b">"):
            t = gguf.TokenType.BYTE
        tokens.append(text.replace(b" ", "\u2581".encode()))
        scores.append(float(score))
        types.append(t)
    if off != len(data):
        raise GGUFError(f"{p}: {len(data) - off} bytes left after {vocab_size} tokens (a tokenizer for another vocabulary?)")
    return tokens, scores, types


def convert_llama2c(model_path, tokenizer_path, out_path) -> str:
    """Writes the checkpoint and its tokenizer as one llama GGUF (f32); returns out_path."""
    import gguf
    import numpy as np

    c, shared = read_config(model_path)
    tokens, scores, types = read_tokenizer(tokenizer_path, c["vocab_size"])
    D, F, L, V = c["dim"], c["hidden_dim"], c["n_layers"], c["vocab_size"]
    hd = D // c["n_heads"]
    kv = hd * c["n_kv_heads"]
    w = np.memmap(os.fspath(model_path), dtype="<f4", mode="r", offset=_HEADER.size)
    pos = 0

    def take(*shape):
        nonlocal pos
        n = int(np.prod(shape))
        a = np.asarray(w[pos:pos + n], dtype=np.float32).reshape(shape)
        pos += n
        return a

    emb = take(V, D)
    att_norm = take(L, D)
    wq, wk, wv, wo = take(L, D, D), take(L, kv, D), take(L, kv, D), take(L, D, D)
    ffn_norm = take(L, D)
    w1, w2, w3 = take(L, F, D), take(L, D, F), take(L, F, D)
    out_norm = take(D)
    take(c["seq_len"], hd)  # the RoPE tables (cos, sin): recomputed from the base
    cls = None if shared else take(V, D)

    tmp = os.fspath(out_path) + ".part"
    g = gguf.GGUFWriter(tmp, "llama")
    g.add_name(Path(os.fspath(model_path)).stem)
    g.add_context_length(c["seq_len"])
    g.add_embedding_length(D)
    g.add_feed_forward_length(F)
    g.add_block_count(L)
    g.add_head_count(c["n_heads"])
    g.add_head_count_kv(c["n_kv_heads"])
    g.add_rope_dimension_count(hd)
    g.add_rope_freq_base(10000.0)
    g.add_layer_norm_rms_eps(1e-5)
    g.add_file_type(gguf.LlamaFileType.ALL_F32)
    g.add_tokenizer_model("llama")
    g.add_tokenizer_pre("default")
    g.add_token_list(tokens)
    g.add_token_scores(scores)
    g.add_token_types(types)
    g.add_unk_token_id(0)
    g.add_bos_token_id(1)
    g.add_eos_token_id(2)
    g.add_add_bos_token(True)
    g.add_add_space_prefix(True)  # run.c encodes with a dummy prefix space
    g.add_tensor("token_embd.weight", emb)
    g.add_tensor("output_norm.weight", out_norm)
    if cls is not None:
        g.add_tensor("output.weight", cls)
    for i in range(L):
        b = f"blk.{i}."
        g.add_tensor(b + "attn_norm.weight", att_norm[i])
        g.add_tensor(b + "attn_q.weight", wq[i])
        g.add_tensor(b + "attn_k.weight", wk[i])
        g.add_tensor(b + "attn_v.weight", wv[i])
        g.add_tensor(b + "attn_output.weight", wo[i])
        g.add_tensor(b + "ffn_norm.weight", ffn_norm[i])
        g.add_tensor(b + "ffn_gate.weight", w1[i])
        g.add_tensor(b + "ffn_down.weight", w2[i])
        g.add_tensor(b + "ffn_up.weight", w3[i])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    os.replace(tmp, out_path)
    return os.fspath(out_path)


def cached_gguf(model_path, tokenizer_path=None) -> str:
    """The GGUF of a llama2.c checkpoint in the cache, converted on first use (tokenizer.bin from the
    checkpoint's directory unless given)."""
    import hashlib

    from . import hub

    mp = Path(os.fspath(model_path)).resolve()
    tp = Path(os.fspath(tokenizer_path)).resolve() if tokenizer_path else mp.parent / "tokenizer.bin"
    if not tp.is_file():
        raise GGUFError(f"{mp}: a llama2.c checkpoint needs its tokenizer.bin (looked for {tp})")
    key = hashlib.sha256()
    for p in (mp, tp):
        st = p.stat()
        key.update(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode())
    out = hub.home() / "llama2c" / f"{mp.stem}-{key.hexdigest()[:16]}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_llama2c(mp, tp, out)
    return str(out)
