"""How much memory a model will take, per QuantMode and context, before anything is allocated."""
from __future__ import annotations

from dataclasses import dataclass

from . import _core
from .llm import KVDtype, QuantMode


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a load plus one session of ``n_ctx`` rows takes of the device's memory.

    ``weights`` are resident in the backend's format (on the CPU the packed layouts; the
    file's pages are given back after packing); ``embd_table`` is the part of it read in
    place from the mapped file, paged in by the rows used (0 when the output matrix is tied
    to it and packed). ``scratch`` is approximate. ``available`` is the host memory
    available now (MemAvailable, capped by a cgroup limit; 0 when unknown or on a GPU).
    """

    mode: QuantMode
    n_ctx: int
    weights: int
    embd_table: int
    kv: int
    scratch: int
    total: int
    available: int

    @property
    def fits(self) -> bool:
        return self.available == 0 or self.total <= self.available


def estimate_memory(model: str, mode: QuantMode = QuantMode.q8, n_ctx: int = 4096,
                    kv_dtype: KVDtype = KVDtype.f16, device: str = "cpu") -> MemoryEstimate:
    """Memory a ``load_model(model, mode)`` and one ``create_session(n_ctx=...)`` will take.

    Reads only the file's header and shapes: nothing is converted, packed or allocated.
    ``model`` is a path or a registry name (resolved from the cache, as ``load_model`` does).
    """
    from . import hub

    path = str(hub.resolve(model))
    d = _core.estimate_memory(path, int(QuantMode(mode)), device, int(n_ctx), int(KVDtype(kv_dtype)))
    return MemoryEstimate(mode=QuantMode(mode), n_ctx=int(n_ctx), **d)
