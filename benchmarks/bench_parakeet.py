"""CPU encode time of a FastConformer CTC encoder (Parakeet CTC) on random weights, ours against
transformers' ParakeetForCTC (torch) on the same features and threads.

Two shapes: a tiny one (d 64, 2 blocks) and parakeet-ctc-0.6b's block shape (d 1024, 8 heads, ffn
4096, conv kernel 9, stem channels 256, 128 mel bins) with fewer blocks (--layers, default 4; the
release has 24: encode time is about linear in the blocks). --outtype f16 stores our matrices in
f16 (the convert option), q8_0 requantizes them (`dasllama quantize`); torch runs f32 either way. Times are the median of --reps runs
(interleaved, ours then torch, after a warm-up each) of the features -> CTC logits (the front
end excluded on both sides).

    python benchmarks/bench_parakeet.py --seconds 10 --threads 2 --layers 4
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def build(tmp: Path, name: str, enc: dict, vocab: int, outtype: str):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import ParakeetCTCConfig, ParakeetForCTC, ParakeetTokenizer

    from dasllama.convert_ctc import convert_hf_parakeet_ctc

    torch.manual_seed(0)
    m = ParakeetForCTC(ParakeetCTCConfig(vocab_size=vocab, pad_token_id=vocab - 1, encoder_config=enc)).eval()
    src = tmp / name
    m.save_pretrained(src)
    pieces = [("<unk>", 0.0)] + [(f"\u2581w{i}", -1.0) for i in range(vocab - 2)]
    ParakeetTokenizer(tokenizer_object=Tokenizer(models.Unigram(pieces, unk_id=0)), unk_token="<unk>",
                      pad_token="<pad>").save_pretrained(src)
    if outtype == "q8_0":  # dasllama quantize over the f32 file (the converter writes f32 / f16)
        from dasllama.convert import requantize

        f32 = convert_hf_parakeet_ctc(src, tmp / f"{name}-f32.gguf", progress=False)
        return m, requantize(f32, tmp / f"{name}.gguf", "q8_0", progress=False)
    return m, convert_hf_parakeet_ctc(src, tmp / f"{name}.gguf", progress=False, outtype=outtype)


def timed(fns, reps):
    """Median seconds of each fn, run interleaved rep by rep after one warm-up each (the machine
    may be shared: interleaving gives both sides the same load)."""
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(ts, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--outtype", default="f32", choices=("f32", "f16", "q8_0"),
                    help="our file's matrices (torch: f32); q8_0 through dasllama quantize")
    ap.add_argument("--split", action="store_true",
                    help="ours only: 1 block against --layers blocks of the 0.6b shape, to split the stem from a block")
    a = ap.parse_args()
    import torch

    import dasllama as d

    torch.set_num_threads(a.threads)
    shapes = {
        "tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                      subsampling_conv_channels=64, num_mel_bins=128), 33),
        f"0.6b-shaped x{a.layers} blocks": (dict(hidden_size=1024, num_hidden_layers=a.layers, num_attention_heads=8,
                                                 intermediate_size=4096, subsampling_conv_channels=256,
                                                 num_mel_bins=128), 1025),
    }
    frames = int(a.seconds * 100)
    feat = np.random.default_rng(0).standard_normal((128, frames)).astype(np.float32)
    if a.split:
        big = dict(hidden_size=1024, num_attention_heads=8, intermediate_size=4096, subsampling_conv_channels=256,
                   num_mel_bins=128)
        with tempfile.TemporaryDirectory() as td:
            ms = [d.load_asr_model(build(Path(td), f"l{n}", dict(big, num_hidden_layers=n), 1025, a.outtype)[1],
                                   n_threads=a.threads) for n in (1, a.layers)]
            t1, tn = timed([lambda m=m: m.encoder.encode_features(feat) for m in ms], a.reps)
        per = (tn - t1) / (a.layers - 1)
        print(f"1 block {t1 * 1000:.0f} ms, {a.layers} blocks {tn * 1000:.0f} ms: a block {per * 1000:.0f} ms, "
              f"stem + head {(t1 - per) * 1000:.0f} ms, 24 blocks ~{(t1 + 23 * per) * 1000:.0f} ms")
        return
    print(f"{a.seconds:g} s of features ({frames} frames), {a.threads} threads, median of {a.reps}, "
          f"our matrices {a.outtype}")
    with tempfile.TemporaryDirectory() as td:
        for name, (enc, vocab) in shapes.items():
            m, path = build(Path(td), name.split()[0], enc, vocab, a.outtype)
            ours = d.load_asr_model(path, n_threads=a.threads)
            x = torch.from_numpy(feat.T.copy())[None]
            with torch.no_grad():
                t_ours, t_ref = timed([lambda: ours.encoder.encode_features(feat), lambda: m(input_features=x)], a.reps)
            print(f"{name:28s} ours {t_ours * 1000:8.1f} ms   transformers {t_ref * 1000:8.1f} ms   "
                  f"ratio {t_ref / t_ours:5.2f}x   RTF ours {t_ours / a.seconds:.4f}")


if __name__ == "__main__":
    main()
