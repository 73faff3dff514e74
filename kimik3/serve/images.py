"""Images in chat requests: OpenAI ``image_url`` parts decoded, checked and made into the vision tower's input.

A part's URL must be a ``data:`` URL holding a PNG or JPEG in base64 (``data:image/png;base64,...``); remote
``http(s)://`` URLs are refused (the server fetches nothing on a client's behalf). Every refusal is an
``ImageError`` (a ``ValueError``; the server answers it with a 400 naming the part), raised before the costly
step it guards:

- the URL: not a ``data:`` URL, a MIME type other than ``image/png`` / ``image/jpeg`` (``image/jpg`` accepted),
  not base64, or more than ``ImageLimits.max_bytes`` bytes once decoded (checked from its length first);
- the file: empty, neither PNG nor JPEG whatever the MIME type said (only those two decoders ever run), a side of
  0 pixels, more than ``max_pixels`` pixels (read from the header, before any pixel is decompressed: a
  decompression bomb is refused without being inflated), truncated or corrupt.

The pixels are converted to RGB (alpha dropped, palettes expanded) and handed to the tower's preprocessing, the
function training uses (``kimik3.model.vision.tokens.preprocess_image``: resize to the token budget, pad to the
28-pixel grid, patchify), under the engine's ``ImageRule`` (the model's patch, merge and token budget). The image
then becomes ``num_tokens`` placeholders in the prompt and a ``digest`` that names its content in the prefix
cache's keys (``kimik3.serve.multimodal``).

Pillow is the [serve] extra's decoder; without it the error says what to install.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kimik3.extras import MissingExtra

MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII)


class ImageError(ValueError):
    """An image part the server refuses (HTTP 400); the message names the problem."""


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one image may be (``create_app(image_limits=...)``)."""

    max_bytes: int = 20 * 2**20          # the decoded file, as OpenAI's limit per image
    max_pixels: int = 50_000_000         # width x height from the header (a 7071² image; ~150 MB as RGB)
    max_images: int = 16                 # image parts per request

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_images"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ImageLimits.{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class ImageRule:
    """How a model turns pixels into tokens: its tower's patch and merge sides, the token budget per image, and
    the prompt's placeholder id (``K3VLForCausalLM.image_token_id``)."""

    patch_size: int
    merge_size: int
    max_tokens: int
    image_token_id: int

    @classmethod
    def of(cls, config: Any) -> "ImageRule | None":
        """The rule of a ``K3Config``; None for a text-only model."""
        if config.vision is None:
            return None
        from kimik3.model.vision.model import image_token_id

        v = config.vision
        return cls(v.patch_size, v.merge_size, v.max_image_tokens, image_token_id(config))


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImage:
    """One image as the engine takes it: the tower's packed input and what the prompt and the cache need."""

    pixel_values: torch.Tensor      # [rows·cols, 3·P·P] float32, raster order (``preprocess_image``)
    grid: tuple[int, int]           # (rows, cols) of patches
    num_tokens: int                 # placeholders in the prompt: rows·cols / merge²
    digest: bytes                   # sha256 of the pixels, their size and the rule: the cache key's share


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as err:
        raise MissingExtra("images in chat requests", "serve", err.name or "PIL") from None
    return Image


def decode_data_url(url: Any, limits: ImageLimits = ImageLimits()) -> bytes:
    """The file bytes of a ``data:image/png|jpeg;base64,...`` URL; ``ImageError`` for anything else."""
    if not isinstance(url, str):
        raise ImageError(f"image_url.url must be a string, got {type(url).__name__}")
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise ImageError("remote image URLs are not fetched by this server: send the image inline as a data URL "
                         "(data:image/png;base64,... or data:image/jpeg;base64,...)")
    match = DATA_URL.match(url[:256])
    if not head.startswith("data:") or match is None:
        raise ImageError("image_url.url must be a data URL (data:image/png;base64,... or "
                         f"data:image/jpeg;base64,...), got one starting {url[:24]!r}")
    mime = match["mime"].strip().lower()
    if mime not in MIME_TYPES:
        raise ImageError(f"unsupported image type {mime or '(none)'!r}: only image/png and image/jpeg are accepted")
    if "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise ImageError("the image data URL must be base64-encoded (data:image/png;base64,...)")
    payload = url[match.end():]
    if len(payload) // 4 * 3 > limits.max_bytes + 3:
        raise ImageError(f"the image is larger than this server's limit of {limits.max_bytes:,} bytes "
                         f"(about {len(payload) // 4 * 3:,} bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data URL is not valid base64") from None
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is larger than this server's limit of {limits.max_bytes:,} bytes "
                         f"({len(data):,} bytes)")
    return data


def _check_size(width: int, height: int, limits: ImageLimits) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"the image has zero size ({width} x {height} pixels)")
    if width * height > limits.max_pixels:
        raise ImageError(f"the image has {width} x {height} = {width * height:,} pixels, more than this server's "
                         f"limit of {limits.max_pixels:,}")


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> np.ndarray:
    """PNG or JPEG file bytes -> uint8 RGB [H, W, 3]; ``ImageError`` for a file refused (see the module notes)."""
    Image = _pil()
    if data[:8] == PNG_SIGNATURE and len(data) >= 24:   # the header's size (Pillow refuses a zero side unsaid)
        _check_size(*struct.unpack(">II", data[16:24]), limits)
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
    except Image.DecompressionBombError as err:   # Pillow's own bound, far above ours: reached by huge headers
        raise ImageError(f"the image has more pixels than this server's limit of {limits.max_pixels:,} "
                         f"({err})") from None
    except (OSError, SyntaxError, ValueError):
        raise ImageError("the image is neither a PNG nor a JPEG file (or its header is corrupt)") from None
    with image:
        width, height = image.size
        _check_size(width, height, limits)
        try:
            image.load()
            rgb = image.convert("RGB")
        except (OSError, SyntaxError, ValueError, EOFError) as err:
            raise ImageError(f"the image file is truncated or corrupt ({err})") from None
    return np.array(rgb, dtype=np.uint8).reshape(height, width, 3)


def image_digest(rgb: np.ndarray, rule: ImageRule) -> bytes:
    """sha256 of an RGB image's size, pixels and the rule that tokenises it: equal digests, equal tower input."""
    h = hashlib.sha256(b"kimik3-image-v1:%d,%d,%d,%d,%d" % (*rgb.shape[:2], rule.patch_size, rule.merge_size,
                                                            rule.max_tokens))
    h.update(np.ascontiguousarray(rgb).data)
    return h.digest()


def prepare_image(rgb: np.ndarray, rule: ImageRule) -> PreparedImage:
    """uint8 RGB [H, W, 3] -> the tower's input under ``rule``, by training's own preprocessing."""
    from kimik3.model.vision.tokens import preprocess_image

    pixels, grid = preprocess_image(torch.from_numpy(np.ascontiguousarray(rgb)), patch_size=rule.patch_size,
                                    merge_size=rule.merge_size, max_tokens=rule.max_tokens)
    tokens = grid[0] * grid[1] // (rule.merge_size * rule.merge_size)
    return PreparedImage(pixels, grid, tokens, image_digest(rgb, rule))


def load_image_url(url: Any, rule: ImageRule, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    """An ``image_url`` part's URL -> ``PreparedImage``; ``ImageError`` names what is wrong with it."""
    return prepare_image(decode_image(decode_data_url(url, limits), limits), rule)


__all__ = ["ImageError", "ImageLimits", "ImageRule", "PreparedImage", "decode_data_url", "decode_image",
           "image_digest", "load_image_url", "prepare_image"]
