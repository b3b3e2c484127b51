"""Tiny random hybrid models (transformers, fp32) turned into GGUF by llama.cpp's own converter:
Qwen3.5 dense (gated-DeltaNet layers between output-gated full-attention layers).

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


FAMILIES = {"qwen35": qwen35}


def convert(hf_dir: str, out: str, outtype: str) -> str:
    src = M.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), hf_dir, "--outfile", out,
                        "--outtype", outtype, "--no-mtp"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stderr[-4000:]}")
    return out


def build(name: str, tok, out_dir: str, outtypes=("f32", "q8_0")):
    """The HF model and {outtype: gguf path} of a family, written under out_dir."""
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: convert(hf_dir, os.path.join(out_dir, f"{name}-{t}.gguf"), t) for t in outtypes}
