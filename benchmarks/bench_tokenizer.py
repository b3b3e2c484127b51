"""Tokenizer speed: encode and decode 1 MB of mixed text (code, unicode, numbers, whitespace runs) with the
tokenizer load_model builds, per model (the budget tests/test_tokenizer.py used to assert: under 1 s).

    python benchmarks/bench_tokenizer.py [--model smollm2-135m-instruct,gemma3-270m]
"""
from __future__ import annotations

import argparse
import time

import dasllama as d

TEXT = ("def f(x):\n    return x ** 2  # square\n\n"
        "Grüße aus Köln! 東京は晴れ。 Здравствуй, мир. 🤖🚀 naïve café\n"
        "3.14159 2718281828 1,000,000 -42 0x1F\n"
        "    indented\t\ttabs   and    spaces\n\n\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct,gemma3-270m")
    a = ap.parse_args()
    text = (TEXT * (1_000_000 // len(TEXT) + 1))[:1_000_000]
    for name in a.model.split(","):
        m = d.load_model(name)
        t = time.perf_counter()
        ids = d.encode(m, text, add_special=False)
        t1 = time.perf_counter()
        d.decode(m, ids)
        t2 = time.perf_counter()
        print(f"{name}: encode 1 MB {t1 - t:.3f} s ({len(ids)} ids), decode {t2 - t1:.3f} s")


if __name__ == "__main__":
    main()
