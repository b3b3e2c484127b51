"""Models from the Hugging Face Hub: ``hf:ORG/REPO[@REV][:QUANT|/FILE.gguf]`` names.

Listing and downloads go through ``huggingface_hub`` (the ``hf`` extra), so HF_TOKEN,
HF_ENDPOINT, HF_HUB_OFFLINE, resumable downloads and the shared HF cache behave as
in every other Hub client; nothing is copied out of that cache. The quant pick follows
llama.cpp's ``-hf`` and Ollama's ``hf.co/`` names: a tag matches the quant label of a
file name case-insensitively (``:q4_k_m`` = ``:Q4_K_M``), no tag means Q4_K_M (or the
repo's only quant), and split files (``-00001-of-0000N.gguf``) come down together.
This module knows nothing of the PyPI registry (hub.py) or of other tools' stores.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .hub_errors import HubError

PREFIXES = ("hf:", "hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/")
DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"-(\d{5,})-of-(\d{5,})\.gguf$", re.IGNORECASE)
# A quant label at the end of a file stem: Q4_K_M, IQ3_XXS, Q8_0, UD-Q4_K_XL, F16, BF16, MXFP4_MOE, TQ1_0 ...
_QUANT = re.compile(r"(?:^|[-._])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|F16|F32|BF16|FP16|FP32|MXFP4(?:_MOE)?))$",
                    re.IGNORECASE)


class HFError(HubError):
    """A Hugging Face Hub name could not be resolved or downloaded."""


def is_hf_name(name: str) -> bool:
    return any(name.startswith(p) for p in PREFIXES)


@dataclass(frozen=True)
class HFRef:
    """A parsed ``hf:`` name."""

    repo: str
    revision: Optional[str] = None
    quant: Optional[str] = None  # the :TAG, as typed
    file: Optional[str] = None   # a path inside the repo


@dataclass
class HFModel:
    """What a name resolved to in one repository: the model's file(s) and the repo's mmproj, if any."""

    repo: str
    revision: Optional[str]
    files: List[str]                       # the model: one file, or every split part in order
    quant: Optional[str]                   # the picked file's quant label
    mmproj: Optional[str] = None           # a projector (vision / audio tower) file in the repo
    mmproj_all: List[str] = field(default_factory=list)

    @property
    def file(self) -> str:
        return self.files[0]


def parse(name: str) -> HFRef:
    """``hf:ORG/REPO``, ``hf:ORG/REPO:Q4_K_M``, ``hf:ORG/REPO/dir/FILE.gguf``, ``@REV`` after REPO;
    ``hf.co/`` and ``huggingface.co/`` (Ollama's spelling) work the same."""
    rest = name
    for p in sorted(PREFIXES, key=len, reverse=True):
        if rest.startswith(p):
            rest = rest[len(p):]
            break
    else:
        raise HFError(f"{name!r} is not a Hub name (hf:ORG/REPO[:QUANT|/FILE.gguf])")
    quant = None
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise HFError(f"{name!r}: expected hf:ORG/REPO[:QUANT|/FILE.gguf]")
    org, repo_part, path = parts[0], parts[1], "/".join(parts[2:])
    if path:  # a file inside the repo; a tag makes no sense after it
        file = path
        if not file.lower().endswith(".gguf"):
            raise HFError(f"{name!r}: a file in the repo must be a .gguf file")
    else:
        file = None
        if ":" in repo_part:
            repo_part, quant = repo_part.split(":", 1)
            if not quant:
                raise HFError(f"{name!r}: empty quant tag after ':'")
    revision = None
    if "@" in repo_part:
        repo_part, revision = repo_part.split("@", 1)
        if not revision:
            raise HFError(f"{name!r}: empty revision after '@'")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", org) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*",
                                                                                 repo_part):
        raise HFError(f"{name!r}: {org}/{repo_part} is not a valid repository id")
    return HFRef(f"{org}/{repo_part}", revision, quant, file)


def quant_label(path: str) -> Optional[str]:
    """The quant label a GGUF file name carries (``Q4_K_M`` of ``Model-Q4_K_M-00001-of-00002.gguf``), upper-cased."""
    stem = _SPLIT.sub("", os.path.basename(path))
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    m = _QUANT.search(stem)
    if m:
        return m.group(1).upper()
    # A quant folder (bartowski / unsloth put big splits in Q8_0/...).
    folder = os.path.basename(os.path.dirname(path))
    m = _QUANT.search(folder)
    return m.group(1).upper() if m and m.start(1) == 0 else None


def _is_mmproj(path: str) -> bool:
    return "mmproj" in os.path.basename(path).lower()


def _split_key(path: str) -> Tuple[str, int, int]:
    m = _SPLIT.search(path)
    return (path[: m.start()], int(m.group(1)), int(m.group(2))) if m else (path, 0, 0)


def _group(files: List[str]) -> Dict[str, List[str]]:
    """Model files grouped: a single file -> [file]; a split -> its parts in order, keyed by part 1."""
    groups: Dict[str, List[str]] = {}
    splits: Dict[Tuple[str, int], List[Tuple[int, str]]] = {}
    for f in sorted(files):
        prefix, no, count = _split_key(f)
        if count:
            splits.setdefault((prefix, count), []).append((no, f))
        else:
            groups[f] = [f]
    for (prefix, count), parts in splits.items():
        parts.sort()
        if [n for n, _ in parts] != list(range(1, count + 1)):
            have = ", ".join(str(n) for n, _ in parts)
            raise HFError(f"the repository lists parts {have} of {count} of {os.path.basename(prefix)}: incomplete split")
        groups[parts[0][1]] = [f for _, f in parts]
    return groups


def _pick_mmproj(mmprojs: List[str]) -> Optional[str]:
    if not mmprojs:
        return None
    # Full precision first: towers are small, and f16 is what most repos mean by "the" mmproj.
    for pref in ("F16", "BF16", "F32", "Q8_0"):
        for f in sorted(mmprojs):
            if quant_label(f) == pref:
                return f
    return sorted(mmprojs)[0]


def choose(ref: HFRef, files: List[str]) -> HFModel:
    """Pick the model file(s) for ``ref`` among a repository's ``files`` (paths)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    mmprojs = [f for f in ggufs if _is_mmproj(f)]
    models = _group([f for f in ggufs if not _is_mmproj(f)])
    where = f"{ref.repo}" + (f"@{ref.revision}" if ref.revision else "")
    if ref.file is not None:
        if ref.file in models:
            picked = ref.file
        elif ref.file in mmprojs:
            raise HFError(f"{ref.file} in {where} is a projector (mmproj), not a language model")
        else:
            owner = [k for k, parts in models.items() if ref.file in parts]
            if owner:
                raise HFError(f"{ref.file} is a later part of a split model; name its first part {owner[0]}")
            listing = ", ".join(sorted(models)) or "no GGUF files"
            raise HFError(f"{where} has no file {ref.file} (it has: {listing})")
    else:
        if not models:
            raise HFError(f"{where} has no GGUF model files" + (" (only mmproj files)" if mmprojs else ""))
        labels: Dict[str, List[str]] = {}
        for key in models:
            labels.setdefault(quant_label(key) or "?", []).append(key)
        available = ", ".join(sorted(labels))
        tag = ref.quant.upper() if ref.quant else None
        if tag is not None:
            hits = labels.get(tag, [])
            if not hits:
                raise HFError(f"{where} has no {ref.quant} file; available quants: {available}")
        elif DEFAULT_QUANT in labels:
            hits = labels[DEFAULT_QUANT]
        elif len(models) == 1:
            hits = list(models)
        else:
            raise HFError(f"{where} has no {DEFAULT_QUANT} file and several others; pick one with "
                          f"hf:{ref.repo}:QUANT (available quants: {available})")
        if len(hits) > 1:
            raise HFError(f"{where} has several {tag or DEFAULT_QUANT} files ({', '.join(hits)}); "
                          f"name one with hf:{ref.repo}/FILE.gguf")
        picked = hits[0]
    return HFModel(ref.repo, ref.revision, models[picked], quant_label(picked), _pick_mmproj(mmprojs), sorted(mmprojs))


# ---- huggingface_hub -------------------------------------------------------------------

def _hfh():
    try:
        import huggingface_hub
    except ImportError as e:
        raise HFError("Hugging Face Hub names need huggingface_hub: pip install 'dasllama[hf]'") from e
    return huggingface_hub


def _explain(e: BaseException, ref: HFRef, what: str) -> HFError:
    """One clear HFError for each way huggingface_hub fails."""
    from huggingface_hub import constants, errors

    where = ref.repo + (f"@{ref.revision}" if ref.revision else "")
    if isinstance(e, errors.GatedRepoError):
        return HFError(f"{where} is gated: accept its terms on the model page and set HF_TOKEN "
                       f"(or run `hf auth login`) to a token that has access")
    if isinstance(e, errors.RevisionNotFoundError):
        return HFError(f"{where}: no such revision on {constants.ENDPOINT}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HFError(f"no repository {ref.repo} on {constants.ENDPOINT} (if it is private, set HF_TOKEN)")
    if isinstance(e, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
        return HFError(f"{where} has no file {what}")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        mode = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        return HFError(f"{mode} and {what} of {where} is not in the HF cache ({constants.HF_HUB_CACHE})")
    if isinstance(e, errors.HfHubHTTPError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return HFError(f"{where}: {first}")
    return HFError(f"{where}: {type(e).__name__}: {e}")


def _cached_files(ref: HFRef) -> Optional[List[str]]:
    """Files of the cached snapshot of ref's revision (offline listing), or None if none is cached."""
    hfh = _hfh()
    try:
        snap = hfh.snapshot_download(ref.repo, revision=ref.revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - any failure here just means "nothing cached"
        return None
    out = []
    for dp, _, fns in os.walk(snap):
        for fn in fns:
            out.append(os.path.relpath(os.path.join(dp, fn), snap).replace(os.sep, "/"))
    return out


def list_files(ref: HFRef) -> Tuple[List[str], bool]:
    """The repository's files, from the Hub's repo info or (offline, or the Hub unreachable)
    from the cached snapshot; the flag says which (True: the cache)."""
    hfh = _hfh()
    from huggingface_hub import constants, errors

    offline_errors: tuple = (errors.OfflineModeIsEnabled,)
    for transport in ("httpx2", "httpx"):  # whichever HTTP client this huggingface_hub is built on
        try:
            mod = __import__(transport)
            offline_errors += (mod.ConnectError, mod.TimeoutException)
        except (ImportError, AttributeError):
            pass
    if not constants.HF_HUB_OFFLINE:
        # The repo info's siblings, as snapshot_download lists a repo: one request, not retried.
        # (list_repo_files retries a refused connection for 23 s before failing.)
        try:
            info = hfh.HfApi().model_info(ref.repo, revision=ref.revision or constants.DEFAULT_REVISION)
            return [s.rfilename for s in info.siblings or []], False
        except offline_errors:
            pass  # fall through to the cache, like hf_hub_download does
        except Exception as e:  # noqa: BLE001
            raise _explain(e, ref, "the file list") from None
    cached = _cached_files(ref)
    if cached is None:
        mode = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        raise HFError(f"{mode} and {ref.repo} is not in the HF cache ({constants.HF_HUB_CACHE})")
    return cached, True


def resolve_name(name: str) -> HFModel:
    """List the repository and pick the model file(s) for ``name`` (nothing downloaded)."""
    ref = parse(name)
    files, from_cache = list_files(ref)
    try:
        return choose(ref, files)
    except HFError as e:
        if from_cache:
            raise HFError(f"{e} (offline: the HF cache holds only these)") from None
        raise


def download(repo: str, filename: str, revision: Optional[str] = None, progress: bool = True) -> Path:
    """One file through huggingface_hub into the shared HF cache; returns its path there."""
    hfh = _hfh()
    ref = HFRef(repo, revision)
    try:
        if not progress:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        return Path(hfh.hf_hub_download(repo, filename, revision=revision))
    except Exception as e:  # noqa: BLE001
        raise _explain(e, ref, filename) from None
    finally:
        if not progress:
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()


def pull(name: str, *, mmproj: bool = False, progress: bool = True) -> Tuple[Path, Optional[Path], HFModel]:
    """Download a Hub model (every split part) and, with ``mmproj=True``, its projector.

    Returns (path of the model's first file, path of the mmproj or None, what was picked).
    """
    m = resolve_name(name)
    paths = [download(m.repo, f, m.revision, progress) for f in m.files]
    proj = download(m.repo, m.mmproj, m.revision, progress) if (mmproj and m.mmproj) else None
    # Split parts sit side by side in the snapshot folder, as the reader expects.
    return paths[0], proj, m
