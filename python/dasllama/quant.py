"""Block formats: dequantize / quantize ggml tensors (numpy in, numpy out).

Shapes follow gguf-py's ``gguf.quants``: ``dequantize`` takes raw bytes whose
last dimension is in bytes and returns float32 with it in elements;
``quantize`` takes floats whose last dimension is in elements and returns the
raw bytes (uint8, for every type, f32/f16/bf16 included). The work is in C++
(the active CPU ISA), bit-exact with gguf-py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


from . import _core

QType = Union[str, int]

# ggml ids by lower-case name; names as gguf-py / llama.cpp print them ("q4_K").
_IDS: dict[str, int] = {}
for _i in range(64):
    try:
        _IDS[_core.type_info(_i)[0].lower()] = _i
    except ValueError:
        pass


@dataclass(frozen=True)
class TypeInfo:
    """A ggml type: its name, elements per block and bytes per block."""

    id: int
    name: str
    block_size: int
    type_size: int
    dequantizable: bool


def _type_id(qtype: QType) -> int:
    if isinstance(qtype, str):
        tid = _IDS.get(qtype.lower())
        if tid is None:
            raise ValueError(f"unknown ggml type {qtype!r}")
        return tid
    return int(qtype)  # ints and IntEnums such as gguf's GGMLQuantizationType


def type_info(qtype: QType) -> TypeInfo:
    """Name, block size (elements) and type size (bytes) of a type name or id."""
    tid = _type_id(qtype)
    name, block_size, type_size, deq = _core.type_info(tid)
    return TypeInfo(tid, name, block_size, type_size, deq)


def dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """Raw bytes of type ``qtype`` (last dim in bytes) to float32 (last dim in elements)."""
    import numpy as np  # here, not at import: a text-only program need not load numpy

    info = type_info(qtype)
    raw = np.ascontiguousarray(data)
    if raw.ndim == 0:
        raw = raw.reshape(1)
    raw = raw.view(np.uint8)
    nbytes = raw.shape[-1]
    if nbytes % info.type_size:
        raise ValueError(f"{nbytes} bytes per row is not a multiple of the {info.name} block ({info.type_size} bytes)")
    n_row = nbytes // info.type_size * info.block_size
    out = _core.dequantize(raw, info.id, n_row * (raw.size // nbytes if nbytes else 0))
    return out.reshape(*raw.shape[:-1], n_row)


def quantize(array: np.ndarray, qtype: QType) -> np.ndarray:
    """Floats (last dim in elements) to raw bytes of type ``qtype`` (last dim in bytes)."""
    import numpy as np  # here, not at import: a text-only program need not load numpy

    info = type_info(qtype)
    x = np.ascontiguousarray(array, dtype=np.float32)
    if x.ndim == 0:
        x = x.reshape(1)
    n_row = x.shape[-1]
    if n_row % info.block_size:
        raise ValueError(f"row of {n_row} elements is not a multiple of the {info.name} block ({info.block_size})")
    out = _core.quantize(x, info.id)
    return out.reshape(*x.shape[:-1], n_row // info.block_size * info.type_size)


__all__ = ["TypeInfo", "dequantize", "quantize", "type_info"]
