"""Other tools' model stores, read in place: Ollama names (``ollama:NAME[:TAG]``) and the
GGUFs found where Ollama, LM Studio, llama.cpp and the Hugging Face cache keep them.

Nothing here writes into another tool's store: manifests and folders are only read,
and a model resolves to the file that is already there (mmapped, never copied).
Layouts, as each tool lays them out:

* Ollama: ``$OLLAMA_MODELS`` (default ``~/.ollama/models``; the Linux service uses
  ``/usr/share/ollama/.ollama/models``) holds ``manifests/HOST/NAMESPACE/NAME/TAG`` (a
  JSON image manifest, ``HOST`` = ``registry.ollama.ai``, ``NAMESPACE`` = ``library``
  for plain names) and ``blobs/sha256-HEX``; the layer with mediaType
  ``application/vnd.ollama.image.model`` is the GGUF, ``...image.projector`` its mmproj.
* LM Studio: ``~/.lmstudio/models/PUBLISHER/REPO/FILE.gguf`` (older versions:
  ``~/.cache/lm-studio/models``).
* llama.cpp: ``$LLAMA_CACHE``, else ``~/.cache/llama.cpp`` (``-hf`` downloads).
* Hugging Face: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``,
  with ``models--ORG--REPO/snapshots/COMMIT/PATH``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from .hub_errors import HubError

OLLAMA_PREFIX = "ollama:"
MODEL_MEDIA = "application/vnd.ollama.image.model"
PROJECTOR_MEDIA = "application/vnd.ollama.image.projector"
_DEFAULT_HOST = "registry.ollama.ai"
_DEFAULT_NS = "library"
_SPLIT_LATER = re.compile(r"-(\d{5,})-of-\d{5,}\.gguf$", re.IGNORECASE)
_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StoreError(HubError):
    """A name in another tool's store could not be resolved."""


# ---- Ollama -------------------------------------------------------------------------------

def ollama_dirs() -> List[Path]:
    """Where Ollama keeps models: $OLLAMA_MODELS alone when set, else the user and service defaults."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def _ollama_parts(name: str) -> Tuple[str, str, str, str]:
    """NAME[:TAG], NS/NAME[:TAG] or HOST/NS/NAME[:TAG] -> (host, namespace, name, tag), like `ollama pull`."""
    ref = name[len(OLLAMA_PREFIX):] if name.startswith(OLLAMA_PREFIX) else name
    tag = "latest"
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        ref, tag = ref.rsplit(":", 1)
    parts = ref.split("/")
    if len(parts) == 1:
        host, ns, model = _DEFAULT_HOST, _DEFAULT_NS, parts[0]
    elif len(parts) == 2:
        host, (ns, model) = _DEFAULT_HOST, parts
    else:
        host, ns, model = parts[0], "/".join(parts[1:-1]), parts[-1]
    for p in [host, model, tag, *ns.split("/")]:
        if not _NAME_PART.fullmatch(p or ""):
            raise StoreError(f"{name!r} is not an Ollama model name (ollama:NAME[:TAG])")
    return host, ns, model, tag


@dataclass(frozen=True)
class OllamaModel:
    name: str            # as `ollama list` shows it: NAME:TAG (with NS/ or HOST/NS/ when not the default)
    manifest: Path
    model: Path          # the GGUF blob, read in place
    projector: Optional[Path]
    size: int


def _blob(root: Path, digest: str, manifest: Path) -> Path:
    m = re.fullmatch(r"sha256[:-]([0-9a-f]{64})", digest or "")
    if not m:
        raise StoreError(f"{manifest}: layer digest {digest!r} is not sha256:<64 hex digits>")
    return root / "blobs" / f"sha256-{m.group(1)}"


def _read_manifest(root: Path, manifest: Path, shown: str) -> OllamaModel:
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise StoreError(f"cannot read Ollama manifest {manifest}: {e}") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list):
        raise StoreError(f"Ollama manifest {manifest} has no layers list")
    model = proj = None
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        if layer.get("mediaType") == MODEL_MEDIA and model is None:
            model = _blob(root, layer.get("digest"), manifest)
        elif layer.get("mediaType") == PROJECTOR_MEDIA and proj is None:
            proj = _blob(root, layer.get("digest"), manifest)
    if model is None:
        raise StoreError(f"Ollama manifest {manifest} has no {MODEL_MEDIA} layer")
    if not model.is_file():
        raise StoreError(f"the model blob of {shown} is missing: {model} (run `ollama pull {shown}`)")
    return OllamaModel(shown, manifest, model, proj if proj is not None and proj.is_file() else None,
                       model.stat().st_size)


def _shown(host: str, ns: str, model: str, tag: str) -> str:
    if host == _DEFAULT_HOST:
        return f"{model}:{tag}" if ns == _DEFAULT_NS else f"{ns}/{model}:{tag}"
    return f"{host}/{ns}/{model}:{tag}"


def ollama_resolve(name: str) -> OllamaModel:
    """``ollama:NAME[:TAG]`` -> the model's GGUF blob in Ollama's store (and its projector, if any)."""
    host, ns, model, tag = _ollama_parts(name)
    shown = _shown(host, ns, model, tag)
    tried = []
    for root in ollama_dirs():
        manifest = root / "manifests" / host / Path(*ns.split("/")) / model / tag
        tried.append(str(manifest))
        if manifest.is_file():
            return _read_manifest(root, manifest, shown)
    where = " or ".join(str(d) for d in ollama_dirs())
    raise StoreError(f"no Ollama model {shown} in {where} (set OLLAMA_MODELS, or `ollama pull {shown}` first)")


def ollama_models() -> List[OllamaModel]:
    out = []
    for root in ollama_dirs():
        mdir = root / "manifests"
        if not mdir.is_dir():
            continue
        for manifest in sorted(p for p in mdir.rglob("*") if p.is_file()):
            rel = manifest.relative_to(mdir).parts
            if len(rel) < 4:
                continue
            host, ns, model, tag = rel[0], "/".join(rel[1:-2]), rel[-2], rel[-1]
            try:
                out.append(_read_manifest(root, manifest, _shown(host, ns, model, tag)))
            except StoreError:
                continue  # a manifest of something that is not a GGUF model, or a half-pulled one
    return out


# ---- discovery for `dasllama list` ----------------------------------------------------------

@dataclass(frozen=True)
class FoundModel:
    store: str   # "ollama", "lmstudio", "llama.cpp", "hf"
    name: str    # what to pass to --model / load_model
    path: Path
    size: int    # bytes (all parts of a split)


def lmstudio_dirs() -> List[Path]:
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def llama_cpp_dir() -> Path:
    env = os.environ.get("LLAMA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llama.cpp"


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _size(path: Path) -> int:
    """Bytes of a file, or of every part of a split named after it."""
    try:
        m = re.search(r"-00001-of-(\d{5,})\.gguf$", path.name)
        if not m:
            return path.stat().st_size
        n = int(m.group(1))
        stem = path.name[: m.start()]
        return sum((path.parent / f"{stem}-{i:05d}-of-{m.group(1)}.gguf").stat().st_size for i in range(1, n + 1))
    except OSError:
        return 0


def _ggufs(root: Path) -> Iterator[Path]:
    """GGUF models under root: later split parts and mmproj files left out."""
    if not root.is_dir():
        return
    for dp, dns, fns in os.walk(root, followlinks=False):
        dns.sort()
        for fn in sorted(fns):
            if not fn.lower().endswith(".gguf") or "mmproj" in fn.lower():
                continue
            m = _SPLIT_LATER.search(fn)
            if m and int(m.group(1)) != 1:
                continue
            yield Path(dp) / fn


def found_models() -> List[FoundModel]:
    """GGUF models the usual tools keep on this machine (read only)."""
    out: List[FoundModel] = []
    for m in ollama_models():
        out.append(FoundModel("ollama", OLLAMA_PREFIX + m.name, m.model, m.size))
    for root in lmstudio_dirs():
        for p in _ggufs(root):
            out.append(FoundModel("lmstudio", str(p), p, _size(p)))
    for p in _ggufs(llama_cpp_dir()):
        out.append(FoundModel("llama.cpp", str(p), p, _size(p)))
    hf = hf_cache_dir()
    if hf.is_dir():
        for repo_dir in sorted(hf.glob("models--*")):
            repo = repo_dir.name[len("models--"):].replace("--", "/", 1)
            snaps = repo_dir / "snapshots"
            for snap in sorted(snaps.iterdir()) if snaps.is_dir() else []:
                for p in _ggufs(snap):
                    if not p.exists():  # a dangling link: the blob is still downloading or was removed
                        continue
                    rel = p.relative_to(snap).as_posix()
                    rev = _ref_of(repo_dir, snap.name)
                    name = f"hf:{repo}{'@' + rev if rev else ''}/{rel}"
                    out.append(FoundModel("hf", name, p, _size(p)))
    return out


def _ref_of(repo_dir: Path, commit: str) -> Optional[str]:
    """'' when refs/main points at the commit (the default revision), else the commit itself."""
    try:
        if (repo_dir / "refs" / "main").read_text().strip() == commit:
            return ""
    except OSError:
        pass
    return commit
