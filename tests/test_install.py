"""The installed package: its version and metadata, and (with DASLLAMA_TEST_INSTALLED=1, as CI
and tools/test_aarch64.py set it) proof that the tests run against an installed wheel, not the
source tree."""
from __future__ import annotations

import os
import platform
import runpy
import sys
from importlib import metadata
from pathlib import Path

import pytest

import dasllama

REPO = Path(__file__).resolve().parent.parent
INSTALLED = os.environ.get("DASLLAMA_TEST_INSTALLED") == "1"


def _dist() -> metadata.Distribution:
    # The CPU wheel is "dasllama", the CUDA one "dasllama-cuda13": both install the package dasllama.
    for name in ("dasllama", "dasllama-cuda13"):
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pass
    pytest.fail("no dasllama distribution is installed")


def test_version_is_the_metadata_version():
    assert dasllama.__version__ == _dist().version


def test_python_m_dasllama_version(capsys, monkeypatch):
    # In-process (runpy is what `python -m` runs): under qemu-user a child process would not be emulated.
    monkeypatch.setattr(sys, "argv", ["dasllama", "--version"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("dasllama", run_name="__main__", alter_sys=True)
    assert e.value.code in (0, None)
    assert capsys.readouterr().out.strip() == f"dasllama {_dist().version}"


def test_metadata():
    md = _dist().metadata
    assert md["License-Expression"] == "MIT" or md["License"] == "MIT"
    classifiers = md.get_all("Classifier")
    assert "Programming Language :: Python :: 3" in classifiers
    # The long description is the README.
    assert md["Description-Content-Type"] == "text/markdown"
    assert "# dasllama" in (md.get_payload() or md["Description"] or "")


def test_system_info_names_this_machine():
    info = dasllama.system_info()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
    assert info["cpu"]["arch"] == machine
    assert info["isa_active"] in info["isa_supported"]
    assert "baseline" in info["isa_compiled"]
    # The best ISA the CPU runs is the one picked, unless DASLLAMA_ISA forces another.
    if not os.environ.get("DASLLAMA_ISA"):
        order = [i for i in ("baseline", "neon", "i8mm", "avx2", "avx512") if i in info["isa_supported"]]
        assert info["isa_active"] == order[-1]


@pytest.mark.skipif(not INSTALLED, reason="runs where DASLLAMA_TEST_INSTALLED=1 (CI's wheel run)")
def test_running_from_an_installed_wheel():
    pkg = Path(dasllama.__file__).resolve().parent
    core = Path(dasllama._core.__file__).resolve()
    assert pkg != REPO / "python" / "dasllama", f"dasllama imported from the source tree: {pkg}"
    assert pkg.parent.name in ("site-packages", "dist-packages") or "aarch64-site" in str(pkg), pkg
    assert core.parent == pkg
    # A wheel build's record lists the extension module, as pip installed it.
    files = {str(f) for f in (_dist().files or [])}
    assert any(f.startswith("dasllama/_core.") and f.endswith(".so") for f in files), sorted(files)[:10]
