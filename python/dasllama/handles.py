"""The wrapper classes over the C++ handles: Model, Session, KVPool, PrefixCache and their records.

A leaf of the package (it imports only _core): llm.py and kv.py hold the functions over these
objects, the chat layer, media and the server use their public properties, never the handles.
"""
from __future__ import annotations

import enum
import functools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


from . import _core


class QuantMode(enum.IntEnum):
    """Weight representation picked at load: fp32 (the reference), q8 (fast path), q4_0."""

    fp32 = 0
    q8 = 1
    q4_0 = 2


class KVDtype(enum.IntEnum):
    """KV-cache codec of a session: f32 (bit-exact reference), f16 (default), q8_0."""

    f32 = 0
    f16 = 1
    q8_0 = 8


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_size: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    norm_eps: float
    n_rot: int
    rope_base: float
    rope_base_swa: float
    rope_freq_scale: float
    rope_scaling: str
    sliding_window: int
    attn_softcap: float
    final_softcap: float
    # M-RoPE sections (rope.dimension_sections; empty for plain rope): image rows take grid positions
    rope_sections: tuple = ()
    # Deepstack layers (Qwen3-VL): image rows also carry features added after the first n layers
    n_deepstack: int = 0


class Model:
    """A loaded GGUF model and its tokenizer (see :func:`load_model`)."""

    def __init__(self, core: "_core.Model", path: str, mode: QuantMode):
        self._m = core
        self.path = path
        self.mode = mode
        cfg = dict(core.config)
        cfg["rope_sections"] = tuple(cfg.get("rope_sections", ()))
        self.config = ModelConfig(**cfg)
        self.arch = self.config.arch

    @property
    def device(self) -> str:
        """Where the weights and KV cache live: ``"cpu"``, ``"cuda:N"`` or ``"vulkan:N"``."""
        d = self._m.device
        return "cpu" if d["backend"] == "cpu" else f"{d['backend']}:{d['index']}"

    @property
    def device_info(self) -> dict:
        """The backend's device: name, memory (on a GPU), compute capability, driver, threads (CPU)."""
        return dict(self._m.device)

    @property
    def eog_ids(self) -> List[int]:
        """End-of-generation ids: eos, eot, eom and the control tokens chat templates end turns with."""
        return list(self._m.eog_ids)

    @functools.cached_property
    def chat_meta(self) -> Dict[str, Optional[str]]:
        """The file's chat template (``template``, None when absent) and bos / eos token texts."""
        return dict(self._m.chat_meta)

    def __repr__(self) -> str:
        c = self.config
        where = f"threads={self._m.n_threads}" if self.device == "cpu" else f"device={self.device!r}"
        return (f"Model({os.path.basename(self.path)!r}, arch={c.arch!r}, layers={c.n_layers}, dim={c.dim}, "
                f"vocab={c.vocab_size}, mode={self.mode.name}, {where})")


class Session:
    """One generation stream: KV cache, position ``n_past`` and the last ``logits``.

    Flat sessions own a cache of ``n_ctx`` rows; paged sessions (made over a
    :class:`~dasllama.KVPool`) take pages from the pool as rows are written.
    """

    def __init__(self, model: Model, kv_dtype: KVDtype = KVDtype.f16, n_ctx: int = 0,
                 pool: Optional["KVPool"] = None):
        self.model = model
        self.pool = pool
        if pool is not None:
            if pool.model is not model:
                raise ValueError("the pool was made for another model")
            self._s = _core.Session(model._m, pool._p, int(n_ctx))
        else:
            self._s = _core.Session(model._m, int(kv_dtype), int(n_ctx))

    @property
    def n_past(self) -> int:
        return self._s.n_past

    @property
    def rope_marks(self) -> List[Tuple[int, int]]:
        """M-RoPE position marks ``[(position, delta)]``: rows at or after a mark rope at their position plus
        its delta (an image advances the rope position by max(grid_h, grid_w), not by its rows). Set after a
        prefix cache attach to restore those of the images inside the attached prefix."""
        return [tuple(m) for m in self._s.rope_marks]

    @rope_marks.setter
    def rope_marks(self, marks) -> None:
        self._s.rope_marks = [(int(p), int(dl)) for p, dl in marks]

    @property
    def n_ctx(self) -> int:
        return self._s.n_ctx

    @property
    def kv_dtype(self) -> KVDtype:
        return KVDtype(self._s.kv_dtype)

    @property
    def paged(self) -> bool:
        return self._s.paged

    @property
    def n_pages(self) -> int:
        """Pool pages in this session's block table (0 for a flat session)."""
        return self._s.n_pages

    @property
    def history(self) -> List[int]:
        """Ids evaluated so far, one per position (media rows as negative ids)."""
        return self._s.history

    def truncate(self, n: int) -> None:
        """Rewind to position ``n`` (<= n_past). On a paged session the pages past ``n`` go back
        to the pool, and a page shared with the prefix cache or another session is copied
        before it is written again."""
        self._s.truncate(int(n))

    def rewind_point(self, n: int) -> int:
        """The position at or before ``n`` that :meth:`truncate` can rewind to: ``n`` itself for a
        model that keeps only KV; for a hybrid model (recurrent layers) the latest position whose
        recurrent state the session still has (0, ``n_past``, or a snapshot)."""
        return self._s.rewind_point(int(n))

    @property
    def logits(self) -> np.ndarray:
        """Logits of the last evaluated row: a view valid until the next eval (copy to keep)."""
        return self._s.logits

    def __repr__(self) -> str:
        kind = f", pages={self._s.n_pages}" if self.paged else ""
        return f"Session(n_past={self.n_past}, n_ctx={self.n_ctx}, kv={self.kv_dtype.name}{kind})"


@dataclass(frozen=True)
class PoolStats:
    """Pages of a pool: ``free + used == total``; ``by_sessions`` and ``by_cache`` count pages held
    by at least one session / by the prefix cache (``shared`` by both, so they may overlap);
    ``allocated`` pages were handed out at least once (memory is committed as they are written)."""

    page_rows: int
    page_bytes: int
    total: int
    free: int
    used: int
    by_sessions: int
    by_cache: int
    shared: int
    allocated: int


@dataclass(frozen=True)
class PrefixChain:
    """One donation to the prefix cache (prefix_chain_list): page-covered tokens, pages still
    cached, attaches that ended in it, born / last-hit ticks, and the caller's preview."""

    tokens: int
    live_pages: int
    hits: int
    born: int
    last_hit: int
    preview: str


class KVPool:
    """A paged KV pool over one model's cache geometry (see :func:`create_kv_pool`)."""

    def __init__(self, model: Model, page_rows: int = 64, kv_dtype: KVDtype = KVDtype.f16, max_pages: int = 0):
        self.model = model
        self._p = _core.KVPool(model._m, int(page_rows), int(KVDtype(kv_dtype)), int(max_pages))

    @property
    def page_rows(self) -> int:
        return self._p.page_rows

    @property
    def max_pages(self) -> int:
        return self._p.max_pages

    @property
    def kv_dtype(self) -> KVDtype:
        return KVDtype(self._p.kv_dtype)

    def stats(self) -> PoolStats:
        return PoolStats(**self._p.stats())

    def __repr__(self) -> str:
        st = self.stats()
        return (f"KVPool(page_rows={st.page_rows}, kv={self.kv_dtype.name}, pages {st.used}/{st.total} used, "
                f"{st.by_cache} cached, {st.page_bytes / 2**20:.2f} MiB/page)")


class PrefixCache:
    """A page-granular prefix cache over one pool's sessions (see :func:`create_prefix_cache`)."""

    def __init__(self, max_groups: int = 0):
        self._c = _core.PrefixCache(int(max_groups))

    @property
    def max_groups(self) -> int:
        return self._c.max_groups

    @property
    def max_states(self) -> int:
        """The budget of recurrent-state snapshots kept with cached pages (hybrid models such as
        Qwen3.5; each snapshot is one model's whole recurrent state). Past it the least recently
        used page gives up its snapshot; the page stays. Default 16."""
        return self._c.max_states

    @max_states.setter
    def max_states(self, n: int) -> None:
        self._c.max_states = int(n)

    @property
    def states_held(self) -> int:
        """Recurrent-state snapshots held now (freed with their pages)."""
        return self._c.states_held()

    def __repr__(self) -> str:
        return f"PrefixCache(pages={self._c.held()}, max_groups={self.max_groups or 'unbounded'})"


