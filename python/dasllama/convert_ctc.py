"""FastConformer CTC models (NVIDIA's Parakeet CTC, as transformers' ``ParakeetForCTC`` saves
them) -> one GGUF for speech recognition. llama.cpp's converter has no layout for this model (its
``parakeet`` projector is Nemotron's speech tower, not the CTC model), so the file is ours,
written with gguf-py's ``GGUFWriter``:

- ``general.architecture = fastconformer_ctc`` and ``fastconformer_ctc.*`` hyperparameters:
  ``embedding_length``, ``block_count``, ``attention.head_count``, ``feed_forward_length``,
  ``conv_kernel_size``, ``subsampling.channels``, ``subsampling.conv_count`` (stride-2 convs),
  ``num_mel_bins``, ``input_scale`` (sqrt(d) when the config scales the stem's rows),
  ``activation`` (``hidden_act``), ``layer_norm_epsilon``, ``blank_id`` (the pad token);
- ``sub.conv.{k}`` (3x3 stride-2 convs; each depthwise + pointwise pair after the first conv
  folded into one dense conv), ``sub.out`` (the linear);
- per block ``ffn1_*`` / ``ffn2_*`` (norm, up, down), ``attn_norm``, ``attn_{q,k,v,out}``,
  ``attn_bias_u`` / ``attn_bias_v``, ``attn_pos`` (``relative_k_proj`` per head as [d] rows of
  head_dim, its sinusoid pairs turned from (sin, cos) to (cos, -sin): see cpp/audio/conformer.h),
  ``conv_norm``, ``conv_pw1``, ``conv_dw`` (batch norm folded in), ``conv_pw2``, ``out_norm``;
- ``ctc`` (the head), and ``tokenizer.ggml.tokens`` / ``token_type`` (3: special).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Tuple, Union

import numpy as np

from ._core import DasllamaError

PathLike = Union[str, "os.PathLike[str]"]
ARCH = "fastconformer_ctc"
BN_EPS = 1e-5  # torch's BatchNorm1d default, which ParakeetEncoderConvolutionModule keeps


def _tokens(d: Path, vocab: int, blank: int) -> Tuple[List[str], List[int]]:
    """(pieces by id, token types) from tokenizer.json; ids the tokenizer lacks (the blank) get names."""
    tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    model = tj.get("model", {})
    v = model.get("vocab", [])
    pieces = {i: p[0] for i, p in enumerate(v)} if isinstance(v, list) else {i: t for t, i in v.items()}
    special = set()
    for a in tj.get("added_tokens", []):
        pieces[int(a["id"])] = a["content"]
        if a.get("special"):
            special.add(int(a["id"]))
    tokens = [pieces.get(i, "<blank>" if i == blank else f"<unused{i}>") for i in range(vocab)]
    types = [3 if i in special or i == blank or i not in pieces else 1 for i in range(vocab)]
    return tokens, types


def convert_hf_parakeet_ctc(src: PathLike, dst: PathLike, progress: bool = True, outtype: str = "f32") -> Path:
    """Write ``dst`` from a transformers ``ParakeetForCTC`` directory (config.json,
    model.safetensors, tokenizer.json). ``outtype`` f32 or f16 (the matrices; vectors and the
    folded depthwise kernels stay f32)."""
    import gguf
    from safetensors.numpy import load_file

    from .convert import _finish, _progress

    d = Path(src)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d}: no {name} (a transformers ParakeetForCTC directory)")
    if outtype not in ("f32", "f16"):
        raise ValueError(f"outtype must be f32 or f16, not {outtype!r}")
    cfg = json.loads((d / "config.json").read_text())
    if "encoder_config" not in cfg or "ctc_head.weight" not in (sd := load_file(str(d / "model.safetensors"))):
        raise DasllamaError(f"{d}: not a CTC model with an encoder_config and a ctc_head")
    ec = cfg["encoder_config"]
    sd = {k.removeprefix("model."): a.astype(np.float32) for k, a in sd.items() if not k.endswith("num_batches_tracked")}
    D, H = int(ec["hidden_size"]), int(ec["num_attention_heads"])
    hd = D // H
    if int(ec.get("subsampling_conv_kernel_size", 3)) != 3 or int(ec.get("subsampling_conv_stride", 2)) != 2:
        raise DasllamaError(f"{d}: only 3x3 stride-2 subsampling convs are served")
    mt = np.float16 if outtype == "f16" else np.float32

    def mat(a):
        return a.astype(mt)

    # The stem: conv layers in module order (layer 0 from one channel, then depthwise + pointwise pairs).
    sub = sorted({int(k.split(".")[3]) for k in sd if k.startswith("encoder.subsampling.layers.")})
    conv = [(sd[f"encoder.subsampling.layers.{i}.weight"], sd[f"encoder.subsampling.layers.{i}.bias"]) for i in sub]
    tensors = [("sub.conv.0.weight", conv[0][0]), ("sub.conv.0.bias", conv[0][1])]
    if (len(conv) - 1) % 2 != 0:
        raise DasllamaError(f"{d}: stem convs do not pair as depthwise + pointwise")
    for k in range((len(conv) - 1) // 2):
        (dw, dwb), (pw, pwb) = conv[1 + 2 * k], conv[2 + 2 * k]
        p = pw[:, :, 0, 0]
        w = p[:, :, None, None] * dw[None, :, 0, :, :]  # [out][in][3][3]
        tensors += [(f"sub.conv.{k + 1}.weight", w), (f"sub.conv.{k + 1}.bias", p @ dwb + pwb)]
    n_convs = 1 + (len(conv) - 1) // 2
    tensors += [("sub.out.weight", mat(sd["encoder.subsampling.linear.weight"])),
                ("sub.out.bias", sd["encoder.subsampling.linear.bias"])]
    n_layers = int(ec["num_hidden_layers"])
    for i in range(n_layers):
        s, b = f"encoder.layers.{i}.", f"blk.{i}."

        def lin(dst_, src_):
            tensors.append((b + dst_ + ".weight", mat(sd[s + src_ + ".weight"])))
            if s + src_ + ".bias" in sd:
                tensors.append((b + dst_ + ".bias", sd[s + src_ + ".bias"]))

        def norm(dst_, src_):
            tensors.extend([(b + dst_ + ".weight", sd[s + src_ + ".weight"]), (b + dst_ + ".bias", sd[s + src_ + ".bias"])])

        for n in (1, 2):
            norm(f"ffn{n}_norm", f"norm_feed_forward{n}")
            lin(f"ffn{n}_up", f"feed_forward{n}.linear1")
            lin(f"ffn{n}_down", f"feed_forward{n}.linear2")
        norm("attn_norm", "norm_self_att")
        for a, t in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj")):
            lin(f"attn_{a}", f"self_attn.{t}")
        tensors.append((b + "attn_bias_u", sd[s + "self_attn.bias_u"].reshape(-1)))
        tensors.append((b + "attn_bias_v", sd[s + "self_attn.bias_v"].reshape(-1)))
        # relative_k_proj [H * hd][D]: head h's term is (q + v)_h . W_h pe(i - j) = a . pe with
        # a = W_h^T (q + v)_h; pe's pairs are (sin, cos) of (i - j) w, and (a0, a1) becomes (a1, -a0)
        # so that rope over positions i and j reproduces it (conformer.h).
        A = sd[s + "self_attn.relative_k_proj.weight"].reshape(H, hd, D).transpose(0, 2, 1)  # [h][c][k]
        Wf = np.empty_like(A)
        Wf[:, 0::2], Wf[:, 1::2] = A[:, 1::2], -A[:, 0::2]
        tensors.append((b + "attn_pos.weight", mat(np.ascontiguousarray(Wf.reshape(H * D, hd)))))
        norm("conv_norm", "norm_conv")
        tensors.append((b + "conv_pw1.weight", mat(sd[s + "conv.pointwise_conv1.weight"][:, :, 0])))
        if s + "conv.pointwise_conv1.bias" in sd:
            tensors.append((b + "conv_pw1.bias", sd[s + "conv.pointwise_conv1.bias"]))
        g, beta = sd[s + "conv.norm.weight"], sd[s + "conv.norm.bias"]
        mean, var = sd[s + "conv.norm.running_mean"], sd[s + "conv.norm.running_var"]
        scale = g / np.sqrt(var + BN_EPS)
        dw = sd[s + "conv.depthwise_conv.weight"][:, 0, :]
        dwb = sd.get(s + "conv.depthwise_conv.bias", np.zeros(D, np.float32))
        tensors += [(b + "conv_dw.weight", (dw * scale[:, None]).astype(np.float32)),
                    (b + "conv_dw.bias", ((dwb - mean) * scale + beta).astype(np.float32))]
        tensors.append((b + "conv_pw2.weight", mat(sd[s + "conv.pointwise_conv2.weight"][:, :, 0])))
        if s + "conv.pointwise_conv2.bias" in sd:
            tensors.append((b + "conv_pw2.bias", sd[s + "conv.pointwise_conv2.bias"]))
        norm("out_norm", "norm_out")
    vocab = int(sd["ctc_head.weight"].shape[0])
    tensors += [("ctc.weight", mat(sd["ctc_head.weight"][:, :, 0]))]
    if "ctc_head.bias" in sd:
        tensors.append(("ctc.bias", sd["ctc_head.bias"]))
    blank = int(cfg.get("pad_token_id", vocab - 1))
    tokens, types = _tokens(d, vocab, blank)

    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
    w.add_string("general.name", f"FastConformer CTC from {d.name}")
    a = ARCH + "."
    w.add_uint32(a + "embedding_length", D)
    w.add_uint32(a + "block_count", n_layers)
    w.add_uint32(a + "attention.head_count", H)
    w.add_uint32(a + "feed_forward_length", int(ec["intermediate_size"]))
    w.add_uint32(a + "conv_kernel_size", int(ec["conv_kernel_size"]))
    w.add_uint32(a + "subsampling.channels", int(ec["subsampling_conv_channels"]))
    w.add_uint32(a + "subsampling.conv_count", n_convs)
    w.add_uint32(a + "num_mel_bins", int(ec["num_mel_bins"]))
    w.add_float32(a + "input_scale", float(np.sqrt(D)) if ec.get("scale_input", True) else 1.0)
    w.add_string(a + "activation", str(ec.get("hidden_act", "silu")))
    w.add_float32(a + "layer_norm_epsilon", 1e-5)  # nn.LayerNorm's default, which the blocks keep
    w.add_uint32(a + "blank_id", blank)
    w.add_string("tokenizer.ggml.model", "llama")  # SentencePiece pieces ("▁" for a space)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    for n, arr in _progress(tensors, "convert conformer", progress):
        w.add_tensor(n, np.ascontiguousarray(arr))
    return _finish(w, tmp, dst)


def is_hf_parakeet_ctc(src: PathLike) -> bool:
    """Whether src is a transformers directory whose config says a CTC model with an encoder_config."""
    p = Path(src) / "config.json"
    if not p.is_file():
        return False
    try:
        cfg = json.loads(p.read_text())
    except ValueError:
        return False
    return isinstance(cfg, dict) and "encoder_config" in cfg and "ctc" in str(cfg.get("model_type", ""))


__all__ = ["ARCH", "convert_hf_parakeet_ctc", "is_hf_parakeet_ctc"]
