"""Helpers for packed variable-length batches described by ``cu_seqlens`` ([N+1] offsets)."""

from __future__ import annotations

import torch


def sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Which packed sequence each of ``total`` tokens belongs to, [total] int64."""
    token = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], token, right=True)


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's 0-based position inside its own sequence, [total] int64."""
    token = torch.arange(total, device=cu_seqlens.device)
    return token - cu_seqlens[sequence_ids(cu_seqlens, total)]
