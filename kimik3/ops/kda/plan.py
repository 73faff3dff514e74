"""The host side of the chunked KDA kernels: which chunks of which sequences every launch walks, and small launch
helpers shared by the Triton stages.

Every call is treated as packed: B rows of T tokens are the sequences [b T, (b + 1) T); with ``cu_seqlens`` (B == 1)
the sequences are the given segments. A sequence of L tokens has ceil(L / C) chunks of C tokens (the last partial);
the kernels index per-chunk buffers [NT, ...] by the global chunk.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

BT = 64  # chunk size (tokens) of the chunked kernels

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # (set by Triton's own interpreter switch)


def scratch(shape: tuple, device: torch.device) -> torch.Tensor:
    """An fp32 buffer the kernels write in full before anything reads it. Under the interpreter (the tests) it
    starts as NaN, so a kernel change that leaves part of it unwritten fails the tests instead of reading the zeros
    of a fresh page."""
    if INTERPRET:
        return torch.full(shape, float("nan"), device=device)
    return torch.empty(shape, device=device, dtype=torch.float32)


def next_pow2(x: int) -> int:
    """The power of two >= x (at least 16): a Triton block over x elements."""
    return max(16, triton.next_power_of_2(int(x)))


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype of tl.dot operands for inputs of ``dtype`` (16-bit inputs: 16-bit operands; fp32: fp32)."""
    return tl.bfloat16 if dtype == torch.bfloat16 else (tl.float16 if dtype == torch.float16 else tl.float32)


class ChunkPlan(NamedTuple):
    cu: torch.Tensor  # [N + 1] int32 token offsets (packed)
    chunk_idx: torch.Tensor  # [NT, 2] int32: (sequence, chunk within sequence)
    chunk_off: torch.Tensor  # [N + 1] int32: first global chunk of each sequence
    N: int
    NT: int
    seq_lens: Tuple[int, ...]
    offsets: Tuple[int, ...]  # cu, on the host

    def tiles(self, size: int) -> "ChunkPlan":
        """The same sequences' plan in chunks of ``size`` tokens (``prep16``'s 16-token tiles)."""
        return _plan_cached(self.offsets, self.cu.device, size)

    def covers(self, n_tokens: int) -> bool:
        """Whether the plan's sequences hold all n_tokens tokens (B * T), so that kernels writing every token of
        every chunk leave no element of a [B, T, ...] output unwritten (no zero fill needed)."""
        return sum(self.seq_lens) == n_tokens


@functools.lru_cache(maxsize=64)
def _plan_cached(offsets: Tuple[int, ...], device: torch.device, size: int = BT) -> ChunkPlan:
    lens = tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    idx, off = [], [0]
    for n, L in enumerate(lens):
        nc = (L + size - 1) // size
        idx.extend((n, c) for c in range(nc))
        off.append(off[-1] + nc)
    ci = torch.tensor(idx if idx else [[0, 0]], dtype=torch.int32).view(-1, 2)
    return ChunkPlan(
        torch.tensor(offsets, dtype=torch.int32, device=device),
        ci.to(device),
        torch.tensor(off, dtype=torch.int32, device=device),
        len(lens),
        len(idx),
        lens,
        offsets,
    )


def make_plan(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device, size: int = BT) -> ChunkPlan:
    """The sequences' chunks of ``size`` tokens (the forward's 64; the 16-token tiles of ``prep16``)."""
    if cu_seqlens is None:
        offsets = tuple(b * T for b in range(B + 1))
    else:
        offsets = tuple(int(x) for x in cu_seqlens.tolist())
    return _plan_cached(offsets, device, size)

