"""Tiny random HF models of every family, written to GGUF (f32, f16, q8_0) the way llama.cpp's converter does.

Each family is a seeded fp32 transformers model small enough to run in milliseconds,
with row lengths that are multiples of 32 (q8_0 blocks) and a sliding window of 8 so
that ~40-token prompts cross it. ``write_gguf`` mirrors convert_hf_to_gguf.py: the
same metadata keys per architecture, gguf-py's tensor name map, llama's Q/K row
permutation for adjacent-pair rope, gemma's +1 on every ``*norm.weight``, 1-D tensors
kept f32 and 2-D tensors stored as the file type. ``reference_model`` gives the HF
model with the weights exactly as stored (quantize -> dequantize in HF layout: q8_0
and f16 act on whole rows, and the only transforms are row permutations and +1 on
f32 norms, so the round trip commutes with them).

Run as ``python tests/oracles/export.py OUTDIR`` to write every file.
"""
from __future__ import annotations

import copy
import io
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict

import gguf
import numpy as np
import torch

VOCAB = 512
SLIDING_WINDOW = 8
TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
         "q8_0": gguf.GGMLQuantizationType.Q8_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


@dataclass
class Family:
    name: str               # general.architecture
    make: Callable[[], torch.nn.Module]
    arch: gguf.MODEL_ARCH
    permute_qk: bool = False   # llama: Q/K rows permuted for adjacent-pair rope
    norm_plus_one: bool = False  # gemma: RMSNorm weights stored as 1 + w
    extra_kv: Callable[[object, gguf.GGUFWriter], None] = field(default=lambda cfg, w: None)


# Weights a little larger than HF's 0.02 default so attention and softcaps are not flat.
INIT = 0.08


def _seeded(build):
    def make():
        torch.manual_seed(0)
        m = build()
        # Norm weights away from their init (1 or 0) so a missed +1 or a skipped norm shows.
        with torch.no_grad():
            for n, p in m.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        return m.float().eval()
    return make


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
        initializer_range=INIT, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    m = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
        initializer_range=INIT, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))
    with torch.no_grad():  # HF initializes biases to zero: make them matter
        for layer in m.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return m


def _qwen2_yarn():
    """Qwen2 with YaRN (factor 4 over a 16-position original context): prompts run past it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 1e4},
        initializer_range=INIT, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        initializer_range=INIT, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    # head_dim is hidden/heads in Phi-3: 128/4 = 32. sliding_window None: llama.cpp ignores phi3 SWA.
    return Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=256,
        rms_norm_eps=1e-5, initializer_range=INIT, tie_word_embeddings=False, sliding_window=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager"))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # Softcaps low enough to bend these logits; query_pre_attn_scalar = head_dim as in every
    # gemma2 but 27B (GGUF has no key for it: llama.cpp derives it from the model size).
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=INIT, sliding_window=SLIDING_WINDOW, attn_logit_softcapping=1.0,
        final_logit_softcapping=1.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="eager"))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    # 7 layers: 0-4 sliding, 5 global, 6 sliding again. Linear rope scaling (factor 8) on the
    # global layers only, as Gemma-3 4B/12B/27B have it.
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=INIT, sliding_window=SLIDING_WINDOW,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager"))


def _gemma_27b_shape(build, n_layers):
    """The 27B models scale queries by (dim/heads)^-0.5, not head_dim^-0.5; no GGUF key says so:
    llama.cpp recognizes them by layer count (gemma2 46, gemma3 62). A tiny model of that depth."""
    def make():
        m = build()
        cfg = m.config
        cfg.num_hidden_layers = n_layers
        cfg.hidden_size, cfg.num_attention_heads = 128, 4  # dim/heads = 32 = head_dim: scale it
        cfg.head_dim, cfg.query_pre_attn_scalar = 64, 32    # unlike head_dim
        cfg.layer_types = None
        cfg.__post_init__() if hasattr(cfg, "__post_init__") else None
        return type(m)(cfg)
    return make


def _kv_llama(cfg, w):
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)


def _kv_phi3(cfg, w):
    w.add_rope_scaling_orig_ctx_len(cfg.rope_parameters.get("original_max_position_embeddings",
                                                            cfg.max_position_embeddings))
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_sliding_window(cfg.sliding_window or 0)


def _kv_gemma2(cfg, w):
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _kv_gemma3(cfg, w):
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


FAMILIES: Dict[str, Family] = {
    "llama": Family("llama", _seeded(_llama), gguf.MODEL_ARCH.LLAMA, permute_qk=True, extra_kv=_kv_llama),
    "qwen2": Family("qwen2", _seeded(_qwen2), gguf.MODEL_ARCH.QWEN2),
    "qwen2-yarn": Family("qwen2", _seeded(_qwen2_yarn), gguf.MODEL_ARCH.QWEN2),
    "qwen3": Family("qwen3", _seeded(_qwen3), gguf.MODEL_ARCH.QWEN3),
    "phi3": Family("phi3", _seeded(_phi3), gguf.MODEL_ARCH.PHI3, extra_kv=_kv_phi3),
    "gemma2": Family("gemma2", _seeded(_gemma2), gguf.MODEL_ARCH.GEMMA2, norm_plus_one=True, extra_kv=_kv_gemma2),
    "gemma3": Family("gemma3", _seeded(_gemma3), gguf.MODEL_ARCH.GEMMA3, norm_plus_one=True, extra_kv=_kv_gemma3),
    "gemma2-27b-shape": Family("gemma2", _seeded(_gemma_27b_shape(_gemma2, 46)), gguf.MODEL_ARCH.GEMMA2,
                               norm_plus_one=True, extra_kv=_kv_gemma2),
    "gemma3-27b-shape": Family("gemma3", _seeded(_gemma_27b_shape(_gemma3, 62)), gguf.MODEL_ARCH.GEMMA3,
                               norm_plus_one=True, extra_kv=_kv_gemma3),
}


def spm_model_proto() -> bytes:
    """A SentencePiece BPE vocabulary of VOCAB pieces (byte fallback), trained on seeded pseudo-words."""
    import sentencepiece as spm

    rng = random.Random(0)
    syll = ["ka", "to", "ri", "mu", "sen", "la", "po", "qui", "ver", "dan", "el", "or", "th", "ing", "an"]
    lines = [" ".join("".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(12))
             for _ in range(2000)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return buf.getvalue()


def _add_spm_vocab(w: gguf.GGUFWriter, proto: bytes):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i).encode())
        scores.append(sp.GetScore(i))
        t = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            t = gguf.TokenType.CONTROL
        elif sp.IsByte(i):
            t = gguf.TokenType.BYTE
        types.append(t)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: HF split-half rope rows -> adjacent pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_tensors(fam: Family, model):
    cfg = model.config
    tmap = gguf.get_tensor_name_map(fam.arch, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        data = t.detach().float()
        if fam.permute_qk and name.endswith("q_proj.weight"):
            data = permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        if fam.permute_qk and name.endswith("k_proj.weight"):
            data = permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if fam.norm_plus_one and name.endswith("norm.weight"):
            data = data + 1
        new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"{fam.name}: no GGUF name for {name}")
        yield new, data.numpy()


def write_gguf(fam: Family, model, path: str, ftype: str, spm_proto: bytes):
    cfg = model.config
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[fam.arch])
    w.add_name(f"tiny-random-{fam.name}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = rope.get("full_attention", rope).get("rope_theta")
    if theta is not None and fam.name != "gemma2":  # gemma2's converter writes no rope base
        w.add_rope_freq_base(theta)
    if rope.get("full_attention", rope).get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.get("full_attention", rope)["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if (local := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(local)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None and fam.name != "phi3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_file_type(FILE_TYPES[ftype])
    fam.extra_kv(cfg, w)
    _add_spm_vocab(w, spm_proto)
    qtype = TYPES[ftype]
    for name, data in _gguf_tensors(fam, model):
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def roundtrip(t: torch.Tensor, ftype: str) -> torch.Tensor:
    """The values a 2-D weight has once stored as ftype (1-D tensors are stored f32)."""
    if t.ndim == 1 or ftype == "f32":
        return t
    qt = TYPES[ftype]
    back = gguf.quants.dequantize(gguf.quants.quantize(t.detach().float().numpy(), qt), qt)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(t.shape)


def reference_model(model, ftype: str):
    """The HF model with every weight as the ftype GGUF stores it."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.copy_(roundtrip(p, ftype))
    return ref.eval()


def export_all(out_dir: str, families=None, types=None) -> Dict[str, Dict[str, str]]:
    """Writes OUT/<family>-<type>.gguf for every family and type; returns {family: {type: path}}."""
    os.makedirs(out_dir, exist_ok=True)
    proto = spm_model_proto()
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(proto)
    paths: Dict[str, Dict[str, str]] = {}
    for name in families or FAMILIES:
        fam = FAMILIES[name]
        model = fam.make()
        for ft in types or TYPES:
            p = os.path.join(out_dir, f"{name}-{ft}.gguf")
            write_gguf(fam, model, p, ft, proto)
            paths.setdefault(name, {})[ft] = p
    return paths


if __name__ == "__main__":
    for fam, by_type in export_all(sys.argv[1] if len(sys.argv) > 1 else "tiny-gguf").items():
        print(fam, " ".join(by_type.values()))
