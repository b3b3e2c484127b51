"""Vision chat example: a decoder GGUF and its vision tower (mmproj GGUF) look at an image and answer.

    python examples/vision_chat.py gemma-3-4b-it.gguf mmproj-gemma-3-4b-it.gguf photo.jpg ["What is in it?"]

Works for Gemma-3 pairs (llama.cpp's mmproj files load as they are). The image is encoded and
prefilled once: the follow-up question reuses it from the KV, and a second chat over the same pool
and prefix cache attaches it without running the tower.
"""
import sys

import dasllama as d


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    decoder, mmproj, image = argv[:3]
    question = argv[3] if len(argv) > 3 else "Describe this image."
    model = d.load_model(decoder)
    vision = d.load_vision_embedder(mmproj, device=model.device)  # its rows must be the decoder's width
    pool = d.create_kv_pool(model, page_rows=64)
    cache = d.create_prefix_cache()

    chat = d.create_chat(model, vision, max_new=128, pool=pool, cache=cache)
    d.add_user_image(chat, image, question)  # a path, bytes, a PIL image or an HxWx3 uint8 array
    for piece in d.stream_respond(model, chat):
        print(piece, end="", flush=True)
    print()
    d.add_user(chat, "Answer again in one short sentence.")  # the image is still in the KV
    print(d.respond(model, chat))
    print("first chat:", chat.media_stats)

    other = d.create_chat(model, vision, max_new=128, pool=pool, cache=cache)
    d.add_user_image(other, image, "What colours stand out?")
    print(d.respond(model, other))
    print("second chat:", other.media_stats, "tower cache:", d.media_cache_stats())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
