"""The library end to end on a Vulkan device, against the CPU backend on the same files.

Sized for lavapipe (Mesa's Vulkan on the CPU), which CI runs on every submission: SmolLM2-135M's
teacher-forced logits over a short text against the CPU in fp32 mode (weights decoded exactly,
f32 math) by normalized squared error, and a few greedy tokens equal to the CPU's; on tiny
random models (tests/oracles/export.py), the f16 / q8_0 caches, paged sessions with the prefix
cache, a ragged batch, an audio turn and the errors. The op-level harness is
tests/test_backend_ops.py. Without a Vulkan device every test here skips, saying why.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import dasllama as d

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "oracles"))
import _device_checks as C  # noqa: E402

# tests/oracles/export.py's vocabulary size, without importing it (and torch) where `tiny` is handed down.
VOCAB = 512

_VK = d.system_info()["devices"]["vulkan"]
pytestmark = pytest.mark.skipif(not _VK["devices"], reason="no Vulkan device here: " + (_VK["error"] or "none found"))

# Measured on lavapipe: 1e-12..2e-11 on SmolLM2 (f32 accumulation in another order); a wrong op
# moves the logits by O(1), an NMSE of 1e-2 or more.
LOGIT_BAR = C.LOGIT_BAR
nmse = C.nmse
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"




def _greedy(m, s, n, vocab):
    toks = []
    for _ in range(n):
        t = int(np.argmax(np.asarray(s.logits).reshape(-1, vocab)[-1]))
        toks.append(t)
        d.eval(m, s, [t])
    return toks


def test_smollm2_logits_and_greedy(smollm2_path):
    out = {}
    for dev in ("cpu", "vulkan"):
        m = d.load_model(smollm2_path, d.QuantMode.fp32, device=dev)
        ids = d.encode(m, TEXT)
        s = d.create_session(m, d.KVDtype.f32, n_ctx=len(ids) + 8)
        d.eval(m, s, ids, all_logits=True)
        logits = np.array(s.logits).reshape(len(ids), -1)
        out[dev] = (logits, _greedy(m, s, 4, logits.shape[1]))
    e = nmse(out["vulkan"][0], out["cpu"][0])
    print(f"SmolLM2 teacher-forced logits over {out['cpu'][0].shape[0]} tokens: NMSE {e:.2e}")
    assert e <= LOGIT_BAR, f"Vulkan logits NMSE {e:.3g} against the CPU"
    assert out["vulkan"][1] == out["cpu"][1]


# Files that several tests use (the tiny model, the converted vision models) are built once into
# one folder. The lavapipe tests below rerun cases of this file in child pytest runs (other
# switches in the environment) and hand the folder down here, so a child builds nothing again.
BUILT_ENV = "DASLLAMA_TEST_VK_BUILT"


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory):
    return os.environ.get(BUILT_ENV) or str(tmp_path_factory.mktemp("vk-built"))


@pytest.fixture(scope="module")
def tiny(built_dir):
    """A tiny random llama-family model, f32 from the exporter and q8_0 requantized."""

    def make(out):
        from dasllama.convert import requantize
        import export as E  # tests/oracles/export.py

        assert E.VOCAB == VOCAB
        fam = E.FAMILIES["llama"]
        f32 = os.path.join(out, "llama-f32.gguf")
        E.write_gguf(fam, fam.make(), f32, "f32", E.spm_model_proto())
        q8 = os.path.join(out, "llama-q8_0.gguf")
        requantize(f32, q8, "q8_0")
        return f32, q8

    f32, q8 = C.built_once(built_dir, "llama-tiny", make)
    return {"f32": f32, "q8_0": q8}


def _child(built_dir, env: dict, files, k: str, s: bool = False):
    """A child pytest run of `files` (names in tests/) selected by `k`, with the switches in `env`
    set and this run's built files handed down; returns its CompletedProcess (output captured)."""
    import subprocess

    here = os.path.dirname(__file__)
    # The children name the int8 shaders a q8-mode prefill of q8_0 / q4_0 runs: on the workgroup-scope
    # tiles' devices, where those matrices are decoded to f16 by default, Q8CM2=0 keeps the int8 tiles
    # (test_f16_prefill_coopmat2's children and this run's own prefills hold the default).
    q8cm2 = {"DASLLAMA_VULKAN_Q8CM2": os.environ.get("DASLLAMA_VULKAN_Q8CM2", "0")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q"] + (["-s"] if s else []) + ["-p", "no:cacheprovider"] +
                          [os.path.join(here, f) for f in files] + ["-k", k],
                          env={**os.environ, **q8cm2, **env, BUILT_ENV: built_dir},
                          capture_output=True, text=True)


# Cases that the children below would run the same way as this run or another child does, left
# out of their selections: test_matmul_q8_mode past 4 tokens (the decode GEMV variants' switches
# act on 1 to 4 tokens; 7 and 20 take gemv_i8, 100 and 150 the int8 GEMM, as in
# test_int8_prefill_on_lavapipe's children).
Q8_PAST_4 = "7-512 or 20-512 or 100-512 or 150-416"


def teacher_forced(path, device, ids, kv):
    m = d.load_model(path, d.QuantMode.fp32, device=device)
    s = d.create_session(m, kv, n_ctx=len(ids))
    d.eval(m, s, ids, all_logits=True)
    return np.array(s.logits).reshape(len(ids), -1)


@pytest.mark.parametrize("kv", [d.KVDtype.f16, d.KVDtype.q8_0])
def test_kv_types(tiny, kv):
    ids = [1] + np.random.default_rng(2).integers(3, VOCAB, 40).tolist()
    e = nmse(teacher_forced(tiny["q8_0"], "vulkan", ids, kv), teacher_forced(tiny["q8_0"], "cpu", ids, kv))
    assert e <= LOGIT_BAR, f"kv {kv.name}: NMSE {e:.3g}"


def test_decode_steps_replayed(tiny):
    """A 70-token prefill (a step the backend runs once), then token-by-token decode (steps it
    records once and replays, with n_kv and the store's row read from the device; attention
    splits its keys past 64 and the step is recorded again as their count grows) against the
    CPU's teacher-forced logits over the same ids."""
    ids = [1] + np.random.default_rng(4).integers(3, VOCAB, 229).tolist()
    ref = teacher_forced(tiny["q8_0"], "cpu", ids, d.KVDtype.f16)[69:]
    m = d.load_model(tiny["q8_0"], d.QuantMode.fp32, device="vulkan")
    e = nmse(_decode_logits(m, ids, 70), ref)
    assert e <= LOGIT_BAR, f"decode steps: NMSE {e:.3g} against the CPU"


def _decode_logits(m, ids, n_prefill):
    """A fresh f16-cache session's logits after prefilling ids[:n_prefill], then after each later id
    decoded one at a time."""
    s = d.create_session(m, d.KVDtype.f16, n_ctx=len(ids))
    d.eval(m, s, ids[:n_prefill])
    got = [np.array(s.logits).reshape(-1)]
    for t in ids[n_prefill:]:
        d.eval(m, s, [t])
        got.append(np.array(s.logits).reshape(-1))
    return np.stack(got)


# (No "greedy" in the name: test_tiled_attention_on_lavapipe's child selects that word.)
def test_pipelined_generate_equals_the_plain_loop(tiny):
    """Greedy generate issues each step before the host reads the id before it, and Vulkan
    submits each step without waiting for it (DASLLAMA_VULKAN_ASYNC, on by default): the same
    tokens, logits and session state as the step-by-step loop, however the stream ends (a step
    taken back, a full context, a full page pool)."""
    C.pipelined_greedy_equals_plain(tiny["q8_0"], "vulkan", [1, 5, 9, 13, 17, 21, 25], d.QuantMode.q8)


def test_pipelined_generate_on_a_queue_thread(built_dir, tiny):
    """The same on a queue that runs behind the host, as a GPU's does (lavapipe submits from the
    calling thread unless MESA_VK_ENABLE_SUBMIT_THREAD is set), with DASLLAMA_VULKAN_STEPS=1 so
    the backend reports its submissions: command buffers were begun while one before them was
    still pending, and steps were replayed. DASLLAMA_VULKAN_GPUTIME=each is on as well: timing
    each submission's span on the device leaves all that (and the tokens) as they are, and its
    per-submission lines add up to its summary."""
    import re

    r = _child(built_dir, {"MESA_VK_ENABLE_SUBMIT_THREAD": "1", "DASLLAMA_VULKAN_STEPS": "1",
                           "DASLLAMA_VULKAN_GPUTIME": "each"}, ("test_vulkan.py",), "pipelined_generate_equals", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    ran = [int(n) for n in re.findall(r"(\d+) begun while one ran", out)]
    assert ran and max(ran) > 0, out[-3000:]
    assert max(int(n) for n in re.findall(r"(\d+) replayed", out)) > 0, out[-3000:]
    total = re.findall(r"vulkan gpu time: (\d+) submissions, busy ([\d.]+) ms, idle between them ([\d.]+) ms", out)
    each = [float(b) for b in re.findall(r"vulkan submission \d+: busy ([\d.]+) us", out)]
    assert total and sum(int(n) for n, _, _ in total) == len(each), out[-3000:]
    busy = sum(float(b) for _, b, _ in total)
    assert busy > 0 and abs(busy - sum(each) * 1e-3) <= 1e-3 * len(each) + 1e-6 * busy, (busy, sum(each))


def test_step_profile(built_dir, tiny):
    """DASLLAMA_VULKAN_STEPPROF=1 stamps each dispatch inside recorded steps, so replayed decode
    steps are timed as they run: the decode test still passes under it (the same logits), and
    each profiled step's dispatch lines add up to its per-run total, with the decode attention
    among them (one a layer)."""
    import re

    r = _child(built_dir, {"DASLLAMA_VULKAN_STEPPROF": "1"}, ("test_vulkan.py",), "decode_steps_replayed", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    heads = list(re.finditer(r"vulkan step profile \(.*\): step \d+, (\d+) runs, (\d+) dispatches, ([\d.]+) us a run\n", out))
    assert heads, out[-3000:]
    for h in heads:
        n = int(h.group(2))
        lines = out[h.end():].splitlines()[:n]
        spans = [float(re.match(r"\s+\d+ (\S+)\s+([\d.]+) us$", ln).group(2)) for ln in lines]
        assert len(spans) == n and all(x >= 0 for x in spans), lines
        total = float(h.group(3))
        assert abs(sum(spans) - total) <= 0.01 * n + 1e-3 * total, (sum(spans), total)
        assert any(re.search(r"attn|attention", ln) for ln in lines), lines


def test_speculated_batch_steps_equal_plain(tiny):
    C.speculated_batch_steps_equal_plain(tiny["q8_0"], "vulkan")
    C.speculated_stepper_streams_equal_plain(tiny["q8_0"], "vulkan")


def test_greedy_batch_steps_equal_logits_argmax(tiny):
    C.greedy_batch_steps_equal_logits_argmax(tiny["q8_0"], "vulkan")


def test_paged_prefix_cache_and_ragged_batch(tiny):
    prompt = [1] + np.random.default_rng(3).integers(3, VOCAB, 40).tolist()
    C.paged_prefix_cache_and_ragged_batch(tiny["q8_0"], "vulkan", prompt)


@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "gpt-oss"])
def test_moe_families(tmp_path, name):
    C.moe_family(str(tmp_path), name, "vulkan")


@pytest.mark.parametrize("name", ["qwen35", "qwen3next", "qwen35moe"])
def test_hybrid_families(tmp_path, name):
    C.hybrid_family(str(tmp_path), name, "vulkan")


@pytest.mark.parametrize("name", ["dense", "eseries", "moe"])
def test_gemma4_shapes(tmp_path, name):
    C.gemma4_family(str(tmp_path), name, "vulkan")


def test_gemma4_released_head_sizes(tmp_path):
    """Gemma-4's released head sizes, 256 on the sliding layers and 512 on the global ones (decode
    rows on attn_dec's wider variants where subgroups have 16 lanes or more, the row-a-workgroup
    attention's 512-wide variant otherwise and for prefill rows; test_subgroup_widths_on_lavapipe
    runs this at 16 lanes)."""
    C.gemma4_family(str(tmp_path), "dense", "vulkan", wide=True)


def test_errors_leave_the_process_usable(tiny):
    C.errors_leave_the_process_usable(tiny["f32"], "vulkan")


def test_audio_tower_and_turn(tmp_path):
    C.audio_tower_and_turn(tmp_path, "vulkan", seconds=2, max_new=8)


def test_qwen3_asr_tower_and_transcribe(qwen3_asr_files):
    C.qwen3_asr_tower_and_transcribe(qwen3_asr_files, "vulkan", max_new=8)


def dec_variants(width: int, head_sizes) -> set:
    """The decode attention shaders vulkan_backend.cpp's attn_dec_pick gives these head sizes where
    the narrowest subgroup has `width` lanes (8 dim pairs a lane for attn_dec, 16, 32)."""
    out = set()
    for hd in head_sizes if width >= 8 else ():
        if hd <= 8 * width and hd <= 256:
            out.add("attn_dec")
        elif hd <= 16 * width:
            out.add("attn_dec_8")
        elif hd <= 32 * width:
            out.add("attn_dec_w")
    return out


def test_subgroup_path_on_lavapipe(built_dir):
    """GPUs take matmul's subgroup path (and past 32 tokens the tiled one; matmul_id grouped by
    expert past 8 pairs), lavapipe the plain one; forced onto the GPUs' paths here, the op
    harness's matmul and matmul_id cases (float64 numpy and the CPU), the paged / prefix-cache /
    ragged-batch checks (a session's rows alike alone and in a batch) and the MoE families hold
    too. (The q8-mode matmuls, which take the int8 path there whatever DASLLAMA_VULKAN_GEMM says,
    run on it in test_int8_prefill_on_lavapipe's and test_int8_decode_gemv_on_lavapipe's children.)"""
    import re
    import subprocess

    env = dict(os.environ, DASLLAMA_VULKAN_SUBGROUP="1")
    probe = subprocess.run([sys.executable, "-c", "import dasllama as d; print(d.system_info()['devices']"
                            "['vulkan']['devices'][0]['features'])"], env=env, capture_output=True, text=True)
    assert probe.stdout.strip().split(", ")[0] == "subgroup matmul", probe.stdout + probe.stderr
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1"}, ("test_backend_ops.py", "test_vulkan.py"),
               "(matmul or paged or moe) and not q8_mode")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    # The op harness's decode attention cases above held against numpy on attn_dec.comp: the
    # profile of the same cases names it (and attention.comp for the rows it does not take), and
    # the variant each head size takes at this device's narrowest subgroup (lavapipe's 8 lanes:
    # 128 on attn_dec_8, 256 on attn_dec_w; NVIDIA's 32: 512 on attn_dec_8).
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1"}, ("test_backend_ops.py",),
               "test_paged_attention and not multi and not gqa and tok1-", s=True)
    for sh in dec_variants(int(probe.stdout.split("subgroups ")[1].split("-")[0]), (64, 128, 256, 512)):
        assert r.returncode == 0 and re.search(rf"^\s*{sh}\s+[\d.]+ ms\s+\d+ calls", r.stderr, re.M), \
            sh + "\n" + r.stdout[-3000:] + r.stderr[-2000:]
    # The same with attention.comp's key splits joined by a second dispatch (attention_merge),
    # head size 512 on their 512-wide variants.
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1",
                           "DASLLAMA_VULKAN_ATTN_SPLIT": "dispatch"}, ("test_backend_ops.py",),
               "test_paged_attention and not multi and not gqa and tok1-", s=True)
    for sh in ("attention_merge", "attention_merge_512", "attention_512"):
        assert r.returncode == 0 and re.search(rf"^\s*{sh}\s+[\d.]+ ms\s+\d+ calls", r.stderr, re.M), \
            sh + "\n" + r.stdout[-3000:] + r.stderr[-2000:]
    # The f16 decode GEMV's row split cases above ran on gemv.comp (the profile names it).
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1"}, ("test_vulkan.py",),
               "gemv_rows_split_or_whole", s=True)
    assert r.returncode == 0 and re.search(r"^\s*gemv1_1\s+[\d.]+ ms\s+\d+ calls", r.stderr, re.M), \
        r.stdout[-3000:] + r.stderr[-2000:]
    # Prefill's 128 x 64 GEMM (opt-in: slower than the 64 x 64 tiles on the H200) holds too.
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_GEMM": "1"}, ("test_backend_ops.py",),
               "matmul and not q8_mode")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


# What GPUs' subgroups span: NVIDIA's 32 lanes, AMD's 32 or 64, Intel's 8 to 32, mobile parts
# 4 to 16. llvmpipe's follow its vector width (LP_NATIVE_VECTOR_WIDTH: 128 bits are 4 lanes,
# 512 bits 16), so the shaders that size work by the subgroup run at other widths than its
# default 8: at 16, the decode attention's variants (head sizes 64, 256 and 512: attn_dec,
# attn_dec_8, attn_dec_w) and flash2's shuffles; at 4, where those need 8 lanes, their fallbacks
# (attention.comp, flash2's reductions through shared memory). (At 1024 bits, 32 lanes, Mesa
# 22.3's llvmpipe gets wrong results from shaders that hold on NVIDIA's 32 lanes, the subgroup
# matmul among them: not a width to check here.)
SUBGROUP_WIDTH_CASES = ("(test_paged_attention and not multi and not gqa and tok1-) or flash_variants"
                        " or gemv_rows_split_or_whole"
                        " or (matmul and not q8_mode and not lavapipe)"
                        " or (test_matmul_q8_mode and (1-512 or 2-288 or 3-1056)) or gemma4_released")


def _lavapipe_width(bits: int, lanes: int) -> dict:
    """The environment that puts llvmpipe's subgroups at `lanes` (LP_NATIVE_VECTOR_WIDTH=bits) on
    the GPUs' path; skips where the device is not llvmpipe or its CPU caps the width."""
    import subprocess

    if "llvmpipe" not in _VK["devices"][0]["name"]:
        pytest.skip("LP_NATIVE_VECTOR_WIDTH sets llvmpipe's subgroup width only")
    env = {"LP_NATIVE_VECTOR_WIDTH": str(bits), "DASLLAMA_VULKAN_SUBGROUP": "1"}
    probe = subprocess.run([sys.executable, "-c", "import dasllama as d; print(d.system_info()['devices']"
                            "['vulkan']['devices'][0]['features'])"], env=dict(os.environ, **env),
                           capture_output=True, text=True)
    assert probe.returncode == 0 and "subgroups" in probe.stdout, probe.stdout + probe.stderr
    if not probe.stdout.strip().endswith(f"subgroups {lanes}"):  # (a CPU whose llvmpipe caps the width)
        pytest.skip(f"llvmpipe gives {probe.stdout.strip().split()[-1]} lanes at {bits} bits on this CPU")
    return env


@pytest.mark.parametrize("bits,lanes,shaders", [(512, 16, tuple(dec_variants(16, (64, 256, 512))) + ("flash2_r2_sg",)),
                                                 (128, 4, ("attention", "flash2_r2"))])
def test_subgroup_widths_on_lavapipe(built_dir, bits, lanes, shaders):
    """The GPUs' paths (DASLLAMA_VULKAN_SUBGROUP=1) at 16- and 4-lane subgroups: the op harness's
    matmuls (decode GEMVs, subgroup and tiled matmuls, experts), decode attention and tiled
    prefill attention against float64 numpy and the CPU, Gemma-4's released head sizes end to end,
    and the profile naming the shaders the width picks (besides gemv.comp and the subgroup matmul
    at both)."""
    import re

    env = _lavapipe_width(bits, lanes)
    r = _child(built_dir, dict(env, DASLLAMA_VULKAN_PROFILE="1"), ("test_backend_ops.py", "test_vulkan.py"),
               SUBGROUP_WIDTH_CASES, s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"\d+ passed", out) and "skipped" not in out, out[-3000:]
    for sh in shaders + ("gemv1_1", "matmul_sg_0"):
        assert re.search(rf"^\s*{sh}\s+[\d.]+ ms\s+\d+ calls", out, re.M), f"{sh} did not run\n" + out[-3000:]


@pytest.mark.parametrize("bits,lanes", [(512, 16), (128, 4)])
def test_decode_folds_at_other_widths(built_dir, tiny, bits, lanes):
    """The one-token decode folds (the KV store in attn_dec, the GLU in the gate / up GEMV's tails)
    and the attention splits' join on the GPUs' path at 16- and 4-lane subgroups (at 4, decode
    attention is attention.comp's and keeps its kv_store: the tests expect the fold only where
    attn_dec runs). Without the profile, which turns folds off."""
    env = _lavapipe_width(bits, lanes)
    _tiny_family(built_dir, "qwen2-yarn")  # made here, not in a child
    _tiny_f16(tiny, built_dir)
    r = _child(built_dir, env, ("test_vulkan.py",), "attn_kv_fold_alike or decode_split_joins or gemv_glu_tail_alike")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "6 passed" in out and "skipped" not in out, out[-3000:]


def test_q8_mode_prefill_logits(tiny):
    """A 100-token prefill in q8 mode (past the 32 tokens where a GPU's matmuls turn to tiles):
    all-row logits equal the CPU's in q8 mode (activations rounded to int8 as it rounds them)
    or, where the device keeps f32 activations (lavapipe's plain path), the CPU's in fp32 mode,
    up to the order of float sums either way; the two CPU modes are 1e-4 apart. Where the device
    has NVIDIA's workgroup-scope matrices, whose f16 tiles take q8_0 / q4_0 prefills by default
    (x and the weights rounded to f16: 11 bits where int8 blocks keep about 8), as an f16 file's
    prefill there (_device_checks.f16_q8_mode_prefill): no farther from fp32 than the CPU's q8
    mode is."""
    ids = [1] + np.random.default_rng(8).integers(3, VOCAB, 99).tolist()

    def rows(mode, device):
        m = d.load_model(tiny["q8_0"], mode, device=device)
        s = d.create_session(m, d.KVDtype.f32, n_ctx=len(ids))
        d.eval(m, s, ids, all_logits=True)
        return np.array(s.logits).reshape(len(ids), -1)

    got, cpu8, cpu32 = rows(d.QuantMode.q8, "vulkan"), rows(d.QuantMode.q8, "cpu"), rows(d.QuantMode.fp32, "cpu")
    e8, e32 = nmse(got, cpu8), nmse(got, cpu32)
    if "f16 coopmat2" in _VK["devices"][0]["features"] and os.environ.get("DASLLAMA_VULKAN_Q8CM2", "") in ("", "dq", "1"):
        e_q8 = nmse(cpu8, cpu32)
        assert e_q8 > LOGIT_BAR and e32 <= e_q8, f"q8-mode prefill on f16 tiles: NMSE {e32:.3g} against fp32, the CPU's q8 {e_q8:.3g}"
        return
    assert min(e8, e32) <= LOGIT_BAR, f"q8-mode prefill: NMSE {e8:.3g} against the CPU's q8 mode, {e32:.3g} against fp32"


def test_int8_prefill_on_lavapipe(built_dir):
    """q8-mode prefill (past 32 tokens on a GPU's path) rounds the activations to int8 blocks
    and runs the int8 GEMM (gemm_i8.comp; the int8 GEMV up to 32 tokens: gemv_q.comp, which
    rounds x itself, up to 4 (opt-in, DASLLAMA_VULKAN_GEMVQ=1), gemv_i8.comp past): forced onto the GPUs' paths here, the op harness's
    q8-mode cases (ragged tiles; float64 numpy and the CPU's q8 sums) and a model's q8-mode
    prefill logits (the CPU's q8 mode, since int8 ran) hold with the packed dot
    product where lavapipe has it and with plain bytes, and the profile (which names every
    shader dispatched) shows the int8 shaders ran (128- and 64-row tiles; and with
    DASLLAMA_VULKAN_I8=rows the 128-row tiles' low-register form), not the f32 tiles;
    where the device has int8 cooperative matrices (NVIDIA), their variant the same way."""
    feats = _VK["devices"][0]["features"]
    dot = "int8 dot" in feats
    dots = ("gemm_i8_", "gemm_i8h_", "gemv_i8_", "gemv_q1_", "gemv_q2_", "gemv_q4_")
    plain = ("gemm_i8p_", "gemm_i8ph_", "gemv_i8p_", "gemv_qp1_", "gemv_qp2_", "gemv_qp4_")
    # rows: 128-row tiles at every size, a row's sums at a time (gemm_i8r_); its rows equal the
    # GEMV's bit for bit (q8_mode_rows_alike), which the first run holds to the CPU, so this file
    # suffices.
    rows = ("gemm_i8r_" if dot else "gemm_i8rp_",) + (dots if dot else plain)[2:]
    coop = "int8 coopmat" in feats  # NVIDIA's GPUs (not lavapipe): the default prefill tiles are coop2's
    # (the harness's and the tiny model's matmuls are few tiles: coop2's 64-row tiles by default)
    both = ("test_backend_ops.py", "test_vulkan.py")
    runs = [("1", ("gemm_i8ch_",) + dots[2:] if coop else dots if dot else plain, both, {}),
            ("plain", plain, ("test_backend_ops.py",), {}), ("rows", rows, ("test_vulkan.py",), {})]
    if coop:  # coop2's 128-row tiles, gemm_i8's own tiles ("dot") and the older cooperative-matrix variant too
        runs.append(("1", ("gemm_i8c_",) + dots[2:], both, {"DASLLAMA_VULKAN_I8C_TILE": "128"}))
        runs.append(("dot", dots, both, {}))
        runs.append(("coop", ("gemm_coop_",) + dots[2:], both, {}))
    for mode, prefixes, files, extra in runs:
        # (Not gemv_variants_alike: with GEMVQ=1, 1 to 4 tokens take gemv_q whichever GEMVI8 it picks.)
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_I8": mode,
                          "DASLLAMA_VULKAN_GEMVQ": "1", **extra}, files, "q8_mode and not lavapipe and not gemv_variants",
                   s=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        for sh in ("quant_act",) + tuple(p + t for p in prefixes for t in ("40", "41")):
            assert sh in out, f"DASLLAMA_VULKAN_I8={mode}: {sh} did not run\n" + out[-3000:]
        assert "matmul_tile_40" not in out and "matmul_tile_41" not in out, out[-3000:]
    # The glu before ffn down folded into gemv_q and the queries' rope into the KV store
    # (recorded steps only, which profiling turns off): a decode alone against the same rows in
    # a 42-row step (glu, quant_act, gemm_i8; rope dispatches).
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_STEPS": "1", "DASLLAMA_VULKAN_GEMVQ": "1"},
               ("test_vulkan.py",), "ragged_step_past_32", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    folded = [[int(part.rsplit(":", 1)[1]) for part in line.split(";")] for line in out.splitlines()
              if "glu folded into gemv_q or quant_act:" in line]
    assert folded and max(f[0] for f in folded) > 0 and max(f[1] for f in folded) > 0, out[-3000:]


def test_f16_model_prefill_logits(tiny, built_dir):
    """A 100-token prefill of an f16 model (past the 32 tokens where a GPU's matmuls turn to
    tiles; on NVIDIA's f16 cooperative matrices, gemm_f16c, which keep f32 activations): all-row
    logits equal the CPU's in fp32 mode (f16 weights, f32 activations) up to the order of float
    sums."""
    from dasllama.convert import requantize

    (f16,) = C.built_once(built_dir, "llama-tiny-f16",
                          lambda out: [str(requantize(tiny["f32"], os.path.join(out, "llama-f16.gguf"), "f16",
                                                      progress=False))])
    ids = [1] + np.random.default_rng(9).integers(3, VOCAB, 99).tolist()
    e = nmse(teacher_forced(f16, "vulkan", ids, d.KVDtype.f32), teacher_forced(f16, "cpu", ids, d.KVDtype.f32))
    assert e <= LOGIT_BAR, f"f16 prefill: NMSE {e:.3g} against the CPU"


def test_f16_model_q8_mode_prefill_logits(tiny, built_dir):
    """The same prefill in q8 mode, where a device on f16 cooperative matrices rounds each
    token's x to f16 once (_device_checks.f16_q8_mode_prefill says the bar)."""
    from dasllama.convert import requantize

    (f16,) = C.built_once(built_dir, "llama-tiny-f16",
                          lambda out: [str(requantize(tiny["f32"], os.path.join(out, "llama-f16.gguf"), "f16",
                                                      progress=False))])
    C.f16_q8_mode_prefill(f16, tiny["q8_0"], "vulkan", VOCAB)


def test_block_formats_q8_mode_prefill_logits(built_dir):
    """A 100-token q8-mode prefill of a file in q4_K, q5_K, q6_K, q4_1, q5_0 and q5_1, which a
    device on f16 cooperative matrices decodes to f16 for its f16 GEMM (_device_checks'
    block_formats_q8_mode_prefill says the bar)."""
    (path,) = C.built_once(built_dir, "llama-blocks",
                           lambda out: [C.write_block_model(os.path.join(out, "llama-blocks.gguf"))])
    C.block_formats_q8_mode_prefill(path, "vulkan")


def test_block_formats_q8_mode_prefill_f16_cache_logits(built_dir):
    """The same over the default f16 cache, whose prefill attention a device on f16 cooperative
    matrices may run with Q and the probabilities rounded to f16 (DASLLAMA_VULKAN_FLASH_CM)."""
    (path,) = C.built_once(built_dir, "llama-blocks",
                           lambda out: [C.write_block_model(os.path.join(out, "llama-blocks.gguf"))])
    C.block_formats_q8_mode_prefill(path, "vulkan", d.KVDtype.f16)


def test_flash_cm_on_lavapipe(built_dir):
    """q8 mode's prefill attention over an f16 cache on f16 cooperative matrices (flash_cm.comp,
    the default where the device has them): lavapipe runs its f32-FMA stand-in (=emu: the same tiles,
    Q * scale and the probabilities rounded to f16, the same softmax) on the op harness's q8-mode
    attention cases (against numpy's own f16 rounding of Q * scale) and the block model's f16-cache
    prefill, and the profile shows it ran for head sizes 64, 128 and 256. Where the device has f16
    cooperative matrices, its own variant the same way; and where it has NVIDIA's workgroup-scope
    ones, flash_cm2.comp's (on the cases whose pages hold its whole tiles)."""
    import re

    feats = _VK["devices"][0]["features"]
    runs = [("emu", ("flash_cme64", "flash_cme128", "flash_cme256"))]
    if "f16 coopmat" in feats:
        sfx = "" if "16x8x16" in feats else "_16"
        runs.append(("1", (f"flash_cm64{sfx}", f"flash_cm128{sfx}", f"flash_cm256{sfx}")))
    if "coopmat2 flash" in feats:
        runs.append(("cm2", ("flash_cm2_64", "flash_cm2_128", "flash_cm2_256")))
    for mode, names in runs:
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1",
                               "DASLLAMA_VULKAN_FLASH_CM": mode},
                   ("test_backend_ops.py", "test_vulkan.py"), "attention_q8_mode or q8_mode_prefill_f16_cache", s=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"FLASH_CM={mode}\n" + r.stdout[-3000:] + r.stderr[-2000:]
        assert re.search(r"(\d+) passed", out) and "skipped" not in out, out[-3000:]
        for name in names:
            assert re.search(rf"^\s+{name}\s", out, re.M), f"FLASH_CM={mode}: {name} did not run\n" + out[-3000:]


def test_block_formats_prefill_on_lavapipe(built_dir):
    """q8 mode's prefill of block-format weights (q4_1, q5_0, q5_1, q4_K, q5_K, q6_K): each
    matrix decoded to f16 (dequant_f16.comp, a slice of rows at a time) for the f16 GEMM after x
    is rounded once (f16_round, gemm_f16o* / the f32-FMA stand-in gemm_f16eo). Lavapipe is forced
    onto the GPUs' path (DASLLAMA_VULKAN_F16C=emu) for the op harness's cases (against numpy's
    f16 rounding of gguf-py's decoded weights) and the model's logits, with whole matrices and
    with 128-row slices; the profile shows each format's decoder ran. DASLLAMA_VULKAN_DQF16=0
    keeps the f32 tiles, which then run instead. Where the device has f16 cooperative matrices,
    its own GEMM the same way (k64: the subgroup-scope tiles; with workgroup-scope ones, the
    default: those)."""
    import re

    feats = _VK["devices"][0]["features"]
    k = "block_formats"
    decoders = tuple(f"dequant_f16_{t}" for t in (3, 6, 7, 12, 13, 14))
    runs = [("emu", "", ("f16_round", "gemm_f16eo") + decoders, ""), ("emu", "128", ("gemm_f16eo",) + decoders, "")]
    if "f16 coopmat" in feats:
        runs.append(("k64", "", ("f16_round", "gemm_f16ok64" if "16x8x16" in feats else "gemm_f16o16") + decoders, ""))
    if "f16 coopmat2" in feats:  # the default there: the workgroup-scope tiles
        runs.append(("", "", ("f16_round", r"gemm_f16mo\w") + decoders, ""))
    runs.append(("emu", "", ("matmul_tile_12", "matmul_tile_14"), "0"))
    for mode, rows, names, dq in runs:
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_F16C": mode,
                               "DASLLAMA_VULKAN_DQ_ROWS": rows, "DASLLAMA_VULKAN_DQF16": dq},
                   ("test_backend_ops.py", "test_vulkan.py"), k + " and not on_lavapipe", s=True)
        out = r.stdout + r.stderr
        what = f"F16C={mode} DQ_ROWS={rows} DQF16={dq}"
        assert r.returncode == 0, what + "\n" + r.stdout[-3000:] + r.stderr[-2000:]
        assert re.search(r"(\d+) passed", out) and "skipped" not in out, what + "\n" + out[-3000:]
        for name in names:  # (profile lines: the shader's name, then its time)
            assert re.search(rf"^\s+{name}\s", out, re.M), f"{what}: {name} did not run\n" + out[-3000:]
        if dq == "0":
            assert not re.search(r"^\s+dequant_f16", out, re.M), f"{what}: decoded to f16\n" + out[-3000:]


def test_norm_round_on_lavapipe(built_dir):
    """q8 mode's f16 prefill takes a layer's norm and the rounding of its rows to f16 in one
    dispatch (norm.comp's mode 2) where they were two (rms_norm, f16_round): on lavapipe forced
    onto the GPUs' path (DASLLAMA_VULKAN_F16C=emu), the block model's all-row prefill logits equal,
    bit for bit, those of the two dispatches (DASLLAMA_VULKAN_NORM_ROUND=0), and the model's path
    count shows the fused dispatch ran (and not with the switch off)."""
    import re

    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_F16C": "emu",
                           "DASLLAMA_TEST_NORM_ROUND": "1"}, ("test_vulkan.py",), "norm_round_child", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and re.search(r"1 passed", out), out[-3000:]


def test_norm_round_child(built_dir, monkeypatch):
    """test_norm_round_on_lavapipe's child (and, on a device with f16 cooperative matrices, its
    own tiles')."""
    if not os.environ.get("DASLLAMA_TEST_NORM_ROUND") and "f16 coopmat" not in _VK["devices"][0]["features"]:
        pytest.skip("run by test_norm_round_on_lavapipe's child (lavapipe on the GPUs' f16 path)")
    (path,) = C.built_once(built_dir, "llama-blocks",
                           lambda out: [C.write_block_model(os.path.join(out, "llama-blocks.gguf"))])
    ids = [1] + np.random.default_rng(9).integers(3, C.BLOCK_MODEL["vocab"], 99).tolist()
    m = d.load_model(path, d.QuantMode.q8, device="vulkan")
    rows = {}
    for on in ("0", "1"):
        monkeypatch.setenv("DASLLAMA_VULKAN_NORM_ROUND", on)
        n0 = m._m.path_count("norm_round")
        s = d.create_session(m, d.KVDtype.f32, n_ctx=len(ids))
        d.eval(m, s, ids, all_logits=True)
        rows[on] = np.array(s.logits).reshape(len(ids), -1)
        ran = m._m.path_count("norm_round") - n0
        assert (ran > 0) == (on == "1"), f"NORM_ROUND={on}: {ran} fused dispatches"
    np.testing.assert_array_equal(rows["1"], rows["0"])


def test_f16_prefill_split_on_lavapipe(built_dir):
    """f16 prefill (past 32 tokens on a GPU's path) on f16 cooperative matrices keeps f32
    activations: each token's x split into two f16 halves under a power-of-two scale
    (f16_split.comp), W * hi + W * lo summed in f32 (gemm_f16c.comp). Lavapipe has no
    cooperative matrices, so it is forced onto the GPUs' path with DASLLAMA_VULKAN_F16C=emu: the
    same split, stages and stores with f32 FMAs in place of the matrices (gemm_f16e) hold the op
    harness's f16 matmul cases at F32_DOT against float64 numpy (tokens from 1e-12 to 1e12, a
    zero token, an outlier; rows, tokens and k ending mid-tile) and an f16 model's prefill
    logits, and the profile (which names every shader dispatched) shows they ran. Where the
    device has f16 cooperative matrices (NVIDIA), each subgroup-scope variant the same way (k64:
    the default where there are no workgroup-scope ones, test_f16_prefill_coopmat2's).
    Then q8 mode, where x is rounded to f16 once and one product runs (f16_round, gemm_f16o* /
    the stand-ins gemm_f16eo*), against numpy's own rounding, and DASLLAMA_F16_SPLIT=1 there;
    and an audio tower in q8 mode, whose f16 weights keep the split (rows equal to the CPU's)."""
    import re

    feats = _VK["devices"][0]["features"]
    # (DASLLAMA_VULKAN_F16C, DASLLAMA_VULKAN_F16C_TILE, the shader): unset, the harness's shapes
    # all take 64-row tiles ("h"); 128 forces the 128-row ones; "w" (64 rows a subgroup) takes
    # 128 always.
    runs = [("emu", "128", "gemm_f16e"), ("emu", "", "gemm_f16eh"), ("emuw", "", "gemm_f16ew")]
    if "f16 coopmat" in feats:
        runs = runs[1:2]  # (the stand-in once: the device's time goes to the matrices)
        n8 = "16x8x16" in feats
        for tile, h in (("128", ""), ("", "h")):
            runs.append(("k64", tile, f"gemm_f16c{h}k64" if n8 else f"gemm_f16c{h}16"))
            if n8:
                runs.append(("k32", tile, f"gemm_f16c{h}"))
                if not h:
                    runs.append(("w", tile, "gemm_f16cw"))
            if "16x16x16" in feats:
                runs.append(("n16", tile, f"gemm_f16c{h}16"))
    runs = [(m, t, ("f16_split", sh), "(matmul and f16 and not bf16 and not q8_mode) or f16_model_prefill", "")
            for m, t, sh in runs]
    # q8 mode (weights not exact): x rounded to f16 once, one product (f16_round, gemm_f16o*, gemm_f16eo*),
    # held to numpy's own f16 rounding of each token's scaled row; DASLLAMA_F16_SPLIT=1 keeps the
    # split there too.
    q8 = "f16_q8_mode or f16_model_q8_mode"
    if "f16 coopmat" in feats:
        n8 = "16x8x16" in feats
        runs += [("k64", "", ("f16_round", "gemm_f16ok64" if n8 else "gemm_f16o16"), q8, ""),
                 ("k64", "64", ("f16_round", "gemm_f16ohk64" if n8 else "gemm_f16oh16"), q8, "")]
        if n8:
            runs.append(("w", "", ("f16_round", "gemm_f16ow"), q8, ""))
    runs += [("emu", "", ("f16_round", "gemm_f16eo"), q8, ""), ("emu", "64", ("f16_round", "gemm_f16eoh"), q8, ""),
             ("emu", "", ("f16_split", "gemm_f16eh"), q8, "1")]
    # An audio tower's f16 convs keep the split in q8 mode too (towers' float weights are exact:
    # its rows equal the CPU's at 1e-9), never the one rounding.
    runs.append(("emu", "", ("f16_split", "gemm_f16eh"), "audio_tower", ""))
    for mode, tile, names, k, split in runs:
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_F16C": mode,
                               "DASLLAMA_VULKAN_F16C_TILE": tile, "DASLLAMA_F16_SPLIT": split},
                   ("test_backend_ops.py", "test_vulkan.py"), k, s=True)
        out = r.stdout + r.stderr
        what = f"F16C={mode} TILE={tile} F16_SPLIT={split}"
        assert r.returncode == 0, what + "\n" + r.stdout[-3000:] + r.stderr[-2000:]
        for name in names:  # (profile lines: the shader's name, then its time)
            assert re.search(rf"^\s+{name}\s", out, re.M), f"{what}: {name} did not run\n" + out[-3000:]
        if "f16_round" not in names:
            assert not re.search(r"^\s+(f16_round|gemm_f16e?o)", out, re.M), f"{what}: rounded once\n" + out[-3000:]


def test_f16_prefill_coopmat2(built_dir):
    """The f16 prefill on NVIDIA's workgroup-scope cooperative matrices (gemm_f16m.comp: a tile a
    workgroup's matrix, tensor loads straight from memory; the extensions are on unless
    DASLLAMA_VULKAN_COOPMAT2=0, DASLLAMA_VULKAN_F16C=cm2* picks the tiles, unset the rule's):
    each tile (128 x 128, 128 x 64, 64 x 64, 128 x 256, and the rule's; whole tiles with k a
    multiple of 512 take the unclamped, unrolled loop) holds the op harness's f16 matmul cases at
    F32_DOT against float64 numpy (tokens from 1e-12 to 1e12, rows, tokens and k ending mid-tile,
    and whole tiles) and an f16 model's prefill
    logits, then in q8 mode (x rounded to f16 once, one product) against numpy's own rounding;
    the profile shows those shaders ran. Needs a device with VK_NV_cooperative_matrix2 and a build
    whose glslang has it (vulkan/CMakeLists.txt): NVIDIA's, never lavapipe."""
    import re

    if "f16 coopmat2" not in _VK["devices"][0]["features"]:
        pytest.skip("no workgroup-scope f16 cooperative matrices here (VK_NV_cooperative_matrix2 and a build "
                    "with glslang 15: NVIDIA's driver)")
    exact = "(matmul and f16 and not bf16 and not q8_mode) or f16_model_prefill"
    q8 = "f16_q8_mode or f16_model_q8_mode"
    for mode, tile in (("cm2l", "L"), ("cm2m", "M"), ("cm2s", "S"), ("cm2x", "X"), ("cm2", "")):
        for k, sh in ((exact, "gemm_f16m"), (q8, "gemm_f16mo")):
            r = _child(built_dir, {"DASLLAMA_VULKAN_COOPMAT2": "1", "DASLLAMA_VULKAN_PROFILE": "1",
                                   "DASLLAMA_VULKAN_F16C": mode}, ("test_backend_ops.py", "test_vulkan.py"), k, s=True)
            out = r.stdout + r.stderr
            assert r.returncode == 0, f"F16C={mode} {k}\n" + r.stdout[-3000:] + r.stderr[-2000:]
            assert "refused" not in out, out[-2000:]
            assert re.search(rf"^\s+{sh}{tile}\w?\s", out, re.M), f"F16C={mode}: {sh}{tile} did not run\n" + out[-3000:]
            assert not re.search(r"^\s+gemm_f16[ceo]", out, re.M), f"F16C={mode}: other f16 tiles ran\n" + out[-3000:]
    # q8 mode's split q8_0 / q4_0 on those tiles: decoded to f16 first (DASLLAMA_VULKAN_Q8CM2=dq:
    # dequant_f16_40 / _41, then gemm_f16mo*), and with block loads each block decoded in the
    # tiles' loads (=1: gemm_f16mq40* / q41*)
    runs = [("", "", "dq", [r"dequant_f16_40", r"dequant_f16_41", r"gemm_f16mo\w"])]
    if "coopmat2 block loads" in _VK["devices"][0]["features"]:
        runs += [(mode, tile, "1", [rf"gemm_f16mq{q}{tile}\w?" for q in ("40", "41")])
                 for mode, tile in (("cm2l", "L"), ("cm2s", "S"), ("cm2x", "X"), ("cm2", ""))]
    for mode, tile, q8m, names in runs:
        r = _child(built_dir, {"DASLLAMA_VULKAN_COOPMAT2": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_F16C": mode,
                               "DASLLAMA_VULKAN_Q8CM2": q8m}, ("test_vulkan.py",), "q8_mode_prefill_on_coopmat2_tiles", s=True)
        out = r.stdout + r.stderr
        what = f"Q8CM2={q8m} F16C={mode}"
        assert r.returncode == 0 and re.search(r"\b2 passed", out), what + "\n" + out[-3000:]
        for name in names:
            assert re.search(rf"^\s+{name}\s", out, re.M), f"{what}: {name} did not run\n" + out[-3000:]
        assert not re.search(r"^\s+gemm_i8", out, re.M), f"{what}: the int8 tiles ran\n" + out[-3000:]


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
def test_q8_mode_prefill_on_coopmat2_tiles(wtype):
    """(test_f16_prefill_coopmat2's children: DASLLAMA_VULKAN_Q8CM2=1 on a device with workgroup-scope
    matrices and block loads, or =dq on one with those matrices.) q8 mode's prefill of split q8_0 /
    q4_0 on the workgroup-scope tiles, each block decoded to f16 in the tile's load or first: over
    rows, tokens and k ending mid-tile and whole tiles, tokens from 1e-12 to 1e12 and a zero one,
    one matmul and three over one x, each token equal to float64 numpy
    over numpy's f16 rounding of gguf-py's decoded weights and of the token's scaled row (as
    test_backend_ops.py's block formats decoded to f16) at the f32 bar."""
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, f16_rounded_rows, make_weight, nmse

    q8m, feats = os.environ.get("DASLLAMA_VULKAN_Q8CM2"), _VK["devices"][0]["features"]
    if not ((q8m == "1" and "coopmat2 block loads" in feats) or (q8m == "dq" and "f16 coopmat2" in feats)):
        pytest.skip("run by test_f16_prefill_coopmat2's children (DASLLAMA_VULKAN_Q8CM2=1 with block loads, or dq, "
                    "on workgroup-scope matrices)")
    b = d._core.Backend("vulkan:0", exact=False)
    qt = int(T[wtype.upper()])
    for rows, cols, n in [(200, 544, 130), (67, 96, 33), (130, 2080, 70), (256, 1024, 256)]:
        rng = np.random.default_rng(rows + cols + n)
        parts = [make_weight(rng, wtype, r, cols) for r in (rows, 40, 129)]
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x *= (10.0 ** rng.integers(-12, 13, n)).astype(np.float32)[:, None]
        x[3] = 0
        hi, inv = f16_rounded_rows(x)
        refs = [(hi @ w.astype(np.float32).astype(np.float16).astype(np.float64).T) * inv[:, None] for _, w in parts]
        outs = [("matmul", np.asarray(b.matmul(parts[0][0], qt, rows, cols, x)).reshape(n, rows), refs[0])]
        multi = np.asarray(b.matmul_multi([p[0] for p in parts], qt, [rows, 40, 129], cols, x)).reshape(-1)
        at = 0
        for (_, w), ref in zip(parts, refs):
            outs.append(("multi", multi[at:at + n * w.shape[0]].reshape(n, w.shape[0]), ref))
            at += n * w.shape[0]
        for name, o, ref in outs:
            for t in range(n):
                e = nmse(o[t], ref[t])
                assert e <= F32_DOT, f"{wtype} {name} {rows}x{cols} n={n} token {t}: NMSE {e:.3g}"


def test_f16_prefill_without_room_alike(tiny, built_dir, monkeypatch):
    """Where the device cannot hold the f16 prefill's scratch (x's f16 halves; DASLLAMA_VULKAN_MEM_LIMIT
    makes the device as small as what is in use plus 1 MiB, under the scratch's 4 MiB), a q8-mode
    prefill of an f16 model keeps the f32 tiles instead of failing: its logits are those of the
    f32 tiles (DASLLAMA_VULKAN_F16C=0) bit for bit, while a fresh model with room takes the f16
    path (other bits), and the process goes on. Run on the GPUs' f16 path (the f32-FMA stand-in)
    by test_f16_prefill_without_room_on_lavapipe."""
    if "subgroup matmul" not in _VK["devices"][0]["features"]:
        pytest.skip("lavapipe's own path has no f16 tiles (test_f16_prefill_without_room_on_lavapipe forces them)")
    f16 = _tiny_f16(tiny, built_dir)
    ids = [1] + np.random.default_rng(31).integers(3, VOCAB, 47).tolist()  # past 32: the tiles
    mode = os.environ.get("DASLLAMA_VULKAN_F16C", "")  # the f16 path's (the child's emu on lavapipe)

    def prefill(m, t):
        d.eval(m, t, ids)
        return np.array(t.logits)

    m = d.load_model(f16, d.QuantMode.q8, device="vulkan")
    ta, tc = d.create_session(m, n_ctx=64), d.create_session(m, n_ctx=64)
    monkeypatch.setenv("DASLLAMA_VULKAN_F16C", "0")
    tiles = prefill(m, ta)
    monkeypatch.setenv("DASLLAMA_VULKAN_F16C", mode)
    m2 = d.load_model(f16, d.QuantMode.q8, device="vulkan")
    roomy = prefill(m2, d.create_session(m2, n_ctx=64))
    assert not np.array_equal(roomy, tiles), "the f16 path did not run (nothing to fall back from)"
    dev = m.device_info
    monkeypatch.setenv("DASLLAMA_VULKAN_MEM_LIMIT", str(dev["total_bytes"] - dev["free_bytes"] + (1 << 20)))
    assert m.device_info["free_bytes"] == 1 << 20
    cramped = prefill(m, tc)
    assert np.array_equal(cramped, tiles), f"without room: max {np.abs(cramped - tiles).max():.3g} from the f32 tiles"
    monkeypatch.delenv("DASLLAMA_VULKAN_MEM_LIMIT")
    again = prefill(m, d.create_session(m, n_ctx=64))
    assert np.array_equal(again, tiles)


def test_full_device_raises_and_keeps_session(tiny, monkeypatch):
    """A prefill on a device with no room left for its buffers (DASLLAMA_VULKAN_MEM_LIMIT: the
    device as large as what is in use, plus 0, 4 KB or 64 KB: on lavapipe each runs out at
    another point) raises DeviceError naming what did not fit, and loses nothing: the session is
    as it was (no rows), and once there is room the same session's prefill gives the logits of a
    fresh model's, bit for bit. Then a decode step with no room at all: it runs, or raises the same way
    with the session unchanged (on the GPUs' path a recorded step's tail counters do not fit:
    test_full_device_on_lavapipe), and the session's next steps give the fresh model's logits."""
    ids = [1] + np.random.default_rng(32).integers(3, VOCAB, 44).tolist()
    ref = C.q8_steps(tiny["q8_0"], "vulkan", ids, 40)

    def limit(m, room):
        dev = m.device_info
        monkeypatch.setenv("DASLLAMA_VULKAN_MEM_LIMIT", str(dev["total_bytes"] - dev["free_bytes"] + room))

    for room in (0, 4096, 65536):  # (no room at all fails on every device; the others where they run out)
        m = d.load_model(tiny["q8_0"], d.QuantMode.q8, device="vulkan")
        s = d.create_session(m, n_ctx=64)
        limit(m, room)
        try:
            d.eval(m, s, ids[:40])
            assert room > 0, "a prefill with no room at all ran"
        except d.DeviceError as e:
            assert "out of device memory for" in str(e), str(e)
            assert s.n_past == 0, f"room {room}: the failed prefill left {s.n_past} rows"
            monkeypatch.delenv("DASLLAMA_VULKAN_MEM_LIMIT")
            d.eval(m, s, ids[:40])
        monkeypatch.delenv("DASLLAMA_VULKAN_MEM_LIMIT", raising=False)
        assert np.array_equal(np.array(s.logits), ref[0]), f"room {room}: the session's prefill after the failure"
    m = d.load_model(tiny["q8_0"], d.QuantMode.q8, device="vulkan")
    s = d.create_session(m, n_ctx=64)
    d.eval(m, s, ids[:40])
    limit(m, 0)
    try:
        d.eval(m, s, ids[40:41])
        assert np.array_equal(np.array(s.logits), ref[1])
    except d.DeviceError as e:
        assert "out of device memory for" in str(e) and s.n_past == 40, (str(e), s.n_past)
    monkeypatch.delenv("DASLLAMA_VULKAN_MEM_LIMIT")
    for i in range(s.n_past - 39, len(ref)):
        d.eval(m, s, ids[39 + i:40 + i])
        assert np.array_equal(np.array(s.logits), ref[i]), f"decode step {i} after the full device"


def test_full_device_on_lavapipe(built_dir, tiny):
    """test_full_device_raises_and_keeps_session on the GPUs' path (recorded steps, tails)."""
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1"}, ("test_vulkan.py",), "full_device_raises")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_f16_prefill_without_room_on_lavapipe(built_dir, tiny):
    """test_f16_prefill_without_room_alike on the GPUs' f16 path (DASLLAMA_VULKAN_F16C=emu)."""
    _tiny_f16(tiny, built_dir)  # made here, not in a child
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_F16C": "emu"}, ("test_vulkan.py",),
               "f16_prefill_without_room_alike")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_int8_decode_gemv_on_lavapipe(built_dir):
    """The q8-mode decode GEMV laid out for GPUs' memory (gemv_i8x.comp, DASLLAMA_VULKAN_GEMVI8=2,
    3 or 4: 1 to 4 tokens over quant_act's int8 rows, 2, 4 or 8 rows a workgroup, up to three
    weights a dispatch; 3: q8_0 a block a lane; 4: two windows of k loaded ahead), forced onto
    the GPUs' paths: the op harness's q8-mode decode cases (float64
    numpy and the CPU's q8 sums; three weights, ragged windows of k), token rows alone equal to
    the same rows in a batch and in a 100-token GEMM bit for bit, and decodes beside a prefill
    (a 42-row step) equal to themselves alone, with the packed dot product where lavapipe has
    it and with plain bytes; the profile (which names every shader dispatched) shows each
    variant ran. Then the same decodes with the glu before ffn down folded into quant_act and
    the attention output rounded by attention (and, with DASLLAMA_VULKAN_NORMTAIL=1, the normed
    rounding after a residual GEMV done by its last workgroup), and decodes past 64 keys against
    gemv_i8's."""
    dot = "int8 dot" in _VK["devices"][0]["features"]
    # (GEMVI8, I8, the variants' rows a workgroup at 1, 2 and 4 tokens)
    runs = [("2", "1", (4, 4, 4)), ("2r2", "plain", (2, 2, 2)), ("3r8", "1", (8, 8, 4)), ("4", "plain", (4, 4, 4))]
    seen = set()
    for mode, i8, rs in runs:
        # gemv_variants_alike picks GEMVI8 itself: once with the dot product and once with bytes.
        k = f"(q8_mode and not prefill and not lavapipe and not ({Q8_PAST_4})" + \
            (" and not gemv_variants" if i8 in seen else "") + ") or ragged_step_past_32"
        seen.add(i8)
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_I8": i8,
                          "DASLLAMA_VULKAN_GEMVI8": mode, "DASLLAMA_VULKAN_GEMVQ": "0"},
                   ("test_backend_ops.py", "test_vulkan.py"), k, s=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"GEMVI8={mode} I8={i8}\n" + r.stdout[-3000:] + r.stderr[-2000:]
        for nt, rw in zip((1, 2, 4), rs):
            for t in ("40", "41"):
                # 3: q8_0 a block a lane; 4: two windows ahead at 1 token
                y = "y" if mode[0] == "3" and t == "40" else "z" if mode[0] == "4" and nt == 1 else "x"
                sh = f"gemv_i8{y}{'' if dot and i8 == '1' else 'p'}{nt}r{rw}_{t}"
                assert sh in out, f"GEMVI8={mode} I8={i8}: {sh} did not run\n" + out[-3000:]
        assert "quant_act32" in out, out[-3000:]  # a decode's rows without the norm: 32-wide workgroups
    # With it, a decode's glu before ffn down is folded into quant_act and the attention output
    # rounded by attention (recorded steps only, which profiling turns off), and with
    # DASLLAMA_VULKAN_NORMTAIL=1 the normed rounding after a residual GEMV is done by its last
    # workgroup: a decode alone against the same rows in a 42-row step (glu, quant_act,
    # gemm_i8), and decodes past 64 keys against gemv_i8's.
    for tail in ("0", "1"):
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_STEPS": "1", "DASLLAMA_VULKAN_GEMVI8": "2",
                          "DASLLAMA_VULKAN_GEMVQ": "0", "DASLLAMA_VULKAN_NORMTAIL": tail},
                   ("test_vulkan.py",), "ragged_step_past_32 or gemv_variants_alike", s=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"NORMTAIL={tail}\n" + out[-3000:]
        folded = [[int(part.rsplit(":", 1)[1]) for part in line.split(";")] for line in out.splitlines()
                  if "glu folded into gemv_q or quant_act:" in line]
        assert folded and max(f[0] for f in folded) > 0 and max(f[2] for f in folded) > 0, out[-3000:]
        assert (max(f[3] for f in folded) > 0) == (tail == "1"), out[-3000:]


@pytest.mark.parametrize("on", ["1", "0"], ids=["ki8on", "ki8off"])
@pytest.mark.parametrize("wtype", ["q4_K", "q5_K", "q6_K"])
def test_k_quant_int8_gemv(monkeypatch, wtype, on):
    """q8 mode's K-quant GEMVs on int8 (DASLLAMA_VULKAN_KI8=1, gemv_ki8.comp; the GPUs' subgroup
    path, which test_k_quant_int8_gemv_on_lavapipe forces there): x rounded to int8 blocks of 32
    by quant_act, each token at the f32 bar against float64 numpy over gguf-py's decoded weights
    and that rounded x (test_backend_ops.a8_rounded), and farther than the bar from the f32
    product (the rounding ran); a token's row the same bits alone as among 3 or 32 tokens (plain,
    normed, into a residual); with KI8 off, the f32 GEMV at the f32 bar, the normed step too. Rows ending mid-workgroup, a row of 9 super-blocks
    (invocations that take two pairs; q6_K's 210-byte blocks then start at 0 and 2 mod 4, and
    rows too), three weights over one x (a matmul_multi, and a step normed on the way), and into
    a residual."""
    if "subgroup matmul" not in _VK["devices"][0]["features"]:
        pytest.skip("lavapipe's own path has no int8 GEMVs (test_k_quant_int8_gemv_on_lavapipe forces them)")
    from gguf.constants import GGMLQuantizationType as T
    from test_backend_ops import F32_DOT, a8_rounded, make_weight

    be = d._core.Backend("vulkan:%d" % _VK["devices"][0]["index"], exact=False)
    qt = int(T[wtype.upper()])
    for cols in (512, 2304):
        rng = np.random.default_rng(cols + qt)
        rows = [201, 32, 40]
        parts = [make_weight(rng, wtype, r, cols) for r in rows]
        x = rng.standard_normal((32, cols)).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
        res = rng.standard_normal((32, rows[0])).astype(np.float32)
        xn = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * nw
        monkeypatch.setenv("DASLLAMA_VULKAN_KI8", on)
        outs = {}
        for sel in (slice(0, 32), slice(5, 6), slice(29, 32)):
            xs = np.ascontiguousarray(x[sel])
            m = len(xs)
            mm = np.asarray(be.matmul(parts[0][0], qt, rows[0], cols, xs)).reshape(m, rows[0])
            three = np.asarray(be.matmul_multi([p[0] for p in parts], qt, rows, cols, xs)).reshape(-1)
            normed = np.asarray(be.matmul_step([p[0] for p in parts], qt, rows, cols, xs, True, nw, 1e-6, None)
                                ).reshape(-1)
            resid = np.asarray(be.matmul_step([parts[0][0]], qt, rows[:1], cols, xs, False, None, 0.0,
                                              np.ascontiguousarray(res[sel]))).reshape(m, rows[0])
            outs[sel.start] = (mm, normed, resid, three)
        mm, normed, resid, three = outs[0]
        # each token alone or among 3 equals itself among 32
        for start in (5, 29):
            a = outs[start]
            m = a[0].shape[0]
            assert np.array_equal(a[0], mm[start:start + m]), f"{wtype} {cols} KI8={on}: rows alone differ"
            assert np.array_equal(a[2], resid[start:start + m]), f"{wtype} {cols} KI8={on}: residual rows differ"
            assert np.array_equal(a[1][:m * rows[0]], normed[start * rows[0]:(start + m) * rows[0]]), \
                f"{wtype} {cols} KI8={on}: normed rows differ"
        # (the normed step's values: the device's f32 norm may put an element on the other side of
        # an int8 rounding from numpy's, so only against f32 numpy with KI8 off)
        for name, got, xr, ws, add in (("matmul", mm, x, [parts[0][1]], None),
                                      ("normed", normed if on == "0" else None, xn.astype(np.float32),
                                       [p[1] for p in parts], None),
                                      ("residual", resid, x, [parts[0][1]], res),
                                      ("three", three, x, [p[1] for p in parts], None)):
            if got is None:
                continue
            at = 0
            flat = got.reshape(-1)
            for i, w in enumerate(ws):
                g = flat[at:at + 32 * w.shape[0]].reshape(32, w.shape[0])
                at += 32 * w.shape[0]
                r8 = a8_rounded(xr) @ w.T + (add if add is not None else 0)
                r32 = xr.astype(np.float64) @ w.T + (add if add is not None else 0)
                ref = r8 if on == "1" else r32
                for t in range(32):
                    e = nmse(g[t], ref[t])
                    assert e <= F32_DOT, f"{wtype} {cols} KI8={on} {name} matrix {i} token {t}: NMSE {e:.3g}"
                if on == "1":
                    assert nmse(g, r32) > F32_DOT, f"{wtype} {cols} {name}: the f32 product's, not rounded"


def test_k_quant_int8_gemv_on_lavapipe(built_dir):
    """test_k_quant_int8_gemv forced onto the GPUs' subgroup path, with the packed dot product
    where lavapipe has it and with plain bytes (DASLLAMA_VULKAN_I8=plain): lavapipe's 8 lanes
    take the sums' shared-memory tree (32-lane GPUs take subgroupAdd, which lavapipe's 32-lane
    setting, LP_NATIVE_VECTOR_WIDTH=1024, gets wrong here past 8 lanes, its f32 subgroup matmul
    too: not testable on lavapipe); the profile shows each type's gemv_ki8 variant ran."""
    if "subgroup matmul" in _VK["devices"][0]["features"]:
        pytest.skip("a GPU: test_k_quant_int8_gemv runs on this device's own path")
    dot = "int8 dot" in _VK["devices"][0]["features"]
    for i8, sel in (("1", ""), ("plain", " and ki8on")):
        r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_PROFILE": "1", "DASLLAMA_VULKAN_I8": i8},
                   ("test_vulkan.py",), "k_quant_int8_gemv and not lavapipe" + sel, s=True)
        out = r.stdout + r.stderr
        assert r.returncode == 0 and "skipped" not in out, f"I8={i8}\n" + out[-3000:]
        for t in (12, 13, 14):
            sh = f"gemv_ki8{'' if dot and i8 == '1' else 'p'}_{t}"
            assert sh in out, f"I8={i8}: {sh} did not run\n" + out[-3000:]


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
def test_q8_mode_rows_alike_at_any_token_count(wtype, monkeypatch):
    """Batched equals alone across the 32 tokens where a GPU's q8-mode matmul turns from the
    GEMV to the int8 GEMM: token rows computed alone (1 token; gemv_q.comp, which rounds x
    itself, up to 4), in a decode-sized batch (20) and inside a 100-token matmul are bit for
    bit the same, plain, normed (a step's fused RMS
    norm) and into a residual. Forced onto the GPUs' paths by test_int8_prefill_on_lavapipe,
    which also checks that the int8 GEMV and GEMM ran; lavapipe's own plain path is held to it
    too. The values against the CPU and float64 numpy: test_backend_ops.py's q8_mode cases. (On
    a device with workgroup-scope matrices a q8_0 / q4_0 prefill rounds to f16 by default, whose
    rows are not the GEMV's bits: DASLLAMA_VULKAN_Q8CM2=0 keeps the int8 GEMM held here.)"""
    from gguf.constants import GGMLQuantizationType as T
    from gguf.quants import quantize

    monkeypatch.setenv("DASLLAMA_VULKAN_Q8CM2", "0")

    dev = "vulkan:%d" % _VK["devices"][0]["index"]
    be = d._core.Backend(dev, exact=False)
    rng = np.random.default_rng(71)
    qt = T[wtype.upper()]
    rows, cols, n = 200, 2080, 100  # 65 blocks of k: chunk and stage edges ragged
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.5, qt)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    res = rng.standard_normal((n, rows)).astype(np.float32)

    def run(sel):
        xs = np.ascontiguousarray(x[sel])
        return {"matmul": np.asarray(be.matmul(raw, int(qt), rows, cols, xs)).reshape(len(xs), rows),
                "norm": np.asarray(be.matmul_step([raw], int(qt), [rows], cols, xs, True, nw, 1e-6, None)
                                   ).reshape(len(xs), rows),
                "residual": np.asarray(be.matmul_step([raw], int(qt), [rows], cols, xs, False, None, 0.0,
                                                      np.ascontiguousarray(res[sel]))).reshape(len(xs), rows)}

    full = run(slice(0, n))
    for sel in (slice(37, 38), slice(0, 1), slice(40, 42), slice(50, 53), slice(96, 100), slice(60, 80)):
        part = run(sel)
        for k in full:
            assert np.array_equal(part[k], full[k][sel]), \
                f"{wtype} {k}: rows {sel.start}..{sel.stop - 1} alone differ from the same rows in {n} tokens " \
                f"(max {np.abs(part[k] - full[k][sel]).max():.3g})"


def test_q8_mode_ragged_step_past_32_rows(tiny, monkeypatch):
    """q8 mode end to end: two sessions decoding in one step beside a 40-token prefill (a step
    of 42 rows, past the 32 where a GPU's matmuls turn to the int8 GEMM) get the logits each
    gets decoding alone (a 1-row step, the GEMV). Run on the GPUs' paths by
    test_int8_prefill_on_lavapipe. (The int8 GEMM pinned, DASLLAMA_VULKAN_Q8CM2=0, as in
    test_q8_mode_rows_alike_at_any_token_count.)"""
    monkeypatch.setenv("DASLLAMA_VULKAN_Q8CM2", "0")
    ids = [1] + np.random.default_rng(5).integers(3, VOCAB, 60).tolist()
    m = d.load_model(tiny["q8_0"], d.QuantMode.q8, device="vulkan")
    pool = d.create_kv_pool(m, page_rows=16)
    ss = [d.create_session(m, pool) for _ in range(3)]
    alone = []
    for i, s in enumerate(ss[1:]):
        d.eval(m, s, ids[:10 + i])
        t = d.create_session(m, pool)
        d.eval(m, t, ids[:10 + i])
        d.eval(m, t, [7])
        alone.append(np.array(t.logits))
        d.release_kv_pages(t)
    d.eval_batch(m, d.create_batch_workspace(m), ss, [ids[:40], 7, 7])
    for s, want in zip(ss[1:], alone):
        got = np.array(s.logits)
        assert np.array_equal(got, want), f"a decode beside a prefill against itself alone: NMSE {nmse(got, want):.3g}"


def test_q8_mode_decode_gemv_variants_alike(tiny, monkeypatch):
    """q8 mode end to end: a session decoding past 64 keys (attention split over keys), each
    step recorded and then replayed, and three sessions decoding together (3-token matmuls) get
    the same logits bit for bit whichever decode GEMV runs:
    gemv_i8.comp (DASLLAMA_VULKAN_GEMVI8=1) or gemv_i8x.comp's variants (2, 3, 4; 3r4, the default), with
    which a step also folds the glu before ffn down into quant_act and rounds the attention
    output in the attention dispatch (with DASLLAMA_VULKAN_NORMTAIL=1, also the normed rounding
    after a residual GEMV in that GEMV's last workgroup). Run on the GPUs' paths by
    test_int8_decode_gemv_on_lavapipe (which checks that both folds ran); lavapipe's own path
    keeps f32 activations, where the switch changes nothing."""
    ids = [1] + np.random.default_rng(12).integers(3, VOCAB, 89).tolist()
    m = d.load_model(tiny["q8_0"], d.QuantMode.q8, device="vulkan")

    def decode(mode):
        monkeypatch.setenv("DASLLAMA_VULKAN_GEMVI8", mode)
        s = d.create_session(m, n_ctx=len(ids))
        d.eval(m, s, ids[:80])
        rows = []
        for tok in ids[80:]:
            d.eval(m, s, [tok])
            rows.append(np.array(s.logits))
        # Three sessions stepping together (3-token matmuls) for three steps.
        ss = [d.create_session(m, n_ctx=len(ids)) for _ in range(3)]
        for i, t in enumerate(ss):
            d.eval(m, t, ids[:70 + 3 * i])
        ws = d.create_batch_workspace(m)
        for k in range(3):
            d.eval_batch(m, ws, ss, [ids[80 + k + i] for i in range(3)])
            rows += [np.array(t.logits) for t in ss]
        return np.stack(rows)

    want = decode("1")
    for mode in ("2", "3", "3r4", "4"):
        got = decode(mode)
        assert np.array_equal(got, want), \
            f"GEMVI8={mode}: decode logits differ from gemv_i8's (max {np.abs(got - want).max():.3g})"


def test_matmul_gemv_rows_split_or_whole(monkeypatch):
    """The decode GEMV of f16 weights (gemv.comp) with a row split over several subgroups joined in
    shared memory, or whole in one (the default for dispatches of 8192 rows and more), against
    float64 numpy: one weight of 8200 rows (a workgroup's 16 rows ragged at the end) and three
    of 40 / 8 / 3 rows (Q, K, V; norm fused), under the default rule, the rule off
    (DASLLAMA_VULKAN_GEMV_KS1_ROWS=0) and the split forced to 1 and 4. Which split ran shows in
    the bits (the sums' order): the rule keeps the 8200 rows whole (those of the forced 1, not of
    the rule off) and leaves Q, K, V split as before (where gemv.comp runs: a GPU, or lavapipe
    forced onto the GPUs' path by test_subgroup_path_on_lavapipe)."""
    from test_backend_ops import F32_DOT

    be = d._core.Backend("vulkan:%d" % _VK["devices"][0]["index"])
    rng = np.random.default_rng(83)
    cols = 2048  # 256 units of 8: split over several subgroups unless the rule keeps a row whole
    x = rng.standard_normal((1, cols)).astype(np.float32)
    w = rng.standard_normal((8200, cols)).astype(np.float16)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    ws = [rng.standard_normal((r, cols)).astype(np.float16) for r in (40, 8, 3)]
    nw = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    xn = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-6) * nw
    ref3 = np.concatenate([xn @ a.astype(np.float64).T for a in ws], axis=1)
    big, qkv = {}, {}
    for split, env in {"rule": {}, "rule off": {"DASLLAMA_VULKAN_GEMV_KS1_ROWS": "0"},
                       "1": {"DASLLAMA_VULKAN_GEMV_KS": "1"}, "4": {"DASLLAMA_VULKAN_GEMV_KS": "4"}}.items():
        for key in ("DASLLAMA_VULKAN_GEMV_KS", "DASLLAMA_VULKAN_GEMV_KS1_ROWS"):
            monkeypatch.delenv(key, raising=False)
        for key, val in env.items():
            monkeypatch.setenv(key, val)
        big[split] = np.asarray(be.matmul(w.view(np.uint8), 1, 8200, cols, x)).reshape(1, -1)
        qkv[split] = np.asarray(be.matmul_step([a.view(np.uint8) for a in ws], 1, [40, 8, 3], cols, x, True, nw,
                                               1e-6, None)).reshape(ref3.shape)
        assert nmse(big[split], ref) <= F32_DOT, f"8200 rows, split {split}: NMSE {nmse(big[split], ref):.3g}"
        assert nmse(qkv[split], ref3) <= F32_DOT, f"Q/K/V normed, split {split}: NMSE {nmse(qkv[split], ref3):.3g}"
    if "subgroup matmul" not in _VK["devices"][0]["features"]:
        return  # lavapipe's own plain path (no split to pick); test_subgroup_path_on_lavapipe forces gemv.comp
    assert np.array_equal(big["rule"], big["1"]), "the rule did not keep 8200 rows whole"
    assert not np.array_equal(big["rule"], big["rule off"]), "the rule's switch did not reach the shader"
    assert np.array_equal(qkv["rule"], qkv["rule off"]), "the rule changed a dispatch under 8192 rows"


def _tiny_f16(tiny, built_dir):
    from dasllama.convert import requantize

    (f16,) = C.built_once(built_dir, "llama-tiny-f16",
                          lambda out: [str(requantize(tiny["f32"], os.path.join(out, "llama-f16.gguf"), "f16",
                                                      progress=False))])
    return f16


# The tails' cases: a file, its mode, the switches (GLU tail, KV tail) set for the run with the
# tails, and gemv.comp's split forced (its rows a workgroup: with the tiny model's 32-dim heads,
# on lavapipe's 8 lanes, 64 rows (two heads a workgroup) unset, 32 at 2, 4 at 16; on 32 lanes, 4).
TAIL_CASES = {"q8_0 q8 (gemv_i8x)": ("q8_0", "q8", "1", "1", None),
              "f16 q8 (gemv.comp)": ("f16", "q8", "0", "2", None),
              "f16 q8, a head a workgroup": ("f16", "q8", "0", "2", "2"),
              "f16 q8, heads over workgroups": ("f16", "q8", "0", "2", "16"),
              "q8_0 fp32 (gemv.comp)": ("q8_0", "fp32", "0", "2", None)}


@pytest.mark.parametrize("case", list(TAIL_CASES))
def test_gemv_tails_alike(tiny, built_dir, monkeypatch, case):
    """Decodes whose glu before ffn down is computed (and in q8 mode rounded) by the gate / up
    GEMV's per-block tails (gemv_i8x.comp flags 4, DASLLAMA_VULKAN_GLUTAIL unset) and whose ropes
    and KV store are done by the Q/K/V GEMV's per-head tails (kvtail.glsl: gemv_i8x.comp's flags
    8, KVTAIL=1, in q8 mode over q8_0; gemv.comp's _kv variants, KVTAIL=2, over f16 weights and
    in fp32 mode over q8_0) get the logits of the same decodes without them (quant_act32 and
    kv_store dispatches) bit for bit: one session (1 token a step, and a 3-token step) over f16,
    f32 and q8_0 caches, and three sessions stepping together (3 tokens: their ropes and stores
    stay apart). Run on the GPUs' paths by test_gemv_tails_on_lavapipe, which checks that the
    tails ran; lavapipe's own path keeps f32 activations and no subgroup GEMV, where the switches
    change nothing."""
    file, mode, glu_on, kv_on, ks = TAIL_CASES[case]
    path = _tiny_f16(tiny, built_dir) if file == "f16" else tiny[file]
    if ks:
        monkeypatch.setenv("DASLLAMA_VULKAN_GEMV_KS", ks)
    ids = [1] + np.random.default_rng(14).integers(3, VOCAB, 12).tolist()
    m = d.load_model(path, d.QuantMode.q8 if mode == "q8" else d.QuantMode.fp32, device="vulkan")

    def decode(glu, kv):
        monkeypatch.setenv("DASLLAMA_VULKAN_GLUTAIL", glu)
        monkeypatch.setenv("DASLLAMA_VULKAN_KVTAIL", kv)
        ss = [d.create_session(m, n_ctx=len(ids)) for _ in range(3)]
        for i, t in enumerate(ss):
            d.eval(m, t, ids[:6 + i])
        rows = []
        for tok in ids[6:9]:  # one session alone, each step recorded then replayed
            d.eval(m, ss[0], [tok])
            rows.append(np.array(ss[0].logits))
        ws = d.create_batch_workspace(m)
        d.eval_batch(m, ws, ss, [ids[9 + i] for i in range(3)])
        rows += [np.array(t.logits) for t in ss]
        for kvt in (d.KVDtype.f32, d.KVDtype.q8_0):  # the tail's other cache rows (f16 above)
            t = d.create_session(m, kvt, n_ctx=len(ids))
            d.eval(m, t, ids[:6])
            for tok in ids[6:8]:
                d.eval(m, t, [tok])
                rows.append(np.array(t.logits))
            d.eval(m, t, ids[8:11], all_logits=True)  # 3 tokens of one session: the tails too
            rows += list(np.array(t.logits).reshape(3, -1))
        return np.stack(rows)

    want = decode("0", "0")
    got = decode(glu_on, kv_on)
    assert np.array_equal(got, want), \
        f"decode logits with the tails differ from those without (max {np.abs(got - want).max():.3g})"


def test_gemv_tails_on_lavapipe(built_dir, tiny):
    """test_gemv_tails_alike forced onto the GPUs' paths (q8-mode decode of q8_0 on gemv_i8x, of
    f16 and fp32 mode's on gemv.comp), with DASLLAMA_VULKAN_STEPS=1 so the backend reports its
    folds and each recorded step's dispatches: both tails ran, and the one-token step lost one
    dispatch a layer to each (the GLU tail a quant_act32, the KV tail the kv_store), on gemv.comp
    in each of its splits' cases."""
    import re

    _tiny_f16(tiny, built_dir)  # made here, not in a child
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_STEPS": "1", "DASLLAMA_VULKAN_GEMVI8": "2",
                           "DASLLAMA_VULKAN_GEMVQ": "0"}, ("test_vulkan.py",), "gemv_tails_alike", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    folds = [line for line in out.splitlines() if "by the gate/up GEMV's block tails:" in line]
    assert folds, out[-3000:]
    counts = [max(c) for c in zip(*[[int(part.rsplit(":", 1)[1]) for part in line.split(";")] for line in folds])]
    assert counts[4] > 0 and counts[5] > 0, out[-3000:]  # GLU tails, KV tails (each model's, the most)
    steps = [(int(m.group(1)), {k: int(v) for k, v in re.findall(r" (\S+) x(\d+)", m.group(2))})
             for m in re.finditer(r"^vulkan step recorded: (\d+) dispatches:(.*)$", out, re.M)]
    # One-token steps of one session (no prefill's gemv_i8): without the tails and with them; a
    # layer is one attention (attn_dec.comp's, or attention.comp's where that does not fit).
    ones = {}
    for n, c in steps:
        if any(k.startswith("gemv_i8x1r") for k in c) and not any(k.startswith("gemv_i8_") for k in c):
            ones[n] = (c.get("attention", 0) + c.get("attn_dec", 0), c.get("quant_act32", 0), c.get("kv_store", 0))
    assert len(ones) == 2, out[-3000:]
    (both, b), (plain, p) = sorted(ones.items())
    layers = p[0]
    # The one-token steps' attention is attn_dec.comp's on the GPUs' path (the tiny model's heads fit it).
    dec = [c["attn_dec"] for _, c in steps if any(k.startswith("gemv_i8x1r") for k in c) and "attn_dec" in c]
    assert dec and all(n == layers for n in dec), out[-3000:]
    assert b[0] == layers and plain - both == 2 * layers, out[-3000:]
    assert p[1] - b[1] == layers and p[2] == layers and b[2] == 0, out[-3000:]
    # gemv.comp's KV tail: for f16 (type 1) and fp32 mode's q8_0 (40), one-token steps with the
    # _kv variant (one a layer) and no kv_store, one dispatch a layer fewer than those without.
    for t in (1, 40):
        kv = {n for n, c in steps if c.get(f"gemv1_kv_{t}") == layers and "kv_store" not in c}
        plain_ = {n for n, c in steps if f"gemv1_{t}" in c and f"gemv1_kv_{t}" not in c and c.get("kv_store") == layers}
        assert kv and {n - layers for n in plain_} == kv, (t, kv, plain_, out[-3000:])


def _switch_alike(m, monkeypatch, var, counter, run, what, head_dim=None):
    """run() (a list of logits rows) with the switch `var` at 0, then at 1: the same bits, and the
    backend's `counter` (path_count) moved only with it on, and then exactly where the device
    takes the subgroup path (a GPU's, or lavapipe's when forced) -- with head_dim given, where
    that path's decode attention is attn_dec.comp's base variant too (dec_variants)."""
    ran, got = {}, {}
    for on in ("0", "1"):
        monkeypatch.setenv(var, on)
        n0 = m._m.path_count(counter)
        got[on] = np.stack(run())
        ran[on] = m._m.path_count(counter) - n0
    feats = _VK["devices"][0]["features"]
    sub = "subgroup matmul" in feats
    if head_dim is not None:
        sub = sub and "attn_dec" in dec_variants(int(feats.split("subgroups ")[1].split("-")[0]), (head_dim,))
    assert ran["0"] == 0 and (ran["1"] > 0) == sub, ran
    assert np.array_equal(got["1"], got["0"]), f"{what} differ (max {np.abs(got['1'] - got['0']).max():.3g})"


def _batch_rows(m, ss, ids):
    """One batch step of sessions ss (their next ids), as eval_batch runs it: their logits."""
    d.eval_batch(m, d.create_batch_workspace(m), ss, ids)
    return [np.array(t.logits) for t in ss]


def _tiny_family(built_dir, name):
    """A tiny random model of one of export.py's families, f32 from the exporter."""
    import export as E  # tests/oracles/export.py

    def make(out):
        fam = E.FAMILIES[name]
        f32 = os.path.join(out, f"{name}-f32.gguf")
        E.write_gguf(fam, fam.make(), f32, "f32", E.spm_model_proto())
        return [f32]

    (f32,) = C.built_once(built_dir, f"{name}-tiny", make)
    return f32


# A one-row step's KV store folded into its decode attention (attn_dec_kf): the file, and the
# cache types (qwen2's head size 16 has no q8_0 cache). Llama's rope turns adjacent pairs, with
# 2 query heads a KV head; qwen2-yarn's turns half-rotations (neox) with YaRN's scale.
KVF_CASES = {"llama f32": ("llama", "f32", ("f16", "f32", "q8_0")),
             "llama q8_0": ("llama", "q8_0", ("f16", "q8_0")),
             "qwen2-yarn f32": ("qwen2-yarn", "f32", ("f16", "f32"))}


@pytest.mark.parametrize("case", list(KVF_CASES))
def test_attn_kv_fold_alike(tiny, built_dir, monkeypatch, case):
    """fp32-mode decode steps whose KV store is done by the decode attention (attn_dec_kf,
    DASLLAMA_VULKAN_KVFOLD=1: the keys rotated, both rows rounded as the cache holds them, the
    queries rotated, by the attention's workgroups) get the logits of the same steps with a
    kv_store dispatch before the attention (KVFOLD=0) bit for bit: one session's one-token steps
    over each cache type, keys split 4 a split (the new key in a later split than the workgroups
    that store it), with a 3-session batch step between them (stores, then attentions: not
    folded). Run on the GPUs' path by test_attn_kv_fold_on_lavapipe, which checks it ran."""
    fam, file, kvts = KVF_CASES[case]
    path = tiny[file] if fam == "llama" else _tiny_family(built_dir, fam)
    monkeypatch.setenv("DASLLAMA_VULKAN_ATTN_KEYS", "4")
    ids = [1] + np.random.default_rng(17).integers(3, VOCAB, 16).tolist()
    m = d.load_model(path, d.QuantMode.fp32, device="vulkan")

    def run():
        rows = []
        for kvt in kvts:
            t = d.create_session(m, getattr(d.KVDtype, kvt), n_ctx=len(ids))
            d.eval(m, t, ids[:5])
            for tok in ids[5:13]:
                d.eval(m, t, [tok])
                rows.append(np.array(t.logits))
        ss = [d.create_session(m, n_ctx=len(ids)) for _ in range(3)]
        for i, t in enumerate(ss):
            d.eval(m, t, ids[:6 + i])
        rows += _batch_rows(m, ss, ids[9:12])
        for tok in ids[13:16]:
            d.eval(m, ss[0], [tok])
            rows.append(np.array(ss[0].logits))
        return rows

    _switch_alike(m, monkeypatch, "DASLLAMA_VULKAN_KVFOLD", "attn_kv", run,
                  "decode logits with the KV store in the attention", head_dim=32 if fam == "llama" else 16)


def test_decode_split_joins(tiny, monkeypatch):
    """Decode steps whose attention keys are split 4 a split (DASLLAMA_VULKAN_ATTN_KEYS=4: 2 to
    16 splits over the steps, so the last split's join loads its partials in one round of 8 and
    in two) against the CPU's teacher-forced logits over the same ids, with the KV store folded
    into the attention and without. On the GPUs' path by test_attn_kv_fold_on_lavapipe."""
    monkeypatch.setenv("DASLLAMA_VULKAN_ATTN_KEYS", "4")
    ids = [1] + np.random.default_rng(19).integers(3, VOCAB, 44).tolist()
    ref = teacher_forced(tiny["q8_0"], "cpu", ids, d.KVDtype.f16)[4:]
    m = d.load_model(tiny["q8_0"], d.QuantMode.fp32, device="vulkan")
    for fold in ("1", "0"):
        monkeypatch.setenv("DASLLAMA_VULKAN_KVFOLD", fold)
        e = nmse(_decode_logits(m, ids, 5), ref)
        assert e <= LOGIT_BAR, f"decode over split keys (KVFOLD={fold}): NMSE {e:.3g} against the CPU"


@pytest.mark.parametrize("file", ["f16", "q8_0"])
def test_gemv_glu_tail_alike(tiny, built_dir, monkeypatch, file):
    """fp32-mode decode steps whose glu is written by the gate / up GEMV's block tails (gemv.comp
    -DGLUT, DASLLAMA_VULKAN_GLUT=1; ffn down then a plain GEMV) get the logits of the same steps
    with the glu computed on the way by ffn down (GLUT=0) bit for bit: an f16 file and q8_0's
    split layout, one session's one-token steps, a 3-session batch step between them (not the
    tail's). Run on the GPUs' path by test_attn_kv_fold_on_lavapipe, which checks it ran."""
    path = _tiny_f16(tiny, built_dir) if file == "f16" else tiny[file]
    ids = [1] + np.random.default_rng(21).integers(3, VOCAB, 14).tolist()
    m = d.load_model(path, d.QuantMode.fp32, device="vulkan")

    def run():
        t = d.create_session(m, n_ctx=len(ids))
        d.eval(m, t, ids[:5])
        rows = []
        for tok in ids[5:10]:
            d.eval(m, t, [tok])
            rows.append(np.array(t.logits))
        ss = [t] + [d.create_session(m, n_ctx=len(ids)) for _ in range(2)]
        for i, u in enumerate(ss[1:]):
            d.eval(m, u, ids[:6 + i])
        rows += _batch_rows(m, ss, ids[10:13])
        for tok in ids[13:15]:
            d.eval(m, t, [tok])
            rows.append(np.array(t.logits))
        return rows

    _switch_alike(m, monkeypatch, "DASLLAMA_VULKAN_GLUT", "glu_sg", run, "decode logits with the GLU tail")


def test_attn_kv_fold_on_lavapipe(built_dir, tiny):
    """test_attn_kv_fold_alike, test_decode_split_joins and test_gemv_glu_tail_alike forced onto
    the GPUs' path, with DASLLAMA_VULKAN_STEPS=1: the KV fold ran (its count), and each one-token
    step recorded with attn_dec_kf has no kv_store and one dispatch a layer fewer than the same
    step recorded with the switch off; steps with the GLU tail (gemv1_gt_*) read a plain ffn down
    (no gemv1_glu_*)."""
    import re

    for fam in ("qwen2-yarn",):
        _tiny_family(built_dir, fam)  # made here, not in a child
    r = _child(built_dir, {"DASLLAMA_VULKAN_SUBGROUP": "1", "DASLLAMA_VULKAN_STEPS": "1"},
               ("test_vulkan.py",), "attn_kv_fold_alike or decode_split_joins or gemv_glu_tail_alike", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    n = [int(x) for x in re.findall(r"KV stores done by decode attention: (\d+)", out)]
    assert n and max(n) > 0, out[-3000:]
    steps = [(int(m.group(1)), {k: int(v) for k, v in re.findall(r" (\S+) x(\d+)", m.group(2))})
             for m in re.finditer(r"^vulkan step recorded: (\d+) dispatches:(.*)$", out, re.M)]
    kf = [(k, c) for k, c in steps if "attn_dec_kf" in c]
    assert kf, out[-3000:]
    plain = {k - c["attn_dec"] for k, c in steps if "attn_dec" in c and c.get("kv_store") == c["attn_dec"]}
    for k, c in kf:
        assert "kv_store" not in c and "attn_dec" not in c and k in plain, (k, c, sorted(plain))
    gt = [c for _, c in steps if any(x.startswith("gemv1_gt_") for x in c)]
    assert gt and all(not any(x.startswith("gemv1_glu_") for x in c) for c in gt), out[-3000:]


# The tiled prefill attention's variants (read at each call): flash2.comp by default (heads up to
# 64), its reductions through shared memory, its 64-row workgroups, and flash.comp's tiles.
FLASH_VARIANTS = {"flash2": {}, "flash2 sg0": {"DASLLAMA_VULKAN_FLASH_SG": "0"},
                  "flash2 br64": {"DASLLAMA_VULKAN_FLASH_BR": "64"}, "flash": {"DASLLAMA_VULKAN_FLASHK": "1"},
                  "flash2 units0": {"DASLLAMA_VULKAN_FLASH_UNITS": "0"}}
# Heads past 128 (Gemma's 256) take attention.comp's row a workgroup (flash.comp's 8-row tiles
# at 256 lost to it on the H200: Gemma-270M F16 pp512 28,760 -> 24,600, twenty-fifth session).
FLASH_VARIANTS_WIDE = {"attention": {}}


def test_flash_variants(monkeypatch):
    """Prefill rows of 16 and more take the tiled attention (decoders' as encoders'); each of its
    variants against float64 numpy over the op harness's reference: row tiles past the rows' end,
    cached keys before the rows, a window with a softcap, sinks, 4 query heads on a KV head, a head
    padded to the tile (48), a head of 32 (its own tiles), heads of 256 and 160 (past the tiles:
    attention.comp), and every cache type (f16 read as pairs). The end-to-end checks
    (logits, greedy tokens, towers) run on the default variant in this run."""
    from test_backend_ops import F32_DOT, KV_TYPES, attention_ref, paged_session, stored

    be = d._core.Backend("vulkan:%d" % _VK["devices"][0]["index"])
    cases = [  # n_tok, n_kv, heads, kv heads, head_dim, page_rows, window, softcap, cache, sinks
        (70, 200, 8, 2, 64, 16, 48, 20.0, "f16", False),
        (33, 33, 6, 2, 64, 16, 0, 0.0, "f32", False),
        (100, 161, 4, 1, 48, 16, 0, 0.0, "f16", False),
        (40, 90, 4, 2, 64, 16, 0, 0.0, "q8_0", True),
        (90, 120, 4, 2, 32, 16, 0, 0.0, "f16", False),  # head 32: 64-row tiles fit lavapipe
        (40, 90, 4, 1, 256, 16, 0, 30.0, "f16", False),  # Gemma: 4 heads on a KV head, a softcap
        (17, 17, 2, 2, 256, 16, 0, 0.0, "f32", False),
        (23, 300, 2, 1, 160, 16, 64, 0.0, "q8_0", True),  # padded to 256, a window, sinks
    ]
    for n_tok, n_kv, H, KVH, hd, P, window, cap, kv, with_sinks in cases:
        q, k, v, sinks, q_pos, ids, pool = paged_session(np.random.default_rng(n_tok + n_kv), n_tok, n_kv, H, KVH, hd,
                                                         P, 2, sinks=with_sinks)
        scale = 1 / np.sqrt(hd)
        ref = attention_ref(q, stored(k, kv), stored(v, kv), q_pos, H, KVH, hd, window, scale, cap, sinks)
        for name, env in (FLASH_VARIANTS if hd <= 128 else FLASH_VARIANTS_WIDE).items():
            for key in ("DASLLAMA_VULKAN_FLASH_SG", "DASLLAMA_VULKAN_FLASH_BR", "DASLLAMA_VULKAN_FLASHK",
                        "DASLLAMA_VULKAN_FLASH_UNITS"):
                monkeypatch.delenv(key, raising=False)
            for key, val in env.items():
                monkeypatch.setenv(key, val)
            extra = {"sinks": sinks} if with_sinks else {}
            got = be.paged_attention(q, k, v, q_pos, H, KVH, hd, KV_TYPES[kv], P, ids, pool, window, scale,
                                     cap, n_kv, **extra)[0]
            e = nmse(got, ref)
            assert e <= F32_DOT, f"{name}, {n_tok} rows over {n_kv} keys, head {hd}, {kv}: NMSE {e:.3g}"


def test_tiled_attention_on_lavapipe(built_dir):
    """test_flash_variants with the profile on (it names every shader dispatched): each variant
    ran where the device allows it (a device whose shared memory is too small for a variant's
    tiles, or without subgroup shuffles, falls back silently, so this says which ran)."""
    r = _child(built_dir, {"DASLLAMA_VULKAN_PROFILE": "1"}, ("test_vulkan.py",), "flash_variants", s=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "flash2_r2" in out and "flash2_d32_r4" in out and "flash_64" in out, out[-3000:]
    ran = sorted({w for w in out.split() if w.startswith("flash2_")})
    print("flash2 variants that ran:", ran)


def test_vision_tower_and_turn(built_dir):
    C.vision_tower_and_turn(built_dir, "vulkan", max_new=8)


@pytest.mark.parametrize("family", ["qwen25v", "qwen3v"])
def test_qwen_vision_tower_and_turn(built_dir, family):
    C.qwen_vision_tower_and_turn(built_dir, "vulkan", family, max_new=8)
