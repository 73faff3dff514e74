"""Fitting a training run to its time budget: what the parts of a run cost (``StepCosts``) and the plan of how
many steps fit (``BudgetPlanner``), re-planned from the measured steps until ``FREEZE_FRACTION`` of the budget is
used, then fixed, with a last-resort early stop; and the Trainer's side of it (``BudgetedRun``: the timed passes,
the first plan, the resumed plan, the re-planning after each step). ``kimik3.train.trainer`` runs the plan; the
cosine schedule, its warmup and the context stages read the planned total.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kimik3.optim.schedule import ContextStage, stage_at, stage_start
from kimik3.train.checkpoint_clock import CheckpointClock


# The clock for timing steps and keeping the time budget (the trainer reads it too; tests replace it with a
# virtual one).
_now = time.perf_counter

FREEZE_FRACTION = 0.5    # a budgeted plan is re-planned until this share of the budget is used, then fixed
REPLAN_DRIFT = 0.05      # ... at steps 3, 6, 12, 24, ... of a process, and when it drifts by more (and 2 steps)
PLAN_MARGIN = 0.02       # the plan aims at the budget less this share: room for the estimates' noise
PLOT_S = 1.0             # what drawing loss.png and the summary lines cost (an allowance; not measured)
FIRST_PLAN_MIN = 10      # the first plan's fewest steps: it rests on timings only (the measured steps correct it)
FREEZE_MEASURED = 3      # ... and the plan is fixed only once the process has measured this many steps


def _robust_mean(values: Sequence[float]) -> float:
    """The mean, each value capped at 3x the median: a step that other work stalled once does not
    weigh on the estimate for the next 32, regular variation still does."""
    cap = 3 * float(np.median(values))
    return sum(min(v, cap) for v in values) / len(values)


class StepCosts:
    """What the parts of a run cost, in seconds, for fitting it to the time budget: forward+backward of a
    step in each context stage, the rest of a step (optimizer, balancer, metrics, progress), an evaluation,
    a checkpoint write, and the end of the run (sample and plot).

    Priors (the planning timings, or the estimates a checkpoint saved) stand in until this process has
    measured its own: the means (``_robust_mean``) of the last 32 steps per stage (a stage not reached
    yet is scaled from a measured one by the ratio of their planning timings), of the last 16 steps'
    rest, and of the last 4 evaluations and writes.
    """

    def __init__(self, fwd_bwd_s: list[float], other_s: float, eval_s: float, save_s: float, tail_s: float):
        self.prior_fwd_bwd = [max(float(v), 1e-6) for v in fwd_bwd_s]
        self.prior = {"other": float(other_s), "eval": float(eval_s), "save": float(save_s)}
        self.tail_s = float(tail_s)
        self.fwd_bwd: list[deque[float]] = [deque(maxlen=32) for _ in fwd_bwd_s]   # per stage, the last steps
        self.recent: dict[str, deque[float]] = {"other": deque(maxlen=16), "eval": deque(maxlen=4),
                                                "save": deque(maxlen=4)}
        self.ratios: deque[float] = deque(maxlen=2)   # the last steps' seconds over their estimate

    def measure_step(self, stage: int, fwd_bwd_s: float, other_s: float) -> None:
        self.ratios.append((fwd_bwd_s + max(0.0, other_s)) / self.step_at(stage))
        self.fwd_bwd[stage].append(fwd_bwd_s)
        self.recent["other"].append(max(0.0, other_s))

    @property
    def measured_steps(self) -> int:
        return sum(len(values) for values in self.fwd_bwd)

    def measure(self, kind: str, seconds: float) -> None:
        self.recent[kind].append(seconds)

    def get(self, kind: str) -> float:
        values = self.recent[kind]
        return _robust_mean(values) if values else self.prior[kind]

    def fwd_bwd_at(self, stage: int) -> float:
        if self.fwd_bwd[stage]:
            return _robust_mean(self.fwd_bwd[stage])
        measured = [i for i, values in enumerate(self.fwd_bwd) if values]
        if not measured:
            return self.prior_fwd_bwd[stage]
        base = min(measured, key=lambda i: (abs(i - stage), -i))   # the nearest measured stage
        return self.fwd_bwd_at(base) * self.prior_fwd_bwd[stage] / self.prior_fwd_bwd[base]

    def step_at(self, stage: int) -> float:
        return self.fwd_bwd_at(stage) + self.get("other")

    def slowdown(self) -> float:
        """How much slower than estimated the last two steps both were (1 when not): the machine
        slowed down (other work started beside the run), which the means learn only slowly."""
        return max(1.0, min(self.ratios)) if len(self.ratios) == self.ratios.maxlen else 1.0

    def end_s(self) -> float:
        """The end of a run: final evaluation, final checkpoint, sample and plot."""
        return self.get("eval") + self.get("save") + self.tail_s

    def state(self) -> dict[str, Any]:
        return {"fwd_bwd_s": [self.fwd_bwd_at(k) for k in range(len(self.fwd_bwd))], "other_s": self.get("other"),
                "eval_s": self.get("eval"), "save_s": self.get("save"), "tail_s": self.tail_s}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StepCosts:
        return cls(state["fwd_bwd_s"], state["other_s"], state["eval_s"], state["save_s"], state["tail_s"])


@dataclass(slots=True)
class PlanChange:
    total: int
    frozen: bool
    lines: list[str] = field(default_factory=list)


class BudgetPlanner:
    """Fits a run to ``--time-budget``: the number of steps (``total``, which the learning-rate and
    context-length schedules read), re-planned from what the steps measurably cost.

    ``used_before``: budget seconds spent by earlier processes of the run (until the checkpoint resumed
    from); ``origin``: when this process started spending (the Trainer's creation). The plan targets
    the budget less ``PLAN_MARGIN`` and the end of the run (final evaluation, checkpoint, sample, plot);
    it is re-planned at steps 3, 6, 12, 24, ... of each process and whenever the best total drifts by
    more than ``REPLAN_DRIFT``, until ``FREEZE_FRACTION`` of the budget is used: then it is fixed, so a
    checkpoint from there on resumes exactly. Whatever the plan, a run stops early, as a last resort,
    when one more step would leave no time for the end of the run.
    """

    def __init__(self, budget_s: float, stages: list[ContextStage], eval_every: int, checkpoints: CheckpointClock,
                 costs: StepCosts, total: int = 0, frozen: bool = False, used_before: float = 0.0,
                 origin: float = 0.0):
        self.budget_s, self.stages, self.eval_every = budget_s, stages, eval_every
        self.checkpoints, self.costs = checkpoints, costs
        self.total, self.frozen = total, frozen
        self.used_before, self.origin = used_before, origin
        self.next_replan = 3

    def used(self, now: float | None = None) -> float:
        return self.used_before + ((_now() if now is None else now) - self.origin)

    def stage(self, step: int, total: int) -> int:
        return stage_at(step, total, self.stages)

    def projected(self, start: int, total: int) -> float:
        """Seconds that steps ``start .. total-1`` take, with the evaluations and checkpoints between them
        (not the ones at the end)."""
        if total <= start:
            return 0.0
        bounds = [stage_start(k, total, self.stages) for k in range(len(self.stages))] + [total]
        seconds = 0.0
        for k in range(len(self.stages)):
            count = min(bounds[k + 1], total) - max(bounds[k], start)
            if count > 0:
                seconds += count * self.costs.step_at(k)
        seconds += max(0, (total - 1) // self.eval_every - start // self.eval_every) * self.costs.get("eval")
        every = self.checkpoints.every
        if every.steps is not None:
            saves = max(0, (total - 1) // every.steps - start // every.steps)
        else:
            saves = int(seconds // max(self.checkpoints.interval or 1.0, 1e-3))
        return seconds + saves * self.costs.get("save")

    def room(self, used: float) -> float:
        """Seconds left for steps: the budget less the margin, what is used and the end of the run."""
        return self.budget_s * (1 - PLAN_MARGIN) - used - self.costs.end_s()

    def best_total(self, start: int, used: float) -> int:
        """The most steps (``start`` for none more) that fit what is left of the budget."""
        room = self.room(used)
        if self.projected(start, start + 1) > room:
            return start
        fits, over = start + 1, start + 2
        while self.projected(start, over) <= room and over < 10**9:
            fits, over = over, start + 2 * (over - start)
        while over - fits > 1:
            middle = (fits + over) // 2
            fits, over = (middle, over) if self.projected(start, middle) <= room else (fits, middle)
        return fits

    def per_step(self, start: int, total: int) -> float:
        return self.projected(start, total) / max(1, total - start)

    def decide(self, step: int, total: int, used: float, since: int) -> PlanChange:
        """After step ``step`` - 1 (``since`` steps into this process): re-plan, fix the plan, or stop."""
        change = PlanChange(total, self.frozen)
        if not self.frozen:
            freeze = used >= FREEZE_FRACTION * self.budget_s and self.costs.measured_steps >= FREEZE_MEASURED
            scheduled = since >= self.next_replan
            while since >= self.next_replan:
                self.next_replan *= 2
            best = self._no_earlier_stage(step, total, self.best_total(step, used))
            drift = abs(best - total) > max(REPLAN_DRIFT * total, 2)
            if best != total and (scheduled or freeze or drift):
                change.lines.append(f"re-planned at step {step} ({used:.0f} s of the {self.budget_s:.0f} s budget "
                                    f"used, ~{self.per_step(step, best):.2f} s a step): {best} steps instead "
                                    f"of {total}" + ("; fixed from here on" if freeze else ""))
                change.total = best
            elif freeze:
                change.lines.append(f"plan fixed at {total} steps at step {step} ({used:.0f} s of the "
                                    f"{self.budget_s:.0f} s budget used, ~{self.per_step(step, total):.2f} s a step)")
            change.frozen = freeze
        stop = self.last_resort(step, change.total, used)
        if stop is not None:
            change.lines.append(stop)
            change.total = step
        return change

    def last_resort(self, step: int, total: int, used: float, pending_eval: bool = True) -> str | None:
        """A line saying why the run stops at ``step``, when one more step and the end of the run
        (evaluation, checkpoint, sample) would overrun the budget; None when they fit. ``pending_eval``:
        step ``step``'s evaluation (when one is due) is still to come."""
        if step >= total:
            return None
        pending = self.costs.get("eval") if pending_eval and step > 0 and step % self.eval_every == 0 else 0.0
        slowdown = self.costs.slowdown()
        next_step = self.costs.step_at(self.stage(step, total)) * slowdown
        end = (self.costs.end_s() + pending) * slowdown
        if used + next_step + end <= self.budget_s:
            return None
        slower = f" (steps now {slowdown:.1f}x slower than measured)" if slowdown > 1.2 else ""
        return (f"stopping at step {step} of {total} to keep the {self.budget_s:.0f} s budget: {used:.0f} s used, "
                f"~{next_step:.1f} s a step{slower}, ~{end:.1f} s for the final evaluation, checkpoint and sample")

    def _no_earlier_stage(self, step: int, total: int, best: int) -> int:
        """``best``, or less so that the context length never goes back to an earlier stage."""
        if best <= total or step == 0:
            return best
        fraction = self.stages[self.stage(step - 1, total)].start_fraction
        if fraction <= 0:
            return best
        limit = math.floor(step / fraction)
        while limit > step and step / limit < fraction:   # the float comparison ``stage_at`` makes
            limit -= 1
        while step / (limit + 1) >= fraction:
            limit += 1
        return max(step + 1, min(best, limit))

    def state(self, used: float) -> dict[str, Any]:
        return {"total": self.total, "frozen": self.frozen, "used_s": used, "costs": self.costs.state()}


class BudgetedRun:
    """The Trainer's side of the plan (``Trainer`` inherits it): its first plan from timed passes of the run's own
    shapes, the plan of a checkpoint resumed from, and the re-planning after each step. What it reads of the
    Trainer: ``args``, ``saved_plan``, ``cost_stages``, ``stages``, ``clock``, ``created``, ``step``, ``ctx``,
    ``model``, ``data``, ``device``, ``log`` / ``say``, and its ``shape_for``, ``_draw``, ``_autocast`` and
    ``sample``; it sets ``planner`` and ``total``."""

    def plan_steps(self) -> int:
        """The run's number of steps: ``--steps``, the plan of the checkpoint resumed from, or as many as
        fit the time budget by this machine's timings (``_time_the_parts``). A budgeted run keeps
        re-planning from its measured steps (``BudgetPlanner``)."""
        a = self.args
        if a.steps is not None:
            return a.steps
        if self.saved_plan is not None:
            return self._continue_plan(self.saved_plan)
        costs = self._time_the_parts()
        planner = BudgetPlanner(a.time_budget_s, self.cost_stages, a.eval_every, self.clock, costs,
                                origin=self.created)
        total = max(self.step + FIRST_PLAN_MIN, planner.best_total(self.step, planner.used()))
        planner.total = total = self.ctx.broadcast_int(total)  # every rank runs rank 0's plan
        self.planner = planner
        self.log(f"planning {total} steps (~{planner.per_step(self.step, total):.2f} s each) to fit the "
                 f"{a.time_budget_s:.0f} s budget; re-planned from the measured steps until "
                 f"{FREEZE_FRACTION:.0%} of it is used")
        return total

    def _continue_plan(self, plan: dict[str, Any]) -> int:
        a = self.args
        costs = StepCosts.from_state(plan["costs"])
        if len(costs.prior_fwd_bwd) != len(self.cost_stages):   # cannot happen with the run's own args
            costs = StepCosts([costs.prior_fwd_bwd[0]] * len(self.cost_stages), costs.prior["other"],
                              costs.prior["eval"], costs.prior["save"], costs.tail_s)
        self.planner = BudgetPlanner(a.time_budget_s, self.cost_stages, a.eval_every, self.clock, costs,
                                     total=int(plan["total"]), frozen=bool(plan["frozen"]),
                                     used_before=float(plan["used_s"]), origin=self.created)
        state = "fixed" if self.planner.frozen else f"re-planned until {FREEZE_FRACTION:.0%} of the budget is used"
        self.log(f"time budget: {self.planner.used_before:.0f} s of {a.time_budget_s:.0f} s used at the checkpoint; "
                 f"{self.planner.total} steps planned ({state})")
        return self.planner.total

    def _time_the_parts(self) -> StepCosts:
        """Planning timings, the priors of the cost model: one forward+backward at the shape of each
        context stage (after one to warm up), one batch of the evaluation and a short sample (each after one
        untimed call: on a GPU the first call of a shape compiles and autotunes its kernels, which can take
        longer than the whole run's evaluations, and the sample's estimate is scaled 20-fold). Nothing is
        trained (the gradients are dropped, the balancer sees nothing)."""
        def timed(run: Callable[[], Any], warm_up: bool = False) -> float:
            if warm_up:
                run()
            start = _now()
            run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return _now() - start

        def fwd_bwd(seq: int) -> None:
            batch, seq = self.shape_for(seq)
            inputs, labels, images = self._draw(0, batch, seq)
            with self._autocast():
                self.model(inputs, labels=labels, **images).loss.backward()

        seqs = [stage.seq_len for stage in self.cost_stages]
        fwd_bwd(seqs[0])   # warm-up
        by_seq: dict[int, float] = {}
        for seq in seqs:
            if seq not in by_seq:
                by_seq[seq] = timed(lambda: fwd_bwd(seq))
        for seq, seconds in list(by_seq.items()):   # one timing each: again, where other work may have slowed it
            if seconds > 1.5 * min(by_seq.values()):
                by_seq[seq] = min(seconds, timed(lambda: fwd_bwd(seq)))
        self.model.zero_grad(set_to_none=True)

        inputs, labels = self.data.eval_windows(self.args.seq_len or self.stages[-1].seq_len,
                                                self.args.eval_windows)
        window, target = self.ctx.shard_sequence(inputs[:4], labels[:4])

        @torch.no_grad()
        def eval_batch() -> None:
            self.model.eval()
            with self._autocast():
                self.model(window.to(self.device), labels=target.to(self.device))
            self.model.train()

        eval_s = timed(eval_batch, warm_up=True) * math.ceil(inputs.shape[0] / 4)
        sample_s = timed(lambda: self.sample(self.data.sample_prompt, max_new_tokens=4), warm_up=True) * 80 / 4
        fwd_bwd_s = [by_seq[seq] for seq in seqs]
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        save_s = 0.1 + 3 * weights / 200e6   # weights and two optimizer moments at ~200 MB/s, until measured
        return StepCosts(fwd_bwd_s, 0.15 * fwd_bwd_s[0], eval_s, save_s, sample_s + PLOT_S)

    def _replan(self, total: int, progress, first_step: int) -> int:
        """After a step of a budgeted run: rank 0's planner re-plans, fixes the plan or stops the run."""
        planner = self.planner
        change = planner.decide(self.step, total, planner.used(), self.step - first_step)
        code = self.ctx.broadcast_int(2 * change.total + int(change.frozen))   # rank 0's decision for every rank
        planner.total, planner.frozen = code // 2, bool(code % 2)
        for line in change.lines:
            self.say(line)
        if planner.total != total:
            progress.total = planner.total
            progress.refresh()
        self.total = planner.total
        return planner.total
