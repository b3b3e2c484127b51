"""The backend-ops harness: every op of every backend present, on random shapes and values.

Each op runs through ``_core.Backend`` (inputs uploaded, output poisoned with NaN, result
downloaded) and is compared by normalized squared error (NMSE) with numpy in float64 over
exactly what the backend stores (weights dequantized by gguf-py, KV rows quantized by
gguf-py), and every device backend is also compared with the CPU backend. The bars are
per precision class, the same for every backend: an op computed in f32 from the same
inputs lands near 1e-12; the CPU's quantized matmul activations (q8 / f16) near 1e-5.
On a machine without a GPU only the CPU runs; device backends are listed by what
``system_info()`` finds, and a missing one is reported as a skip with its reason.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as g_dequantize
from gguf.quants import quantize as g_quantize

import dasllama
from dasllama import _core

INFO = dasllama.system_info()["devices"]
DEVICES = ["cpu"] + [f"{b}:{d['index']}" for b, e in INFO.items() if b != "cpu" for d in e["devices"]]
NOT_FOUND = {b: e["error"] for b, e in INFO.items() if b != "cpu" and not e["devices"]}

MATMUL_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K", "mxfp4"]
QUANTIZABLE = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"}
K_SCALES = {"q4_K": [0, 2], "q5_K": [0, 2], "q6_K": [208], "mxfp4": []}  # byte offsets of f16 scale fields
KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8}

# NMSE bars by precision class (see the module docstring).
EXACT = 1e-10        # f32 arithmetic on identical inputs (norms, rope, elementwise, copies)
F32_DOT = 1e-9       # long f32 dot products (matmul with f32 activations, attention)
ACT_QUANT = 1e-4     # the CPU's matmul quantizes activations to q8 (or f16)


@pytest.fixture(scope="module")
def backends():
    return {d: _core.Backend(d) for d in DEVICES}


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a = np.asarray(a, np.float64)
    ref = np.asarray(ref, np.float64)
    assert a.shape == ref.shape
    assert np.isfinite(a).all(), "the op left NaN or inf (an output element never written?)"
    den = float(np.sum(ref * ref))
    return float(np.sum((a - ref) ** 2)) / (den if den > 0 else 1.0)


def check(name, outs, ref, bar, cpu_bar=None):
    """Every backend's output against the reference; device backends also against the CPU's."""
    errs = {d: nmse(o, ref) for d, o in outs.items()}
    cpu_bar = bar if cpu_bar is None else cpu_bar
    for d, e in errs.items():
        assert e <= (cpu_bar if d == "cpu" else bar), f"{name} on {d}: NMSE {e:.3g} vs the float64 reference"
        if d != "cpu":
            vs_cpu = nmse(outs[d], outs["cpu"])
            assert vs_cpu <= bar + 4 * cpu_bar, f"{name} on {d}: NMSE {vs_cpu:.3g} vs the CPU backend"


def run_all(backends, op, *args):
    return {d: getattr(b, op)(*args) for d, b in backends.items()}


def test_device_list_says_why():
    """Device backends are either found (and run below) or say why not."""
    for b, why in NOT_FOUND.items():
        assert why, f"{b}: no device and no reason given"
    if len(DEVICES) == 1:
        pytest.skip("no device backend on this machine: " + "; ".join(f"{b}: {w}" for b, w in NOT_FOUND.items()))


# ---- matmul and get_rows over every weight format -----------------------------------------


def make_weight(rng, name: str, rows: int, cols: int):
    """Bytes of a rows x cols matrix in `name`, and its float64 values as gguf-py reads them."""
    if name in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.5
        raw = g_quantize(w, T[name.upper()]) if name != "f32" else w.view(np.uint8)
    else:
        bs, ts = GGML_QUANT_SIZES[T[name.upper()]]
        raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
        if name == "mxfp4":  # e8m0 exponents around 2^-6 .. 2^3 (values up to 12 times half of that)
            raw[:, :, 0] = rng.integers(121, 131, size=raw.shape[:2])
        for off in K_SCALES[name]:
            sc = (rng.uniform(0.002, 0.02, size=raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])).astype(np.float16)
            raw[:, :, off:off + 2] = sc.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(rows, -1)
    raw = np.ascontiguousarray(raw.reshape(rows, -1).view(np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        vals = g_dequantize(raw, T[name.upper()]).astype(np.float64)
    return raw, vals.reshape(rows, cols)


@pytest.mark.parametrize("wtype", MATMUL_TYPES)
# (19, 16384, 2): a row over all 8 warps of a GEMV block (CUDA's direct kernels, f16 / bf16).
@pytest.mark.parametrize("rows,cols,n", [(64, 256, 1), (67, 512, 3), (40, 512, 12), (130, 256, 17), (256, 1024, 64),
                                         (33, 2048, 300), (37, 4096, 1), (21, 8192, 9), (19, 16384, 2)])
def test_matmul(backends, wtype, rows, cols, n):
    rng = np.random.default_rng(rows * 7 + cols + n)
    raw, w = make_weight(rng, wtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    outs = run_all({d: b for d, b in backends.items() if b.supports("matmul", int(T[wtype.upper()]))}, "matmul",
                   raw, int(T[wtype.upper()]), rows, cols, x)
    assert "cpu" in outs
    cpu_bar = F32_DOT if wtype == "f32" else ACT_QUANT
    check(f"matmul {wtype} {rows}x{cols} n={n}", outs, x.astype(np.float64) @ w.T, F32_DOT, cpu_bar)


@pytest.mark.parametrize("wtype", ["f16", "bf16"])
# (256, 1024, 256): whole tiles of every size, k a multiple of 512 (Vulkan's workgroup-scope tiles'
# unclamped, unrolled path).
@pytest.mark.parametrize("rows,cols,n", [(70, 512, 80), (256, 1024, 256)])
def test_matmul_token_scales(backends, wtype, rows, cols, n):
    """Prefill rows of very different magnitudes (1e-12 .. 1e12, a zero row, one outlier) against
    float weights: each token's outputs keep f32 precision on its own scale (a device that splits
    activations into halves with a scale per token must pick each token's scale)."""
    rng = np.random.default_rng(61)
    raw, w = make_weight(rng, wtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
    x[3] = 0
    x[5, 17] = 3e4 * np.abs(x[5]).max()
    outs = run_all(backends, "matmul", raw, int(T[wtype.upper()]), rows, cols, x)
    ref = (x.astype(np.float64) @ w.T).reshape(n, rows)
    for d, o in outs.items():
        o = np.asarray(o).reshape(n, rows)
        for t in range(n):
            bar = F32_DOT if d != "cpu" else ACT_QUANT
            e = nmse(o[t], ref[t])
            assert e <= bar, f"matmul {wtype} token {t} (scale {np.abs(x[t]).max():.3g}) on {d}: NMSE {e:.3g}"


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("cols,n", [(200, 1), (100, 3), (200, 70), (100, 40), (1000, 150)])
def test_matmul_odd_width(backends, wtype, cols, n):
    """Float rows that end mid-vector (cols not a multiple of 16 or of 8): decode and prefill;
    1000: a GPU tile's last 32 of k cut at 8, over several row and token tiles."""
    rng = np.random.default_rng(cols + n)
    raw, w = make_weight(rng, wtype, 131, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    outs = run_all(backends, "matmul", raw, int(T[wtype.upper()]), 131, cols, x)
    check(f"matmul {wtype} 131x{cols} n={n}", outs, x.astype(np.float64) @ w.T, F32_DOT,
          F32_DOT if wtype == "f32" else ACT_QUANT)


def test_matmul_multi(backends):
    rng = np.random.default_rng(5)
    parts = [make_weight(rng, "q8_0", r, 512) for r in (64, 16, 16)]
    x = rng.standard_normal((9, 512)).astype(np.float32)
    outs = run_all(backends, "matmul_multi", [p[0] for p in parts], int(T.Q8_0), [64, 16, 16], 512, x)
    ref = np.concatenate([(x.astype(np.float64) @ p[1].T).reshape(-1) for p in parts])
    check("matmul_multi", outs, ref, F32_DOT, ACT_QUANT)


@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n", [1, 7, 40, 400])  # 400: the CPU's packed prefill in blocks of 96 tokens
def test_matmul_epilogue(backends, wtype, n):
    """matmul_multi_ex: a bias and the exact GELU applied as the outputs are stored (in the packed
    f32 / f16 kernel's registers on the CPU, after the kernel for other formats) against float64
    numpy, and equal to the same backend's plain ops (matmul, add_bias, gelu_erf): bit for bit on
    the CPU, where they run the same arithmetic in another order of passes."""
    rng = np.random.default_rng(29 + n)
    qt = int(T[wtype.upper()])
    rows, cols = 131, 256  # 131: a last packed group of 3 rows
    raw, w = make_weight(rng, wtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    b = rng.standard_normal(rows).astype(np.float32) * 2
    erf = np.vectorize(math.erf)
    lin = x.astype(np.float64) @ w.T
    for name, bias, gelu in [("bias", b, False), ("bias+gelu", b, True), ("gelu", None, True)]:
        pre = lin + (b.astype(np.float64) if bias is not None else 0.0)
        ref = 0.5 * pre * (1 + erf(pre / math.sqrt(2))) if gelu else pre
        outs = {}
        for d, be in backends.items():
            if not be.supports("matmul", qt):
                continue
            for packed in ([True, False] if d == "cpu" else [True]):
                got, plain = be.matmul_ex(raw, qt, rows, cols, x, bias, gelu, packed)
                if d == "cpu":
                    assert np.array_equal(got, plain), f"matmul_ex {name} {wtype} n={n}: not its plain ops"
                else:
                    assert nmse(got, plain) <= EXACT, f"matmul_ex {name} {wtype} n={n} on {d}: not its plain ops"
                outs[d] = got
        check(f"matmul_ex {name} {wtype} n={n}", outs, ref, F32_DOT, F32_DOT if wtype == "f32" else ACT_QUANT)


def rms_rows(x, w=None, eps=1e-5):
    x = x.astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_1", "q4_K", "q6_K"])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_matmul_step(backends, wtype, n):
    """The fused stage (norm -> up to three matmuls; or a matmul into the residual). A
    backend that fuses keeps f32 activations and is held to float64 numpy at the f32 bar;
    each backend also equals its own plain ops (rms_norm, matmul_multi, add) within that
    bar, bit for bit where it composes them (the CPU, whose q8 activations put it at the
    ACT_QUANT class against numpy: its plain matmul is checked in test_matmul)."""
    rng = np.random.default_rng(17 + n)
    qt = int(T[wtype.upper()])
    cols, rows = 512, [96, 32, 40]
    parts = [make_weight(rng, wtype, r, cols) for r in rows]
    raws = [p[0] for p in parts]
    x = rng.standard_normal((n, cols)).astype(np.float32) * 3
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    res = rng.standard_normal((n, rows[0])).astype(np.float32)
    cases = [  # (name, weights, rows, norm, norm_w, eps, residual, float64 reference)
        ("norm+3", raws, rows, True, nw, 1e-6, None,
         np.concatenate([(rms_rows(x, nw.astype(np.float64), 1e-6) @ p[1].T).reshape(-1) for p in parts])),
        ("norm", raws[:1], rows[:1], True, None, 1e-6, None, (rms_rows(x, None, 1e-6) @ parts[0][1].T).reshape(-1)),
        ("residual", raws[:1], rows[:1], False, None, 0.0, res, res + x.astype(np.float64) @ parts[0][1].T),
    ]
    for name, ws, rs, norm, w_n, eps, r, ref in cases:
        for d, b in backends.items():
            got = b.matmul_step(ws, qt, rs, cols, x, norm, w_n, eps, r)
            xin = b.rms_norm(x, w_n, eps) if norm else x
            plain = b.matmul_multi(ws, qt, rs, cols, xin)
            if r is not None:
                plain = b.add(r, plain).reshape(r.shape)
            if d == "cpu":
                assert np.array_equal(got, plain), f"matmul_step {name} {wtype} n={n} on cpu: not its plain ops"
                continue
            assert nmse(got, ref) <= F32_DOT, f"matmul_step {name} {wtype} n={n} on {d}: NMSE {nmse(got, ref):.3g}"
            assert nmse(got, plain) <= F32_DOT, f"matmul_step {name} {wtype} n={n} on {d}: not its plain ops"


@pytest.mark.parametrize("wtype", ["f16", "q8_0"])
def test_glu_then_matmul_step(backends, wtype):
    """A step's glu, in place into up as the decoder's FFN writes it, then the matmul that reads it
    (ffn down), recorded as one step, where a backend may fold the glu into the matmul (Vulkan's
    gemv.comp -DGLU computes x on the way, and its last workgroup writes the glu's output). The
    glu's output is held to float64 numpy at its bar and, for silu and relu, equals the backend's
    own glu op bit for bit (gelu_tanh's tanh: NVIDIA's compiler rounds it differently in the two
    shaders, within the bar); the product is held to numpy where activations stay f32, and is the
    CPU's own matmul of that glu output where it rounds them to q8 (its class against numpy is
    test_matmul's). 1 and 3 tokens, each activation the fold takes."""
    rng = np.random.default_rng(23)
    qt = int(T[wtype.upper()])
    cols, rows = 2048, 64
    raw, w64 = make_weight(rng, wtype, rows, cols)
    for n in (1, 3):
        g = (rng.standard_normal((n, cols)) * 2).astype(np.float32)
        u = rng.standard_normal((n, cols)).astype(np.float32)
        g64, u64 = g.astype(np.float64), u.astype(np.float64)
        gt = 0.5 * g64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3)))
        for act, ref, bar in ((0, g64 / (1 + np.exp(-g64)) * u64, EXACT), (1, gt * u64, 1e-9),
                              (4, np.maximum(g64, 0) * u64, EXACT)):
            for d, b in backends.items():
                h, y = b.glu_matmul_step(g, u, act, raw, qt, rows)
                what = f"glu {act} then matmul {wtype} n={n} on {d}"
                assert nmse(h, ref) <= bar, f"{what}: glu NMSE {nmse(h, ref):.3g}"
                if act != 1:
                    assert np.array_equal(h, b.glu(g, u, act)), f"{what}: the glu's output is not its glu op's"
                if d == "cpu":
                    assert np.array_equal(y, b.matmul(raw, qt, rows, cols, h)), f"{what}: not its matmul of the glu"
                    continue
                e = nmse(y, ref @ w64.T)
                assert e <= F32_DOT, f"{what}: product NMSE {e:.3g}"
    # Bad calls are ValueErrors, and the backend still runs the step after them.
    g1 = rng.standard_normal((1, cols)).astype(np.float32)
    for b in backends.values():
        with pytest.raises(ValueError):
            b.glu_matmul_step(g1, g1[:, :-8], 0, raw, qt, rows)  # gate and up of two shapes
        with pytest.raises(ValueError):
            b.glu_matmul_step(g1, g1, 9, raw, qt, rows)  # no such activation
        with pytest.raises(ValueError):
            b.glu_matmul_step(g1, g1, 0, raw[:-1], qt, rows)  # weight bytes short of rows x cols
        with pytest.raises(ValueError):
            b.glu_matmul_step(g1[:0], g1[:0], 0, raw, qt, rows)  # no tokens
        h, _ = b.glu_matmul_step(g1, g1, 4, raw, qt, rows)
        assert np.array_equal(h, np.maximum(g1, 0) * g1)


@pytest.fixture(scope="module")
def q8_backends():
    return {d: _core.Backend(d, exact=False) for d in DEVICES}


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
# (150, 416): several 64-token tiles and 13 blocks of k, not a multiple of a GPU tile's 4;
# (2, 288), (3, 1056): Vulkan's 2- and 4-token GEMV with 9 and 33 blocks (ragged chunks).
# (4, 16384), (1, 32768): rows split over 4 and 8 warps of CUDA's q8 GEMV block.
@pytest.mark.parametrize("n,cols", [(1, 512), (2, 288), (3, 1056), (7, 512), (20, 512), (100, 512), (150, 416),
                                    (4, 16384), (1, 32768)])
def test_matmul_q8_mode(q8_backends, wtype, n, cols):
    """Weights loaded as in q8 mode: a backend either quantizes the activations to 8-bit
    blocks of 32 with the CPU's rounding (act_blocks.h), and then equals the CPU's matmul up
    to the order of float sums, or keeps them in f32 and equals float64 numpy at the f32
    bar; either way it is in the ACT_QUANT class against numpy. Plain, normed with three
    outputs, and into a residual. A device that rounds x and the decoded weights to f16 for its
    f16 tiles (Vulkan's prefill on NVIDIA's workgroup-scope matrices) equals float64 numpy over
    numpy's f16 rounding of both instead (f16_product)."""
    rng = np.random.default_rng(29 + n)
    qt = int(T[wtype.upper()])
    rows = [96, 32, 40]
    parts = [make_weight(rng, wtype, r, cols) for r in rows]
    raws = [p[0] for p in parts]
    x = rng.standard_normal((n, cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    res = rng.standard_normal((n, rows[0])).astype(np.float32)
    xn = rms_rows(x, nw.astype(np.float64), 1e-6)
    cases = [
        ("matmul", "matmul", (raws[0], qt, rows[0], cols, x), x.astype(np.float64) @ parts[0][1].T,
         f16_product(x, parts[0][1])),
        ("step norm+3", "matmul_step", (raws, qt, rows, cols, x, True, nw, 1e-6, None),
         np.concatenate([(xn @ p[1].T).reshape(-1) for p in parts]),
         np.concatenate([f16_product(xn, p[1]).reshape(-1) for p in parts])),
        ("step residual", "matmul_step", (raws[:1], qt, rows[:1], cols, x, False, None, 0.0, res),
         res + x.astype(np.float64) @ parts[0][1].T, res + f16_product(x, parts[0][1])),
    ]
    for name, op, args, ref, ref16 in cases:
        check_q8(f"q8 {name} {wtype} n={n}", run_all(q8_backends, op, *args), ref, ref16)


def f16_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T in float64 over numpy's f16 rounding of each row of x on its power-of-two scale
    (f16_rounded_rows) and of w's values (gguf-py's decoded weights)."""
    hi, inv = f16_rounded_rows(np.asarray(x, np.float32))
    return (hi @ w.astype(np.float32).astype(np.float16).astype(np.float64).T) * inv[:, None]


def check_q8(name, outs, ref, ref16=None):
    """q8 mode's bars: every backend in the ACT_QUANT class against float64; a device backend
    equal to the CPU's q8 sums up to the order of float adds, or to f32's at the f32 bar, or (where
    given) to ref16, float64 over x and the weights rounded to f16, at the f32 bar."""
    for d, o in outs.items():
        ref_ = ref.reshape(np.shape(o))
        assert nmse(o, ref_) <= ACT_QUANT, f"{name} on {d}: NMSE {nmse(o, ref_):.3g}"
        if d != "cpu":
            e_cpu, e_f32 = nmse(o, outs["cpu"]), nmse(o, ref_)
            e16 = nmse(o, ref16.reshape(np.shape(o))) if ref16 is not None else np.inf
            assert min(e_cpu, e_f32, e16) <= F32_DOT, \
                f"{name} on {d}: NMSE {e_cpu:.3g} against the CPU's, {e_f32:.3g} against f32, {e16:.3g} over f16"


def a8_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded to the A8 blocks of 32 (cpp/cpu/act_blocks.h's recipe, in f32: d = amax / 127,
    q = rint(x * (127 / amax)) clamped to +-127), as float64 values d * q."""
    n, k = x.shape
    xb = x.astype(np.float32).reshape(n, k // 32, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv), -127, 127)
    return (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(n, k)


def f16_rounded_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x scaled by a power of two s (its largest magnitude into [2^13, 2^14), the
    exponent clamped to +-110) and rounded to f16 by numpy: (x * s as f16, in float64; 1 / s)."""
    amax = np.abs(x).max(axis=1).astype(np.float64)
    e = np.where((amax > 0) & (amax <= 3.0e38), np.frexp(np.where(amax > 0, amax, 1.0))[1], 0)
    e = np.clip(14 - e, -110, 110)
    s = np.ldexp(1.0, e)
    hi = (x.astype(np.float64) * s[:, None]).astype(np.float32).astype(np.float16).astype(np.float64)
    return hi, 1.0 / s


@pytest.mark.parametrize("rows,cols,n", [(70, 512, 1), (67, 512, 33), (130, 1000, 80), (200, 544, 130), (256, 1024, 256)])
def test_matmul_f16_q8_mode(q8_backends, rows, cols, n):
    """f16 weights loaded as in q8 mode, with tokens of very different magnitudes (1e-12 ..
    1e12, a zero row, an outlier): a backend either keeps the activations in f32 (the CPU; a
    GPU's decode) and equals float64 numpy at the f32 bar, or (a GPU's prefill on f16 tensor
    cores) rounds each token's x to f16 on a power-of-two scale of its own, once, and then equals
    numpy's float64 product over numpy's own f16 rounding of the same scaled rows at that bar.
    Token by token, so a wrong scale cannot hide behind a large row."""
    rng = np.random.default_rng(rows + cols + n)
    raw, w = make_weight(rng, "f16", rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
    if n > 3:
        x[3] = 0
        x[1, 17] = 3e4 * np.abs(x[1]).max()
    ref = x.astype(np.float64) @ w.T
    hi, inv = f16_rounded_rows(x)
    ref16 = (hi @ w.T) * inv[:, None]
    for d, o in run_all(q8_backends, "matmul", raw, int(T.F16), rows, cols, x).items():
        o = np.asarray(o).reshape(n, rows)
        for t in range(n):
            e32, e16 = nmse(o[t], ref[t]), nmse(o[t], ref16[t])
            ok = e32 <= F32_DOT if d == "cpu" else min(e32, e16) <= F32_DOT
            assert ok, f"f16 q8-mode matmul {rows}x{cols} n={n} token {t} on {d}: NMSE {e32:.3g} against f32, " \
                f"{e16:.3g} against x rounded to f16"
    # The rounding is what tells the two apart: the f16-rounded reference is that far from f32.
    assert np.all(hi * inv[:, None] == x) or nmse(ref16, ref) > F32_DOT


@pytest.mark.parametrize("multi", ["0", "1"])
@pytest.mark.parametrize("mode", ["fp32_mode", "q8_mode"])  # (ids other tests' -k selections name)
def test_matmul_multi_f16_prefill(backends, q8_backends, mode, multi, monkeypatch):
    """Three f16 weights over one x past a GPU's prefill threshold (Q / K / V, which a GPU may split
    or round x for once, not once a matrix), rows and tokens ending mid-tile, tokens from 1e-12 to
    1e12 and a zero one: each matrix's rows, token by token, as test_matmul_f16_q8_mode holds one
    matmul's (weights as in fp32 mode: the f32 bar against float64; as in q8 mode: that, or numpy's
    own f16 rounding of each token's scaled row). CUDA with x rounded once for all three (the
    default) and once a matrix (DASLLAMA_CUDA_F16_MULTI=0)."""
    monkeypatch.setenv("DASLLAMA_CUDA_F16_MULTI", multi)
    rng = np.random.default_rng(43)
    rows, cols, n = [200, 40, 129], 544, 130
    parts = [make_weight(rng, "f16", r, cols) for r in rows]
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
    x[3] = 0
    hi, inv = f16_rounded_rows(x)
    outs = run_all(backends if mode == "fp32_mode" else q8_backends, "matmul_multi", [p[0] for p in parts], int(T.F16),
                   rows, cols, x)
    for d, o in outs.items():
        o, at = np.asarray(o).reshape(-1), 0
        for (_, w), r in zip(parts, rows):
            got = o[at:at + n * r].reshape(n, r)
            at += n * r
            ref, ref16 = x.astype(np.float64) @ w.T, (hi @ w.T) * inv[:, None]
            for t in range(n):
                e32, e16 = nmse(got[t], ref[t]), nmse(got[t], ref16[t])
                ok = e32 <= F32_DOT if mode == "fp32_mode" or d == "cpu" else min(e32, e16) <= F32_DOT
                assert ok, f"f16 matmul_multi ({mode}) {r}x{cols} n={n} token {t} on {d}: NMSE {e32:.3g} against " \
                    f"f32, {e16:.3g} against x rounded to f16"


@pytest.mark.parametrize("wtype", ["q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("rows,cols,n", [(200, 512, 33), (67, 1024, 80), (130, 256, 130)])
def test_matmul_block_formats_q8_mode_prefill(q8_backends, wtype, rows, cols, n):
    """Prefill (past 32 tokens) of weights in q8 mode's other block formats, tokens from 1e-12 to
    1e12 and a zero one: a GPU may decode the weights to f16 (nearest even) and round each
    token's scaled x to f16 once for an f16 GEMM (as llama.cpp's dequantize-then-GEMM prefill
    does), and then equals float64 numpy over numpy's f16 rounding of gguf-py's decoded weights
    and of the same rows at the f32 bar; else it keeps exact weights and f32 activations and
    equals the float64 product at that bar. (The CPU's q8 mode rounds activations to 8-bit
    blocks: test_matmul_q8_mode's class, not this one's.)"""
    devices = {k: b for k, b in q8_backends.items() if k != "cpu"}
    if not devices:
        pytest.skip("no device backend on this machine")
    rng = np.random.default_rng(rows + cols + n)
    raw, w = make_weight(rng, wtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
    x[3] = 0
    ref = x.astype(np.float64) @ w.T
    hi, inv = f16_rounded_rows(x)
    w16 = w.astype(np.float32).astype(np.float16).astype(np.float64)
    ref16 = (hi @ w16.T) * inv[:, None]
    for d, o in run_all(devices, "matmul", raw, int(T[wtype.upper()]), rows, cols, x).items():
        o = np.asarray(o).reshape(n, rows)
        for t in range(n):
            e32, e16 = nmse(o[t], ref[t]), nmse(o[t], ref16[t])
            assert min(e32, e16) <= F32_DOT, f"{wtype} q8-mode prefill {rows}x{cols} n={n} token {t} on {d}: NMSE {e32:.3g} against " \
                f"f32, {e16:.3g} against f16 weights and x"
    assert nmse(ref16, ref) > F32_DOT  # the two references are told apart


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("rows,cols,n", [(200, 544, 130), (67, 96, 33), (130, 2080, 70), (8200, 96, 200)])
def test_matmul_q8_mode_prefill(q8_backends, wtype, rows, cols, n):
    """q8 mode over many tokens (a GPU's prefill tiles: 64 or, on the largest shape, 128 rows x
    64 tokens on Vulkan's int8 GEMM) with rows, tokens and 32-blocks that leave every tile edge
    ragged: one matmul, and
    three weights over the same x (which may round x once for all). As test_matmul_q8_mode:
    the CPU's q8 sums up to the order of float adds, or f32's, or (x and the weights rounded to
    f16 for f16 tiles) f16_product's."""
    rng = np.random.default_rng(rows + cols + n)
    qt = int(T[wtype.upper()])
    rs = [rows, 40, 129]
    parts = [make_weight(rng, wtype, r, cols) for r in rs]
    x = rng.standard_normal((n, cols)).astype(np.float32)
    cases = [("matmul", "matmul", (parts[0][0], qt, rows, cols, x), x.astype(np.float64) @ parts[0][1].T,
              f16_product(x, parts[0][1])),
             ("multi", "matmul_multi", ([p[0] for p in parts], qt, rs, cols, x),
              np.concatenate([(x.astype(np.float64) @ p[1].T).reshape(-1) for p in parts]),
              np.concatenate([f16_product(x, p[1]).reshape(-1) for p in parts]))]
    for name, op, args, ref, ref16 in cases:
        check_q8(f"q8 {name} {wtype} {rows}x{cols} n={n}", run_all(q8_backends, op, *args), ref, ref16)


@pytest.mark.parametrize("wtype", ["f16", "bf16"])
def test_matmul_large_tiles(backends, wtype):
    """f16 / bf16 weights (f32 activations) over many GPU prefill tiles (64 x 64: 18 x 16 here)
    whose rows and tokens end mid-tile (q8 mode's tiles: test_matmul_q8_mode_prefill)."""
    rng = np.random.default_rng(41)
    rows, cols, n = 1100, 416, 1000
    raw, w = make_weight(rng, wtype, rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    outs = run_all(backends, "matmul", raw, int(T[wtype.upper()]), rows, cols, x)
    check(f"matmul {wtype} {rows}x{cols} n={n}", outs, x.astype(np.float64) @ w.T, F32_DOT, ACT_QUANT)


@pytest.mark.parametrize("wtype", MATMUL_TYPES)
def test_get_rows(backends, wtype):
    rng = np.random.default_rng(11)
    raw, w = make_weight(rng, wtype, 50, 256)
    ids = np.array([0, 49, 7, 7, 23], np.int32)
    outs = run_all(backends, "get_rows", raw, int(T[wtype.upper()]), 50, 256, ids)
    check(f"get_rows {wtype}", outs, w[ids], EXACT)


def test_mxfp4_rows_bit_exact(backends):
    """MXFP4 (gpt-oss's expert format) decoded by every backend equals gguf-py's dequantize bit for
    bit, over every exponent a block may carry (subnormal scales 0 and 1 included)."""
    rng = np.random.default_rng(17)
    raw = rng.integers(0, 256, size=(64, 8, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(64 * 8).reshape(64, 8) % 256  # all 256 exponents
    raw[raw[:, :, 0] == 255, 0] = 254  # 0xFF is e8m0's NaN: gguf-py and ggml disagree on nothing else
    raw = raw.reshape(64, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the top exponents overflow to inf, in both
        want = g_dequantize(raw, T.MXFP4).astype(np.float32).reshape(64, 256)
    ids = np.arange(64, dtype=np.int32)
    for dev, out in run_all(backends, "get_rows", raw, int(T.MXFP4), 64, 256, ids).items():
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), f"mxfp4 rows on {dev}"


# ---- norms, rope, elementwise ----------------------------------------------------------


@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (300, 2048)])
def test_norms(backends, rows, dim):
    rng = np.random.default_rng(dim)
    x = (rng.standard_normal((rows, dim)) * 3 + 1).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    b = rng.standard_normal(dim).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + 1e-6) * w
    check("rms_norm", run_all(backends, "rms_norm", x, w, 1e-6), ref, EXACT)
    check("rms_norm no weight", run_all(backends, "rms_norm", x, None, 1e-6), ref / w, EXACT)
    mu = x64.mean(axis=1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w + b
    check("layer_norm", run_all(backends, "layer_norm", x, w, b, 1e-5), ref, EXACT)


def rope_ref(x, n_heads, hd, pos, neox, n_rot, base, freq_scale, ff, inv, mscale):
    out = x.astype(np.float64).copy()
    half = n_rot // 2
    f = np.asarray(inv, np.float64) if inv is not None else base ** (-2.0 * np.arange(half) / n_rot)
    if ff is not None:
        f = f / ff
    theta = (pos.astype(np.float64) * freq_scale)[:, None] * f[None, :]
    cs, sn = np.cos(theta) * mscale, np.sin(theta) * mscale
    for h in range(n_heads):
        v = out[:, h * hd:(h + 1) * hd]
        i0 = np.arange(half) if neox else 2 * np.arange(half)
        i1 = i0 + half if neox else i0 + 1
        a, b = v[:, i0].copy(), v[:, i1].copy()
        v[:, i0] = a * cs - b * sn
        v[:, i1] = a * sn + b * cs
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("variant", ["plain", "partial", "factors", "yarn"])
def test_rope(backends, neox, variant):
    rng = np.random.default_rng(3)
    n_heads, hd, n = 4, 64, 9
    x = rng.standard_normal((n, n_heads * hd)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 4095, 7, 30000, 5, 65000], np.int32)
    n_rot, ff, inv, mscale, fs = hd, None, None, 1.0, 1.0
    if variant == "partial":
        n_rot, fs = 32, 0.25
    elif variant == "factors":
        ff = rng.uniform(1, 8, hd // 2).astype(np.float32)
    elif variant == "yarn":
        inv = 10000.0 ** (-2.0 * np.arange(hd // 2) / hd) / rng.uniform(1, 4, hd // 2)
        mscale = 1.2
    outs = run_all(backends, "rope", x, n_heads, hd, pos, neox, n_rot, 10000.0, fs, ff, inv, mscale)
    # f32 cos/sin of angles up to 65000 rad: the angle's own rounding bounds the agreement.
    check(f"rope {variant}", outs, rope_ref(x, n_heads, hd, pos, neox, n_rot, 10000.0, fs, ff, inv, mscale), 1e-9)


def test_elementwise(backends):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((13, 96)) * 4).astype(np.float32)
    y = rng.standard_normal((13, 96)).astype(np.float32)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    check("add", run_all(backends, "add", y, x), (y64 + x64).reshape(-1), EXACT)
    check("add_bias", run_all(backends, "add_bias", y, x[0]), y64 + x64[0], EXACT)
    check("scale", run_all(backends, "unary", "scale", x, 0.37), x64.reshape(-1) * np.float32(0.37), EXACT)
    check("softcap", run_all(backends, "unary", "softcap", x, 3.0), 3.0 * np.tanh(x64.reshape(-1) / 3.0), EXACT)
    erf = np.vectorize(math.erf)
    check("gelu_erf", run_all(backends, "unary", "gelu_erf", x, 0.0),
          (0.5 * x64 * (1 + erf(x64 / math.sqrt(2)))).reshape(-1), EXACT)
    silu = x64 / (1 + np.exp(-x64))
    check("glu silu", run_all(backends, "glu", x, y, 0), silu * y64, EXACT)
    gt = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    check("glu gelu_tanh", run_all(backends, "glu", x, y, 1), gt * y64, 1e-9)
    g = np.minimum(x64 * 4, 7.0)  # gate and up spread past gpt-oss's clamp at 7
    u = np.clip(y64 * 4, -7.0, 7.0)
    oai = g / (1 + np.exp(-1.702 * g)) * (u + 1)
    check("glu swiglu_oai", run_all(backends, "glu", x * 4, y * 4, 2), oai, EXACT)
    check("glu sigmoid", run_all(backends, "glu", x, y, 3), y64 / (1 + np.exp(-x64)), EXACT)
    check("glu relu", run_all(backends, "glu", x, y, 4), np.maximum(x64, 0) * y64, EXACT)


# ---- recurrent (gated DeltaNet) layers: the causal conv with its state, the gated delta rule --


def conv_ref(state, x, w, silu):
    """float64: the causal depthwise conv over [state rows; x rows], and the new state."""
    k = w.shape[1]
    u = np.concatenate([state, x]).astype(np.float64)
    y = np.stack([(u[t:t + k] * w.T.astype(np.float64)).sum(0) for t in range(len(x))])
    if silu:
        y = y / (1 + np.exp(-y))
    return y, u[len(u) - (k - 1):]


@pytest.mark.parametrize("k,n", [(4, 1), (4, 9), (2, 3), (4, 2), (3, 20000)])
def test_conv1d_causal(backends, k, n):
    """One call over n rows, from a carried state; the state it leaves is the last k-1 rows (a
    sequence shorter than the state keeps part of the old one). 20000 rows: a conformer stem's
    depthwise pass over a flat grid (lavapipe stopped one invocation's rows at 13107)."""
    rng = np.random.default_rng(k * 10 + n)
    C = 70
    st = rng.standard_normal((k - 1, C)).astype(np.float32)
    x = rng.standard_normal((n, C)).astype(np.float32)
    w = rng.standard_normal((C, k)).astype(np.float32)
    for silu in (False, True):
        outs = run_all(backends, "conv1d_causal", st, x, w, silu)
        y, new = conv_ref(st, x, w, silu)
        check(f"conv1d_causal k={k} n={n} silu={silu}", {b: o[0] for b, o in outs.items()}, y, EXACT)
        check(f"conv1d_causal state k={k} n={n}", {b: o[1] for b, o in outs.items()}, new, EXACT)


def delta_ref(state, qkv, alpha, beta, A, dt, nk, eps=1e-6, grouped=False):
    """float64, token by token as transformers' torch_recurrent_gated_delta_rule (l2-normed q and
    k, q / sqrt(dk); value head h reads key head h % nk, the converter's tiled order, or h // (nv / nk)
    grouped, as transformers' repeat_interleave)."""
    nv, dk, dv = state.shape
    S = state.astype(np.float64).copy()
    out = np.zeros((len(qkv), nv * dv))
    for t, row in enumerate(qkv.astype(np.float64)):
        q = row[:nk * dk].reshape(nk, dk)
        kk = row[nk * dk:2 * nk * dk].reshape(nk, dk)
        v = row[2 * nk * dk:].reshape(nv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(dk)
        kk = kk / np.sqrt((kk * kk).sum(-1, keepdims=True) + eps)
        g = A.astype(np.float64) * np.log1p(np.exp(alpha[t].astype(np.float64) + dt))
        b = 1 / (1 + np.exp(-beta[t].astype(np.float64)))
        for h in range(nv):
            g_ = h // (nv // nk) if grouped else h % nk
            qh, kh = q[g_], kk[g_]
            S[h] *= np.exp(g[h])
            delta = (v[h] - kh @ S[h]) * b[h]
            S[h] += np.outer(kh, delta)
            out[t, h * dv:(h + 1) * dv] = qh @ S[h]
    return out, S


@pytest.mark.parametrize("nk,nv,dk,dv,n,grouped", [(2, 4, 16, 16, 7, False), (2, 4, 16, 16, 5, True),
                                                   (1, 1, 32, 8, 1, False), (2, 2, 8, 80, 3, False),
                                                   (1, 1, 128, 128, 130, False)])
def test_delta_rule(backends, nk, nv, dk, dv, n, grouped):
    """The gated delta rule from a carried state: the outputs and the state it leaves; one call
    over n tokens equals n calls of one token (the decode step), to the bar."""
    rng = np.random.default_rng(nk + nv + dk + n)
    st = (rng.standard_normal((nv, dk, dv)) * 0.3).astype(np.float32)
    qkv = rng.standard_normal((n, 2 * nk * dk + nv * dv)).astype(np.float32)
    alpha = rng.standard_normal((n, nv)).astype(np.float32)
    beta = rng.standard_normal((n, nv)).astype(np.float32)
    A = -rng.uniform(0.1, 4, nv).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    outs = run_all(backends, "delta_rule", st, qkv, alpha, beta, A, dt, nk, 1e-6, grouped)
    out, S = delta_ref(st, qkv, alpha, beta, A, dt, nk, grouped=grouped)
    check(f"delta_rule {nk}/{nv} {dk}x{dv} n={n}", {b: o[0] for b, o in outs.items()}, out, F32_DOT)
    check(f"delta_rule state {nk}/{nv} {dk}x{dv} n={n}", {b: o[1] for b, o in outs.items()}, S, F32_DOT)
    for name, be in backends.items():  # token by token, the state carried between calls
        s, rows = st, []
        for t in range(n):
            o, s = be.delta_rule(s, qkv[t:t + 1], alpha[t:t + 1], beta[t:t + 1], A, dt, nk, 1e-6, grouped)
            rows.append(o)
        assert np.array_equal(np.concatenate(rows), outs[name][0]), name
        assert np.array_equal(s, outs[name][1]), name
    for be in backends.values():
        with pytest.raises(ValueError):
            be.delta_rule(st, qkv[:, 1:], alpha, beta, A, dt, nk, 1e-6)  # a short qkv row
        with pytest.raises(ValueError):
            be.conv1d_causal(np.zeros((2, 5), np.float32), np.zeros((1, 5), np.float32), np.zeros((5, 4), np.float32), True)


# Chunk-boundary lengths of the chunked form (chunks of 64 tokens), and Qwen3.5-sized heads (700
# tokens: past the loop bound lavapipe puts on one shader invocation, so the dispatch is cut).
@pytest.mark.parametrize("nk,nv,dk,dv,n,grouped", [(2, 4, 32, 32, 1, False), (2, 4, 32, 32, 63, False),
                                                   (2, 4, 32, 32, 64, True), (2, 4, 32, 32, 65, False),
                                                   (1, 3, 16, 40, 200, False), (1, 2, 128, 128, 130, True),
                                                   (1, 1, 128, 128, 700, False)])
def test_delta_rule_chunked(backends, nk, nv, dk, dv, n, grouped):
    """The chunked form (the prefill's: chunks of 64 tokens, a triangular solve within each, the
    state passed between them) from a carried state: its outputs and the state it leaves against
    the float64 token-by-token reference at F32_DOT, and against the CPU's recurrent op; the CPU's
    kernel in every ISA variant; a second call continues from the state the first left."""
    rng = np.random.default_rng(1000 + nv * dk + n)
    st = (rng.standard_normal((nv, dk, dv)) * 0.3).astype(np.float32)
    qkv = rng.standard_normal((n, 2 * nk * dk + nv * dv)).astype(np.float32)
    alpha = rng.standard_normal((n, nv)).astype(np.float32)
    beta = rng.standard_normal((n, nv)).astype(np.float32)
    A = -rng.uniform(0.1, 4, nv).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32) - 2  # some slow decays, so the state carries
    outs = {b: be.delta_rule(st, qkv, alpha, beta, A, dt, nk, 1e-6, grouped, True) for b, be in backends.items()}
    out, S = delta_ref(st, qkv, alpha, beta, A, dt, nk, grouped=grouped)
    check(f"delta_rule chunked {nk}/{nv} {dk}x{dv} n={n}", {b: o[0] for b, o in outs.items()}, out, F32_DOT)
    check(f"delta_rule chunked state {nk}/{nv} {dk}x{dv} n={n}", {b: o[1] for b, o in outs.items()}, S, F32_DOT)
    o, s = backends["cpu"].delta_rule(st, qkv, alpha, beta, A, dt, nk, 1e-6, grouped)  # the recurrent op
    for name in backends:
        assert nmse(outs[name][0], o) <= F32_DOT and nmse(outs[name][1], s) <= F32_DOT, name
    before = dasllama.get_isa()
    try:  # the CPU's kernel in every ISA variant this machine runs
        for isa in dasllama.system_info()["isa_supported"]:
            dasllama.set_isa(isa)
            o, s = backends["cpu"].delta_rule(st, qkv, alpha, beta, A, dt, nk, 1e-6, grouped, True)
            assert nmse(o, out) <= F32_DOT and nmse(s, S) <= F32_DOT, isa
    finally:
        dasllama.set_isa(before)
    h = n // 2
    if h:  # split in two calls: the second starts from the state the first leaves
        for name, be in backends.items():
            o1, s1 = be.delta_rule(st, qkv[:h], alpha[:h], beta[:h], A, dt, nk, 1e-6, grouped, True)
            o2, s2 = be.delta_rule(s1, qkv[h:], alpha[h:], beta[h:], A, dt, nk, 1e-6, grouped, True)
            assert nmse(np.concatenate([o1, o2]), out) <= F32_DOT and nmse(s2, S) <= F32_DOT, name


# ---- mixture of experts: routing, the gathered expert matmul, the weighted sum ---------------


def route_ref(logits, k, gate, norm):
    """The k largest logits per row (ties to the lower id) and their weights, in float64."""
    l = logits.astype(np.float64)
    ids = np.argsort(-l, axis=1, kind="stable")[:, :k]
    picked = np.take_along_axis(l, ids, 1)
    if gate == 0:  # softmax over all experts, the picked ones' probabilities
        e = np.exp(l - l.max(1, keepdims=True))
        w = np.take_along_axis(e / e.sum(1, keepdims=True), ids, 1)
    elif gate == 1:  # sigmoid of each picked logit
        w = 1 / (1 + np.exp(-picked))
    else:  # softmax over the picked logits only
        e = np.exp(picked - picked.max(1, keepdims=True))
        w = e / e.sum(1, keepdims=True)
    if norm:
        w = w / w.sum(1, keepdims=True)
    return ids, w


@pytest.mark.parametrize("gate,norm,E,k", [(0, False, 8, 2), (0, True, 60, 4), (1, False, 1, 1), (2, False, 32, 4)])
def test_moe_route(backends, gate, norm, E, k):
    rng = np.random.default_rng(11 + gate + E)
    logits = (rng.standard_normal((37, E)) * 2).astype(np.float32)
    ids_ref, w_ref = route_ref(logits, k, gate, norm)
    outs = run_all(backends, "moe_route", logits, k, gate, norm)
    for dev, (ids, _) in outs.items():
        assert np.array_equal(ids, ids_ref), f"moe_route on {dev}: other experts picked"
    check(f"moe_route gate={gate} norm={norm}", {dev: o[1] for dev, o in outs.items()}, w_ref, EXACT)


@pytest.mark.parametrize("wtype", MATMUL_TYPES)
@pytest.mark.parametrize("rows,cols,n,k,per_pair,bias", [
    (64, 512, 1, 2, False, False),   # decode: one token's gate/up over its 2 experts (packed on the CPU)
    (24, 512, 5, 3, True, True),     # a down projection (a row per pair); 24 rows: an unpacked stack
    (64, 256, 40, 4, False, True),   # prefill: many tokens share each expert
    (80, 256, 1, 2, False, False),   # 80 rows: each expert packed on its own (CPU super-groups of 64 rows)
    (80, 256, 12, 3, False, True),
])
def test_matmul_id(backends, wtype, rows, cols, n, k, per_pair, bias):
    rng = np.random.default_rng(rows + cols + n + k)
    E = 6
    raw, w = make_weight(rng, wtype, E * rows, cols)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n)]).astype(np.int32).reshape(-1)
    x = rng.standard_normal((n * k if per_pair else n, cols)).astype(np.float32)
    b = rng.standard_normal((E, rows)).astype(np.float32) if bias else None
    x_div = 1 if per_pair else k
    ref = np.stack([w[e * rows:(e + 1) * rows] @ x[p // x_div].astype(np.float64) for p, e in enumerate(ids)])
    if bias:
        ref = ref + b[ids].astype(np.float64)
    t = int(T[wtype.upper()])
    outs = run_all({dv: be for dv, be in backends.items() if be.supports("matmul", t)}, "matmul_id",
                   raw, t, E, rows, cols, x, x_div, ids, b)
    check(f"matmul_id {wtype} {rows}x{cols} n={n} k={k}", outs, ref, F32_DOT, F32_DOT if wtype == "f32" else ACT_QUANT)


def argmax_ref(x: np.ndarray) -> np.ndarray:
    """Each row's first index of its largest number (NaN never the largest; 0 for a row of NaN)."""
    out = []
    for r in x:
        ok = ~np.isnan(r)
        out.append(int(np.flatnonzero(r == r[ok].max())[0]) if ok.any() else 0)
    return np.array(out, np.int32)


@pytest.mark.parametrize("dim,rows", [(1, 7), (33, 7), (1000, 7), (5000, 1), (5000, 300), (128256, 7),
                                      (128256, 1), (100003, 40)])
def test_argmax(backends, dim, rows):
    """Rows split over many blocks (a GPU's few rows of a vocabulary) and rows whole (many rows):
    a tie far apart in the row (so in different splits), NaN at the row's ends."""
    rng = np.random.default_rng(dim + rows)
    x = rng.standard_normal((max(rows, 7), dim)).astype(np.float32)
    x[1, dim // 2] = x[1, dim - 1] = x[1].max() + 1  # a tie: the first wins
    x[2, 0] = np.nan  # a NaN where the walks start
    x[2, dim - 1] = np.nan
    x[3] = np.nan  # no number at all
    x[4] = -np.inf  # the first -inf
    x[4, dim // 3] = np.nan
    x[5, :] = 0.25  # all equal
    x[6, dim - 1] = np.inf
    if rows < 7:
        x = x[[1, 2, 3, 4, 5, 6, 0][:rows]]  # the special rows first
    ref = argmax_ref(x)
    for dev, got in run_all(backends, "argmax", x).items():
        assert np.array_equal(got, ref), f"argmax on {dev}: {got} against {ref}"


def test_moe_route_sum_and_bad_calls(backends):
    rng = np.random.default_rng(3)
    n, k, dim = 9, 3, 130
    y = rng.standard_normal((n * k, dim)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    ref = np.einsum("tj,tjd->td", w.astype(np.float64), y.reshape(n, k, dim).astype(np.float64))
    check("moe_sum", run_all(backends, "moe_sum", y, w), ref, EXACT)
    raw, _ = make_weight(rng, "q8_0", 4 * 32, 64)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    for be in backends.values():
        with pytest.raises(ValueError):
            be.matmul_id(raw, int(T.Q8_0), 4, 32, 64, x, 1, np.array([0, 4], np.int32), None)  # expert 4 of 4
        with pytest.raises(ValueError):
            be.moe_route(x, 65, 0, False)  # k above the 64 experts
        with pytest.raises(ValueError):
            be.moe_route(x, 2, 3, False)  # no such gate


def test_copies_and_pooling(backends):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((11, 40)).astype(np.float32)
    check("copy_rows", run_all(backends, "copy_rows", x, 7, 20), x[:, 7:27], 0.0)
    check("avg_pool_rows", run_all(backends, "avg_pool_rows", x, 2),
          np.stack([x[i:i + 2].astype(np.float64).mean(0) for i in range(0, 11, 2)]), EXACT)
    mel = rng.standard_normal((5, 30)).astype(np.float32)  # [C][stride]; frames past T=23 read as 0
    ref = np.zeros((23, 5 * 3))
    for t in range(23):
        for c in range(5):
            for j in range(3):
                s = t + j - 1
                ref[t, c * 3 + j] = mel[c, s] if 0 <= s < 23 else 0
    check("im2col_1d", run_all(backends, "im2col_1d", mel, 23, 3, 1, 1, 23), ref, 0.0)
    rows = rng.standard_normal((23, 6)).astype(np.float32)  # [T][C], stride 2
    ref = np.zeros((12, 6 * 3))
    for t in range(12):
        for j in range(3):
            s = 2 * t + j - 1
            if 0 <= s < 23:
                ref[t, j::3] = rows[s]
    check("im2col_rows", run_all(backends, "im2col_rows", rows, 3, 2, 1, 12), ref, 0.0)


def test_im2col_2d(backends):
    """im2col_2d against torch's unfold (its reference: skipped where torch has no wheel, as on
    the emulated aarch64 runs)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    # im2col_2d against torch's unfold (a conv2d's input columns): channel-major [C][H][W] input,
    # then the same tensor read through the strides of a row layout [H][W][C], then the transpose
    # (kh = H, kw = 1) that turns conv rows into per-time-step features.
    img = rng.standard_normal((3, 9, 14)).astype(np.float32)
    ref = torch.nn.functional.unfold(torch.from_numpy(img)[None], 3, padding=1, stride=2)[0].T.numpy()
    check("im2col_2d", run_all(backends, "im2col_2d", img.ravel(), 3, 9, 14, 9 * 14, 14, 1, 3, 3, 2, 1, 5, 7),
          ref, 0.0)
    hwc = np.ascontiguousarray(img.transpose(1, 2, 0))
    check("im2col_2d rows", run_all(backends, "im2col_2d", hwc.ravel(), 3, 9, 14, 1, 14 * 3, 3, 3, 3, 2, 1, 5, 7),
          ref, 0.0)
    check("im2col_2d transpose", run_all(backends, "im2col_2d", img.ravel(), 3, 9, 14, 9 * 14, 14, 1, 9, 1, 1, 0,
                                         1, 14), img.reshape(3 * 9, 14).T, 0.0)


# ---- the KV store and paged attention ------------------------------------------------------


def stored(x: np.ndarray, kv: str) -> np.ndarray:
    """What a cache of `kv` gives back for rows x (gguf-py's q8_0 quantizer)."""
    if kv == "f32":
        return x.astype(np.float64)
    if kv == "f16":
        return x.astype(np.float16).astype(np.float64)
    return g_dequantize(g_quantize(x, T.Q8_0), T.Q8_0).astype(np.float64)


def paged_session(rng, n_tok, n_kv, H, KVH, hd, P, spare, sinks=False, q_mul=1.0):
    """One session's random attention inputs: q for its last n_tok of n_kv rows (times q_mul), k, v,
    a sink logit a head (or None), the rows' positions, and their pages drawn out of order from a
    pool of n_pages + spare. Returns (q, k, v, sinks, q_pos, page_ids, pool_pages)."""
    q = (rng.standard_normal((n_tok, H * hd)) * q_mul).astype(np.float32)
    k = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    v = rng.standard_normal((n_kv, KVH * hd)).astype(np.float32)
    sk = (rng.standard_normal(H) * 3).astype(np.float32) if sinks else None
    q_pos = np.arange(n_kv - n_tok, n_kv, dtype=np.int32)
    n_pages = -(-n_kv // P)
    page_ids = rng.permutation(n_pages + spare)[:n_pages].astype(np.int32)
    return q, k, v, sk, q_pos, page_ids, n_pages + spare


def attention_ref(q, k, v, q_pos, n_heads, n_kv_heads, hd, window, scale, softcap, sinks=None):
    out = np.zeros((q.shape[0], n_heads * hd))
    group = n_heads // n_kv_heads
    j = np.arange(k.shape[0])
    for t in range(q.shape[0]):
        vis = j <= q_pos[t]
        if window:
            vis &= q_pos[t] - j < window
        for h in range(n_heads):
            kh = (h // group) * hd
            s = k[:, kh:kh + hd] @ q[t, h * hd:(h + 1) * hd].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            s = np.where(vis, s, -np.inf)
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - mx)
            den = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - mx))  # the sink takes a share
            out[t, h * hd:(h + 1) * hd] = (p / den) @ v[:, kh:kh + hd]
    return out


ATTN_CASES = [
    # n_tok, n_kv, heads, kv heads, head_dim, page_rows, window, softcap, store chunk
    (1, 1, 4, 4, 64, 16, 0, 0.0, 1),
    (1, 300, 8, 2, 64, 16, 0, 0.0, 1),
    (5, 133, 4, 1, 128, 64, 0, 0.0, 5),
    (33, 33, 6, 2, 64, 16, 0, 0.0, 33),
    (1, 1000, 8, 8, 128, 64, 0, 50.0, 256),
    (17, 700, 4, 2, 256, 16, 128, 0.0, 17),
    (1, 2050, 16, 4, 64, 16, 512, 0.0, 100),
    (3, 4100, 4, 1, 64, 64, 0, 0.0, 1000),  # decode over a long context: a device may split the keys
    (1, 700, 8, 4, 256, 16, 512, 0.0, 1),  # a Gemma-3 decode: head size 256, a sliding window
    (1, 300, 4, 1, 512, 16, 0, 0.0, 1),  # Gemma-4's global layers: head size 512, decode
    (20, 40, 4, 2, 512, 16, 16, 0.0, 20),  # and a windowed prefill
    # prefills of several row tiles (a device's tiled kernel), a head size padded to its tile,
    # a window and softcap, rows past a tile's end
    (130, 300, 4, 2, 96, 16, 0, 0.0, 130),
    (97, 161, 2, 1, 160, 16, 40, 30.0, 97),
    # a device's tensor-core tiles (f16 cache): a window and softcap, 4 heads on a KV head, ragged
    # tiles of both sizes
    (70, 200, 8, 2, 128, 16, 48, 20.0, 70),
    (64, 64, 4, 4, 64, 16, 0, 0.0, 64),
]


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("case", [(1, 1000, 8, 2, 64, 16, 0), (33, 70, 8, 2, 64, 16, 16), (1, 5, 4, 4, 64, 16, 0)],
                         ids=lambda c: "tok{}-kv{}-h{}/{}-d{}-p{}-w{}".format(*c))
def test_attention_sinks(backends, kv, case):
    """gpt-oss's sinks: a logit per head in each softmax's denominator (decode over many keys,
    where a device splits the keys; a windowed prefill)."""
    n_tok, n_kv, H, KVH, hd, P, window = case
    q, k, v, sinks, q_pos, page_ids, pool = paged_session(np.random.default_rng(n_kv + 7), n_tok, n_kv, H, KVH, hd, P,
                                                          2, sinks=True)
    scale = 1 / math.sqrt(hd)
    outs = {d: b.paged_attention(q, k, v, q_pos, H, KVH, hd, KV_TYPES[kv], P, page_ids, pool, window, scale,
                                 0.0, n_kv, sinks=sinks)[0] for d, b in backends.items()}
    ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, window, scale, 0.0, sinks)
    check(f"attention with sinks {case} {kv}", outs, ref, F32_DOT)


@pytest.mark.parametrize("kv", list(KV_TYPES))
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: "tok{}-kv{}-h{}/{}-d{}-p{}-w{}-cap{}".format(*c[:8]))
def test_paged_attention(backends, kv, case):
    n_tok, n_kv, H, KVH, hd, P, window, cap, chunk = case
    q, k, v, _, q_pos, page_ids, pool_pages = paged_session(np.random.default_rng(n_kv + hd + H), n_tok, n_kv, H, KVH,
                                                            hd, P, 3)
    scale = 1 / math.sqrt(hd)
    res = {d: b.paged_attention(q, k, v, q_pos, H, KVH, hd, KV_TYPES[kv], P, page_ids, pool_pages, window,
                                scale, cap, chunk) for d, b in backends.items()}
    # The store: each row's bytes where the block table puts it, exactly as gguf-py / numpy encode it.
    row_bytes = {"f32": 4 * KVH * hd, "f16": 2 * KVH * hd, "q8_0": 34 * KVH * hd // 32}[kv]
    enc = {"f32": lambda x: x.view(np.uint8), "f16": lambda x: x.astype(np.float16).view(np.uint8),
           "q8_0": lambda x: g_quantize(x, T.Q8_0)}[kv]
    kb, vb = enc(k).reshape(n_kv, row_bytes), enc(v).reshape(n_kv, row_bytes)
    for d, (_, raw) in res.items():
        pages = raw.reshape(pool_pages, 2, P, row_bytes)
        for p, pid in enumerate(page_ids):
            r = slice(p * P, min(n_kv, (p + 1) * P))
            cnt = r.stop - r.start
            np.testing.assert_array_equal(pages[pid, 0, :cnt], kb[r], err_msg=f"kv_store K on {d}")
            np.testing.assert_array_equal(pages[pid, 1, :cnt], vb[r], err_msg=f"kv_store V on {d}")
    ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, window, scale, cap)
    check(f"attention {kv}", {d: o for d, (o, _) in res.items()}, ref, F32_DOT)


# q8 mode's prefill attention on f16 tensor cores rounds each probability to f16 (2^-11 of it at
# most): the output moves by about that in NMSE (~1e-7 over many keys), under this bar.
ATTN_F16 = 1e-6


ATTN_Q8_CASES = [(33, 33, 6, 2, 64, 16, 0, 0.0), (130, 300, 4, 2, 64, 16, 0, 0.0), (70, 200, 8, 2, 128, 16, 48, 20.0),
                 (100, 260, 8, 8, 128, 64, 0, 0.0), (64, 64, 4, 4, 64, 16, 0, 0.0), (90, 1000, 4, 1, 64, 16, 100, 0.0),
                 # Gemma's head size 256: a window and a softcap, rows past a 32-row tile
                 (40, 120, 4, 2, 256, 16, 32, 50.0), (70, 70, 2, 1, 256, 16, 0, 0.0),
                 # pages of whole 64-key tiles (32 at head size 256; a device's workgroup-scope
                 # tiles need them): a ragged last tile, windows, softcaps, gpt-oss's sinks
                 (130, 300, 4, 2, 64, 64, 0, 0.0, True), (90, 1000, 4, 1, 64, 128, 100, 0.0),
                 (70, 200, 8, 2, 128, 64, 48, 20.0), (40, 120, 4, 2, 256, 32, 32, 50.0, True)]


@pytest.mark.parametrize("case", ATTN_Q8_CASES, ids=lambda c: "tok{}-kv{}-h{}/{}-d{}-p{}-w{}-cap{}".format(*c) +
                         ("-sinks" if c[8:] and c[8] else ""))
def test_paged_attention_q8_mode(q8_backends, case):
    """Prefill attention over an f16 cache in q8 mode, queries 4x sharper than the harness's
    others: a device either keeps f32 (equal to float64 numpy at the f32 bar), or rounds each
    row of Q * scale to f16 once and the probabilities to f16 for its tensor cores, and then equals
    float64 numpy over numpy's own f16 rounding of Q * scale within ATTN_F16 (the probabilities'
    rounding), row by row. The CPU keeps f32."""
    for d, (e32, e16) in attention_q8_errors(q8_backends, case).items():
        for t, (a, b) in enumerate(zip(e32, e16)):
            ok = a <= F32_DOT if d == "cpu" else a <= F32_DOT or b <= ATTN_F16
            assert ok, f"q8-mode attention {case} on {d}, row {t}: NMSE {a:.3g} against f32, {b:.3g} " \
                f"against Q * scale rounded to f16"


def attention_q8_errors(backends, case):
    """{device: (each row's NMSE against float64 numpy, against it over Q * scale rounded to f16)}
    for test_paged_attention_q8_mode's case."""
    n_tok, n_kv, H, KVH, hd, P, window, cap = case[:8]
    q, k, v, sinks, q_pos, page_ids, pool = paged_session(np.random.default_rng(n_kv + hd + H + 1), n_tok, n_kv, H, KVH,
                                                          hd, P, 3, sinks=bool(case[8:] and case[8]), q_mul=4.0)
    scale = 1 / math.sqrt(hd)
    ks, vs = stored(k, "f16"), stored(v, "f16")
    ref = attention_ref(q, ks, vs, q_pos, H, KVH, hd, window, scale, cap, sinks)
    q16 = (q * np.float32(scale)).astype(np.float16).astype(np.float64)
    ref16 = attention_ref(q16, ks, vs, q_pos, H, KVH, hd, window, 1.0, cap, sinks)
    assert nmse(ref16, ref) > F32_DOT  # the rounding of Q is told apart
    out = {}
    for d, b in backends.items():
        o = b.paged_attention(q, k, v, q_pos, H, KVH, hd, KV_TYPES["f16"], P, page_ids, pool, window, scale,
                              cap, n_tok, sinks=sinks)[0]
        out[d] = ([nmse(o[t], ref[t]) for t in range(n_tok)], [nmse(o[t], ref16[t]) for t in range(n_tok)])
    return out


MULTI_SPECS = {  # (rows already cached, new rows) per session; the pool's pages
    "short": ([(10, 9), (17, 1), (24, 1), (0, 3), (40, 1)], 16),
    # decodes deep enough that a device splits their keys, in one step (concurrent splits)
    "deep": ([(100, 1), (200, 1), (70, 2), (0, 3), (300, 1), (129, 4)], 64),
}


def multi_sessions(rng, plan, pool: int, H: int, KVH: int, hd: int, P: int) -> list:
    """A batched step's sessions for paged_attention_multi: per (past, new) of plan, new query
    rows, past + new K and V rows, and its pages (a shuffle of the pool's, each session its own)."""
    ids = rng.permutation(pool).astype(np.int32)
    sessions, at = [], 0
    for past, new in plan:
        n_kv = past + new
        n_pages = -(-n_kv // P)
        sessions.append((rng.standard_normal((new, H * hd)).astype(np.float32),
                         rng.standard_normal((n_kv, KVH * hd)).astype(np.float32),
                         rng.standard_normal((n_kv, KVH * hd)).astype(np.float32), ids[at:at + n_pages]))
        at += n_pages
    return sessions


@pytest.mark.parametrize("kv", list(KV_TYPES))
@pytest.mark.parametrize("depth", list(MULTI_SPECS))
def test_paged_attention_multi(backends, kv, depth):
    """One step's attentions over several sessions, as eval_batch issues them (a prefill beside
    decodes at other depths, each session on its own pages): every session equals the float64
    reference over its own rows."""
    rng = np.random.default_rng(41)
    spec, pool = MULTI_SPECS[depth]
    H, KVH, hd, P = 4, 2, 32, 16
    sessions = multi_sessions(rng, spec, pool, H, KVH, hd, P)
    scale = 1 / math.sqrt(hd)
    outs = {d: b.paged_attention_multi(sessions, H, KVH, hd, KV_TYPES[kv], P, pool, scale) for d, b in backends.items()}
    for i, (q, k, v, _) in enumerate(sessions):
        q_pos = np.arange(k.shape[0] - q.shape[0], k.shape[0])
        ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, 0, scale, 0.0)
        check(f"attention_multi {kv}, session {i} of {len(spec)}", {d: o[i] for d, o in outs.items()}, ref, F32_DOT)


# ---- CUDA's grouped-query decode kernel (DASLLAMA_CUDA_ATTN_GQA=1) -----------------------------
# A block per (row, query heads of one KV head, key split) with 16-byte K / V loads: the same f32
# arithmetic as the default decode kernel (attn_k) but for the order of sums, so it is held to the
# float64 reference (F32_DOT) and to attn_k's output within GQA_ORDER; Backend.path_count tells
# that it ran. Forced split counts (DASLLAMA_CUDA_ATTN_GQA_SPLITS) give splits with no keys, a
# count that is no power of two and the most the kernel takes.
GQA_ORDER = 1e-11

GQA_CASES = [
    # n_tok, n_kv, heads, kv heads, head_dim, page_rows, window, softcap
    (1, 1, 4, 4, 64, 16, 0, 0.0),  # one key, a query head a KV head
    (1, 17, 32, 8, 64, 16, 0, 0.0),  # Llama-3.2-1B's heads
    (1, 100, 32, 8, 64, 16, 0, 0.0),
    (1, 700, 32, 8, 64, 16, 0, 0.0),  # splits
    (3, 700, 8, 4, 128, 64, 0, 0.0),  # rows of one session at three positions
    (1, 100, 8, 1, 128, 16, 0, 30.0),  # 8 heads a KV head (items of 2), a softcap
    (1, 700, 4, 4, 128, 16, 0, 0.0),
    (5, 133, 6, 2, 64, 64, 40, 0.0),  # 3 heads a KV head (items of 1), a window
    (1, 2050, 16, 4, 64, 16, 512, 0.0),  # a window over a long context
    (1, 4100, 32, 8, 64, 64, 0, 0.0),  # many splits
    (1, 700, 8, 4, 256, 16, 512, 0.0),  # a Gemma-3 decode: head size 256, a window
    (15, 90, 8, 2, 64, 16, 0, 20.0),  # the most rows the row kernels take (FLASH_MIN 16)
]


def _cuda_backends(backends):
    cu = {d: b for d, b in backends.items() if d.startswith("cuda")}
    if not cu:
        pytest.skip("no CUDA device here: " + (NOT_FOUND.get("cuda") or "none found"))
    return cu


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kv", list(KV_TYPES))
@pytest.mark.parametrize("case", GQA_CASES, ids=lambda c: "tok{}-kv{}-h{}/{}-d{}-p{}-w{}-cap{}".format(*c))
def test_paged_attention_gqa(backends, monkeypatch, kv, case, sinks):
    """DASLLAMA_CUDA_ATTN_GQA=1 on one session's decode rows (Backend::attention): 1 to 4100 keys,
    1, 2, 3, 4 and 8 query heads a KV head, head sizes 64, 128 and 256, windows, softcaps and
    sinks, every KV type, the split rule and forced splits."""
    cu = _cuda_backends(backends)
    n_tok, n_kv, H, KVH, hd, P, window, cap = case
    q, k, v, sk, q_pos, page_ids, pool = paged_session(np.random.default_rng(n_kv + hd + H + 3), n_tok, n_kv, H, KVH,
                                                       hd, P, 3, sinks=sinks)
    scale = 1 / math.sqrt(hd)
    ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, window, scale, cap, sk)

    def run(b):
        return b.paged_attention(q, k, v, q_pos, H, KVH, hd, KV_TYPES[kv], P, page_ids, pool, window, scale,
                                 cap, 64, sinks=sk)[0]

    for d, b in cu.items():
        monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", "0")
        monkeypatch.delenv("DASLLAMA_CUDA_ATTN_GQA_SPLITS", raising=False)
        n0 = b.path_count("attn_gqa")
        old = run(b)
        assert b.path_count("attn_gqa") == n0, "the switch off still took the grouped-query kernel"
        monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", "1")
        for i, splits in enumerate(["", "3", "64"]):
            monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA_SPLITS", splits)
            got = run(b)
            assert b.path_count("attn_gqa") == n0 + i + 1, f"{d}: the grouped-query kernel did not run"
            e, e_old = nmse(got, ref), nmse(got, old)
            assert e <= F32_DOT, f"gqa {case} {kv} splits {splits or 'rule'} on {d}: NMSE {e:.3g} vs float64"
            assert e_old <= GQA_ORDER, f"gqa {case} {kv} splits {splits or 'rule'} on {d}: NMSE {e_old:.3g} vs attn_k"
        if n_tok == 1:  # one row unsplit on the 16-warp block (DASLLAMA_CUDA_ATTN_WIDE: up to 1000 of its batches)
            monkeypatch.delenv("DASLLAMA_CUDA_ATTN_GQA_SPLITS", raising=False)
            monkeypatch.setenv("DASLLAMA_CUDA_ATTN_WIDE", "1000")
            w0 = b.path_count("attn_wide")
            got = run(b)
            monkeypatch.delenv("DASLLAMA_CUDA_ATTN_WIDE")
            assert b.path_count("attn_wide") == w0 + 1, f"{d}: the wide block did not run"
            e, e_old = nmse(got, ref), nmse(got, old)
            assert e <= F32_DOT, f"gqa {case} {kv} wide on {d}: NMSE {e:.3g} vs float64"
            assert e_old <= GQA_ORDER, f"gqa {case} {kv} wide on {d}: NMSE {e_old:.3g} vs attn_k"


GQA_MULTI = {  # (rows already cached, new rows) per session
    "one": [(699, 1)],
    "three": [(0, 1), (16, 1), (99, 1)],
    "twelve": [(p, 1) for p in (0, 16, 99, 699, 5, 40, 63, 64, 200, 1, 31, 300)],
    "ragged": [(10, 3), (16, 1), (99, 5), (0, 2)],  # several rows a session, padded row slots
}
GQA_HEADS = [(32, 8, 64), (8, 8, 64), (12, 4, 64), (8, 4, 128), (8, 1, 128), (4, 2, 256)]


@pytest.mark.parametrize("heads", GQA_HEADS, ids=lambda h: "h{}/{}-d{}".format(*h))
@pytest.mark.parametrize("kv", list(KV_TYPES))
@pytest.mark.parametrize("spec", list(GQA_MULTI))
def test_paged_attention_multi_gqa(backends, monkeypatch, spec, kv, heads):
    """DASLLAMA_CUDA_ATTN_GQA=1 on a batched step's sessions in one launch (Backend::attention_multi,
    each session's arguments in the step's blob): 1, 3 and 12 sessions of 1 to 700 keys, and a
    ragged step; every session equals the float64 reference and attn_k's output."""
    cu = _cuda_backends(backends)
    H, KVH, hd = heads
    P = 16
    rng = np.random.default_rng(43)
    plan = GQA_MULTI[spec]
    pool = sum(-(-(past + new) // P) for past, new in plan) + 2
    sessions = multi_sessions(rng, plan, pool, H, KVH, hd, P)
    scale = 1 / math.sqrt(hd)
    for d, b in cu.items():
        monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", "0")
        n0 = b.path_count("attn_gqa")
        old = b.paged_attention_multi(sessions, H, KVH, hd, KV_TYPES[kv], P, pool, scale)
        monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", "1")
        got = b.paged_attention_multi(sessions, H, KVH, hd, KV_TYPES[kv], P, pool, scale)
        assert b.path_count("attn_gqa") == n0 + 1, f"{d}: the grouped-query kernel did not run"
        for i, (q, k, v, _) in enumerate(sessions):
            q_pos = np.arange(k.shape[0] - q.shape[0], k.shape[0])
            ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, 0, scale, 0.0)
            e, e_old = nmse(got[i], ref), nmse(got[i], old[i])
            assert e <= F32_DOT, f"gqa multi {spec} {kv} {heads} session {i} on {d}: NMSE {e:.3g} vs float64"
            assert e_old <= GQA_ORDER, f"gqa multi {spec} {kv} {heads} session {i} on {d}: NMSE {e_old:.3g} vs attn_k"
