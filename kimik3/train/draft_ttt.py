"""The draft's training-time test (EAGLE-3): K draft steps unrolled over every chain start at once.

Legend: B = batch, T = tokens, D = model width, V = vocabulary, C = MLA cache width, K = draft steps.

The target runs once over x_0..x_{T-1} and gives, at every position t, its features f_t (``features_at`` the
draft's layers, then the final hidden state) and its logits L_t (the distribution of x_{t+1}). A chain starts at
every t:

    step 1:       (fuse(f)_t,        emb(x_{t+1}))  -> a_1, q_1(x_{t+2})    compared with softmax(L_{t+1})
    step k >= 2:  (a_{k-1} at t,     emb(x_{t+k}))  -> a_k, q_k(x_{t+k+1})  compared with softmax(L_{t+k})

so every step k is one [B, T] forward of the draft. The soft targets are always the target's own distributions;
the data's tokens only enter as the inputs x. Step k at chain start t has a target only while t + k <= T - 1: the
later positions are computed (the tensors keep their [B, T] shape, so the steps' latents line up) but left out of
the loss and of the metrics.

A draft with a reduced vocabulary S (``EagleDraft.vocab_ids``) is compared with the target's distribution on S:
the acceptance (and the LK loss) is sum_{x in S} min(p(x), q(x)) with p the target's full softmax, what decoding
accepts; the KL loss compares q with p renormalised over S (KL against p itself is infinite when p has mass
outside S).

Attention inside the draft's MLA block is what decoding does (``ChainCache``): the draft's cache holds step 1's
latents of every position the target has verified, and a chain appends its own. So a query of step k at chain
start t sees the step-1 latents of positions s <= t, plus the latents of steps 2..k of its own chain (the EAGLE-3
"diagonal": the same t in every later step's block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kimik3.model.draft import EagleDraft
from kimik3.train.lk_loss import acceptance_rate, kl_loss, lk_loss

LOSSES: dict[str, Callable[..., torch.Tensor]] = {"lk": lk_loss, "kl": kl_loss}


def chain_mask(length: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The boolean mask [T, step*T] (True = may attend) of step ``step``'s queries over the latents of steps
    1..step laid side by side: causal over step 1's block, the diagonal (the same chain start) over each later
    step's block."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    same = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [same] * (step - 1), dim=1)


class ChainCache:
    """The ``LatentCache`` of the draft's MLA block across the unrolled steps of one batch.

    Each call (one draft step over [B, T]) stores that step's latents and returns those of every step so far,
    [B, step*T, C], with ``chain_mask``; step 1 is plain causal (mask None). The latents keep their graph, so the
    loss of a later step trains the earlier steps' keys and values too, as in EAGLE-3."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def attend(self, kv_BTC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.steps and kv_BTC.shape[:2] != self.steps[0].shape[:2]:
            raise ValueError(f"every unrolled step covers the same [B, T]: got {tuple(kv_BTC.shape[:2])} after "
                             f"{tuple(self.steps[0].shape[:2])}")
        self.steps.append(kv_BTC)
        if len(self.steps) == 1:
            return kv_BTC, None
        return torch.cat(self.steps, dim=1), chain_mask(kv_BTC.shape[1], len(self.steps), kv_BTC.device)


def shifted(input_ids: torch.Tensor, k: int) -> torch.Tensor:
    """x_{t+k} at every t: [B, T], the positions past the end filled with token 0 (their outputs are unused)."""
    return torch.cat([input_ids[:, k:], input_ids.new_zeros(input_ids.shape[0], min(k, input_ids.shape[1]))], 1)


@dataclass(slots=True)
class TargetPass:
    """What the frozen target computed over one batch: the draft's input features and its logits."""

    features: list[torch.Tensor]   # [B, T, D] each: the draft's layers, then the final hidden state
    logits: torch.Tensor           # [B, T, V]


@torch.no_grad()
def target_pass(model: nn.Module, draft: EagleDraft, input_ids: torch.Tensor) -> TargetPass:
    out = model(input_ids, features_at=draft.feature_layers)
    return TargetPass([f.detach() for f in out.features], out.logits.detach())


def unroll(model: nn.Module, draft: EagleDraft, target: TargetPass, input_ids: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """The draft's logits of steps 1..K over their valid chain starts: step k's is [B, T-k, V] ([B, T-k, N] for a
    reduced vocabulary; chain start t predicts x_{t+k+1}; compare with ``target.logits[:, k:]``)."""
    length = input_ids.shape[1]
    if not 1 <= steps < length:
        raise ValueError(f"{steps} draft steps need sequences longer than that, got {length} tokens")
    cache = ChainCache()
    feature = draft.fuse_features(target.features)
    logits = []
    for k in range(1, steps + 1):
        feature, normed = draft(feature, model.embed(shifted(input_ids, k)), cache)
        logits.append(draft.logits(model, normed[:, :length - k]))
    return logits


def against_target(draft: EagleDraft, draft_logits: torch.Tensor, reference: torch.Tensor, loss: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the acceptance sum_x min(p, q) per position, without gradient; ``loss``'s value or None) of a step's draft
    logits against the target's logits ``reference`` [..., V] (see the module notes for a reduced vocabulary)."""
    if draft.vocab_ids is None:
        target, kl_target, is_logits = reference, reference, True
    else:   # p on the draft's ids (not renormalised) for the acceptance; renormalised there for the KL
        target = torch.softmax(reference.float(), dim=-1)[..., draft.vocab_ids]
        kl_target, is_logits = reference[..., draft.vocab_ids], False
    with torch.no_grad():
        rate = acceptance_rate(draft_logits, target, target_is_logits=is_logits)
    if loss is None:
        return rate, None
    if loss == "kl":
        return rate, kl_loss(draft_logits, kl_target)
    return rate, lk_loss(draft_logits, target, target_is_logits=is_logits)


def ttt_loss(model: nn.Module, draft: EagleDraft, target: TargetPass, input_ids: torch.Tensor, steps: int,
             loss: str) -> tuple[torch.Tensor, list[float], list[float]]:
    """(the mean over the K steps of ``loss``, each step's loss, each step's acceptance rate) for one batch."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
    per_step, rates = [], []
    for k, draft_logits in enumerate(unroll(model, draft, target, input_ids, steps), start=1):
        rate, value = against_target(draft, draft_logits, target.logits[:, k:], loss)
        per_step.append(value)
        rates.append(float(rate.detach().mean()))
    total = torch.stack(per_step).mean()
    return total, [float(x.detach()) for x in per_step], rates


@dataclass(slots=True)
class ChainMetrics:
    """Held-out acceptance along teacher-forced chains, per chain position k = 1..K."""

    acceptance: list[float]   # alpha_k: the mean of sum_x min(p, q), temperature 1
    greedy: list[float]       # the share of positions where the draft's argmax is the target's
    positions: int            # chain starts evaluated (at step 1)

    @staticmethod
    def expected_accepted(rates: list[float]) -> float:
        """sum_k prod_{j<=k} rate_j: the drafted tokens accepted per verification, when position k is accepted
        with ``rates[k-1]`` given the earlier ones (the target's own bonus token not counted)."""
        total, run = 0.0, 1.0
        for rate in rates:
            run *= rate
            total += run
        return total

    @property
    def tau(self) -> float:
        return self.expected_accepted(self.acceptance)

    @property
    def tau_greedy(self) -> float:
        return self.expected_accepted(self.greedy)

    def as_dict(self) -> dict[str, object]:
        return {"acceptance": [round(x, 5) for x in self.acceptance], "greedy": [round(x, 5) for x in self.greedy],
                "tau": round(self.tau, 5), "tau_greedy": round(self.tau_greedy, 5), "positions": self.positions}

    def describe(self) -> str:
        alpha = " ".join(f"{x:.3f}" for x in self.acceptance)
        greedy = " ".join(f"{x:.3f}" for x in self.greedy)
        return (f"acceptance per position [{alpha}], tau {self.tau:.3f}; greedy match [{greedy}], tau "
                f"{self.tau_greedy:.3f} ({self.positions:,} chains)")


@torch.no_grad()
def chain_metrics(model: nn.Module, draft: EagleDraft, input_ids: torch.Tensor, steps: int,
                  batch_size: int = 8, autocast: Callable[[], object] | None = None) -> ChainMetrics:
    """``ChainMetrics`` of ``draft`` over the sequences ``input_ids`` [N, T] (already on the model's device)."""
    was_training = draft.training
    draft.eval()
    accepted = torch.zeros(steps, dtype=torch.float64)
    matched = torch.zeros(steps, dtype=torch.float64)
    counts = torch.zeros(steps, dtype=torch.float64)
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start:start + batch_size]
            with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
                target = target_pass(model, draft, ids)
                chains = unroll(model, draft, target, ids, steps)
            for k, draft_logits in enumerate(chains, start=1):
                reference = target.logits[:, k:]
                accepted[k - 1] += float(against_target(draft, draft_logits, reference)[0].double().sum())
                guess = draft.target_ids(draft_logits.argmax(-1))
                matched[k - 1] += float((guess == reference.argmax(-1)).double().sum())
                counts[k - 1] += reference.shape[0] * reference.shape[1]
    finally:
        draft.train(was_training)
    return ChainMetrics((accepted / counts).tolist(), (matched / counts).tolist(), int(counts[0]))


__all__ = ["LOSSES", "ChainCache", "ChainMetrics", "TargetPass", "against_target", "chain_mask", "chain_metrics",
           "shifted", "target_pass", "ttt_loss", "unroll"]
