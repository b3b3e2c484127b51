"""The requantizer against gguf-py: the file it writes reads back in gguf-py's own reader
with the same metadata, and every matrix equals gguf-py's quantize of the source dequantized."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as T

import dasllama as d
from dasllama.convert import requantize


@pytest.fixture(scope="module", params=["q8_0", "f16", "q4_0"])
def converted(request, smollm2_path, tmp_path_factory):
    dst = tmp_path_factory.mktemp("rq") / f"smollm2-{request.param}.gguf"
    return request.param, requantize(smollm2_path, dst, request.param, progress=False)


def test_requantized_file_matches_gguf_py(converted, smollm2_path):
    qtype, path = converted
    src, out = GGUFReader(str(smollm2_path)), GGUFReader(str(path))
    skip = {"general.file_type", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.alignment"}
    src_kv = {k: f.contents() for k, f in src.fields.items() if k not in skip}
    out_kv = {k: f.contents() for k, f in out.fields.items() if k not in skip}
    assert out_kv == src_kv
    assert out.fields["general.file_type"].contents() == {"q8_0": 7, "f16": 1, "q4_0": 2}[qtype]
    target = T[qtype.upper()]
    by_name = {t.name: t for t in src.tensors}
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for i, t in enumerate(out.tensors):
        s = by_name[t.name]
        assert list(t.shape) == list(s.shape)
        if len(s.shape) == 1 or i % 9:  # every matrix's type; bytes of a spread of them (gguf-py is slow)
            assert t.tensor_type == (target if len(s.shape) == 2 else T.F32)
            continue
        want = gq.quantize(gq.dequantize(s.data, s.tensor_type), target)
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), np.asarray(want).view(np.uint8).reshape(-1))


def test_requantized_model_answers(converted):
    _, path = converted
    m = d.load_model(path)
    ids = d.encode(m, "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                   parse_special=True)
    out = []
    d.generate(m, d.create_session(m), ids, d.SamplingParams(), 16, lambda i, p: out.append(p))
    assert "Paris" in "".join(out)


def test_requantize_rejects_unknown_type(smollm2_path, tmp_path):
    with pytest.raises(ValueError):
        requantize(smollm2_path, tmp_path / "x.gguf", "q3_K")
