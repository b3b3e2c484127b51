"""A tiny random Qwen3-ASR (transformers' Qwen3ASRForConditionalGeneration, fp32) turned into GGUF by
llama.cpp's own converter: the decoder (arch qwen3vl) and the mmproj (projector qwen3a).

The tokenizer is SmolLM2's (as moe.py), with Qwen3-ASR's audio and transcription markers added as
special tokens; the model's vocabulary is sized to it. The tower's conv kernels are rounded through
f16 in the reference model, as the converter stores them (tensor_force_quant).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import moe as M  # noqa: E402

MARKERS = ["<|audio_start|>", "<|audio_pad|>", "<|audio_end|>", "<asr_text>"]


def asr_tokenizer(tok):
    """A copy of tok with Qwen3-ASR's audio and transcription markers as special tokens."""
    t = copy.deepcopy(tok)
    t.add_special_tokens({"additional_special_tokens": MARKERS})
    return t


def model(tok, seed: int = 0, layers: int = 4):
    """Tower: 128 mel, 16 conv channels, width 48, 4 blocks, 4 heads, output 64 (the decoder's width)."""
    from transformers import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration

    ac = dict(num_mel_bins=128, encoder_layers=layers, encoder_attention_heads=4, encoder_ffn_dim=96, d_model=48,
              output_dim=64, n_window=50, n_window_infer=800, downsample_hidden_size=16)
    tc = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
              rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = Qwen3ASRConfig(audio_config=ac, text_config=tc, audio_token_id=tok.convert_tokens_to_ids("<|audio_pad|>"),
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = Qwen3ASRForConditionalGeneration(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:  # norms and biases away from 1 / 0 so a skipped one shows
                p.copy_((1.0 if "norm" in n and n.endswith("weight") else 0.0) + torch.randn_like(p) * 0.1)
            elif n.startswith("model.language_model.") and "embed" not in n:
                # 3x larger in the decoder's layers: with tied embeddings at the common scale the input
                # token's own row dominates and greedy repeats one token; this way it varies with the audio.
                p.copy_(torch.randn_like(p) * M.INIT * 3)
            else:
                p.copy_(torch.randn_like(p) * M.INIT)
        tw = m.model.audio_tower
        for conv in (tw.conv2d1, tw.conv2d2, tw.conv2d3, tw.conv_out):  # all stored f16
            conv.weight.copy_(conv.weight.half().float())
    return m.float().eval()


def features(samples: np.ndarray):
    """The processor's audio input for one clip (padding to the longest: the clip's own frames)."""
    from transformers import Qwen3ASRFeatureExtractor

    fe = Qwen3ASRFeatureExtractor()
    f = fe(samples, sampling_rate=16000, padding=True, return_attention_mask=True, return_tensors="pt")
    return f["input_features"], f["attention_mask"]


def tower_rows(m, samples: np.ndarray) -> np.ndarray:
    """get_audio_features on the processor's input: the projected rows the decoder splices."""
    x, mask = features(samples)
    with torch.no_grad():
        return m.get_audio_features(x, mask).pooler_output.numpy()


def save_original_layout(m, out_dir: str) -> None:
    """The tower in the layout of Qwen's own Qwen3-ASR release, which the converter's mmproj path reads
    (config under thinker_config, tensors under thinker.audio_tower, the projector as the tower's
    proj1 / proj2); transformers' -hf layout moves the projector out to multi_modal_projector."""
    import json

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = m.config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ASRForConditionalGeneration"], "model_type": "qwen3_asr",
                   "thinker_config": {"audio_config": cfg.audio_config.to_dict(),
                                      "text_config": cfg.text_config.to_dict()}}, f)
    t = {f"thinker.audio_tower.{k}": v.contiguous() for k, v in m.model.audio_tower.state_dict().items()
         if "positional_embedding" not in k}
    p = m.model.multi_modal_projector
    for i, lin in ((1, p.linear_1), (2, p.linear_2)):
        t[f"thinker.audio_tower.proj{i}.weight"] = lin.weight.detach().contiguous()
        t[f"thinker.audio_tower.proj{i}.bias"] = lin.bias.detach().contiguous()
    save_file(t, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def build(tok, out_dir: str, seed: int = 0):
    """(model, decoder GGUF, mmproj GGUF), both f32, written by the converter."""
    m = model(tok, seed)
    hf_dir = os.path.join(out_dir, "qwen3asr-hf")
    m.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    orig_dir = os.path.join(out_dir, "qwen3asr-orig")
    save_original_layout(m, orig_dir)
    src = M.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    outs = {}
    for kind, d, extra in (("decoder", hf_dir, []), ("mmproj", orig_dir, ["--mmproj"])):
        out = os.path.join(out_dir, f"qwen3asr-{kind}.gguf")
        r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), d, "--outfile", out,
                            "--outtype", "f32", *extra], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py {' '.join(extra)} failed on {hf_dir}:\n{r.stderr[-4000:]}")
        outs[kind] = out
    return m, outs["decoder"], outs["mmproj"]
