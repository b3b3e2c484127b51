"""Where the CUDA backend finds cuBLAS (opened at run time, never linked: a wheel needs only the
driver). The loader's own search rarely sees the copies users have: pip's nvidia wheels (torch
pulls them in) and the toolkit's lib64. The first found goes to DASLLAMA_CUBLAS, which the
backend reads when its first f16 prefill asks for cuBLAS; a value already set is kept."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def _candidates() -> list[Path]:
    dirs: list[Path] = []
    for base in sys.path:
        if base:
            dirs += [Path(base) / "nvidia" / "cu13" / "lib", Path(base) / "nvidia" / "cublas" / "lib"]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs.append(Path(os.environ[env]) / "lib64")
    dirs.append(Path("/usr/local/cuda/lib64"))
    return dirs


def find_cublas() -> str | None:
    """The path of a libcublas.so (major 13 before 12), or None."""
    for major in ("13", "12"):
        for d in _candidates():
            p = d / f"libcublas.so.{major}"
            if p.is_file():
                return str(p)
    return None


def point_at_cublas() -> None:
    if os.environ.get("DASLLAMA_CUBLAS"):
        return
    try:
        p = find_cublas()
    except OSError:  # an unreadable path entry: the loader's own search then
        return
    if p:
        os.environ["DASLLAMA_CUBLAS"] = p
