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
    meta, types = f.metadata, f._f.metadata_types()
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
    items = list(f.tensors.items())
    it = items
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(items, desc=f"requantize to {qtype}", unit="tensor", leave=False)
    for name, info in it:
        x = f.dequantize(name)
        if x.ndim == 2 and name.endswith(".weight") and x.shape[-1] % block == 0:
            data = quant.quantize(x, qtype)
            w.add_tensor(name, data, raw_dtype=target)  # shape follows from the row bytes
        else:
            w.add_tensor(name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, dst)
    return dst
