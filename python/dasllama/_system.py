"""What this build and this machine can do: CPU features, kernel ISAs, backends."""
from __future__ import annotations

from . import _core

_ALL_BACKENDS = ("cpu", "cuda", "vulkan", "metal")


def system_info() -> dict:
    """CPU features, the compiled/supported/active kernel ISA and each backend's state.

    A backend that this build does not contain is reported as ``"not built"``;
    nothing pretends to run on a device it cannot reach.
    """
    info = _core.system_info()
    built = set(info.pop("backends_built").split(","))
    info["backends"] = {b: ("built" if b in built else "not built") for b in _ALL_BACKENDS}
    return info


def set_isa(name: str) -> None:
    """Force the CPU kernel ISA (``baseline``, ``avx2``, ``avx512``, ``neon``, ``i8mm``).

    The environment variable ``DASLLAMA_ISA`` does the same at start-up.
    Raises :class:`dasllama.DasllamaError` if this build or CPU cannot run it.
    """
    _core.set_isa(name)


def get_isa() -> str:
    """The CPU kernel ISA in use."""
    return _core.get_isa()
