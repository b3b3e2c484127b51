"""Other tools' stores, built in a temp HOME the way each tool lays them out: Ollama
(manifests + sha256 blobs, OLLAMA_MODELS), LM Studio, llama.cpp's cache and the HF cache.
Models resolve to the files already there; nothing is written into any store."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import dasllama as d
from dasllama import cli, hub, stores


def _tree_state(root: Path):
    """Every path under root with its size and mtime: a store must look the same after we read it."""
    return sorted((str(p.relative_to(root)), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*"))


def _ollama_store(root: Path, name: str, tag: str, model_bytes: bytes, *, ns="library", host="registry.ollama.ai",
                  projector: bytes = None, link_from: Path = None) -> Path:
    """An Ollama store entry as `ollama pull` leaves it: blobs/sha256-<hex> and a v2 image manifest."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes, src: Path = None):
        hexd = hashlib.sha256(data).hexdigest()
        p = blobs / f"sha256-{hexd}"
        if not p.exists():
            if src is not None:
                os.link(src, p) if src.stat().st_dev == blobs.stat().st_dev else p.write_bytes(data)
            else:
                p.write_bytes(data)
        return f"sha256:{hexd}", len(data)

    layers = []
    dg, n = blob(model_bytes, link_from)
    layers.append({"mediaType": "application/vnd.ollama.image.model", "digest": dg, "size": n})
    if projector is not None:
        dg, n = blob(projector)
        layers.append({"mediaType": "application/vnd.ollama.image.projector", "digest": dg, "size": n})
    for media, body in [("application/vnd.ollama.image.template", b"{{ .Prompt }}"),
                        ("application/vnd.ollama.image.params", b'{"stop": ["<|im_end|>"]}')]:
        dg, n = blob(body)
        layers.append({"mediaType": media, "digest": dg, "size": n})
    cfg, cn = blob(b'{"model_format":"gguf","model_family":"llama"}')
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": cfg, "size": cn},
                "layers": layers}
    mpath = root / "manifests" / host / Path(*ns.split("/")) / name / tag
    mpath.parent.mkdir(parents=True, exist_ok=True)
    mpath.write_text(json.dumps(manifest))
    return mpath


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for k in ("OLLAMA_MODELS", "LLAMA_CACHE", "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DASLLAMA_HOME", str(tmp_path / "dl"))
    monkeypatch.setattr(stores, "ollama_dirs", lambda real=stores.ollama_dirs: [
        p for p in real() if not str(p).startswith("/usr/share/ollama")])  # the machine's service store stays out
    return h


def test_ollama_names(home):
    root = home / ".ollama" / "models"
    _ollama_store(root, "smol", "latest", b"GGUF-a")
    _ollama_store(root, "smol", "q8", b"GGUF-b")
    _ollama_store(root, "tool", "v1", b"GGUF-c", ns="someone")
    m = stores.ollama_resolve("ollama:smol")
    assert m.model == root / "blobs" / f"sha256-{hashlib.sha256(b'GGUF-a').hexdigest()}"
    assert m.name == "smol:latest" and m.projector is None and m.size == 6
    assert stores.ollama_resolve("ollama:smol:q8").model.read_bytes() == b"GGUF-b"
    assert stores.ollama_resolve("ollama:someone/tool:v1").model.read_bytes() == b"GGUF-c"
    assert hub.resolve("ollama:smol:latest") == m.model
    with pytest.raises(stores.StoreError, match=r"no Ollama model smol:q4 in .*\(set OLLAMA_MODELS, or `ollama "
                                                r"pull smol:q4` first\)"):
        stores.ollama_resolve("ollama:smol:q4")
    with pytest.raises(stores.StoreError, match="is not an Ollama model name"):
        stores.ollama_resolve("ollama:../etc:passwd")
    assert issubclass(stores.StoreError, hub.HubError)


def test_ollama_hf_co_names_and_projector(home):
    root = home / ".ollama" / "models"
    mpath = _ollama_store(root, "Qwen2-Audio-GGUF", "Q4_K_M", b"GGUF-m", ns="someone", host="hf.co",
                          projector=b"GGUF-p")
    m = stores.ollama_resolve("ollama:hf.co/someone/Qwen2-Audio-GGUF:Q4_K_M")
    assert m.manifest == mpath and m.model.read_bytes() == b"GGUF-m" and m.projector.read_bytes() == b"GGUF-p"
    assert m.name == "hf.co/someone/Qwen2-Audio-GGUF:Q4_K_M"
    assert hub.find_mmproj("ollama:hf.co/someone/Qwen2-Audio-GGUF:Q4_K_M") == m.projector


def test_ollama_models_env_and_broken_manifests(home, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    _ollama_store(other, "smol", "latest", b"GGUF-x")
    monkeypatch.setenv("OLLAMA_MODELS", str(other))
    assert stores.ollama_dirs() == [other]
    assert stores.ollama_resolve("ollama:smol").model.read_bytes() == b"GGUF-x"
    mdir = other / "manifests" / "registry.ollama.ai" / "library"
    (mdir / "bad" ).mkdir()
    (mdir / "bad" / "latest").write_text("{not json")
    with pytest.raises(stores.StoreError, match="cannot read Ollama manifest"):
        stores.ollama_resolve("ollama:bad")
    (mdir / "nolayer").mkdir()
    (mdir / "nolayer" / "latest").write_text(json.dumps({"layers": [{"mediaType": "x", "digest": "sha256:00"}]}))
    with pytest.raises(stores.StoreError, match="has no application/vnd.ollama.image.model layer"):
        stores.ollama_resolve("ollama:nolayer")
    (mdir / "evil").mkdir()
    (mdir / "evil" / "latest").write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../etc/passwd"}]}))
    with pytest.raises(stores.StoreError, match="is not sha256:<64 hex digits>"):
        stores.ollama_resolve("ollama:evil")
    blob = stores.ollama_resolve("ollama:smol").model
    blob.unlink()
    with pytest.raises(stores.StoreError, match=r"the model blob of smol:latest is missing"):
        stores.ollama_resolve("ollama:smol")
    assert [m.name for m in stores.ollama_models()] == []  # broken entries are skipped in listings


def test_ollama_model_loads_and_chats_in_place(home, smollm2_path, capsys):
    root = home / ".ollama" / "models"
    _ollama_store(root, "smollm2", "135m", smollm2_path.read_bytes(), link_from=smollm2_path)
    before = _tree_state(root)
    m = d.load_model("ollama:smollm2:135m")
    blob = root / "blobs" / f"sha256-{hub.REGISTRY['smollm2-135m-instruct'].artifacts[0].sha256}"
    assert m.path == str(blob)  # the blob itself, mapped in place: no copy anywhere
    one = d.load_model(smollm2_path)
    replies = []
    for model in (one, m):
        chat = d.create_chat(model, max_new=12)
        d.add_user(chat, "Name a color.")
        replies.append(d.respond(model, chat, d.SamplingParams()))
    assert replies[0] == replies[1] and replies[0]
    assert cli.main(["chat", "--model", "ollama:smollm2:135m", "--max-tokens", "12", "Name a color."]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == replies[0].strip()
    assert "ollama:smollm2:135m (Ollama's store, read in place" in out.err
    assert _tree_state(root) == before
    assert not list((home.parent / "dl").glob("**/*.gguf"))  # and nothing copied into our cache


def test_list_finds_models_in_every_store(home, tmp_path, monkeypatch, capsys):
    # Ollama
    _ollama_store(home / ".ollama" / "models", "smol", "latest", b"GGUF" + bytes(100))
    # LM Studio: PUBLISHER/REPO/FILE.gguf under ~/.lmstudio/models (and the older ~/.cache/lm-studio/models)
    lm = home / ".lmstudio" / "models" / "lmstudio-community" / "Qwen3-1.7B-GGUF"
    lm.mkdir(parents=True)
    (lm / "Qwen3-1.7B-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(200))
    (lm / "mmproj-Qwen3-F16.gguf").write_bytes(b"GGUF")  # a projector is not listed as a model
    old = home / ".cache" / "lm-studio" / "models" / "TheBloke" / "X-GGUF"
    old.mkdir(parents=True)
    (old / "x.Q4_0.gguf").write_bytes(b"GGUF" + bytes(10))
    # llama.cpp's cache (-hf downloads), here through LLAMA_CACHE
    lc = tmp_path / "llamacache"
    lc.mkdir()
    (lc / "ggml-org_gemma-3-1b-it-GGUF_gemma-3-1b-it-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(30))
    for i in (1, 2):  # a split shows once, with both parts' bytes
        (lc / f"big-0000{i}-of-00002.gguf").write_bytes(b"GGUF" + bytes(50))
    monkeypatch.setenv("LLAMA_CACHE", str(lc))
    # The HF cache: models--ORG--REPO/{blobs,refs/main,snapshots/COMMIT/...} with symlinks into blobs
    hfc = tmp_path / "hfhome" / "hub"
    repo = hfc / "models--org--tiny-GGUF"
    commit = "a" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "blobs" / ("b" * 64)).write_bytes(b"GGUF" + bytes(60))
    (repo / "snapshots" / commit / "tiny-Q4_K_M.gguf").symlink_to(Path("../../blobs") / ("b" * 64))
    (repo / "snapshots" / commit / "tiny-Q8_0.gguf").symlink_to(Path("../../blobs") / ("c" * 64))  # dangling
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    stores_before = {p: _tree_state(p) for p in (home, lc, hfc)}

    found = {f.name: f for f in stores.found_models()}
    assert set(found) == {"ollama:smol:latest", str(lm / "Qwen3-1.7B-Q4_K_M.gguf"), str(old / "x.Q4_0.gguf"),
                          str(lc / "ggml-org_gemma-3-1b-it-GGUF_gemma-3-1b-it-Q4_K_M.gguf"),
                          str(lc / "big-00001-of-00002.gguf"), "hf:org/tiny-GGUF/tiny-Q4_K_M.gguf"}
    assert found["ollama:smol:latest"].store == "ollama" and found["ollama:smol:latest"].size == 104
    assert found[str(lc / "big-00001-of-00002.gguf")].size == 108
    assert found["hf:org/tiny-GGUF/tiny-Q4_K_M.gguf"].store == "hf"
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "found on this machine" in out
    for name in found:
        assert name in out
    assert "lmstudio: " in out and "llama.cpp: " in out and "hf: " in out and "ollama: " in out
    assert {p: _tree_state(p) for p in (home, lc, hfc)} == stores_before  # read only

    # HF_HUB_CACHE wins over HF_HOME.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nothing"))
    assert not [f for f in stores.found_models() if f.store == "hf"]


def test_list_with_no_stores(home, capsys):
    assert stores.found_models() == []
    assert cli.main(["list"]) == 0
    assert "found on this machine" not in capsys.readouterr().out
