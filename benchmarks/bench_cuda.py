"""CUDA speed on real model shapes: decode (1 stream), batched decode, pp512; against the bandwidth floor.

The models are random weights in the exact shapes of Llama-3.2-1B, Gemma-3-270M and
SmolLM2-135M (llama architecture, tied output), written as GGUF with blocks drawn
directly in each format (speed does not depend on the values). The floor is the weight
bytes a decode step reads over the device-to-device copy bandwidth measured in the same
run (torch). Run on the GPU machine:

    python benchmarks/bench_cuda.py --shapes llama1b,gemma270m,smollm135m --types f16,q8_0,q4_0
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

SHAPES = {
    # dim, layers, heads, kv heads, head_dim, ffn, vocab
    "llama1b": (2048, 16, 32, 8, 64, 8192, 128256),
    "gemma270m": (640, 18, 4, 1, 256, 2048, 262144),
    "smollm135m": (576, 30, 9, 3, 64, 1536, 49152),
}


# Byte offsets of each format's f16 scale fields (d, and dmin / m where it has one), and their value.
SCALES = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q4_K": [0, 2], "q5_K": [0, 2],
          "q6_K": [208]}
SCALE = {"q4_K": 2e-5, "q5_K": 1e-5, "q6_K": 1e-5}  # weights up to d * 63 * 15, d * 63 * 31, d * 127 * 32


def random_blocks(rng, ftype: str, rows: int, cols: int) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

    if ftype == "f16":
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
    bs, ts = GGML_QUANT_SIZES[T[ftype.upper()]]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for off in SCALES[ftype]:  # the block scales (random bytes there could be inf or NaN)
        raw[:, :, off:off + 2] = np.frombuffer(np.float16(SCALE.get(ftype, 0.002)).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def tensor_type(ftype: str, name: str, layer: int, n_layers: int, cols: int) -> str:
    """The format of a tensor in a file of `ftype`: "q4_k_m" mixes as llama.cpp's Q4_K_M does
    (q6_K for the embedding (the tied output) and for V and down in the first and last eighth of
    the layers and every third between, q4_K elsewhere; rows that are not whole 256-blocks fall
    back to q5_0 / q8_0 as llama.cpp's do); any other ftype is every matrix's."""
    if ftype != "q4_k_m":
        return ftype
    more = layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
    k = "q6_K" if name == "token_embd" or (name in ("attn_v", "ffn_down") and more) else "q4_K"
    return k if cols % 256 == 0 else {"q4_K": "q5_0", "q6_K": "q8_0"}[k]


def write_model(path: str, shape: str, ftype: str) -> None:
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    D, L, H, KVH, hd, F, V = SHAPES[shape]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(8192)
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] +
                     [f"\u2581t{i}" for i in range(V - 259)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (V - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    def mat(name, rows, cols):
        parts = name.split(".")
        ft = tensor_type(ftype, parts[-2], int(parts[1]) if parts[0] == "blk" else 0, L, cols)
        w.add_tensor(name, random_blocks(rng, ft, rows, cols), raw_dtype=T[ft.upper()] if ft != "f16" else None)

    mat("token_embd.weight", V, D)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
        mat(p + "attn_q.weight", H * hd, D)
        mat(p + "attn_k.weight", KVH * hd, D)
        mat(p + "attn_v.weight", KVH * hd, D)
        mat(p + "attn_output.weight", D, H * hd)
        mat(p + "ffn_gate.weight", F, D)
        mat(p + "ffn_up.weight", F, D)
        mat(p + "ffn_down.weight", D, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), by torch."""
    import torch

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 20 / (time.perf_counter() - t)


def load(path: str, device: str):
    """The model on device; BENCH_MODE=fp32 (a QuantMode name) loads it in that mode, so ab_cuda.py
    can set modes beside each other as it sets environment variables."""
    import dasllama as d

    mode = os.environ.get("BENCH_MODE")
    if mode and mode not in d.QuantMode.__members__:
        raise SystemExit(f"BENCH_MODE={mode}: not one of {', '.join(d.QuantMode.__members__)}")
    return d.load_model(path, device=device, **({"mode": d.QuantMode[mode]} if mode else {}))


def bench(path: str, device: str, batches, tg: bool = True, greedy: bool = False) -> dict:
    import dasllama as d

    m = load(path, device)
    out = {"weight_bytes": m._m.weight_bytes}
    prompt = list(range(3, 3 + 512))
    # pp512: a fresh session prefilling 512 tokens (best of 3, after a warm-up).
    best = 1e9
    for _ in range(4):
        s = d.create_session(m, n_ctx=1024)
        t = time.perf_counter()
        d.eval(m, s, prompt)
        best = min(best, time.perf_counter() - t)
    out["pp512"] = 512 / best
    # Decode: the C++ loop of generate, 256 tokens after a 16-token prompt, no stop ids.
    tgs = []
    for _ in range(3 if tg else 0):
        s = d.create_session(m, n_ctx=1024)
        d.generate(m, s, prompt[:16], d.SamplingParams(), 256, stop_ids=[])
        tgs.append(d.stats(s).gen_tps)
    if tgs:
        out["tg256"] = max(tgs)
    # Launches joined into others over the steps so far (CUDA), so that an A/B row whose setting
    # did not take (a condition not met on this model) shows it.
    for k, get in (("fused_ops", lambda: m._m.fused_ops), ("rms_tail", lambda: m._m.path_count("rms_tail"))):
        try:
            v = get()
        except (AttributeError, RuntimeError):
            continue
        if v:
            out[k] = v
    # Batched decode: B sessions of a pool, 64 steps of one token each after a 16-token prefill.
    for B in batches:
        pool = d.create_kv_pool(m, page_rows=16, max_pages=B * 8)
        ss = [d.create_session(m, pool) for _ in range(B)]
        ws = d.create_batch_workspace(m)
        d.eval_batch(m, ws, ss, [prompt[:16]] * B)
        d.eval_batch(m, ws, ss, [5] * B)
        t = time.perf_counter()
        for _ in range(64):
            d.eval_batch(m, ws, ss, [5] * B)
        out[f"B{B}"] = B * 64 / (time.perf_counter() - t)
        if greedy:
            # B greedy streams: each step evaluates the ids the last step's device argmax gave (only
            # B ids cross back a step, not B x vocab logits).
            for s in ss:
                s.truncate(17)
            ids = d.eval_batch(m, ws, ss, [5] * B, greedy=True)
            t = time.perf_counter()
            for _ in range(64):
                ids = d.eval_batch(m, ws, ss, ids, greedy=True)
            out[f"G{B}"] = B * 64 / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama1b")
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="4,16,64")
    ap.add_argument("--json", default=None)
    ap.add_argument("--greedy", action="store_true", help="also batched greedy streams (G<B>: ids from the device)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            for ft in args.types.split(","):
                path = os.path.join(tmp, f"{shape}-{ft}.gguf")
                write_model(path, shape, ft)
                r = bench(path, args.device, [int(b) for b in args.batches.split(",") if shape == "llama1b" and b],
                          greedy=args.greedy)
                os.remove(path)
                r.update(shape=shape, type=ft, floor_tps=bw / r["weight_bytes"])
                rows.append(r)
                extra = " ".join(f"{k}{b}={r[f'{k}{b}']:.0f}" for b in args.batches.split(",") for k in "BG"
                                 if f"{k}{b}" in r)
                print(f"{shape:11s} {ft:5s} tg {r['tg256']:7.0f} t/s ({r['tg256'] / r['floor_tps']:.0%} of the floor "
                      f"{r['floor_tps']:.0f})  pp512 {r['pp512']:8.0f} t/s  {extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
