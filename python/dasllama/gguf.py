"""Read GGUF files: metadata, tensor infos, raw tensor bytes (zero copy), dequantized tensors.

The C++ core maps the file read-only and validates all of it on open; any
malformed or truncated file raises :class:`dasllama.GGUFError`.

Conventions:

* ``metadata`` values: ints, floats, bools and str (UTF-8 decoded with
  ``errors='replace'``); arrays of numbers or bools are 1-D numpy arrays
  (copies, dtype as stored), arrays of strings or of arrays are lists.
* ``TensorInfo.shape`` is numpy order (outermost first, the reverse of ggml's
  ``ne``), like gguf-py's ``ReaderTensor.data``; ``offset`` is absolute in the file
  (in the part's file, ``part_paths[info.part]``, for a split model).
* A split model (``NAME-00001-of-0000N.gguf``, llama.cpp's gguf-split layout and
  gguf-py's sharded writer) opens from its first part as one file: every part is
  mapped and checked (count, numbering, tensor total); the metadata is the first
  part's. ``GGUFFile(part, join_splits=False)`` opens one part as it is.
* ``tensor()`` returns a read-only view over the mapping; ``close()`` drops this
  object's reference, the mapping itself goes once no view refers to it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

from . import _core
from ._core import GGUFError

__all__ = ["GGUFFile", "GGUFError", "TensorInfo"]

# ggml types with a plain numpy dtype, for typed views (bf16 has none: viewed as uint16).
_TYPED = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64", 30: "uint16"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file. ``shape`` is outermost first; ``offset`` absolute in its (part's) file."""

    name: str
    shape: Tuple[int, ...]
    type: int
    type_name: str
    offset: int
    nbytes: int
    part: int = 0  # index into GGUFFile.part_paths (split models)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """A GGUF file mapped read-only. Use as a context manager or call ``close()``."""

    def __init__(self, path: "str | os.PathLike[str]", join_splits: bool = True):
        self.path = os.fspath(path)
        self._f: Optional[_core.GGUFFile] = _core.GGUFFile(self.path, join_splits)
        self.part_paths: Tuple[str, ...] = tuple(self._f.part_paths)
        self.version: int = self._f.version
        self.alignment: int = self._f.alignment
        self.data_offset: int = self._f.data_offset
        self.file_size: int = self._f.file_size
        self._metadata: Optional[Dict[str, Any]] = None
        arch = self._f.get("general.architecture")  # one key, not the whole metadata
        self.arch: Optional[str] = arch if isinstance(arch, str) else None
        self.tensors: Dict[str, TensorInfo] = {
            name: TensorInfo(name, tuple(shape), t, _core.ggml_type_name(t), off, nb, part)
            for name, shape, t, off, nb, part in self._f.tensors()
        }

    @property
    def metadata(self) -> Dict[str, Any]:
        """All key/value pairs in file order (converted once, on first use)."""
        if self._metadata is None:
            self._metadata = self._core().metadata()
        return self._metadata

    def metadata_types(self) -> Dict[str, Any]:
        """Each key's GGUF value type (and an array's element type), as the file stores them: what a
        writer needs to copy the metadata without widening a type."""
        return self._core().metadata_types()

    def _core(self) -> _core.GGUFFile:
        if self._f is None:
            raise ValueError(f"GGUF file {self.path} is closed")
        return self._f

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in {self.path}") from None

    def tensor(self, name: str, typed: bool = False) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view (no copy).

        ``typed=True`` views f32/f16/f64/i8..i64 tensors with their dtype and shape
        (bf16 as uint16); other types raise ValueError.
        """
        info = self._info(name)
        raw = self._core().tensor_bytes(name)
        if not typed:
            return raw
        dt = _TYPED.get(info.type)
        if dt is None:
            raise ValueError(f"tensor {name!r} has block type {info.type_name}; no typed view (use dequantize)")
        import numpy as np  # here: `import dasllama` does not load numpy

        return raw.view(np.dtype(dt).newbyteorder("<")).reshape(info.shape)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array shaped like ``tensors[name].shape``."""
        self._info(name)
        return self._core().dequantize(name)

    def close(self) -> None:
        self._f = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __repr__(self) -> str:
        state = "" if self._f is not None else ", closed"
        parts = f", parts={len(self.part_paths)}" if len(self.part_paths) > 1 else ""
        return (f"GGUFFile({os.path.basename(self.path)!r}, arch={self.arch!r}, tensors={len(self.tensors)}, "
                f"version={self.version}{parts}{state})")

