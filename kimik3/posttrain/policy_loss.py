"""The RL objective: group-normalised advantages and the clipped policy-gradient loss over completion tokens.

Legend: N = rows (one per assistant turn of a rollout), T = tokens of a row, V = vocabulary.

**Advantages** (``group_advantages``): the G completions of one prompt form a group; a completion's advantage
is its reward minus the group's mean, over the group's standard deviation + eps. A group whose rewards are all
equal (all solved, or none) has no signal: its advantages are exactly 0 and it contributes nothing.

**Loss** (``clipped_policy_loss``), per completion token t with advantage A (its rollout's), the rollout's
log-probability ``old`` (the behaviour policy: the engine's, with the weights of this iteration) and the trained
policy's ``new``::

    ratio_t = exp(new_t - old_t)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)  [+ kl_coef * KL_t]

with ``KL_t = exp(ref_t - new_t) - (ref_t - new_t) - 1`` (the non-negative "k3" estimator of KL(new || ref))
to the reference model when ``kl_coef > 0``. The loss is the mean over the completion tokens of the batch (each
token weighs the same, whatever its completion's length); prompt and tool-result tokens take no loss.

**Stale tokens** (partial rollouts, ``partial.py``): a token sampled by a policy ``s >= 1`` versions older than
the one being updated ("staleness" s) has ``old`` = that older policy's log-probability. Clipping its ratio to
``old`` would zero its gradient wherever the policy has already moved past 1 +- eps since it was sampled, which
after a few iterations of learning is most stale tokens. So, on stale tokens only (s > 0; fresh tokens keep
exactly the loss above, so ``--partial-lambda 1`` changes nothing), the trust region is taken around the
**proximal** policy ``prox``: the policy being updated as it was at the start of this update (log-probabilities
from a no-grad forward), the decoupled objective of Hilton et al. 2021, "Batch size-invariance for policy
optimization"; the step from the sampling policy to the proximal one is an importance weight, truncated::

    w_t     = min(exp(prox_t - old_t), C)                       (no gradient)
    r_t     = exp(new_t - prox_t)
    loss_t  = -w_t * min(r_t * A, clip(r_t, 1 - eps, 1 + eps) * A) + stale_coef * s_t * (new_t - old_t)^2 / 2

* the **truncated weight** (C = ``ratio_cap`` > 1 + eps, default 3, the "dual clip" value of Ye et al. 2020)
  bounds what a token the sampling policy found unlikely can contribute;
* the **regulariser** (new - old)^2 / 2 is the "k2" estimator of KL(behaviour || policy) at the sampled token (the
  squared log-ratio penalty of Kimi k1.5's mirror-descent objective), weighted by the token's staleness: seed §6's
  "per-token regularisation": the older the policy that sampled it, the more the update is held near what that
  policy did, where the importance-weighted estimate is least reliable. Its gradient (new - old) * grad(new) is
  bounded by the log-ratio, unlike the k3 estimator's (ratio - 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

EPS = 1e-6


def group_advantages(rewards: Sequence[float], group: int, eps: float = EPS) -> list[float]:
    """Advantages of rewards laid out as consecutive groups of ``group`` (the completions of one prompt)."""
    if group < 1 or len(rewards) % group:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group}")
    out: list[float] = []
    for start in range(0, len(rewards), group):
        r = torch.tensor(rewards[start:start + group], dtype=torch.float64)
        centred = r - r.mean()
        std = r.std(unbiased=False)
        if float(std) == 0.0:     # every completion scored the same: no signal, exactly zero
            out += [0.0] * group
        else:
            out += (centred / (std + eps)).tolist()
    return out


@dataclass(slots=True)
class Batch:
    """Training rows, right-padded: ``input_ids`` [N, T] (the prompt then the completion), ``targets`` [N, T]
    (token t + 1, what position t predicts), ``mask`` [N, T] (True where ``targets`` is a completion token),
    ``old`` [N, T] (the rollout's log-probability of each target), ``advantages`` [N] (one per row) or [N, T] (one
    per token, as on-policy distillation's dense reward gives); ``staleness`` [N, T] (policy
    versions between the one that sampled each target and the one being updated; None: all fresh); ``prox`` [N, T]
    (the updated policy's log-probability of each target before the update: the stale tokens' trust region)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    advantages: torch.Tensor
    staleness: torch.Tensor | None = None
    prox: torch.Tensor | None = None

    FIELDS = ("input_ids", "targets", "mask", "old", "advantages", "staleness", "prox")

    def rows(self, index: slice) -> "Batch":
        cut = int(self.mask[index].any(0).nonzero().max()) + 1 if bool(self.mask[index].any()) else 1
        advantages = self.advantages[index]
        return Batch(self.input_ids[index, :cut], self.targets[index, :cut], self.mask[index, :cut],
                     self.old[index, :cut], advantages[:, :cut] if advantages.dim() == 2 else advantages,
                     *(None if t is None else t[index, :cut] for t in (self.staleness, self.prox)))

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (self.input_ids, self.targets, self.mask, self.old,
                                                                     self.advantages, self.staleness, self.prox)))


def make_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]], advantages: Sequence[float], pad_id: int = 0,
               staleness: Sequence[Sequence[int]] | None = None) -> Batch:
    """Rows of (prompt, completion) token ids with the completion's rollout log-probabilities (one per token) and,
    optionally, each completion token's staleness (policy versions behind the updated one)."""
    if not (len(prompts) == len(completions) == len(logprobs) == len(advantages)):
        raise ValueError("prompts, completions, logprobs and advantages must have one entry per row")
    if staleness is not None and len(staleness) != len(prompts):
        raise ValueError("staleness must have one entry per row")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1
    n = len(prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.bool)
    old = torch.zeros((n, width), dtype=torch.float32)
    stale = None if staleness is None else torch.zeros((n, width), dtype=torch.float32)
    for i, (prompt, completion, lps) in enumerate(zip(prompts, completions, logprobs)):
        if not prompt or len(lps) != len(completion):
            raise ValueError(f"row {i}: needs a prompt and one log-probability per completion token "
                             f"({len(lps)} for {len(completion)} tokens)")
        ids = list(prompt) + list(completion)
        input_ids[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        targets[i, :len(ids) - 1] = torch.tensor(ids[1:])
        start = len(prompt) - 1                 # position predicting the first completion token
        mask[i, start:start + len(completion)] = True
        old[i, start:start + len(completion)] = torch.tensor(lps, dtype=torch.float32)
        if stale is not None:
            if len(staleness[i]) != len(completion) or min(staleness[i], default=0) < 0:
                raise ValueError(f"row {i}: needs one staleness >= 0 per completion token")
            stale[i, start:start + len(completion)] = torch.tensor(staleness[i], dtype=torch.float32)
    return Batch(input_ids, targets, mask, old, torch.tensor(advantages, dtype=torch.float32), stale)


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log p(targets[n, t] | input_ids[n, :t + 1]) under ``model`` at ``temperature``: [N, T] float32."""
    logits = model(input_ids).logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass(slots=True)
class LossParts:
    loss: torch.Tensor        # what backward runs on
    tokens: int               # completion tokens in the batch
    clipped: float            # completion tokens whose ratio the clip held (the gradient is zero there)
    kl: float                 # sum over the completion tokens of the KL estimate (0 without a reference)
    ratio_sum: float          # sum over the completion tokens of the importance ratio
    ratio_max_dev: float      # max |ratio - 1| over the completion tokens
    stale: int = 0            # completion tokens sampled by an older policy (staleness > 0)
    truncated: float = 0.0    # stale tokens whose weight exp(prox - old) the cap C held
    stale_reg: float = 0.0    # sum over the stale tokens of the staleness-weighted regulariser


def clipped_policy_loss(new: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip: float, ref: torch.Tensor | None = None, kl_coef: float = 0.0,
                        normaliser: int | None = None, staleness: torch.Tensor | None = None,
                        stale_coef: float = 0.0, ratio_cap: float = 3.0, prox: torch.Tensor | None = None) -> LossParts:
    """The clipped surrogate over the ``mask``ed tokens (see the module notes): new/old/ref [N, T], advantages
    [N] (one per row) or [N, T] (one per token). ``normaliser``: the token count the sum is divided by (default:
    this batch's; a micro-batch of a larger update passes the update's, so its gradients add up to the whole batch's
    mean). ``staleness`` [N, T]: where > 0, the stale-token objective: the trust region around ``prox`` [N, T]
    (required then), the weight exp(prox - old) truncated at ``ratio_cap``, the regulariser weighted by
    ``stale_coef``."""
    if staleness is not None and ratio_cap <= 1 + clip:
        raise ValueError(f"the stale ratio cap must exceed 1 + clip = {1 + clip}, got {ratio_cap}")
    mask_f = mask.float()
    tokens = int(mask.sum())
    divide = max(1, normaliser if normaliser is not None else tokens)
    ratio = torch.exp((new - old) * mask_f)     # 1 off the mask, where old is padding
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(new.dtype)
    stale = (staleness > 0) & mask if staleness is not None else None
    stale_tokens = int(stale.sum()) if stale is not None else 0
    trust = ratio                                # the ratio the clip holds: to old (fresh) or to prox (stale)
    weight = None
    if stale_tokens:
        if prox is None:
            raise ValueError("stale tokens need the proximal log-probabilities (prox): the updated policy's before "
                             "the update")
        stale_f = stale.float()
        trust = torch.where(stale, torch.exp((new - prox) * stale_f), ratio)
        behaviour = torch.exp((prox - old) * stale_f).detach()   # the sampling policy to prox, before truncation
        weight = torch.where(stale, behaviour.clamp(max=ratio_cap), 1.0)
    surrogate = torch.minimum(trust * adv, trust.clamp(1 - clip, 1 + clip) * adv)
    per_token = -surrogate if weight is None else -weight * surrogate
    truncated = reg_sum = 0.0
    if stale_tokens:
        log_ratio = (new - old) * stale_f
        reg = stale_coef * staleness * 0.5 * log_ratio.square()
        per_token = per_token + reg
        with torch.no_grad():
            truncated = float((stale & (behaviour > ratio_cap)).sum())
            reg_sum = float(reg.detach().sum())
    kl_sum = 0.0
    if ref is not None and kl_coef > 0:
        delta = ref - new
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + kl_coef * kl
        kl_sum = float((kl.detach() * mask_f).sum())
    loss = (per_token * mask_f).sum() / divide
    with torch.no_grad():
        held = ((trust * adv) > (trust.clamp(1 - clip, 1 + clip) * adv)) & mask
        deviation = float(((ratio - 1).abs() * mask_f).max()) if tokens else 0.0
    return LossParts(loss, tokens, float(held.sum()), kl_sum, float((ratio.detach() * mask_f).sum()), deviation,
                     stale_tokens, truncated, reg_sum)


__all__ = ["Batch", "LossParts", "clipped_policy_loss", "group_advantages", "make_batch", "token_logprobs"]
