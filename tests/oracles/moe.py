"""Tiny random mixture-of-experts models (transformers, fp32) turned into GGUF by llama.cpp's own converter.

Unlike export.py (our exporter, mirroring the converter), these files come from
``convert_hf_to_gguf.py`` itself, with its vendored gguf-py, so the tensor layout of
the expert stacks, the metadata keys and the quantized types are what users' files
carry. The converter is taken from the llama-cpp-python sdist (pinned), fetched once
with pip into the hub cache. The tokenizer is SmolLM2's (pulled through the hub,
rebuilt by transformers from its GGUF): the converter needs a real one, and the
models' vocabulary is sized to it; gpt-oss's adds Harmony's control tokens and carries the real
gpt-oss chat template (shipped in llama.cpp's source as models/templates/openai-gpt-oss-120b.jinja).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch

LLAMA_CPP_PYTHON = "0.3.36"
# Weights a little larger than HF's 0.02 default (as export.py): routers that pick clearly,
# attention that is not flat.
INIT = 0.08


def llama_cpp_dir() -> Path:
    """vendor/llama.cpp of the pinned llama-cpp-python sdist (converter, conversion/, gguf-py)."""
    from dasllama import hub

    root = hub.home() / "llama.cpp-src"
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/openai-gpt-oss-120b.jinja",
            "tools/mtmd/test-1.jpeg")  # a real photo (vision tests)
    if all((src / k).exists() for k in keep):
        return src
    root.mkdir(parents=True, exist_ok=True)
    tgz = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tgz.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--no-build-isolation", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)],
                           capture_output=True, text=True)
        if r.returncode:  # (pip's own words: a missing build backend, no network)
            raise RuntimeError(f"pip download llama-cpp-python=={LLAMA_CPP_PYTHON} failed:\n{r.stderr[-3000:]}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(tgz) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(keep)]
        tf.extractall(root, members=members, filter="data")
    return src


@functools.lru_cache(maxsize=None)
def tokenizer(path_gguf: str):
    """transformers' tokenizer from the GGUF, built once a session (~7 s; several fixtures ask for
    SmolLM2's): shared, so callers copy it to change it (harmony_tokenizer, qwen3asr.asr_tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path_gguf), gguf_file=os.path.basename(path_gguf))


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def harmony_tokenizer(tok):
    """A copy of tok with Harmony's control tokens and gpt-oss's own chat template."""
    import copy

    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    t.chat_template = (llama_cpp_dir() / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    return t


def _seeded(model: torch.nn.Module) -> torch.nn.Module:
    # 1-D weights (norms, biases) away from their init so a skipped norm or bias shows.
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


def qwen3moe(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], max_position_embeddings=256, rms_norm_eps=1e-6,
                         initializer_range=INIT, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         attn_implementation="eager")
    return _seeded(Qwen3MoeForCausalLM(cfg))


def qwen2moe(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
                         rms_norm_eps=1e-6, initializer_range=INIT, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return _seeded(Qwen2MoeForCausalLM(cfg))


def gpt_oss(vocab: int) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    # Layer 0 sliding (window 8, crossed by the ~40-token prompts), layer 1 full; YaRN as the real
    # files have it (factor 32, no truncation), over a small original context so it bites.
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=2048,
                       rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64},
                       rms_norm_eps=1e-5, initializer_range=INIT, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    m = _seeded(GptOssForCausalLM(cfg))
    with torch.no_grad():  # sinks that take a real share of each softmax; gates past the clamp at 7
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.mlp.experts.gate_up_proj.mul_(12.0)
    return m


FAMILIES = {"qwen3moe": qwen3moe, "qwen2moe": qwen2moe, "gpt-oss": gpt_oss}

# ---- MXFP4 as gpt-oss checkpoints carry it: e2m1 values, a shared e8m0 exponent per 32 -----

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: np.ndarray):
    """Rows of w (last dim a multiple of 32) in OpenAI's checkpoint layout: blocks [..., n/32, 16]
    (element 2j in the low nibble of byte j, 2j+1 in the high), scales [..., n/32] (e8m0), and the
    values they decode to."""
    x = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(x).max(-1, keepdims=True)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).clip(-127, 127)
    y = x / np.exp2(e)
    idx = np.abs(y[..., None] - FP4[None, :8]).argmin(-1) + np.where(y < 0, 8, 0)
    idx = idx.astype(np.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    scales = (e[..., 0] + 127).astype(np.uint8)
    values = (FP4[idx] * np.exp2(e)).reshape(w.shape)
    return blocks, scales, values.astype(np.float32)


def save_gpt_oss_mxfp4(model, out_dir: str):
    """The model's experts as MXFP4 blocks/scales (quantization_config mxfp4, as openai/gpt-oss-*
    ship), every other tensor as it is; the model's own expert weights become the decoded values,
    so it is the reference for exactly what the file stores."""
    import json

    from safetensors.torch import save_file

    sd = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                w = p.detach().numpy().transpose(0, 2, 1)  # [E, out, in]: rows of the checkpoint
                blocks, scales, values = mxfp4_quantize(w)
                sd[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
                sd[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
                p.copy_(torch.from_numpy(values.transpose(0, 2, 1).copy()))
            else:
                sd[name] = p.detach().clone().contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def convert(hf_dir: str, out: str, outtype: str) -> str:
    """convert_hf_to_gguf.py on a saved HF model, with the converter's own gguf-py."""
    src = llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), hf_dir, "--outfile", out,
                        "--outtype", outtype], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stderr[-4000:]}")
    return out


def build(name: str, tok, out_dir: str, outtypes=("f32", "q8_0")):
    """The HF model and {outtype: gguf path} of a family, written under out_dir."""
    if name == "gpt-oss":
        tok = harmony_tokenizer(tok)
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    if name == "gpt-oss":
        save_gpt_oss_mxfp4(model, hf_dir)
    else:
        model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: convert(hf_dir, os.path.join(out_dir, f"{name}-{t}.gguf"), t) for t in outtypes}


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


# ---- network-free files for the device tests ---------------------------------------------------

def random_gguf(name: str, path: str, ftype: str = "q8_0", seed: int = 0) -> str:
    """A small random file of a family with the converter's names, shapes, keys and types (as the
    converter-made files above carry them; gpt-oss's experts MXFP4), written by gguf-py with
    export.py's 512-token SPM vocabulary: for the device tests, which compare a device with the
    CPU (itself held to transformers above) where neither PyPI nor the converter is reachable."""
    import gguf

    import export as E

    rng = np.random.default_rng(seed)
    D, H, KVH, hd, E_, k, F, V = 64, 4, 2, 16, 8, 2, 32, E.VOCAB
    arch = {"qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
            "gpt-oss": gguf.MODEL_ARCH.GPT_OSS}[name]
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E_)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(F)
    if name == "qwen2moe":
        w.add_expert_shared_feed_forward_length(64)
    if name == "gpt-oss":
        w.add_sliding_window(8)
        w.add_rope_freq_base(150000.0)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(64)
    else:
        w.add_rope_freq_base(1e6)
    E._add_spm_vocab(w, E.spm_model_proto())
    qt = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}[ftype]

    def mat(tname, *shape, scale=INIT, qtype=None):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        q = qtype if qtype is not None else qt
        if q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, a)
        else:
            w.add_tensor(tname, gguf.quants.quantize(a, q), raw_dtype=q)

    def vec(tname, *shape, base=0.0):
        w.add_tensor(tname, (base + rng.standard_normal(shape) * 0.1).astype(np.float32))

    mat("token_embd.weight", V, D, scale=1.0)
    vec("output_norm.weight", D, base=1.0)
    mat("output.weight", V, D)
    exps = gguf.GGMLQuantizationType.MXFP4 if name == "gpt-oss" else None
    for il in range(2):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", D, base=1.0)
        mat(b + "attn_q.weight", H * hd, D)
        mat(b + "attn_k.weight", KVH * hd, D)
        mat(b + "attn_v.weight", KVH * hd, D)
        mat(b + "attn_output.weight", D, H * hd)
        if name == "qwen3moe":
            vec(b + "attn_q_norm.weight", hd, base=1.0)
            vec(b + "attn_k_norm.weight", hd, base=1.0)
        if name != "qwen3moe":
            for t, n in (("attn_q", H * hd), ("attn_k", KVH * hd), ("attn_v", KVH * hd)):
                vec(b + t + ".bias", n)
        vec(b + ("post_attention_norm" if name == "gpt-oss" else "ffn_norm") + ".weight", D, base=1.0)
        mat(b + "ffn_gate_inp.weight", E_, D, scale=0.5, qtype=gguf.GGMLQuantizationType.F32)
        mat(b + "ffn_gate_exps.weight", E_, F, D, qtype=exps)
        mat(b + "ffn_up_exps.weight", E_, F, D, qtype=exps)
        mat(b + "ffn_down_exps.weight", E_, D, F, qtype=exps)
        if name == "qwen2moe":
            mat(b + "ffn_gate_inp_shexp.weight", 1, D, qtype=gguf.GGMLQuantizationType.F32)
            mat(b + "ffn_gate_shexp.weight", 64, D)
            mat(b + "ffn_up_shexp.weight", 64, D)
            mat(b + "ffn_down_shexp.weight", D, 64)
        if name == "gpt-oss":
            vec(b + "attn_output.bias", D)
            vec(b + "attn_sinks.weight", H)
            vec(b + "ffn_gate_inp.bias", E_)
            vec(b + "ffn_gate_exps.bias", E_, F)
            vec(b + "ffn_up_exps.bias", E_, F)
            vec(b + "ffn_down_exps.bias", E_, D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
