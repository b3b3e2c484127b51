"""Hugging Face Hub names (hf:ORG/REPO[:QUANT|/FILE.gguf]) with the real huggingface_hub client
against a loopback server that speaks the Hub's file API (tests/_fake_hub.py), reached
through HF_ENDPOINT in a fresh process, as a user's environment would set it."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf as gguf_py
from _fake_hub import FakeHub
from dasllama import hf, hub

# --- names and the quant pick (no network) ---------------------------------------------------


@pytest.mark.parametrize("name,ref", [
    ("hf:org/Repo-GGUF", hf.HFRef("org/Repo-GGUF")),
    ("hf:org/Repo-GGUF:q4_k_m", hf.HFRef("org/Repo-GGUF", quant="q4_k_m")),
    ("hf.co/org/Repo-GGUF:IQ3_M", hf.HFRef("org/Repo-GGUF", quant="IQ3_M")),
    ("huggingface.co/org/Repo-GGUF", hf.HFRef("org/Repo-GGUF")),
    ("hf:org/Repo-GGUF@v1.0:Q8_0", hf.HFRef("org/Repo-GGUF", revision="v1.0", quant="Q8_0")),
    ("hf:org/Repo-GGUF/sub/dir/x-Q4_0.gguf", hf.HFRef("org/Repo-GGUF", file="sub/dir/x-Q4_0.gguf")),
])
def test_parse(name, ref):
    assert hf.is_hf_name(name)
    assert hf.parse(name) == ref


@pytest.mark.parametrize("bad", ["hf:", "hf:org", "hf:org/", "hf:org/repo:", "hf:org/repo/README.md",
                                 "hf:../x/y", "hf:org/re po", "hf:org/repo@:Q4_0"])
def test_parse_rejects(bad):
    with pytest.raises(hf.HFError):
        hf.parse(bad)


@pytest.mark.parametrize("path,label", [
    ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"), ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"), ("gemma-3-270m-it-qat-Q4_0.gguf", "Q4_0"),
    ("Qwen3-8B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"), ("x-IQ3_XXS.gguf", "IQ3_XXS"), ("x-BF16.gguf", "BF16"),
    ("x-f16.gguf", "F16"), ("Q8_0/Big-Q8_0-00001-of-00003.gguf", "Q8_0"), ("Q6_K/Big-00002-of-00003.gguf", "Q6_K"),
    ("model.gguf", None),
])
def test_quant_label(path, label):
    assert hf.quant_label(path) == label


REPO = ["README.md", "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-IQ3_M.gguf", "mmproj-tiny-F32.gguf",
        "mmproj-tiny-F16.gguf", "Q6_K/tiny-Q6_K-00001-of-00002.gguf", "Q6_K/tiny-Q6_K-00002-of-00002.gguf"]


def _choose(name, files=REPO):
    return hf.choose(hf.parse(name), files)


def test_choose_default_case_insensitive_split_and_mmproj():
    m = _choose("hf:o/r")
    assert m.files == ["tiny-Q4_K_M.gguf"] and m.quant == "Q4_K_M"
    assert m.mmproj == "mmproj-tiny-F16.gguf" and m.mmproj_all == ["mmproj-tiny-F16.gguf", "mmproj-tiny-F32.gguf"]
    assert _choose("hf:o/r:q8_0").files == ["tiny-Q8_0.gguf"]
    assert _choose("hf:o/r:Iq3_m").files == ["tiny-IQ3_M.gguf"]
    assert _choose("hf:o/r:q6_k").files == ["Q6_K/tiny-Q6_K-00001-of-00002.gguf", "Q6_K/tiny-Q6_K-00002-of-00002.gguf"]
    assert _choose("hf:o/r/tiny-Q8_0.gguf").files == ["tiny-Q8_0.gguf"]
    # One model file and no Q4_K_M: that file.
    assert _choose("hf:o/r", ["a.gguf", "mmproj-a-f16.gguf"]).files == ["a.gguf"]


def test_choose_errors_list_what_is_there():
    with pytest.raises(hf.HFError, match=r"o/r has no Q5_K_M file; available quants: IQ3_M, Q4_K_M, Q6_K, Q8_0"):
        _choose("hf:o/r:Q5_K_M")
    with pytest.raises(hf.HFError, match=r"no Q4_K_M file and several others; pick one with hf:o/r:QUANT "
                                         r"\(available quants: Q4_0, Q8_0\)"):
        _choose("hf:o/r", ["m-Q8_0.gguf", "m-Q4_0.gguf"])
    with pytest.raises(hf.HFError, match=r"several Q4_K_M files \(a-Q4_K_M.gguf, b-Q4_K_M.gguf\)"):
        _choose("hf:o/r", ["a-Q4_K_M.gguf", "b-Q4_K_M.gguf"])
    with pytest.raises(hf.HFError, match=r"o/r has no file nope.gguf \(it has: "):
        _choose("hf:o/r/nope.gguf")
    with pytest.raises(hf.HFError, match="is a projector"):
        _choose("hf:o/r/mmproj-tiny-F16.gguf")
    with pytest.raises(hf.HFError, match="later part of a split model; name its first part"):
        _choose("hf:o/r/Q6_K/tiny-Q6_K-00002-of-00002.gguf")
    with pytest.raises(hf.HFError, match=r"parts 1 of 3 of .*incomplete split"):
        _choose("hf:o/r", ["x-00001-of-00003.gguf"])
    with pytest.raises(hf.HFError, match="no GGUF model files \\(only mmproj files\\)"):
        _choose("hf:o/r", ["README.md", "mmproj-f16.gguf"])
    assert issubclass(hf.HFError, hub.HubError)


# --- the real client against the loopback Hub -----------------------------------------------------

def _gguf_bytes(tmp: Path, name: str, n: int, seed: int) -> bytes:
    """A small valid GGUF (gguf-py's writer) of about n float32 values."""
    p = tmp / name
    w = gguf_py.GGUFWriter(str(p), "llama")
    w.add_string("general.name", name)
    w.add_tensor("w", np.random.default_rng(seed).standard_normal(n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p.read_bytes()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hubfiles")
    h = FakeHub()
    h.add("org/tiny-GGUF", {
        "README.md": b"# tiny\n",
        "tiny-Q4_K_M.gguf": _gguf_bytes(tmp, "a.gguf", 200_000, 0),      # 800 kB: served through the CDN redirect
        "tiny-Q8_0.gguf": _gguf_bytes(tmp, "b.gguf", 1000, 1),
        "mmproj-tiny-F16.gguf": _gguf_bytes(tmp, "c.gguf", 64, 2),
        "mmproj-tiny-F32.gguf": _gguf_bytes(tmp, "d.gguf", 64, 3),
    })
    h.add("org/gated-GGUF", {"g-Q4_K_M.gguf": _gguf_bytes(tmp, "g.gguf", 64, 4)}, gated_token="hf_right_token")
    h.add("org/big-GGUF", {"big-Q4_K_M.gguf": _gguf_bytes(tmp, "e.gguf", 6_000_000, 5)})  # 24 MB
    h.start()
    yield h
    h.stop()


def _env(fake: FakeHub, cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=fake.url, HF_HUB_CACHE=str(cache / "hub"), HF_HOME=str(cache / "home"),
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               DASLLAMA_HOME=str(cache / "dasllama"), PYTHONPATH=str(Path(__file__).parent))
    env.update(extra)
    return env


def _cli(env, *args):
    return subprocess.run([sys.executable, "-m", "dasllama", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def _sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def test_pull_default_quant_into_the_hf_cache(fake, tmp_path):
    env = _env(fake, tmp_path)
    r = _cli(env, "pull", "hf:org/tiny-GGUF")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    snap = tmp_path / "hub" / "models--org--tiny-GGUF" / "snapshots" / fake.repos["org/tiny-GGUF"].commit
    assert path == snap / "tiny-Q4_K_M.gguf"
    assert path.read_bytes() == fake.repos["org/tiny-GGUF"].files["tiny-Q4_K_M.gguf"]
    assert path.is_symlink() and (tmp_path / "hub" / "models--org--tiny-GGUF" / "blobs").is_dir()  # HF cache layout
    assert "mmproj-tiny-F16.gguf" in r.stderr and "--mmproj auto" in r.stderr
    # The client's calls: the repo info (its file list), then HEAD on resolve and the redirected GET on the CDN.
    paths = [(m, p) for m, p, _, _ in fake.log]
    assert ("GET", "/api/models/org/tiny-GGUF/revision/main") in paths
    assert ("HEAD", "/org/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf") in paths
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert ("GET", f"/cdn/{sha}") in paths

    # A quant tag in any case, and the projector with --mmproj.
    r = _cli(env, "pull", "hf:org/tiny-GGUF:q8_0", "--mmproj")
    assert r.returncode == 0, r.stderr
    model, proj = map(Path, r.stdout.split())
    assert model.name == "tiny-Q8_0.gguf" and proj.name == "mmproj-tiny-F16.gguf"
    assert proj.read_bytes() == fake.repos["org/tiny-GGUF"].files["mmproj-tiny-F16.gguf"]


def test_missing_quant_file_and_repo(fake, tmp_path):
    env = _env(fake, tmp_path)
    r = _cli(env, "pull", "hf:org/tiny-GGUF:Q5_K_M")
    assert r.returncode == 1
    assert r.stderr.strip() == "dasllama: error: org/tiny-GGUF has no Q5_K_M file; available quants: Q4_K_M, Q8_0"
    r = _cli(env, "pull", "hf:org/tiny-GGUF/tiny-Q2_K.gguf")
    assert r.returncode == 1 and "org/tiny-GGUF has no file tiny-Q2_K.gguf (it has: tiny-Q4_K_M.gguf" in r.stderr
    r = _cli(env, "pull", "hf:org/no-such-repo")
    assert r.returncode == 1
    assert f"no repository org/no-such-repo on {fake.url} (if it is private, set HF_TOKEN)" in r.stderr
    # A file the server does not have (404 EntryNotFound from resolve), through the same download path.
    code = "from dasllama import hf; hf.download('org/tiny-GGUF', 'gone.gguf', progress=False)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "dasllama.hf.HFError: org/tiny-GGUF has no file gone.gguf" in r.stderr
    assert "Traceback" in r.stderr  # the Python API raises; the CLI prints one line
    for out in (r.stderr,):
        assert "RemoteEntryNotFoundError" not in out.split("HFError")[-1]


def test_gated_repo_needs_hf_token(fake, tmp_path):
    r = _cli(_env(fake, tmp_path), "pull", "hf:org/gated-GGUF")
    assert r.returncode == 1
    assert ("org/gated-GGUF is gated: accept its terms on the model page and set HF_TOKEN (or run `hf auth login`)"
            in r.stderr), r.stderr
    r = _cli(_env(fake, tmp_path, HF_TOKEN="hf_wrong"), "pull", "hf:org/gated-GGUF")
    assert r.returncode == 1 and "is gated" in r.stderr
    fake.log.clear()
    r = _cli(_env(fake, tmp_path, HF_TOKEN="hf_right_token"), "pull", "hf:org/gated-GGUF")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == fake.repos["org/gated-GGUF"].files["g-Q4_K_M.gguf"]
    heads = [a for m, p, _, a in fake.log if m == "HEAD" and p.endswith("/g-Q4_K_M.gguf")]
    assert heads == ["Bearer hf_right_token"]


def test_interrupted_download_resumes_with_a_range_request(fake, tmp_path):
    from huggingface_hub import constants

    data = fake.repos["org/big-GGUF"].files["big-Q4_K_M.gguf"]
    sha = hashlib.sha256(data).hexdigest()
    chunk = constants.DOWNLOAD_CHUNK_SIZE  # the client writes (and so can resume from) whole 10 MiB chunks
    cut = chunk + chunk // 2
    assert len(data) > 2 * chunk
    fake.drop_after[sha] = cut  # the first GET of the blob stops after 15 MiB, connection closed
    fake.log.clear()
    r = _cli(_env(fake, tmp_path), "pull", "hf:org/big-GGUF")
    assert r.returncode == 0, r.stderr
    assert _sha(r.stdout.strip()) == sha
    gets = [(rng) for m, p, rng, _ in fake.log if m == "GET" and p == f"/cdn/{sha}"]
    assert gets == [None, f"bytes={chunk}-"], gets  # resumed after what it kept, not restarted
    assert sha not in fake.drop_after
    # Nothing half-written is left in the cache.
    assert not list((tmp_path / "hub").rglob("*.incomplete"))


def test_offline_mode_uses_the_cache(fake, tmp_path):
    env = _env(fake, tmp_path)
    r = _cli(env, "pull", "hf:org/tiny-GGUF")
    assert r.returncode == 0, r.stderr
    online = r.stdout.strip()
    fake.log.clear()
    off = _env(fake, tmp_path, HF_HUB_OFFLINE="1")
    r = _cli(off, "pull", "hf:org/tiny-GGUF")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == online
    r = _cli(off, "pull", "hf:org/tiny-GGUF:q4_k_m")
    assert r.returncode == 0 and r.stdout.strip() == online
    assert fake.log == []  # not one request
    r = _cli(off, "pull", "hf:org/tiny-GGUF:Q8_0")  # never downloaded
    assert r.returncode == 1
    assert "org/tiny-GGUF has no Q8_0 file; available quants: Q4_K_M (offline: the HF cache holds only these)" \
        in r.stderr, r.stderr
    r = _cli(off, "pull", "hf:org/big-GGUF")
    assert r.returncode == 1
    assert f"HF_HUB_OFFLINE is set and org/big-GGUF is not in the HF cache ({tmp_path / 'hub'})" in r.stderr
    assert fake.log == []


def test_unreachable_endpoint_falls_back_to_the_cache(fake, tmp_path):
    env = _env(fake, tmp_path)
    r = _cli(env, "pull", "hf:org/tiny-GGUF")
    assert r.returncode == 0, r.stderr
    dead = _env(fake, tmp_path, HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens on port 9
    r = _cli(dead, "pull", "hf:org/tiny-GGUF")
    assert r.returncode == 0 and r.stdout.strip().endswith("tiny-Q4_K_M.gguf"), r.stderr
    r = _cli(dead, "pull", "hf:org/big-GGUF")
    assert r.returncode == 1 and "http://127.0.0.1:9 cannot be reached and org/big-GGUF is not in the HF cache" \
        in r.stderr, r.stderr


# --- a real model from a Hub repo, single file and split: load and chat ---------------------------

@pytest.fixture(scope="module")
def smol_hub(smollm2_path, tmp_path_factory):
    from test_gguf_split import _copy_as_split

    tmp = tmp_path_factory.mktemp("smolsplit")
    parts = _copy_as_split(smollm2_path, tmp / "SmolLM2-135M-Instruct-Q4_1.gguf", max_tensors=100)
    h = FakeHub()
    h.add("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
          {"SmolLM2-135M-Instruct-Q4_1.gguf": smollm2_path.read_bytes(), "README.md": b"x"})
    h.add("someone/SmolLM2-split-GGUF", {f"Q4_1/{p.name}": p.read_bytes() for p in parts})
    h.start()
    yield h, parts
    h.stop()


def test_hub_model_and_split_repo_load_and_chat(smol_hub, smollm2_path, tmp_path):
    h, parts = smol_hub
    env = _env(h, tmp_path)
    q = "Name one primary color."
    local = _cli(env, "chat", "--quiet", "--model", str(smollm2_path), "--max-tokens", "16", q)
    assert local.returncode == 0, local.stderr
    one = _cli(env, "chat", "--model", "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "--max-tokens", "16", q)
    assert one.returncode == 0, one.stderr
    assert one.stdout == local.stdout and one.stdout.strip()
    assert "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF (Hugging Face Hub" in one.stderr  # the banner says so
    split = _cli(env, "chat", "--quiet", "--model", "hf:someone/SmolLM2-split-GGUF:q4_1", "--max-tokens", "16", q)
    assert split.returncode == 0, split.stderr
    assert split.stdout == local.stdout
    snap = next((tmp_path / "hub" / "models--someone--SmolLM2-split-GGUF" / "snapshots").iterdir())
    assert sorted(p.name for p in (snap / "Q4_1").iterdir()) == [p.name for p in parts]  # every part came down
