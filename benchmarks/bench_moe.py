"""A mixture of experts of a real shape, ours next to llama.cpp's llama-bench on the same file.

    python benchmarks/bench_moe.py [--layers 4] [--type q8_0] [--threads 2] [--reps 2] [--llama-bench PATH]
                                   [--device cuda|vulkan]

Writes (once, into the hub cache) a random-weight qwen3moe file with Qwen3-30B-A3B's layer
shapes -- dim 2048, 32 query / 4 KV heads of 128, 128 experts of 768 rows, 8 used per token --
but few layers and a 512-token vocabulary (tests/oracles/export.py's), so it fits in memory and
the time goes to the MoE layers. Then pp512 / tg128 by bench_cpu.py's two runners. Random
weights: the numbers measure speed only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "oracles"))

import bench_cpu as B  # noqa: E402

import dasllama as d  # noqa: E402

SHAPE = dict(dim=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ffn=768)


def _blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """rows x cols of random blocks (q8_0 / q4_0), scales ~ N(0, 0.02) per element: quick to make."""
    import gguf

    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nb = cols // bs
    raw = rng.integers(0, 256, size=(rows, nb, ts), dtype=np.uint8)
    scale = (0.02 / (64 if qtype == gguf.GGMLQuantizationType.Q8_0 else 4)) * np.ones((rows, nb), np.float16)
    raw[:, :, 0:2] = scale.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * ts)


def write(path: str, layers: int, qname: str) -> str:
    import gguf

    import export as E

    qt = gguf.GGMLQuantizationType[qname.upper()]
    s = SHAPE
    D, H, KVH, hd, NE, K, F = (s[k] for k in ("dim", "heads", "kv_heads", "head_dim", "experts", "used", "expert_ffn"))
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(6144)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(NE)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(F)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qname == "q8_0" else gguf.LlamaFileType.MOSTLY_Q4_0)
    E._add_spm_vocab(w, E.spm_model_proto())
    V = E.VOCAB

    def q(name, rows, cols, stack=1):
        raw = _blocks(rng, stack * rows, cols, qt)
        w.add_tensor(name, raw.reshape(stack, rows, -1) if stack > 1 else raw, raw_dtype=qt)

    def f32(name, *shape, base=1.0):
        w.add_tensor(name, (base + 0.05 * rng.standard_normal(shape)).astype(np.float32))

    q("token_embd.weight", V, D)
    f32("output_norm.weight", D)
    q("output.weight", V, D)
    for il in range(layers):
        b = f"blk.{il}."
        f32(b + "attn_norm.weight", D)
        q(b + "attn_q.weight", H * hd, D)
        q(b + "attn_k.weight", KVH * hd, D)
        q(b + "attn_v.weight", KVH * hd, D)
        q(b + "attn_output.weight", D, H * hd)
        f32(b + "attn_q_norm.weight", hd)
        f32(b + "attn_k_norm.weight", hd)
        f32(b + "ffn_norm.weight", D)
        f32(b + "ffn_gate_inp.weight", NE, D, base=0.0)
        q(b + "ffn_gate_exps.weight", F, D, NE)
        q(b + "ffn_up_exps.weight", F, D, NE)
        q(b + "ffn_down_exps.weight", D, F, NE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_bench(exe: str, path: str, threads: int) -> tuple:
    """bench_cpu's runner with the weights loaded (-lm none), as ours are packed at load: a mapped
    file would fault each expert in on its first use inside the timed runs."""
    import json
    import subprocess

    out = subprocess.run([exe, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", "1", "-lm", "none",
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return (next(r["avg_ts"] for r in rows if r["n_prompt"] == 512),
            next(r["avg_ts"] for r in rows if r["n_gen"] == 128))


def ours_on(path: str, device: str) -> tuple:
    """bench_cpu.ours on a device backend (the file's formats, the default mode), after a warm-up."""
    m = d.load_model(path, device=device)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, m.config.vocab_size - 1, 512)]
    d.eval(m, d.create_session(m, n_ctx=1024), prompt[:64])
    s = d.create_session(m, n_ctx=1024)
    t = time.perf_counter()
    d.eval(m, s, prompt)
    pp = 512 / (time.perf_counter() - t)
    s = d.create_session(m, n_ctx=1024)
    d.eval(m, s, [prompt[0]])
    t = time.perf_counter()
    for i in range(128):
        d.eval(m, s, [prompt[i + 1]])
    return pp, 128 / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--type", default="q8_0", choices=["q8_0", "q4_0"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    ap.add_argument("--device", default="cpu", help="cpu, or a device backend (llama-bench then is not run)")
    a = ap.parse_args()
    path = d.hub.home() / "bench" / f"qwen3moe-30b-a3b-shape-{a.layers}l-{a.type}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        write(str(path) + ".part", a.layers, a.type)
        os.replace(str(path) + ".part", path)
        print(f"# wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
    where = f"threads={a.threads}" if a.device == "cpu" else f"device={a.device}"
    print(f"# {time.strftime('%Y-%m-%d')} {d.system_info()['isa_active']} {where}; Qwen3-30B-A3B layer "
          f"shapes x {a.layers} layers, {a.type}, random weights")
    print("| test | dasllama t/s | llama.cpp t/s | ratio |")
    print("| --- | --- | --- | --- |")
    o, lb = [], []
    for _ in range(a.reps):  # interleaved: ours, then theirs, each rep
        o.append(B.ours(str(path), a.threads, "q8") if a.device == "cpu" else ours_on(str(path), a.device))
        if a.llama_bench and a.device == "cpu":
            lb.append(llama_bench(a.llama_bench, str(path), a.threads))
    for i, test in enumerate(("pp512", "tg128")):
        ours = float(np.mean([x[i] for x in o]))
        theirs = float(np.mean([x[i] for x in lb])) if lb else float("nan")
        print(f"| {test} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
