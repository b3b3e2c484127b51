"""Tiny random audio towers (transformers, fp32) and their mmproj GGUFs in llama.cpp's layout.

``write_mmproj`` mirrors llama.cpp's ``convert_hf_to_gguf.py --mmproj`` for whisper-class
towers (conversion/ultravox.py, qwenvl.py, base.py MmprojModel): general.architecture
"clip", the clip.* / clip.audio.* keys, tensors renamed through gguf-py's map
(audio_tower.* -> a.*, multi_modal_projector.* -> mm.a.*), conv biases unsqueezed to
[dim, 1], conv kernels stored as f16 even in an f32 file, everything else f32.
The reference models then get their conv kernels rounded through f16 too, so both
sides compute with the weights as stored.

Run as ``python tests/oracles/audio.py OUTDIR`` to write every file.
"""
from __future__ import annotations

import os
import sys

import gguf
import numpy as np
import torch

INIT = 0.08
AUDIO_TOKEN = 500


def _randomize(m: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:  # norms and biases away from 1 / 0 so a skipped one shows
                p.copy_((1.0 if "norm" in n and n.endswith("weight") else 0.0) + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * INIT)
        for n, b in m.named_buffers():
            pass
    return m.float().eval()


def _round_convs_f16(tower: torch.nn.Module) -> None:
    with torch.no_grad():
        for conv in (tower.conv1, tower.conv2):
            conv.weight.copy_(conv.weight.half().float())


def qwen2_audio(seed: int = 0, n_mel: int = 128):
    """A tiny Qwen2AudioForConditionalGeneration: tower width 48, 2 blocks, decoder width 64."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2Config)
    ac = Qwen2AudioEncoderConfig(num_mel_bins=n_mel, encoder_layers=2, encoder_attention_heads=4,
                                 encoder_ffn_dim=96, d_model=48, max_source_positions=1500)
    tc = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                     bos_token_id=1, eos_token_id=2)
    cfg = Qwen2AudioConfig(audio_config=ac.to_dict(), text_config=tc.to_dict(), audio_token_id=AUDIO_TOKEN)
    cfg._attn_implementation = "eager"
    m = _randomize(Qwen2AudioForConditionalGeneration(cfg), seed)
    _round_convs_f16(m.model.audio_tower)
    return m


def qwen2_audio_rows(model, samples: np.ndarray) -> np.ndarray:
    """The projected audio rows transformers' own forward splices for ``samples``.

    Its feature extractor builds the input (padded to 30 s, with the frame mask the
    Qwen2-Audio processor passes); the processor's token count comes from the mask;
    the model runs its full forward and we keep what its projector produced for the
    clip's rows (a hook, so the masking is transformers' code, not ours).
    """
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=model.config.audio_config.num_mel_bins)
    feats = fe(samples, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    mask = feats["attention_mask"]
    n = int(mask.sum())
    n_tok = (((n - 1) // 2 + 1) - 2) // 2 + 1  # Qwen2AudioProcessor's count
    got = {}
    h = model.model.multi_modal_projector.register_forward_hook(lambda mod, i, o: got.setdefault("rows", o))
    ids = torch.tensor([[3] + [AUDIO_TOKEN] * n_tok + [4, 5]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats["input_features"],
              feature_attention_mask=mask)
    h.remove()
    return got["rows"][0, :n_tok].numpy()


_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out", "self_attn_layer_norm": "ln1", "final_layer_norm": "ln2",
    "fc1": "ffn_up", "fc2": "ffn_down",
}


def tower_tensors(tower: torch.nn.Module):
    """(name, array) pairs of a whisper encoder in llama.cpp's a.* names."""
    for name, t in tower.state_dict().items():
        x = t.detach().float().numpy()
        if name.startswith("layers."):
            _, il, rest = name.split(".", 2)
            mod, suffix = rest.rsplit(".", 1)
            yield f"a.blk.{il}.{_BLOCK[mod]}.{suffix}", x
        elif name.startswith(("conv1.", "conv2.")):
            mod, suffix = name.split(".")
            if suffix == "bias":
                x = x[:, None]  # the converter's unsqueeze(-1): ggml shape [1, dim]
            else:
                x = x.astype(np.float16)
            yield f"a.conv1d.{mod[-1]}.{suffix}", x
        elif name == "embed_positions.weight":
            yield "a.position_embd.weight", x
        elif name.startswith(("layer_norm.", "ln_post.")):
            yield "a.post_ln." + name.split(".")[-1], x
        elif name.startswith("proj."):  # qwen2.5-omni's in-tower projector
            yield "mm.a.fc." + name.split(".")[-1], x
        # avg_pooler has no parameters; audio_bos_eos_token is unused (as the converter skips it)


def write_mmproj(path, tower, projector: dict, proj_type: str, n_heads: int, proj_dim: int,
                 eps: float = 1e-5, stack: int | None = None, extra=()):
    """Writes ``tower`` (a whisper-class encoder module) plus ``projector`` ({gguf name: array})."""
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_bool("clip.has_vision_encoder", False)
    w.add_bool("clip.has_audio_encoder", True)
    w.add_string("clip.projector_type", proj_type)
    cfg = tower.config
    w.add_uint32("clip.audio.projection_dim", proj_dim)
    w.add_uint32("clip.audio.embedding_length", cfg.d_model)
    w.add_uint32("clip.audio.feed_forward_length", cfg.encoder_ffn_dim)
    w.add_uint32("clip.audio.block_count", cfg.encoder_layers)
    w.add_uint32("clip.audio.attention.head_count", cfg.encoder_attention_heads if n_heads is None else n_heads)
    w.add_uint32("clip.audio.num_mel_bins", cfg.num_mel_bins)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", eps)
    if stack is not None:
        w.add_uint32("clip.audio.projector.stack_factor", stack)
    for k, v in extra:
        w.add_key_value(k, v[0], v[1])
    for name, x in list(tower_tensors(tower)) + list(projector.items()):
        w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return path


def write_qwen2_audio(model, path):
    p = model.model.multi_modal_projector.linear
    proj = {"mm.a.fc.weight": p.weight.detach().numpy(), "mm.a.fc.bias": p.bias.detach().numpy()}
    return write_mmproj(path, model.model.audio_tower, proj, "qwen2a", None, p.weight.shape[0])


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    write_qwen2_audio(qwen2_audio(), os.path.join(out, "mmproj-qwen2a-tiny.gguf"))
