"""Chunk layout for ``chunk.py``: packed [B, T, H, D] tokens <-> chunk-major [n * H, C, D] float32,
the varlen plan, and the constants of the 16-token sub-tile bound (see ``chunk.py``'s docstring)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch

# Rows of one intra-chunk sub-tile. With gates >= g_min = -5, 16 tokens
# accumulate at most -80 in log space, so every factor built against a tile
# reference stays within [e^-80, e^80]: finite and normal in float32. Larger
# tiles break the bound (32 tokens -> e^160); smaller ones only add overhead.
SUBTILE = 16

# exp() of a float32 below ~-87.3 is subnormal or zero, and torch's CPU
# vectorised exp falls back to a ~10-30x slower path there. Exponents of
# factors that only ever *shrink* a term (all <= 1) are floored here: e^-80 is
# far below float32 resolution of the order-one terms they are summed with.
_LOG_FLOOR = -80.0
_LOG2E = 1.0 / math.log(2.0)
_LOG2_FLOOR = _LOG_FLOOR * _LOG2E  # the same floor in base 2


class _Layout(NamedTuple):
    """Where every packed token goes among the padded chunks, and back.

    Chunks are ordered step-major: all sequences' chunk 0, then chunk 1, ...
    Sequences are sorted by chunk count (descending) so the sequences still
    running at step j are always a prefix; the sequential loop then works on
    contiguous slices with no per-step gathers.
    """

    gather_nHC: torch.Tensor  # index into [(P + 1) * H] rows; pad token = P
    scatter_PH: torch.Tensor  # index into [n * H * C] rows for every real (token, head)
    seq_order_N: torch.Tensor  # sorted position -> original sequence index
    seq_rank_N: torch.Tensor  # original sequence index -> sorted position
    step_counts: Tuple[int, ...]  # sequences still running at each chunk step
    has_pad: bool
    identity_order: bool


@functools.lru_cache(maxsize=64)
def _build_layout(
    seq_starts: Tuple[int, ...], seq_lens: Tuple[int, ...], P: int, H: int, C: int, device: torch.device
) -> _Layout:
    N = len(seq_lens)
    starts_N = torch.tensor(seq_starts, dtype=torch.long)
    lens_N = torch.tensor(seq_lens, dtype=torch.long)
    chunks_N = (lens_N + C - 1) // C
    order_N = torch.argsort(chunks_N, descending=True, stable=True)
    rank_N = torch.empty_like(order_N)
    rank_N[order_N] = torch.arange(N)
    sorted_chunks_N = chunks_N[order_N]
    max_chunks = int(sorted_chunks_N[0]) if N else 0
    counts_J = (sorted_chunks_N[None, :] > torch.arange(max_chunks)[:, None]).sum(1)
    n = int(counts_J.sum())

    step_of_n = torch.repeat_interleave(torch.arange(max_chunks), counts_J)
    rank_of_n = torch.arange(n) - (torch.cumsum(counts_J, 0) - counts_J)[step_of_n]
    seq_of_n = order_N[rank_of_n]
    pos_nC = step_of_n[:, None] * C + torch.arange(C)[None, :]
    real_nC = pos_nC < lens_N[seq_of_n][:, None]
    tok_nC = torch.where(real_nC, starts_N[seq_of_n][:, None] + pos_nC, torch.full_like(pos_nC, P))
    gather_nHC = tok_nC[:, None, :] * H + torch.arange(H)[None, :, None]

    # Inverse map: real token p sits in chunk c at slot i -> row (c * H + h) * C + i.
    chunk_slot_P = torch.empty(P, dtype=torch.long)
    slot_nC = torch.arange(n)[:, None] * (H * C) + torch.arange(C)[None, :]
    chunk_slot_P[tok_nC[real_nC]] = slot_nC[real_nC]
    scatter_PH = chunk_slot_P[:, None] + torch.arange(H)[None, :] * C

    return _Layout(
        gather_nHC.reshape(-1).to(device),
        scatter_PH.reshape(-1).to(device),
        order_N.to(device),
        rank_N.to(device),
        tuple(int(c) for c in counts_J),
        bool((~real_nC).any()),
        bool(torch.equal(order_N, torch.arange(N))),
    )


class _Consts(NamedTuple):
    tri_RR: torch.Tensor  # [R, R]: log2(e) * inclusive cumsum within a tile
    coef: torch.Tensor  # [3I + 1, I]: the tile-level exponents from the tile totals
    triu_RR: torch.Tensor  # reverse (suffix) cumsum matrix over a tile
    sup_II: torch.Tensor  # [I, I] 1.0 where m > i (tiles after tile i)
    strict_RR: torch.Tensor  # [R, R] 1.0 strictly below the diagonal
    lower_RR: torch.Tensor  # [R, R] 1.0 on and below the diagonal


@functools.lru_cache(maxsize=16)
def _consts(C: int, device: torch.device) -> _Consts:
    R, I = SUBTILE, C // SUBTILE
    # Exponents (base 2) as sums of tile totals tau_m (all <= 0, so no
    # cancellation); eps_i = Gamma at the last token of tile i, eps_-1 = 0:
    #   start i: eps_{i-1} = sum_{m<i} tau_m
    #   to_end j: Gamma_C - eps_j = sum_{m>j} tau_m
    #   decay: Gamma_C = sum_m tau_m
    #   total j: eps_j - eps_{j-1} = tau_j (last: never floored, it multiplies columns up to e^80)
    coef = torch.zeros(3 * I + 1, I)
    for i in range(I):
        coef[i, :i] = 1.0
        coef[I + i, i + 1 :] = 1.0
        coef[2 * I + 1 + i, i] = 1.0
    coef[2 * I] = 1.0
    return _Consts(
        (torch.ones(R, R).tril() * _LOG2E).to(device),
        coef.to(device),
        torch.ones(R, R).triu().to(device),
        torch.ones(I, I).triu(1).to(device),
        torch.ones(R, R).tril(-1).to(device),
        torch.ones(R, R).tril().to(device),
    )


# --------------------------------------------------------------------------
# layout: packed [B, T, H, D] tokens <-> chunk-major [n * H, C, D] float32
# --------------------------------------------------------------------------


class _Plan(NamedTuple):
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    C: int
    n: int  # chunks, all sequences
    fast: bool  # no cu_seqlens and T % C == 0: strided views, no gather
    layout: Optional[_Layout]
    step_counts: Tuple[int, ...]

    @property
    def pre(self) -> Tuple[int, ...]:
        """Leading dims of the chunk views: (steps, B, H) on the fast path, else (n * H,)."""
        return (self.T // self.C, self.B, self.H) if self.fast else (self.n * self.H,)


def _chunk_view(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[B, T, H, D] (or [B, T, H]) -> float32 chunks [*pre, C, D] (or [*pre, C]).

    The fast path returns a strided view (no copy for float32 input): its
    elementwise consumers write chunk-major outputs, fusing the layout change.
    Otherwise the tokens are gathered, padded slots zero.
    """
    x = x.float()
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(-1)
    B, T, H, D = x.shape
    C = plan.C
    if plan.fast:
        out = x.unflatten(1, (T // C, C)).permute(1, 0, 3, 2, 4)  # [steps, B, H, C, D]
    else:
        layout, n = plan.layout, plan.n
        rows = x.reshape(B * T * H, D)
        if layout.has_pad:
            rows = torch.cat([rows, rows.new_zeros(H, D)])
        out = rows.index_select(0, layout.gather_nHC).view(n * H, C, D)
    return out.squeeze(-1) if squeeze else out


def _unchunk(x_XCD: torch.Tensor, plan: _Plan, dtype: torch.dtype, mul: Optional[float] = None) -> torch.Tensor:
    """[n * H, C, D] float32 chunks -> [B, T, H, D] in dtype (padding dropped), times mul."""
    B, T, H, C = plan.B, plan.T, plan.H, plan.C
    D = x_XCD.shape[-1]
    if plan.fast:
        out = torch.empty(B, T, H, D, dtype=dtype, device=x_XCD.device)
        dst = out.view(B, T // C, C, H, D).permute(1, 0, 3, 2, 4)
        src = x_XCD.view(T // C, B, H, C, D)
        if mul is None:
            dst.copy_(src)
        elif dtype == torch.float32:
            torch.mul(src, mul, out=dst)
        else:
            dst.copy_(src * mul)
        return out
    x_PHD = x_XCD.reshape(-1, D).index_select(0, plan.layout.scatter_PH)
    if mul is not None:
        x_PHD = x_PHD.mul_(mul)
    return x_PHD.view(B, T, H, D).to(dtype)
