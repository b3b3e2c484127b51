"""Tiny random vision models (transformers, fp32) turned into GGUF by llama.cpp's own converter.

``gemma3()`` builds a seeded Gemma3ForConditionalGeneration (SigLIP tower, pooled projector,
Gemma-3 decoder) small enough to run in a second; ``convert_gemma3`` saves it and runs
``convert_hf_to_gguf.py`` twice (the decoder, then ``--mmproj``), so both files are what users'
files carry. The vocabulary is export.py's SentencePiece BPE with Gemma-3's image and turn
specials as control pieces, and the chat template a short Gemma-style one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
import moe  # noqa: E402  (llama_cpp_dir: the pinned converter)

GEMMA_SPECIALS = {500: "<start_of_image>", 501: "<end_of_image>", 502: "<image_soft_token>",
                  503: "<start_of_turn>", 504: "<end_of_turn>"}
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
IMAGE_SIZE, PATCH, TOKENS = 32, 4, 16  # an 8x8 patch grid pooled 2x2 -> 16 rows


def gemma3(seed: int = 0, sliding_window: int = 512):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         query_pre_attn_scalar=16,  # = head_dim, as the released models (llama.cpp assumes it)
                         # five sliding layers, then a global one: the pattern llama.cpp assumes for gemma3
                         layer_types=["sliding_attention"] * 5 + ["full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE_SIZE, patch_size=PATCH, layer_norm_eps=1e-6,
                           vision_use_head=False),
        mm_tokens_per_image=TOKENS, boi_token_index=500, eoi_token_index=501, image_token_index=502)
    torch.manual_seed(seed)
    m = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1 or "mm_input_projection" in name:
                p.add_(torch.randn_like(p) * 0.1)  # norms and biases away from their init
            elif p.ndim >= 2:
                p.normal_(0, 0.08)
    m.config.text_config._attn_implementation = "eager"
    m.config.vision_config._attn_implementation = "eager"
    m.config._attn_implementation = "eager"
    return m.float().eval()


def _vocab_proto() -> bytes:
    import audio

    return audio.chat_vocab_proto(GEMMA_SPECIALS)


def save_hf(model, out_dir: str) -> str:
    """The checkpoint as Google's Gemma-3 releases lay it out (vision_tower.vision_model.*; transformers 5
    saves vision_tower.* directly, which the converter does not map), with tokenizer and processor files."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(out_dir)
    st = os.path.join(out_dir, "model.safetensors")
    sd = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
          for k, v in load_file(st).items()}
    save_file(sd, st, metadata={"format": "pt"})
    Path(out_dir, "tokenizer.model").write_bytes(_vocab_proto())
    Path(out_dir, "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": GEMMA_TEMPLATE}))
    Path(out_dir, "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_seq_length": TOKENS,
        "do_resize": True, "do_rescale": True, "do_normalize": True, "resample": 2, "rescale_factor": 1 / 255}))
    return out_dir


def _convert(hf_dir: str, out: str, *extra: str) -> str:
    src = moe.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), hf_dir, "--outfile", out,
                        "--outtype", "f32", *extra], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {' '.join(extra)} failed on {hf_dir}:\n{r.stderr[-4000:]}")
    return out


def convert_gemma3(model, out_dir: str):
    """(decoder GGUF, mmproj GGUF) of ``model``, both from llama.cpp's converter."""
    hf = save_hf(model, os.path.join(out_dir, "gemma3v-hf"))
    dec = _convert(hf, os.path.join(out_dir, "gemma3v.gguf"))
    mm = _convert(hf, os.path.join(out_dir, "mmproj-gemma3v.gguf"), "--mmproj")
    return dec, mm


def image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
