"""2D rotary positions for native-resolution patches.

Legend: T = packed patches (all images), H = heads, K = head dim (a multiple of 4).

Each head's K channels form K/2 consecutive pairs (channels 2m, 2m+1), each pair one complex number
rotated by an angle. Pair 2j turns with the patch's column x at frequency f_j, pair 2j+1 with its row y at
the same f_j, where f_j = theta^(-4j/K), j = 0 .. K/4 - 1. Positions restart at (0, 0) in every image, so
an image's attention depends on relative offsets inside it only, at any size or aspect ratio.
"""

from __future__ import annotations

import torch


def patch_positions(grid_hw: torch.Tensor) -> torch.Tensor:
    """[N, 2] (rows, cols) per image -> [T, 2] int64 (row y, column x) of each patch, raster order per image."""
    positions = []
    for rows, cols in grid_hw.tolist():
        ys = torch.arange(rows, device=grid_hw.device).repeat_interleave(cols)
        xs = torch.arange(cols, device=grid_hw.device).repeat(rows)
        positions.append(torch.stack([ys, xs], dim=-1))
    return torch.cat(positions)


def rope_angles(positions_T2: torch.Tensor, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[T, 2] (y, x) -> angles [T, K/2] in fp32: pair 2j = x·f_j, pair 2j+1 = y·f_j."""
    if head_dim % 4:
        raise ValueError(f"2D rotary positions need head_dim divisible by 4, got {head_dim}")
    freqs = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32, device=positions_T2.device) / head_dim)
    y = positions_T2[:, 0:1].float() * freqs      # [T, K/4]
    x = positions_T2[:, 1:2].float() * freqs
    return torch.stack([x, y], dim=-1).flatten(1)  # [T, K/2], interleaved x, y


def apply_rope_2d(x_THK: torch.Tensor, angles_TP: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair of x [T, H, K] by angles [T, K/2] (computed in fp32, cast back)."""
    cos = angles_TP.cos()[:, None, :]
    sin = angles_TP.sin()[:, None, :]
    pairs = x_THK.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).to(x_THK.dtype)
