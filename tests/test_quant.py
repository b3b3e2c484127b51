"""Block formats against gguf-py's numpy (de)quantizers, bit for bit, on every CPU ISA."""
from __future__ import annotations

import time
import zlib
import warnings

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as g_dequantize
from gguf.quants import quantize as g_quantize

import dasllama
from dasllama import quant

ISAS = dasllama.system_info()["isa_supported"]

# Byte offsets of the f16 scale fields per format, so "valid" blocks get finite scales.
F16_FIELDS = {
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
    "q2_K": [80, 82], "q3_K": [108], "q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208],
    "iq4_nl": [0], "iq4_xs": [0],
}
DEQUANT_FORMATS = ["f32", "f16", "bf16", *F16_FIELDS, "mxfp4", "q8_K"]
QUANT_FORMATS = ["f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
UNSUPPORTED = ["q8_1", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq3_s", "iq2_s", "iq1_m", "tq1_0", "tq2_0", "nvfp4"]


def gtype(name: str) -> T:
    return T[name.upper()]


@pytest.fixture(params=ISAS)
def isa(request):
    before = dasllama.get_isa()
    dasllama.set_isa(request.param)
    yield request.param
    dasllama.set_isa(before)


def assert_same_bits(ours: np.ndarray, ref: np.ndarray) -> None:
    """Identical float32 bits; NaNs only need to sit in the same places (payloads
    depend on the operand order the compiler or numpy's SIMD picked)."""
    assert ours.dtype == np.float32 and ref.dtype == np.float32
    assert ours.shape == ref.shape
    nan_o, nan_r = np.isnan(ours), np.isnan(ref)
    np.testing.assert_array_equal(nan_o, nan_r)
    np.testing.assert_array_equal(ours.view(np.uint32)[~nan_o], ref.view(np.uint32)[~nan_r])


def reference_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    if name == "q8_K":  # gguf-py has no q8_K; ggml's dequantize_row_q8_K is d * qs
        blocks = raw.reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)
        qs = blocks[:, 4:260].copy().view(np.int8).astype(np.float32)
        with np.errstate(all="ignore"):
            return (d * qs).reshape(*raw.shape[:-1], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 in random blocks
        return g_dequantize(raw, gtype(name))


def random_f16_scales(rng, shape) -> np.ndarray:
    """Finite halves over many magnitudes: zeros, subnormals, negatives, large."""
    mag = 10.0 ** rng.uniform(-7, 3, size=shape)
    v = (rng.standard_normal(shape) * mag).astype(np.float16)
    v[rng.random(shape) < 0.05] = 0
    return v


def valid_blocks(rng, name: str, n_blocks: int) -> np.ndarray:
    bs, ts = GGML_QUANT_SIZES[gtype(name)]
    if name in ("f32", "f16", "bf16"):
        lo, hi = {"f32": (-40, 38), "f16": (-8, 4), "bf16": (-40, 38)}[name]
        x = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(lo, hi, n_blocks)).astype(np.float32)
        if name == "f16":
            return x.astype(np.float16).view(np.uint8)
        if name == "bf16":
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(60, 190, size=n_blocks)  # exponents that keep 12 * 2^e finite
    elif name == "q8_K":
        raw[:, :4] = (rng.standard_normal(n_blocks) * 1e-2).astype(np.float32).view(np.uint8).reshape(-1, 4)
    for off in F16_FIELDS.get(name, []):
        raw[:, off:off + 2] = random_f16_scales(rng, n_blocks).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


# ---- dequantize --------------------------------------------------------------------------


@pytest.mark.parametrize("name", DEQUANT_FORMATS)
def test_dequantize_valid_blocks(name, isa):
    rng = np.random.default_rng(zlib.crc32(b"valid" + name.encode()))
    raw = valid_blocks(rng, name, 600).reshape(6, -1)
    ours = quant.dequantize(raw, name)
    ref = reference_dequantize(raw, name)
    assert np.isfinite(ours).all()
    assert_same_bits(ours, ref)


@pytest.mark.parametrize("name", DEQUANT_FORMATS)
def test_dequantize_random_bytes(name, isa):
    """Fully random bytes: NaN / inf scales included, same as gguf-py."""
    rng = np.random.default_rng(zlib.crc32(b"raw" + name.encode()))
    ts = GGML_QUANT_SIZES[gtype(name)][1]
    raw = rng.integers(0, 256, size=(4, ts * 300), dtype=np.uint8)
    assert_same_bits(quant.dequantize(raw, name), reference_dequantize(raw, name))


def test_dequantize_every_half():
    """All 65536 halves (subnormals, infs, NaN payloads) through f16 and every ISA."""
    raw = np.arange(65536, dtype=np.uint16).view(np.uint8)
    ref = raw.view(np.float16).astype(np.float32)
    for name in ISAS:
        dasllama.set_isa(name)
        assert_same_bits(quant.dequantize(raw, "f16"), ref)
        assert_same_bits(quant.dequantize(raw, "bf16"), (np.arange(65536, dtype=np.uint32) << 16).view(np.float32))


def test_type_ids_and_names_accepted():
    rng = np.random.default_rng(1)
    raw = valid_blocks(rng, "q4_K", 3)
    a = quant.dequantize(raw, "q4_K")
    assert_same_bits(quant.dequantize(raw, 12), a)
    assert_same_bits(quant.dequantize(raw, T.Q4_K), a)
    assert a.shape == (768,)


def test_type_info_matches_gguf():
    for t in T:
        info = quant.type_info(int(t))
        assert info.name.lower() == t.name.lower()
        assert (info.block_size, info.type_size) == GGML_QUANT_SIZES[t]
        assert quant.type_info(info.name) == info
        assert info.dequantizable == (info.name in DEQUANT_FORMATS)


# ---- quantize -----------------------------------------------------------------------------


def quantize_rows(rng) -> np.ndarray:
    """Rows of 256 (every block size divides it) covering the corners."""
    n = 256
    rows = [
        np.zeros(n),
        np.where(rng.random(n) < 0.5, -0.0, 0.0),
        rng.standard_normal(n),
        -np.abs(rng.standard_normal(n)),
        np.abs(rng.standard_normal(n)),
        rng.standard_normal(n) * 1e-30,
        rng.standard_normal(n) * 1e-40,  # f32 subnormals
        rng.standard_normal(n) * 1e-6,  # f16 subnormal scales
        rng.standard_normal(n) * 1e30,  # scales overflow f16
        rng.standard_normal(n) * 1e37,
        np.full(n, 3.25),
        np.tile([5.0, -5.0, 1.0, 0.0], n // 4),  # ties for the signed max
        np.tile([-5.0, 5.0, 2.5, -2.5], n // 4),
        rng.integers(-64, 64, n).astype(np.float64),
        rng.integers(-8, 8, n) / 8.0,  # lands on the .5 rounding boundaries
        rng.standard_normal(n) * 10.0 ** rng.uniform(-20, 20, n),
    ]
    rows += [rng.standard_normal(n) * 10.0 ** rng.uniform(-5, 5) for _ in range(48)]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name", QUANT_FORMATS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_quantize_matches_gguf(name):
    rng = np.random.default_rng(zlib.crc32(b"q" + name.encode()))
    x = quantize_rows(rng)
    if name in ("q4_1", "q5_1"):
        # numpy's min over a mix of -0.0 and +0.0 returns either zero depending on its
        # SIMD reduction order (so on the machine): no fixed answer to match there.
        x[1] = 0.0
    ours = quant.quantize(x, name)
    ref = np.ascontiguousarray(g_quantize(x, gtype(name))).view(np.uint8)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape
    if name in SCALE_BYTES:
        _assert_blocks_match(x, ours, ref, name)
    else:
        np.testing.assert_array_equal(ours, ref)
    # 3-d input keeps its leading dims, like gguf-py
    x3 = x.reshape(4, 16, 256)
    np.testing.assert_array_equal(quant.quantize(x3, name), ours.reshape(4, 16, -1))


# Bytes of the f16 scale (and min) that open a block of these formats.
SCALE_BYTES = {"q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4}


def _assert_blocks_match(x, ours, ref, name):
    """Every byte, but for the quants of blocks whose scale underflows.

    There (f32 subnormal inputs) 1/d overflows to inf, and gguf-py's cast of inf to an
    integer is the CPU's own (0 on x86-64, saturated on aarch64: numpy warns "invalid value
    encountered in cast"). Those quants carry nothing, as the stored f16 scale is 0, so for
    such blocks the scale bytes and the dequantized values must match instead."""
    bs, ts = GGML_QUANT_SIZES[gtype(name)]
    ob, rb = ours.reshape(x.shape[0], -1, ts), ref.reshape(x.shape[0], -1, ts)
    xb = x.reshape(x.shape[0], -1, bs)
    # The f32 scale as gguf-py forms it: |signed max| / 8 or 16, or (max - min) / 15 or 31.
    span = np.abs(xb).max(-1) if name.endswith("_0") else xb.max(-1) - xb.min(-1)
    d = (span / np.float32({"q4_0": 8, "q5_0": 16, "q4_1": 15, "q5_1": 31}[name])).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        free = (d != 0) & np.isinf(np.float32(1) / d)
    assert free.any()  # the subnormal row is there: the case this guards is exercised
    np.testing.assert_array_equal(ob[~free], rb[~free])
    np.testing.assert_array_equal(ob[free][:, :SCALE_BYTES[name]], rb[free][:, :SCALE_BYTES[name]])
    np.testing.assert_array_equal(g_dequantize(ours, gtype(name)), g_dequantize(ref, gtype(name)))


def test_quantize_specials_f16_bf16():
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 65504, 65520, 1e-8, -3e-8, 6e-5] * 4, np.float32)
    x = np.concatenate([x, np.array([0x7f800001, 0xff812345, 0x7fc00001, 0xffffffff], np.uint32).view(np.float32)])
    f16 = quant.quantize(x, "f16").view(np.float16)
    with np.errstate(all="ignore"):
        ref16 = x.astype(np.float16)
    np.testing.assert_array_equal(np.isnan(f16), np.isnan(ref16))
    ok = ~np.isnan(ref16)
    np.testing.assert_array_equal(f16.view(np.uint16)[ok], ref16.view(np.uint16)[ok])
    np.testing.assert_array_equal(quant.quantize(x, "bf16"), g_quantize(x, T.BF16).view(np.uint8))


def ggml_q8_K(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref in numpy (gguf-py has no q8_K): scale -127/max of
    the first largest magnitude, round half to even, 16-element sums."""
    out = np.zeros((x.shape[0], 292), np.uint8)
    for i, row in enumerate(x):
        j = int(np.argmax(np.abs(row)))
        if row[j] == 0:
            continue
        iscale = np.float32(-127.0) / row[j]
        qs = np.minimum(127, np.rint(iscale * row)).astype(np.int8)
        out[i, :4] = np.array([np.float32(1.0) / iscale], np.float32).view(np.uint8)
        out[i, 4:260] = qs.view(np.uint8)
        out[i, 260:] = qs.astype(np.int16).reshape(16, 16).sum(-1).astype(np.int16).view(np.uint8)
    return out


def test_quantize_q8_K():
    # Row 6 (f32 subnormals) overflows the scale to inf: ggml asserts on that input.
    x = np.delete(quantize_rows(np.random.default_rng(7)), 6, axis=0)
    raw = quant.quantize(x, "q8_K").reshape(-1, 292)
    np.testing.assert_array_equal(raw, ggml_q8_K(x))
    y = quant.dequantize(raw, "q8_K")
    amax = np.abs(x).max(-1, keepdims=True)
    assert (np.abs(y - x) <= amax / 127 * 0.5001).all()


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", UNSUPPORTED)
def test_unsupported_types_raise(name):
    ts = GGML_QUANT_SIZES[gtype(name)][1]
    with pytest.raises(dasllama.UnsupportedModelError, match=name):
        quant.dequantize(np.zeros(ts, np.uint8), name)


def test_bad_input_raises():
    with pytest.raises(ValueError):
        quant.dequantize(np.zeros(35, np.uint8), "q8_0")  # not a whole block
    with pytest.raises(ValueError):
        quant.dequantize(np.zeros(34, np.uint8), "q9_9")
    with pytest.raises(ValueError):
        quant.quantize(np.zeros(33, np.float32), "q8_0")
    with pytest.raises(dasllama.UnsupportedModelError):
        quant.quantize(np.zeros(256, np.float32), "q4_K")
    with pytest.raises((ValueError, dasllama.DasllamaError)):
        dasllama._core.dequantize(np.zeros(34, np.uint8), 8, 33)
    with pytest.raises(ValueError):
        dasllama._core.dequantize(np.zeros(33, np.uint8), 8, 32)
    with pytest.raises(ValueError):
        dasllama._core.dequantize(np.zeros(34, np.uint8), 8, -32)
    with pytest.raises(ValueError):
        dasllama._core.dequantize(np.zeros(68, np.uint8)[::2], 8, 32)
    with pytest.raises(ValueError):
        dasllama._core.dequantize(np.zeros(34, np.uint8), 1000, 32)
    assert quant.dequantize(np.zeros((3, 0), np.uint8), "q4_0").shape == (3, 0)


# ---- real models --------------------------------------------------------------------------


def check_model(path) -> set:
    """Every tensor: gguf-py once, ours on every ISA, in row chunks to bound memory."""
    reader = GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        seen.add(name)
        data = np.asarray(t.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        step = max(1, (1 << 22) // rows.shape[1])
        for r0 in range(0, rows.shape[0], step):
            chunk = rows[r0:r0 + step]
            ref = g_dequantize(chunk, t.tensor_type)
            for isa in ISAS:
                dasllama.set_isa(isa)
                assert_same_bits(quant.dequantize(chunk.view(np.uint8), name), ref)
    return seen


def test_smollm2_every_tensor(smollm2_path):
    before = dasllama.get_isa()
    try:
        assert {"q4_1", "f32"} <= check_model(smollm2_path)
    finally:
        dasllama.set_isa(before)


def test_gemma3_every_tensor(gemma3_path):
    before = dasllama.get_isa()
    try:
        assert {"q4_k", "q6_k", "q5_0"} <= check_model(gemma3_path)
    finally:
        dasllama.set_isa(before)


def test_dequantize_smollm2_is_fast(smollm2_path):
    """The whole model, active ISA: well under a second (pages warmed first)."""
    reader = GGUFReader(str(smollm2_path))
    tensors = [(np.asarray(t.data).view(np.uint8), int(t.tensor_type)) for t in reader.tensors]
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for raw, tid in tensors:
            quant.dequantize(raw, tid)
        best = min(best, time.perf_counter() - t0)
    assert best < 1.0, f"dequantizing SmolLM2 took {best:.2f} s"
