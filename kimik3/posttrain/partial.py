"""Partial rollouts (``kimik3 rl --partial-lambda λ``): an iteration stops generating once a fraction λ of its
trajectories have finished; the unfinished ones are paused and resumed first in the next iteration.

Seed §6: "long rollouts use partial rollouts: generation pauses once a fraction λ of the active trajectories
finish, paused ones are queued and resumed first next iteration, and the update absorbs the staleness with
per-token regularisation."

**A trajectory** (``Trajectory``) is one completion of one prompt (a member of its prompt's group of G), possibly
several assistant turns (tool use). It keeps what the finished turns were (the prompt ids the engine saw, the
sampled tokens, their rollout log-probabilities) and, while paused, the tokens of its current turn generated so
far, each with its rollout log-probability and the **policy version** (the iteration whose weights sampled it).

**An iteration's rollouts** (``partial_rollouts``): every trajectory's current turn is submitted to the engine at
once, the paused ones first (the engine admits in submission order, so they take the first running slots). A
turn that ends with a tool call gets the environment's reply and its next turn is submitted at once (not at a
turn barrier). When ``ceil(λ·N)`` of the N trajectories have finished (their last turn ended without a call),
every request still in flight is aborted: its tokens so far stay with its trajectory, which is paused. A
trajectory between turns at that moment pauses at the turn boundary. ``λ = 1`` waits for every trajectory.

**Resuming** a paused trajectory submits its current turn's prompt followed by its tokens so far, with the
turn's remaining token budget: the new weights continue the same token sequence. The rollout engine's prefix
cache is cleared at each weight sync (its KDA states and MLA latents were computed by the old weights), so the
paused prefix is prefilled again under the new weights, one chunked forward rather than a token-by-token
decode; members of a group share their prompt's prefix through the cache. The engine's KDA/MLA state is not
kept across iterations: it would be the old weights' state, and keeping it needs hooks in ``kimik3/serve``.

**Training** uses finished trajectories only, each trained once, as soon as its group gives it a baseline
(``FinishedGroups``): the group-normalised advantage compares the completions of one prompt, normalised over the
members finished so far once there are two or more with different rewards. A group whose members all finish in
one iteration is scored exactly as without partial rollouts; the early finishers of a group with a long member are
trained while their tokens are fresh instead of waiting, stale, for the last one, which is compared with all G
when it finishes. A token sampled by an older policy version than the one being updated is
**stale**; ``policy_loss.clipped_policy_loss`` corrects it (see there: the clip taken around the policy before
the update, a truncated importance weight from the sampling policy to it, and a staleness-weighted squared
log-ratio regulariser to the token's rollout-time log-probability).
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kimik3.posttrain.evaluate import ANSWER_TOKENS, Rollout, sampling_for
from kimik3.posttrain.policy_loss import group_advantages
from kimik3.posttrain.tasks import EFFORT_BUDGETS, Task
from kimik3.serve.chat import ChatEncoder


@dataclass(slots=True)
class Trajectory:
    """One completion of one prompt, across iterations. ``group``: (iteration it started, prompt index);
    ``member``: its index within the group; ``max_tokens``: its per-turn budget (None: the effort's default)."""

    task: Task
    group: tuple[int, int]
    member: int
    max_tokens: int | None = None
    conversation: list[dict] = field(default_factory=list)
    rollout: Rollout | None = None
    versions: list[list[int]] = field(default_factory=list)       # per finished turn, per token
    # The current turn: its prompt ids (set when first submitted) and the tokens generated so far.
    turn_prompt: list[int] | None = None
    partial_ids: list[int] = field(default_factory=list)
    partial_logprobs: list[float] = field(default_factory=list)
    partial_versions: list[int] = field(default_factory=list)
    finished: bool = False
    pauses: int = 0

    def __post_init__(self) -> None:
        if not self.conversation:
            self.conversation = list(self.task.prompt)
        if self.rollout is None:
            self.rollout = Rollout(self.task)

    @property
    def turn_budget(self) -> int:
        return self.max_tokens or EFFORT_BUDGETS[self.task.effort] + ANSWER_TOKENS

    def token_versions(self) -> list[int]:
        """The policy version of every token sampled so far (finished turns, then the current one)."""
        return [v for turn in self.versions for v in turn] + list(self.partial_versions)

    def _end_turn(self, tokenizer: Any, reason: str) -> None:
        """The current turn ended (stop or length): it joins the finished turns; the environment replies or the
        trajectory is finished."""
        rollout = self.rollout
        text = tokenizer.decode(self.partial_ids)
        rollout.add_turn(text, tokenizer)
        rollout.prompt_ids.append(list(self.turn_prompt))
        rollout.token_ids.append(list(self.partial_ids))
        rollout.logprobs.append(list(self.partial_logprobs))
        self.versions.append(list(self.partial_versions))
        rollout.tokens += len(self.partial_ids)
        rollout.finish = reason
        self.turn_prompt, self.partial_ids, self.partial_logprobs, self.partial_versions = None, [], [], []
        reply = self.task.reply(rollout.turns)
        if reply is None:
            self.finished = True
        else:
            self.conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": reply}]


@dataclass(slots=True)
class PartialStats:
    seconds: float
    completion_tokens: int      # tokens sampled in this call
    finished: int               # trajectories that finished in this call
    paused: int                 # trajectories left unfinished
    resumed: int                # trajectories that came in with tokens or turns of earlier iterations
    target: int                 # ceil(λ·N): the finished count that stopped generation

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)


def finish_target(lam: float, n: int) -> int:
    """How many of ``n`` trajectories must finish before an iteration stops generating: ceil(λ·n), at least 1."""
    if not 0 < lam <= 1:
        raise ValueError(f"--partial-lambda must be in (0, 1], got {lam}")
    return max(1, min(n, math.ceil(lam * n - 1e-9)))


def partial_rollouts(engine: Any, encoder: ChatEncoder, trajectories: Sequence[Trajectory], lam: float,
                     version: int, seed: int, temperature: float = 1.0) -> PartialStats:
    """Advance ``trajectories`` (paused ones first, in the order given) on ``engine`` (an ``LLMEngine`` holding
    the weights of policy ``version``) until ``ceil(lam·N)`` of them have finished, then pause the rest. Each
    trajectory's fields are updated in place."""
    from kimik3.serve.types import GenerationRequest

    start = time.perf_counter()
    n = len(trajectories)
    if n == 0:
        return PartialStats(0.0, 0, 0, 0, 0, 0)
    if any(t.finished for t in trajectories):
        raise ValueError("a finished trajectory cannot be rolled out again")
    target = finish_target(lam, n)
    resumed = sum(1 for t in trajectories if t.partial_ids or t.rollout.turns)
    events: queue.Queue = queue.Queue()
    inflight: dict[str, int] = {}
    buffers: dict[str, tuple[list[int], list[float]]] = {}
    submissions = 0

    def submit(i: int) -> None:
        nonlocal submissions
        t = trajectories[i]
        prompt_ids, hints = encoder.encode(t.conversation)
        if t.turn_prompt is None:
            t.turn_prompt = list(prompt_ids)
        elif t.turn_prompt != list(prompt_ids):
            raise RuntimeError(f"trajectory {i}: its conversation no longer encodes to its turn's prompt")
        budget = t.turn_budget - len(t.partial_ids)
        # Distinct sampling streams per (call seed, trajectory, turn, submission).
        params = sampling_for(t.task.effort, temperature,
                              None if temperature == 0 else seed + 7919 * i + 104_729 * len(t.rollout.turns)
                              + 15_485_863 * t.pauses, encoder, budget, logprobs=True)
        request_id = f"traj-{i}-{submissions}"
        submissions += 1
        inflight[request_id] = i
        buffers[request_id] = ([], [])
        engine.submit(GenerationRequest(request_id, list(t.turn_prompt) + list(t.partial_ids), params,
                                        boundary_hints=hints), events.put)

    for i in range(n):
        submit(i)
    finished = tokens = 0
    stopping = False
    while inflight:
        event = events.get()
        ids, lps = buffers[event.request_id]
        if event.token_id is not None:
            ids.append(event.token_id)
            if event.logprob is not None:
                lps.append(event.logprob)
        if not event.finished:
            continue
        i = inflight.pop(event.request_id)
        del buffers[event.request_id]
        if event.error:
            raise RuntimeError(f"the engine failed on trajectory {i}: {event.error}")
        if len(lps) != len(ids):
            raise RuntimeError(f"the engine gave {len(lps)} log-probabilities for {len(ids)} tokens")
        t = trajectories[i]
        t.partial_ids += ids
        t.partial_logprobs += lps
        t.partial_versions += [version] * len(ids)
        tokens += len(ids)
        if event.finish_reason == "abort":      # paused mid-turn
            continue
        t._end_turn(engine.tokenizer, event.finish_reason or "stop")
        if t.finished:
            finished += 1
            if finished >= target and not stopping:
                stopping = True
                for request_id in list(inflight):
                    engine.abort(request_id)
        elif not stopping:
            submit(i)                          # the next turn, at once
    paused = [t for t in trajectories if not t.finished]
    for t in paused:
        t.pauses += 1
    return PartialStats(time.perf_counter() - start, tokens, finished, len(paused), resumed, target)


class FinishedGroups:
    """The finished members of groups not yet complete: their rewards, and which of them wait for a baseline.

    ``add`` takes an iteration's newly finished trajectories with their rewards and returns those to train now
    with their advantages: in every group touched, the untrained finished members are normalised over all its
    finished members' rewards (mean and population std, as ``policy_loss.group_advantages``) once there are two or
    more of them and their rewards differ, or once the group is complete (G finished; a zero-variance complete group
    trains with advantage 0, i.e. not at all). Otherwise they wait for the group's next finisher."""

    def __init__(self, group: int):
        self.group = group
        self.rewards: dict[tuple[int, int], dict[int, float]] = {}
        self.untrained: dict[tuple[int, int], list[Trajectory]] = {}

    def add(self, finished: Sequence[Trajectory], rewards: Sequence[float]) -> tuple[list[Trajectory], list[float],
                                                                                       list[float], int]:
        """(trajectories to train, their rewards, their advantages, groups completed by this call)."""
        if len(finished) != len(rewards):
            raise ValueError(f"{len(finished)} trajectories with {len(rewards)} rewards")
        seen = set()
        for t in finished:                      # checked whole before anything is recorded
            if not t.finished:
                raise ValueError("only finished trajectories are scored")
            if not 0 <= t.member < self.group:
                raise ValueError(f"member {t.member} of group {t.group}: a group has {self.group} members")
            if (t.group, t.member) in seen or t.member in self.rewards.get(t.group, ()):
                raise ValueError(f"member {t.member} of group {t.group} finished twice")
            seen.add((t.group, t.member))
        for t, reward in zip(finished, rewards):
            self.rewards.setdefault(t.group, {})[t.member] = float(reward)
            self.untrained.setdefault(t.group, []).append(t)
        train, train_rewards, advantages, completed = [], [], [], 0
        for key in sorted({t.group for t in finished}):
            known = self.rewards[key]
            order = sorted(known)
            normalised = dict(zip(order, group_advantages([known[m] for m in order], len(order)), strict=True))
            complete = len(known) == self.group
            if not complete and not any(normalised.values()):
                continue                        # no baseline yet (one member, or all alike): wait for the next
            for t in sorted(self.untrained.pop(key), key=lambda t: t.member):
                train.append(t)
                train_rewards.append(known[t.member])
                advantages.append(normalised[t.member])
            if complete:
                completed += 1
                del self.rewards[key]
        return train, train_rewards, advantages, completed

    @property
    def waiting(self) -> int:
        """Groups with a finished member and an unfinished one."""
        return len(self.rewards)


def trajectory_rows(trajectories: Sequence[Trajectory], advantages: Sequence[float],
                    current_version: int) -> tuple[list, list, list, list, list]:
    """(prompts, completions, logprobs, staleness, advantages) of the training rows of finished trajectories:
    one row per assistant turn with tokens, each token's staleness = ``current_version`` - the version that
    sampled it. Trajectories with advantage 0 make no row."""
    prompts, completions, logprobs, staleness, advs = [], [], [], [], []
    for t, advantage in zip(trajectories, advantages):
        if not t.finished:
            raise ValueError("only finished trajectories are trained on")
        if advantage == 0.0:
            continue
        r = t.rollout
        for prompt, ids, lps, versions in zip(r.prompt_ids, r.token_ids, r.logprobs, t.versions):
            if not ids:
                continue
            if not len(lps) == len(versions) == len(ids):
                raise RuntimeError(f"{len(ids)} tokens with {len(lps)} log-probabilities and {len(versions)} "
                                   "versions")
            if max(versions) > current_version:
                raise ValueError(f"a token of policy version {max(versions)} is newer than the updated policy "
                                 f"({current_version})")
            prompts.append(prompt)
            completions.append(ids)
            logprobs.append(lps)
            staleness.append([current_version - v for v in versions])
            advs.append(advantage)
    return prompts, completions, logprobs, staleness, advs


__all__ = ["FinishedGroups", "PartialStats", "Trajectory", "finish_target", "partial_rollouts", "trajectory_rows"]
