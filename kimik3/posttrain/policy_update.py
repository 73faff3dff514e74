"""The update half of an RL iteration (``PolicyUpdate``): policy-gradient steps over the iteration's rows.

An iteration's rows (one per completion, or per assistant turn with partial rollouts) are shuffled into
``minibatches`` per epoch; each minibatch is one optimizer step, its rows cut into micro-batches of like lengths
whose gradients accumulate. The loss is ``policy_loss.clipped_policy_loss`` (clipped ratio to the rollout's
log-probabilities, optional KL to a reference, the stale-token objective with partial rollouts). Stale rows first
get the policy's own log-probabilities before the first step (``_proximal``): the stale tokens' trust region.

``RLRun`` (``rl.py``) inherits it, and ``MOPDRun`` (``mopd.py``) through ``RLRun``. What it reads of them:
``trainer`` (model, optimizer, balancer, device, autocast, seed and step), ``spec`` (clip, kl_coef, minibatches,
micro_batch, epochs, temperature, stale_coef, stale_ratio_cap, stale_limit), ``policy`` and ``reference`` (None:
no KL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kimik3.posttrain.policy_loss import clipped_policy_loss, make_batch, token_logprobs
from kimik3.posttrain.rollout import rollout_rows


class PolicyUpdate:
    """Policy-gradient steps over one iteration's rows (module notes)."""

    trainer: Any
    spec: Any
    policy: torch.nn.Module
    reference: torch.nn.Module | None

    def update(self, rollouts, advantages, rows: tuple | None = None, batch: Any = None) -> dict[str, Any]:
        """The policy-gradient steps of one iteration; an iteration without signal makes none. ``rows``: the
        training rows with each token's staleness (``partial.trajectory_rows``) instead of ``rollouts``'.
        ``batch``: a ready ``policy_loss.Batch`` (e.g. per-token advantages, ``mopd.py``) instead of either."""
        trainer, spec = self.trainer, self.spec
        if batch is not None:
            prompts, staleness = list(range(len(batch.input_ids))), batch.staleness
        elif rows is None:
            prompts, completions, logprobs, advs = rollout_rows(rollouts, advantages)
            staleness = None
        else:
            prompts, completions, logprobs, staleness, advs = rows
        out = {"loss": 0.0, "skipped": False, "optimizer_steps": 0, "clip_fraction": 0.0, "kl": 0.0,
               "ratio_mean": 1.0, "ratio_max_dev": 0.0, "trained_tokens": 0}
        if staleness is not None:
            out.update(stale_tokens=0, stale_truncated=0.0, stale_reg=0.0)
        limit = spec.stale_limit if rows is not None else None   # only rows with staleness have a limit to apply
        if limit is not None:
            out["stale_limited"] = sum(s > limit for row in staleness for s in row)
            prompts, completions, logprobs, staleness, advs = self._within_stale_limit(*rows)
        if not prompts:
            return out
        if batch is None:
            batch = make_batch(prompts, completions, logprobs, advs, staleness=staleness)
            if limit is not None:               # too-stale tokens: context, out of the loss
                batch.mask &= batch.staleness <= limit
        # The proximal pass is for stale tokens in the loss: none when the stale limit keeps them all as context.
        if batch.staleness is not None and bool(((batch.staleness > 0) & batch.mask).any()):
            batch.prox = self._proximal(batch)
        # Each epoch visits every row once, in minibatches of a fresh random order; the first is on-policy.
        shuffle = torch.Generator().manual_seed(trainer.args.seed + trainer.step)
        chunks = [chunk for _ in range(spec.epochs)
                  for chunk in np.array_split(torch.randperm(len(prompts), generator=shuffle).numpy(),
                                              min(spec.minibatches, len(prompts)))]
        totals = {"loss": 0.0, "tokens": 0, "clipped": 0.0, "kl": 0.0, "ratio": 0.0, "stale": 0, "truncated": 0.0,
                  "stale_reg": 0.0}
        first_dev = 0.0
        self.policy.train()
        for index, chunk in enumerate(chunks):
            loss, parts, finite = self._minibatch(batch, chunk)
            if not finite:
                trainer.nonfinite_total += 1
                out["skipped"] = True
                trainer.optimizer.zero_grad(set_to_none=True)
                if trainer.balancer is not None:
                    trainer.balancer.discard()
                continue
            trainer.optimizer.step()
            if trainer.balancer is not None:
                trainer.balancer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            out["optimizer_steps"] += 1
            totals["loss"] += loss
            for key in totals.keys() - {"loss"}:
                totals[key] += parts[key]
            if index == 0:
                first_dev = parts["dev"]
        tokens = max(1, totals["tokens"])
        out.update(loss=totals["loss"] / max(1, out["optimizer_steps"]), clip_fraction=totals["clipped"] / tokens,
                   kl=totals["kl"] / tokens, ratio_mean=totals["ratio"] / tokens, ratio_max_dev=first_dev,
                   trained_tokens=totals["tokens"])
        if staleness is not None:
            out.update(stale_tokens=totals["stale"], stale_truncated=totals["truncated"],
                       stale_reg=totals["stale_reg"] / tokens)
        return out

    def _within_stale_limit(self, prompts, completions, logprobs, staleness, advs) -> tuple:
        """The training rows without those whose every token is more than ``--stale-limit`` versions stale (the
        rows' other too-stale tokens are masked out of the loss in ``update``)."""
        keep = [i for i, row in enumerate(staleness) if min(row) <= self.spec.stale_limit]
        return tuple([column[i] for i in keep] for column in (prompts, completions, logprobs, staleness, advs))

    def _proximal(self, batch) -> torch.Tensor:
        """The policy's log-probability of every target before this update's first step ([N, T], no gradient, in
        the update's micro-batches): the trust region of the stale tokens' objective (``policy_loss``)."""
        trainer, spec = self.trainer, self.spec
        prox = torch.zeros_like(batch.old)
        with torch.no_grad():
            for index in _micro_batches(batch, range(len(batch.input_ids)), spec.micro_batch):
                micro = batch.rows(index).to(trainer.device)
                with trainer._autocast():
                    lp = token_logprobs(self.policy, micro.input_ids, micro.targets, spec.temperature)
                prox[index, :lp.shape[1]] = lp.cpu()
        return prox

    def _minibatch(self, batch, rows) -> tuple[float, dict[str, float], bool]:
        """Forward and backward of one minibatch (micro-batches accumulating), clipped gradient norm."""
        trainer, spec = self.trainer, self.spec
        device = trainer.device
        normaliser = int(batch.mask[rows].sum())
        parts = {"tokens": 0, "clipped": 0.0, "kl": 0.0, "ratio": 0.0, "dev": 0.0, "stale": 0, "truncated": 0.0,
                 "stale_reg": 0.0}
        loss_sum = 0.0
        for index in _micro_batches(batch, rows, spec.micro_batch):
            micro = batch.rows(index).to(device)
            with trainer._autocast():
                out = self.policy(micro.input_ids)
            if trainer.balancer is not None:
                trainer.balancer.observe(out.routing)
            new = torch.log_softmax(out.logits.float() / spec.temperature, dim=-1)
            new = new.gather(-1, micro.targets.unsqueeze(-1)).squeeze(-1)
            ref = None
            if self.reference is not None:
                with torch.no_grad(), trainer._autocast():
                    ref = token_logprobs(self.reference, micro.input_ids, micro.targets, spec.temperature)
            result = clipped_policy_loss(new, micro.old, micro.advantages, micro.mask, spec.clip, ref, spec.kl_coef,
                                         normaliser, micro.staleness, spec.stale_coef, spec.stale_ratio_cap,
                                         micro.prox)
            if not torch.isfinite(result.loss):
                return float("nan"), parts, False
            result.loss.backward()
            loss_sum += float(result.loss.detach())
            parts["tokens"] += result.tokens
            parts["clipped"] += result.clipped
            parts["kl"] += result.kl
            parts["ratio"] += result.ratio_sum
            parts["stale"] += result.stale
            parts["truncated"] += result.truncated
            parts["stale_reg"] += result.stale_reg
            parts["dev"] = max(parts["dev"], result.ratio_max_dev)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.policy.parameters() if p.grad is not None], trainer.args.grad_clip)
        return loss_sum, parts, bool(torch.isfinite(grad_norm))


def _micro_batches(batch: Any, rows: Sequence[int], micro_batch: int) -> list[torch.Tensor]:
    """A minibatch's rows cut into micro-batches of rows of like lengths (each micro-batch is padded only to its
    longest row, ``Batch.rows``): sorted by length, a micro-batch takes at most ``micro_batch`` rows and at most the
    padded tokens ``micro_batch`` rows of the minibatch's mean length would, so that a long completion is not paired
    with many short ones (one row always fits). The minibatch, hence the step's gradient, is the same set of rows."""
    mask = batch.mask[torch.as_tensor(rows)]
    ends = (mask.shape[1] - mask.flip(1).int().argmax(1)).tolist()   # each row's length up to its last target
    order = sorted(range(len(ends)), key=ends.__getitem__)
    budget = micro_batch * sum(ends) / len(ends)
    out, current = [], []
    for i in order:
        if current and (len(current) == micro_batch or (len(current) + 1) * ends[i] > budget):
            out.append(torch.as_tensor([rows[j] for j in current]))
            current = []
        current.append(i)
    out.append(torch.as_tensor([rows[j] for j in current]))
    return out


__all__ = ["PolicyUpdate"]
