"""The LK loss (``kimik3.train.lk_loss``): -log of the acceptance rate sum_x min(p, q), its gradient, and KL."""

from __future__ import annotations

import pytest
import torch

from kimik3.train.lk_loss import acceptance_rate, kl_loss, lk_loss


def test_values():
    target = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-30]]))
    assert float(lk_loss(target.clone(), target)) == pytest.approx(0.0, abs=1e-6)   # q = p: always accepted
    draft = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    assert float(acceptance_rate(draft, target)) == pytest.approx(0.5)           # min: 0.25 + 0.25 + 0
    assert float(lk_loss(draft, target)) == pytest.approx(-torch.log(torch.tensor(0.5)).item())
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    assert float(lk_loss(draft, probs, target_is_logits=False)) == pytest.approx(0.6931, abs=1e-4)
    mask = torch.tensor([True, False])
    two = torch.cat([draft, target.clone()]), torch.cat([target, torch.log(torch.tensor([[1e-30, 1.0, 1e-30]]))])
    assert float(lk_loss(*two, mask)) == pytest.approx(0.6931, abs=1e-4)
    assert float(kl_loss(target.clone(), target)) == pytest.approx(0.0, abs=1e-6)


def test_gradient_descent_raises_the_acceptance_rate_and_leaves_the_target_alone():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(4, 11, generator=gen, requires_grad=True)
    draft = torch.randn(4, 11, generator=gen, requires_grad=True)
    before = acceptance_rate(draft, target).detach()
    loss = lk_loss(draft, target)
    loss.backward()
    assert target.grad is None or torch.count_nonzero(target.grad) == 0
    with torch.no_grad():
        after = acceptance_rate(draft - 0.5 * draft.grad, target)
    assert bool((after > before).all())


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="must match"):
        lk_loss(torch.zeros(2, 3), torch.zeros(2, 4))
