"""Tokens to expert-sorted rows and back, each direction a gather in forward and in backward.

A token routed to K experts becomes K rows, sorted by expert: row r is (token, slot) ``order_R[r]`` of the flat
[T * K] list, so its token is ``order_R[r] // K``. With ``inverse_R`` (row of each flat (token, slot)):

    to_expert_rows:    x_RL = x_TL[order_R // K]           backward: dx_TL = dx_RL[inverse_R].view(T, K, L).sum(1)
    from_expert_rows:  y_TKL = y_RL[inverse_R].view(T, K)   backward: dy_RL = dy_TKL.flatten(0, 1)[order_R]

Indexing (``x[idx]``, ``index_copy_``) would give the same values, but its backward is an accumulating
``index_put_`` that sorts the indices first; here every backward is a gather (and the K-way sum reduces in fp32
at least), deterministic and several times cheaper.
"""

from __future__ import annotations

import torch


def inverse_permutation(order_R: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of 0..R-1: ``inverse[order[r]] = r``."""
    inverse_R = torch.empty_like(order_R)
    inverse_R[order_R] = torch.arange(order_R.numel(), device=order_R.device, dtype=order_R.dtype)
    return inverse_R


class _ToExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TL, order_R, inverse_R, top_k):
        ctx.save_for_backward(inverse_R)
        ctx.top_k = top_k
        return x_TL.index_select(0, torch.div(order_R, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad_RL):
        (inverse_R,) = ctx.saved_tensors
        per_slot = grad_RL.index_select(0, inverse_R).view(-1, ctx.top_k, grad_RL.shape[-1])
        total = per_slot.sum(1, dtype=torch.promote_types(grad_RL.dtype, torch.float32))
        return total.to(grad_RL.dtype), None, None, None


class _FromExpertRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RL, order_R, inverse_R, top_k):
        ctx.save_for_backward(order_R)
        return y_RL.index_select(0, inverse_R).view(-1, top_k, y_RL.shape[-1])

    @staticmethod
    def backward(ctx, grad_TKL):
        (order_R,) = ctx.saved_tensors
        return grad_TKL.reshape(-1, grad_TKL.shape[-1]).index_select(0, order_R), None, None, None


def to_expert_rows(x_TL: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, L] tokens -> [T * K, L] rows in ``order_R``'s order (each token once per slot)."""
    return _ToExpertRows.apply(x_TL, order_R, inverse_R, top_k)


def from_expert_rows(y_RL: torch.Tensor, order_R: torch.Tensor, inverse_R: torch.Tensor,
                     top_k: int) -> torch.Tensor:
    """[T * K, L] rows in ``order_R``'s order -> [T, K, L], each token's K slots."""
    return _FromExpertRows.apply(y_RL, order_R, inverse_R, top_k)
