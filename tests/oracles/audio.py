"""Tiny random audio towers (transformers, fp32) and their mmproj GGUFs in llama.cpp's layout.

``write_mmproj`` mirrors llama.cpp's ``convert_hf_to_gguf.py --mmproj`` for whisper-class
towers (conversion/ultravox.py, qwenvl.py, base.py MmprojModel): general.architecture
"clip", the clip.* / clip.audio.* keys, tensors renamed through gguf-py's map
(audio_tower.* -> a.*, multi_modal_projector.* -> mm.a.*), conv biases unsqueezed to
[dim, 1], conv kernels stored as f16 even in an f32 file, everything else f32.
The reference models then get their conv kernels rounded through f16 too, so both
sides compute with the weights as stored. Checked once by hand against the converter of
llama.cpp's source (llama-cpp-python 0.3.36 sdist, ``--mmproj --outtype f32``) on the tiny
Qwen2-Audio and Voxtral below: identical tensor names, shapes, types and bytes, and
identical clip.* keys.

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
    return m.float().eval()


def _round_convs_f16(tower: torch.nn.Module) -> None:
    with torch.no_grad():
        for conv in (tower.conv1, tower.conv2):
            conv.weight.copy_(conv.weight.half().float())


def qwen2_audio(seed: int = 0, n_mel: int = 128):
    """A tiny Qwen2AudioForConditionalGeneration: tower width 48, 3 blocks, decoder width 64.

    Three blocks, not two: llama.cpp's converter maps conv{N} names through its per-block
    table, so a tower with fewer than 3 blocks cannot name conv2."""
    from transformers import (Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2AudioForConditionalGeneration,
                              Qwen2Config)
    ac = Qwen2AudioEncoderConfig(num_mel_bins=n_mel, encoder_layers=3, encoder_attention_heads=4,
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


def _features(samples, n_mel, max_length=30 * 16000):
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=n_mel)
    return fe(samples, sampling_rate=16000, padding="max_length", max_length=max_length, truncation=False,
              return_tensors="pt")["input_features"]


def qwen2_audio_full_window_rows(model, samples: np.ndarray) -> np.ndarray:
    """llama.cpp's convention: the whole 30 s window encoded unmasked (750 rows)."""
    with torch.no_grad():
        h = model.model.audio_tower(_features(samples, model.config.audio_config.num_mel_bins)).last_hidden_state
        return model.model.multi_modal_projector(h)[0].numpy()


def voxtral(seed: int = 0):
    """A tiny VoxtralForConditionalGeneration: tower width 48 (FFN 192 = 4 x 48, so stack 4), decoder 64."""
    from transformers import LlamaConfig, VoxtralConfig, VoxtralEncoderConfig, VoxtralForConditionalGeneration
    ac = VoxtralEncoderConfig(hidden_size=48, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                              num_mel_bins=128, max_source_positions=1500)
    tc = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2)
    cfg = VoxtralConfig(audio_config=ac.to_dict(), text_config=tc.to_dict(), audio_token_id=AUDIO_TOKEN)
    cfg._attn_implementation = "eager"
    m = _randomize(VoxtralForConditionalGeneration(cfg), seed)
    _round_convs_f16(m.model.audio_tower)
    return m


def voxtral_rows(model, samples: np.ndarray) -> np.ndarray:
    """Voxtral's get_audio_features on its processor's input: the clip padded to whole 30 s windows."""
    n_chunks = max(1, -(-len(samples) // (30 * 16000)))
    feats = _features(samples, 128, n_chunks * 30 * 16000)
    feats = feats.reshape(128, n_chunks, 3000).permute(1, 0, 2)  # the processor's chunks as a batch
    with torch.no_grad():
        return model.get_audio_features(feats).pooler_output.numpy()


def write_voxtral(model, path):
    p = model.model.multi_modal_projector
    proj = {"mm.a.mlp.1.weight": p.linear_1.weight.detach().numpy(),
            "mm.a.mlp.2.weight": p.linear_2.weight.detach().numpy()}
    return write_mmproj(path, model.model.audio_tower, proj, "voxtral", None, p.linear_2.weight.shape[0], stack=4)


def whisper_encoder(seed: int = 0, n_mel: int = 80):
    """A tiny transformers WhisperEncoder (width 48, 3 blocks, 4 heads)."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    cfg = WhisperConfig(num_mel_bins=n_mel, d_model=48, encoder_layers=3, encoder_attention_heads=4,
                        encoder_ffn_dim=96, max_source_positions=1500)
    cfg._attn_implementation = "eager"
    enc = _randomize(WhisperEncoder(cfg), seed)
    _round_convs_f16(enc)
    return enc


def whisper_rows(enc, samples: np.ndarray) -> np.ndarray:
    """The encoder's rows over each whole 30 s window of the clip."""
    n_chunks = max(1, -(-len(samples) // (30 * 16000)))
    feats = _features(samples, enc.config.num_mel_bins, n_chunks * 30 * 16000)
    feats = feats.reshape(enc.config.num_mel_bins, n_chunks, 3000).permute(1, 0, 2)
    with torch.no_grad():
        return enc(feats).last_hidden_state.reshape(-1, enc.config.d_model).numpy()


def write_whisper(enc, path):
    return write_mmproj(path, enc, {}, "whisper", None, enc.config.d_model)


class UltravoxProjector(torch.nn.Module):
    """Ultravox v0.5's projector as its model code defines it (StackAudioFrames, RMSNorm,
    Linear, SwiGLU with the gate in the second half, RMSNorm, Linear; no biases), built
    from transformers' LlamaRMSNorm (eps 1e-6)."""

    def __init__(self, d_in, stack, hidden, d_out, seed):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        super().__init__()
        self.stack = stack
        self.ln_pre = LlamaRMSNorm(d_in * stack, eps=1e-6)
        self.linear_1 = torch.nn.Linear(d_in * stack, 2 * hidden, bias=False)
        self.ln_mid = LlamaRMSNorm(hidden, eps=1e-6)
        self.linear_2 = torch.nn.Linear(hidden, d_out, bias=False)
        _randomize(self, seed)

    def forward(self, x):  # x: [T, d_in]
        pad = (-x.shape[0]) % self.stack
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(-1, x.shape[1] * self.stack)
        x = self.linear_1(self.ln_pre(x))
        h, gate = x.chunk(2, dim=-1)
        return self.linear_2(self.ln_mid(torch.nn.functional.silu(gate) * h))


def ultravox(seed: int = 0):
    """A whisper encoder (80 mel) and an ultravox projector (stack 8, hidden 80, out 64)."""
    return whisper_encoder(seed, 80), UltravoxProjector(48, 8, 80, 64, seed + 1)


def ultravox_rows(pair, samples: np.ndarray) -> np.ndarray:
    enc, proj = pair
    rows = whisper_rows(enc, samples)
    out = []
    with torch.no_grad():
        for c in range(rows.shape[0] // 1500):
            out.append(proj(torch.from_numpy(rows[c * 1500:(c + 1) * 1500])).numpy())
    return np.concatenate(out)


def write_ultravox(pair, path):
    enc, p = pair
    proj = {"mm.a.norm_pre.weight": p.ln_pre.weight.detach().numpy(),
            "mm.a.mlp.1.weight": p.linear_1.weight.detach().numpy(),
            "mm.a.norm_mid.weight": p.ln_mid.weight.detach().numpy(),
            "mm.a.mlp.2.weight": p.linear_2.weight.detach().numpy()}
    return write_mmproj(path, enc, proj, "ultravox", None, 64, stack=8)


def qwen25_omni_audio(seed: int = 0):
    """A tiny Qwen2.5-Omni audio tower (transformers' Qwen2_5OmniAudioEncoder): width 48,
    3 blocks, output 64, the released n_window of 100 (200-frame chunks)."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
    cfg = Qwen2_5OmniAudioEncoderConfig(num_mel_bins=128, encoder_layers=3, encoder_attention_heads=4,
                                        encoder_ffn_dim=96, d_model=48, output_dim=64, n_window=100,
                                        max_source_positions=1500)
    cfg._attn_implementation = "eager"
    enc = _randomize(Qwen2_5OmniAudioEncoder(cfg), seed)
    _round_convs_f16(enc)
    return enc


def qwen25_omni_rows(enc, samples: np.ndarray) -> np.ndarray:
    """The tower on the clip's own frames, as Qwen2.5-Omni's get_audio_features feeds it
    (its processor's 30 s padded features, then only the frames the mask keeps)."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128)
    n_max = max(30 * 16000, len(samples))
    f = fe(samples, sampling_rate=16000, return_attention_mask=True, padding="max_length", max_length=n_max,
           truncation=False, return_tensors="pt")
    n = int(f["attention_mask"].sum())
    with torch.no_grad():
        return enc(f["input_features"][0, :, :n], feature_lens=torch.tensor([n])).last_hidden_state.numpy()


def write_qwen25_omni(enc, path):
    # The converter writes the sinusoid table (its formula is the module's buffer) as positions.
    pos = {"a.position_embd.weight": enc.positional_embedding.positional_embedding.detach().float().numpy()}
    return write_mmproj(path, enc, pos, "qwen2.5o", None, enc.config.output_dim)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    write_qwen2_audio(qwen2_audio(), os.path.join(out, "mmproj-qwen2a-tiny.gguf"))
    write_voxtral(voxtral(), os.path.join(out, "mmproj-voxtral-tiny.gguf"))
    write_ultravox(ultravox(), os.path.join(out, "mmproj-ultravox-tiny.gguf"))
    write_whisper(whisper_encoder(), os.path.join(out, "mmproj-whisper-tiny.gguf"))
    write_qwen25_omni(qwen25_omni_audio(), os.path.join(out, "mmproj-qwen2.5o-tiny.gguf"))


# -- the decoder side: the tiny model's language model as a qwen2 GGUF ------------------------------------

# Chat specials put at the top of the tiny SentencePiece vocabulary (replacing pieces the pseudo-word
# text never reaches), with <|AUDIO|> at AUDIO_TOKEN where the transformers model splices its rows.
SPECIALS = {500: "<|AUDIO|>", 501: "<|audio_bos|>", 502: "<|audio_eos|>", 503: "<|im_start|>",
            504: "<|im_end|>", 505: "[BEGIN_AUDIO]"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


VOXTRAL_SPECIALS = {**SPECIALS, 506: "[INST]", 507: "[/INST]"}
VOXTRAL_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
                    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


def chat_vocab_proto(specials=None) -> bytes:
    """export.py's SentencePiece vocabulary with ``specials`` (default SPECIALS) as control pieces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    sys.path.insert(0, os.path.dirname(__file__))
    import export

    mp = pb.ModelProto()
    mp.ParseFromString(export.spm_model_proto())
    for i, text in (specials or SPECIALS).items():
        mp.pieces[i].piece = text
        mp.pieces[i].type = pb.ModelProto.SentencePiece.CONTROL
        mp.pieces[i].score = 0.0
    return mp.SerializeToString()


def language_model(model):
    """The audio model's decoder as a Qwen2ForCausalLM / LlamaForCausalLM sharing its weights."""
    import copy

    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    tc = copy.deepcopy(model.config.text_config)
    tc._attn_implementation = "eager"
    tc.max_position_embeddings = 32768  # room for a ten-minute clip (15000 rows); plain rope ignores it
    lm = (Qwen2ForCausalLM if tc.model_type == "qwen2" else LlamaForCausalLM)(tc)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    return lm.float().eval()


def write_decoder(model, path, template: str = CHATML, specials=None):
    """The audio model's decoder as an f32 GGUF (qwen2, or llama for Voxtral) with the chat vocabulary
    (``specials`` as control pieces) and ``template``."""
    sys.path.insert(0, os.path.dirname(__file__))
    import export

    lm = language_model(model)
    llama = lm.config.model_type != "qwen2"
    fam = export.Family("llama" if llama else "qwen2", lambda: None,
                        gguf.MODEL_ARCH.LLAMA if llama else gguf.MODEL_ARCH.QWEN2, permute_qk=llama,
                        extra_kv=lambda cfg, w: w.add_chat_template(template))
    export.write_gguf(fam, lm, str(path), "f32", chat_vocab_proto(specials))
    return path
