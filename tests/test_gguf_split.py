"""Split GGUFs (NAME-00001-of-0000N.gguf) open as one file: parts written by gguf-py's
own sharding writer (the layout llama.cpp's gguf-split writes), hand-broken parts, and
mutated parts that must raise GGUFError, never crash."""
from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import gguf as gguf_py
import _gguf_helpers as h
import dasllama as d
from dasllama.gguf import GGUFError, GGUFFile

VT = gguf_py.GGUFValueType


def _names(path: Path, n: int):
    # gguf-py's SHARD_NAME_FORMAT, the same "%s-%05d-of-%05d.gguf" llama.cpp's gguf-split uses.
    return [path.with_name(gguf_py.SHARD_NAME_FORMAT.format(path.stem, i + 1, n)) for i in range(n)]


def _tensors(n=7, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        if i % 3 == 2:
            out[f"blk.{i}.q8"] = (rng.integers(0, 255, (2, 34), dtype=np.uint8), gguf_py.GGMLQuantizationType.Q8_0)
        else:
            out[f"blk.{i}.w"] = (rng.standard_normal((i + 1, 32)).astype(np.float32), None)
    return out


def _write_split(path: Path, tensors, *, max_tensors=0, max_size=0, small_first=False, extra_kv=None) -> list:
    w = gguf_py.GGUFWriter(str(path), "llama", split_max_tensors=max_tensors, split_max_size=max_size,
                           small_first_shard=small_first)
    w.add_string("general.name", "split test")
    w.add_uint32("llama.block_count", 3)
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.stem + "-"))


def _copy_as_split(src: Path, dst: Path, max_tensors: int) -> list:
    """A real model rewritten by gguf-py's writer in parts: same metadata, same tensor bytes."""
    r = gguf_py.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf_py.GGUFWriter(str(dst), arch, split_max_tensors=max_tensors)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vt = field.types[0]
        if vt == VT.ARRAY:
            w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vt)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized data comes as byte rows
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return _names(dst, len(list(dst.parent.glob(dst.stem + "-*-of-*.gguf"))))


# --- the real writer -------------------------------------------------------------------

@pytest.mark.parametrize("kw,n_parts", [({"max_tensors": 2}, 4), ({"max_tensors": 3, "small_first": True}, 4),
                                         ({"max_size": 600}, None)])
def test_gguf_py_split_opens_as_one_file(tmp_path, kw, n_parts):
    ts = _tensors()
    parts = _write_split(tmp_path / "model.gguf", ts, **kw)
    assert len(parts) > 1
    if n_parts is not None:
        assert len(parts) == n_parts
    assert parts == _names(tmp_path / "model.gguf", len(parts))
    f = GGUFFile(parts[0])
    assert f.part_paths == tuple(map(str, parts))
    assert f.metadata["split.count"] == len(parts) and f.metadata["split.no"] == 0
    assert f.metadata["split.tensors.count"] == len(ts)
    assert f.metadata["general.name"] == "split test" and f.arch == "llama"
    assert list(f.tensors) == list(ts)  # the writer's order, across parts
    ref = {}  # gguf-py's reader on each part is the oracle for where each tensor lives
    for i, p in enumerate(parts):
        for t in gguf_py.GGUFReader(str(p)).tensors:
            ref[t.name] = (i, int(t.data_offset), bytes(np.asarray(t.data).tobytes()))
    for name, (arr, raw) in ts.items():
        info = f.tensors[name]
        part, off, data = ref[name]
        assert (info.part, info.offset) == (part, off)
        view = f.tensor(name)
        assert not view.flags.owndata and not view.flags.writeable  # a view over the part's mapping
        assert view.tobytes() == data == arr.tobytes()
        if raw is None:
            np.testing.assert_array_equal(f.tensor(name, typed=True), arr)
            np.testing.assert_array_equal(f.dequantize(name), arr)
    assert "parts=" in repr(f)


def test_real_model_split_loads_and_generates_like_the_single_file(smollm2_path, tmp_path):
    parts = _copy_as_split(smollm2_path, tmp_path / "smol.gguf", max_tensors=80)
    assert len(parts) == 4 and all(p.exists() for p in parts)  # 272 tensors, 80 a part
    one = d.load_model(smollm2_path)
    split = d.load_model(parts[0])
    assert split.config == one.config
    prompt = d.encode(one, "The three primary colors are")
    assert d.encode(split, "The three primary colors are") == prompt

    def run(m):
        s = d.create_session(m)
        got = []
        d.generate(m, s, prompt, d.SamplingParams(), 24, lambda i, _p: got.append(i) or True)
        return got

    assert run(split) == run(one)
    # The chat layer reads the template from the first part's metadata: same reply.
    replies = []
    for m in (one, split):
        chat = d.create_chat(m, max_new=12)
        d.add_user(chat, "Name a color.")
        replies.append(d.respond(m, chat, d.SamplingParams()))
    assert replies[0] == replies[1] and replies[0]


# --- broken splits -----------------------------------------------------------------------

@pytest.fixture
def parts3(tmp_path):
    parts = _write_split(tmp_path / "m.gguf", _tensors(6), max_tensors=2)
    assert len(parts) == 3
    return parts


def test_missing_part(parts3):
    parts3[1].unlink()
    with pytest.raises(GGUFError, match=r"split part 2 of 3 \(m-00002-of-00003.gguf\) is missing"):
        GGUFFile(parts3[0])
    with pytest.raises(GGUFError, match="is missing"):
        d.load_model(parts3[0])


def test_opening_a_later_part_names_the_first(parts3):
    with pytest.raises(GGUFError, match=r"part 2 of 3 of a split model; open its first part \(m-00001-of-00003"):
        GGUFFile(parts3[1])
    one = GGUFFile(parts3[1], join_splits=False)  # one part as it is
    assert len(one.tensors) == 2 and one.part_paths == (str(parts3[1]),)


def test_part_from_another_split(parts3, tmp_path):
    other = tmp_path / "o"
    other.mkdir()
    oparts = _write_split(other / "m.gguf", _tensors(5, seed=1), max_tensors=2)  # also 3 parts, 5 tensors
    shutil.copy(oparts[2], parts3[2])
    with pytest.raises(GGUFError, match=r"split part 3 of 3 .*belongs to another split: split.count 3, "
                                        r"split.tensors.count 5 \(the first part says 3 and 6\)"):
        GGUFFile(parts3[0])


def test_parts_swapped(parts3):
    a, b = parts3[1].read_bytes(), parts3[2].read_bytes()
    parts3[1].write_bytes(b)
    parts3[2].write_bytes(a)
    with pytest.raises(GGUFError, match=r"split part 2 of 3 .*has split.no = 2, expected 1"):
        GGUFFile(parts3[0])


def test_renamed_first_part_cannot_find_the_rest(parts3, tmp_path):
    dst = tmp_path / "renamed.gguf"
    shutil.copy(parts3[0], dst)
    with pytest.raises(GGUFError, match=r"part 1 of 3 of a split model, but its name does not end in "
                                        r"-00001-of-00003.gguf"):
        GGUFFile(dst)


def test_part_that_is_not_gguf(parts3):
    parts3[2].write_bytes(b"<html>not found</html>")
    with pytest.raises(GGUFError, match=r"split part 3 of 3 .*bad magic"):
        GGUFFile(parts3[0])


# Hand-built parts: the split keys with the types both writers use (u16, u16, i32).
def _part(path, no, count, total, tensors, extra=()):
    kvs = [h.kv("split.no", VT.UINT16, no), h.kv("split.count", VT.UINT16, count),
           h.kv("split.tensors.count", VT.INT32, total), *extra]
    infos = [h.tinfo(name, (8,), 0, 32 * i) for i, name in enumerate(tensors)]
    data = b"".join(np.full(8, i, np.float32).tobytes() for i in range(len(tensors)))
    path.write_bytes(h.build(kvs, infos, data))


def test_hand_built_split_and_its_breakages(tmp_path):
    names = _names(tmp_path / "x.gguf", 2)
    arch = [h.kv("general.architecture", VT.STRING, "llama")]
    _part(names[0], 0, 2, 3, ["a", "b"], arch)
    _part(names[1], 1, 2, 3, ["c"])
    f = GGUFFile(names[0])
    assert list(f.tensors) == ["a", "b", "c"] and f.tensors["c"].part == 1
    np.testing.assert_array_equal(f.tensor("c", typed=True), np.zeros(8, np.float32))

    _part(names[1], 1, 2, 3, ["c", "d"])  # one tensor more than split.tensors.count
    with pytest.raises(GGUFError, match="more than split.tensors.count 3"):
        GGUFFile(names[0])
    _part(names[1], 1, 2, 4, [])  # total disagrees with the first part
    with pytest.raises(GGUFError, match="belongs to another split"):
        GGUFFile(names[0])
    _part(names[0], 0, 2, 4, ["a", "b"], arch)
    _part(names[1], 1, 2, 4, [])  # agrees, but the parts hold 2 of 4
    with pytest.raises(GGUFError, match="hold 2 tensors, split.tensors.count says 4"):
        GGUFFile(names[0])
    _part(names[0], 0, 2, 3, ["a", "b"], arch)
    _part(names[1], 1, 2, 3, ["a"])  # a name in two parts
    with pytest.raises(GGUFError, match="tensor 'a' appears in more than one part"):
        GGUFFile(names[0])
    _part(names[1], 1, 2, 3, ["c"])
    names[1].write_bytes(h.build([h.kv("split.no", VT.UINT16, 1)], [h.tinfo("c", (8,), 0, 0)], bytes(32)))
    with pytest.raises(GGUFError, match="not a split part"):
        GGUFFile(names[0])
    _part(names[1], 1, 2, 3, ["c"], [h.kv("general.architecture", VT.STRING, "llama")])
    assert len(GGUFFile(names[0]).tensors) == 3  # extra keys in later parts are allowed
    names[1].write_bytes(h.build([h.kv("split.no", VT.STRING, "1"), h.kv("split.count", VT.UINT16, 2),
                                  h.kv("split.tensors.count", VT.INT32, 3)], [h.tinfo("c", (8,), 0, 0)], bytes(32)))
    with pytest.raises(GGUFError, match="key 'split.no' has type string"):
        GGUFFile(names[0])
    for no, count, msg in [(0, 0, "split.count 0 not in 1..65535"), (5, 2, "split.no 5 not in 0..1")]:
        names[0].write_bytes(h.build([h.kv("split.no", VT.UINT16, no), h.kv("split.count", VT.UINT16, count),
                                      h.kv("split.tensors.count", VT.INT32, 3)]))
        with pytest.raises(GGUFError, match=msg):
            GGUFFile(names[0])
    names[0].write_bytes(h.build([h.kv("split.count", VT.UINT16, 2), h.kv("split.tensors.count", VT.INT32, 3)]))
    with pytest.raises(GGUFError, match="split.no is missing"):
        GGUFFile(names[0])


def test_count_one_is_a_plain_file(tmp_path):
    p = tmp_path / "solo-00001-of-00001.gguf"
    _part(p, 0, 1, 1, ["a"])
    assert list(GGUFFile(p).tensors) == ["a"]


def test_mutated_parts_raise_never_crash(parts3, tmp_path):
    """Every mutant of a later part either opens consistently or raises GGUFError."""
    rng = random.Random(20)
    originals = [p.read_bytes() for p in parts3]
    opened = rejected = 0
    for i in range(300):
        k = 1 + i % 2
        buf = originals[k]
        lengths, end = h.length_fields(buf)
        parts3[k].write_bytes(h.mutate(buf, h.random_ops(rng, rng.randint(1, 3)), lengths, end))
        try:
            f = GGUFFile(parts3[0])
        except GGUFError:
            rejected += 1
        else:
            opened += 1
            for info in f.tensors.values():
                size = os.path.getsize(f.part_paths[info.part])
                assert info.offset + info.nbytes <= size
                raw = f.tensor(info.name)
                raw[0], raw[-1]  # noqa: B018 (touch both ends of the mapping)
        parts3[k].write_bytes(originals[k])
    assert rejected > 100 and opened > 0, (opened, rejected)


def test_split_keys_types_match_llama_cpp(parts3):
    """llama.cpp's gguf-split writes split.no / split.count as u16 and split.tensors.count as i32."""
    for i, p in enumerate(parts3):
        types = GGUFFile(p, join_splits=False).metadata_types()
        assert types["split.no"][0] == VT.UINT16 and types["split.count"][0] == VT.UINT16
        assert types["split.tensors.count"][0] == VT.INT32
        with open(p, "rb") as fh:
            assert fh.read(4) == b"GGUF" and struct.unpack("<I", fh.read(4))[0] == 3
