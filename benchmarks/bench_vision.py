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

Qwen towers (``--family qwen25v`` / ``qwen3v``), at their real shapes with random weights:

    python benchmarks/bench_vision.py --family qwen25v [--layers 32] [--dec-layers 4] [--image 448x448]
        [--workdir DIR] [--mtmd path/to/llama-mtmd-cli]

qwen25v is Qwen2.5-VL's ViT (the same for 3B / 7B / 72B: 32 blocks, width 1280, 16 heads, MLP 3420,
14 px patches, 112 px windows with full attention every 8th block, 2 x 2 merger) projecting to
Qwen2.5-VL-3B's decoder (width 2048, MLP 11008, 16 / 2 heads, M-RoPE [16, 24, 24]); qwen3v is
Qwen3-VL-2B's (24 blocks, width 1024, 16 heads, MLP 4096, 16 px patches, 48 x 48 learned positions,
deepstack after blocks 5 / 11 / 17) with its decoder (width 2048, MLP 6144, 16 / 8 heads of 128,
interleaved M-RoPE [24, 20, 20]). The model is made in transformers (random init, fp16), saved, and
turned into the decoder and mmproj GGUFs by llama.cpp's own convert_hf_to_gguf.py (f16), so the
files are laid out as real ones and llama-mtmd-cli reads them too. ``--layers`` / ``--dec-layers``
cut the tower's / decoder's depth (time scales with them; this 2-core machine cannot hold the
3B decoder's 36 layers of random weights in reasonable time); the vocabulary is the tests' 512
pieces. ``--mtmd`` also runs llama.cpp's llama-mtmd-cli on the same files and image (it prints its
own encode and decode times). ``--workdir`` keeps the files (made once, reused).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


# Real shapes: Qwen2.5-VL's ViT (all sizes) + Qwen2.5-VL-3B's decoder; Qwen3-VL-2B's ViT + decoder.
QWEN_SHAPES = {
    "qwen25v": dict(
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=2048,
                    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                              mrope_section=[16, 24, 24]))),
    "qwen3v": dict(
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
        text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, rope_parameters=dict(
                      rope_type="default", rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True))),
}


def convert_pair(hf, dec, mm):
    """The decoder and mmproj GGUFs (f16) of a saved transformers model, by llama.cpp's converter."""
    import moe

    src = moe.llama_cpp_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), HF_HUB_OFFLINE="1")
    for out, extra in ((dec, []), (mm, ["--mmproj"])):
        r = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), hf, "--outfile", out + ".part",
                            "--outtype", "f16", *extra], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}")
        os.replace(out + ".part", out)
    return dec, mm


def qwen_files(family, layers, dec_layers, workdir):
    """(decoder GGUF, mmproj GGUF) of a random Qwen-VL model at the real shapes, by llama.cpp's converter."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "oracles"))
    import audio
    import vision as V

    tag = f"{family}-L{layers}-D{dec_layers}"
    dec, mm = os.path.join(workdir, f"{tag}.gguf"), os.path.join(workdir, f"mmproj-{tag}.gguf")
    if os.path.exists(dec) and os.path.exists(mm):
        return dec, mm
    sh = QWEN_SHAPES[family]
    vis = dict(sh["vision"], depth=layers)
    if family == "qwen25v":  # full attention every 8th block, as in the real tower
        vis["fullatt_block_indexes"] = [i for i in range(layers) if i % 8 == 7] or [layers - 1]
        from transformers import Qwen2_5_VLConfig as Cfg, Qwen2_5_VLForConditionalGeneration as M
    else:
        vis["deepstack_visual_indexes"] = [i for i in sh["vision"]["deepstack_visual_indexes"] if i < layers]
        from transformers import Qwen3VLConfig as Cfg, Qwen3VLForConditionalGeneration as M
    text = dict(sh["text"], num_hidden_layers=dec_layers, vocab_size=512, max_position_embeddings=32768,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = Cfg(text_config=text, vision_config=vis, image_token_id=502, video_token_id=505,
              vision_start_token_id=500, vision_end_token_id=501)
    torch.manual_seed(0)
    model = M(cfg).half()  # transformers' random init: the time does not depend on the values
    hf = os.path.join(workdir, f"{tag}-hf")
    model.save_pretrained(hf)
    del model
    Path(hf, "tokenizer.model").write_bytes(audio.chat_vocab_proto(V.QWEN_SPECIALS))
    Path(hf, "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": V.QWEN_TEMPLATE}))
    pp = {"image_processor_type": "Qwen2VLImageProcessor", "temporal_patch_size": 2, "merge_size": 2}
    if family == "qwen25v":
        pp.update(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                  image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    else:
        pp.update(patch_size=16, size={"shortest_edge": 65536, "longest_edge": 16777216},
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    Path(hf, "preprocessor_config.json").write_text(json.dumps(pp))
    return convert_pair(hf, dec, mm)


def gemma_files(layers, dec_layers, workdir):
    """(decoder GGUF, mmproj GGUF) of a random Gemma-3 model: the SigLIP tower at its real shape,
    a Gemma-3-270M-shaped decoder (``dec_layers`` of its 18), llama.cpp's converter. For machines
    that cannot pull the hub's gemma3-270m (``--random-decoder``)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "oracles"))
    import vision as V
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tag = f"gemma3v-L{layers}-D{dec_layers}"
    dec, mm = os.path.join(workdir, f"{tag}.gguf"), os.path.join(workdir, f"mmproj-{tag}.gguf")
    if os.path.exists(dec) and os.path.exists(mm):
        return dec, mm
    cfg = Gemma3Config(
        text_config=dict(vocab_size=512, hidden_size=640, intermediate_size=2048, num_hidden_layers=dec_layers,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, query_pre_attn_scalar=256,
                         layer_types=[("full_attention" if i % 6 == 5 else "sliding_attention")
                                      for i in range(dec_layers)]),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers, num_attention_heads=16,
                           image_size=896, patch_size=14, layer_norm_eps=1e-6, vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=500, eoi_token_index=501, image_token_index=502)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).half()
    hf = V.save_hf(model, os.path.join(workdir, f"{tag}-hf"))
    del model
    pp = json.loads(Path(hf, "preprocessor_config.json").read_text())
    pp.update(size={"height": 896, "width": 896}, image_seq_length=256)
    Path(hf, "preprocessor_config.json").write_text(json.dumps(pp))
    return convert_pair(hf, dec, mm)


def run_mtmd(binary, dec, mm, image_path, threads, question):
    """llama-mtmd-cli on the same files: its own encode / decode times (ms) and the image's tokens."""
    cmd = [binary, "-m", dec, "--mmproj", mm, "--image", image_path, "-p", question, "-n", "1",
           "--temp", "0", "-c", "8192", "-v"]
    if threads:
        cmd += ["-t", str(threads)]
    t = time.perf_counter()
    # errors="replace": a random model's one token may be a piece of a UTF-8 sequence
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    wall = time.perf_counter() - t
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"llama-mtmd-cli failed ({r.returncode}):\n{log[-3000:]}")
    # mtmd-cli logs its image encode as "mtmd batch encoding done in N ms" (older builds: "image slice
    # encoded in N ms"), and the image rows' prefill as "image decoded (batch i/n) in N ms".
    enc = [float(x) for x in re.findall(r"(?:mtmd batch encoding done|image slice encoded) in (\d+) ms", log)]
    dec_ms = [float(x) for x in re.findall(r"image decoded \(batch \d+/\d+\) in (\d+) ms", log)]
    return {"encode_ms": sum(enc), "image_decode_ms": sum(dec_ms), "wall_s": wall, "log": log}


def ttft_rounds(model, e, img, reps):
    """Best time to first token over `reps` rounds: an image turn cold, a follow-up in the same
    chat, and the same image in a new conversation over the prefix cache (which must run no
    encoder and prefill no image rows). Returns (cold, second, same) in seconds."""
    import dasllama as d
    from dasllama.chat import media as M

    def ttft(chat):
        t = time.perf_counter()
        chat.max_new = 1
        d.respond(model, chat)
        return time.perf_counter() - t

    cold, second, same = [], [], []
    for _ in range(reps):
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
        assert b.media_stats["encodes"] == 0 and b.media_stats["media_rows_prefilled"] == 0, b.media_stats
    return min(cold), min(second), min(same)


def qwen_main(args):
    import dasllama as d

    rng = np.random.default_rng(0)
    w, h = (int(x) for x in args.image.split("x"))
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    keep = args.workdir is not None
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-vision-")
    os.makedirs(workdir, exist_ok=True)
    try:
        t = time.perf_counter()
        dec, mm = (gemma_files(args.layers, args.dec_layers, workdir) if args.family == "gemma3v" else
                   qwen_files(args.family, args.layers, args.dec_layers, workdir))
        print(f"files ready in {time.perf_counter() - t:.0f} s: {dec}, {mm}")
        e = d.load_vision_embedder(mm, n_threads=args.threads, device=args.device)
        print(e, f"image {w}x{h} -> {e.image_rows(img)} rows (grid {e.image_grid(img)})")
        t_pre = best(lambda: e.pixel_values(img), 3)
        if args.reps > 1:
            d.encode_image_rows(e, img)
        t_enc = best(lambda: d.encode_image_rows(e, img), args.reps)
        print(f"encode one image ({args.layers} blocks) on {args.device}: {t_enc * 1e3:.0f} ms "
              f"(of which preprocessing {t_pre * 1e3:.1f} ms)")
        if args.encode_only:
            return
        model = d.load_model(dec, n_threads=args.threads, device=args.device)

        cold, second, same = ttft_rounds(model, e, img, args.reps)
        print(f"TTFT {args.family} ({args.dec_layers}-layer decoder) + image, cold: {cold * 1e3:.0f} ms; "
              f"second question, new conversation (prefix cache): {second * 1e3:.0f} ms; "
              f"follow-up in the same chat: {same * 1e3:.0f} ms")
        if args.mtmd:
            from PIL import Image

            png = os.path.join(workdir, f"bench-{w}x{h}.png")
            Image.fromarray(img).save(png)
            runs = [run_mtmd(args.mtmd, dec, mm, png, args.threads, "Describe this picture.") for _ in range(args.reps)]
            r = min(runs, key=lambda x: x["encode_ms"])
            for ln in r["log"].splitlines():
                if re.search(r"encoding done|encoded in|decoded|n_tokens_batch|n_patches|prompt eval", ln):
                    print("  mtmd:", ln.strip())
            print(f"llama-mtmd-cli: image encode {r['encode_ms']:.0f} ms, image decode (prefill) "
                  f"{r['image_decode_ms']:.0f} ms, whole run {r['wall_s']:.1f} s")
    finally:
        if not keep:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--encode-only", action="store_true", help="time the tower alone (no decoder, no TTFT)")
    ap.add_argument("--family", default="gemma3v", choices=("gemma3v", "qwen25v", "qwen3v"))
    ap.add_argument("--dec-layers", type=int, default=4, help="qwen: decoder layers of the random decoder")
    ap.add_argument("--image", default="448x448", help="qwen: the random image's WxH")
    ap.add_argument("--workdir", default=None, help="qwen: keep (and reuse) the converted files here")
    ap.add_argument("--mtmd", default=None, help="qwen: llama-mtmd-cli to run on the same files")
    ap.add_argument("--random-decoder", action="store_true",
                    help="gemma3v: a converter-made random Gemma-3-270M-shaped decoder and tower (no network)")
    args = ap.parse_args()
    if args.family != "gemma3v" or args.random_decoder:
        if args.family == "gemma3v" and args.dec_layers == 4:
            args.dec_layers = 18  # Gemma-3-270M's depth: small enough to run whole
        if args.family != "gemma3v" and args.layers == 27:  # the default is Gemma-3's depth: a Qwen tower's own then
            args.layers = QWEN_SHAPES[args.family]["vision"]["depth"]
        return qwen_main(args)

    import dasllama as d
    from dasllama import hub

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

        cold, second, same = ttft_rounds(model, e, img, args.reps)
        print(f"TTFT Gemma-3-270M + image, cold: {cold * 1e3:.0f} ms; second question, new conversation "
              f"(prefix cache): {second * 1e3:.0f} ms; follow-up in the same chat: {same * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
