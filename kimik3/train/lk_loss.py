"""The LK loss for training a speculative-decoding draft (seed section 8): the negative log of the theoretical
acceptance rate.

For a target distribution p and a draft distribution q over the vocabulary, a drafted token is accepted with
probability sum_x min(p(x), q(x)) (``kimik3.serve.spec_verify``'s rule). K3 trains its draft on

    L_LK = -log sum_x min(p(x), q(x))

rather than the usual surrogate KL(p || q): the loss is the quantity decoding speed depends on. Its gradient moves
q's mass only where q(x) < p(x) (elsewhere min takes p, a constant), so it stops pushing once q covers p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _probs(draft_logits: torch.Tensor, target: torch.Tensor, target_is_logits: bool):
    if draft_logits.shape != target.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target {tuple(target.shape)} must match "
                         "([..., V])")
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    q = torch.softmax(draft_logits.to(dtype), dim=-1)
    p = (torch.softmax(target.to(dtype), dim=-1) if target_is_logits else target.to(dtype)).detach()
    return p, q


def acceptance_rate(draft_logits: torch.Tensor, target: torch.Tensor, *, target_is_logits: bool = True
                    ) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per position: [...]."""
    p, q = _probs(draft_logits, target, target_is_logits)
    return torch.minimum(p, q).sum(-1)


def lk_loss(draft_logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None, *,
            target_is_logits: bool = True) -> torch.Tensor:
    """-log acceptance rate, averaged over the positions (``mask`` [...] bool: the positions that count).
    ``target``: the target's logits (or, with ``target_is_logits=False``, its probabilities); no gradient flows
    into it."""
    rate = acceptance_rate(draft_logits, target, target_is_logits=target_is_logits)
    return _mean(-torch.log(rate.clamp(min=torch.finfo(rate.dtype).tiny)), mask)


def kl_loss(draft_logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None, *,
            target_is_logits: bool = True) -> torch.Tensor:
    """The usual surrogate KL(p || q), averaged like ``lk_loss`` (for comparing the two)."""
    p, q = _probs(draft_logits, target, target_is_logits)
    losses = (p * (torch.log(p.clamp(min=torch.finfo(p.dtype).tiny)) - F.log_softmax(
        draft_logits.to(q.dtype), dim=-1))).sum(-1)
    return _mean(losses, mask)


def _mean(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The positions' mean, over those ``mask`` keeps when given."""
    if mask is None:
        return losses.mean()
    if mask.shape != losses.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must be the positions' shape {tuple(losses.shape)}")
    return (losses * mask).sum() / mask.sum().clamp(min=1)
