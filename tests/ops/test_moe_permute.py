"""Tokens to expert-sorted rows and back (``kimik3.ops.moe.permute``) against plain indexing: the same values, and
gradients equal to indexing's accumulating backward."""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.moe import from_expert_rows, inverse_permutation, to_expert_rows


@pytest.mark.parametrize("tokens,top_k,experts,width", [(1, 1, 1, 3), (7, 3, 5, 17), (33, 4, 8, 64)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_matches_indexing_forward_and_backward(tokens, top_k, experts, width, dtype):
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    ids_R = torch.randint(0, experts, (tokens * top_k,), generator=gen)
    order_R = torch.argsort(ids_R, stable=True)
    inverse_R = inverse_permutation(order_R)
    assert torch.equal(order_R[inverse_R], torch.arange(order_R.numel()))
    x = torch.randn(tokens, width, generator=gen, dtype=torch.float64).to(dtype)
    grad_rows = torch.randn(tokens * top_k, width, generator=gen, dtype=torch.float64).to(dtype)
    grad_out = torch.randn(tokens, top_k, width, generator=gen, dtype=torch.float64).to(dtype)

    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    rows, rows_ref = to_expert_rows(ours, order_R, inverse_R, top_k), ref[order_R // top_k]
    assert torch.equal(rows, rows_ref)
    rows.backward(grad_rows)
    wide = torch.promote_types(dtype, torch.float32)   # the reference accumulates in fp32 (at least) too
    rows_ref.to(wide).backward(grad_rows.to(wide))
    tol = dict(rtol=0, atol=1e-14) if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)  # sum order
    torch.testing.assert_close(ours.grad, ref.grad, **tol)

    y = torch.randn(tokens * top_k, width, generator=gen, dtype=torch.float64).to(dtype)
    ours, ref = y.clone().requires_grad_(), y.clone().requires_grad_()
    back = from_expert_rows(ours, order_R, inverse_R, top_k)
    back_ref = torch.zeros_like(ref).index_copy(0, order_R, ref).view(tokens, top_k, width)
    assert back.shape == (tokens, top_k, width) and torch.equal(back, back_ref)
    back.backward(grad_out)
    back_ref.backward(grad_out)
    assert torch.equal(ours.grad, ref.grad)
