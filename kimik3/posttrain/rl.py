"""On-policy RL with verifiable rewards (``kimik3 rl``): a run's model improved on the tasks of one (domain,
effort), or of a mixture of them (``--domain all`` and / or ``--effort all``), by rollouts on the serving engine,
group-normalised advantages and a clipped policy gradient.

One iteration (``RLRun.iteration``):

1. **Prompts**: P train tasks of (domain, effort[, difficulty]), a pure function of (seed, iteration): fresh ones
   each iteration, or with ``--prompt-pool N`` the next P of a fixed set of N (an RL dataset of N problems). On
   a mixture of C cells, prompt k of iteration s comes from cell (s·P + k) mod C (``iteration_tasks``), as in
   ``kimik3 mopd``, and the records add per-cell rewards and lengths (``cells``).
2. **Sync**: the policy's weights are copied into the rollout engine's model (``rollout.RolloutEngine.sync``).
3. **Rollouts**: G completions per prompt, sampled at ``--temperature`` (default 1) by the engine (batched,
   prefix-cached), with each token's log-probability under that tempered distribution; tool-use tasks turn by
   turn. The policy's log-probabilities in the update are taken at the same temperature, so the importance
   ratios compare the distribution that sampled with the one trained (a temperature below 1 samples nearer the
   greedy answer a small model gives, which is what its test accuracy measures). Throughput (completion
   tokens/s) is logged.
4. **Rewards**: each task's verifier ``score``; advantages normalised within each prompt's group
   (``policy_loss.group_advantages``: zero-variance groups contribute nothing).
5. **Update**: the rows (one per assistant turn with a nonzero advantage) are split into ``--minibatches``
   optimizer steps, ``--epochs`` times over (each pass in a new random order); each recomputes the policy's
   log-probabilities and minimises the clipped surrogate over the completion tokens
   (``policy_loss.clipped_policy_loss``), with optional KL to the reference (the starting
   model). The first minibatch is on-policy (ratio 1 up to the engine's numerics, logged as
   ``ratio_max_dev``); the later ones are off-policy by the earlier steps, which the clip bounds.

QAT (``moe.expert_quant = "mxfp4"`` in the run's config) stays on: the policy trains through the fake-quantised
experts, and the engine serves them packed as MXFP4 from the same weights.

**The run** is ``kimik3 train``'s: the ``Trainer`` builds the model (from the base run's weights), the optimizer
(per-head Muon + AdamW, constant learning rate here), the router-bias balancer if ``--balance`` asks for one
(none by default: ``driver.POSTTRAIN_BALANCE``), the run directory,
checkpoints (every 60 s and at the end) and ``--resume``; this module runs its own loop with them, writing
``metrics.jsonl`` (one record per iteration, ``step`` = iteration) and ``rl.png``, plus ``rl.json`` (the base run
and the RL settings) that ``--resume`` reads back. The output loads in ``kimik3 serve`` and ``eval-tasks`` like
any run. Iteration s's prompts and sampling seeds are functions of (seed, s), so a resumed run continues with the
prompts the uninterrupted one would have used.

**Partial rollouts** (``--partial-lambda λ < 1``, ``partial.py``): an iteration rolls out the trajectories paused
by the previous one first, then its P x G new ones, and stops generating once ceil(λ·N) of those N have finished;
the rest are paused (their tokens so far kept with their rollout log-probabilities and the policy version of each
token). A finished trajectory is trained once, as soon as its group has a baseline for it (its advantage normalised
over the group's members finished so far, ``partial.FinishedGroups``); its tokens sampled by older weights get
the stale-token objective of ``policy_loss.clipped_policy_loss``, whose trust region is the policy as it was before
the update (one more forward of the rows, without gradient, when a stale token is in the loss); ``--stale-limit K``
keeps tokens more than K versions stale as context only, out of the loss. λ = 1 is the plain loop above. A
``--resume``d run starts with an empty queue (paused trajectories and waiting early finishers are not
checkpointed).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kimik3.files import write_text_atomic
from kimik3.posttrain.driver import POSTTRAIN_BALANCE, drive, metrics_file, open_base, policy_trainer
from kimik3.posttrain.evaluate import expand, score_rollouts
from kimik3.posttrain.partial import (FinishedGroups, Trajectory, finish_target, partial_rollouts,
                                     trajectory_rows)
from kimik3.posttrain.policy_loss import group_advantages
from kimik3.posttrain.policy_update import PolicyUpdate
from kimik3.posttrain.rollout import RolloutEngine
from kimik3.posttrain.tasks import DOMAINS, EFFORTS, make_tasks

RL_FILE = "rl.json"
PLOT_FILE = "rl.png"
CELL_SALT = 7919   # added to the task seed per cell index of a mixture
RECIPE = "rl-grpo-clip-v1"


class SettingsFile:
    """A post-training run's settings file: ``FILE`` in the run directory, the dataclass's fields under ``KEY``,
    written by ``COMMAND`` (the name its errors give)."""

    FILE: ClassVar[str]
    KEY: ClassVar[str]
    COMMAND: ClassVar[str]

    def write(self, run_dir: Path) -> None:
        write_text_atomic(run_dir / self.FILE, json.dumps({self.KEY: dataclasses.asdict(self)}, indent=1))

    @classmethod
    def read(cls, run_dir: Path):
        path = run_dir / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {run_dir} is not a run written by `{cls.COMMAND}`")
        try:
            return cls(**json.loads(path.read_text())[cls.KEY])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: unreadable ({err!r})") from None


def check_update_settings(spec: Any) -> None:
    """The rollout and update settings ``kimik3 rl`` and ``kimik3 mopd`` share: clip, minibatches, micro_batch,
    epochs, max_tokens, temperature."""
    if not 0 < spec.clip < 1:
        raise ValueError(f"--clip must be in (0, 1), got {spec.clip}")
    if spec.minibatches < 1 or spec.micro_batch < 1 or spec.epochs < 1:
        raise ValueError(f"--minibatches, --micro-batch and --epochs must be >= 1, got {spec.minibatches}, "
                         f"{spec.micro_batch}, {spec.epochs}")
    if spec.max_tokens is not None and spec.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {spec.max_tokens}")
    if not 0 < spec.temperature <= 2:
        raise ValueError(f"the rollout temperature must be in (0, 2], got {spec.temperature}")


@dataclass(slots=True)
class RLSpec(SettingsFile):
    """What ``rl.json`` records: the base run and the RL settings (everything but the optimizer's, which the
    Trainer's arguments hold)."""

    base_run: str
    domain: str
    effort: str
    difficulty: str = "standard"
    group: int = 8
    prompts: int = 8
    clip: float = 0.2
    kl_coef: float = 0.0
    minibatches: int = 2
    micro_batch: int = 16
    temperature: float = 1.0
    max_tokens: int | None = None     # per turn; None: the effort's budget + the answer's allowance
    epochs: int = 1                   # passes over an iteration's rows (PPO epochs)
    prompt_pool: int | None = None    # prompts from a fixed set of this many train tasks (None: fresh each time)
    partial_lambda: float = 1.0       # stop an iteration's rollouts once this fraction finished (1: wait for all)
    stale_coef: float = 0.1           # weight of the staleness-weighted regulariser on stale tokens
    stale_ratio_cap: float = 3.0      # truncation C of stale tokens' importance ratio
    stale_limit: int | None = None    # tokens more versions stale than this are context only (None: all trained)

    FILE: ClassVar[str] = RL_FILE
    KEY: ClassVar[str] = "rl"
    COMMAND: ClassVar[str] = "kimik3 rl"

    @property
    def cells(self) -> list[tuple[str, str]]:
        """The (domain, effort) cells the prompts come from: ``domain`` and ``effort`` each one name or "all"
        (RL on the mixture of those cells)."""
        return [(d, e) for d in expand(self.domain, DOMAINS, "domain") for e in expand(self.effort, EFFORTS, "effort")]

    @property
    def label(self) -> str:
        return f"{self.domain}/{self.effort}"

    def validate(self) -> None:
        for domain, effort in self.cells:   # an unknown domain or effort: refused
            make_tasks(domain, "train", 1, 0, effort, self.difficulty)   # an unknown difficulty: refused
        if self.group < 2:
            raise ValueError(f"--group must be >= 2 (advantages compare completions of one prompt), got {self.group}")
        if self.prompts < 1:
            raise ValueError(f"--prompts must be >= 1, got {self.prompts}")
        if self.prompt_pool is not None and self.prompt_pool < 1:
            raise ValueError(f"--prompt-pool must be >= 1, got {self.prompt_pool}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        check_update_settings(self)
        finish_target(self.partial_lambda, 1)     # outside (0, 1]: refused
        if self.stale_coef < 0:
            raise ValueError(f"--stale-coef must be >= 0, got {self.stale_coef}")
        if self.stale_ratio_cap <= 1 + self.clip:
            raise ValueError(f"--stale-ratio-cap must exceed 1 + --clip = {1 + self.clip}, got {self.stale_ratio_cap}")
        if self.stale_limit is not None and self.stale_limit < 0:
            raise ValueError(f"--stale-limit must be >= 0 policy versions, got {self.stale_limit}")

    @property
    def fingerprint(self) -> str:
        fields = dataclasses.asdict(self)
        if self.partial_lambda == 1.0:       # the plain loop: the partial settings change nothing (nor old runs' hash)
            for name in ("partial_lambda", "stale_coef", "stale_ratio_cap", "stale_limit"):
                fields.pop(name)
        # a setting at its default: hashed as an rl.json lacking it
        for name, default in (("epochs", 1), ("prompt_pool", None), ("stale_limit", None)):
            if name in fields and fields[name] == default:
                fields.pop(name)
        return hashlib.sha256(json.dumps([RECIPE, fields], sort_keys=True).encode()).hexdigest()


class RLSource:
    """The ``DataSource`` the Trainer is built with: the tokenizer and the fingerprint a checkpoint is checked
    against. RL's data are its rollouts, so there are no batches nor validation windows to read."""

    unigram = float("nan")

    def __init__(self, spec: RLSpec, tokenizer: Any):
        self.spec, self.tokenizer = spec, tokenizer
        self.fingerprint = spec.fingerprint
        domain, effort = spec.cells[0]
        task = make_tasks(domain, "train", 1, 0, effort, spec.difficulty)[0]
        self.sample_prompt = task.messages[-1]["content"]

    def describe(self) -> str:
        s = self.spec
        cells = s.cells
        where = s.label if len(cells) == 1 else f"{len(cells)} cells ({', '.join(f'{d}/{e}' for d, e in cells)})"
        return (f"RL on {where}" + (f" ({s.difficulty})" if s.difficulty != "standard" else "")
                + f": {s.prompts} prompts x {s.group} completions per iteration")

    def batch_at(self, step: int, seed: int, batch_size: int, seq_len: int):
        raise NotImplementedError("RL trains on its rollouts, not on a batch of a corpus")

    eval_windows = batch_at

    def with_tokenizer(self, tokenizer: Any) -> "RLSource":
        return RLSource(self.spec, tokenizer)


def spread_over_cells(cells: int, first: int, prompts: int, draw: Callable[[int, list[int]], Sequence]) -> list:
    """(task, cell index) for prompts ``first .. first + prompts - 1`` of a run over ``cells`` cells: prompt k comes
    from cell k mod C as the j-th prompt that cell gives, j = k // C. ``draw(c, numbers)`` returns cell c's tasks for
    its prompt numbers j (in order), one call per cell present."""
    wanted: dict[int, list[int]] = {}   # cell -> its prompts' numbers j, in order
    for k in range(first, first + prompts):
        wanted.setdefault(k % cells, []).append(k // cells)
    taken = {c: iter(draw(c, numbers)) for c, numbers in wanted.items()}
    return [(next(taken[k % cells]), k % cells) for k in range(first, first + prompts)]


def fresh_cell_tasks(c: int, domain: str, effort: str, n: int, seed: int, iteration: int, difficulty: str) -> list:
    """``n`` fresh train tasks of cell ``c`` (its index in the run's cells) for ``iteration``: drawn with (seed,
    iteration) salted per cell, so that two efforts of one domain draw different problems (the first cell: no
    salt). RL on a mixture and MOPD draw through this, so that both see the same problems."""
    return make_tasks(domain, "train", n, seed * 1_000_003 + iteration + CELL_SALT * c, effort, difficulty)


def iteration_tasks(spec: RLSpec, seed: int, iteration: int) -> list:
    """The prompts of ``iteration``, each repeated ``group`` times (consecutively: one group per prompt). Prompt k
    of iteration s comes from cell (s·P + k) mod C of the C cells (with one cell, every prompt; ``spread_over_cells``):
    fresh train tasks drawn with (seed, iteration), or with ``prompt_pool`` N from a fixed set of N train tasks of
    the cell, taken in a new seeded order on each pass over the set (a finite RL dataset, visited epoch by epoch)."""
    cells = spec.cells

    def draw(c: int, numbers: list[int]) -> list:
        domain, effort = cells[c]
        if spec.prompt_pool is None:
            return fresh_cell_tasks(c, domain, effort, len(numbers), seed, iteration, spec.difficulty)
        pool = _prompt_pool(domain, spec.prompt_pool, seed, effort, spec.difficulty, CELL_SALT * c)
        orders: dict[int, np.ndarray] = {}   # pass -> its order (an iteration spans at most two passes)
        tasks = []
        for j in numbers:
            epoch = j // len(pool)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(pool))
            tasks.append(pool[orders[epoch][j % len(pool)]])
        return tasks

    return [task for task, _ in spread_over_cells(len(cells), iteration * spec.prompts, spec.prompts, draw)
            for _ in range(spec.group)]


def cell_stats(spec: RLSpec, rollouts: list, rewards: list[float]) -> dict[str, Any]:
    """With several cells, ``{"cells": {"d:e": {"reward_mean", "completion_tokens", "rollouts"}}}`` over the cells
    the rollouts came from (an iteration's prompts cover some cells, or all); with one cell, nothing."""
    if len(spec.cells) == 1:
        return {}
    by_cell: dict[str, list[tuple[float, int]]] = {}
    for rollout, reward in zip(rollouts, rewards, strict=True):
        by_cell.setdefault(f"{rollout.task.domain}:{rollout.task.effort}", []).append((reward, rollout.tokens))
    return {"cells": {cell: {"reward_mean": float(np.mean([r for r, _ in rows])),
                             "completion_tokens": float(np.mean([t for _, t in rows])), "rollouts": len(rows)}
                      for cell, rows in sorted(by_cell.items())}}


@functools.lru_cache(maxsize=16)
def _prompt_pool(domain: str, size: int, seed: int, effort: str, difficulty: str, salt: int = 0) -> tuple:
    """The fixed train tasks of ``--prompt-pool``, made once per run rather than every iteration."""
    return tuple(make_tasks(domain, "train", size, seed * 1_000_003 - 1 + salt, effort, difficulty))


class RLRun(PolicyUpdate):
    """The Trainer (model, optimizer, run directory, checkpoints), the rollout engine and the reference; the
    update of each iteration is ``PolicyUpdate``'s."""

    def __init__(self, trainer: Any, spec: RLSpec, encoder: Any, log: Callable[[str], None] = print):
        self.trainer, self.spec, self.log = trainer, spec, log
        self.policy = trainer.model
        # Partial rollouts carry about N (1 / λ - 1) paused trajectories on top of the N new ones.
        self.engine = RolloutEngine(self.policy, trainer.tokenizer, encoder,
                                    max_running=min(256, math.ceil(spec.prompts * spec.group / spec.partial_lambda)))
        self.paused: list[Trajectory] = []                          # resumed first next iteration
        self.finished_groups = FinishedGroups(spec.group)           # finished members of groups not yet complete
        self.rewards: Callable[[list], list[float]] = score_rollouts   # the rollouts' rewards, in order
        # (iteration, index in the iteration's P x G) -> that trajectory's per-turn token budget; None: spec's.
        self.budget: Callable[[int, int], int | None] | None = None
        self.reference = None
        if spec.kl_coef > 0:
            from kimik3.model.k3 import K3ForCausalLM

            first = next(self.policy.parameters())
            self.reference = K3ForCausalLM.from_pretrained(spec.base_run, device=first.device, dtype=first.dtype)
            self.reference.eval().requires_grad_(False)

    def close(self) -> None:
        self.engine.close()

    def iteration(self, step: int, progress: bool = False) -> dict[str, Any]:
        trainer, spec = self.trainer, self.spec
        seed = trainer.args.seed
        record: dict[str, Any] = {"step": step, "total_steps": trainer.total, "lr": trainer.args.lr}
        start = time.perf_counter()
        if spec.partial_lambda < 1.0 or self.budget is not None:   # per-trajectory budgets need the trajectory loop
            return self._partial_iteration(step, record, start, progress)
        tasks = iteration_tasks(spec, seed, step)
        self.engine.sync(self.policy)
        rollouts, stats = self.engine.rollouts(tasks, seed=(seed * 1_000_003 + step) * 65_536,
                                               temperature=spec.temperature, max_tokens=spec.max_tokens,
                                               progress=progress)
        rewards = self.rewards(rollouts)
        advantages = group_advantages(rewards, spec.group)
        groups = np.asarray(rewards).reshape(-1, spec.group)
        record.update(reward_mean=float(np.mean(rewards)), accuracy=float(np.mean([r >= 1.0 for r in rewards])),
                      completion_tokens=float(np.mean([r.tokens for r in rollouts])),
                      zero_variance_groups=float(np.mean(groups.std(axis=1) == 0)),
                      rollout_s=stats.seconds, rollout_tokens=stats.completion_tokens,
                      rollout_tokens_per_s=stats.tokens_per_s, **cell_stats(spec, rollouts, rewards))
        update_start = time.perf_counter()
        record.update(self.update(rollouts, advantages))
        record["update_s"] = time.perf_counter() - update_start
        record["iteration_s"] = time.perf_counter() - start
        record["elapsed_s"] = time.perf_counter() - trainer.started
        return record

    def _partial_iteration(self, step: int, record: dict[str, Any], start: float, progress: bool) -> dict[str, Any]:
        """An iteration with partial rollouts (module notes): resumed trajectories first, then P x G new ones;
        generation stops at ceil(λ·N) finished; finished trajectories are trained once their group gives them a
        baseline (``FinishedGroups``)."""
        trainer, spec = self.trainer, self.spec
        seed = trainer.args.seed
        new = [Trajectory(task, (step, k // spec.group), k % spec.group,
                          (self.budget(step, k) if self.budget is not None else None) or spec.max_tokens)
               for k, task in enumerate(iteration_tasks(spec, seed, step))]
        batch = self.paused + new
        self.engine.sync(self.policy)
        stats = partial_rollouts(self.engine.engine, self.engine.encoder, batch, spec.partial_lambda, version=step,
                                 seed=(seed * 1_000_003 + step) * 65_536, temperature=spec.temperature)
        self.paused = [t for t in batch if not t.finished]
        finished = [t for t in batch if t.finished]
        trained, rewards, advantages, completed = self.finished_groups.add(
            finished, self.rewards([t.rollout for t in finished]))
        rollouts = [t.rollout for t in trained]
        record.update(rollout_s=stats.seconds, rollout_tokens=stats.completion_tokens,
                      rollout_tokens_per_s=stats.tokens_per_s, trajectories=len(batch), resumed=stats.resumed,
                      finished=stats.finished, paused=stats.paused, finish_target=stats.target,
                      trained=len(trained), groups_completed=completed, groups_waiting=self.finished_groups.waiting,
                      reward_mean=float(np.mean(rewards)) if rewards else float("nan"),
                      accuracy=float(np.mean([r >= 1.0 for r in rewards])) if rewards else float("nan"),
                      completion_tokens=float(np.mean([r.tokens for r in rollouts])) if rollouts else float("nan"),
                      **cell_stats(spec, rollouts, rewards))
        versions = [v for t in trained for v in t.token_versions()]
        record["stale_token_fraction"] = float(np.mean([v < step for v in versions])) if versions else 0.0
        record["max_staleness"] = int(step - min(versions)) if versions else 0
        update_start = time.perf_counter()
        record.update(self.update(rollouts, advantages, rows=trajectory_rows(trained, advantages, step)))
        record["update_s"] = time.perf_counter() - update_start
        record["iteration_s"] = time.perf_counter() - start
        record["elapsed_s"] = time.perf_counter() - trainer.started
        return record


def plot_rl(metrics_path: Path, out_path: Path) -> Path | None:
    """``rl.png``: reward and accuracy, completion length, clip fraction and KL, rollout tokens/s over iterations."""
    from kimik3.train.plot import draw_figure, read_metrics, smooth

    records = [r for r in read_metrics(metrics_path) if "reward_mean" in r]
    if not records:
        return None
    steps = [r["step"] for r in records]

    def draw(axes) -> None:
        reward = [r["reward_mean"] for r in records]
        axes[0].plot(steps, reward, color="tab:blue", alpha=0.3, lw=0.8)
        axes[0].plot(steps, smooth(reward), color="tab:blue", label="train reward (smoothed)")
        tests = [(r["step"], r["test_accuracy"]) for r in records if "test_accuracy" in r]
        if tests:
            axes[0].plot(*zip(*tests), "o-", color="tab:orange", label="test accuracy (greedy)")
        axes[0].set_ylabel("reward")
        axes[0].legend()
        axes[1].plot(steps, [r["completion_tokens"] for r in records], color="tab:purple")
        axes[1].set_ylabel("completion tokens")
        axes[2].plot(steps, [r["clip_fraction"] for r in records], color="tab:red", label="clip fraction")
        axes[2].plot(steps, [r["kl"] for r in records], color="tab:green", label="KL to reference")
        axes[2].legend()
        axes[3].plot(steps, [r["rollout_tokens_per_s"] for r in records], color="tab:gray")
        axes[3].set_ylabel("rollout tokens/s")
        axes[3].set_xlabel("iteration")
        for ax in axes:
            ax.grid(alpha=0.3)

    return draw_figure(out_path, "the RL plot", 4, draw, figsize=(8, 10))


def run_rl(run: str | Path | None = None, *, domain: str = "general", effort: str = "low",
           difficulty: str = "standard", iterations: int = 20, group: int = 8, prompts: int = 8, lr: float = 2e-4,
           kl_coef: float = 0.0, clip: float = 0.2, minibatches: int = 2, micro_batch: int = 16,
           max_tokens: int | None = None, temperature: float = 1.0, epochs: int = 1, prompt_pool: int | None = None,
           partial_lambda: float = 1.0,
           stale_coef: float = 0.1, stale_ratio_cap: float = 3.0, stale_limit: int | None = None,
           out: str | Path | None = None,
           resume: str | Path | None = None,
           seed: int = 0, device: str = "cpu", balance: str = POSTTRAIN_BALANCE,
           checkpoint_every: str | None = None, eval_n: int = 0, progress: bool = True,
           log: Callable[[str], None] = print,
           on_iteration: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """RL on ``run``'s model (new run ``out``, default ``<run>-rl-<domain>-<effort>``), or continue the RL run
    ``resume`` up to ``iterations``. ``eval_n``: greedy test accuracy on that many test tasks before the first
    iteration and after the last (recorded as ``test_accuracy``). Returns this call's iteration records."""
    if iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {iterations}")
    if eval_n < 0:
        raise ValueError(f"--eval-n must be >= 0, got {eval_n}")
    if resume is not None:
        resume = Path(resume)
        if not resume.is_dir():
            raise FileNotFoundError(f"--resume {resume}: no such run directory")
        spec = RLSpec.read(resume)
    else:
        if run is None:
            raise ValueError("which run to train? pass --run DIR")
        spec = RLSpec(str(Path(run)), domain, effort, difficulty, group, prompts, clip, kl_coef, minibatches,
                      micro_batch, temperature=temperature, max_tokens=max_tokens, epochs=epochs,
                      prompt_pool=prompt_pool,
                      partial_lambda=partial_lambda,
                      stale_coef=stale_coef, stale_ratio_cap=stale_ratio_cap, stale_limit=stale_limit)
    spec.validate()
    base = Path(spec.base_run)
    config, tokenizer, encoder = open_base(base)
    trainer = policy_trainer(base, config, RLSource(spec, tokenizer), iterations=iterations,
                             out=str(out or f"{str(base).rstrip('/')}-rl-{spec.domain}-{spec.effort}"), seed=seed,
                             lr=lr, device=device, checkpoint_every=checkpoint_every, progress=progress,
                             resume=resume, log=log, balance=balance)
    if resume is None:
        spec.write(trainer.run_dir)
        log(f"RL on {base} into {trainer.run_dir}: {trainer.data.describe()}")
    rl = RLRun(trainer, spec, encoder, log)
    steps = trainer.args.steps
    pending: dict[str, Any] = {}

    def before() -> None:   # greedy test accuracy before the first iteration
        if eval_n and trainer.step == 0:
            pending.update(_test_accuracy(rl, spec, eval_n, seed, log))

    def annotate(record: dict[str, Any]) -> None:
        record.update(pending)
        pending.clear()
        if trainer.step == steps and eval_n:
            record.update({f"{key}_after": value for key, value in _test_accuracy(rl, spec, eval_n, seed,
                                                                                    log).items()})

    def summary(r: dict[str, Any]) -> str:
        partial = (f"; finished {r['finished']}/{r['trajectories']}, {r['trained']} trained, stale "
                   f"tokens {r['stale_token_fraction']:.2f}" if "finished" in r else "")
        return (f"iteration {r['step']}: reward {r['reward_mean']:.3f} accuracy {r['accuracy']:.3f} length "
                f"{r['completion_tokens']:.0f} clip {r['clip_fraction']:.3f} kl {r['kl']:.4f} rollouts "
                f"{r['rollout_tokens_per_s']:,.0f} tok/s ({r['rollout_s']:.1f} s), update {r['update_s']:.1f} s"
                + partial + "".join(f"; {cell} reward {c['reward_mean']:.3f} length {c['completion_tokens']:.0f}"
                                    for cell, c in r.get("cells", {}).items()))

    records = drive(trainer, rl, summary=summary, progress=progress, log=log, on_iteration=on_iteration,
                    before=before, annotate=annotate)
    plot = plot_rl(metrics_file(trainer), trainer.run_dir / PLOT_FILE)
    if records:
        rate = float(np.median([r["rollout_tokens_per_s"] for r in records]))
        log(f"reward {records[0]['reward_mean']:.3f} (first iteration of this call) -> {records[-1]['reward_mean']:.3f}"
            f" (last); rollouts {rate:,.0f} completion tokens/s (median)")
    log(f"run written to {trainer.run_dir}/: model.safetensors config.json tokenizer.json train_state.* "
        f"metrics.jsonl {RL_FILE}" + (f" {plot.name}" if plot else ""))
    return records


def _test_accuracy(rl: RLRun, spec: RLSpec, n: int, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Greedy accuracy of the current policy on ``n`` test tasks of each of the run's cells (at its difficulty):
    ``{"test_accuracy": the mean over cells}``, with ``"test_accuracy_cells"`` (cell "d:e" -> accuracy) when there
    are several."""
    from kimik3.posttrain.evaluate import confidence_interval, generate_completions

    cells = spec.cells
    tasks = [task for domain, effort in cells for task in make_tasks(domain, "test", n, seed, effort, spec.difficulty)]
    rl.engine.sync(rl.policy)
    rollouts = generate_completions(rl.engine.engine, rl.engine.encoder, tasks, temperature=0.0, seed=seed,
                                    max_tokens=spec.max_tokens)
    scores = score_rollouts(rollouts)
    by_cell = {}
    for c, (domain, effort) in enumerate(cells):
        mine = scores[c * n:(c + 1) * n]
        low, high = confidence_interval(mine)
        by_cell[f"{domain}:{effort}"] = mean = sum(mine) / len(mine)
        log(f"test accuracy {mean:.3f} (95% CI [{low:.3f}, {high:.3f}]) on {n} {domain}/{effort} test tasks")
    out: dict[str, Any] = {"test_accuracy": float(np.mean(list(by_cell.values())))}
    if len(cells) > 1:
        out["test_accuracy_cells"] = by_cell
    return out


__all__ = ["RLRun", "RLSource", "RLSpec", "cell_stats", "fresh_cell_tasks", "iteration_tasks", "plot_rl", "run_rl",
           "spread_over_cells"]
