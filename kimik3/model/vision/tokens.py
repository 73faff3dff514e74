"""How many language-model tokens an image becomes, and the pixels the tower sees.

The rule (native resolution; patch P = 14, merge M = 2, so one LM token covers a 28 x 28 pixel cell):

1. **Resize only to fit the budget, keeping the aspect ratio; never upscale.** An image whose padded
   size would give more than ``max_tokens`` LM tokens (16,384 by default: one 3584 x 3584 image) is
   scaled down by the largest factor s <= 1 (searched in steps of 1%, after a first guess
   sqrt(budget x 28² / (H x W))) for which the rule below fits the budget; new sides
   ``max(1, floor(H·s))`` x ``max(1, floor(W·s))``. Every other image keeps its pixels.
2. **Pad, never crop**, at the bottom and right to the next multiple of 28 (in the normalised
   space the padding is 0, i.e. mid-grey).
3. Patches: ``ceil(H/28)·2`` x ``ceil(W/28)·2`` of 14 x 14 pixels, in raster order; the 2 x 2 pixel
   shuffle merges them into ``ceil(H/28) x ceil(W/28)`` LM tokens.

So ``num_image_tokens(3584, 3584) == 128 * 128 == 16384`` (256² = 65,536 patches, 1.6% of a 1M
context), ``num_image_tokens(1024, 1024) == 37 * 37``, ``num_image_tokens(100, 30) == 4 * 2``.

Pixel values: ``preprocess_image`` takes uint8 [H, W, 3] (RGB), scales to [0, 1] and normalises with
mean 0.5, std 0.5 (to [-1, 1]); the patch vector is (channel, row, column) flattened, the layout of
the released conv patch embedding's [D, 3, P, P] weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PATCH_SIZE = 14
MERGE_SIZE = 2
MAX_IMAGE_TOKENS = 16_384


def _check_size(height: int, width: int) -> None:
    for name, value in (("height", height), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"image {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"image {name} must be >= 1 pixel, got {value} (a zero-size image has no tokens)")


def _tokens(height: int, width: int, unit: int) -> int:
    return math.ceil(height / unit) * math.ceil(width / unit)


def fit_size(height: int, width: int, *, patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
             max_tokens: int = MAX_IMAGE_TOKENS) -> tuple[int, int]:
    """The (height, width) an image is resized to before padding (step 1 of the module's rule)."""
    _check_size(height, width)
    unit = patch_size * merge_size
    if _tokens(height, width, unit) <= max_tokens:
        return height, width
    scale = min(1.0, math.sqrt(max_tokens * unit * unit / (height * width)))
    while True:
        h, w = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
        if _tokens(h, w, unit) <= max_tokens:
            return h, w
        if h == 1 and w == 1:   # max_tokens >= 1, so a single pixel always fits
            return h, w
        scale *= 0.99


def image_grid(height: int, width: int, *, patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
               max_tokens: int = MAX_IMAGE_TOKENS) -> tuple[int, int]:
    """The patch grid (rows, columns) of an image of ``height`` x ``width`` pixels after the rule."""
    h, w = fit_size(height, width, patch_size=patch_size, merge_size=merge_size, max_tokens=max_tokens)
    unit = patch_size * merge_size
    return math.ceil(h / unit) * merge_size, math.ceil(w / unit) * merge_size


def num_image_tokens(height: int, width: int, *, patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
                     max_tokens: int = MAX_IMAGE_TOKENS) -> int:
    """Language-model tokens of one ``height`` x ``width`` image (see the module's rule): 3584² -> 16,384."""
    rows, cols = image_grid(height, width, patch_size=patch_size, merge_size=merge_size, max_tokens=max_tokens)
    return (rows // merge_size) * (cols // merge_size)


def preprocess_image(image: torch.Tensor, *, patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
                     max_tokens: int = MAX_IMAGE_TOKENS) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 [H, W, 3] RGB -> (patches [rows·cols, 3·P·P] float32 in raster order, (rows, cols)).

    Raises TypeError for another dtype, ValueError for another shape or an empty image."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a torch.Tensor (uint8 [H, W, 3]), got {type(image).__name__}")
    if image.dtype != torch.uint8:
        raise TypeError(f"image must be uint8 [H, W, 3] (RGB), got dtype {image.dtype}")
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be [H, W, 3] (RGB), got shape {tuple(image.shape)}")
    height, width = int(image.shape[0]), int(image.shape[1])
    _check_size(height, width)
    h, w = fit_size(height, width, patch_size=patch_size, merge_size=merge_size, max_tokens=max_tokens)
    pixels_CHW = image.permute(2, 0, 1).float().div(255.0)
    if (h, w) != (height, width):
        pixels_CHW = F.interpolate(pixels_CHW[None], size=(h, w), mode="bilinear", antialias=True,
                                   align_corners=False)[0].clamp(0.0, 1.0)
    pixels_CHW = (pixels_CHW - 0.5) / 0.5
    unit = patch_size * merge_size
    pad_h, pad_w = -h % unit, -w % unit
    pixels_CHW = F.pad(pixels_CHW, (0, pad_w, 0, pad_h), value=0.0)
    rows, cols = (h + pad_h) // patch_size, (w + pad_w) // patch_size
    patches = (pixels_CHW.reshape(3, rows, patch_size, cols, patch_size)
               .permute(1, 3, 0, 2, 4).reshape(rows * cols, 3 * patch_size * patch_size))
    return patches.contiguous(), (rows, cols)


def pack_images(images: list[torch.Tensor], **rule) -> tuple[torch.Tensor, torch.Tensor]:
    """Several uint8 [H, W, 3] images -> (pixel_values [sum rows·cols, 3·P·P], image_grid_hw [N, 2] int64),
    the encoder's packed input (each image's patches contiguous, in list order)."""
    if not images:
        raise ValueError("pack_images needs at least one image")
    patches, grids = zip(*(preprocess_image(image, **rule) for image in images))
    return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)
