"""Pixel shuffle: each M x M block of neighbouring patches becomes one token of M·M·D features.

Legend: D = tower width, M = merge side. An image of R x C patches ([R·C, D] in raster order) gives
(R/M)·(C/M) tokens in raster order; token (i, j) holds patches (M·i + a, M·j + b) for a, b in 0..M-1,
concatenated row-major over (a, b). 3584² pixels at patch 14: 256² = 65,536 patches -> 128² = 16,384 tokens.
"""

from __future__ import annotations

import torch


def pixel_shuffle(x_TD: torch.Tensor, rows: int, cols: int, merge: int = 2) -> torch.Tensor:
    """[rows·cols, D] -> [(rows/M)·(cols/M), M·M·D] for one image."""
    if rows % merge or cols % merge:
        raise ValueError(f"a {rows} x {cols} patch grid does not divide into {merge} x {merge} blocks")
    if x_TD.shape[0] != rows * cols:
        raise ValueError(f"expected {rows} x {cols} = {rows * cols} patches, got {x_TD.shape[0]}")
    d = x_TD.shape[-1]
    return (x_TD.reshape(rows // merge, merge, cols // merge, merge, d)
            .permute(0, 2, 1, 3, 4).reshape((rows // merge) * (cols // merge), merge * merge * d))


def pixel_unshuffle(x_TF: torch.Tensor, rows: int, cols: int, merge: int = 2) -> torch.Tensor:
    """The inverse of ``pixel_shuffle``: [(rows/M)·(cols/M), M·M·D] -> [rows·cols, D]."""
    d = x_TF.shape[-1] // (merge * merge)
    return (x_TF.reshape(rows // merge, cols // merge, merge, merge, d)
            .permute(0, 2, 1, 3, 4).reshape(rows * cols, d))


def pixel_shuffle_packed(x_TD: torch.Tensor, grid_hw: torch.Tensor, merge: int = 2) -> torch.Tensor:
    """Packed images [sum rows·cols, D] -> packed tokens [sum (rows/M)·(cols/M), M·M·D], image by image."""
    out, start = [], 0
    for rows, cols in grid_hw.tolist():
        out.append(pixel_shuffle(x_TD[start:start + rows * cols], rows, cols, merge))
        start += rows * cols
    return torch.cat(out)
