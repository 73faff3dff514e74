"""Multi-teacher on-policy distillation (``kimik3 mopd``): expert policies, one per (domain, effort) cell, consolidated
into one student that samples on-policy and is rewarded token by token by the teacher of each prompt's cell.

Seed §6's dense reward, for a completion token y_t of a prompt x from cell (d, e)::

    r_opd(y_t) = clip(sg(log π_teacher^(d,e)(y_t | x, y<t) - log π_θ(y_t | e, x, y<t)), -R_max, R_max)

One iteration (``MOPDRun.iteration``):

1. **Prompts**: P train tasks spread over the teachers' cells in turn (prompt k of iteration s is from cell
   (s·P + k) mod C, so every cell gets its share over iterations even when P < C), G completions each.
2. **Rollouts** by the student on the serving engine, exactly as ``kimik3 rl`` does them (``RLRun``'s
   ``RolloutEngine``: weights synced, batched, prefix-cached), with each sampled token's log-probability.
3. **Rewards**: one forward of the cell's teacher (no grad) over each row (prompt + completion) gives the teacher's
   log-probability of every sampled token; minus the student's rollout log-probability (the behaviour policy's,
   the same weights as the update's first minibatch), clipped to [-R_max, R_max]. The reward is a constant of the
   update (stop-gradient): it is computed before the update from the rollout's numbers, never from the graph.
4. **Update**: ``PolicyUpdate.update`` (``RLRun``'s) with the rewards as **per-token advantages** (no group
   normalisation: the reward is already a centred, per-token signal) through the same clipped surrogate
   (``policy_loss.clipped_policy_loss``).
   At ratio 1 the gradient is -E_t[r_t ∇ log π_θ(y_t)], a per-token estimate of the gradient of the reverse KL
   KL(π_θ || π_teacher) (the future tokens' terms dropped, as in on-policy distillation); the clip bounds R_max
   keep a token the student finds very unlikely under the teacher (log-ratio -30, say) from dominating a batch.

The verifiable task reward is *off* by default (``--task-reward-coef 0``): the teachers were trained on it, the
seed's MOPD objective is the dense reward alone, and at tiny scale its group-normalised advantage is zero almost
always (every completion scores 0). With ``--task-reward-coef α > 0`` (needs ``--group >= 2``), α times each
rollout's group-normalised task advantage is added to every token's advantage, as in ``kimik3 rl``.

**Teachers** are runs with a saved model and the student's tokenizer (the reward compares log-probabilities of the
same token ids). A teacher's cell is what its ``rl.json`` records (a ``kimik3 rl`` run); ``--teacher-cells d:e,...``
gives the cells in the teachers' order (and must agree with any rl.json). Two teachers of one cell are refused.

**The run** is ``kimik3 rl``'s (the ``Trainer``: model, optimizer at a constant lr, checkpoints, ``--resume``):
``metrics.jsonl`` (one record per iteration, with per-cell ``cells``: mean r_opd, mean unclipped log-ratio
student - teacher (the on-policy estimate of KL(student || teacher) per token), mean task score and mean
completion tokens), ``mopd.png`` and ``mopd.json`` (student, teachers, cells, settings) that ``--resume`` reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from kimik3.posttrain.driver import POSTTRAIN_BALANCE, drive, metrics_file, open_base, policy_trainer
from kimik3.posttrain.evaluate import score_rollouts
from kimik3.posttrain.policy_loss import group_advantages, make_batch, token_logprobs
from kimik3.posttrain.rl import (RL_FILE, RLRun, RLSource, RLSpec, SettingsFile, check_update_settings,
                                 fresh_cell_tasks, spread_over_cells)
from kimik3.posttrain.rollout import rollout_rows
from kimik3.posttrain.tasks import make_tasks
from kimik3.posttrain.tasks.base import check_domain_effort

MOPD_FILE = "mopd.json"
PLOT_FILE = "mopd.png"
RECIPE = "mopd-clipped-logratio-v1"


def parse_cell(text: str) -> str:
    """``"domain:effort"``, checked (an unknown domain or effort: ValueError)."""
    domain, sep, effort = text.strip().partition(":")
    if not sep:
        raise ValueError(f"a teacher cell is domain:effort (e.g. general:low), got {text!r}")
    check_domain_effort(domain, effort)
    return f"{domain}:{effort}"


def parse_cells(text: str | Sequence[str] | None) -> list[str] | None:
    """``--teacher-cells``: ``"d:e,d:e"`` or a list of ``d:e`` (None: not given)."""
    if text is None:
        return None
    parts = text.split(",") if isinstance(text, str) else list(text)
    return [parse_cell(p) for p in parts if p.strip()]


def recorded_cell(teacher: Path) -> str | None:
    """The (domain, effort) a teacher run records: its ``rl.json``'s; None when it has none."""
    if not (teacher / RL_FILE).is_file():
        return None
    spec = RLSpec.read(teacher)
    if len(spec.cells) > 1:
        raise ValueError(f"teacher {teacher} was trained by RL on a mixture ({spec.label}, its {RL_FILE}): a teacher "
                         "is one (domain, effort) cell's expert")
    return f"{spec.domain}:{spec.effort}"


def resolve_teachers(teachers: Sequence[str | Path], cells: Sequence[str] | None = None) -> list[str]:
    """Each teacher's cell, in order: ``cells`` where given (they must agree with what a teacher records), else the
    teacher's ``rl.json``. Missing directories, unknown and duplicated cells are refused with the teacher named."""
    from kimik3.model.pretrained import has_weights

    if not teachers:
        raise ValueError("--teachers: at least one teacher run is needed")
    paths = [Path(t) for t in teachers]
    for path in paths:
        if not path.is_dir():
            raise FileNotFoundError(f"teacher {path}: no such run directory")
        if not (path / "config.json").is_file() or not has_weights(path):
            raise FileNotFoundError(f"teacher {path}: not a run with a saved model (config.json and weights)")
    if cells is not None and len(cells) != len(paths):
        raise ValueError(f"--teacher-cells gives {len(cells)} cells for {len(paths)} teachers: one per teacher, "
                         "in the same order")
    out: list[str] = []
    owner: dict[str, Path] = {}
    for i, path in enumerate(paths):
        recorded = recorded_cell(path)
        given = parse_cell(cells[i]) if cells is not None else None
        if given is not None and recorded is not None and given != recorded:
            raise ValueError(f"teacher {path} was trained by RL on {recorded} (its {RL_FILE}) but --teacher-cells "
                             f"says {given}")
        cell = given or recorded
        if cell is None:
            raise ValueError(f"teacher {path}: its (domain, effort) is unknown (no {RL_FILE}); pass --teacher-cells "
                             "domain:effort,... in the teachers' order")
        if cell in owner:
            raise ValueError(f"teachers {owner[cell]} and {path} are both for {cell}: one teacher per cell")
        owner[cell] = path
        out.append(cell)
    return out


def opd_rewards(teacher_lp: torch.Tensor, student_lp: torch.Tensor, mask: torch.Tensor, r_max: float) -> torch.Tensor:
    """r_opd per token: clip(sg(teacher - student), -r_max, r_max) where ``mask``, 0 elsewhere ([N, T])."""
    return (teacher_lp.detach() - student_lp.detach()).clamp(-r_max, r_max) * mask


@dataclass(slots=True)
class MOPDSpec(SettingsFile):
    """What ``mopd.json`` records: the student's starting run, the teachers and their cells, the settings."""

    student_run: str
    teachers: list[str] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)     # teachers[i]'s "domain:effort"
    r_max: float = 2.0
    group: int = 2
    prompts: int = 9
    clip: float = 0.2
    minibatches: int = 2
    micro_batch: int = 16
    temperature: float = 1.0
    max_tokens: int | None = None
    difficulty: str = "standard"
    task_reward_coef: float = 0.0

    FILE: ClassVar[str] = MOPD_FILE
    KEY: ClassVar[str] = "mopd"
    COMMAND: ClassVar[str] = "kimik3 mopd"

    # What ``RLRun`` reads of its spec that distillation fixes: no reference KL, one pass, no partial rollouts.
    kl_coef: ClassVar[float] = 0.0
    epochs: ClassVar[int] = 1
    partial_lambda: ClassVar[float] = 1.0
    stale_coef: ClassVar[float] = 0.0
    stale_ratio_cap: ClassVar[float] = 3.0
    stale_limit: ClassVar[int | None] = None

    @property
    def base_run(self) -> str:
        return self.student_run

    def validate(self) -> None:
        if len(self.cells) != len(self.teachers) or not self.teachers:
            raise ValueError("one cell per teacher is needed")
        if len(set(self.cells)) != len(self.cells):
            raise ValueError(f"duplicated teacher cells: {self.cells}")
        for cell in self.cells:
            domain, effort = parse_cell(cell).split(":")
            make_tasks(domain, "train", 1, 0, effort, self.difficulty)     # an unknown difficulty: refused
        if not self.r_max > 0:
            raise ValueError(f"--r-max must be > 0, got {self.r_max}")
        if self.group < 1 or self.prompts < 1:
            raise ValueError(f"--group and --prompts must be >= 1, got {self.group}, {self.prompts}")
        if self.task_reward_coef < 0:
            raise ValueError(f"--task-reward-coef must be >= 0, got {self.task_reward_coef}")
        if self.task_reward_coef > 0 and self.group < 2:
            raise ValueError("--task-reward-coef > 0 needs --group >= 2 (the task advantage compares a group)")
        check_update_settings(self)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([RECIPE, dataclasses.asdict(self)], sort_keys=True).encode()).hexdigest()


class MOPDSource(RLSource):
    """``RLSource`` for distillation: the tokenizer, the fingerprint, a sample prompt of the first cell."""

    def __init__(self, spec: MOPDSpec, tokenizer: Any):
        self.spec, self.tokenizer = spec, tokenizer
        self.fingerprint = spec.fingerprint
        domain, effort = spec.cells[0].split(":")
        self.sample_prompt = make_tasks(domain, "train", 1, 0, effort, spec.difficulty)[0].messages[-1]["content"]

    def describe(self) -> str:
        s = self.spec
        return (f"MOPD from {len(s.teachers)} teachers ({', '.join(s.cells)}): {s.prompts} prompts x {s.group} "
                f"completions per iteration, R_max {s.r_max}")

    def with_tokenizer(self, tokenizer: Any) -> "MOPDSource":
        return MOPDSource(self.spec, tokenizer)


def iteration_tasks(spec: MOPDSpec, seed: int, iteration: int) -> tuple[list, list[int]]:
    """The tasks of ``iteration`` (each repeated ``group`` times, consecutively) and each one's teacher index."""
    def draw(c: int, numbers: list[int]) -> list:
        domain, effort = spec.cells[c].split(":")
        return fresh_cell_tasks(c, domain, effort, len(numbers), seed, iteration, spec.difficulty)

    drawn = spread_over_cells(len(spec.cells), iteration * spec.prompts, spec.prompts, draw)
    return ([task for task, _ in drawn for _ in range(spec.group)],
            [c for _, c in drawn for _ in range(spec.group)])


class MOPDRun(RLRun):
    """``RLRun`` (Trainer, rollout engine, clipped update) with the teachers and the distillation iteration."""

    def __init__(self, trainer: Any, spec: MOPDSpec, encoder: Any, teachers: Sequence[torch.nn.Module],
                 log: Callable[[str], None] = print):
        super().__init__(trainer, spec, encoder, log)
        self.teachers = list(teachers)

    @torch.no_grad()
    def teacher_logprobs(self, batch: Any, row_cells: Sequence[int]) -> torch.Tensor:
        """[N, T] log-probability of each row's targets under the teacher of that row's cell (0 off the rows)."""
        out = torch.zeros_like(batch.old)
        cells = torch.as_tensor(row_cells)
        for c, teacher in enumerate(self.teachers):
            rows = (cells == c).nonzero().flatten()
            for start in range(0, len(rows), self.spec.micro_batch):
                index = rows[start:start + self.spec.micro_batch]
                micro = batch.rows(index)
                with self.trainer._autocast():
                    lp = token_logprobs(teacher, micro.input_ids.to(self.trainer.device),
                                        micro.targets.to(self.trainer.device))
                out[index, :lp.shape[1]] = lp.float().cpu()
        return out

    def iteration(self, step: int, progress: bool = False) -> dict[str, Any]:
        trainer, spec = self.trainer, self.spec
        seed = trainer.args.seed
        record: dict[str, Any] = {"step": step, "total_steps": trainer.total, "lr": trainer.args.lr}
        start = time.perf_counter()
        tasks, task_cells = iteration_tasks(spec, seed, step)
        self.engine.sync(self.policy)
        rollouts, stats = self.engine.rollouts(tasks, seed=(seed * 1_000_003 + step) * 65_536,
                                               temperature=spec.temperature, max_tokens=spec.max_tokens,
                                               progress=progress)
        scores = score_rollouts(rollouts)
        task_adv = (group_advantages(scores, spec.group) if spec.task_reward_coef > 0 else [0.0] * len(rollouts))
        prompts, completions, logprobs, row_cells, row_task_adv = [], [], [], [], []
        for rollout, cell, adv in zip(rollouts, task_cells, task_adv):
            p, c, lp, _ = rollout_rows([rollout], [1.0])    # its turns' rows (every rollout is trained on)
            prompts += p
            completions += c
            logprobs += lp
            row_cells += [cell] * len(p)
            row_task_adv += [adv] * len(p)
        record.update(rollout_s=stats.seconds, rollout_tokens=stats.completion_tokens,
                      rollout_tokens_per_s=stats.tokens_per_s, task_reward=float(np.mean(scores)),
                      completion_tokens=float(np.mean([r.tokens for r in rollouts])))
        cells: dict[str, dict[str, float]] = {}
        for c, name in enumerate(spec.cells):
            mine = [k for k, tc in enumerate(task_cells) if tc == c]
            if mine:
                cells[name] = {"task_reward": float(np.mean([scores[k] for k in mine])),
                               "completion_tokens": float(np.mean([rollouts[k].tokens for k in mine]))}
        batch = None
        if prompts:
            batch = make_batch(prompts, completions, logprobs, [0.0] * len(prompts))
            teacher_lp = self.teacher_logprobs(batch, row_cells)
            mask = batch.mask.float()
            rewards = opd_rewards(teacher_lp, batch.old, mask, spec.r_max)
            log_ratio = (batch.old - teacher_lp) * mask      # student - teacher: per-token reverse-KL estimate
            batch.advantages = rewards + spec.task_reward_coef * torch.tensor(row_task_adv)[:, None] * mask
            row_cell_t = torch.as_tensor(row_cells)
            tokens = max(1.0, float(mask.sum()))
            record.update(opd_reward=float(rewards.sum()) / tokens, kl_to_teacher=float(log_ratio.sum()) / tokens,
                          opd_clipped_fraction=float(((log_ratio.abs() > spec.r_max) & batch.mask).sum()) / tokens)
            for c, name in enumerate(spec.cells):
                here = (row_cell_t == c)
                n = float(mask[here].sum())
                if n:
                    cells[name].update(opd_reward=float(rewards[here].sum()) / n,
                                       kl_to_teacher=float(log_ratio[here].sum()) / n, tokens=int(n))
        else:
            record.update(opd_reward=float("nan"), kl_to_teacher=float("nan"), opd_clipped_fraction=0.0)
        record["cells"] = cells
        record["reward_mean"] = record["opd_reward"]
        update_start = time.perf_counter()
        record.update(self.update(None, None, batch=batch) if batch is not None
                      else self.update([], [], rows=([], [], [], None, [])))
        record["update_s"] = time.perf_counter() - update_start
        record["iteration_s"] = time.perf_counter() - start
        record["elapsed_s"] = time.perf_counter() - trainer.started
        return record


def plot_mopd(metrics_path: Path, out_path: Path) -> Path | None:
    """``mopd.png``: mean r_opd and KL(student || teacher) per cell, completion tokens per cell, rollout tokens/s."""
    from kimik3.train.plot import draw_figure, read_metrics

    records = [r for r in read_metrics(metrics_path) if "opd_reward" in r]
    if not records:
        return None
    names = sorted({name for r in records for name in r.get("cells", {})})

    def series(name: str, key: str) -> tuple[list, list]:
        points = [(r["step"], r["cells"][name][key]) for r in records if key in r.get("cells", {}).get(name, {})]
        return (list(zip(*points)) if points else ([], []))  # type: ignore[return-value]

    def draw(axes) -> None:
        for name in names:
            line, = axes[0].plot(*series(name, "kl_to_teacher"), label=f"{name} KL")
            axes[0].plot(*series(name, "opd_reward"), "--", color=line.get_color())
            axes[1].plot(*series(name, "completion_tokens"), color=line.get_color(), label=name)
        axes[0].set_ylabel("KL to teacher (solid), r_opd (dashed)")
        axes[0].legend(fontsize=7)
        axes[1].set_ylabel("completion tokens")
        axes[1].legend(fontsize=7)
        axes[2].plot([r["step"] for r in records], [r["rollout_tokens_per_s"] for r in records], color="tab:gray")
        axes[2].set_ylabel("rollout tokens/s")
        axes[2].set_xlabel("iteration")
        for ax in axes:
            ax.grid(alpha=0.3)

    return draw_figure(out_path, "the MOPD plot", 3, draw, figsize=(8, 9))


def load_teachers(spec: MOPDSpec, student_config: Any, student_tokenizer: Path, device: Any) -> list[torch.nn.Module]:
    """The teachers' models (eval, no grad), after checking they share the student's vocabulary and tokenizer."""
    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM

    tokenizer_text = student_tokenizer.read_bytes()
    models = []
    for teacher in map(Path, spec.teachers):
        config = K3Config.from_json(teacher / "config.json")
        if config.vocab_size != student_config.vocab_size or not (teacher / "tokenizer.json").is_file() \
                or (teacher / "tokenizer.json").read_bytes() != tokenizer_text:
            raise ValueError(f"teacher {teacher} does not share the student's tokenizer (vocabulary "
                             f"{config.vocab_size} vs {student_config.vocab_size}): the reward compares the "
                             "log-probabilities of the same token ids")
        model = K3ForCausalLM.from_pretrained(teacher, device=device, dtype=torch.float32)
        models.append(model.eval().requires_grad_(False))
    return models


def run_mopd(run: str | Path | None = None, *, teachers: Sequence[str | Path] = (),
             teacher_cells: Sequence[str] | None = None, r_max: float = 2.0, iterations: int = 20, prompts: int = 9,
             group: int = 2, lr: float = 2e-4, clip: float = 0.2, minibatches: int = 2, micro_batch: int = 16,
             max_tokens: int | None = None, difficulty: str = "standard", task_reward_coef: float = 0.0,
             out: str | Path | None = None, resume: str | Path | None = None, seed: int = 0, device: str = "cpu",
             checkpoint_every: str | None = None, balance: str = POSTTRAIN_BALANCE, progress: bool = True,
             log: Callable[[str], None] = print,
             on_iteration: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Distil ``teachers`` into ``run``'s model (new run ``out``, default ``<run>-mopd``), or continue the MOPD run
    ``resume`` up to ``iterations``. Returns this call's iteration records."""
    if iterations < 1:
        raise ValueError(f"--iterations must be >= 1, got {iterations}")
    if resume is not None:
        resume = Path(resume)
        if not resume.is_dir():
            raise FileNotFoundError(f"--resume {resume}: no such run directory")
        spec = MOPDSpec.read(resume)
        resolve_teachers(spec.teachers, spec.cells)     # the teachers are still there, with the same cells
    else:
        if run is None:
            raise ValueError("which student run to train? pass --run DIR")
        cells = resolve_teachers(teachers, teacher_cells)
        spec = MOPDSpec(str(Path(run)), [str(Path(t)) for t in teachers], cells, r_max, group, prompts, clip,
                        minibatches, micro_batch, max_tokens=max_tokens, difficulty=difficulty,
                        task_reward_coef=task_reward_coef)
    spec.validate()
    base = Path(spec.student_run)
    config, tokenizer, encoder = open_base(base)
    trainer = policy_trainer(base, config, MOPDSource(spec, tokenizer), iterations=iterations,
                             out=str(out or f"{str(base).rstrip('/')}-mopd"), seed=seed, lr=lr, device=device,
                             checkpoint_every=checkpoint_every, progress=progress, resume=resume, log=log,
                             balance=balance)
    teacher_models = load_teachers(spec, config, base / "tokenizer.json", trainer.device)
    if resume is None:
        spec.write(trainer.run_dir)
        log(f"MOPD of {base} into {trainer.run_dir}: {trainer.data.describe()}")
    mopd = MOPDRun(trainer, spec, encoder, teacher_models, log)

    def summary(r: dict[str, Any]) -> str:
        per_cell = "; ".join(f"{name} r {c.get('opd_reward', float('nan')):.3f} kl "
                             f"{c.get('kl_to_teacher', float('nan')):.3f} len {c['completion_tokens']:.0f}"
                             for name, c in r["cells"].items())
        return (f"iteration {r['step']}: r_opd {r['opd_reward']:.3f} kl_to_teacher {r['kl_to_teacher']:.3f} task "
                f"{r['task_reward']:.3f} clip {r['clip_fraction']:.3f} rollouts {r['rollout_tokens_per_s']:,.0f} tok/s "
                f"({r['rollout_s']:.1f} s), update {r['update_s']:.1f} s [{per_cell}]")

    records = drive(trainer, mopd, summary=summary, progress=progress, log=log, on_iteration=on_iteration)
    plot = plot_mopd(metrics_file(trainer), trainer.run_dir / PLOT_FILE)
    if records:
        log(f"kl_to_teacher {records[0]['kl_to_teacher']:.3f} (first iteration of this call) -> "
            f"{records[-1]['kl_to_teacher']:.3f} (last); r_opd {records[0]['opd_reward']:.3f} -> "
            f"{records[-1]['opd_reward']:.3f}")
    log(f"run written to {trainer.run_dir}/: model.safetensors config.json tokenizer.json train_state.* "
        f"metrics.jsonl {MOPD_FILE}" + (f" {plot.name}" if plot else ""))
    return records


__all__ = ["MOPDRun", "MOPDSource", "MOPDSpec", "iteration_tasks", "load_teachers", "opd_rewards", "parse_cells",
           "plot_mopd", "resolve_teachers", "run_mopd"]
