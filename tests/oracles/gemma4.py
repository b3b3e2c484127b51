"""Tiny random Gemma-4 text models (transformers, fp32) turned into GGUF by llama.cpp's own converter.

Two shapes: ``dense`` as the 31B is built (sliding layers of head_dim 16 with two kv heads, global
layers of head_dim 32 with one kv head and no V projection -- attention_k_eq_v -- proportional rope
on a quarter of the global head) and ``eseries`` as E2B / E4B are (per-layer embeddings, the last two
layers reading the KV of the last earlier layer of their kind, a double-wide FFN in those layers).
Both soft-cap their logits and scale each layer's output by a random layer_scalar.

The vocabulary is a small BPE trained here in the SentencePiece style Gemma's tokenizer has
(spaces as "\u2581", byte fallback), wrapped in transformers' GemmaTokenizer with Gemma-4's control
tokens at the front: the converter reads it as it reads the real one (tokenizer.ggml.model
"gemma4", merges given). The real Gemma-4 vocabulary ships in llama.cpp's source
(models/ggml-vocab-gemma-4.gguf) with llama.cpp's own tokenizations of a test text (.inp / .out).
"""
from __future__ import annotations

import json
import os

import torch

import hybrid as H
import moe as M

INIT = M.INIT
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
            "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
            "<tool_response|>", '<|"|>']
CORPUS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
          "Hello world! 1234 5678", "\u00c4pfel und Birnen", "  indented   spaces\n\n\nnewlines",
          "the theory of the thing they thought", "user model system tool call response"]
VOCAB_FILES = ("models/ggml-vocab-gemma-4.gguf", "models/ggml-vocab-gemma-4.gguf.inp",
               "models/ggml-vocab-gemma-4.gguf.out", "models/templates/google-gemma-4-31B-it.jinja")


def llama_cpp_file(rel: str) -> str:
    """A file of the pinned llama.cpp source (extracted from the sdist on first use)."""
    import tarfile

    src = M.llama_cpp_dir()
    p = src / rel
    if not p.exists():
        root = src.parents[2]
        prefix = f"llama_cpp_python-{M.LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(root / f"llama_cpp_python-{M.LLAMA_CPP_PYTHON}.tar.gz") as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix) and m.name[len(prefix):] in VOCAB_FILES]
            tf.extractall(root, members=members, filter="data")
    return str(p)


def tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Split("\u2581", "merged_with_next")
    tr = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                             special_tokens=SPECIALS + [f"<0x{b:02X}>" for b in range(256)])
    tk.train_from_iterator(CORPUS * 20, tr)
    j = json.loads(tk.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in j["merges"]]
    tok = GemmaTokenizer(vocab=j["vocab"], merges=merges)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[5:]})
    tok.chat_template = open(llama_cpp_file("models/templates/google-gemma-4-31B-it.jinja"), encoding="utf-8").read()
    return tok


def _config(vocab: int, eseries: bool):
    from transformers import Gemma4TextConfig

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, max_position_embeddings=512,
              rms_norm_eps=1e-6, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              final_logit_softcapping=30.0, initializer_range=INIT, tie_word_embeddings=True, pad_token_id=0,
              eos_token_id=1, bos_token_id=2, attn_implementation="eager")
    if eseries:
        kw.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab, num_kv_shared_layers=2,
                  attention_k_eq_v=False, use_double_wide_mlp=True)
    else:
        kw.update(hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                  num_kv_shared_layers=0)
    return Gemma4TextConfig(**kw)


def _model(vocab: int, eseries: bool) -> torch.nn.Module:
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    m = M._seeded(Gemma4ForCausalLM(_config(vocab, eseries)))
    with torch.no_grad():  # layer_scalar is a buffer (ones): random, so a skipped scale shows
        for layer in m.model.layers:
            layer.layer_scalar.uniform_(0.6, 1.4)
    return m


FAMILIES = {"dense": lambda v: _model(v, False), "eseries": lambda v: _model(v, True)}


def build(name: str, tok, out_dir: str, outtypes=("f32", "q8_0")):
    """The HF model and {outtype: gguf path} of a shape, written under out_dir."""
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: H.convert(hf_dir, os.path.join(out_dir, f"gemma4-{name}-{t}.gguf"), t, ()) for t in outtypes}
