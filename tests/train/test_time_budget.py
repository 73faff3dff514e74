"""``--time-budget`` is a deadline: the run's number of steps is planned from timings, re-planned from
the measured steps (optimizer, evaluations, checkpoints included) until half the budget is used,
then fixed so that a later checkpoint resumes exactly; a run stops early rather than overrun.

The runs here keep time on a virtual clock (``VirtualClock``, ``kimik3.train.budget._now``): only what a
test says costs time, so a "slow machine" is exact and the tests take seconds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import kimik3.train.budget as budget_module
import kimik3.train.trainer as trainer_module
from kimik3 import K3ForCausalLM
from kimik3.optim.schedule import cosine_lr, parse_stages, stage_at, stage_start
from kimik3.train.checkpoint_clock import CheckpointClock, CheckpointEvery
from kimik3.train.budget import FREEZE_FRACTION, BudgetPlanner, StepCosts
from kimik3.train.trainer import Trainer, _postfix
from tests.train.small_run import losses, resume, small_args


class VirtualClock:
    """Time passes only where a test spends it (and a microsecond a read, so that it moves)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-6
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds


class Costs:
    """What a training forward and an optimizer step cost on the virtual clock; the forward's cost
    until the first optimizer step (the planning timings) may differ from the run's."""

    def __init__(self, clock: VirtualClock, forward_s: float, optimizer_s: float,
                 planning_forward_s: float | None = None):
        self.clock, self.forward_s, self.optimizer_s = clock, forward_s, optimizer_s
        self.planning_forward_s = forward_s if planning_forward_s is None else planning_forward_s
        self.optimizer_steps = 0

    def factory(self, config, device, seed):
        model = K3ForCausalLM(config, device=device, dtype=torch.float32, seed=seed)
        real = model.forward

        def forward(*args, **kwargs):
            if model.training and torch.is_grad_enabled():
                self.clock.spend(self.planning_forward_s if self.optimizer_steps == 0 else self.forward_s)
            return real(*args, **kwargs)

        model.forward = forward
        return model

    def slow_optimizer(self, trainer: Trainer) -> Trainer:
        real = trainer.optimizer.step

        def step(*args, **kwargs):
            self.optimizer_steps += 1
            self.clock.spend(self.optimizer_s)
            return real(*args, **kwargs)

        trainer.optimizer.step = step
        return trainer


def budget_args(config, corpus, out, budget_s, **changes):
    """A budgeted run of the small model in two context stages (16 then 32 tokens, 32 tokens a step)."""
    base = dict(steps=None, time_budget_s=budget_s, seq_len=None, batch_size=None, stages="0:16,0.5:32",
                tokens_per_step=32, eval_every=10, checkpoint_every=1000)
    base.update(changes)
    return small_args(config, corpus, out, **base)


def budgeted_run(config, corpus, out, budget_s, costs: Costs, log: list[str], on_step=None, **changes):
    trainer = costs.slow_optimizer(Trainer(budget_args(config, corpus, out, budget_s, **changes),
                                           model_factory=costs.factory, log=log.append))
    return trainer.run(on_step=on_step)


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plan_of(run_dir):
    state = json.loads((run_dir / "train_state.json").read_text())["state"]
    from kimik3.train.checkpoint import unflatten_state

    return unflatten_state(dict(state["dict"])["plan"], {})


def assert_schedule_fits(history, args):
    """The cosine schedule ended at its minimum at the run's last step: the plan was the steps taken."""
    last = history[-1]
    assert last["total_steps"] == len(history) == last["step"] + 1
    assert last["lr"] == pytest.approx(args.lr * args.min_lr_ratio, rel=1e-9)


@pytest.fixture
def clock(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(budget_module, "_now", clock)
    return clock


# ---------------------------------------------------------------------- runs on the virtual clock
SLOW_BUDGET_S = 30.0


@pytest.fixture(scope="module")
def slow_run(small_config_path, code_corpus, tmp_path_factory):
    """A budgeted run whose optimizer step (0.45 s) dwarfs the forward+backward the plan times
    (0.05 s): the issue's slow Muon step. Checkpoints every 5 steps."""
    out = tmp_path_factory.mktemp("budget") / "slow"
    log: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        clock = VirtualClock()
        patch.setattr(budget_module, "_now", clock)
        patch.setenv("KIMIK3_CACHE", str(tmp_path_factory.getbasetemp() / "kimik3-cache"))
        summary = budgeted_run(small_config_path, code_corpus, out, SLOW_BUDGET_S, Costs(clock, 0.05, 0.45), log,
                               checkpoint_every=5)
    return out, summary, log, clock.t


def test_steps_much_slower_than_timed_shrink_the_plan_and_the_run_keeps_its_deadline(slow_run):
    out, summary, log, ended = slow_run
    assert 0.85 * SLOW_BUDGET_S <= ended <= SLOW_BUDGET_S, ended
    first = next(line for line in log if line.startswith("planning "))
    planned = int(first.split()[1])
    history = records(out)
    assert planned > 3 * len(history), (first, len(history))   # the timings alone promised far too many steps
    assert any(line.startswith("re-planned at step") for line in log)
    assert not any(line.startswith("stopping at step") for line in log)   # re-planning, not the last resort
    assert_schedule_fits(history, budget_args("c", "d", out, SLOW_BUDGET_S))
    assert summary.steps == len(history) and "val_loss" in history[-1]
    assert any(line.startswith("time: ") and line.endswith(f"of the 30 s budget, {len(history)} steps") for line in log)


def test_the_plan_is_fixed_after_half_the_budget(slow_run):
    out, _, log, _ = slow_run
    fixed = [i for i, line in enumerate(log) if "fixed from here on" in line or line.startswith("plan fixed at")]
    assert len(fixed) == 1, log
    assert not [line for line in log[fixed[0] + 1:] if line.startswith("re-planned")]
    step = int(log[fixed[0]].split("at step ")[1].split()[0])
    used = float(log[fixed[0]].split("(")[1].split(" s of")[0])
    assert used >= FREEZE_FRACTION * SLOW_BUDGET_S - 0.5
    totals = [r["total_steps"] for r in records(out)]
    assert len(set(totals[step:])) == 1 and totals[0] != totals[-1]   # re-planned before, fixed from then on
    plan = plan_of(out)
    assert plan["frozen"] and plan["total"] == totals[-1] and plan["used_s"] <= SLOW_BUDGET_S


def test_a_resume_after_the_freeze_reproduces_the_uninterrupted_run(slow_run, small_config_path, code_corpus,
                                                                     tmp_path, clock):
    reference, _, reference_log, _ = slow_run
    totals = [r["total_steps"] for r in records(reference)]
    fixed = next(line for line in reference_log if "fixed from here on" in line or line.startswith("plan fixed"))
    checkpoint = 5 * math.ceil(int(fixed.split("at step ")[1].split()[0]) / 5)   # the first one after the freeze
    stop_at = checkpoint + 2
    assert stop_at < len(totals) - 2
    costs = Costs(clock, 0.05, 0.45)
    out = tmp_path / "interrupted"

    def interrupt(record):
        if record["step"] == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        budgeted_run(small_config_path, code_corpus, out, SLOW_BUDGET_S, costs, [], on_step=interrupt,
                     checkpoint_every=5)
    plan = plan_of(out)
    assert plan["frozen"] and plan["total"] == totals[-1], plan

    clock.t = 0.0   # a new process: its clock starts anew, the budget used so far comes from the checkpoint
    log: list[str] = []
    costs.slow_optimizer(resume(out, log)).run()
    assert any("s used at the checkpoint" in line and "(fixed)" in line for line in log), log
    assert losses(out) == losses(reference)
    assert [r["total_steps"] for r in records(out)] == totals


def test_steps_faster_than_timed_grow_the_plan_and_the_bar_follows(small_config_path, code_corpus, tmp_path,
                                                                   clock, monkeypatch):
    bars = []

    class Bar:
        def __init__(self, total, initial, enabled):
            self.total, self.n, self.postfix = total, initial, None
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix(self, postfix, refresh=True):
            self.postfix = postfix

        def refresh(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(trainer_module, "_progress", Bar)
    log: list[str] = []
    budget = 20.0
    summary = budgeted_run(small_config_path, code_corpus, tmp_path / "fast", budget,
                           Costs(clock, 0.2, 0.05, planning_forward_s=1.0), log)
    history = records(tmp_path / "fast")
    assert 0.85 * budget <= clock.t <= budget, clock.t
    planned = int(next(line for line in log if line.startswith("planning ")).split()[1])
    assert len(history) > 2 * planned
    assert_schedule_fits(history, budget_args("c", "d", "o", budget))
    assert [r["seq_len"] for r in history] == sorted(r["seq_len"] for r in history)   # stages never go back
    bar, = bars
    assert bar.total == bar.n == len(history)
    # The bar's loss is the next-token loss of the summary (and of loss.png's smoothed curve).
    assert bar.postfix["loss"] == f"{summary.final_loss:.3f}"
    mean = sum(r["main_loss"] for r in history[-10:]) / 10
    assert summary.final_loss == pytest.approx(mean)


def test_a_machine_that_slows_down_after_the_freeze_stops_early_rather_than_overrun(
        small_config_path, code_corpus, tmp_path, clock):
    costs = Costs(clock, 0.05, 0.2)
    log: list[str] = []
    budget = 12.0

    def slow_down(record):
        if record["step"] == 30:
            costs.optimizer_s = 1.0   # other work started beside the run

    summary = budgeted_run(small_config_path, code_corpus, tmp_path / "slower", budget, costs, log, on_step=slow_down)
    assert clock.t <= budget
    stop = [line for line in log if line.startswith("stopping at step")]
    assert len(stop) == 1 and f"stopping at step {summary.steps} of" in stop[0], log
    history = records(tmp_path / "slower")
    assert history[-1]["total_steps"] > len(history) and "val_loss" in history[-1]
    assert json.loads((tmp_path / "slower" / "train_state.json").read_text())["step"] == len(history)
    assert plan_of(tmp_path / "slower")["total"] == len(history)   # a resume has nothing left to do
    log = []
    resume(tmp_path / "slower", log).run()
    assert any("nothing to do" in line for line in log) and len(records(tmp_path / "slower")) == len(history)


def test_a_first_call_that_compiles_does_not_inflate_the_plans_estimates(small_config_path, code_corpus, tmp_path,
                                                                        clock):
    """On a GPU the first evaluation batch and the first sample compile their kernels (here 20 s each: the end of
    the run, a full evaluation and an 80-token sample scaled from them, would look like minutes); the planning
    times a second call, so the run fills its budget instead of stopping at once."""
    budget_s = 120.0
    costs = Costs(clock, 0.5, 0.5)
    trainer = costs.slow_optimizer(Trainer(budget_args(small_config_path, code_corpus, tmp_path / "run", budget_s),
                                           model_factory=costs.factory, log=[].append))
    real_sample, real_forward = trainer.sample, trainer.model.forward
    first = {"sample": True, "eval": True}

    def sample(*args, **kwargs):
        clock.spend(20.0 if first["sample"] else 0.01)
        first["sample"] = False
        return real_sample(*args, **kwargs)

    def forward(*args, **kwargs):   # the planning's evaluation batch: the first forward in eval mode
        if not trainer.model.training and first["eval"]:
            clock.spend(20.0)
            first["eval"] = False
        return real_forward(*args, **kwargs)

    trainer.sample, trainer.model.forward = sample, forward
    summary = trainer.run()
    assert 0.85 * budget_s <= clock.t <= budget_s, clock.t
    assert summary.steps >= 60, summary.steps


def test_steps_runs_exactly_n_steps_whatever_the_budget(small_config_path, code_corpus, tmp_path, clock):
    log: list[str] = []
    costs = Costs(clock, 1.0, 10.0)
    budgeted_run(small_config_path, code_corpus, tmp_path / "fixed", 1.0, costs, log, steps=5)
    history = records(tmp_path / "fixed")
    assert [r["step"] for r in history] == list(range(5)) and {r["total_steps"] for r in history} == {5}
    assert not [line for line in log if line.startswith(("planning", "re-planned", "stopping", "time:"))]
    assert plan_of(tmp_path / "fixed") == {"total": 5, "frozen": True}
    assert json.loads((tmp_path / "fixed" / "run.json").read_text())["args"]["steps"] == 5


def test_a_budgeted_runs_arguments_keep_steps_unset(slow_run):
    out, _, _, _ = slow_run   # the plan is in the checkpoint's training state (plan_of)
    assert json.loads((out / "run.json").read_text())["args"]["steps"] is None
    from kimik3.train.checkpoint import read_state_entry

    assert read_state_entry(out / "checkpoint", "args")["steps"] is None


# ---------------------------------------------------------------------- the progress bar
def test_the_progress_bar_shows_the_next_token_loss():
    record = {"loss": 5.0, "main_loss": 4.0, "mtp_loss": 3.33, "tokens_per_s": 100.0, "lr": 1e-3}
    assert _postfix(record, None)["loss"] == "4.000"
    assert _postfix(record, 3.5, [4.0, 5.0])["loss"] == "4.500"   # the average of the last steps'
    assert _postfix({"loss": 2.0, "tokens_per_s": 1.0, "lr": 1e-3}, None)["loss"] == "2.000"   # no MTP


# ---------------------------------------------------------------------- the planner and the schedules
def test_the_cosine_schedule_reaches_its_minimum_at_the_last_step():
    for total in (1, 2, 3, 7, 20, 101):
        warmup = max(1, round(0.05 * total))
        lrs = [cosine_lr(s, total, 1.0, warmup, 0.1) for s in range(total)]
        if total - 1 >= warmup:
            assert lrs[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(lrs[warmup - 1:], lrs[warmup:]))


def test_stage_start_agrees_with_stage_at():
    stages = parse_stages("0:128,0.3:256,0.7:512")
    for total in range(1, 60):
        for k in range(len(stages)):
            first = stage_start(k, total, stages)
            assert all(stage_at(s, total, stages) >= k for s in range(first, total))
            assert all(stage_at(s, total, stages) < k for s in range(first))


def _planner(budget_s=100.0, stages="0:16,0.5:32", fwd_bwd=(1.0, 2.0), eval_every=10, every=CheckpointEvery(steps=7)):
    costs = StepCosts(list(fwd_bwd), 0.5, 3.0, 1.0, 2.0)
    return BudgetPlanner(budget_s, parse_stages(stages), eval_every, CheckpointClock(every, lambda _: None,
                                                                                    now=lambda: 0.0), costs)


def test_the_projection_adds_each_stages_steps_evaluations_and_checkpoints():
    planner = _planner()
    for start, total in [(0, 1), (0, 20), (3, 20), (9, 31), (15, 16), (40, 77)]:
        expected = sum(planner.costs.step_at(stage_at(s, total, planner.stages)) for s in range(start, total))
        expected += 3.0 * sum(1 for m in range(start + 1, total) if m % 10 == 0)
        expected += 1.0 * sum(1 for m in range(start + 1, total) if m % 7 == 0)
        assert planner.projected(start, total) == pytest.approx(expected), (start, total)


def test_best_total_is_the_most_steps_that_fit():
    planner = _planner()
    for used in (0.0, 10.0, 50.0, 93.0, 99.0):
        for start in (0, 5, 20):
            best = planner.best_total(start, used)
            room = planner.room(used)
            assert best >= start
            assert best == start or planner.projected(start, best) <= room
            assert planner.projected(start, best + 1) > room


def test_a_replan_never_sends_the_context_length_back_to_an_earlier_stage():
    planner = _planner(budget_s=1000.0)
    # Step 12 of 20 is in the second stage (from step 10); twice as many steps would put it back in the first.
    change = planner.decide(12, 20, used=1.0, since=12)
    assert change.total > 20 and stage_at(12, change.total, planner.stages) == 1
    assert math.floor(12 / 0.5) == change.total
