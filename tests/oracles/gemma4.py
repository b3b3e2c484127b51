"""Tiny random Gemma-4 text models (transformers, fp32) turned into GGUF by llama.cpp's own converter.

Two shapes: ``dense`` as the 31B is built (sliding layers of head_dim 16 with two kv heads, global
layers of head_dim 32 with one kv head and no V projection -- attention_k_eq_v -- proportional rope
on a quarter of the global head) and ``eseries`` as E2B / E4B are (per-layer embeddings, the last two
layers reading the KV of the last earlier layer of their kind, a double-wide FFN in those layers).
A third, ``moe``, is the dense one with experts beside each layer's MLP, as the 26B-A4B is (a router
with its own input norm, a per-expert scale, the experts' gate and up as one stack). All soft-cap
their logits and scale each layer's output by a random layer_scalar.

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


def _config(vocab: int, eseries: bool, moe: bool = False):
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
    if moe:  # as the 26B-A4B: experts beside the dense MLP in every layer
        kw.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    return Gemma4TextConfig(**kw)


def _model(vocab: int, eseries: bool, moe: bool = False) -> torch.nn.Module:
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    m = M._seeded(Gemma4ForCausalLM(_config(vocab, eseries, moe)))
    with torch.no_grad():  # layer_scalar is a buffer (ones): random, so a skipped scale shows
        for layer in m.model.layers:
            layer.layer_scalar.uniform_(0.6, 1.4)
    return m


FAMILIES = {"dense": lambda v: _model(v, False), "eseries": lambda v: _model(v, True),
            "moe": lambda v: _model(v, False, True)}


def build(name: str, tok, out_dir: str, outtypes=("f32", "q8_0")):
    """The HF model and {outtype: gguf path} of a shape, written under out_dir."""
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: H.convert(hf_dir, os.path.join(out_dir, f"gemma4-{name}-{t}.gguf"), t, ()) for t in outtypes}


# ---- network-free files for the device tests ---------------------------------------------------

def random_gguf(name: str, path: str, ftype: str = "q8_0", seed: int = 0, wide: bool = False) -> str:
    """A small random Gemma-4 file of a shape above, with the converter's names, shapes and keys (as the
    converter-made files carry them; keys written by name, since an installed gguf-py may predate the
    family) and export.py's 512-token SPM vocabulary: for the device tests, which compare a device with
    the CPU (itself held to transformers above) where neither PyPI nor the converter is reachable.
    wide: the released models' head sizes (256 sliding, 512 global) in place of 16 and 32."""
    import gguf
    import numpy as np

    import export as E

    assert name in FAMILIES
    es, moe = name == "eseries", name == "moe"
    rng = np.random.default_rng(seed)
    D, H, V, L, P = 64, 4, E.VOCAB, 6, 8
    swa = [True, True, False] * 2
    kvh = [2] * L if es else [2 if s else 1 for s in swa]
    hs, hg = (256, 512) if wide else (16, 32)  # sliding, global head sizes
    hd = [hs if s else hg for s in swa]
    ff = [96] * 4 + [192] * 2 if es else [96] * L
    shared = 2 if es else 0
    w = gguf.GGUFWriter(path, "gemma4")
    a = "gemma4."
    w.add_uint32(a + "block_count", L)
    w.add_uint32(a + "context_length", 512)
    w.add_uint32(a + "embedding_length", D)
    w.add_array(a + "feed_forward_length", ff) if es else w.add_uint32(a + "feed_forward_length", 96)
    w.add_uint32(a + "attention.head_count", H)
    w.add_uint32(a + "attention.head_count_kv", 2) if es else w.add_array(a + "attention.head_count_kv", kvh)
    w.add_float32(a + "rope.freq_base", 1e6)
    w.add_float32(a + "rope.freq_base_swa", 1e4)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(a + "attention.key_length", hg)
    w.add_uint32(a + "attention.value_length", hg)
    w.add_uint32(a + "attention.key_length_swa", hs)
    w.add_uint32(a + "attention.value_length_swa", hs)
    w.add_float32(a + "final_logit_softcapping", 30.0)
    w.add_uint32(a + "attention.sliding_window", 8)
    w.add_uint32(a + "attention.shared_kv_layers", shared)
    w.add_uint32(a + "embedding_length_per_layer_input", P if es else 0)
    w.add_array(a + "attention.sliding_window_pattern", swa)
    w.add_uint32(a + "rope.dimension_count", hg)
    w.add_uint32(a + "rope.dimension_count_swa", hs)
    if moe:
        w.add_uint32(a + "expert_count", 4)
        w.add_uint32(a + "expert_used_count", 2)
        w.add_uint32(a + "expert_feed_forward_length", 32)
    E._add_spm_vocab(w, E.spm_model_proto())
    qt = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}[ftype]

    def mat(tname, *shape, scale=INIT):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qt == gguf.GGMLQuantizationType.F32 or shape[-1] % 32:
            w.add_tensor(tname, x)
        else:
            w.add_tensor(tname, gguf.quants.quantize(x, qt), raw_dtype=qt)

    def vec(tname, *shape, base=1.0, scale=0.1):
        w.add_tensor(tname, (base + rng.standard_normal(shape) * scale).astype(np.float32))

    w.add_tensor("rope_freqs.weight", np.array([1.0] * (hg // 8) + [1e30] * (3 * hg // 8), dtype=np.float32))
    mat("token_embd.weight", V, D, scale=1.0)
    vec("output_norm.weight", D)
    if es:
        mat("per_layer_token_embd.weight", V, L * P, scale=1.0)
        mat("per_layer_model_proj.weight", L * P, D)
        vec("per_layer_proj_norm.weight", P)
    for il in range(L):
        b = f"blk.{il}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            vec(b + n + ".weight", D)
        w.add_tensor(b + "layer_output_scale.weight", rng.uniform(0.6, 1.4, 1).astype(np.float32))
        mat(b + "attn_q.weight", H * hd[il], D)
        vec(b + "attn_q_norm.weight", hd[il])
        if il < L - shared:
            mat(b + "attn_k.weight", kvh[il] * hd[il], D)
            vec(b + "attn_k_norm.weight", hd[il])
            if es or swa[il]:
                mat(b + "attn_v.weight", kvh[il] * hd[il], D)
        mat(b + "attn_output.weight", D, H * hd[il])
        mat(b + "ffn_gate.weight", ff[il], D)
        mat(b + "ffn_up.weight", ff[il], D)
        mat(b + "ffn_down.weight", D, ff[il])
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((4, D)) * 0.5).astype(np.float32))
            vec(b + "ffn_gate_inp.scale", D)
            mat(b + "ffn_gate_up_exps.weight", 4, 64, D)
            mat(b + "ffn_down_exps.weight", 4, D, 32)
            vec(b + "ffn_down_exps.scale", 4)
            for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                vec(b + n + ".weight", D)
        if es:
            mat(b + "inp_gate.weight", P, D)
            mat(b + "proj.weight", D, P)
            vec(b + "post_norm.weight", D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
