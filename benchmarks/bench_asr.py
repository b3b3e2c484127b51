"""Speech recognition: whisper tiny.en encoder time against CTranslate2's, and whole transcriptions
(real-time factor, word error rate) against faster-whisper's, interleaved rep by rep in one run.

    python benchmarks/bench_asr.py [--threads 2] [--reps 3] [--encoder-only] [--core DIR] [--cpu-time]
    python benchmarks/bench_asr.py --ours-only --device cuda --model whisper-tiny.en.gguf   # a GPU machine

Both sides read the same pulled CTranslate2 files (``dasllama pull whisper-tiny.en``; ours through
``dasllama convert``), in float32, with the same thread count. Encoder: ours is mel (C++) + encoder
of a 30 s window (``encode_audio_rows`` with a reused ``AudioState``, as a caller encoding
repeatedly passes one; CTranslate2 keeps its own buffers cached), CTranslate2 is
``Whisper.encode`` of WhisperFeatureExtractor's features (mel not counted on its side). Transcription: greedy, beam 1,
whisper's fallback schedule, condition_on_previous_text off, no VAD, on speech eSpeak NG speaks
(tests/oracles/asr_script.py): one sentence (5.6 s) and eight sentences (41 s). Best of
``--reps`` per pipeline. ``--encoder-only`` skips the transcriptions; ``--core DIR`` loads
``dasllama._core`` from DIR (another build's extension, same Python files): an A/B of two
builds runs this script alternately with and without it. ``--cpu-time`` also reports each side's
process CPU time per encode (``time.process_time``, median of the reps): with ``--threads 1`` the
steadiest measure on a shared machine, where wall times follow the other workers' load.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "oracles"))


def load_core(directory: str) -> None:
    """Makes ``dasllama._core`` the extension built in ``directory`` (another build, for an A/B);
    call before importing dasllama."""
    import glob
    import importlib.util

    path = glob.glob(os.path.join(directory, "_core.*.so"))[0]
    spec = importlib.util.spec_from_file_location("dasllama._core", path)
    core = importlib.util.module_from_spec(spec)
    sys.modules["dasllama._core"] = core
    spec.loader.exec_module(core)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--encoder-only", action="store_true")
    ap.add_argument("--core", default=None)
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--device", default=None, help="ours on this device (cuda, vulkan); the peers stay on the CPU")
    ap.add_argument("--model", default=None, help="our whisper GGUF (default: converted from the pulled files)")
    ap.add_argument("--ours-only", action="store_true",
                    help="time ours alone (a GPU machine without CTranslate2 or the network)")
    args = ap.parse_args()
    if args.core:
        load_core(args.core)

    import dasllama as d
    from dasllama import cli, hub
    from asr_script import SENTENCES, long_clip, wer
    from speech import speak

    gguf = args.model
    if gguf is None:
        gguf = os.path.join(tempfile.mkdtemp(), "whisper-tiny.en.gguf")
        cli.main(["convert", "whisper-tiny.en", gguf])
    model = d.load_asr_model(gguf, n_threads=args.threads, device=args.device)
    if args.ours_only:
        return ours_only(d, model, speak, SENTENCES, long_clip, wer, args.reps)

    import ctranslate2
    from faster_whisper import WhisperModel
    from transformers import WhisperFeatureExtractor

    ct2_dir = str(hub.pull("whisper-tiny.en"))
    ct2 = ctranslate2.models.Whisper(ct2_dir, device="cpu", compute_type="float32", intra_threads=args.threads)
    fw = WhisperModel(ct2_dir, device="cpu", compute_type="float32", cpu_threads=args.threads)

    # -- encoder of one 30 s window ----------------------------------------------------------------
    x30 = np.resize(speak(SENTENCES[0]), 30 * 16000).astype(np.float32)
    feats = WhisperFeatureExtractor()(x30, sampling_rate=16000, return_tensors="np").input_features
    sv = ctranslate2.StorageView.from_array(np.ascontiguousarray(feats))
    ours_enc, ct2_enc, ours_cpu, ct2_cpu = [], [], [], []
    state = d.AudioState()
    d.encode_audio_rows(model.encoder, x30, state, full_window=True)  # warm-up both
    ct2.encode(sv)
    for _ in range(args.reps):
        t, c = time.perf_counter(), time.process_time()
        d.encode_audio_rows(model.encoder, x30, state, full_window=True)
        ours_enc.append(time.perf_counter() - t)
        ours_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        ct2.encode(sv)
        ct2_enc.append(time.perf_counter() - t)
        ct2_cpu.append(time.process_time() - c)
    print(f"encoder 30 s window, {args.threads} threads: dasllama (mel + encoder) {min(ours_enc) * 1e3:.1f} ms, "
          f"CTranslate2 (encoder) {min(ct2_enc) * 1e3:.1f} ms, ratio {min(ct2_enc) / min(ours_enc):.2f}x "
          f"(load average {' '.join(open('/proc/loadavg').read().split()[:3])})", flush=True)
    if args.cpu_time:
        a, b = float(np.median(ours_cpu)), float(np.median(ct2_cpu))
        print(f"  CPU time per encode (median of {args.reps}): dasllama {a * 1e3:.1f} ms, CTranslate2 {b * 1e3:.1f} ms, "
              f"ratio {b / a:.2f}x", flush=True)
    if args.encoder_only:
        return

    # -- whole transcriptions --------------------------------------------------------------------------
    settings = SETTINGS
    clips = {"one sentence": (speak(SENTENCES[0]), SENTENCES[0]),
             "eight sentences": (long_clip(), " ".join(SENTENCES))}
    print("| clip | seconds | dasllama s | dasllama RTF | faster-whisper s | faster-whisper RTF | WER ours | "
          "WER faster-whisper | same text |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (x, script) in clips.items():
        dur = len(x) / 16000
        ours_t, fw_t = [], []
        ours_text = fw_text = ""
        for _ in range(args.reps):
            t = time.perf_counter()
            ours_text = d.transcribe(model, x, logprob_threshold=-1.0, **settings).text
            ours_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            segs, _ = fw.transcribe(x, language="en", beam_size=1, best_of=5, vad_filter=False,
                                    log_prob_threshold=-1.0, **settings)
            fw_text = "".join(s.text for s in segs).strip()
            fw_t.append(time.perf_counter() - t)
        a, b = min(ours_t), min(fw_t)
        print(f"| {name} | {dur:.1f} | {a:.2f} | {a / dur:.3f} | {b:.2f} | {b / dur:.3f} | "
              f"{wer(ours_text, script):.3f} | {wer(fw_text, script):.3f} | {ours_text == fw_text} |")


SETTINGS = dict(compression_ratio_threshold=2.4, no_speech_threshold=0.6, condition_on_previous_text=False)


def ours_only(d, model, speak, sentences, long_clip, wer, reps) -> None:
    """Our encoder of a 30 s window and the two transcriptions, timed alone (best of reps)."""
    x30 = np.resize(speak(sentences[0]), 30 * 16000).astype(np.float32)
    state = d.AudioState()
    d.encode_audio_rows(model.encoder, x30, state, full_window=True)  # warm-up
    enc = []
    for _ in range(reps):
        t = time.perf_counter()
        d.encode_audio_rows(model.encoder, x30, state, full_window=True)
        enc.append(time.perf_counter() - t)
    print(f"encoder 30 s window (mel + encoder): {min(enc) * 1e3:.1f} ms", flush=True)
    for name, (x, script) in {"one sentence": (speak(sentences[0]), sentences[0]),
                              "eight sentences": (long_clip(), " ".join(sentences))}.items():
        ts, text = [], ""
        for _ in range(reps):
            t = time.perf_counter()
            text = d.transcribe(model, x, logprob_threshold=-1.0, **SETTINGS).text
            ts.append(time.perf_counter() - t)
        dur = len(x) / 16000
        print(f"{name} ({dur:.1f} s): {min(ts):.3f} s, RTF {min(ts) / dur:.4f}, WER {wer(text, script):.3f}", flush=True)


if __name__ == "__main__":
    main()
