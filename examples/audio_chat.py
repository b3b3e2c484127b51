"""Audio chat example: a decoder GGUF and its audio tower (mmproj GGUF) hear a clip and answer about it.

    python examples/audio_chat.py decoder.gguf mmproj.gguf clip.wav ["What is said?"]

Works for Qwen2-Audio, Qwen2.5-Omni (audio), Voxtral and Ultravox pairs: the framing of the clip
in the prompt follows the tower's family. The clip is encoded and prefilled once: the follow-up
question reuses it from the KV, and a second chat over the same pool and prefix cache attaches it.
"""
import sys

import dasllama as d


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    decoder, mmproj, clip = argv[:3]
    question = argv[3] if len(argv) > 3 else "What is being said in this audio?"
    model = d.load_model(decoder)
    tower = d.load_audio_tower(mmproj)  # its rows must be the decoder's width (create_chat checks)
    pool = d.create_kv_pool(model, page_rows=64)
    cache = d.create_prefix_cache()

    chat = d.create_chat(model, tower, max_new=128, pool=pool, cache=cache)
    d.add_user_audio(chat, clip)  # a path, bytes, or float32 16 kHz mono samples
    d.add_user(chat, question)
    for piece in d.stream_respond(model, chat):
        print(piece, end="", flush=True)
    print()
    d.add_user(chat, "Answer again in one short sentence.")  # the clip is still in the KV
    print(d.respond(model, chat))
    print("first chat:", chat.media_stats)

    # A new conversation about the same clip: the prefix cache holds its span, the tower cache its rows.
    other = d.create_chat(model, tower, max_new=128, pool=pool, cache=cache)
    d.add_user_audio(other, clip, "Who might be speaking?")
    print(d.respond(model, other))
    print("second chat:", other.media_stats, "tower cache:", d.audio_cache_stats())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
