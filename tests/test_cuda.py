"""The library end to end on a CUDA device, against the CPU backend on the same files.

Tiny random models of every family (tests/oracles/export.py, the files llama.cpp's
converter writes) in every format the requantizer writes: teacher-forced logits over 256
positions on the GPU against the CPU in fp32 mode (weights decoded exactly, f32 math), by
normalized squared error; greedy tokens, paged sessions with the prefix cache, ragged
batches and an audio turn on the GPU against the same on the CPU. The op-level harness
is tests/test_backend_ops.py. Without a CUDA device (CI) every test here skips, saying why.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d
from dasllama.convert import requantize

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import export as E  # noqa: E402
import _device_checks as C  # noqa: E402

_CUDA = d.system_info()["devices"]["cuda"]
pytestmark = pytest.mark.skipif(not _CUDA["devices"], reason="no CUDA device here: " + (_CUDA["error"] or "none found"))

# Measured on the H200: 1e-13..1e-11 for every family and format (f32 accumulation in
# another order); a wrong op moves the logits by O(1), an NMSE of 1e-2 or more.
LOGIT_BAR = C.LOGIT_BAR
nmse = C.nmse
FORMATS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]  # what the requantizer writes
N_POS = 256




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{family: {format: path}}: f32 files from the exporter, the rest requantized from them."""
    out = tmp_path_factory.mktemp("cuda-gguf")
    proto = E.spm_model_proto()
    built = {}
    for name, fam in E.FAMILIES.items():
        model = fam.make()
        f32 = str(out / f"{name}-f32.gguf")
        E.write_gguf(fam, model, f32, "f32", proto)
        paths = {"f32": f32}
        for ft in FORMATS[1:] if name == "llama" else ["f16", "q8_0"]:
            paths[ft] = str(out / f"{name}-{ft}.gguf")
            requantize(f32, paths[ft], ft)
        built[name] = paths
    return built


def teacher_forced(path, device, ids, kv=d.KVDtype.f32):
    m = d.load_model(path, d.QuantMode.fp32, device=device)
    s = d.create_session(m, kv, n_ctx=len(ids))
    d.eval(m, s, ids, all_logits=True)
    return np.array(s.logits).reshape(len(ids), -1)


@pytest.mark.parametrize("name", list(E.FAMILIES))
def test_logits_every_family_and_format(files, name):
    ids = [1] + np.random.default_rng(1).integers(3, E.VOCAB, N_POS - 1).tolist()
    for ft, path in files[name].items():
        cpu = teacher_forced(path, "cpu", ids)
        gpu = teacher_forced(path, "cuda", ids)
        e = nmse(gpu, cpu)
        print(f"{name} {ft}: NMSE {e:.2e}")
        assert e <= LOGIT_BAR, f"{name} {ft}: GPU logits NMSE {e:.3g} against the CPU"


@pytest.mark.parametrize("split", ["0", "1"])
def test_f16_prefill_tiles(monkeypatch, split):
    """Each of the f16 prefill's tile shapes (DASLLAMA_CUDA_F16H_TILE: the split's 64x64, one product's
    128x64k64, and 128x64) on matmuls whose rows, tokens and k all end mid-tile, tokens from 1e-12 to 1e12: in
    q8 mode one product, equal to float64 numpy over numpy's own f16 rounding of each token's
    scaled row; with the split (DASLLAMA_F16_SPLIT=1) equal to the f32 product. Each also with k
    split over a cluster of 2, 3 or the rule's blocks a tile (DASLLAMA_CUDA_F16H_SPLIT; k ending
    mid-stage, and stage counts that 3 does not divide: 17, 65). cuBLAS off (test_f16_prefill_cublas
    holds it)."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, f16_rounded_rows, make_weight, nmse as op_nmse

    b = d._core.Backend("cuda:0", exact=False)
    monkeypatch.setenv("DASLLAMA_F16_SPLIT", split)
    monkeypatch.setenv("DASLLAMA_CUDA_CUBLAS", "0")  # one product goes to cuBLAS where it is found
    for rows, cols, n in [(200, 544, 130), (67, 1000, 80), (130, 2080, 200)]:
        rng = np.random.default_rng(rows + cols + n)
        raw, w = make_weight(rng, "f16", rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
        x[3] = 0
        if split == "1":
            ref = x.astype(np.float64) @ w.T
        else:
            hi, inv = f16_rounded_rows(x)
            ref = (hi @ w.T) * inv[:, None]
        for tile in ["64x64", "128x64", "128x64k64"]:
            for ks in ["1", "2", "3", "auto"]:
                monkeypatch.setenv("DASLLAMA_CUDA_F16H_TILE", tile)
                monkeypatch.setenv("DASLLAMA_CUDA_F16H_SPLIT", ks)
                o = np.asarray(b.matmul(raw, int(T.F16), rows, cols, x)).reshape(n, rows)
                for t in range(n):
                    e = op_nmse(o[t], ref[t])
                    assert e <= F32_DOT, \
                        f"F16H_TILE={tile} F16H_SPLIT={ks} split={split} {rows}x{cols} n={n} token {t}: NMSE {e:.3g}"


def test_f16_prefill_cublas(monkeypatch):
    """The f16 prefill's products through cuBLAS (the default where the package finds the library:
    system_info names it; DASLLAMA_CUDA_CUBLAS=0 for our tiles): one matmul and a matmul_multi of three (x rounded once) on
    rows, tokens and k that end mid-tile, tokens from 1e-12 to 1e12 and a zero one, each token
    equal to float64 numpy over numpy's own f16 rounding of its scaled row (so each token's scale
    came back), and not bit-equal to our tiles' output (the product really went elsewhere)."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, f16_rounded_rows, make_weight, nmse as op_nmse

    feats = [x["features"] for x in _CUDA["devices"]]
    if not any(f.startswith("cublas ") for f in feats):
        pytest.skip(f"no cuBLAS found here (features {feats})")
    b = d._core.Backend("cuda:0", exact=False)
    monkeypatch.setenv("DASLLAMA_F16_SPLIT", "0")
    rng = np.random.default_rng(7)
    for rows, cols, n in [([200], 544, 130), ([67], 1000, 80), ([130, 40, 2049], 2080, 200)]:
        parts = [make_weight(rng, "f16", r, cols) for r in rows]
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
        x[3] = 0
        hi, inv = f16_rounded_rows(x)
        outs = {}
        for cb in ["0", "1"]:
            monkeypatch.setenv("DASLLAMA_CUDA_CUBLAS", cb)
            if len(rows) == 1:
                outs[cb] = np.asarray(b.matmul(parts[0][0], int(T.F16), rows[0], cols, x)).reshape(-1)
            else:
                outs[cb] = np.asarray(b.matmul_multi([p[0] for p in parts], int(T.F16), rows, cols, x)).reshape(-1)
        assert not np.array_equal(outs["0"], outs["1"]), f"{rows}x{cols} n={n}: cuBLAS's output is the tiles' bits"
        at = 0
        for (_, w), r in zip(parts, rows):
            got = outs["1"][at:at + n * r].reshape(n, r)
            at += n * r
            ref = (hi @ w.T) * inv[:, None]
            for t in range(n):
                e = op_nmse(got[t], ref[t])
                assert e <= F32_DOT, f"cuBLAS {r}x{cols} n={n} token {t}: NMSE {e:.3g}"


@pytest.mark.parametrize("wtype", ["q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"])
def test_block_formats_prefill_decoded_to_f16(monkeypatch, wtype):
    """q8 mode's prefill past 64 tokens of a block format (DASLLAMA_CUDA_DQF16, on): the matrix
    decoded to f16 (dequant_f16_k) and x rounded to f16 once, so each token equals float64 numpy
    over numpy's f16 rounding of gguf-py's decoded weights and of the scaled row (and not the f32
    product: the two references are farther apart than the bar); DQF16=0, the f32 tiles, equal to
    the f32 product. Also 40 tokens with the path taken from 33 (DASLLAMA_CUDA_DQF16_MIN=33, the
    default; the GEMVs took them before), whole and (with cuBLAS) decoded 32 rows at a time
    (DASLLAMA_CUDA_DQF16_SLAB_KB=32: 1 KiB rows, the last slab 2 rows), and 24 tokens from 17
    (the staged GEMV's range handed to the decoding)."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, f16_rounded_rows, make_weight, nmse as op_nmse

    b = d._core.Backend("cuda:0", exact=False)
    monkeypatch.setenv("DASLLAMA_CUDA_KMMA_MAX", "16")  # (by default K-quants' 17-32 take the int8 mmas)
    for rows, cols, n, dmin, slab in [(200, 512, 130, "65", "0"), (67, 1024, 80, "65", "0"), (130, 256, 200, "65", "0"),
                                      (130, 512, 40, "33", "0"), (130, 512, 40, "33", "32"), (130, 512, 24, "17", "0")]:
        monkeypatch.setenv("DASLLAMA_CUDA_DQF16_MIN", dmin)
        monkeypatch.setenv("DASLLAMA_CUDA_DQF16_SLAB_KB", slab)
        rng = np.random.default_rng(rows + cols + n)
        raw, w = make_weight(rng, wtype, rows, cols)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
        x[3] = 0
        hi, inv = f16_rounded_rows(x)
        w16 = w.astype(np.float32).astype(np.float16).astype(np.float64)
        refs = {"1": (hi @ w16.T) * inv[:, None], "0": x.astype(np.float64) @ w.T}
        assert op_nmse(refs["1"], refs["0"]) > F32_DOT
        for on, ref in refs.items():
            monkeypatch.setenv("DASLLAMA_CUDA_DQF16", on)
            o = np.asarray(b.matmul(raw, int(T[wtype.upper()]), rows, cols, x)).reshape(n, rows)
            for t in range(n):
                e = op_nmse(o[t], ref[t])
                assert e <= F32_DOT, f"{wtype} DQF16={on} {rows}x{cols} n={n} token {t}: NMSE {e:.3g}"


@pytest.mark.parametrize("wtype", ["q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("n", [1, 3, 16, 24])
def test_k_quant_int8_gemv(monkeypatch, wtype, n):
    """q8 mode's K-quant GEMVs on int8 dot products (DASLLAMA_CUDA_Q4K_I8 / DASLLAMA_CUDA_Q56K_I8,
    both on): x rounded to A8 blocks, each token at the f32 bar against float64
    numpy over gguf-py's decoded weights and that rounded x, and farther than the bar from the f32
    product (the rounding ran), with 1, 2 and 4 rows a warp from 2 tokens (DASLLAMA_CUDA_KI8_R)
    and on int8 mmas (DASLLAMA_CUDA_KMMA=1, 3, 16 and, with DASLLAMA_CUDA_KMMA_MAX=32, 24 tokens:
    only the mmas take 24);
    off, the f32 GEMV at the f32 bar. Rows ending mid-block of warps (and mid-warp),
    a row of 9 super-blocks (lanes that take two pairs of sub-blocks; q6_K's 210-byte blocks then
    start at 0 and 2 mod 4 within a row, and rows too), three weights over one x, and into a
    residual."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, a8_rounded, make_weight, nmse as op_nmse

    b = d._core.Backend("cuda:0", exact=False)
    qt = int(T[wtype.upper()])
    for cols in (512, 2304):
        rng = np.random.default_rng(cols + n)
        rows = [202, 32, 41]
        parts = [make_weight(rng, wtype, r, cols) for r in rows]
        x = rng.standard_normal((n, cols)).astype(np.float32)
        res = rng.standard_normal((n, rows[0])).astype(np.float32)
        xa, x64 = a8_rounded(x), x.astype(np.float64)
        cases = [("matmul", lambda: b.matmul(parts[0][0], qt, rows[0], cols, x), [parts[0][1]], None),
                 ("three", lambda: b.matmul_step([p[0] for p in parts], qt, rows, cols, x, False, None, 0.0, None),
                  [p[1] for p in parts], None),
                 ("residual", lambda: b.matmul_step([parts[0][0]], qt, rows[:1], cols, x, False, None, 0.0, res),
                  [parts[0][1]], res)]
        for name, run, ws, r0 in cases:
            refs = {}
            for xr, key in ((xa, "a8"), (x64, "f32")):
                outs = [xr @ w.T for w in ws]
                if r0 is not None:
                    outs[0] = outs[0] + r0
                refs[key] = outs
            monkeypatch.setenv("DASLLAMA_CUDA_KMMA_MAX", "32")
            variants = (("1", "1", "0"), ("1", "2", "0"), ("1", "4", "0"), ("1", "2", "1"), ("0", "1", "0"))
            for on, rw, mma in variants if n <= 16 else variants[3:4]:
                monkeypatch.setenv("DASLLAMA_CUDA_Q4K_I8", on)
                monkeypatch.setenv("DASLLAMA_CUDA_Q56K_I8", on)
                monkeypatch.setenv("DASLLAMA_CUDA_KI8_R", rw)
                monkeypatch.setenv("DASLLAMA_CUDA_KMMA", mma)
                o, at = np.asarray(run()).reshape(-1), 0
                for i, w in enumerate(ws):
                    got = o[at:at + n * w.shape[0]].reshape(n, w.shape[0])
                    at += n * w.shape[0]
                    ref, other = (refs["a8"][i], refs["f32"][i]) if on == "1" else (refs["f32"][i], None)
                    for t in range(n):
                        e = op_nmse(got[t], ref[t])
                        assert e <= F32_DOT, f"{wtype} I8={on} R={rw} KMMA={mma} {name} {cols} n={n} matrix {i} token {t}: NMSE {e:.3g}"
                    if other is not None:
                        assert op_nmse(got, other) > F32_DOT, f"{wtype} {name} {cols} n={n}: the f32 product's, not rounded"


def test_block_formats_prefill_without_room(monkeypatch):
    """Where the device cannot hold DQF16's f16 copy of a matrix (DASLLAMA_CUDA_MEM_LIMIT: the device
    as large as what is in use, the 64 MiB CUDA keeps back, and 24 MiB: room for the matmul's own
    buffers, not for the 48 MiB copy of a 4096 x 4096 q4_K matrix), the prefill keeps the f32
    tiles instead of failing: each token equals the f32 product (DQF16=0's reference), not the f16
    one; and the process goes on."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, make_weight, nmse as op_nmse

    b = d._core.Backend("cuda:0", exact=False)
    rows = cols = 4096
    n = 100
    rng = np.random.default_rng(7)
    raw, w = make_weight(rng, "q4_K", rows, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    monkeypatch.setenv("DASLLAMA_CUDA_DQF16", "0")
    b.matmul(raw, int(T.Q4_K), rows, cols, x)  # (the f32 tiles' own buffers, made once)
    monkeypatch.delenv("DASLLAMA_CUDA_DQF16")
    info = b.device
    monkeypatch.setenv("DASLLAMA_CUDA_MEM_LIMIT",
                       str(info["total_bytes"] - info["free_bytes"] + (64 << 20) + (24 << 20)))
    o = np.asarray(b.matmul(raw, int(T.Q4_K), rows, cols, x)).reshape(n, rows)
    for t in range(n):
        e = op_nmse(o[t], ref[t])
        assert e <= F32_DOT, f"without room for the f16 copy, token {t}: NMSE {e:.3g} from the f32 product"
    monkeypatch.delenv("DASLLAMA_CUDA_MEM_LIMIT")


def test_full_device_raises_and_keeps_session(files, monkeypatch):
    """A fresh model's first prefill on a device with no room left (DASLLAMA_CUDA_MEM_LIMIT: as large
    as what is in use) raises DeviceError naming what did not fit, with the session unchanged (its
    activation buffers are made at the first prefill, as test_vulkan.py's twin finds on lavapipe);
    then a decode step with no room runs or raises the same way. Once there is room, the session's
    logits are a fresh model's, bit for bit."""
    path = files["llama"]["q8_0"]
    ids = [1] + np.random.default_rng(32).integers(3, E.VOCAB, 44).tolist()
    ref = C.q8_steps(path, "cuda", ids, 40)
    m = d.load_model(path, d.QuantMode.q8, device="cuda")
    s = d.create_session(m, n_ctx=64)
    raised = 0
    for step, (toks, before) in enumerate([(ids[:40], 0), (ids[40:41], 40)]):
        dev = m.device_info
        monkeypatch.setenv("DASLLAMA_CUDA_MEM_LIMIT", str(dev["total_bytes"] - dev["free_bytes"]))
        try:
            d.eval(m, s, toks)
            assert step > 0, "a fresh model's prefill with no room at all ran"
        except d.DeviceError as e:
            raised += 1
            assert "out of device memory for" in str(e) and s.n_past == before, (str(e), s.n_past)
            monkeypatch.delenv("DASLLAMA_CUDA_MEM_LIMIT")
            d.eval(m, s, toks)
        monkeypatch.delenv("DASLLAMA_CUDA_MEM_LIMIT", raising=False)
        assert np.array_equal(np.array(s.logits), ref[step]), f"step {step} after a full device"
    for i in range(2, len(ref)):
        d.eval(m, s, ids[39 + i:40 + i])
        assert np.array_equal(np.array(s.logits), ref[i]), f"decode step {i} after a full device"
    print(f"steps that ran out of room: {raised}")


def test_block_formats_q8_mode_prefill_logits(tmp_path, monkeypatch):
    """A q8-mode prefill of a file in q4_K, q5_K, q6_K, q4_1, q5_0 and q5_1, decoded to f16 (the
    default; _device_checks' block_formats_q8_mode_prefill says the bar)."""
    monkeypatch.delenv("DASLLAMA_CUDA_DQF16", raising=False)
    C.block_formats_q8_mode_prefill(C.write_block_model(str(tmp_path / "llama-blocks.gguf")), "cuda")


def test_block_formats_q8_mode_prefill_f16_cache_logits(tmp_path, monkeypatch):
    """The same over the f16 cache, so with the f16 flash attention too (DASLLAMA_CUDA_FLASH_F16)."""
    monkeypatch.delenv("DASLLAMA_CUDA_DQF16", raising=False)
    monkeypatch.delenv("DASLLAMA_CUDA_FLASH_F16", raising=False)
    C.block_formats_q8_mode_prefill(C.write_block_model(str(tmp_path / "llama-blocks.gguf")), "cuda", d.KVDtype.f16)


@pytest.mark.parametrize("n", [1, 3, 16])
def test_k_quant_mixed_step(monkeypatch, n):
    """A step over K-quants of two types (a Q4_K_M file's Q / K beside a q6_K V) with
    DASLLAMA_CUDA_KMIX=1: x rounded once, each run of one type's GEMV over it. Unnormed, each
    token at the f32 bar against float64 numpy over gguf-py's decoded weights and the A8-rounded
    x; normed, bit for bit the outputs of each type's own normed step (the same rounding kernel,
    once instead of once a run); unnormed with KMIX=0 (the composition: a rounding a matrix), at
    the same bar."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, a8_rounded, make_weight, nmse as op_nmse

    b = d._core.Backend("cuda:0", exact=False)
    cols, rows = 2304, [64, 32, 40]
    types = [int(T.Q4_K), int(T.Q4_K), int(T.Q6_K)]
    rng = np.random.default_rng(n + 5)
    parts = [make_weight(rng, name, r, cols) for name, r in zip(["q4_K", "q4_K", "q6_K"], rows)]
    x = rng.standard_normal((n, cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    raws = [p[0] for p in parts]

    def split(o):
        o, at, out = np.asarray(o).reshape(-1), 0, []
        for r in rows:
            out.append(o[at:at + n * r].reshape(n, r))
            at += n * r
        return out

    for kmix in ("1", "0"):
        monkeypatch.setenv("DASLLAMA_CUDA_KMIX", kmix)
        got = split(b.matmul_step(raws, types, rows, cols, x, False, None, 0.0, None))
        for i, (g, (_, w)) in enumerate(zip(got, parts)):
            ref = a8_rounded(x) @ w.T
            for t in range(n):
                e = op_nmse(g[t], ref[t])
                assert e <= F32_DOT, f"KMIX={kmix} n={n} matrix {i} token {t}: NMSE {e:.3g}"
    monkeypatch.setenv("DASLLAMA_CUDA_KMIX", "1")
    mixed = split(b.matmul_step(raws, types, rows, cols, x, True, nw, 1e-6, None))
    alone = np.asarray(b.matmul_step(raws[:2], types[0], rows[:2], cols, x, True, nw, 1e-6, None)).reshape(-1)
    v = np.asarray(b.matmul_step(raws[2:], types[2], rows[2:], cols, x, True, nw, 1e-6, None)).reshape(n, rows[2])
    assert np.array_equal(np.concatenate([m.reshape(-1) for m in mixed[:2]]), alone), f"n={n}: Q / K differ"
    assert np.array_equal(mixed[2], v), f"n={n}: V differs from its own normed step"


@pytest.mark.parametrize("case", range(8))  # the harness's head sizes 64, 128 and (6, 7) Gemma's 256
def test_flash_attention_f16_q8_mode(monkeypatch, case):
    """q8 mode's prefill attention over an f16 cache (DASLLAMA_CUDA_FLASH_F16, on: flash_h16_k:
    Q * scale and the probabilities rounded to f16, one f16 mma a product; head size 256 with
    DASLLAMA_CUDA_FLASH_H256=1): every row equals float64 numpy over numpy's f16 rounding of Q *
    scale within the harness's ATTN_F16, and some row is farther than the f32 bar from the f32
    result (the rounding ran); FLASH_F16=0, the TF32 kernel (flash_k's f32 FMAs for 256), at the
    f32 bar."""
    from test_backend_ops import ATTN_F16, ATTN_Q8_CASES, F32_DOT, attention_q8_errors

    b = {"cuda": d._core.Backend("cuda:0", exact=False)}
    monkeypatch.delenv("DASLLAMA_CUDA_FLASH_H256", raising=False)
    monkeypatch.delenv("DASLLAMA_CUDA_FLASH_F16", raising=False)
    e32, e16 = attention_q8_errors(b, ATTN_Q8_CASES[case])["cuda"]
    assert max(e16) <= ATTN_F16 and max(e32) > F32_DOT, (max(e16), max(e32))
    monkeypatch.setenv("DASLLAMA_CUDA_FLASH_F16", "0")
    e32, _ = attention_q8_errors(b, ATTN_Q8_CASES[case])["cuda"]
    assert max(e32) <= F32_DOT, max(e32)


def test_f16_model_q8_mode_prefill_logits(files):
    """A q8-mode f16 prefill (x rounded to f16 once): _device_checks.f16_q8_mode_prefill's bar."""
    C.f16_q8_mode_prefill(files["llama"]["f16"], files["llama"]["q8_0"], "cuda", E.VOCAB)


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_kv_types(files, kv):
    ids = [1] + np.random.default_rng(2).integers(3, E.VOCAB, 100).tolist()
    path = files["llama"]["q8_0"]
    e = nmse(teacher_forced(path, "cuda", ids, kv), teacher_forced(path, "cpu", ids, kv))
    assert e <= LOGIT_BAR, f"kv {kv.name}: NMSE {e:.3g}"


def test_greedy_tokens_agree(files):
    for ft in ("f16", "q4_0"):
        out = {}
        for dev in ("cpu", "cuda"):
            m = d.load_model(files["llama"][ft], d.QuantMode.fp32, device=dev)
            out[dev] = _greedy(m, d.create_session(m), [1, 5, 9, 13], 48)
        assert out["cuda"] == out["cpu"], ft


PRE_AMPERE_CASES = ("(logits_every_family_and_format and llama) or greedy_tokens_agree or kv_types or "
                    "paged_prefix or speculated or pipelined or block_formats_q8_mode_prefill_logits")


def test_pre_ampere_paths(files):
    """What a pre-Ampere GPU (a T4: compute capability 7.5) runs: the build's compute_75 PTX,
    assembled by the driver at load (CUDA_FORCE_PTX_JIT=1), with the device taken for 7.x
    (DASLLAMA_CUDA_CC_MAJOR=7: no tensor-core kernels, no dependent launches, no clusters). A
    child run of this file's logits, greedy, cache, paged, batched and q8-mode prefill checks
    holds there, as here: an sm_80 instruction outside its guard fails its whole module's load."""
    import subprocess

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", PRE_AMPERE_CASES],
                       env=dict(os.environ, CUDA_FORCE_PTX_JIT="1", DASLLAMA_CUDA_CC_MAJOR="7"),
                       capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "passed" in out and "skipped" not in out, out[-4000:]
    probe = subprocess.run([sys.executable, "-c", "import sys, dasllama as d; print(d.load_model(sys.argv[1], "
                            "device='cuda').device_info['compute_capability'])", files["llama"]["f16"]],
                           env=dict(os.environ, CUDA_FORCE_PTX_JIT="1", DASLLAMA_CUDA_CC_MAJOR="7"),
                           capture_output=True, text=True)
    assert probe.stdout.strip().startswith("7."), probe.stdout + probe.stderr[-2000:]  # the paths it took


def test_pipelined_greedy_generate_equals_the_plain_loop(files):
    """Greedy generate issues each step before the host reads the id before it (CUDA's default):
    the same tokens, logits and session state as the step-by-step loop, however the stream ends."""
    for ft in ("f16", "q8_0"):
        C.pipelined_greedy_equals_plain(files["llama"][ft], "cuda", [1, 5, 9, 13, 17, 21, 25], d.QuantMode.q8)


def _greedy(m, s, prompt, n):
    d.eval(m, s, prompt)
    toks = []
    for _ in range(n):
        t = int(np.argmax(s.logits))
        toks.append(t)
        d.eval(m, s, [t])
    return toks


def _llama_file(tmp, hidden, heads, kv_heads, ffn, layers=2, formats=("q8_0", "q4_0")):
    """A random Llama of these sizes as the exporter writes it (f32), requantized to q8_0 and q4_0
    (or the given formats)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    build = E._seeded(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=E.VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=E.INIT, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, attn_implementation="eager")))
    f32 = str(tmp / f"llama-{hidden}-{heads}-f32.gguf")
    E.write_gguf(E.FAMILIES["llama"], build(), f32, "f32", E.spm_model_proto())
    out = {}
    for ft in formats:
        out[ft] = str(tmp / f"llama-{hidden}-{heads}-{ft}.gguf")
        requantize(f32, out[ft], ft)
    return out


def _decode_steps(path, kv, env, monkeypatch, n_prompt=40, n_steps=150):
    """Per decode step's logits (greedy from a random prompt) on a paged session of 16-row pages."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    m = d.load_model(path, device="cuda")
    s = d.create_session(m, d.KVPool(m, page_rows=16, kv_dtype=kv))
    d.eval(m, s, [1] + np.random.default_rng(5).integers(3, E.VOCAB, n_prompt - 1).tolist())
    out = []
    for _ in range(n_steps):
        d.eval(m, s, [int(np.argmax(s.logits))])
        out.append(np.array(s.logits))
    return np.stack(out), m


def _batch_steps(path, kv, env, monkeypatch):
    """Three sessions' logits after two batched steps: a ragged one (3, 1 and 2 new tokens), then one
    token each (the grouped launches take every session's rows)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    m = d.load_model(path, device="cuda")
    pool = d.KVPool(m, page_rows=16, kv_dtype=kv)
    rng = np.random.default_rng(9)
    ss = [d.create_session(m, pool) for _ in range(3)]
    for i, s in enumerate(ss):
        d.eval(m, s, [1] + rng.integers(3, E.VOCAB, 20 + 7 * i).tolist())
    ws = d.create_batch_workspace(m)
    d.eval_batch(m, ws, ss, [[5, 6, 7], [8], [9, 10]])
    out = [np.array(s.logits) for s in ss]
    d.eval_batch(m, ws, ss, [[int(np.argmax(s.logits))] for s in ss])
    return np.stack(out + [np.array(s.logits) for s in ss]), m


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_fused_decode_ops_equal_separate_launches(files, tmp_path, monkeypatch, kv):
    """Decode steps give the logits of separate launches bit for bit when ops join the launch
    before them: a GEMV that rounds the next matmul's input in its last block (RMS norm and all)
    or forms the GLU and its rounding as each 32-row chunk of gate and up completes
    (cuda::GemvTail), attention rounding its output for the O projection as it writes it
    (cuda::AttnQuant), the KV stores in the Q / K rope's launch (cuda::RopeStore); and each does
    run."""
    off = {"DASLLAMA_CUDA_TAILS": "0", "DASLLAMA_CUDA_ATTNQ": "0", "DASLLAMA_CUDA_ROPEST": "0"}
    # Per decode step and layer, tails: the rounding after O, the GLU's, the next layer's (or the
    # output's) after down; attention: its output's rounding; rope: the stores. Every step is
    # recorded (then replays a captured graph), so the counts grow with the steps (150, 2 layers).
    cases = (({"DASLLAMA_CUDA_TAILS": "3"}, 3), ({"DASLLAMA_CUDA_ATTNQ": "1"}, 300),
             ({"DASLLAMA_CUDA_ROPEST": "1"}, 300),
             ({"DASLLAMA_CUDA_TAILS": "3", "DASLLAMA_CUDA_ATTNQ": "1", "DASLLAMA_CUDA_ROPEST": "1"}, 603))
    shapes = {"tiny": files["llama"], "hd64": _llama_file(tmp_path, 512, 8, 2, 1024)}
    for name, paths in shapes.items():
        for ft in ("q8_0", "q4_0"):
            want, m_off = _decode_steps(paths[ft], kv, off, monkeypatch)
            assert m_off._m.fused_ops == 0
            for on, least in cases:
                env = off | on
                got, m = _decode_steps(paths[ft], kv, env, monkeypatch)
                assert m._m.fused_ops >= least, (name, ft, on, m._m.fused_ops)
                assert np.array_equal(got, want), f"{name} {ft} kv {kv.name} {on}: logits differ, max " \
                    f"{np.abs(got - want).max():.3g} at step {np.argwhere(got != want)[0][0]}"
            # Several sessions in one step: their rows consecutive, grouped launches.
            want, _ = _batch_steps(paths[ft], kv, off, monkeypatch)
            got, m = _batch_steps(paths[ft], kv, off | cases[-1][0], monkeypatch)
            assert m._m.fused_ops >= 2, (name, ft, m._m.fused_ops)
            assert np.array_equal(got, want), f"{name} {ft} kv {kv.name}: batched steps' logits differ"


def _need_clusters(path):
    """Skips a test of thread-block clusters on a GPU without them (compute capability below 9.0),
    where those paths are never taken."""
    cc = d.load_model(path, device="cuda").device_info["compute_capability"]
    if float(cc) < 9.0:
        pytest.skip(f"thread-block clusters need compute capability 9.0; this GPU is {cc}")


@pytest.mark.parametrize("tails", ["2", "8"])
def test_glu_tail_over_several_waves(files, tmp_path, monkeypatch, tails):
    """The GLU tail's 32-row chunks complete while blocks of the same gate / up GEMV that started
    later still read their input: over a grid of more blocks than the GPU holds at once (ffn
    8192 over hidden 1024: 1,024 blocks of 16 rows at two rows a warp group, against four an SM on
    132 SMs; f7ceb50's build, whose tail wrote over its GEMV's input, gave NaN logits), the tail gives
    the logits of separate launches bit for bit (it writes the down projection's input beside the
    GEMV's own, not over it); q8_0 and q4_0, an f16 and a q8_0 cache; each chunk's blocks counted
    (TAILS=2) or run as one thread-block cluster of gate's and up's blocks, renumbered (TAILS=8,
    sm_90; clusters of 8 blocks for q8_0, 4 for q4_0)."""
    paths = _llama_file(tmp_path, 1024, 16, 4, 8192)
    if tails == "8":
        _need_clusters(paths["q8_0"])
    for ft in ("q8_0", "q4_0"):
        for kv in (d.KVDtype.f16, d.KVDtype.q8_0):
            want, m_off = _decode_steps(paths[ft], kv, {"DASLLAMA_CUDA_TAILS": "0"}, monkeypatch, n_steps=24)
            got, m = _decode_steps(paths[ft], kv, {"DASLLAMA_CUDA_TAILS": tails, "DASLLAMA_CUDA_CLUSTER_MAX": "8"},
                                   monkeypatch, n_steps=24)
            # (the tail in both layers of every step, beyond what joins launches without it)
            assert m._m.fused_ops - m_off._m.fused_ops >= 2 * len(got), (ft, kv.name, m._m.fused_ops)
            assert np.array_equal(got, want), f"{ft} kv {kv.name}: logits differ, max " \
                f"{np.abs(got - want).max():.3g} at step {np.argwhere(got != want)[0][0]}"


def test_f16_glu_cluster_tail_equals_the_glu_launch(files, tmp_path, monkeypatch):
    """DASLLAMA_CUDA_TAILS bit 8 on f16 weights: the one-token gate / up GEMV (float activations,
    4 rows a warp group) runs each 32-row chunk of gate and of up as one thread-block cluster whose
    rank 0 writes the chunk's GLU, so no glu launch follows; the logits of decode steps equal the
    glu launch's bit for bit (the tiny shape in f16 and bf16, and ffn 8192 over hidden 1024 in f16:
    1,024 blocks, several waves), and it ran in every layer of every step."""
    _need_clusters(files["llama"]["f16"])
    shapes = {"tiny": files["llama"]["f16"], "tiny bf16": files["llama"]["bf16"],
              "waves": _llama_file(tmp_path, 1024, 16, 4, 8192, formats=("f16",))["f16"]}
    for name, path in shapes.items():
        want, m_off = _decode_steps(path, d.KVDtype.f16, {"DASLLAMA_CUDA_TAILS": "0"}, monkeypatch, n_steps=24)
        got, m = _decode_steps(path, d.KVDtype.f16, {"DASLLAMA_CUDA_TAILS": "8", "DASLLAMA_CUDA_CLUSTER_MAX": "8"},
                               monkeypatch, n_steps=24)
        assert m._m.fused_ops - m_off._m.fused_ops >= 2 * len(got), (name, m._m.fused_ops, m_off._m.fused_ops)
        assert np.array_equal(got, want), f"{name}: logits differ, max " \
            f"{np.abs(got - want).max():.3g} at step {np.argwhere(got != want)[0][0]}"


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_rms_tail_decode_against_the_cpu(files, tmp_path, monkeypatch, kv):
    """DASLLAMA_CUDA_TAILS bit 4 (rms_tail): the residual GEMVs (O, down) run the blocks of each
    32-row chunk of x as one thread-block cluster whose rank 0 rounds x * norm_w and writes the
    chunk's sum of squares, and the next GEMV (gate / up, Q / K / V with its rope) scales its sums
    by the RMS norm, so no rounding launch comes between them. Its quants are not the normed row's
    bit for bit, so the logits are held to the reference as the q8 checks are: teacher-forced
    decode steps (40 to 190 rows of a paged cache), q8_0 and q4_0, head sizes 32, 64 and 128 and
    an ffn of 8192 (clusters of 2 to 8 blocks, gate / up over several waves), at most twice as far
    from the CPU's fp32 logits (NMSE) as the CPU's own q8 mode, where a wrong op gives 1e-2 or
    more; the tail ran 2L - 1 times a step (O of every layer, down of all but the last, where a
    chunk's blocks fit a portable cluster), beside
    the cluster GLU tail (bit 8) in half the cases and, on an f16 cache, the rope epilogue; and with
    DASLLAMA_CUDA_CLUSTER_MAX=16, down's 16-block chunks too."""
    shapes = {"tiny": files["llama"], "hd64": _llama_file(tmp_path, 512, 8, 2, 1024),
              "hd128": _llama_file(tmp_path, 512, 4, 2, 1536), "waves": _llama_file(tmp_path, 1024, 16, 4, 8192)}
    _need_clusters(files["llama"]["q8_0"])
    ids = [1] + np.random.default_rng(6).integers(3, E.VOCAB, 189).tolist()
    for name, paths in shapes.items():
        for ft in ("q8_0", "q4_0"):
            ref, _ = _forced_steps(paths[ft], "cpu", d.QuantMode.fp32, kv, ids)
            cpu_q8, _ = _forced_steps(paths[ft], "cpu", d.QuantMode.q8, kv, ids)
            for tails in ("4", "12", "12/16"):
                tails, cmax = (tails.split("/") + ["8"])[:2]
                monkeypatch.setenv("DASLLAMA_CUDA_TAILS", tails)
                monkeypatch.setenv("DASLLAMA_CUDA_CLUSTER_MAX", cmax)
                got, m = _forced_steps(paths[ft], "cuda", d.QuantMode.q8, kv, ids)
                monkeypatch.delenv("DASLLAMA_CUDA_TAILS")
                monkeypatch.delenv("DASLLAMA_CUDA_CLUSTER_MAX")
                # O's tail in every layer; down's in all but the last, where its chunk's blocks make a
                # cluster of at most CLUSTER_MAX (q8_0 at ffn 8192 splits each row over 8 warps: 16
                # blocks a chunk, sm_90's non-portable size)
                layers = 2
                want = 2 * layers - 1 if not (name == "waves" and ft == "q8_0" and cmax == "8") else layers
                assert m._m.path_count("rms_tail") >= want * len(got), (name, ft, tails, m._m.path_count("rms_tail"))
                assert (m._m.path_count("gemv_rope") >= layers * len(got)) == (kv == d.KVDtype.f16), (name, ft)
                e, e_cpu = nmse(got, ref), nmse(cpu_q8, ref)
                print(f"{name} {ft} kv {kv.name} TAILS={tails} CLUSTER_MAX={cmax}: NMSE {e:.3g}, the CPU's q8 {e_cpu:.3g}")
                assert e <= 2 * e_cpu, \
                    f"{name} {ft} kv {kv.name} TAILS={tails}: NMSE {e:.3g} against fp32, the CPU's q8 {e_cpu:.3g}"


def test_gemv_rope_equals_two_launches(files, tmp_path, monkeypatch):
    """The Q / K / V GEMV that also ropes Q and K and stores K and V into the cache
    (cuda::gemv_roped, the default where it fits: normal rope, f16 / f32 caches, 1-4 tokens) gives
    the GEMV-then-rope-and-store launches' logits bit for bit (DASLLAMA_CUDA_GEMV_ROPE=0): decode
    steps and batched steps of three sessions, head sizes 32 / 64 / 128 (rows over 1-8 warps), q8
    mode's q8_0 / q4_0 and f16; it ran (path_count), and a q8_0 cache keeps the two launches."""
    shapes = {"tiny": files["llama"], "hd64": _llama_file(tmp_path, 512, 8, 2, 1024, formats=("q8_0", "f16")),
              "hd128": _llama_file(tmp_path, 1024, 8, 2, 1024, formats=("q4_0", "f16"))}
    for name, paths in shapes.items():
        for ft in ("q8_0", "q4_0", "f16"):
            if ft not in paths:
                continue
            for kv in (d.KVDtype.f16, d.KVDtype.f32, d.KVDtype.q8_0):
                want, _ = _decode_steps(paths[ft], kv, {"DASLLAMA_CUDA_GEMV_ROPE": "0"}, monkeypatch, n_steps=40)
                got, m = _decode_steps(paths[ft], kv, {"DASLLAMA_CUDA_GEMV_ROPE": "1"}, monkeypatch, n_steps=40)
                n = m._m.path_count("gemv_rope")
                assert (n > 0) == (kv != d.KVDtype.q8_0), (name, ft, kv.name, n)
                assert np.array_equal(got, want), \
                    f"{name} {ft} kv {kv.name}: decode logits differ, max {np.abs(got - want).max():.3g}"
                want, _ = _batch_steps(paths[ft], kv, {"DASLLAMA_CUDA_GEMV_ROPE": "0"}, monkeypatch)
                got, m = _batch_steps(paths[ft], kv, {"DASLLAMA_CUDA_GEMV_ROPE": "1"}, monkeypatch)
                assert (m._m.path_count("gemv_rope") > 0) == (kv != d.KVDtype.q8_0), (name, ft, kv.name)
                assert np.array_equal(got, want), f"{name} {ft} kv {kv.name}: batched logits differ"


def test_rope_angles_at_the_start_equal_at_the_end(files, tmp_path, monkeypatch):
    """The one-token q8 Q / K / V GEMV forming its rope angles at its start, before its weights and
    its wait (DASLLAMA_CUDA_ROPE_EARLY=1; q8_0's default), gives the logits of forming them after
    the sums bit for bit: decode steps after an 80-token prefill, and ragged batched steps (their
    kernels keep the late angles); q8_0 / q4_0, an f16 and an f32 cache; hidden 64, 320 and 512
    (head sizes 16 and 64)."""
    fmts = ("q8_0", "q4_0")
    shapes = {"tiny": files["llama"], "h320": _llama_file(tmp_path, 320, 5, 1, 640, formats=fmts),
              "h512": _llama_file(tmp_path, 512, 8, 2, 1024, formats=fmts)}
    for name, paths in shapes.items():
        for ft in fmts:
            for kv in (d.KVDtype.f16, d.KVDtype.f32):
                late, early = {"DASLLAMA_CUDA_ROPE_EARLY": "0"}, {"DASLLAMA_CUDA_ROPE_EARLY": "1"}
                want, _ = _decode_steps(paths[ft], kv, late, monkeypatch, n_prompt=80, n_steps=40)
                got, m = _decode_steps(paths[ft], kv, early, monkeypatch, n_prompt=80, n_steps=40)
                assert m._m.path_count("gemv_rope") > 0, (name, ft, kv.name)
                assert np.array_equal(got, want), f"{name} {ft} kv {kv.name}: decode logits differ, " \
                    f"max {np.abs(got - want).max():.3g}"
                want, _ = _batch_steps(paths[ft], kv, late, monkeypatch)
                got, _ = _batch_steps(paths[ft], kv, early, monkeypatch)
                assert np.array_equal(got, want), f"{name} {ft} kv {kv.name}: batched logits differ"


def test_attention_early_loads_equal_late(files, tmp_path, monkeypatch):
    """The grouped-query decode attention loading its first key batch before waiting on the kernel
    before it (DASLLAMA_CUDA_ATTN_EARLY, the default; only rows earlier steps wrote) gives the
    logits of loading it after, bit for bit: decode steps whose splits grow with the context, and
    batched steps, over f16 and q8_0 caches."""
    path = _llama_file(tmp_path, 512, 8, 2, 1024, formats=("q8_0",))["q8_0"]
    for kv in (d.KVDtype.f16, d.KVDtype.q8_0):
        want, _ = _decode_steps(path, kv, {"DASLLAMA_CUDA_ATTN_EARLY": "0"}, monkeypatch)
        got, m = _decode_steps(path, kv, {"DASLLAMA_CUDA_ATTN_EARLY": "1"}, monkeypatch)
        assert m._m.path_count("attn_gqa") > 0
        assert np.array_equal(got, want), f"kv {kv.name}: decode logits differ, max {np.abs(got - want).max():.3g}"
        want, _ = _batch_steps(path, kv, {"DASLLAMA_CUDA_ATTN_EARLY": "0"}, monkeypatch)
        got, _ = _batch_steps(path, kv, {"DASLLAMA_CUDA_ATTN_EARLY": "1"}, monkeypatch)
        assert np.array_equal(got, want), f"kv {kv.name}: batched logits differ"


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0, d.KVDtype.f32])
def test_fused_decode_layer_equals_op_by_op(files, tmp_path, monkeypatch, kv):
    """Decode steps give the op-by-op kernels' logits bit for bit when each GEMV rounds its own
    input (DASLLAMA_CUDA_QX=1) and when each layer runs as one fused kernel
    (cuda/fused.cu): head sizes 32, 64 and 128, q8_0 and q4_0 weights, a paged cache whose
    attention splits grow with the context (40 to 190 rows). The fused layer's attention keeps
    attn_k's order of sums, so the op-by-op steps take attn_k too (DASLLAMA_CUDA_ATTN_GQA=0)."""
    monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", "0")
    shapes = {"tiny": files["llama"], "hd64": _llama_file(tmp_path, 512, 8, 2, 1024),
              "hd128": _llama_file(tmp_path, 512, 4, 2, 1536)}
    for name, paths in shapes.items():
        for ft in ("q8_0", "q4_0"):
            want, m_off = _decode_steps(paths[ft], kv, {"DASLLAMA_CUDA_FUSED": "0", "DASLLAMA_CUDA_QX": "0"},
                                        monkeypatch)
            n_off = m_off._m.fused_layers
            for env in ({"DASLLAMA_CUDA_QX": "1"}, {"DASLLAMA_CUDA_FUSED": "1"}):
                got, m_on = _decode_steps(paths[ft], kv, env, monkeypatch)
                n_on = m_on._m.fused_layers
                fused = env.get("DASLLAMA_CUDA_FUSED") == "1"
                assert n_off == 0 and n_on == (150 * 2 if fused else 0), (name, ft, env, n_off, n_on)
                assert np.array_equal(got, want), f"{name} {ft} kv {kv.name} {env}: logits differ, max " \
                    f"{np.abs(got - want).max():.3g} at step {np.argwhere(got != want)[0][0]}"


def _forced_steps(path, device, mode, kv, ids, n_prompt=40):
    """Per decode step's logits, the steps teacher-forced through ids[n_prompt:] one token at a time
    on a paged session of 16-row pages."""
    m = d.load_model(path, mode, device=device)
    s = d.create_session(m, d.KVPool(m, page_rows=16, kv_dtype=kv))
    d.eval(m, s, ids[:n_prompt])
    out = []
    for t in ids[n_prompt:]:
        d.eval(m, s, [t])
        out.append(np.array(s.logits))
    return np.stack(out), m


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_mega_decode_chain_against_the_cpu(files, tmp_path, monkeypatch, kv):
    """DASLLAMA_CUDA_MEGA=1: a one-token step's dense layers run as one persistent kernel
    (cuda/mega.cu) whose sums run in another order than the op-by-op path's, so it is held to
    the reference as the q8 checks are: teacher-forced decode steps over a paged cache (40 to 190
    rows, attention split 16 ways), q8_0 and q4_0, head sizes 32, 64 and 128; its q8-mode logits
    are at most twice as far from the CPU's fp32 ones (NMSE) as the CPU's own q8 mode, where a
    wrong op gives 1e-2 or more; and every layer of every step ran in the chain."""
    shapes = {"tiny": files["llama"], "hd64": _llama_file(tmp_path, 512, 8, 2, 1024),
              "hd128": _llama_file(tmp_path, 512, 4, 2, 1536)}
    ids = [1] + np.random.default_rng(6).integers(3, E.VOCAB, 189).tolist()
    for name, paths in shapes.items():
        for ft in ("q8_0", "q4_0"):
            ref, _ = _forced_steps(paths[ft], "cpu", d.QuantMode.fp32, kv, ids)
            cpu_q8, _ = _forced_steps(paths[ft], "cpu", d.QuantMode.q8, kv, ids)
            monkeypatch.setenv("DASLLAMA_CUDA_MEGA", "1")
            got, m = _forced_steps(paths[ft], "cuda", d.QuantMode.q8, kv, ids)
            monkeypatch.delenv("DASLLAMA_CUDA_MEGA")
            assert m._m.fused_layers == 2 * len(got), (name, ft, m._m.fused_layers)
            e, e_cpu = nmse(got, ref), nmse(cpu_q8, ref)
            print(f"{name} {ft} kv {kv.name}: NMSE {e:.3g}, the CPU's q8 {e_cpu:.3g}")
            assert e <= 2 * e_cpu, f"{name} {ft} kv {kv.name}: NMSE {e:.3g} against fp32, the CPU's q8 {e_cpu:.3g}"


def _forced_batch(path, mode, kv, B, monkeypatch, gqa, n_steps=24):
    """Batched decode of B sessions (prompts of 200 and 6 to 105 tokens; a ragged step of 3, 1 and
    2 rows first), then n_steps steps of tokens drawn in advance (the same inputs however the
    logits come out): each step's logits, and the attentions the grouped-query kernel ran
    (path_count)."""
    monkeypatch.setenv("DASLLAMA_CUDA_ATTN_GQA", gqa)
    m = d.load_model(path, mode, device="cuda")
    pool = d.create_kv_pool(m, page_rows=16, kv_dtype=kv, max_pages=B * 20)
    ws = d.create_batch_workspace(m)
    rng = np.random.default_rng(3)
    ss = [d.create_session(m, pool) for _ in range(B)]
    for i, s in enumerate(ss):
        d.eval(m, s, [1] + rng.integers(3, E.VOCAB, 200 if B == 1 else 5 + 9 * i).tolist())
    if B > 1:
        d.eval_batch(m, ws, ss, [[5, 6, 7], [8], [9, 10]][:B] + [[11]] * (B - 3))
    logits = []
    for t in rng.integers(3, E.VOCAB, (n_steps, B)).tolist():
        d.eval_batch(m, ws, ss, [[x] for x in t])
        logits.append(np.array([s.logits for s in ss]))
    return np.array(logits), m._m.path_count("attn_gqa")


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0, d.KVDtype.f32])
def test_gqa_decode_attention_batches(tmp_path, monkeypatch, kv):
    """DASLLAMA_CUDA_ATTN_GQA=1 (cuda/attention.cu's grouped-query decode kernel): batched decode
    steps of 1, 3 and 12 sessions, teacher-forced, on random Llamas of head size 64 with 4 and 1
    query heads a KV head and of head size 128 with 2, in q8 mode (the attention rounding its
    output for O, AttnQuant) and fp32 mode: the logits of the switch off within the order of f32
    sums (fp32 mode: LOGIT_BAR, and the same argmax every step; q8 mode, where that order may tip
    an activation's 8-bit rounding: 1e-4, where a wrong op gives 1e-2 or more), and every step's
    attentions took the kernel."""
    for sub in ("g4", "g1", "g2"):
        (tmp_path / sub).mkdir()
    shapes = {"hd64-g4": _llama_file(tmp_path / "g4", 512, 8, 2, 1024),
              "hd64-g1": _llama_file(tmp_path / "g1", 512, 8, 8, 1024),
              "hd128-g2": _llama_file(tmp_path / "g2", 512, 4, 2, 1536)}
    modes = [d.QuantMode.q8, d.QuantMode.fp32] if kv == d.KVDtype.f16 else [d.QuantMode.q8]
    for name, paths in shapes.items():
        for mode in modes:
            for B in (1, 3, 12):
                lw, n_off = _forced_batch(paths["q8_0"], mode, kv, B, monkeypatch, "0")
                lg, n_on = _forced_batch(paths["q8_0"], mode, kv, B, monkeypatch, "1")
                tag = f"{name} {mode.name} kv {kv.name} B={B}"
                assert n_off == 0 and n_on >= 2 * 24, (tag, n_off, n_on)  # 2 layers, 24 steps at least
                e = nmse(lg, lw)
                print(f"{tag}: logits NMSE {e:.3g}")
                assert e <= (LOGIT_BAR if mode == d.QuantMode.fp32 else 1e-4), f"{tag}: logits NMSE {e:.3g}"
                if mode == d.QuantMode.fp32:
                    assert np.array_equal(lg.argmax(-1), lw.argmax(-1)), tag


def test_speculated_batch_steps_equal_plain(files):
    """Speculated steps (the default): each batch decode step records the next while the device runs (the
    logits' download in two halves around it): the plain steps' logits bit for bit."""
    for ft in ("f16", "q8_0"):
        C.speculated_batch_steps_equal_plain(files["llama"][ft], "cuda")
    C.speculated_stepper_streams_equal_plain(files["llama"]["q8_0"], "cuda")


def test_greedy_batch_steps_equal_logits_argmax(files):
    """Batched greedy steps take their argmaxes on the GPU (eval_batch(greedy=True), BatchStepper's
    greedy streams): numpy's argmax of the plain steps' logits, across the GEMVs' and tiles'
    token counts, speculated steps, ragged steps and steps of several chunks."""
    for ft in ("f16", "q8_0", "q4_0"):
        C.greedy_batch_steps_equal_logits_argmax(files["llama"][ft], "cuda")
    C.greedy_batch_steps_equal_logits_argmax(files["gemma2"]["q8_0"], "cuda")  # the final softcap


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_logits_in_parts_equal_one_product(files, monkeypatch, name):
    """The logits made and downloaded in parts of the vocabulary (DASLLAMA_CUDA_LOGIT_PARTS: each
    part's download overlapping the next part's product; gemma2's final softcap applied a part at
    a time): batched decode steps of 3 and 12 sessions (the GEMVs, the tiles and cuBLAS's
    ranges), speculated as by default, give the one product's logits; a prefill asking for every
    row's logits gives the CPU's in fp32 mode."""
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, E.VOCAB, 4 + i).tolist() for i in range(12)]
    toks = rng.integers(3, E.VOCAB, (5, 12)).tolist()

    def steps(path, parts, B):
        monkeypatch.setenv("DASLLAMA_CUDA_LOGIT_PARTS", parts)
        m = d.load_model(path, d.QuantMode.q8, device="cuda")
        pool = d.create_kv_pool(m, page_rows=16)
        ws = d.create_batch_workspace(m)
        ss = [d.create_session(m, pool) for _ in range(B)]
        for s, p in zip(ss, prompts):
            d.eval(m, s, p)
        out = []
        for t in toks:
            d.eval_batch(m, ws, ss, t[:B])
            out.append(np.array([s.logits for s in ss]))
        # every batched step's head was made in parts (a speculated recording left unissued counts
        # too), or none was
        n = m._m.parted_logits
        assert (n >= len(toks)) if parts != "0" else n == 0, (parts, n)
        return np.array(out)

    for ft, path in files[name].items():
        for B in (3, 12):
            one, parts = steps(path, "0", B), steps(path, "3", B)
            e = nmse(parts, one)
            assert e <= 1e-12, f"{name} {ft} B={B}: logits in parts against one product, NMSE {e:.3g}"
        monkeypatch.setenv("DASLLAMA_CUDA_LOGIT_PARTS", "3")
        ids = [1] + rng.integers(3, E.VOCAB, 40).tolist()
        e = nmse(teacher_forced(path, "cuda", ids), teacher_forced(path, "cpu", ids))
        assert e <= LOGIT_BAR, f"{name} {ft}: a prefill's logits in parts against the CPU, NMSE {e:.3g}"


def test_paged_prefix_cache_and_ragged_batch(files):
    prompt = [1] + np.random.default_rng(3).integers(3, E.VOCAB, 70).tolist()
    C.paged_prefix_cache_and_ragged_batch(files["qwen3"]["q8_0"], "cuda", prompt)


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "gpt-oss"])
def test_moe_families(tmp_path, name):
    C.moe_family(str(tmp_path), name, "cuda")


def test_gemma4_released_head_sizes(tmp_path):
    """Gemma-4's released head sizes, 256 sliding and 512 global (attn_k's 16-a-lane instance)."""
    C.gemma4_family(str(tmp_path), "dense", "cuda", wide=True)


@pytest.mark.parametrize("name", ["qwen35", "qwen3next", "qwen35moe"])
def test_hybrid_families(tmp_path, name):
    C.hybrid_family(str(tmp_path), name, "cuda")


@pytest.mark.parametrize("name", ["dense", "eseries", "moe"])
def test_gemma4_shapes(tmp_path, name):
    C.gemma4_family(str(tmp_path), name, "cuda")


def test_errors_leave_the_process_usable(files):
    C.errors_leave_the_process_usable(files["llama"]["f32"], "cuda")


def test_audio_tower_and_turn(tmp_path):
    C.audio_tower_and_turn(tmp_path, "cuda", seconds=3, max_new=24)


def test_vision_tower_and_turn(tmp_path):
    C.vision_tower_and_turn(tmp_path, "cuda", max_new=24)


@pytest.mark.parametrize("family", ["qwen25v", "qwen3v"])
def test_qwen_vision_tower_and_turn(tmp_path, family):
    C.qwen_vision_tower_and_turn(tmp_path, "cuda", family, max_new=24)
