"""GGUF test helpers: a raw byte builder for malformed files, a walker that finds
count/length fields, seed files and the mutation strategy shared by the fuzz tests."""
from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

import gguf as gguf_py

VT = gguf_py.GGUFValueType
_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
        VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def gstr(b) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def payload(t, v, elem=None) -> bytes:
    """Encoding of a value of type t without its type tag; arrays take (elem, items)."""
    if t == VT.STRING:
        return gstr(v)
    if t == VT.ARRAY:
        et, items = v
        sub = items and isinstance(items[0], tuple) and et == VT.ARRAY
        out = struct.pack("<IQ", et, len(items))
        for it in items:
            out += payload(et, it) if not sub else payload(VT.ARRAY, it)
        return out
    return struct.pack(_FMT[t], v)


def kv(key, t, v) -> bytes:
    return gstr(key) + struct.pack("<I", t) + payload(t, v)


def tinfo(name, ne: Sequence[int], typ: int, off: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", d) for d in ne) + struct.pack("<IQ", typ, off)


def build(kvs: Sequence[bytes] = (), tensors: Sequence[bytes] = (), data: bytes = b"", *, version=3,
          alignment=32, magic=b"GGUF", n_kv=None, n_tensors=None) -> bytes:
    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(kvs) if n_kv is None else n_kv)
    out += b"".join(kvs) + b"".join(tensors)
    out += b"\0" * ((-len(out)) % alignment)
    return out + data


def length_fields(buf: bytes) -> Tuple[List[int], int]:
    """Offsets of every u64 count/length field of a valid GGUF, and the header end."""
    pos = [8, 16]
    p = 24
    n_t, n_kv = struct.unpack_from("<QQ", buf, 8)

    def rstr(p):
        pos.append(p)
        (n,) = struct.unpack_from("<Q", buf, p)
        return p + 8 + n

    def rval(p, t):
        if t == VT.STRING:
            return rstr(p)
        if t == VT.ARRAY:
            et, n = struct.unpack_from("<IQ", buf, p)
            pos.append(p + 4)
            p += 12
            if et not in (VT.STRING, VT.ARRAY):
                return p + n * struct.calcsize(_FMT[et])
            for _ in range(n):
                p = rval(p, et)
            return p
        return p + struct.calcsize(_FMT[t])

    for _ in range(n_kv):
        p = rstr(p)
        (t,) = struct.unpack_from("<I", buf, p)
        p = rval(p + 4, t)
    for _ in range(n_t):
        p = rstr(p)
        (nd,) = struct.unpack_from("<I", buf, p)
        pos.extend(p + 4 + 8 * i for i in range(nd))  # dims are i64 fields worth hitting too
        p += 4 + 8 * nd + 4
        pos.append(p)  # offset
        p += 8
    return pos, p


def writer_file(path: Path, alignment: int | None = None) -> Path:
    """A small file by GGUFWriter: every scalar type, strings, arrays, nested arrays, several tensor types."""
    path = Path(path)
    w = gguf_py.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float32("t.f32", 1.5e-7)
    w.add_float64("t.f64", -2.2250738585072014e-308)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "hello")
    w.add_key_value("t.empty", "", VT.STRING)  # add_string skips empty values
    w.add_string("t.unicode", "héllo wörld — 你好 🦙")
    for t in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64):
        w.add_key_value(f"a.{t.name.lower()}", [0, 1, 2, 100], VT.ARRAY, sub_type=t)
    w.add_key_value("a.float32", [0.5, -1.25, 3e38], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("a.float64", [0.1, -1e300], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_key_value("a.bool", [True, False, True], VT.ARRAY, sub_type=VT.BOOL)
    w.add_array("a.string", ["a", "", "ü", "🦙" * 10])
    w.add_key_value("a.nested", [[1, 2], [3]], VT.ARRAY)
    w.add_key_value("a.nested3", [[[1.5], [2.5, 3.5]], [[4.5]]], VT.ARRAY)
    w.add_key_value("a.nested_str", [["x", "y"], ["z"]], VT.ARRAY)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((2, 3)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    w.add_tensor("q8_0", rng.integers(0, 255, (3, 2 * 34), dtype=np.uint8),
                 raw_dtype=gguf_py.GGMLQuantizationType.Q8_0)
    w.add_tensor("q4_1", rng.integers(0, 255, (2, 20), dtype=np.uint8),
                 raw_dtype=gguf_py.GGMLQuantizationType.Q4_1)
    w.add_tensor("q4_k.3d", rng.integers(0, 255, (2, 3, 144), dtype=np.uint8),
                 raw_dtype=gguf_py.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def smollm2_seed(model: Path) -> bytes:
    """The real SmolLM2 metadata with a handful of small tensor infos and their data, a few MB smaller."""
    with open(model, "rb") as f:
        buf = f.read(4 << 20)  # the metadata (vocab, merges) ends near 1.8 MB
    r_kv = struct.unpack_from("<Q", buf, 16)[0]
    # Find the end of the metadata with the walker on a header that claims no tensors.
    head = buf[:8] + struct.pack("<Q", 0) + buf[16:]
    _, kv_end = length_fields(head)
    tensors = [tinfo("tok", (64, 2), 8, 0), tinfo("norm", (16,), 0, 160), tinfo("w", (32, 3), 3, 224)]
    return build([buf[24:kv_end]], tensors, bytes(range(256)) + bytes(32), n_kv=r_kv)


OPS = ("flip", "insert", "delete", "u64", "truncate")
_SPECIAL = (0, 1, 2, 7, 31, 2**31, 2**32, 2**32 - 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


def mutate(buf: bytes, ops, lengths: Sequence[int], header_end: int) -> bytes:
    """Applies ops [(op, a, b), ...]: positions are taken modulo the header region."""
    b = bytearray(buf)
    for op, a, c in ops:
        if not b:
            break
        region = max(1, min(len(b), header_end))
        p = a % region
        if op == "flip":
            b[p] ^= (c % 255) + 1
        elif op == "insert":
            b[p:p] = bytes([c % 256]) * (1 + c % 9)
        elif op == "delete":
            del b[p:p + 1 + c % 9]
        elif op == "u64":
            q = lengths[a % len(lengths)] if c % 3 else p
            v = _SPECIAL[c % len(_SPECIAL)] if c % 2 else (c * 2654435761) % 2**64
            if q + 8 <= len(b):
                b[q:q + 8] = struct.pack("<Q", v)
        elif op == "truncate":
            del b[p:]
    return bytes(b)


def random_ops(rng: random.Random, n: int):
    return [(rng.choice(OPS), rng.randrange(2**32), rng.randrange(2**32)) for _ in range(n)]
