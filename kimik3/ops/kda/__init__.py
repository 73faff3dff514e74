"""Kimi Delta Attention (KDA) operators.

Public API:
    naive_recurrent_kda  float32 token-loop reference (the oracle).
    chunk_kda            chunkwise-parallel path used for training / prefill.
    recurrent_kda_step   one-token update used for decoding.

Layout follows fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
states [N, H, K, V] float32. See ``naive.py`` for the recurrence and
``chunk.py`` for the chunkwise algorithm and the gate-bound contract.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk import SUBTILE, chunk_kda_torch
from .naive import naive_recurrent_kda, recurrent_kda_step

__all__ = ["chunk_kda", "naive_recurrent_kda", "recurrent_kda_step", "chunk_kda_torch", "SUBTILE"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunkwise KDA; arguments and returns as ``chunk.chunk_kda_torch``.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: optional [N, H, K, V]; cu_seqlens: optional [N + 1] ints
    (B == 1). Returns o [B, T, H, V] (v's dtype) and the final state
    [N, H, K, V] float32 (None unless output_final_state).
    """
    # Single backend dispatch point: a fused CUDA kernel will be selected here
    # (by device) once it exists; until then every device runs the torch path.
    return chunk_kda_torch(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
    )
