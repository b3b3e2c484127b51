"""CPU matmul kernels against gguf-py's dequantize, on every ISA, random and real tensors.

Products go through the CPU backend (``_core.Backend("cpu", n_threads)``: the weight loaded and packed
as the model loader does, activations quantized and rows split over its thread pool as in a forward
pass), in the ISA's packed layout and in the file's.
"""
from __future__ import annotations

import functools
import warnings
import zlib

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as g_dequantize

import dasllama
from dasllama import _core, quant

ISAS = dasllama.system_info()["isa_supported"]

A8_TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "mxfp4"]  # 32-element activation blocks
K8_TYPES = ["q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_xs"]  # 256-element activation blocks
F32_TYPES = ["f32", "f16", "bf16", "q8_K"]  # activations stay f32 (q8_K: the generic dequantize path)
QUANTIZABLE = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"}  # made by dasllama.quant.quantize
F16_FIELDS = {"q2_K": [80, 82], "q3_K": [108], "q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208],
              "iq4_nl": [0], "iq4_xs": [0]}
SHAPES = [(1, 256), (3, 576), (17, 1536), (64, 2048), (1, 2048), (64, 576)]  # (n_tok, k)

# Bars. Kernel vs the float64 product of the same quantized operands: what is left is
# float32 rounding (eps 6e-8) of a few products per block and of the sums over k/32
# blocks; the zero-point/min terms are at most a few times sum |w||x| per block, so the
# error stays around 1e-6 of sum |w||x| per output. 1e-5 leaves room yet catches a
# wrong element or block (a wrong block costs ~1/nb >= 1/64 of the norm). Same bar
# between ISAs (reassociation only).
EXACT_REL = 1e-5
# Against the unquantized product: rounding x to 8 bits per block of 32 (256) moves
# each element by at most amax/254, an rms error of ~0.6% (0.7%) of a Gaussian row;
# W spreads it evenly, so the normalized error ||y - y_f|| / ||y_f|| over many outputs
# is about that. 2e-2 is the bar.
QUANT_REL = 2e-2


def gtype(name: str) -> T:
    return T[name.upper()]


def act_block(name: str) -> int:
    return 32 if name in A8_TYPES else 256 if name in K8_TYPES else 0


def act_roundtrip(x: np.ndarray, bs: int) -> np.ndarray:
    """x after the kernels' activation quantization, rebuilt independently (cpu/act_blocks.h):
    d = amax/127, q = rint(x * (127/amax)) clamped to +-127, all in float32; returns q*d in float64."""
    if bs == 0:
        return x.astype(np.float64)
    xb = x.astype(np.float32).reshape(-1, bs)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, None]), -127, 127)
    return (q.astype(np.float64) * d.astype(np.float64)[:, None]).reshape(x.shape)


def random_weights(rng, name: str, rows: int, k: int) -> np.ndarray:
    """Raw bytes (rows x row_bytes): quantized Gaussians where we can quantize, else valid random blocks."""
    if name in QUANTIZABLE or name in ("f32", "f16", "bf16"):
        w = rng.standard_normal((rows, k)).astype(np.float32)
        return quant.quantize(w, name).reshape(rows, -1)
    bs, ts = GGML_QUANT_SIZES[gtype(name)]
    nb = rows * k // bs
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(110, 140, size=nb)
    elif name == "q8_K":
        raw[:, :4] = (rng.standard_normal(nb) * 1e-2).astype(np.float32).view(np.uint8).reshape(-1, 4)
    for off in F16_FIELDS.get(name, []):
        # Finite halves over several magnitudes (subnormals included) with both signs.
        v = (rng.standard_normal(nb) * 10.0 ** rng.uniform(-6, 1, nb)).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def dequant(raw: np.ndarray, name: str) -> np.ndarray:
    if name == "q8_K":  # gguf-py has no q8_K: ggml's dequantize is d * qs
        b = raw.reshape(-1, 292)
        d = b[:, :4].copy().view(np.float32).astype(np.float64)
        return (d * b[:, 4:260].copy().view(np.int8)).reshape(raw.shape[0], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return g_dequantize(raw, gtype(name)).astype(np.float64)


@functools.lru_cache(maxsize=None)
def cpu(n_threads: int = 1):
    return _core.Backend("cpu", n_threads)


def matmul(raw, name, k, x, n_threads=1, packed=False):
    raw = np.ascontiguousarray(raw)
    return cpu(n_threads).matmul(raw, int(gtype(name)), raw.shape[0], k, x, packed=packed)


@pytest.fixture
def restore_isa():
    before = dasllama.get_isa()
    yield
    dasllama.set_isa(before)


def check_against_reference(raw, name, k, x, isas=ISAS, quant_bar=True):
    wd = dequant(raw, name)
    xq = act_roundtrip(x, act_block(name))
    ref = xq @ wd.T
    scale = np.abs(xq) @ np.abs(wd).T  # sum |w||x| per output
    base = None
    for isa in isas:
        dasllama.set_isa(isa)
        for packed in (False, True):  # the file layout and the layout prepared at load (where the ISA has one)
            y = matmul(raw, name, k, x, packed=packed)
            assert y.shape == ref.shape and y.dtype == np.float32
            assert np.isfinite(y).all()
            err = np.abs(y - ref)
            assert (err <= EXACT_REL * scale + 1e-30).all(), (isa, packed, float((err / np.maximum(scale, 1e-30)).max()))
            if base is None:
                base = y
            else:  # every ISA and layout agrees with the first (baseline) up to reassociation
                assert (np.abs(y - base) <= EXACT_REL * scale + 1e-30).all(), (isa, packed)
    if quant_bar and ref.size >= 64:  # a norm over few outputs is too noisy for a bar
        yf = x.astype(np.float64) @ wd.T
        nerr = np.linalg.norm(base - yf) / np.linalg.norm(yf)
        assert nerr < QUANT_REL, nerr
    return base


@pytest.mark.parametrize("name", A8_TYPES + K8_TYPES + F32_TYPES)
def test_random_weights_every_isa(name, restore_isa):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    bs = GGML_QUANT_SIZES[gtype(name)][0]
    for n_tok, k in SHAPES:
        if k % bs:
            continue
        for rows in (1, 5, 37):
            raw = random_weights(rng, name, rows, k)
            x = rng.standard_normal((n_tok, k)).astype(np.float32)
            # Random K-quant bytes give scales over seven decades, so y is dominated by a few
            # blocks; the 8-bit bar is checked on the Gaussian-weight types.
            check_against_reference(raw, name, k, x, quant_bar=name in QUANTIZABLE)


@pytest.mark.parametrize("name", ["q4_0", "q8_0", "q4_K", "q6_K"])
def test_activation_outliers_and_zeros(name, restore_isa):
    """Zero blocks (scale 0), a huge outlier, and tiny values: quantization stays exact-reproducible."""
    rng = np.random.default_rng(7)
    k = 512
    raw = random_weights(rng, name, 9, k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[0] = 0
    x[1, :256] = 0
    x[2, 3] = 1e4
    x[3] *= 1e-30
    check_against_reference(raw, name, k, x, quant_bar=False)


def test_threads_bitwise_equal(restore_isa):
    rng = np.random.default_rng(3)
    for name in ["q4_1", "q4_K", "q6_K", "f16"]:
        raw = random_weights(rng, name, 203, 1536)
        x = rng.standard_normal((9, 1536)).astype(np.float32)
        for isa in ISAS:
            dasllama.set_isa(isa)
            for packed in (False, True):
                y1 = matmul(raw, name, 1536, x, 1, packed=packed)
                for nt in (2, 3, 8):
                    np.testing.assert_array_equal(matmul(raw, name, 1536, x, nt, packed=packed), y1)


@pytest.mark.parametrize("name", A8_TYPES + K8_TYPES)
def test_decode_equals_prefill_bitwise(name, restore_isa):
    """A token's row is the same bits whether it is decoded alone (the GEMV path) or inside a prefill
    batch (the tiled path): a prefix-cache hit followed by a short tail must reproduce a cold run."""
    rng = np.random.default_rng(11)
    bs = GGML_QUANT_SIZES[gtype(name)][0]
    # 13 rows: one packed group short of 16; 141: two full 64-row super-groups (the decode tile) and
    # a short one of a single group, with 1 and 3 threads (chunks that start mid-super-group).
    for k, rows in ((32, 13), (96, 13), (576, 13), (1536, 13), (2048, 13), (256, 141), (576, 141)):
        if k % bs:
            continue
        raw = random_weights(rng, name, rows, k)
        x = rng.standard_normal((20, k)).astype(np.float32)
        for isa in ISAS:
            dasllama.set_isa(isa)
            for packed in (False, True):
                full = matmul(raw, name, k, x, packed=packed)
                for n in (1, 2, 3, 4, 5, 8, 9):  # decode, batched decode, and the switch to the tiled path
                    for nt in ((1, 3) if rows > 64 else (1,)):
                        np.testing.assert_array_equal(matmul(raw, name, k, x[:n], nt, packed=packed), full[:n],
                                                      err_msg=f"{isa} packed={packed} k={k} rows={rows} n={n} nt={nt}")


@pytest.mark.skipif(not {"neon", "i8mm"} <= set(ISAS),
                    reason="needs an arm64 CPU with i8mm (tools/test_aarch64.py runs it under qemu -cpu max)")
@pytest.mark.parametrize("name", A8_TYPES)
def test_i8mm_equals_neon_bitwise(name, restore_isa):
    """The i8mm variant's smmla tiles (pairs of rows x pairs of tokens) form the same exact integer
    block sums as the neon variant's sdot and the same float operations in the same order, so the two
    give the same bits: odd row and token counts (a row paired with itself, a token left to sdot),
    padded block counts, zero and outlier activations, and a thread split."""
    rng = np.random.default_rng(zlib.crc32(b"i8mm" + name.encode()))
    for k in (32, 96, 576):
        for rows in (1, 2, 3, 7):
            raw = random_weights(rng, name, rows, k)
            x = rng.standard_normal((11, k)).astype(np.float32)
            x[1] = 0
            x[2, 5] = 1e4
            for n in (2, 3, 5, 8, 11):
                dasllama.set_isa("neon")
                want = matmul(raw, name, k, x[:n])
                dasllama.set_isa("i8mm")
                np.testing.assert_array_equal(matmul(raw, name, k, x[:n]), want, err_msg=f"k={k} rows={rows} n={n}")
    raw = random_weights(rng, name, 45, 1024)
    x = rng.standard_normal((9, 1024)).astype(np.float32)
    dasllama.set_isa("neon")
    want = matmul(raw, name, 1024, x, 1)
    dasllama.set_isa("i8mm")
    np.testing.assert_array_equal(matmul(raw, name, 1024, x, 3), want)


def test_bad_input_raises():
    rng = np.random.default_rng(0)
    raw = random_weights(rng, "q4_0", 4, 64)
    x = np.zeros((2, 64), np.float32)
    be = cpu()
    matmul(raw, "q4_0", 64, x)
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 4, 96, np.zeros((2, 96), np.float32))  # cols disagree with row bytes
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 4, 48, np.zeros((2, 48), np.float32))  # not whole blocks
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 5, 64, x)  # rows disagree with the bytes
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 4, 64, np.zeros((2, 32), np.float32))
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 4, 64, np.zeros(64, np.float32))
    with pytest.raises(ValueError):
        be.matmul(raw[:, ::2].copy(), int(T.Q4_0), 4, 64, x)
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.IQ2_XXS), 1, 256, np.zeros((2, 256), np.float32))  # no matmul for this type
    with pytest.raises(ValueError):
        be.matmul(raw, 999, 4, 64, x)
    with pytest.raises(ValueError):
        be.matmul(raw, int(T.Q4_0), 4, 64, x, repeat=0)
    with pytest.raises(ValueError):
        _core.Backend("cpu", -1)
    assert matmul(raw, "q4_0", 64, np.zeros((0, 64), np.float32)).shape == (0, 4)


# ---- real tensors -------------------------------------------------------------------------------


def real_tensors(path, wanted):
    """First tensor of each wanted type that is a matrix: (name, type name, raw rows, k)."""
    out = {}
    for t in GGUFReader(path).tensors:
        tname = T(t.tensor_type).name.lower().replace("_k", "_K")
        if tname in wanted and tname not in out and len(t.shape) == 2:
            k = int(t.shape[0])
            raw = np.asarray(t.data).reshape(int(t.shape[1]), -1)
            out[tname] = (t.name, tname, raw, k)
    assert set(out) == set(wanted), (set(wanted) - set(out))
    return list(out.values())


def run_real(path, wanted):
    rng = np.random.default_rng(11)
    for tensor_name, name, raw, k in real_tensors(path, wanted):
        rows = raw[:67] if raw.shape[0] > 67 else raw
        for n_tok in (1, 17):
            x = rng.standard_normal((n_tok, k)).astype(np.float32)
            check_against_reference(np.ascontiguousarray(rows), name, k, x)


def test_real_smollm2(smollm2_path, restore_isa):
    run_real(smollm2_path, ["q4_1", "q8_0"])


def test_real_gemma3(gemma3_path, restore_isa):
    run_real(gemma3_path, ["q5_0", "q8_0", "q4_K", "q6_K"])


@pytest.mark.parametrize("isa", ISAS)
def test_f16_cache_conversions_match_numpy(isa, restore_isa):
    """The KV cache's f32 -> f16 store and f16 -> f32 read, per ISA, bit for bit against numpy's
    float16 (round to nearest even): normals, subnormals, exact ties, overflow, zeros, infinities,
    and every one of the 63,488 non-NaN f16 values read back. Lengths that are not a multiple of the
    vector width exercise the scalar tails."""
    dasllama.set_isa(isa)
    rng = np.random.default_rng(5)
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = halves[~np.isnan(halves.view(np.float16))]
    ties = (finite.view(np.float16).astype(np.float32).view(np.uint32) + (1 << 12)).view(np.float32)  # halfway up
    x = np.concatenate([
        rng.standard_normal(4099).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, 4099),
        finite.view(np.float16).astype(np.float32), ties[np.isfinite(ties)],
        np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 65519.99, 1e-8, -3e-8, 7e4], np.float32),
    ])
    with np.errstate(over="ignore"):  # overflow to infinity is part of what is checked
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_core._f32_to_f16(x), want)
    back = _core._f16_to_f32(finite[:-3])
    np.testing.assert_array_equal(back.view(np.uint32), finite[:-3].view(np.float16).astype(np.float32).view(np.uint32))

