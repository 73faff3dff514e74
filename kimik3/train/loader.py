"""Batches of training windows drawn from a token stream, as a pure function of (seed, step).

Legend: B = batch size, T = sequence length.

A batch is B random windows of T+1 tokens (inputs and their next-token labels). The offsets come
from a generator seeded with (seed, step), so the data position is the step number itself:
resuming at step s reproduces exactly the batches an uninterrupted run would have seen, with no
iterator state to save. Documents are joined with EOS; windows may span a boundary, and the EOS
tells the model where one file ends.
"""

from __future__ import annotations

import numpy as np
import torch

_STEP_MIX = 0x9E3779B97F4A7C15  # spreads consecutive steps over unrelated generator seeds


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _STEP_MIX + step) % (2**63))


def batch_at(stream: np.ndarray, step: int, seed: int, batch_size: int,
             seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of ``step``: (input_ids [B, T], labels [B, T]) int64."""
    if stream.shape[0] < seq_len + 2:
        raise ValueError(f"token stream of {stream.shape[0]} tokens is shorter than one window of {seq_len + 1}")
    starts = torch.randint(0, stream.shape[0] - seq_len - 1, (batch_size,), generator=_generator(seed, step))
    rows = np.stack([stream[s: s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    window = torch.from_numpy(rows)
    return window[:, :-1], window[:, 1:]


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, evenly spaced validation windows (the same every evaluation): ([W, T], [W, T])."""
    usable = (stream.shape[0] - 1) // seq_len
    if usable < 1:
        raise ValueError(f"validation stream of {stream.shape[0]} tokens is shorter than one window of {seq_len + 1}")
    count = min(max_windows, usable)
    starts = np.linspace(0, (usable - 1) * seq_len, count).astype(np.int64)
    rows = np.stack([stream[s: s + seq_len + 1] for s in starts]).astype(np.int64)
    window = torch.from_numpy(rows)
    return window[:, :-1], window[:, 1:]
