"""Vision benchmarks: the encode time of one image through a Gemma-3-shaped SigLIP tower, and the
time to first token of an image turn, cold and as a second question about the same image.

    python benchmarks/bench_vision.py [--threads 2] [--reps 3] [--layers 27] [--device cpu] [--encode-only]

Tower: Gemma-3's vision shape (SigLIP-so400m: 896 px, 14 px patches -> 4096 patches, width 1152,
16 heads, MLP 4304, 27 blocks; pooled 4 x 4 -> 256 rows) with random f16 weights written in
llama.cpp's mmproj layout by gguf-py -- the time does not depend on the values, and no gated
checkpoint is pulled. ``--layers`` runs fewer blocks (the time scales with them).
``--torch`` also times transformers' SiglipVisionModel + Gemma3MultiModalProjector (fp32) on the
same shape.

TTFT: Gemma-3-270M (``dasllama pull gemma3-270m``, Q4_K_M, width 640) with a tower projecting to its
width: "cold" encodes the image and prefills the turn (256 image rows + text), "second question"
is a new conversation over the same pool and prefix cache asking about the same image (its span
is attached: no encode, no image prefill), "same chat" a follow-up question in the first chat.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def best(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def write_mmproj(path, layers, proj_dim, image_size=896, patch=14, width=1152, heads=16, ffn=4304, seed=0):
    """A random Gemma-3 SigLIP mmproj with the keys and tensors llama.cpp's converter writes."""
    import gguf

    rng = np.random.default_rng(seed)

    def r(*shape, scale=0.02, dtype=np.float16):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    w = gguf.GGUFWriter(path, "clip")
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_uint32("clip.vision.embedding_length", width)
    w.add_uint32("clip.vision.feed_forward_length", ffn)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.projection_dim", proj_dim)
    w.add_uint32("clip.vision.attention.head_count", heads)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_string("clip.projector_type", "gemma3")
    n = (image_size // patch) ** 2
    w.add_tensor("mm.input_projection.weight", r(width, proj_dim))
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(width, np.float32))
    w.add_tensor("v.patch_embd.weight", r(width, 3, patch, patch, dtype=np.float32))
    w.add_tensor("v.patch_embd.bias", r(width, dtype=np.float32))
    w.add_tensor("v.position_embd.weight", r(n, width, dtype=np.float32))
    for i in range(layers):
        b = f"v.blk.{i}."
        for nm in ("ln1", "ln2"):
            w.add_tensor(b + nm + ".weight", np.ones(width, np.float32))
            w.add_tensor(b + nm + ".bias", np.zeros(width, np.float32))
        for nm in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(b + nm + ".weight", r(width, width))
            w.add_tensor(b + nm + ".bias", r(width, dtype=np.float32))
        w.add_tensor(b + "ffn_up.weight", r(ffn, width))
        w.add_tensor(b + "ffn_up.bias", r(ffn, dtype=np.float32))
        w.add_tensor(b + "ffn_down.weight", r(width, ffn))
        w.add_tensor(b + "ffn_down.bias", r(width, dtype=np.float32))
    w.add_tensor("v.post_ln.weight", np.ones(width, np.float32))
    w.add_tensor("v.post_ln.bias", np.zeros(width, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def torch_encode_time(args, image_size=896, patch=14, width=1152, heads=16, ffn=4304):
    import torch
    from transformers import Gemma3Config
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.siglip.modeling_siglip import SiglipVisionConfig, SiglipVisionModel

    torch.set_num_threads(args.threads)
    vc = SiglipVisionConfig(hidden_size=width, intermediate_size=ffn, num_hidden_layers=args.layers,
                            num_attention_heads=heads, image_size=image_size, patch_size=patch, vision_use_head=False)
    tower = SiglipVisionModel(vc).eval()
    proj = Gemma3MultiModalProjector(Gemma3Config(vision_config=vc.to_dict(), text_config={"hidden_size": 640})).eval()
    px = torch.randn(1, 3, image_size, image_size)
    with torch.no_grad():
        return best(lambda: proj(tower(pixel_values=px).last_hidden_state), args.reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--encode-only", action="store_true", help="time the tower alone (no decoder, no TTFT)")
    args = ap.parse_args()

    import dasllama as d
    from dasllama import hub
    from dasllama.chat import media as M

    model = None
    if not args.encode_only:
        dec = str(hub.pull("gemma3-270m"))
        model = d.load_model(dec, n_threads=args.threads, device=args.device)
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        mm = write_mmproj(os.path.join(tmp, "mmproj-gemma3-shape.gguf"), args.layers,
                          model.config.dim if model is not None else 640)
        e = d.load_vision_embedder(mm, n_threads=args.threads, device=args.device)
        print(e)
        if args.reps > 1:
            d.encode_image_rows(e, img)  # warm up (allocations)
        t_enc = best(lambda: d.encode_image_rows(e, img), args.reps)
        t_pre = best(lambda: e.pixel_values(img), max(args.reps, 3))
        print(f"encode one image ({args.layers} blocks, 4096 patches -> {e.n_rows} rows) on {args.device}: "
              f"{t_enc * 1e3:.0f} ms (of which preprocessing {t_pre * 1e3:.1f} ms)")
        if args.torch:
            print(f"transformers SigLIP + projector, fp32, {args.threads or 'default'} threads: "
                  f"{torch_encode_time(args) * 1e3:.0f} ms")
        if args.encode_only:
            return

        def ttft(chat):
            t = time.perf_counter()
            chat.max_new = 1
            d.respond(model, chat)
            return time.perf_counter() - t

        cold, second, same = [], [], []
        for _ in range(args.reps):
            M.ROW_CACHE.clear()
            pool = d.create_kv_pool(model, page_rows=16)
            cache = d.create_prefix_cache()
            a = d.create_chat(model, e, pool=pool, cache=cache)
            d.add_user_image(a, img, "Describe this picture.")
            cold.append(ttft(a))
            d.add_user(a, "What colours are in it?")
            same.append(ttft(a))
            b = d.create_chat(model, e, pool=pool, cache=cache)
            d.add_user_image(b, img, "What is in the picture?")
            second.append(ttft(b))
            assert b.media_stats["encodes"] == 0
        print(f"TTFT Gemma-3-270M + image, cold: {min(cold) * 1e3:.0f} ms; second question, new conversation "
              f"(prefix cache): {min(second) * 1e3:.0f} ms; follow-up in the same chat: {min(same) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
