"""Tiny random mixture-of-experts models (transformers, fp32) turned into GGUF by llama.cpp's own converter.

Unlike export.py (our exporter, mirroring the converter), these files come from
``convert_hf_to_gguf.py`` itself, with its vendored gguf-py, so the tensor layout of
the expert stacks, the metadata keys and the quantized types are what users' files
carry. The converter is taken from the llama-cpp-python sdist (pinned), fetched once
with pip into the hub cache. The tokenizer is SmolLM2's (pulled through the hub,
rebuilt by transformers from its GGUF): the converter needs a real one, and the
models' vocabulary is sized to it.
"""
from __future__ import annotations

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
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    tgz = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not tgz.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(root)],
                       check=True, capture_output=True)
    keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(tgz) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(keep)]
        tf.extractall(root, members=members, filter="data")
    return src


def tokenizer(path_gguf: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path_gguf), gguf_file=os.path.basename(path_gguf))


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


FAMILIES = {"qwen3moe": qwen3moe, "qwen2moe": qwen2moe}


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
    model = FAMILIES[name](len(tok))
    hf_dir = os.path.join(out_dir, name + "-hf")
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return model, {t: convert(hf_dir, os.path.join(out_dir, f"{name}-{t}.gguf"), t) for t in outtypes}


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()
