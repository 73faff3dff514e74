"""Grouped matmul: rows sorted by expert, one weight matrix per expert.

Legend: R = rows (tokens x top-k, sorted by expert), E = experts, I = in features, O = out features.

On CUDA this is ``torch._grouped_mm`` (one kernel for all experts). Elsewhere it is a loop over the
non-empty groups with a hand-written backward (``grouped_mm_loop``): on CPU a loop is faster than
``torch._grouped_mm`` (benchmarks/NOTES-train.md), whose CPU backward also rejects the expanded gradients that
``.sum()`` produces. Both are tested against a per-row reference.
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
    """One matmul per non-empty expert group (the CPU path; it reads the group sizes on the host).

    Each group's product is written into its rows of one output (``mm(out=)``), and the backward writes each
    group's input grad into its rows of one buffer and each expert's weight grad into its slot: no concatenation
    of the groups' outputs forward nor of their grads backward (autograd through per-group products and a
    ``torch.cat`` copies both)."""
    _check(x_RI, w_EIO, counts_E)
    counts = counts_E.tolist()
    if sum(counts) != x_RI.shape[0]:
        raise ValueError(f"grouped_mm: counts sum to {sum(counts)} but x has {x_RI.shape[0]} rows")
    device = x_RI.device.type
    if torch.is_autocast_enabled(device):   # the products in autocast's dtype, as a matmul under it would run
        dtype = torch.get_autocast_dtype(device)
        x_RI, w_EIO = x_RI.to(dtype), w_EIO.to(dtype)
    return _GroupedMMLoop.apply(x_RI, w_EIO, counts)


class _GroupedMMLoop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RI, w_EIO, counts):
        y_RO = x_RI.new_empty(x_RI.shape[0], w_EIO.shape[2])
        for e, rows in _groups(counts):
            torch.mm(x_RI[rows], w_EIO[e], out=y_RO[rows])
        ctx.save_for_backward(x_RI, w_EIO)
        ctx.counts = counts
        return y_RO

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, w_EIO = ctx.saved_tensors
        d_x = torch.empty_like(x_RI) if ctx.needs_input_grad[0] else None
        d_w = torch.zeros_like(w_EIO) if ctx.needs_input_grad[1] else None   # an expert without rows: zero
        for e, rows in _groups(ctx.counts):
            if d_x is not None:
                torch.mm(grad_RO[rows], w_EIO[e].t(), out=d_x[rows])
            if d_w is not None:
                torch.mm(x_RI[rows].t(), grad_RO[rows], out=d_w[e])
        return d_x, d_w, None


def _groups(counts: list[int]):
    """(expert, its rows as a slice) for each expert with rows."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            yield e, slice(start, start + count)
        start += count


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
