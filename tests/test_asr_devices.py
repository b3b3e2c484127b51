"""The whisper decoder on device backends (Vulkan: lavapipe here; CUDA on the lent GPU) against
the CPU and the references: the tiny random transformers whisper of test_asr.py (logits NMSE
1e-6 against the CPU's, greedy ids equal), and on CUDA also whisper tiny.en's tokens equal to
CTranslate2's (test_asr_whisper.py). Without a device, its tests skip saying why.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d

sys.path.insert(0, os.path.dirname(__file__))
from test_asr import EOT, EN, NMSE, NO_TS, SOT, TRANSCRIBE, clip, gguf_path, hf_dir, nmse  # noqa: E402,F401

_DEV = d.system_info()["devices"]


def _present(backend):
    info = _DEV.get(backend, {})
    return pytest.mark.skipif(not info.get("devices"), reason=f"no {backend} device here: "
                              + (info.get("error") or "none found"))


DEVICES = [pytest.param("vulkan", marks=_present("vulkan")), pytest.param("cuda", marks=_present("cuda"))]


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_whisper_on_device(gguf_path, clip, device):  # noqa: F811
    cpu = d.load_asr_model(gguf_path, n_threads=2)
    dev = d.load_asr_model(gguf_path, n_threads=2, device=device)
    ids = np.array([SOT, EN, TRANSCRIBE, NO_TS] + list(range(40, 60)), np.int32)
    out = {}
    for name, m in (("cpu", cpu), ("dev", dev)):
        m.decoder.set_encoder(d.encode_audio_rows(m.encoder, clip, full_window=True))
        out[name] = m.decoder.forward(ids, 0, True)
    assert nmse(out["dev"], out["cpu"]) < NMSE
    a = d.transcribe(cpu, clip, language="en", max_new_tokens=24)
    b = d.transcribe(dev, clip, language="en", max_new_tokens=24)
    assert a.segments[0].tokens == b.segments[0].tokens


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=_present("cuda"))])
def test_whisper_tiny_en_on_device(device, tmp_path):
    from test_asr_whisper import JFK, _ct2_tokens
    import ctranslate2

    from dasllama import hub
    from speech import speak

    m = d.load_asr_model("whisper-tiny.en", device=device)
    ct2 = ctranslate2.models.Whisper(str(hub.pull("whisper-tiny.en")), device="cpu", compute_type="float32")
    x = speak(JFK)
    for ts in (False, True):
        ref = [i for i in _ct2_tokens(ct2, x, m.prompt(None, ts)) if i != m.eot]
        t = d.transcribe(m, x, timestamps=ts)
        assert [i for s in t.segments for i in s.tokens] == [i for i in ref if i < m.eot]
