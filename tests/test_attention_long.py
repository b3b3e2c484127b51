"""CPU paged attention at long context, on every kernel ISA: against numpy in float64 over exactly
what the cache stores (f16 / q8_0 rows as numpy and gguf-py encode them), and bitwise between a
row decoded alone and the same row inside a prefill (a decode step scores keys where they lie,
a prefill block through a transposed tile; both must sum in one order)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize as g_dequantize
from gguf.quants import quantize as g_quantize

import dasllama
from dasllama import _core

ISAS = dasllama.system_info()["isa_supported"]
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}


@pytest.fixture
def restore_isa():
    before = dasllama.get_isa()
    yield
    dasllama.set_isa(before)


def stored(x, kv):
    if kv == "f32":
        return x.astype(np.float64)
    if kv == "f16":
        return x.astype(np.float16).astype(np.float64)
    return g_dequantize(g_quantize(x, T.Q8_0), T.Q8_0).astype(np.float64)


def reference(q, k, v, q_pos, H, KVH, hd, window, scale):
    out = np.zeros((q.shape[0], H * hd))
    g = H // KVH
    j = np.arange(k.shape[0])
    for t in range(q.shape[0]):
        vis = (j <= q_pos[t]) & ((q_pos[t] - j < window) if window else True)
        for h in range(H):
            kh = (h // g) * hd
            s = np.where(vis, k[:, kh:kh + hd] @ q[t, h * hd:(h + 1) * hd].astype(np.float64) * scale, -np.inf)
            p = np.exp(s - s.max())
            out[t, h * hd:(h + 1) * hd] = (p / p.sum()) @ v[:, kh:kh + hd]
    return out


def run(be, q, k, v, q_pos, H, KVH, hd, kv, window, P=64, seed=0):
    n_pages = -(-k.shape[0] // P)
    ids = np.random.default_rng(seed).permutation(n_pages + 1)[:n_pages].astype(np.int32)
    return be.paged_attention(q, k, v, np.asarray(q_pos, np.int32), H, KVH, hd, KV_TYPES[kv], P, ids, n_pages + 1,
                              window, 1 / math.sqrt(hd), 0.0, 512)[0]


# (heads, kv heads, head_dim, window): SmolLM2-135M, Gemma-3-270M's sliding layers, a head_dim
# that is not a multiple of 16, and enough KV heads that a decode step is not split by head.
SHAPES = [(9, 3, 64, 0), (4, 1, 256, 512), (4, 2, 40, 0), (16, 8, 64, 0)]
# A q8_0 cache needs head_dim a multiple of 32 (the backend refuses others).
CASES = [(s, kv) for s in SHAPES for kv in KV_TYPES if kv != "q8_0" or s[2] % 32 == 0]


@pytest.mark.parametrize("shape,kv", CASES, ids=lambda c: str(c))
def test_long_context_matches_numpy(shape, kv, restore_isa):
    H, KVH, hd, window = shape
    n_kv = 4133
    rng = np.random.default_rng(hd + H)
    k = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    q = (rng.standard_normal((19, H * hd)) * 2).astype(np.float32)
    q_pos = np.arange(n_kv - 19, n_kv)
    ref = reference(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, window, 1 / math.sqrt(hd))
    be = _core.Backend("cpu")
    for isa in ISAS:
        dasllama.set_isa(isa)
        for rows in (slice(18, 19), slice(0, 19)):  # a decode step, then a prefill of 19 rows
            out = run(be, q[rows], k, v, q_pos[rows], H, KVH, hd, kv, window).astype(np.float64)
            err = np.mean((out - ref[rows]) ** 2) / np.mean(ref[rows] ** 2)
            assert err < 1e-9, (isa, rows, err)


@pytest.mark.parametrize("shape,kv", CASES, ids=lambda c: str(c))
def test_decode_equals_prefill_bitwise(shape, kv, restore_isa):
    H, KVH, hd, window = shape
    n_kv = 1111
    rng = np.random.default_rng(7 * hd + H)
    k = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    q = (rng.standard_normal((40, H * hd)) * 3).astype(np.float32)
    q_pos = np.arange(n_kv - 40, n_kv)
    be = _core.Backend("cpu")
    for isa in ISAS:
        dasllama.set_isa(isa)
        full = run(be, q, k, v, q_pos, H, KVH, hd, kv, window)
        for t in (0, 1, 17, 39):  # rows of the first and last blocks, each decoded alone over its keys
            p = int(q_pos[t])
            one = run(be, q[t:t + 1], k[:p + 1], v[:p + 1], [p], H, KVH, hd, kv, window, seed=t)
            np.testing.assert_array_equal(one[0], full[t], err_msg=f"{isa} row {t}")
        # A short prefill (a few rows: the decode path's scoring) against the long one.
        few = run(be, q[36:39], k[:int(q_pos[38]) + 1], v[:int(q_pos[38]) + 1], q_pos[36:39], H, KVH, hd, kv, window)
        np.testing.assert_array_equal(few, full[36:39], err_msg=f"{isa} rows 36..38")


# Encoder shapes (every row sees every key, any_order): whisper tiny's 6 x 64, the tiny ASR model's
# 4 x 16, a head_dim that is not a multiple of 64, grouped heads, and key counts off the kernel's
# 64-key blocks. The CPU runs its blocked dense kernel there (another summation order than the
# paged kernel's), so the bar is numpy's float64 result, as for the decoder's.
DENSE = [(6, 6, 64, 1500), (4, 4, 16, 1500), (4, 4, 80, 37), (8, 2, 64, 200), (6, 6, 64, 16)]


@pytest.mark.parametrize("shape", DENSE, ids=lambda c: str(c))
def test_encoder_attention_matches_numpy(shape, restore_isa):
    H, KVH, hd, n = shape
    rng = np.random.default_rng(n + hd)
    k = rng.standard_normal((n, KVH * hd)).astype(np.float32)
    v = rng.standard_normal((n, KVH * hd)).astype(np.float32)
    q = (rng.standard_normal((n, H * hd)) * 2).astype(np.float32)
    q_pos = np.full(n, n - 1)
    ref = reference(q, stored(k, "f32"), stored(v, "f32"), q_pos, H, KVH, hd, 0, 1 / math.sqrt(hd))
    be = _core.Backend("cpu")
    page = 1 << (n - 1).bit_length()  # one page, as the encoder's own K|V buffer
    for isa in ISAS:
        dasllama.set_isa(isa)
        out = be.paged_attention(q, k, v, q_pos.astype(np.int32), H, KVH, hd, 0, page, np.zeros(1, np.int32), 1, 0,
                                 1 / math.sqrt(hd), 0.0, n, any_order=True)[0].astype(np.float64)
        err = np.mean((out - ref) ** 2) / np.mean(ref ** 2)
        assert err < 1e-9, (isa, err)


def test_any_order_causal_rows_take_the_paged_kernel(restore_isa):
    """any_order on rows that do not all see every key (causal): the dense kernel must not take them."""
    H, KVH, hd, n = 6, 6, 64, 300
    rng = np.random.default_rng(7)
    k = rng.standard_normal((n, KVH * hd)).astype(np.float32)
    v = rng.standard_normal((n, KVH * hd)).astype(np.float32)
    q = rng.standard_normal((n, H * hd)).astype(np.float32)
    q_pos = np.arange(n)
    be = _core.Backend("cpu")
    for isa in ISAS:
        dasllama.set_isa(isa)
        args = (q, k, v, q_pos.astype(np.int32), H, KVH, hd, 0, 512, np.zeros(1, np.int32), 1, 0, 1 / math.sqrt(hd),
                0.0, n)
        a = be.paged_attention(*args, any_order=True)[0]
        b = be.paged_attention(*args)[0]
        assert np.array_equal(a, b), isa
