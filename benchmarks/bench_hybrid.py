"""A gated-DeltaNet hybrid of a real shape, ours next to llama.cpp's llama-bench on the same file.

    python benchmarks/bench_hybrid.py [--type q8_0] [--threads 2] [--reps 1] [--prompts 512,2048]
                                      [--llama-bench PATH] [--device cpu|cuda|vulkan] [--op]

Writes (once, into the hub cache) a random-weight qwen35 file with Qwen3.5-0.8B's published layer
shapes -- 24 layers, every 4th full attention (8 query / 2 KV heads of 256, a quarter rotary),
the others gated DeltaNet (16 key and 16 value heads of 128, a 4-tap conv), dim 1024, FFN 3584 --
with the converter's tensor names and keys but a 512-token vocabulary (tests/oracles/export.py's),
so the time goes to the layers. Then prefill of each prompt length (the chunked delta rule) and
tg128 (the recurrent step). Random weights: the numbers measure speed only. --op times the delta
rule op alone at one layer's shape, token by token and chunked, on the device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "oracles"))

from bench_moe import _blocks  # noqa: E402

import dasllama as d  # noqa: E402

SHAPE = dict(layers=24, dim=1024, ffn=3584, heads=8, kv_heads=2, head_dim=256, interval=4, nk=16, nv=16, dk=128,
             dv=128, conv=4)


def write(path: str, qname: str) -> str:
    import gguf

    import export as E

    qt = gguf.GGMLQuantizationType[qname.upper()]
    s = SHAPE
    D, F, H, KVH, hd = s["dim"], s["ffn"], s["heads"], s["kv_heads"], s["head_dim"]
    nk, nv, dk, dv, K = s["nk"], s["nv"], s["dk"], s["dv"], s["conv"]
    C = 2 * nk * dk + nv * dv
    rec = [(il + 1) % s["interval"] != 0 for il in range(s["layers"])]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen35")
    a = "qwen35."
    for k, v in (("block_count", len(rec)), ("context_length", 8192), ("embedding_length", D),
                 ("feed_forward_length", F), ("attention.head_count", H), ("attention.head_count_kv", KVH),
                 ("attention.key_length", hd), ("attention.value_length", hd), ("rope.dimension_count", hd // 4),
                 ("ssm.conv_kernel", K), ("ssm.state_size", dk), ("ssm.group_count", nk),
                 ("ssm.time_step_rank", nv), ("ssm.inner_size", nv * dv),
                 ("full_attention_interval", s["interval"])):
        w.add_uint32(a + k, v)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(a + "rope.freq_base", 1e7)
    w.add_array(a + "rope.dimension_sections", [11, 11, 10, 0])
    w.add_array(a + "attention.recurrent_layers", rec)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qname == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0)
    E._add_spm_vocab(w, E.spm_model_proto())
    V = E.VOCAB

    def q(name, rows, cols):
        w.add_tensor(name, _blocks(rng, rows, cols, qt), raw_dtype=qt)

    def vec(name, n, base=1.0, scale=0.05):
        w.add_tensor(name, (base + scale * rng.standard_normal(n)).astype(np.float32))

    q("token_embd.weight", V, D)
    vec("output_norm.weight", D)
    q("output.weight", V, D)
    for il, r in enumerate(rec):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", D)
        vec(b + "post_attention_norm.weight", D)
        if r:
            q(b + "attn_qkv.weight", C, D)
            q(b + "attn_gate.weight", nv * dv, D)
            w.add_tensor(b + "ssm_alpha.weight", (0.02 * rng.standard_normal((nv, D))).astype(np.float32))
            w.add_tensor(b + "ssm_beta.weight", (0.02 * rng.standard_normal((nv, D))).astype(np.float32))
            q(b + "ssm_out.weight", D, nv * dv)
            w.add_tensor(b + "ssm_conv1d.weight", (0.5 * rng.standard_normal((C, K))).astype(np.float32))
            w.add_tensor(b + "ssm_a", -rng.uniform(0.1, 4, nv).astype(np.float32))
            vec(b + "ssm_dt.bias", nv)
            vec(b + "ssm_norm.weight", dv)
        else:
            q(b + "attn_q.weight", 2 * H * hd, D)
            q(b + "attn_k.weight", KVH * hd, D)
            q(b + "attn_v.weight", KVH * hd, D)
            q(b + "attn_output.weight", D, H * hd)
            vec(b + "attn_q_norm.weight", hd)
            vec(b + "attn_k_norm.weight", hd)
        q(b + "ffn_gate.weight", F, D)
        q(b + "ffn_up.weight", F, D)
        q(b + "ffn_down.weight", D, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ours(path: str, device: str, threads: int, prompts) -> list:
    """Prefill t/s of each prompt length (a fresh session each), then tg128 t/s; after a warm-up."""
    m = d.load_model(path, device=device, n_threads=threads) if device == "cpu" else d.load_model(path, device=device)
    rng = np.random.default_rng(0)
    n_ctx = max(prompts) + 256
    toks = [int(x) for x in rng.integers(100, m.config.vocab_size - 1, max(prompts) + 130)]
    d.eval(m, d.create_session(m, n_ctx=n_ctx), toks[:64])
    out = []
    for n in prompts:
        s = d.create_session(m, n_ctx=n_ctx)
        t = time.perf_counter()
        d.eval(m, s, toks[:n])
        out.append(n / (time.perf_counter() - t))
    s = d.create_session(m, n_ctx=n_ctx)
    d.eval(m, s, [toks[0]])
    t = time.perf_counter()
    for i in range(128):
        d.eval(m, s, [toks[i + 1]])
    out.append(128 / (time.perf_counter() - t))
    return out


def op_times(device: str, prompts) -> list:
    """The delta rule op alone at one layer's shape (16 heads of 128 x 128), n tokens from a zero
    state: (n, recurrent ms, chunked ms), each the best of 3 (the harness's uploads included)."""
    from dasllama import _core

    be = _core.Backend(device)
    s = SHAPE
    nk, nv, dk, dv = s["nk"], s["nv"], s["dk"], s["dv"]
    rng = np.random.default_rng(0)
    st = np.zeros((nv, dk, dv), np.float32)
    A = -rng.uniform(0.1, 4, nv).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    out = []
    for n in prompts:
        qkv = rng.standard_normal((n, 2 * nk * dk + nv * dv)).astype(np.float32)
        al, bt = rng.standard_normal((n, nv)).astype(np.float32), rng.standard_normal((n, nv)).astype(np.float32)
        row = [n]
        for chunked in (False, True):
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                be.delta_rule(st, qkv, al, bt, A, dt, nk, 1e-6, False, chunked)
                best = min(best, time.perf_counter() - t)
            row.append(best * 1e3)
        out.append(tuple(row))
    return out


def llama_bench(exe: str, path: str, threads: int, prompts) -> list:
    out = subprocess.run([exe, "-m", path, "-t", str(threads), "-p", ",".join(map(str, prompts)), "-n", "128",
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return ([next(r["avg_ts"] for r in rows if r["n_prompt"] == n and r["n_gen"] == 0) for n in prompts]
            + [next(r["avg_ts"] for r in rows if r["n_gen"] == 128)])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--device", default="cpu", help="cpu, or a device backend (llama-bench then is not run)")
    ap.add_argument("--op", action="store_true", help="time the delta rule op alone, recurrent vs chunked")
    a = ap.parse_args()
    prompts = [int(x) for x in a.prompts.split(",")]
    if a.op:
        print(f"# {time.strftime('%Y-%m-%d')} delta_rule op on {a.device}: 16 heads of 128 x 128")
        print("| n | recurrent ms | chunked ms | speed-up |")
        print("| --- | --- | --- | --- |")
        for n, r, c in op_times(a.device if a.device != "cpu" else "cpu", prompts):
            print(f"| {n} | {r:.1f} | {c:.1f} | {r / c:.2f} |")
        return 0
    path = d.hub.home() / "bench" / f"qwen35-0.8b-shape-{a.type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write(str(path) + ".part", a.type)
        os.replace(str(path) + ".part", path)
        print(f"# wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
    where = f"threads={a.threads}" if a.device == "cpu" else f"device={a.device}"
    print(f"# {time.strftime('%Y-%m-%d')} {d.system_info()['isa_active']} {where}; Qwen3.5-0.8B layer shapes, "
          f"{a.type}, 512-token vocabulary, random weights")
    print("| test | dasllama t/s | llama.cpp t/s | ratio |")
    print("| --- | --- | --- | --- |")
    o, lb = [], []
    for _ in range(a.reps):  # interleaved: ours, then theirs, each rep
        o.append(ours(str(path), a.device, a.threads, prompts))
        if a.llama_bench and a.device == "cpu":
            lb.append(llama_bench(a.llama_bench, str(path), a.threads, prompts))
    for i, test in enumerate([f"pp{n}" for n in prompts] + ["tg128"]):
        mine = float(np.mean([x[i] for x in o]))
        theirs = float(np.mean([x[i] for x in lb])) if lb else float("nan")
        print(f"| {test} | {mine:.1f} | {theirs:.1f} | {mine / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
