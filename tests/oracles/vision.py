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


# -- Qwen2.5-VL ------------------------------------------------------------------------------------------------

QWEN_SPECIALS = {500: "<|vision_start|>", 501: "<|vision_end|>", 502: "<|image_pad|>", 503: "<|im_start|>",
                 504: "<|im_end|>"}
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A small processor budget so a photo becomes a few dozen rows: 28 x 28 pixels per row.
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 40


def qwen25vl(seed: int = 0):
    """A seeded fp32 Qwen2_5_VLForConditionalGeneration: a 4-block window-attention ViT (blocks 1 and 3 full, the
    usual 112-pixel windows, so a photo of > 4 merged rows a side is cut into several), the patch merger,
    and a 2-layer decoder with M-RoPE sections [2, 3, 3] over its 8 rotary pairs."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        # depth >= 3: the converter maps the merger's mlp.2 through its block-number table
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3], hidden_act="silu"),
        image_token_id=502, video_token_id=505, vision_start_token_id=500, vision_end_token_id=501)
    torch.manual_seed(seed)
    m = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    for c in (m.config, m.config.text_config, m.config.vision_config):
        c._attn_implementation = "eager"
    return m.float().eval()


def convert_qwen25vl(model, out_dir: str):
    """(decoder GGUF, mmproj GGUF) of a Qwen2.5-VL model, both from llama.cpp's converter."""
    import audio

    hf = os.path.join(out_dir, "qwen25vl-hf")
    model.save_pretrained(hf)
    Path(hf, "tokenizer.model").write_bytes(audio.chat_vocab_proto(QWEN_SPECIALS))
    Path(hf, "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": QWEN_TEMPLATE}))
    Path(hf, "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": QWEN_MIN_PIXELS, "max_pixels": QWEN_MAX_PIXELS,
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    dec = _convert(hf, os.path.join(out_dir, "qwen25vl.gguf"))
    mm = _convert(hf, os.path.join(out_dir, "mmproj-qwen25vl.gguf"), "--mmproj")
    return dec, mm


def qwen_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)


# -- Qwen3-VL --------------------------------------------------------------------------------------------------

# Qwen3-VL's processor: 16-pixel patches merged 2 x 2 (32 pixels a row), mean = std = 0.5.
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 40


def qwen3vl(seed: int = 0):
    """A seeded fp32 Qwen3VLForConditionalGeneration: a 4-block ViT (learned 8 x 8 position grid, resampled
    to each image), deepstack mergers after blocks 1 and 2 (fed to decoder layers 0 and 1), the merger, and
    a 3-layer qwen3 decoder with interleaved M-RoPE sections [2, 3, 3] over its 8 rotary pairs."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[1, 2],
                           hidden_act="gelu_pytorch_tanh"),
        image_token_id=502, video_token_id=505, vision_start_token_id=500, vision_end_token_id=501)
    torch.manual_seed(seed)
    m = Qwen3VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    for c in (m.config, m.config.text_config, m.config.vision_config):
        c._attn_implementation = "eager"
    return m.float().eval()


def convert_qwen3vl(model, out_dir: str):
    """(decoder GGUF, mmproj GGUF) of a Qwen3-VL model, both from llama.cpp's converter."""
    import audio

    hf = os.path.join(out_dir, "qwen3vl-hf")
    model.save_pretrained(hf)
    Path(hf, "tokenizer.model").write_bytes(audio.chat_vocab_proto(QWEN_SPECIALS))
    Path(hf, "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": QWEN_TEMPLATE}))
    Path(hf, "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "size": {"shortest_edge": QWEN3_MIN_PIXELS, "longest_edge": QWEN3_MAX_PIXELS},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    dec = _convert(hf, os.path.join(out_dir, "qwen3vl.gguf"))
    mm = _convert(hf, os.path.join(out_dir, "mmproj-qwen3vl.gguf"), "--mmproj")
    return dec, mm


def qwen3_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS, patch_size=16,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
