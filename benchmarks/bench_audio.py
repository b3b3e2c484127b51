"""Audio benchmarks: mel + encoder time of a 30 s clip (ours, CTranslate2, transformers) and the time to
first token of an audio turn, cold and as a second question about the same clip through the prefix cache.

    python benchmarks/bench_audio.py [--threads 2] [--reps 3]
    python benchmarks/bench_audio.py --device cuda [--shape llama1b]   # a GPU home: TTFT rows only

Encoder: whisper tiny.en (``dasllama pull whisper-tiny.en``, converted by ``dasllama convert``) for
ours and CTranslate2 (fp32, its own Whisper.encode); transformers runs a WhisperEncoder of the same
shapes (tiny.en: 4 layers, width 384, 80 mel) with random weights -- the time does not depend on
the values, and no HF checkpoint is pulled. Mel for CTranslate2 and transformers is transformers'
WhisperFeatureExtractor (numpy), which both pipelines use in practice.

TTFT: SmolLM2-135M-Instruct (q8) hears 750 rows (Qwen2-Audio's count for a 30 s clip) spliced as
pre-encoded rows; "cold" prefills the whole turn, "second question" is a new conversation over the
same pool and prefix cache whose span is attached. The tiny random Qwen2-Audio pair of the tests
measures the whole path including its tower (encode + splice + prefill).

With --device (cuda, vulkan): no download (GPU machines may have no network), so the 750-row turn
goes to a random-weight q8_0 decoder of one of bench_cuda.py's shapes (Llama-3.2-1B's by default)
and the tiny Qwen2-Audio pair runs its tower and decoder on the device.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "oracles"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def best(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def clip30():
    from speech import speak

    x = speak("And so my fellow Americans, ask not what your country can do for you, "
              "ask what you can do for your country.")
    return np.resize(x, 30 * 16000).astype(np.float32)


def encoder_rows(args, x, tmp):
    import ctranslate2
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    import dasllama as d
    from dasllama import cli, hub

    torch.set_num_threads(args.threads)
    ct2_dir = str(hub.pull("whisper-tiny.en"))
    mm = os.path.join(tmp, "whisper-tiny.en-encoder.gguf")
    cli.main(["convert", "whisper-tiny.en", mm])
    emb = d.load_audio_embedder(mm, n_threads=args.threads)
    st = d.AudioState()
    rows = []
    rows.append(("dasllama", "mel (C++)", best(lambda: d.log_mel(x, 80), args.reps)))
    rows.append(("dasllama", "mel + encoder", best(lambda: d.encode_audio_rows(emb, x, st), args.reps)))
    fe = WhisperFeatureExtractor()
    feats = fe(x, sampling_rate=16000, return_tensors="np").input_features
    rows.append(("WhisperFeatureExtractor", "mel (numpy)", best(lambda: fe(x, sampling_rate=16000,
                                                                           return_tensors="np"), args.reps)))
    ct2 = ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32", intra_threads=args.threads)
    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats))
    t_enc = best(lambda: ct2.encode(sv, to_cpu=True), args.reps)
    rows.append(("CTranslate2 fp32", "encoder", t_enc))
    rows.append(("CTranslate2 fp32", "mel (numpy) + encoder", t_enc + rows[2][2]))
    cfg = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                        num_mel_bins=80, max_source_positions=1500)
    enc = WhisperEncoder(cfg).eval()
    tf = torch.from_numpy(feats)

    def hf():
        with torch.no_grad():
            enc(tf)
    t_hf = best(hf, args.reps)
    rows.append(("transformers fp32", "encoder", t_hf))
    rows.append(("transformers fp32", "mel (numpy) + encoder", t_hf + rows[2][2]))
    return rows


def ttft(model, make_chat, add, question, reps):
    """(cold TTFT, second-question TTFT, media rows prefilled by the second) -- best of reps."""
    import dasllama as d

    cold, warm, media = [], [], 0
    for _ in range(reps):
        for kind in ("cold", "warm"):
            pool = d.create_kv_pool(model, page_rows=64)
            cache = d.create_prefix_cache()
            if kind == "warm":  # a first conversation about the clip fills the cache
                c0 = make_chat(pool, cache)
                add(c0, "What is said?")
                d.respond(model, c0)
                d.chat.media.ROW_CACHE.hits  # noqa: B018 - the tower cache stays warm too
            else:
                d.chat.media.ROW_CACHE.clear()
            c = make_chat(pool, cache)
            add(c, question)
            t0 = time.perf_counter()
            first = []
            d.respond(model, c, None, lambda p: (first.append(time.perf_counter()), False)[1])
            (cold if kind == "cold" else warm).append((first[0] if first else time.perf_counter()) - t0)
            if kind == "warm":
                media = c.media_stats["media_rows_prefilled"]
            d.prefix_release(cache, pool)
    return min(cold), min(warm), media


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or a GPU home (TTFT rows only, random-weight decoders)")
    ap.add_argument("--shape", default="llama1b", help="with --device: bench_cuda.py's decoder shape")
    args = ap.parse_args()
    import dasllama as d

    dev = None if args.device == "cpu" else args.device
    x = clip30()
    with tempfile.TemporaryDirectory() as tmp:
        if not dev:
            print("| pipeline | stage | 30 s clip, ms |\n| --- | --- | --- |")
            for who, what, t in encoder_rows(args, x, tmp):
                print(f"| {who} | {what} | {t * 1e3:.1f} |")

        print("\n| decoder | rows | cold TTFT ms | second question TTFT ms | media rows prefilled (2nd) |")
        print("| --- | --- | --- | --- | --- |")
        if dev:
            import bench_cuda

            path = os.path.join(tmp, f"{args.shape}-q8_0.gguf")
            bench_cuda.write_model(path, args.shape, "q8_0")
            m = d.load_model(path, n_threads=args.threads, device=dev)
            label = f"random {args.shape} q8_0 on {dev}"
        else:
            m = d.load_model("smollm2-135m-instruct", n_threads=args.threads)
            label = "SmolLM2-135M q8"
        rows = np.random.default_rng(0).standard_normal((750, m.config.dim)).astype(np.float32) * 0.05
        c, w, media = ttft(m, lambda pool, cache: d.create_chat(m, max_new=4, pool=pool, cache=cache),
                           lambda ch, q: (d.add_user_audio_rows(m, ch, rows, 750), d.add_user(ch, q)),
                           "Who is speaking?", args.reps)
        print(f"| {label} | 750 (pre-encoded) | {c * 1e3:.1f} | {w * 1e3:.1f} | {media} |")

        import audio as A

        hfm = A.qwen2_audio()
        mm = A.write_qwen2_audio(hfm, os.path.join(tmp, "mm.gguf"))
        dec = A.write_decoder(hfm, os.path.join(tmp, "dec.gguf"))
        tm = d.load_model(dec, n_threads=args.threads, device=dev)
        tower = d.load_audio_tower(mm, n_threads=args.threads, device=dev)
        c, w, media = ttft(tm, lambda pool, cache: d.create_chat(tm, tower, max_new=4, pool=pool, cache=cache),
                           lambda ch, q: d.add_user_audio(ch, x, q), "Who is speaking?", args.reps)
        where = f" on {dev}" if dev else ""
        print(f"| tiny Qwen2-Audio (tower + decoder{where}) | {tower.n_rows(len(x))} (encoded) | {c * 1e3:.1f} | "
              f"{w * 1e3:.1f} | {media} |")


if __name__ == "__main__":
    main()
