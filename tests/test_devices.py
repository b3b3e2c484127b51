"""Choosing a device: the registry's answers, DASLLAMA_DEVICE, --device, and clear refusals.

Runs everywhere: on a machine without a GPU (CI) asking for CUDA must fail with a reason
and leave the process generating on the CPU; on a GPU machine it must load there.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dasllama as d

CUDA = d.system_info()["devices"]["cuda"]


def test_system_info_says_what_was_built_and_found():
    info = d.system_info()
    assert info["backends"]["cpu"] == "built"
    devs = info["devices"]
    assert devs["cpu"]["devices"][0]["threads"] >= 1
    for b in ("cuda", "vulkan", "metal"):
        e = devs[b]
        assert e["devices"] or e["error"], f"{b}: neither a device nor a reason"
        assert (info["backends"][b] == "built") == e["built"]


def test_unknown_and_malformed_devices(smollm2_path):
    for bad in ("tpu", "cuda:x", "cuda:-1", "cpu:1"):
        with pytest.raises(d.DasllamaError):
            d.load_model(smollm2_path, device=bad)


@pytest.mark.skipif(bool(CUDA["devices"]), reason="this machine has a CUDA device (tests/test_cuda.py covers it)")
def test_cuda_missing_is_a_clear_error_and_the_cpu_still_works(smollm2_path, monkeypatch):
    with pytest.raises(d.DeviceError, match="cuda") as e:
        d.load_model(smollm2_path, device="cuda")
    why = str(e.value)  # a build without nvcc, a machine without the driver, or one without a GPU
    assert "no CUDA backend" in why or "driver" in why or "no CUDA device" in why, why
    monkeypatch.setenv("DASLLAMA_DEVICE", "cuda:0")
    with pytest.raises(d.DeviceError):
        d.load_model(smollm2_path)  # the environment picks the device when the call does not
    monkeypatch.delenv("DASLLAMA_DEVICE")
    m = d.load_model(smollm2_path)
    assert m.device == "cpu" and "threads=" in repr(m)
    s = d.create_session(m)
    d.eval(m, s, d.encode(m, "Hello"))
    assert np.isfinite(s.logits).all()
    r = subprocess.run([sys.executable, "-m", "dasllama.cli", "run", "--model", str(smollm2_path), "--device", "cuda",
                        "Hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "dasllama: error:" in r.stderr and "cuda" in r.stderr and "Traceback" not in r.stderr


def test_backend_handle_refuses_bad_sizes():
    be = d._core.Backend("cpu")
    with pytest.raises(ValueError):
        be.matmul(np.zeros((2, 10), np.uint8), 8, 2, 32, np.zeros((1, 32), np.float32))  # q8_0 row is 34 bytes
    z = np.zeros((4, 64), np.float32)
    for bad in (lambda: be.rms_norm(np.zeros(5, np.float32), None, 1e-6),  # a row needs two dimensions
                lambda: be.copy_rows(z, 40, 30),  # columns past the row
                lambda: be.rope(z, 1, 64, np.array([0], np.int32), True, 64, 1e4, 1.0, None, None, 1.0),
                lambda: be.paged_attention(z[:1], z, z, np.array([3], np.int32), 1, 1, 64, 1, 16,
                                           np.array([7], np.int32), 2, 0, 1.0, 0.0, 4)):  # page 7 of a 2-page pool
        with pytest.raises(ValueError):
            bad()


def test_cublas_is_looked_for_where_users_have_it(tmp_path, monkeypatch):
    """The package points the CUDA backend at a libcublas.so where pip's nvidia wheels or a toolkit
    keep one (major 13 before 12), keeps a DASLLAMA_CUBLAS already set, and sets nothing where none
    is found (the backend then keeps its own tiles)."""
    from dasllama import _cuda_libs as L

    pip12 = tmp_path / "site" / "nvidia" / "cublas" / "lib"
    pip13 = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    tk = tmp_path / "cuda" / "lib64"
    for p in (pip12, pip13, tk):
        p.mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setattr(L, "_candidates", lambda real=L._candidates: [p for p in real() if "/usr/local/cuda" not in str(p)])
    monkeypatch.delenv("DASLLAMA_CUBLAS", raising=False)
    L.point_at_cublas()
    assert "DASLLAMA_CUBLAS" not in os.environ
    (pip12 / "libcublas.so.12").write_bytes(b"")
    assert L.find_cublas() == str(pip12 / "libcublas.so.12")
    (tk / "libcublas.so.13").write_bytes(b"")
    assert L.find_cublas() == str(tk / "libcublas.so.13")
    (pip13 / "libcublas.so.13").write_bytes(b"")
    L.point_at_cublas()
    assert os.environ["DASLLAMA_CUBLAS"] == str(pip13 / "libcublas.so.13")
    monkeypatch.setenv("DASLLAMA_CUBLAS", "/somewhere/libcublas.so")
    L.point_at_cublas()
    assert os.environ["DASLLAMA_CUBLAS"] == "/somewhere/libcublas.so"
