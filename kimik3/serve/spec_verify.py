"""Verifying drafted tokens against the target model: the lossless acceptance rule of speculative decoding.

A draft proposes K tokens x_1..x_K with distributions q_1..q_K; one target forward scores them, giving p_1..p_{K+1}
(p_i the target's distribution for the position x_i fills, p_{K+1} the one after the last draft). Both are the
distributions actually sampled from: temperature, top-k and top-p applied to each the way the target would.

Sampling (temperature > 0), per sequence, left to right: x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i));
at the first rejection the step ends with a token drawn from the residual max(0, p_i - q_i) (normalised); if all K
are accepted, one more token is drawn from p_{K+1}. Every emitted token is then distributed exactly as the target
alone would have sampled it (Leviathan et al. 2023, Chen et al. 2023).

Greedy (temperature 0): x_i is accepted while it is the target's argmax; the step ends with the target's argmax at
the first mismatch (or after the last draft). The output equals greedy decoding of the target.

Each step emits between 1 and K + 1 tokens. Batched over B sequences: ``verify_sampled`` / ``verify_greedy`` return
the emitted tokens [B, K + 1] (only the first ``counts[b]`` of row b are meaningful) and the counts [B].
"""

from __future__ import annotations

import torch

from kimik3.ops.sampling import row_argmax


def _check(draft_BK: torch.Tensor, target_BKV: torch.Tensor, draft_probs_BKV: torch.Tensor | None = None) -> None:
    if draft_BK.ndim != 2 or target_BKV.ndim != 3:
        raise ValueError(f"draft tokens must be [B, K] and target distributions [B, K + 1, V], got "
                         f"{tuple(draft_BK.shape)} and {tuple(target_BKV.shape)}")
    B, K = draft_BK.shape
    if target_BKV.shape[:2] != (B, K + 1):
        raise ValueError(f"target distributions must be [B, K + 1, V] = [{B}, {K + 1}, V] for {K} drafted tokens, "
                         f"got {tuple(target_BKV.shape)}")
    if draft_probs_BKV is not None and draft_probs_BKV.shape != (B, K, target_BKV.shape[2]):
        raise ValueError(f"draft distributions must be [B, K, V] = [{B}, {K}, {target_BKV.shape[2]}], got "
                         f"{tuple(draft_probs_BKV.shape)}")


def _accepted_prefix(accepted_BK: torch.Tensor) -> torch.Tensor:
    """The number of drafts accepted before each row's first rejection: [B]."""
    return torch.cumprod(accepted_BK.long(), dim=1).sum(1)


def _emit(draft_BK: torch.Tensor, n_B: torch.Tensor, last_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first ``n_B`` drafts followed by its closing token: tokens [B, K + 1] and counts [B]."""
    tokens = torch.cat([draft_BK, torch.zeros_like(draft_BK[:, :1])], dim=1)
    tokens.scatter_(1, n_B[:, None], last_B[:, None])
    return tokens, n_B + 1


def verify_greedy(draft_BK: torch.Tensor, target_logits_BKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: the drafts agreeing with the target's argmax, then its argmax at the first mismatch
    (or after the last draft)."""
    _check(draft_BK, target_logits_BKV)
    best_BK1 = row_argmax(target_logits_BKV)
    n_B = _accepted_prefix(draft_BK == best_BK1[:, :-1])
    return _emit(draft_BK, n_B, best_BK1.gather(1, n_B[:, None])[:, 0])


def verify_sampled(draft_BK: torch.Tensor, draft_probs_BKV: torch.Tensor, target_probs_BKV: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification (see the module docstring); probabilities in any float dtype (computed in
    fp32 at least). The drafts must have been sampled from ``draft_probs``: a draft token of probability 0 there
    is an error in the caller."""
    _check(draft_BK, target_probs_BKV, draft_probs_BKV)
    B, K = draft_BK.shape
    dtype = torch.promote_types(target_probs_BKV.dtype, torch.float32)
    p_BKV, q_BKV = target_probs_BKV.to(dtype), draft_probs_BKV.to(dtype)
    p_x = p_BKV[:, :K].gather(2, draft_BK[..., None])[..., 0]
    q_x = q_BKV.gather(2, draft_BK[..., None])[..., 0]
    if bool((q_x <= 0).any()):
        raise ValueError("a drafted token has probability 0 under its draft distribution: the drafts must be "
                         "sampled from draft_probs")
    u = torch.rand(B, K, generator=generator, device=p_BKV.device, dtype=dtype)
    n_B = _accepted_prefix(u * q_x < p_x)              # u < p / q, without dividing
    # The closing distribution: the residual at the first rejection, p_{K+1} when every draft was accepted.
    q_pad = torch.cat([q_BKV, torch.zeros_like(p_BKV[:, :1])], dim=1)   # q_{K+1} = 0: the residual is p_{K+1}
    rows = torch.arange(B, device=p_BKV.device)
    residual = (p_BKV[rows, n_B] - q_pad[rows, n_B]).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    # A residual of zero mass means p <= q everywhere there, where a rejection has probability 0; rounding can still
    # land there: then p itself is the right distribution to close with.
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(dtype).tiny), p_BKV[rows, n_B])
    last = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return _emit(draft_BK, n_B, last)
