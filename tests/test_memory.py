"""Memory: a load holds the file once, estimate_memory says the size first, and what does not fit is refused."""
import subprocess
import sys

import pytest

import dasllama as d

# A fresh process per load: RSS figures of this one are shared by every test before it.
PROBE = """
import os, sys, dasllama as d
def rss():
    r = {}
    for l in open('/proc/self/status'):
        if l.startswith(('RssAnon', 'RssFile', 'VmHWM')):
            r[l.split(':')[0]] = int(l.split()[1]) * 1024
    return r
def file_rss(path):
    # Resident bytes of the model file's own mappings (RssFile also counts the code of the
    # modules a load imports on first use, numpy's among them).
    total, ours = 0, False
    for l in open('/proc/self/smaps'):
        f = l.split()
        if f and '-' in f[0] and len(f) >= 5:
            ours = len(f) >= 6 and os.path.realpath(f[5]) == path
        elif ours and f[0] == 'Rss:':
            total += int(f[1]) * 1024
    return total
path = os.path.realpath(sys.argv[1])
before = rss()
m = d.load_model(sys.argv[1], mode=d.QuantMode[sys.argv[2]], n_threads=1)
after = rss()
print(after['RssAnon'] - before['RssAnon'], file_rss(path), after['VmHWM'] - before['VmHWM'])
"""


@pytest.mark.parametrize("mode", ["q8", "fp32"])
def test_load_holds_the_file_once(smollm2_path, mode):
    est = d.estimate_memory(str(smollm2_path), d.QuantMode[mode], n_ctx=256)
    out = subprocess.run([sys.executable, "-c", PROBE, str(smollm2_path), mode], capture_output=True, text=True,
                         check=True).stdout.split()
    anon, file_, hwm = (int(x) for x in out)
    # Packed (or converted) weights are the anonymous memory; the file's pages went back.
    assert file_ < 8 << 20, f"the model file's mapped pages kept after load: {file_ >> 20} MiB"
    assert anon < est.weights + (24 << 20), (anon >> 20, est.weights >> 20)
    if mode == "q8":  # the quantized image is about the file's size; fp32's larger one is expected
        assert est.weights < 1.05 * smollm2_path.stat().st_size
        assert hwm < est.weights + (40 << 20), "the load held a matrix twice"


def test_estimate_memory_grows_with_context(smollm2_path):
    small = d.estimate_memory(str(smollm2_path), d.QuantMode.q8, n_ctx=256)
    big = d.estimate_memory(str(smollm2_path), d.QuantMode.q8, n_ctx=4096)
    c = d.load_model(str(smollm2_path), n_threads=1).config
    assert big.kv == 16 * small.kv == c.n_layers * 2 * 4096 * c.n_kv_heads * c.head_size * 2  # f16 rows
    assert big.weights == small.weights and big.total > small.total
    assert d.estimate_memory(str(smollm2_path), d.QuantMode.fp32, 256).weights > 4 * small.weights
    assert small.available > 0 and small.fits


def test_what_does_not_fit_is_refused(smollm2_path):
    m = d.load_model(str(smollm2_path), n_threads=1)
    with pytest.raises(d.DeviceError, match="host memory is available"):
        d.KVPool(m, max_pages=1 << 26)
    s = d.create_session(m, n_ctx=64)  # the process goes on
    d.eval(m, s, [1, 2, 3])



def test_import_loads_only_what_text_needs():
    # numpy (~16 MB resident) and OpenSSL (hashlib, ~4 MB) count in every program's peak RSS:
    # a program that only generates text loads neither; the media, ASR and chat parts load on
    # first use, and their names still resolve.
    code = ("import sys, dasllama as d; print(sorted(m for m in ('numpy', '_hashlib', 'dasllama.audio', "
            "'dasllama.vision', 'dasllama.asr', 'dasllama.chat') if m in sys.modules)); "
            "print(d.ChatSession.__module__, d.load_audio.__module__, d.chat.render_prompt.__module__, "
            "'transcribe' in dir(d))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", out[0]
    assert out[1] == "dasllama.chat.turns dasllama.audio_io dasllama.chat.template True", out[1]
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        d.not_a_name  # noqa: B018

def test_generating_text_loads_only_what_text_needs(smollm2_path):
    # The same for a whole text program: load a GGUF, eval, sample (what bench_memory.py measures
    # against llama-simple). A module on the load path that imported numpy at its top (the
    # llama2.c reader did) put ~16 MB on every text program's peak RSS.
    code = ("import sys, dasllama as d; m = d.load_model(sys.argv[1], n_threads=1); "
            "s = d.create_session(m, n_ctx=64); d.eval(m, s, d.encode(m, 'Hello there')); "
            "d.eval(m, s, [d.sample(s)]); print(sorted(x for x in ('numpy', '_hashlib') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(smollm2_path)], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out


TOKENIZER_PROBE = """
import sys
from dasllama import _core
def anon():
    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssAnon'))
before = anon()
t = _core.Tokenizer.from_gguf(sys.argv[1])
print(anon() - before, t.n_vocab, len(t.encode('Hello world')))
"""


def test_tokenizer_holds_its_vocabulary_compactly(gemma3_path):
    """Gemma's 262k vocabulary (and its 515k SentencePiece merges, derived at load): one arena of
    bytes and flat tables, not three heap strings per token and node-based maps (~270 bytes a
    token, 68 MiB, before)."""
    out = subprocess.run([sys.executable, "-c", TOKENIZER_PROBE, str(gemma3_path)], capture_output=True, text=True,
                         check=True).stdout.split()
    anon, n_vocab = int(out[0]), int(out[1])
    assert n_vocab == 262144
    assert anon < 160 * n_vocab, f"tokenizer holds {anon >> 20} MiB"
