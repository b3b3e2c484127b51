"""Vision towers (reference §17.1.9 and the VisionImage / VisionEmbedder / VisionState types): an
image in, soft-token rows out.

Files are llama.cpp-layout mmproj GGUFs (``clip.vision.*`` keys, ``v.*`` / ``mm.*`` tensors), as
llama.cpp's ``convert_hf_to_gguf.py --mmproj`` writes them. Families: ``gemma3v`` (Gemma-3's
SigLIP tower with its pooled projector; its rows are one non-causal span in the decoder) and
``qwen25v`` (Qwen2.5-VL's window-attention ViT at the image's own size, then the patch merger; its
rows are causal and take M-RoPE grid positions in the decoder: ``eval_embd_span_mrope``) and
``qwen3v`` (Qwen3-VL's ViT with resampled learned positions and deepstack mergers, whose features
the decoder adds after its first layers; interleaved M-RoPE).

Images are decoded with Pillow (the optional extra ``dasllama[vision]``): JPEG, PNG, WebP, GIF
(first frame), EXIF orientation applied. Each family's preprocessing follows its transformers
image processor (gemma3v: a bilinear resize to the tower's square; qwen25v: a bicubic resize to the
nearest multiple of 28 pixels a side within ``min_pixels`` / ``max_pixels`` (Qwen2-VL's smart_resize);
then (x / 255 - mean) / std).
An embedder may be shared by threads (encodes on one embedder are serialized). This module knows
no chat: the chat layer splices the rows (``proj_dim`` wide, the decoder's embedding width).
"""
from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from . import _core
from ._core import UnsupportedModelError

PathLike = Union[str, "os.PathLike[str]"]

FAMILIES = tuple(_core.VisionEncoder.families())
# Images larger than this many pixels are refused before they are decoded (a decompression
# bomb is a small file that claims a huge image); the file itself is capped at MAX_IMAGE_BYTES.
MAX_IMAGE_PIXELS = 64 << 20
MAX_IMAGE_BYTES = 64 << 20
# Qwen2-VL's image processor defaults (its preprocessor_config's min_pixels / max_pixels).
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
# Qwen3-VL's (its preprocessor_config's size: shortest_edge / longest_edge).
QWEN3_MIN_PIXELS = 65536
QWEN3_MAX_PIXELS = 16777216
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """Qwen2-VL's target size: sides multiples of ``factor``, the area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as that allows (transformers' smart_resize)."""
    import math

    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class ImageError(ValueError):
    """An image that cannot be used: unreadable, truncated, of a format we do not decode, or too large."""


def _pil():
    try:
        from PIL import Image, ImageOps
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ImportError("images need Pillow: pip install 'dasllama[vision]' (or pip install pillow)") from None
    return Image, ImageOps


@dataclass(eq=False)
class VisionImage:
    """A decoded RGB8 image: ``width``, ``height`` and ``rgb``, a (height, width, 3) uint8 array."""

    width: int
    height: int
    rgb: np.ndarray

    def __repr__(self) -> str:
        return f"VisionImage({self.width}x{self.height})"

    def content_key(self) -> bytes:
        h = hashlib.blake2b(digest_size=20, person=b"dasllama-image")
        h.update(f"{self.width}x{self.height}|".encode())
        h.update(np.ascontiguousarray(self.rgb).tobytes())
        return h.digest()


def _from_array(a) -> VisionImage:
    x = np.asarray(a)
    if x.dtype != np.uint8:
        raise ImageError(f"an image array must be uint8 (H x W x 3 RGB), got dtype {x.dtype}")
    if x.ndim != 3 or x.shape[2] != 3:
        raise ImageError(f"an image array must be H x W x 3 (RGB), got shape {x.shape}")
    h, w = int(x.shape[0]), int(x.shape[1])
    if h < 1 or w < 1:
        raise ImageError(f"the image is empty ({w}x{h})")
    if h * w > MAX_IMAGE_PIXELS:
        raise ImageError(f"the image has {w}x{h} pixels, over the limit of {MAX_IMAGE_PIXELS}")
    return VisionImage(w, h, np.ascontiguousarray(x))


def load_image_rgb(src, max_pixels: Optional[int] = None) -> VisionImage:
    """Decode ``src`` -- a path, the bytes of an image file, a PIL image, an H x W x 3 uint8 array or a
    VisionImage -- into a VisionImage. Files are JPEG, PNG, WebP or GIF (its first frame), with EXIF
    orientation applied. Raises :class:`ImageError` for anything unreadable, empty or over ``max_pixels``."""
    limit = MAX_IMAGE_PIXELS if max_pixels is None else int(max_pixels)
    if isinstance(src, VisionImage):
        return src
    if isinstance(src, np.ndarray):
        return _from_array(src)
    Image, ImageOps = _pil()
    if isinstance(src, Image.Image):
        im, opened = src, None
    else:
        if isinstance(src, (bytes, bytearray, memoryview)):
            data = bytes(src)
            if len(data) > MAX_IMAGE_BYTES:
                raise ImageError(f"the image file is {len(data)} bytes, over the limit of {MAX_IMAGE_BYTES}")
            fp = io.BytesIO(data)
            what = "image bytes"
        elif isinstance(src, (str, os.PathLike)):
            path = os.fspath(src)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no such image file: {path}")
            if os.path.getsize(path) > MAX_IMAGE_BYTES:
                raise ImageError(f"{path} is over the limit of {MAX_IMAGE_BYTES} bytes")
            fp = open(path, "rb")
            what = path
        else:
            raise TypeError(f"an image is a path, bytes, a PIL image or an HxWx3 uint8 array, not {type(src).__name__}")
        try:
            try:
                opened = Image.open(fp, formats=("JPEG", "PNG", "WEBP", "GIF"))
            except Image.DecompressionBombError as e:
                raise ImageError(f"{what}: the image is over the limit of pixels Pillow decodes ({e})") from None
            except Exception as e:  # noqa: BLE001 - PIL raises many types for bad files
                raise ImageError(f"{what}: not a JPEG, PNG, WebP or GIF image ({type(e).__name__}: {e})") from None
            im = opened
        except BaseException:
            fp.close()
            raise
    try:
        w, h = im.size
        if w < 1 or h < 1:
            raise ImageError(f"the image is empty ({w}x{h})")
        if w * h > limit:  # checked on the header, before any pixel is decoded
            raise ImageError(f"the image has {w}x{h} pixels, over the limit of {limit}")
        if im.mode in ("I", "F") or im.mode.startswith("I;"):
            # Pillow's convert("RGB") clips 16-bit and integer samples at 255 and truncates floats: the
            # picture would come out near white or black. Refused rather than silently wrong.
            raise ImageError(f"the image's mode {im.mode!r} has samples wider than 8 bits "
                             "(16-bit, 32-bit or float grayscale); convert it to 8-bit RGB first")
        try:
            if getattr(im, "n_frames", 1) > 1:
                im.seek(0)
            im.load()
            im = ImageOps.exif_transpose(im)
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
        except ImageError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated data, bad EXIF, unsupported mode
            raise ImageError(f"the image could not be decoded ({type(e).__name__}: {e})") from None
    finally:
        if opened is not None:
            opened.close()
    return _from_array(rgb)


class VisionState:
    """Caller-owned scratch for ``encode_image`` (the reference's type); holds no image state."""

    def __repr__(self) -> str:
        return "VisionState()"


class VisionEmbedder:
    """A loaded vision tower of whatever family the mmproj turned out to be."""

    def __init__(self, enc: "_core.VisionEncoder", min_pixels: Optional[int] = None,
                 max_pixels: Optional[int] = None):
        self._enc = enc
        c = enc.config
        self.family: str = c["family"]
        self.image_size: int = c["image_size"]
        self.dim: int = c["dim"]
        self.n_layers: int = c["n_layers"]
        self.proj_dim: int = c["proj_dim"]
        self.n_rows: int = c["n_rows"]  # rows per image (0: the image's size decides, see image_grid)
        self.non_causal: bool = c["non_causal"]  # the rows attend each other in the decoder
        self.mrope: bool = c["mrope"]  # the rows take M-RoPE grid positions (eval_embd_span_mrope)
        # Deepstack mergers (qwen3v): each row carries n_deepstack more proj_dim-wide features after its
        # first proj_dim, for the decoder's first layers (eval_embd_span_mrope's deepstack)
        self.n_deepstack: int = c["n_deepstack"]
        self.row_width: int = self.proj_dim * (1 + self.n_deepstack)
        self.patch_size: int = c["patch_size"]
        self.merge: int = c["merge"]
        self.image_mean = tuple(c["image_mean"])
        self.image_std = tuple(c["image_std"])
        # A variable-size tower's pixel budget (Qwen2-VL's processor defaults unless given).
        q3 = self.family == "qwen3v"
        self.min_pixels: int = int(min_pixels) if min_pixels is not None else (QWEN3_MIN_PIXELS if q3 else QWEN_MIN_PIXELS)
        self.max_pixels: int = int(max_pixels) if max_pixels is not None else (QWEN3_MAX_PIXELS if q3 else QWEN_MAX_PIXELS)
        if self.mrope and not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels} make no range")
        self.path: str = enc.path

    @property
    def vision_proj_dim(self) -> int:
        return self.proj_dim

    @property
    def encoder_key(self) -> int:
        """Names the loaded encoder (not its file): the key of caches of its outputs (chat.media.RowCache)."""
        return id(self._enc)

    @property
    def config(self) -> dict:
        return dict(self._enc.config)

    def image_grid(self, image) -> tuple:
        """(grid_h, grid_w): the image's rows as a grid (row-major), after the family's resize."""
        img = load_image_rgb(image)
        if not self.mrope:
            side = int(round(self.n_rows ** 0.5))
            return (side, self.n_rows // side)
        unit = self.patch_size * self.merge
        h, w = smart_resize(img.height, img.width, unit, self.min_pixels, self.max_pixels)
        return (h // unit, w // unit)

    def image_rows(self, image) -> int:
        """How many rows ``image`` makes."""
        gh, gw = self.image_grid(image)
        return gh * gw

    def pixel_values(self, image) -> np.ndarray:
        """The tower's input for ``image``: float32 (3, H, W), as the family's transformers processor makes
        it (gemma3v: PIL bilinear resize to S x S; qwen25v: PIL bicubic resize to smart_resize's size;
        then rescale by 1/255, normalize by the file's mean / std)."""
        img = load_image_rgb(image)
        Image, _ = _pil()
        im = Image.fromarray(img.rgb, "RGB")
        if self.mrope:
            unit = self.patch_size * self.merge
            H, W = smart_resize(img.height, img.width, unit, self.min_pixels, self.max_pixels)
            resample = Image.BICUBIC
        else:
            H = W = self.image_size
            resample = Image.BILINEAR
        if (img.width, img.height) != (W, H):
            im = im.resize((W, H), resample)
        x = np.asarray(im, dtype=np.float32) * np.float32(1 / 255)
        x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)

    def image_key(self, image: VisionImage) -> str:
        """The content key of an image as this embedder sees it (its pixels plus what shapes its rows)."""
        h = hashlib.blake2b(digest_size=20, person=b"dasllama-vision")
        h.update(f"{self.family}|{self.path}|{self.proj_dim}|{self.n_rows}|{self.min_pixels}|{self.max_pixels}|".encode())
        h.update(image.content_key())
        return "image:" + h.hexdigest()

    def __repr__(self) -> str:
        return (f"VisionEmbedder(family={self.family!r}, image_size={self.image_size}, dim={self.dim}, "
                f"layers={self.n_layers}, rows={self.n_rows}, proj_dim={self.proj_dim}, "
                f"path={os.path.basename(self.path)!r})")


def load_vision_embedder(path: PathLike, n_threads: int = 0, device: Optional[str] = None,
                         min_pixels: Optional[int] = None, max_pixels: Optional[int] = None) -> VisionEmbedder:
    """Loads the vision tower of an mmproj GGUF, whatever family it is (UnsupportedModelError when
    the file holds none we serve). ``device`` as for :func:`~dasllama.load_model`. ``min_pixels`` /
    ``max_pixels``: a variable-size tower's (qwen25v) resize budget, as its processor's."""
    from .llm import resolve_device

    return VisionEmbedder(_core.VisionEncoder(os.fspath(path), int(n_threads), resolve_device(device)),
                          min_pixels, max_pixels)


def vision_probe_family(path: PathLike) -> str:
    """The vision family ``load_vision_embedder(path)`` would load, or "" when the file holds none we serve."""
    return _core.VisionEncoder.probe_family(os.fspath(path))


def encode_image(embedder: VisionEmbedder, scratch: Optional[VisionState], img, tag: str = "",
                 out: Optional[np.ndarray] = None) -> int:
    """The whole image path in one call -- decode if needed, resize, normalize, encode -- into ``out``,
    a writable C-contiguous float32 array with room for ``n_rows * proj_dim`` floats; returns npos.
    ``tag`` is accepted for the reference's signature (it names a debug dump there). GIL released."""
    if not isinstance(embedder, VisionEmbedder):
        raise TypeError("encode_image takes a VisionEmbedder")
    if scratch is not None and not isinstance(scratch, VisionState):
        raise TypeError("scratch must be a VisionState")
    if not isinstance(out, np.ndarray):
        raise TypeError("out must be a numpy float32 array")
    px = embedder.pixel_values(img)
    if embedder.mrope:
        return embedder._enc.encode_hw(px, out)
    return embedder._enc.encode(px, out)


def encode_image_rows(embedder: VisionEmbedder, img, scratch: Optional[VisionState] = None) -> np.ndarray:
    """``encode_image`` into a fresh float32 array of shape ``(rows, row_width)`` (the image's
    ``image_rows``: ``n_rows`` for a fixed-size tower; ``row_width`` is ``proj_dim`` but for deepstack
    towers, whose rows carry the deepstack features after it)."""
    img = load_image_rgb(img)
    out = np.empty((embedder.image_rows(img), embedder.row_width), np.float32)
    n = encode_image(embedder, scratch, img, "", out)
    return out[:n]


__all__ = [
    "ImageError", "VisionEmbedder", "VisionImage", "VisionState", "encode_image", "encode_image_rows",
    "load_image_rgb", "load_vision_embedder", "smart_resize", "vision_probe_family",
]
