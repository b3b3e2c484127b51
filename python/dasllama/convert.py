"""Requantizer: a GGUF rewritten with its matrices in another block format.

Reading is ours (``dasllama.gguf``); writing goes through gguf-py's
``GGUFWriter`` (install ``dasllama[convert]``). Norms and other 1-D tensors stay
f32; 2-D ``*.weight`` matrices whose rows are whole blocks take the new type.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np

from . import quant
from ._core import DasllamaError
from .gguf import GGUFFile

TARGETS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}  # -> general.file_type
_SKIP_KEYS = {"general.architecture", "general.alignment", "general.file_type"}


def _progress(items, desc: str, on: bool):
    """items, wrapped in a tqdm bar when on."""
    if not on:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="tensor", leave=False)


def _finish(w, tmp: Path, dst: Path) -> Path:
    """Writes the GGUF to tmp, then moves it to dst: a failed run never leaves a partial dst."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, dst)
    return dst


def requantize(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], qtype: str = "q8_0",
               progress: bool = True) -> Path:
    """Write ``dst``: ``src`` with its matrices in ``qtype`` (f32, f16, bf16, q8_0, q4_0, q4_1)."""
    try:
        import gguf
    except ImportError as e:  # writing needs gguf-py; reading and inference do not
        raise DasllamaError("requantizing needs gguf-py: pip install 'dasllama[convert]'") from e
    if qtype not in TARGETS:
        raise ValueError(f"unsupported target type {qtype!r}; choose from {sorted(TARGETS)}")
    f = GGUFFile(src)
    meta, types = f.metadata, f.metadata_types()
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise DasllamaError(f"{src}: no general.architecture")
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, val in meta.items():
        if key in _SKIP_KEYS:
            continue
        vtype, sub = types[key]
        vt = gguf.GGUFValueType(vtype)
        if vt == gguf.GGUFValueType.ARRAY:
            val = [v.item() if isinstance(v, np.generic) else v for v in list(val)]
            w.add_key_value(key, val, vt, sub_type=gguf.GGUFValueType(sub))
        else:
            w.add_key_value(key, val, vt)
    w.add_uint32("general.file_type", TARGETS[qtype])
    target = gguf.GGMLQuantizationType[qtype.upper()]
    block = gguf.GGML_QUANT_SIZES[target][0]
    for name, info in _progress(list(f.tensors.items()), f"requantize to {qtype}", progress):
        x = f.dequantize(name)
        if x.ndim == 2 and name.endswith(".weight") and x.shape[-1] % block == 0:
            data = quant.quantize(x, qtype)
            w.add_tensor(name, data, raw_dtype=target)  # shape follows from the row bytes
        else:
            w.add_tensor(name, x.astype(np.float32))
    return _finish(w, tmp, dst)


# ---- whisper encoders from CTranslate2 files -> whisper-encoder mmproj ----------------

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # 5: bfloat16


def _read_ct2(path: Path) -> dict:
    """The variables of a CTranslate2 model.bin (binary version <= 6) as numpy arrays.

    Layout (ctranslate2/specs/model_spec.py, ModelSpec._serialize): u32 version, string
    spec name, u32 revision, u32 count, then per variable: string name, u8 rank, u32 dims,
    u8 dtype, u32 byte count, bytes; strings are u16 length (with a NUL) + bytes.
    """
    import struct

    buf = memoryview(path.read_bytes())
    off = 0

    def take(fmt):
        nonlocal off
        size = struct.calcsize(fmt)
        if off + size > len(buf):
            raise DasllamaError(f"{path}: truncated CTranslate2 model at byte {off}")
        v = struct.unpack_from(fmt, buf, off)
        off += size
        return v[0]

    def string():
        nonlocal off
        n = take("<H")
        if n == 0 or off + n > len(buf):
            raise DasllamaError(f"{path}: bad string at byte {off}")
        s = bytes(buf[off:off + n - 1]).decode("utf-8", "replace")
        off += n
        return s

    version = take("<I")
    if not 1 <= version <= 6:
        raise DasllamaError(f"{path}: unsupported CTranslate2 binary version {version}")
    spec = string()
    take("<I")  # revision
    out = {"__spec__": spec}
    for _ in range(take("<I")):
        name = string()
        dims = [take("<I") for _ in range(take("<B"))]
        dtype, nbytes = take("<B"), take("<I")
        if off + nbytes > len(buf):
            raise DasllamaError(f"{path}: variable {name} runs past the end of the file")
        raw = buf[off:off + nbytes]
        off += nbytes
        if dtype == 5:  # bfloat16: the high half of a float32
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype in _CT2_DTYPES:
            a = np.frombuffer(raw, _CT2_DTYPES[dtype])
        else:
            raise DasllamaError(f"{path}: variable {name} has unknown dtype {dtype}")
        if a.size != int(np.prod(dims)):
            raise DasllamaError(f"{path}: variable {name} holds {a.size} values for shape {dims}")
        out[name] = a.reshape(dims)
    return out


def convert_ct2_whisper(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], progress: bool = True) -> Path:
    """Write ``dst``: the encoder of a CTranslate2 whisper model (directory or model.bin) as a
    whisper-encoder mmproj in llama.cpp's layout (family ``whisper``, no projector).

    Weights keep their stored precision (f16 stays f16, int8 is dequantized with its
    per-row scales to f16); norms and biases are f32; the fused QKV splits into
    attn_q / attn_k / attn_v (whisper's key has no bias: CTranslate2 stores zeros there).
    """
    try:
        import gguf
    except ImportError as e:
        raise DasllamaError("converting needs gguf-py: pip install 'dasllama[convert]'") from e
    src = Path(src)
    binf = src / "model.bin" if src.is_dir() else src
    if not binf.is_file():
        raise FileNotFoundError(f"{binf}: no CTranslate2 model.bin")
    v = _read_ct2(binf)
    if v["__spec__"] != "WhisperSpec":
        raise DasllamaError(f"{binf}: a {v['__spec__']}, not a whisper model")

    meta, tensors = convert_ct2_whisper_tensors(v, str(binf))
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_string("general.name", f"whisper encoder from {binf.parent.name}")
    for k, (kind, val) in meta.items():
        getattr(w, f"add_{kind}")(k, val)
    for name, a in _progress(tensors, "convert whisper encoder", progress):
        w.add_tensor(name, np.ascontiguousarray(a))
    return _finish(w, tmp, dst)


def convert_ct2_whisper_tensors(v: dict, name: str):
    """The whisper-encoder mmproj's metadata ({key: (kind, value)}) and tensors [(name, array)]
    from CTranslate2-named variables (also used by convert_asr for whole models)."""
    def get(name):
        if f"encoder/{name}" not in v:
            raise DasllamaError(f"{name}: missing encoder/{name}")
        a = v[f"encoder/{name}"]
        scale = v.get(f"encoder/{name}_scale")
        if a.dtype == np.int8:  # CTranslate2 int8: w = q / scale, one scale per output row
            if scale is None:
                raise DasllamaError(f"{name}: int8 encoder/{name} without a scale")
            a = (a.astype(np.float32) / scale.reshape(-1, *([1] * (a.ndim - 1)))).astype(np.float16)
        return a

    def f32(a):
        return np.ascontiguousarray(a, dtype=np.float32)

    def mat(a):  # stored precision: f16 stays f16, f32 stays f32
        return np.ascontiguousarray(a if a.dtype in (np.float16, np.float32) else a.astype(np.float32))

    c1w, c2w = get("conv1/weight"), get("conv2/weight")
    dim, n_mel = c1w.shape[0], c1w.shape[1]
    heads = int(np.asarray(v.get("encoder/num_heads", 0)).reshape(-1)[0]) if "encoder/num_heads" in v else 0
    if heads <= 0 or dim % heads:
        raise DasllamaError(f"{name}: encoder/num_heads {heads} does not divide width {dim}")
    n_layers = 0
    while f"encoder/layer_{n_layers}/self_attention/linear_0/weight" in v:
        n_layers += 1
    ffn = get("layer_0/ffn/linear_0/weight").shape[0] if n_layers else 0
    if n_layers == 0:
        raise DasllamaError(f"{name}: no encoder layers")

    tensors = [
        ("a.conv1d.1.weight", c1w.astype(np.float16)), ("a.conv1d.1.bias", f32(get("conv1/bias"))[:, None]),
        ("a.conv1d.2.weight", c2w.astype(np.float16)), ("a.conv1d.2.bias", f32(get("conv2/bias"))[:, None]),
        ("a.position_embd.weight", f32(get("position_encodings/encodings"))),
        ("a.post_ln.weight", f32(get("layer_norm/gamma"))), ("a.post_ln.bias", f32(get("layer_norm/beta"))),
    ]
    for il in range(n_layers):
        p = f"layer_{il}/"
        qkv, qkv_b = get(p + "self_attention/linear_0/weight"), f32(get(p + "self_attention/linear_0/bias"))
        if qkv.shape != (3 * dim, dim) or qkv_b.shape != (3 * dim,):
            raise DasllamaError(f"{name}: layer {il} fused QKV has shape {qkv.shape}")
        b = f"a.blk.{il}."
        tensors += [
            (b + "attn_q.weight", mat(qkv[:dim])), (b + "attn_q.bias", qkv_b[:dim]),
            (b + "attn_k.weight", mat(qkv[dim:2 * dim])),
            (b + "attn_v.weight", mat(qkv[2 * dim:])), (b + "attn_v.bias", qkv_b[2 * dim:]),
            (b + "attn_out.weight", mat(get(p + "self_attention/linear_1/weight"))),
            (b + "attn_out.bias", f32(get(p + "self_attention/linear_1/bias"))),
            (b + "ln1.weight", f32(get(p + "self_attention/layer_norm/gamma"))),
            (b + "ln1.bias", f32(get(p + "self_attention/layer_norm/beta"))),
            (b + "ffn_up.weight", mat(get(p + "ffn/linear_0/weight"))),
            (b + "ffn_up.bias", f32(get(p + "ffn/linear_0/bias"))),
            (b + "ffn_down.weight", mat(get(p + "ffn/linear_1/weight"))),
            (b + "ffn_down.bias", f32(get(p + "ffn/linear_1/bias"))),
            (b + "ln2.weight", f32(get(p + "ffn/layer_norm/gamma"))),
            (b + "ln2.bias", f32(get(p + "ffn/layer_norm/beta"))),
        ]
        if np.any(qkv_b[dim:2 * dim] != 0):
            tensors.append((b + "attn_k.bias", qkv_b[dim:2 * dim]))
    meta = {
        "clip.has_vision_encoder": ("bool", False), "clip.has_audio_encoder": ("bool", True),
        "clip.projector_type": ("string", "whisper"), "clip.audio.projection_dim": ("uint32", dim),
        "clip.audio.embedding_length": ("uint32", dim), "clip.audio.feed_forward_length": ("uint32", ffn),
        "clip.audio.block_count": ("uint32", n_layers), "clip.audio.attention.head_count": ("uint32", heads),
        "clip.audio.num_mel_bins": ("uint32", n_mel), "clip.audio.attention.layer_norm_epsilon": ("float32", 1e-5),
    }
    return meta, tensors
