"""Paged KV pool, prefix cache and media ids (reference §17.1.2 KVPool / PrefixCache, §17.1.4).

A :class:`KVPool` owns fixed pages of ``page_rows`` positions for all layers;
sessions made over it (``create_session(model, pool)``) hold a block table and
take pages as they grow. A :class:`PrefixCache` keeps finished sessions' full
pages keyed by a chained hash of the page ids (and a last partial page holding media
rows), so a later prompt with the same prefix attaches them instead of prefilling::

    pool = create_kv_pool(model, page_rows=64)
    cache = create_prefix_cache()
    s = create_session(model, pool)
    n = prefix_attach(cache, pool, s, prompt)     # 0 on a miss; never the whole prompt
    eval(model, s, prompt[n:])                    # prefill only the tail
    ...                                           # generate
    prefix_insert(cache, pool, s, s.history)      # donate the full pages
    release_kv_pages(s)

The pool and cache may be shared by threads (their bookkeeping is locked); a
session is used by one thread at a time. Keep the pool alive while its sessions
live, and call :func:`prefix_release` before dropping a cache you want emptied now.

Media ids: positions filled with embedding rows (audio, images) carry negative
ids derived from the media's content key (:func:`media_ids`), so the prefix
cache hashes and verifies them like tokens and the same clip in a later turn
matches. -1 is an anonymous row (no key) and is never cached.
"""
from __future__ import annotations

from typing import List, Sequence, Union

from . import _core
from .handles import KVDtype, KVPool, Model, PoolStats, PrefixCache, PrefixChain, Session  # noqa: F401

MEDIA_ID_ANONYMOUS = -1
_MEDIA_SPAN = 2 ** 31 - 2  # media ids lie in [-2^31 + 1, -2]


def create_kv_pool(model: Model, page_rows: int = 64, kv_dtype: KVDtype = KVDtype.f16,
                   max_pages: int = 0) -> KVPool:
    """A paged KV pool: pages of ``page_rows`` positions (a power of two) for every layer, in
    ``kv_dtype``. At most ``max_pages`` pages (0: four contexts of min(seq_len, 4096) rows);
    memory is taken page by page as sessions grow."""
    return KVPool(model, page_rows, kv_dtype, max_pages)


def release_kv_pages(session: Session) -> None:
    """Return a paged session's pages to its pool; it stays usable and starts over at position 0
    with an empty history. A no-op on flat sessions."""
    _core.release_kv_pages(session._s)


def create_prefix_cache(max_groups: int = 0) -> PrefixCache:
    """A prefix cache for the paged sessions of one pool. ``max_groups`` caps the pages it keeps
    (0: unbounded); past it, and whenever the pool runs out of free pages, the least recently
    used pages that no session holds go first (leaves of a chain before their parents)."""
    return PrefixCache(max_groups)


def _pool_of(pool: KVPool, session: Session) -> None:
    if session.pool is not pool:
        raise ValueError("the session was not created over this pool")


def prefix_attach(cache: PrefixCache, pool: KVPool, session: Session, prompt: Sequence[int]) -> int:
    """Attach the longest cached prefix of ``prompt`` to a fresh paged session of ``pool``.

    Matched pages join the session's block table and ``n_past`` moves past them, so the
    caller prefills only ``prompt[matched:]``. Returns the matched count: whole pages, plus
    the first rows of one more page where those hold media rows (an image or clip that ends
    mid-page is attached whole; the shared page is copied before the session writes to it),
    capped one token short of the prompt (the tail is never empty, so the tail's eval gives
    logits). Ids are verified on every hit, not only hashed.
    """
    _pool_of(pool, session)
    return _core.prefix_attach(cache._c, pool._p, session._s, [int(t) for t in prompt])


def prefix_insert(cache: PrefixCache, pool: KVPool, session: Session, tokens: Sequence[int],
                  preview: str = "") -> None:
    """Donate the session's full pages to the cache, and its last, partly filled page when that holds
    media rows (the session copies it before writing there again). ``tokens`` is the session's evaluated history
    (``session.history``; checked against it); only the first ``n_past`` rows exist. The donated
    pages survive :func:`release_kv_pages`. ``preview`` labels the chain in :func:`prefix_chain_list`."""
    _pool_of(pool, session)
    _core.prefix_insert(cache._c, pool._p, session._s, [int(t) for t in tokens], str(preview))


def prefix_chain_list(cache: PrefixCache) -> List[PrefixChain]:
    """Snapshot of the cache's live donations, oldest first."""
    return [PrefixChain(**d) for d in cache._c.chains()]


def prefix_held_groups(cache: PrefixCache) -> int:
    """Pages the cache holds now."""
    return cache._c.held()


def prefix_release(cache: PrefixCache, pool: KVPool) -> None:
    """Give every cached page back to ``pool`` and empty the cache (pages still used by live
    sessions stay alive until those sessions release them)."""
    cache._c.release(pool._p)


def media_ids(key: Union[bytes, str], n: int) -> List[int]:
    """``n`` negative ids for the positions of a media span with content key ``key`` (e.g. a
    digest of the audio samples or image bytes, plus anything that changes the rows, such as
    the encoder's name). The same key always gives the same ids; different keys collide with
    negligible probability, and the prefix cache compares ids on every hit anyway."""
    if n < 0:
        raise ValueError("n must be >= 0")
    import hashlib  # here: hashlib loads OpenSSL (~4 MB resident), and only media spans need it

    k = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    root = hashlib.blake2b(k, digest_size=32, person=b"dasllama-media").digest()
    out = []
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8, key=root).digest()
        out.append(-2 - int.from_bytes(h, "little") % _MEDIA_SPAN)
    return out


def is_media_position(id: int) -> bool:  # noqa: A002 - mirrors the reference's name
    """True for a position filled by an embedding row (a negative id) rather than a token."""
    return int(id) < 0
