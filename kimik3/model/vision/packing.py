"""Attention over several images packed in one sequence, kept inside each image.

Legend: T = packed patches, H = heads, K = head dim, N = images.

The images' patches are contiguous; ``cu_seqlens`` [N+1] (int64, starting at 0) marks where each begins,
as in varlen attention kernels. Attention is block-diagonal: a patch attends to every patch of its own
image (no causal mask) and to nothing else. Images of the same length run as one batched
``scaled_dot_product_attention`` call, so a batch of many images costs one call per distinct size, and
memory stays per image (one 3584² image is 65,536 patches: a dense T x T mask over a packed batch would
not fit). ``block_diagonal_attention_reference`` is the same thing with an explicit mask, for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cu_seqlens_from_grid(grid_hw: torch.Tensor) -> torch.Tensor:
    """[N, 2] patch grids -> [N+1] int64 cumulative patch counts."""
    lengths = grid_hw.prod(dim=-1).to(torch.int64)
    return F.pad(lengths.cumsum(0), (1, 0))


def packed_attention(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Softmax attention within each segment of ``cu_seqlens``; returns [T, H, K]."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q_THK.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the {q_THK.shape[0]} packed patches, got {bounds}")
    out = torch.empty_like(q_THK)
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    for length, starts in by_length.items():
        index = (torch.tensor(starts, device=q_THK.device)[:, None]
                 + torch.arange(length, device=q_THK.device)).flatten()
        q, k, v = (t.index_select(0, index).unflatten(0, (len(starts), length)).transpose(1, 2)
                   for t in (q_THK, k_THK, v_THK))       # [B, H, L, K]
        o = F.scaled_dot_product_attention(q, k, v)
        out.index_copy_(0, index, o.transpose(1, 2).flatten(0, 1))
    return out


def block_diagonal_attention_reference(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor,
                                       cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The same attention as one masked softmax over all T patches (fp32; O(T²) memory: tests only)."""
    segment = torch.bucketize(torch.arange(q_THK.shape[0]), cu_seqlens[1:], right=True)
    mask = segment[:, None] == segment[None, :]
    scores = torch.einsum("thk,shk->hts", q_THK.float(), k_THK.float()) * q_THK.shape[-1] ** -0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shk->thk", weights, v_THK.float()).to(q_THK.dtype)
