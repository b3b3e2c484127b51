"""GGUF reader against gguf-py (GGUFWriter writes, GGUFReader is the oracle), malformed files, fuzzing."""
from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf as gguf_py
import dasllama
from dasllama import DasllamaError, GGUFError, UnsupportedModelError
from dasllama.gguf import GGUFFile, TensorInfo

import _gguf_helpers as h
from _gguf_helpers import VT, build, gstr, kv, tinfo


def _flatten(v):
    if isinstance(v, list):
        return [x for e in v for x in _flatten(e)]
    if isinstance(v, np.ndarray):
        return v.tolist()
    return [v]


def check_against_reader(path):
    """Every key/value and every tensor info and byte equal to GGUFReader's view."""
    ref = gguf_py.GGUFReader(str(path))
    with GGUFFile(path) as f:
        fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
        md = f.metadata
        types = f.metadata_types()
        assert list(md) == list(fields)
        assert f.version == ref.fields["GGUF.version"].contents()
        for k, fld in fields.items():
            t, et = types[k]
            assert t == fld.types[0], k
            want, got = fld.contents(), md[k]
            if t == VT.ARRAY:
                if len(fld.types) > 1:  # GGUFReader records no element type for an empty array
                    assert et == fld.types[1], k
                if et not in (VT.STRING, VT.ARRAY):
                    assert isinstance(got, np.ndarray) and got.ndim == 1
                assert _flatten(got) == want, k
            else:
                assert type(got) is type(want) or (isinstance(want, (int, float)) and not isinstance(got, (str, bool))), k
                assert got == want, k
        assert f.alignment == ref.alignment
        assert f.data_offset == ref.data_offset
        assert len(f) == len(ref.tensors)
        assert list(f.tensors) == [t.name for t in ref.tensors]
        for rt in ref.tensors:
            ti = f.tensors[rt.name]
            assert ti.shape == tuple(int(d) for d in reversed(rt.shape)), rt.name
            assert ti.type == int(rt.tensor_type)
            assert ti.type_name.lower() == rt.tensor_type.name.lower()
            assert ti.offset == rt.data_offset
            assert ti.nbytes == rt.n_bytes
            raw = f.tensor(rt.name)
            assert raw.dtype == np.uint8 and raw.shape == (rt.n_bytes,)
            assert np.array_equal(raw, np.ascontiguousarray(rt.data).reshape(-1).view(np.uint8)), rt.name
        return f


@pytest.fixture(scope="module")
def wdir():
    d = tempfile.mkdtemp(prefix="dl_gguf_")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_writer_file_matches_reader(wdir, alignment):
    p = h.writer_file(os.path.join(wdir, f"w{alignment}.gguf"), alignment)
    f = check_against_reader(p)
    assert f.alignment == (alignment or 32)
    # Exact structure of nested arrays (GGUFReader flattens them).
    md = GGUFFile(p).metadata
    assert [[a.tolist() for a in x] for x in md["a.nested3"]] == [[[1.5], [2.5, 3.5]], [[4.5]]]
    assert [a.tolist() for a in md["a.nested"]] == [[1, 2], [3]]
    assert md["a.nested_str"] == [["x", "y"], ["z"]]
    assert md["a.bool"].dtype == np.bool_ and md["a.uint64"].dtype == np.uint64
    assert md["t.unicode"] == "héllo wörld — 你好 🦙" and md["t.empty"] == ""
    assert md["t.u64"] == 2**64 - 1 and md["t.i64"] == -(2**63) and md["t.true"] is True


def test_version_2(wdir):
    b = bytearray(h.writer_file(os.path.join(wdir, "v3.gguf")).read_bytes())
    b[4:8] = struct.pack("<I", 2)
    p = os.path.join(wdir, "v2.gguf")
    Path(p).write_bytes(b)
    assert check_against_reader(p).version == 2


def test_empty_arrays_and_typed_views(wdir):
    kvs = [kv("general.architecture", VT.STRING, "x")]
    kvs += [kv(f"e.{t.name}", VT.ARRAY, (t, [])) for t in VT]
    data = np.arange(12, dtype=np.float32).tobytes() + bytes(16) + np.arange(8, dtype=np.float16).tobytes()
    p = os.path.join(wdir, "empty.gguf")
    Path(p).write_bytes(build(kvs, [tinfo("a", (4, 3), 0, 0), tinfo("b", (8,), 1, 64)], data))
    f = check_against_reader(p)
    f = GGUFFile(p)
    assert all(len(f.metadata[f"e.{t.name}"]) == 0 for t in VT)
    assert np.array_equal(f.tensor("a", typed=True), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(f.dequantize("a"), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(f.dequantize("b"), np.arange(8, dtype=np.float32))


def test_real_model_matches_reader(smollm2_path):
    f = check_against_reader(smollm2_path)
    assert len(f) == 272 and "token_embd.weight" in f and "nope" not in f
    r = repr(f)
    assert "llama" in r and "272" in r and "version=3" in r and "\n" not in r


def test_dequantize_matches_gguf_py(smollm2_path, wdir):
    """Where a dequantizer exists, bit-exact with gguf-py; elsewhere a clear UnsupportedModelError."""
    p = h.writer_file(os.path.join(wdir, "dq.gguf"))
    for path in (p, smollm2_path):
        ref = {t.name: t for t in gguf_py.GGUFReader(str(path)).tensors}
        f = GGUFFile(path)
        for name in list(f.tensors)[:12]:
            ti = f.tensors[name]
            if ti.type_name in ("i32",):
                continue
            try:
                got = f.dequantize(name)
            except UnsupportedModelError:
                continue
            want = gguf_py.quants.dequantize(ref[name].data, ref[name].tensor_type)
            assert got.dtype == np.float32 and got.shape == ti.shape
            assert np.array_equal(got.view(np.uint32), want.astype(np.float32).reshape(ti.shape).view(np.uint32)), name


def test_views_zero_copy_readonly_and_outlive_close(smollm2_path):
    f = GGUFFile(smollm2_path)
    a = f.tensor("token_embd.weight")
    b = f.tensor("token_embd.weight")
    assert a.ctypes.data == b.ctypes.data  # both view the mapping
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    first = int(a[0])
    f.close()
    del f
    assert int(a[0]) == first and int(a[-1]) >= 0  # the mapping lives while the view does
    with pytest.raises(KeyError):
        GGUFFile(smollm2_path).tensor("no.such.tensor")
    with pytest.raises(KeyError):
        GGUFFile(smollm2_path).dequantize("no.such.tensor")


def test_big_vocab_converts_fast(wdir):
    toks = [f"tok_{i}_\u0120x".encode() for i in range(150_000)]
    body = struct.pack("<IIQ", VT.ARRAY, VT.STRING, len(toks)) + b"".join(gstr(t) for t in toks)
    p = os.path.join(wdir, "vocab.gguf")
    Path(p).write_bytes(build([gstr("tokenizer.ggml.tokens") + body,
                               kv("tokenizer.ggml.scores", VT.ARRAY, (VT.FLOAT32, [0.5] * 150_000))]))
    t = time.perf_counter()
    md = GGUFFile(p).metadata
    assert time.perf_counter() - t < 0.5
    assert len(md["tokenizer.ggml.tokens"]) == 150_000 and md["tokenizer.ggml.tokens"][7] == "tok_7_\u0120x"
    assert md["tokenizer.ggml.scores"].dtype == np.float32


def test_invalid_utf8_is_replaced(wdir):
    p = os.path.join(wdir, "utf8.gguf")
    Path(p).write_bytes(build([gstr("k") + struct.pack("<I", VT.STRING) + gstr(b"a\xffb")]))
    assert GGUFFile(p).metadata["k"] == "a\ufffdb"


def test_io_errors(tmp_path):
    with pytest.raises(DasllamaError, match="No such file") as e:
        GGUFFile(tmp_path / "missing.gguf")
    assert not isinstance(e.value, GGUFError)
    with pytest.raises(DasllamaError, match="directory") as e:
        GGUFFile(tmp_path)
    assert not isinstance(e.value, GGUFError)
    assert dasllama.GGUFError is GGUFError and dasllama.gguf.GGUFError is GGUFError


# ---- one targeted test per malformation -------------------------------------------------

A = [kv("general.architecture", VT.STRING, "llama")]
T1 = [tinfo("w", (4, 2), 0, 0)]
D1 = bytes(32)


def _bad(tmp_path, blob, *needles):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(GGUFError) as e:
        GGUFFile(p)
    msg = str(e.value)
    assert "at byte" in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


CASES = {
    "empty": (b"", "empty"),
    "tiny": (b"GGU", "magic", "truncated"),
    "short_header": (b"GGUF\x03\x00\x00\x00\x01\x00", "tensor count", "truncated"),
    "magic": (build(A, magic=b"GGML"), "magic"),
    "version1": (build(A, version=1), "version 1"),
    "version4": (build(A, version=4), "version 4"),
    "bigendian": (build(A, version=3 << 24), "big-endian"),
    "n_kv_huge": (build(A, n_kv=2**63), "metadata count"),
    "n_kv_u64max": (build(A, n_kv=2**64 - 1), "metadata count"),
    "n_tensors_huge": (build(A, T1, D1, n_tensors=2**40), "tensor count"),
    "kv_missing": (build(A, n_kv=2, alignment=1), "metadata key #1", "truncated"),
    "key_len": (build([struct.pack("<Q", 2**62) + b"abc"]), "metadata key #0", "string length"),
    "empty_key": (build([kv("", VT.UINT8, 1)]), "metadata key #0", "empty"),
    "str_len": (build([gstr("k") + struct.pack("<IQ", VT.STRING, 1 << 40) + b"xx"]), "key 'k'", "string length"),
    "value_type": (build([gstr("k") + struct.pack("<I", 13) + b"\0" * 8]), "key 'k'", "unknown value type 13"),
    "elem_type": (build([gstr("k") + struct.pack("<IIQ", VT.ARRAY, 99, 1) + b"\0" * 8]), "key 'k'", "element type 99"),
    "array_count": (build([gstr("k") + struct.pack("<IIQ", VT.ARRAY, VT.UINT32, 2**62)]), "key 'k'", "array count"),
    "array_count_str": (build([gstr("k") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 2**61) + bytes(64)]), "key 'k'",
                        "array count"),
    "array_trunc": (build([gstr("k") + struct.pack("<IIQ", VT.ARRAY, VT.STRING, 3) + gstr("a") + struct.pack("<Q", 99)]),
                    "key 'k'[1]", "string length"),
    "nest_deep": (build([gstr("k") + struct.pack("<I", VT.ARRAY) + struct.pack("<IQ", VT.ARRAY, 1) * 9
                         + struct.pack("<IQ", VT.UINT8, 0)]), "key 'k'", "nested"),
    "bool": (build([kv("k", VT.BOOL, 2)]), "key 'k'", "bool"),
    "dup_key": (build(A + A), "key 'general.architecture'", "duplicate"),
    "align0": (build([kv("general.alignment", VT.UINT32, 0)]), "general.alignment", "power of two"),
    "align3": (build([kv("general.alignment", VT.UINT32, 3)], alignment=1), "general.alignment", "power of two"),
    "align_neg": (build([kv("general.alignment", VT.INT32, -32)]), "general.alignment"),
    "align_str": (build([kv("general.alignment", VT.STRING, "32")]), "general.alignment", "integer"),
    "dup_tensor": (build(A, T1 + [tinfo("w", (4,), 0, 32)], bytes(64)), "tensor 'w'", "duplicate"),
    "n_dims0": (build(A, [tinfo("w", (), 0, 0)], D1), "tensor 'w'", "n_dims 0"),
    "n_dims5": (build(A, [tinfo("w", (1, 1, 1, 1, 1), 0, 0)], D1), "tensor 'w'", "n_dims 5"),
    "dim_zero": (build(A, [tinfo("w", (4, 0), 0, 0)], D1), "tensor 'w'", "ne[1] = 0"),
    "dim_neg": (build(A, [tinfo("w", (4, -2), 0, 0)], D1), "tensor 'w'", "ne[1] = -2"),
    "dim_overflow": (build(A, [tinfo("w", (2**32, 2**32), 0, 0)], D1), "tensor 'w'", "overflows"),
    "bytes_overflow": (build(A, [tinfo("w", (2**61,), 28, 0)], D1), "tensor 'w'", "overflows"),
    "block": (build(A, [tinfo("w", (33, 2), 2, 0)], D1), "tensor 'w'", "block size"),
    "type_unknown": (build(A, [tinfo("w", (4,), 99, 0)], D1), "tensor 'w'", "unknown tensor type 99"),
    "type_retired": (build(A, [tinfo("w", (4,), 4, 0)], D1), "tensor 'w'", "unknown tensor type 4"),
    "misaligned": (build(A, [tinfo("w", (4,), 0, 4)], D1), "tensor 'w'", "not aligned"),
    "past_end": (build(A, [tinfo("blk.0.attn_q.weight", (4, 4), 0, 0)], D1), "tensor 'blk.0.attn_q.weight'",
                 "past end of file"),
    "offset_huge": (build(A, [tinfo("w", (4,), 0, 2**64 - 32)], D1), "tensor 'w'", "past end of file"),
    "no_data": (build(A, T1), "tensor 'w'", "past end of file"),
    "overlap": (build(A, [tinfo("a", (16,), 0, 0), tinfo("b", (8,), 0, 32)], bytes(64)), "tensor 'b'", "overlaps"),
    "tname_utf8": (build(A, [tinfo(b"w\xf1x", (4,), 0, 0)], D1), "tensor 'w\\xf1x'", "UTF-8"),
    "tname_surrogate": (build(A, [tinfo(b"\xed\xa0\x80", (4,), 0, 0)], D1), "UTF-8"),
    "tname_trunc": (build(A, n_tensors=1, alignment=1), "tensor #0 name", "truncated"),
    "dims_trunc": (build(A, n_tensors=1, alignment=1) + gstr("w") + struct.pack("<Iq", 3, 4), "tensor 'w'", "truncated"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed(tmp_path, case):
    blob, *needles = CASES[case]
    _bad(tmp_path, blob, *needles)


def test_every_truncation_raises(tmp_path, wdir):
    """Cut a real writer file at every byte of its header and inside its data."""
    b = h.writer_file(os.path.join(wdir, "cut.gguf")).read_bytes()
    p = tmp_path / "cut.gguf"
    for n in list(range(0, GGUFFile(os.path.join(wdir, "cut.gguf")).data_offset + 1)) + [len(b) - 1]:
        p.write_bytes(b[:n])
        with pytest.raises(GGUFError):
            GGUFFile(p)


# ---- fuzzing: mutants either raise GGUFError or parse into a file that is self-consistent -----

@pytest.fixture(scope="module")
def seeds(smollm2_path, wdir):
    out = []
    for al in (None, 1, 256):
        out.append(h.writer_file(os.path.join(wdir, f"seed{al}.gguf"), al).read_bytes())
    out.append(h.smollm2_seed(smollm2_path))
    with open(smollm2_path, "rb") as f:  # the real header with its data cut short
        out.append(f.read(1_785_664 + 4096))
    return [(b, *_fields(b)) for b in out]


def _fields(b):
    lengths, end = h.length_fields(b)
    return lengths, end


def assert_consistent(path):
    try:
        f = GGUFFile(path)
    except GGUFError:
        return
    f.metadata
    spans = []
    for ti in f.tensors.values():
        assert f.data_offset <= ti.offset and ti.offset + ti.nbytes <= f.file_size
        assert all(d > 0 for d in ti.shape) and ti.nbytes > 0
        raw = f.tensor(ti.name)
        raw[0], raw[-1]  # noqa: B018 (touch both ends of the mapping)
        spans.append((ti.offset, ti.offset + ti.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_header_mutations(seeds, wdir, data):
    buf, lengths, end = data.draw(st.sampled_from(seeds))
    ops = data.draw(st.lists(st.tuples(st.sampled_from(h.OPS), st.integers(0, 2**32 - 1),
                                       st.integers(0, 2**32 - 1)), min_size=1, max_size=4))
    p = os.path.join(wdir, "mutant.gguf")
    with open(p, "wb") as f:
        f.write(h.mutate(buf, ops, lengths, end))
    assert_consistent(p)
