"""Grouped matmul: rows sorted by expert, one weight matrix per expert.

Legend: R = rows (tokens x top-k, sorted by expert), E = experts, I = in features, O = out features.

On CUDA this is ``torch._grouped_mm`` (one kernel for all experts). Elsewhere it is a loop over the
non-empty groups: on CPU that loop measured faster than ``torch._grouped_mm`` (7.1 ms vs 5.4 ms at
R=4096, 32 experts, 256x128, torch 2.13), whose CPU backward also rejects the expanded gradients
that ``.sum()`` produces. Both are tested against each other and against a per-row reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """How rows sorted by expert split into groups: ``counts_E`` rows per expert, and their running ends
    ``offsets_E`` (int32, the form ``torch._grouped_mm`` takes), computed once for the several grouped matmuls of
    one MoE layer."""

    counts_E: torch.Tensor
    offsets_E: torch.Tensor

    @classmethod
    def of(cls, counts_E: torch.Tensor) -> ExpertGroups:
        return cls(counts_E, torch.cumsum(counts_E, 0, dtype=torch.int32))


def _check(x_RI: torch.Tensor, w_EIO: torch.Tensor, counts_E: torch.Tensor) -> None:
    if x_RI.ndim != 2 or w_EIO.ndim != 3:
        raise ValueError(f"grouped_mm wants x [R, I] and w [E, I, O], got {tuple(x_RI.shape)} and "
                         f"{tuple(w_EIO.shape)}")
    if x_RI.shape[1] != w_EIO.shape[1]:
        raise ValueError(f"grouped_mm: x has {x_RI.shape[1]} features but w expects {w_EIO.shape[1]}")
    if counts_E.shape != (w_EIO.shape[0],):
        raise ValueError(f"grouped_mm: counts must have shape [{w_EIO.shape[0]}], got {tuple(counts_E.shape)}")


def grouped_mm_loop(x_RI: torch.Tensor, w_EIO: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Reference/fallback: one matmul per non-empty expert group.

    The groups are cut with ``split`` and the experts with ``unbind`` (not by indexing each): their backward is one
    concatenation each, where indexing would add a zero-filled copy of the whole input and of the whole weight
    stack per expert."""
    _check(x_RI, w_EIO, counts_E)
    counts = counts_E.tolist()
    if sum(counts) != x_RI.shape[0]:
        raise ValueError(f"grouped_mm: counts sum to {sum(counts)} but x has {x_RI.shape[0]} rows")
    outs = [rows @ w for rows, w, count in zip(x_RI.split(counts), w_EIO.unbind(0), counts) if count]
    if not outs:
        return x_RI.new_zeros(0, w_EIO.shape[2])
    return torch.cat(outs)


def grouped_mm_on_device(x_RI: torch.Tensor, w_EIO: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` runs as ``torch._grouped_mm`` on these operands (bf16 on CUDA, 16-byte aligned rows);
    otherwise it is ``grouped_mm_loop``, which reads the group sizes on the host (no CUDA graph can capture it)."""
    return (
        x_RI.is_cuda and hasattr(torch, "_grouped_mm") and x_RI.dtype == torch.bfloat16
        and w_EIO.dtype == torch.bfloat16
        and (x_RI.shape[1] * 2) % 16 == 0 and (w_EIO.shape[2] * 2) % 16 == 0
    )


def grouped_mm(x_RI: torch.Tensor, w_EIO: torch.Tensor, groups: ExpertGroups | torch.Tensor) -> torch.Tensor:
    """``y[r] = x[r] @ w[e(r)]`` for rows grouped by expert in order; ``groups``: the rows per expert, as
    ``ExpertGroups`` or as counts [E] (integer, sum R).

    x [R, I], w [E, I, O]. Returns [R, O] in x's dtype.
    """
    if not isinstance(groups, ExpertGroups):
        groups = ExpertGroups.of(groups)
    if grouped_mm_on_device(x_RI, w_EIO):
        _check(x_RI, w_EIO, groups.counts_E)
        return torch._grouped_mm(x_RI, w_EIO, offs=groups.offsets_E)
    return grouped_mm_loop(x_RI, w_EIO, groups.counts_E)
