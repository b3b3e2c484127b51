"""Tiny random hybrid models (transformers, fp32) turned into GGUF by llama.cpp's own converter:
Qwen3.5 dense (gated-DeltaNet layers between output-gated full-attention layers), Qwen3.5-MoE (the same
with Qwen3-Next's experts and gated shared expert, beta and alpha apart) and Qwen3-Next
(the same with a mixture of experts and a shared expert; its value heads stay grouped by key head
in the file, and beta / alpha come as one interleaved projection).

The converter runs with --no-mtp (a random model has no multi-token-prediction layers). The
linear-attention layers have twice as many value heads as key heads, so the converter's reorder
of value heads (grouped by key head in HF, tiled in the GGUF) is exercised.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

import moe as M

INIT = M.INIT


def qwen35(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=256,
                            rms_norm_eps=1e-6, initializer_range=INIT, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    return M._seeded(Qwen3_5ForCausalLM(cfg))


def qwen3next(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_conv_kernel_dim=4, full_attention_interval=2, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
                          initializer_range=INIT, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          attn_implementation="eager")
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    return M._seeded(Qwen3NextForCausalLM(cfg))


def qwen35moe(vocab: int) -> torch.nn.Module:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                               full_attention_interval=2, num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=64,
                               max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=INIT,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    return M._seeded(Qwen3_5MoeForCausalLM(cfg))


FAMILIES = {"qwen35": qwen35, "qwen3next": qwen3next, "qwen35moe": qwen35moe}


# transformers maps Qwen3.5-MoE configs to its Qwen3_5Tokenizer, which rebuilds the pre-tokenizer of
# the borrowed SmolLM2 tokenizer into one whose hash the converter does not know: the converter's
# pre-tokenizer check then reads the directory's own tokenizer.json (as it does for Qwen3.5 dense).
_OWN_TOKENIZER_JSON = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
import conversion.base as B
from transformers import PreTrainedTokenizerFast
orig = B.TextModel.get_vocab_base_pre
B.TextModel.get_vocab_base_pre = lambda self, tok: orig(
    self, PreTrainedTokenizerFast(tokenizer_file=str(self.dir_model / "tokenizer.json")))
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def convert(hf_dir: str, out: str, outtype: str, extra=("--no-mtp",), own_tokenizer_json: bool = False) -> str:
    src = M.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    head = ["-c", _OWN_TOKENIZER_JSON, str(src)] if own_tokenizer_json else [str(src / "convert_hf_to_gguf.py")]
    r = subprocess.run([sys.executable, *head, hf_dir, "--outfile", out,
                        "--outtype", outtype, *extra], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stderr[-4000:]}")
    return out


def build(name: str, tok, out_dir: str, outtypes=("f32", "q8_0")):
    """The HF model and {outtype: gguf path} of a family, written under out_dir."""
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: convert(hf_dir, os.path.join(out_dir, f"{name}-{t}.gguf"), t,
                              own_tokenizer_json=name == "qwen35moe") for t in outtypes}


# ---- network-free files for the device tests ---------------------------------------------------

def random_gguf(name: str, path: str, ftype: str = "q8_0", seed: int = 0) -> str:
    """A small random Qwen3.5 / Qwen3-Next file with the converter's names, shapes and keys (as the
    converter-made files above carry them; keys written by name, since an installed gguf-py may
    predate these families), with
    export.py's 512-token SPM vocabulary: for the device tests, which compare a device with the CPU
    (itself held to transformers above) where neither PyPI nor the converter is reachable."""
    import gguf
    import numpy as np

    import export as E

    assert name in FAMILIES
    moe = name != "qwen35"  # experts and a shared expert
    ba = name == "qwen3next"  # beta and alpha as one ssm_ba
    rng = np.random.default_rng(seed)
    D, H, KVH, hd, F, V = 64, 4, 2, 16, 128, E.VOCAB
    nk, nv, dk, dv, K = 2, 4, 16, 16, 4
    C = 2 * nk * dk + nv * dv
    rec = [True, False, True, False]
    w = gguf.GGUFWriter(path, name)
    a = name + "."
    w.add_uint32(a + "block_count", len(rec))
    w.add_uint32(a + "context_length", 256)
    w.add_uint32(a + "embedding_length", D)
    w.add_uint32(a + "feed_forward_length", F)
    w.add_uint32(a + "attention.head_count", H)
    w.add_uint32(a + "attention.head_count_kv", KVH)
    w.add_uint32(a + "attention.key_length", hd)
    w.add_uint32(a + "attention.value_length", hd)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(a + "rope.freq_base", 10000.0)
    w.add_uint32(a + "rope.dimension_count", hd // 4)
    w.add_array(a + "rope.dimension_sections", [11, 11, 10, 0])
    w.add_uint32(a + "ssm.conv_kernel", K)
    w.add_uint32(a + "ssm.state_size", dk)
    w.add_uint32(a + "ssm.group_count", nk)
    w.add_uint32(a + "ssm.time_step_rank", nv)
    w.add_uint32(a + "ssm.inner_size", nv * dv)
    w.add_array(a + "attention.recurrent_layers", rec)
    w.add_uint32(a + "full_attention_interval", 4)
    if moe:
        w.add_uint32(a + "expert_count", 8)
        w.add_uint32(a + "expert_used_count", 2)
        w.add_uint32(a + "expert_feed_forward_length", 32)
        w.add_uint32(a + "expert_shared_feed_forward_length", 64)
    E._add_spm_vocab(w, E.spm_model_proto())
    qt = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}[ftype]

    def mat(tname, *shape, scale=INIT):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, x)
        else:
            w.add_tensor(tname, gguf.quants.quantize(x, qt), raw_dtype=qt)

    def vec(tname, *shape, base=0.0, scale=0.1):
        w.add_tensor(tname, (base + rng.standard_normal(shape) * scale).astype(np.float32))

    mat("token_embd.weight", V, D, scale=1.0)
    vec("output_norm.weight", D, base=1.0)
    mat("output.weight", V, D)
    for il, r in enumerate(rec):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", D, base=1.0)
        vec(b + "post_attention_norm.weight", D, base=1.0)
        if r:
            mat(b + "attn_qkv.weight", C, D)
            mat(b + "attn_gate.weight", nv * dv, D)
            if ba:
                mat(b + "ssm_ba.weight", 2 * nv, D)
            else:
                mat(b + "ssm_alpha.weight", nv, D)
                mat(b + "ssm_beta.weight", nv, D)
            mat(b + "ssm_out.weight", D, nv * dv)
            vec(b + "ssm_conv1d.weight", C, K, scale=0.5)
            w.add_tensor(b + "ssm_a", -rng.uniform(0.1, 4, nv).astype(np.float32))
            vec(b + "ssm_dt.bias", nv, base=1.0)
            vec(b + "ssm_norm.weight", dv, base=1.0)
        else:
            mat(b + "attn_q.weight", 2 * H * hd, D)
            mat(b + "attn_k.weight", KVH * hd, D)
            mat(b + "attn_v.weight", KVH * hd, D)
            mat(b + "attn_output.weight", D, H * hd)
            vec(b + "attn_q_norm.weight", hd, base=1.0)
            vec(b + "attn_k_norm.weight", hd, base=1.0)
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((8, D)) * 0.5).astype(np.float32))
            w.add_tensor(b + "ffn_gate_inp_shexp.weight", (rng.standard_normal((1, D)) * INIT).astype(np.float32))
            mat(b + "ffn_gate_exps.weight", 8, 32, D)
            mat(b + "ffn_up_exps.weight", 8, 32, D)
            mat(b + "ffn_down_exps.weight", 8, D, 32)
            mat(b + "ffn_gate_shexp.weight", 64, D)
            mat(b + "ffn_up_shexp.weight", 64, D)
            mat(b + "ffn_down_shexp.weight", D, 64)
        else:
            mat(b + "ffn_gate.weight", F, D)
            mat(b + "ffn_up.weight", F, D)
            mat(b + "ffn_down.weight", D, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
