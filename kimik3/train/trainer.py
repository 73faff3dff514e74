"""The training loop behind ``kimik3 train``, written for one process.

One run: corpus -> tokenizer (cached) -> model -> per-head Muon + AdamW -> Quantile Balancing of
the router biases -> cosine schedule with context-length stages -> checkpoints, metrics, plot.

Exact resume: the batch of step s is a pure function of (seed, s) (``loader.batch_at``), the
model, optimizer and router biases are checkpointed, and no other state carries across steps, so
``--resume`` after an interruption reproduces the uninterrupted run's losses bit for bit on CPU.
Checkpoints come every 60 s of wall time by default (``--checkpoint-every``: a duration or a step
count), so a kill loses about a minute of work at most; a run killed before its first checkpoint
restarts from step 0 with the arguments it saved in ``run.json``.

``--time-budget`` (unless ``--steps`` fixes the count) is a deadline for the whole run, counted from
the Trainer's creation: data, tokenizer and model, planning, steps, evaluations, checkpoints, the
final checkpoint, plot and sample. ``BudgetPlanner`` (``train/budget.py``) plans the number of steps
(``total``, which the cosine schedule, its warmup and the context stages read) from timings of this
machine, then re-plans it from the measured cost of the steps (optimizer, balancer, evaluations,
checkpoints included) until half the budget is used (by then the second context stage has been
measured, not only estimated); from then on the plan is fixed, so a checkpoint taken after that point
resumes exactly. The plan (total, fixed or not, budget used, cost estimates) is saved with every
checkpoint and ``--resume`` continues it. As a last resort a run stops early when one more step would
leave no time for the end of the run.

Several processes (launched by torchrun, or ``kimik3 train --nproc N`` which relaunches through it;
see docs/parallel.md) run this same loop. Everything that differs goes through the run's
``ParallelContext`` (``kimik3.parallel.context``): the model is parallelised (FSDP2, MoonEP, KCP),
each rank trains on its part of the step's global batch, which is exactly the single-process batch
of that step, and the logged loss is the global one, so the losses match a single-process run up
to reduction order. Rank 0 alone writes metrics and plots. Checkpoints: a single process writes the
single-file format (``train/checkpoint.py``: what ``from_pretrained``, ``generate`` and ``serve`` read);
several ranks write the sharded one (``train/dcp_checkpoint.py``), each rank its own shards, with no
gather. Resuming reads either format on any number of ranks, so either kind of run resumes the other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kimik3.config.schema import K3Config
from kimik3.model.moe import RoutingStats
from kimik3.model.vision import causal_lm_class
from kimik3.optim.schedule import ContextStage, cosine_lr, parse_stages, seq_len_at
from kimik3.parallel.activation_checkpoint import checkpoint_mode
from kimik3.parallel.context import ParallelContext, training_context
from kimik3.parallel.mesh import ParallelDims
from kimik3.tokenizer import EOS, load_tokenizer_from_json
from kimik3.train import budget
from kimik3.train.args import RUN_FILE, TrainArgs, resolve_model_config, write_run_args
from kimik3.train.checkpoint import (
    STATE_JSON_FILE,
    CheckpointError,
    adopt_checkpoint,
    save_checkpoint,
)
from kimik3.train.budget import BudgetedRun, BudgetPlanner
from kimik3.train.checkpoint_clock import DEFAULT_CHECKPOINT_EVERY, CheckpointClock, parse_checkpoint_every
from kimik3.train.dcp_checkpoint import load_run_checkpoint, save_dcp_checkpoint
from kimik3.train.run_dir import METRICS_FILE, prepare_run_dir, resume_point, truncate_metrics
from kimik3.train.source import CorpusSource, DataSource, unigram_loss

SAMPLE_PROMPT = CorpusSource.sample_prompt

__all__ = ["RunSummary", "TrainArgs", "Trainer", "TrainingError", "next_token_loss",
           "unigram_loss"]


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. repeated non-finite losses); the last good checkpoint is intact."""


@dataclass(slots=True)
class RunSummary:
    run_dir: Path
    steps: int
    final_loss: float
    final_val_loss: float | None
    unigram_val_loss: float
    tokens_per_s: float
    sample: str
    history: list[dict[str, Any]] = field(default_factory=list)


def routing_imbalance(routing: tuple[RoutingStats | None, ...]) -> float | None:
    """Mean over the routers that ran of max / mean expert load (this rank's tokens); None without routers."""
    values = []
    for stats in routing:
        if stats is not None:
            loads = stats.loads_E.float()
            values.append(float(loads.max() / loads.mean().clamp_min(1e-9)))
    return float(np.mean(values)) if values else None


class Trainer(BudgetedRun):
    """Builds everything from ``TrainArgs`` and runs the loop (``run()``).

    ``parallel``: the parallel degrees of a distributed run (default: dp = world size); ``context``
    instead gives the ``ParallelContext`` itself (default: ``training_context``, which joins the
    process group torchrun describes, if any). ``activation_checkpointing``: a mode of
    ``kimik3.parallel.activation_checkpoint`` ("none", "full", "selective", "every:N"). ``source``: the data
    (default: ``--data`` as a pre-training corpus, ``CorpusSource``); supervised fine-tuning gives its own.
    """

    def __init__(self, args: TrainArgs, resume: str | Path | None = None,
                 model_factory: Callable[[K3Config, torch.device, int], torch.nn.Module] | None = None,
                 log: Callable[[str], None] = print, parallel: ParallelDims | None = None,
                 activation_checkpointing: str | bool = "none", context: ParallelContext | None = None,
                 source: DataSource | None = None):
        self.created = budget._now()   # a time budget counts from here: data, tokenizer and model included
        self.resume_dir = Path(resume) if resume is not None else None
        self.resume_checkpoint: Path | None = None  # None on resume: restart from step 0 (run.json)
        self.damaged_checkpoints: dict[str, str] = {}
        if self.resume_dir is not None:
            point = resume_point(self.resume_dir, args)
            args, self.resume_checkpoint, self.damaged_checkpoints = point.args, point.checkpoint, point.damaged
        if args.checkpoint_every is None:
            args.checkpoint_every = DEFAULT_CHECKPOINT_EVERY  # saved explicitly with the run
        args.validate()
        self.activation_checkpointing = checkpoint_mode(activation_checkpointing)  # checked before any work
        self.args = args
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no GPU")
        if context is not None and parallel is not None:
            raise ValueError("give the parallel degrees (parallel=) or a context (context=), not both")
        self.ctx = context if context is not None else training_context(device, parallel)
        self.device = self.ctx.device
        self.log = log if self.ctx.is_main else (lambda _: None)
        if not self.ctx.is_main:
            args.progress = False
        self.model_config = resolve_model_config(args)
        self.stages = parse_stages(args.stages)
        # The shapes a step can take (one when --seq-len fixes it): the budget's cost model has one entry each.
        self.cost_stages = self.stages if args.seq_len is None else [ContextStage(0.0, args.seq_len)]
        self.planner: BudgetPlanner | None = None       # a run fitted to --time-budget (not --steps)
        self.saved_plan: dict[str, Any] | None = None   # the plan of the checkpoint resumed from
        self.total = args.steps or 0

        # Data first: a bad data path fails before any model is built (and a missing tower file before both).
        if args.vision_init is not None and self.resume_checkpoint is None and not Path(args.vision_init).is_file():
            raise FileNotFoundError(f"--vision-init {args.vision_init}: no such file")
        if source is None and args.vision:   # image-text samples with the text corpus (train/vision_data.py)
            from kimik3.train.vision_data import VisionSource, bind_image_token

            if self.dims.world > 1:
                raise ValueError("--vision trains on one process (its images are not sharded across ranks)")
            source = VisionSource.load(args.data, self.model_config.vocab_size, self.ctx, seed=args.seed,
                                       text_fraction=args.vision_text_fraction, blank=args.vision_blank)
            self.model_config = bind_image_token(self.model_config, source)
        self.data: DataSource = source or CorpusSource.load(args.data, self.model_config.vocab_size, self.ctx)
        self.tokenizer = self.data.tokenizer
        self.unigram = self.data.unigram

        if self.device.type == "cpu":
            # Decayed KDA states and tiny gradients reach subnormal floats, on which x86 takes a
            # microcode path up to ~100x slower; flushing them to zero costs nothing measurable.
            torch.set_flush_denormal(True)
        torch.manual_seed(args.seed)
        factory = model_factory or (lambda cfg, dev, seed: causal_lm_class(cfg)(cfg, device=dev, dtype=torch.float32,
                                                                                seed=seed))
        self.model = factory(self.model_config, self.device, args.seed)
        if args.vision_init is not None and self.resume_checkpoint is None:   # a checkpoint brings its own tower
            self._load_vision_init(args.vision_init)
        self.model.train()
        self.ctx.wrap_model(self.model, activation_checkpointing=self.activation_checkpointing,
                            ep_planner=args.ep_planner)
        self.compiled = self._compile_blocks(args)
        from kimik3.optim import build_param_groups

        # The step replayed as a CUDA graph (train/graphed_step.py) where it can be: one CUDA device in one process
        # (not a process group, even of one rank: its model is wrapped for FSDP), batches of fixed shapes (a
        # multimodal batch's images vary). Its AdamW keeps its step count on the device.
        graphed = (args.cuda_graph and self.device.type == "cuda" and type(self.ctx) is ParallelContext
                   and not args.vision)
        self.optimizer = build_param_groups(self.model, lr=args.lr, weight_decay=args.weight_decay,
                                            capturable=graphed)
        self.balancer = self._build_balancer()
        self.step = 0
        self.nonfinite_total = 0
        self.fwd_bwd_s = 0.0   # the last step's forward+backward (and clipping), seconds
        self.say = self.log    # the loop's lines (the progress bar's write while it shows)
        self.clock = CheckpointClock(parse_checkpoint_every(args.checkpoint_every), self.log)
        if args.checkpoint_async and self.dims.world == 1:
            raise ValueError("--checkpoint-async writes sharded checkpoints in the background, which runs on more "
                             "than one rank write; this run has one process (its checkpoint is one file)")
        self.pending_save: Future | None = None   # an asynchronous checkpoint still being written
        self.run_dir = prepare_run_dir(args, self.model_config.name, self.resume_dir is not None, self.ctx, self.log)
        if self.resume_dir is not None:
            self._restore()
        self.graphed = None
        if graphed:
            from kimik3.train.graphed_step import GraphedTrainStep

            self.graphed = GraphedTrainStep(self)

    def _compile_blocks(self, args: TrainArgs) -> bool:
        """torch.compile every block (``parallel/compile.py``) where asked, by default on a CUDA device in one
        process. The CPU's blocks run the chunked torch KDA, whose in-place writes through views AOTAutograd
        refuses to trace."""
        one_process = type(self.ctx) is ParallelContext
        if args.compile is None:
            wanted = self.device.type == "cuda" and one_process
        elif args.compile and not one_process:
            raise ValueError("--compile compiles the blocks of a one-process run; a process group's model is "
                             "wrapped for FSDP / expert parallelism, which compiled blocks are not tested under: "
                             "drop --compile")
        elif args.compile and self.device.type != "cuda":
            raise ValueError("--compile needs --device cuda: on the CPU the blocks run the chunked torch KDA, whose "
                             "in-place writes through views torch.compile cannot trace; drop --compile")
        else:
            wanted = args.compile
        if wanted:
            from kimik3.parallel.compile import apply_compile

            apply_compile(self.model)
        return wanted

    def _step_kind(self, args: TrainArgs) -> str:
        blocks = ", blocks compiled (--no-compile: eager)" if self.compiled else ""
        if self.graphed is not None:
            return f"replayed as a CUDA graph (one capture per batch shape; --no-cuda-graph: eager){blocks}"
        if self.device.type != "cuda":
            return f"eager on {self.device.type}{blocks}"
        reason = ("--no-cuda-graph" if not args.cuda_graph else "a process group" if type(self.ctx) is not
                  ParallelContext else "multimodal batches vary in shape")
        return f"eager on cuda ({reason}){blocks}"

    @property
    def dims(self) -> ParallelDims:
        return self.ctx.dims

    # ------------------------------------------------------------------ setup helpers
    def _build_balancer(self):
        routers = self.model.routers() if hasattr(self.model, "routers") else []
        if not routers or self.args.balance == "none":
            return None
        if self.args.balance == "sign":
            from kimik3.train.balance import SignBalancer

            return SignBalancer(routers, all_reduce=self.ctx.sum_counts)
        from kimik3.train.balance import QuantileBalancer

        return QuantileBalancer(routers, rate=self.args.qb_rate, all_reduce=self.ctx.sum_counts)

    def _train_state(self, optimizer: bool = True) -> dict[str, Any]:
        """What a checkpoint stores besides the weights; ``optimizer``: with the (gathered) optimizer state,
        which the sharded format stores sharded instead."""
        return {
            "args": dataclasses.asdict(self.args),
            **({"optimizer": self.ctx.full_optimizer_state(self.optimizer)} if optimizer else {}),
            "torch_rng": torch.get_rng_state(),
            "nonfinite_total": self.nonfinite_total,
            "corpus_fingerprint": self.data.fingerprint,
            # The number of steps (the schedule reads it) and, for a budgeted run, whether it may still
            # change, the budget used so far and the cost model: --resume continues with them.
            "plan": (self.planner.state(self.planner.used()) if self.planner is not None
                     else {"total": self.total, "frozen": True}),
        }

    def _restore(self) -> None:
        if self.resume_checkpoint is None:
            if self.ctx.is_main:
                truncate_metrics(self.run_dir, 0)
            self.ctx.barrier()
            self.log(f"{self.run_dir} has no checkpoint (it was stopped before its first one): restarting it "
                     f"from step 0 with the arguments saved in {self.run_dir / RUN_FILE}")
            return
        if self.ctx.is_main:
            adopt_checkpoint(self.run_dir, self.resume_checkpoint, self.damaged_checkpoints,
                             warn=lambda message: self.log(f"warning: {message}"))
        self.ctx.barrier()
        step, state, tokenizer_json = load_run_checkpoint(self.run_dir, self.resume_checkpoint, self.model,
                                                          self.optimizer)
        if state.get("corpus_fingerprint") != self.data.fingerprint:
            raise CheckpointError(f"{self.run_dir / STATE_JSON_FILE}: the data changed since this run was "
                                  "checkpointed; resuming needs the same corpus")
        saved_tokenizer = load_tokenizer_from_json(tokenizer_json, self.run_dir / "tokenizer.json")
        if saved_tokenizer.get_vocab_size() > self.model_config.vocab_size:
            raise CheckpointError(f"{self.run_dir / 'tokenizer.json'}: vocabulary of "
                                  f"{saved_tokenizer.get_vocab_size()} exceeds the model's "
                                  f"{self.model_config.vocab_size}")
        if saved_tokenizer.to_str() != self.tokenizer.to_str():  # re-encode with the run's own tokenizer
            self.data = self.data.with_tokenizer(saved_tokenizer)
            self.tokenizer = saved_tokenizer
        torch.set_rng_state(state["torch_rng"])
        self.nonfinite_total = int(state["nonfinite_total"])
        plan = state.get("plan")   # absent from older checkpoints: their args hold the planned --steps
        self.saved_plan = plan if isinstance(plan, dict) and "costs" in plan else None
        self.step = step
        if self.ctx.is_main:
            truncate_metrics(self.run_dir, step)
        self.ctx.barrier()
        self.log(f"resumed {self.run_dir} at step {step} from {self.resume_checkpoint.relative_to(self.run_dir)}")

    def _load_vision_init(self, path: str) -> None:
        """Start the vision tower from a tower file (``kimik3.model.vision.contrastive.save_tower``); the text
        model and the projector keep their seeded initialisation."""
        from kimik3.model.vision.contrastive import load_tower

        tower = getattr(self.model, "vision_tower", None)
        if tower is None:
            raise ValueError(f"--vision-init {path}: the model {self.model_config.name!r} has no vision tower")
        load_tower(path, tower)
        self.log(f"vision tower initialised from {path} ({sum(p.numel() for p in tower.parameters()):,} parameters)")

    # ------------------------------------------------------------------ one step
    def batch_shape(self, step: int, total: int) -> tuple[int, int]:
        return self.shape_for(self.args.seq_len or seq_len_at(step, total, self.stages))

    def shape_for(self, seq: int) -> tuple[int, int]:
        return self.args.batch_size or max(1, self.args.tokens_per_step // seq), seq

    def _autocast(self, cache_enabled: bool = True):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
        return torch.autocast("cpu", enabled=False)

    def train_step(self, step: int, total: int) -> dict[str, Any]:
        batch, seq = self.batch_shape(step, total)
        # This rank's part of the global batch: together the ranks train on the very batch a single
        # process would, and the global loss is the single-process loss.
        inputs, labels, images = self._draw(step, batch, seq)
        lr_scale = cosine_lr(step, total, 1.0, max(1, round(self.args.warmup_fraction * total)),
                             self.args.min_lr_ratio)
        if self.graphed is not None:
            return self.graphed.train_step(step, total, (batch, seq), inputs, labels, lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_scale

        start = budget._now()
        with self._autocast():
            out = self.model(inputs, labels=labels, **images)
        if self.balancer is not None:
            self.balancer.observe(out.routing)   # bins the scores, then drops them before backward
        loss = out.loss
        global_loss = self.ctx.global_loss(loss.detach())  # one verdict for every rank
        finite = bool(torch.isfinite(global_loss))
        grad_norm = None
        if finite:
            self.ctx.backward_loss(loss).backward()
            grad_norm = float(self.ctx.clip_grad_norm(self.model.parameters(), self.args.grad_clip))
            finite = math.isfinite(grad_norm)
        self.fwd_bwd_s = budget._now() - start   # (synchronised by the loss's and the norm's reads)
        if finite:
            self.optimizer.step()
            balance = self.balancer.step() if self.balancer is not None else {}
        else:
            self.nonfinite_total += 1
            balance = self.balancer.discard() if self.balancer is not None else {}
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = max(budget._now() - start, 1e-9)
        split = None
        if out.main_loss is not None and out.mtp_loss is not None:
            split = (float(self.ctx.global_loss(out.main_loss.detach())),
                     float(self.ctx.global_loss(out.mtp_loss.detach())))
        load = (balance["load_max_over_mean_mean"] if "load_max_over_mean_mean" in balance
                else routing_imbalance(getattr(out, "routing", ())))
        return self.step_record(step, total, (batch, seq), lr_scale, elapsed, float(global_loss), finite, grad_norm,
                                split, load)

    def step_record(self, step: int, total: int, shape: tuple[int, int], lr_scale: float, elapsed: float,
                    loss: float, finite: bool, grad_norm: float | None, split: tuple[float, float] | None,
                    load: float | None) -> dict[str, Any]:
        """A step's line of metrics.jsonl (what the progress bar, the plot and the summary read): ``grad_norm``
        None when the step did not get that far, ``split`` the (main, MTP) losses when the model reports them."""
        batch, seq = shape
        record: dict[str, Any] = {"step": step, "total_steps": total, "seq_len": seq, "batch_size": batch,
                                  "lr": self.args.lr * lr_scale}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm
        record.update(loss=loss, tokens_per_s=batch * seq / elapsed, step_time_s=elapsed,
                      elapsed_s=budget._now() - self.started, skipped=not finite, nonfinite_total=self.nonfinite_total)
        if split is not None:
            record.update(main_loss=split[0], mtp_loss=split[1])
        record["expert_load_max_over_mean"] = load
        return record

    def _draw(self, step: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's (inputs, labels) of ``step`` on the device, and the model's image inputs (a multimodal
        source's ``pixel_values`` and ``image_grid_hw``; none from a text source)."""
        drawn = self.data.batch_at(step, self.args.seed, batch, seq)
        inputs, labels = self.ctx.shard_batch(*drawn[:2])
        images = {k: v.to(self.device) for k, v in drawn[2].items()} if len(drawn) > 2 else {}
        return inputs.to(self.device), labels.to(self.device), images

    @torch.no_grad()
    def evaluate(self) -> float:
        was_training = self.model.training
        self.model.eval()
        seq = self.args.seq_len or self.stages[-1].seq_len
        inputs, labels = self.data.eval_windows(seq, self.args.eval_windows)
        losses = []
        for start in range(0, inputs.shape[0], 4):
            # Every dp rank evaluates the same windows.
            window, target = self.ctx.shard_sequence(inputs[start:start + 4], labels[start:start + 4])
            with self._autocast():
                out = self.model(window.to(self.device), labels=target.to(self.device))
            loss = out.main_loss if out.main_loss is not None else out.loss
            losses.append(float(self.ctx.global_loss(loss)))
        self.model.train(was_training)
        return float(np.mean(losses))

    # ------------------------------------------------------------------ the loop
    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunSummary:
        """Train to ``args.steps``, or to the end of the time budget (see ``BudgetPlanner``); ``on_step``
        sees each record."""
        self.started = budget._now()
        a = self.args
        self.total = total = self.plan_steps()
        if self.ctx.is_main:
            write_run_args(self.run_dir, a)  # from here on, --resume can restart the run
        if self.step >= total:
            planned = f"--steps {total}" if a.steps is not None else f"the {total} steps planned"
            self.log(f"{self.run_dir} is already at step {self.step} >= {planned}: nothing to do")
        elif self.planner is not None and self.step > 0:   # a resumed budgeted run: is there time left?
            line = self.planner.last_resort(self.step, total, self.planner.used(), pending_eval=False)
            stop = self.ctx.broadcast_int(int(line is not None))
            if stop:
                self.log(f"{line or ''}; train further with --resume {self.run_dir} --steps N")
                self.total = self.planner.total = total = self.step
        self.log(f"data: {self.data.describe()}; unigram val loss {self.unigram:.3f}")
        self.log(f"training step: {self._step_kind(a)}")
        metrics_path = self.run_dir / METRICS_FILE
        history: list[dict[str, Any]] = []
        recent: deque[float] = deque(maxlen=10)   # next-token losses: the bar's, the summary's, the plot's smoothing
        consecutive_bad = 0
        last_val = None
        progress = _progress(total, self.step, a.progress)
        # The planner's lines: above the progress bar rather than glued to it.
        self.say = progress.write if a.progress and self.log is print else self.log
        first_step = self.step
        self.clock.restart()
        mark, aside = budget._now(), 0.0   # the last planning point; evaluations and checkpoints since then
        try:
            with (open(metrics_path, "a") if self.ctx.is_main else open(os.devnull, "w")) as metrics_file:
                while self.step < total:
                    record = self.train_step(self.step, total)
                    consecutive_bad = consecutive_bad + 1 if record["skipped"] else 0
                    if consecutive_bad >= a.max_nonfinite:
                        raise TrainingError(
                            f"{consecutive_bad} non-finite losses in a row at step {self.step}: stopping. The last "
                            f"good checkpoint is intact in {self.run_dir}; try a lower --lr.")
                    self.step += 1
                    if self.planner is not None:
                        now = budget._now()
                        if self.step - first_step > 1:   # the first step of a process warms up: not a measure
                            self.planner.costs.measure_step(self.planner.stage(record["step"], total),
                                                            self.fwd_bwd_s, now - mark - aside - self.fwd_bwd_s)
                        mark, aside = now, 0.0
                        total = self._replan(total, progress, first_step)
                    if self.step % a.eval_every == 0 or self.step == total:
                        start = budget._now()
                        last_val = self.evaluate()
                        aside += self._measured("eval", start)
                        record["val_loss"] = last_val
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                    history.append(record)
                    if not record["skipped"]:
                        recent.append(next_token_loss(record))
                    progress.update(1)
                    progress.set_postfix(_postfix(record, last_val, recent), refresh=False)
                    # No checkpoint in the middle of a run of skipped steps: the last one stays the last good one.
                    if self.step < total and consecutive_bad == 0 and self._checkpoint_due():
                        start = budget._now()
                        self.save()
                        aside += self._measured("save", start)
                    if on_step is not None:
                        on_step(record)
        finally:
            progress.close()
            self._wait_for_save()   # whatever ended the loop, no checkpoint is left half-written behind it
        if self.step > first_step:  # a resumed run that had nothing to do keeps its checkpoint as is
            self.save()
            self._wait_for_save()
        from kimik3.train.plot import plot_run

        plot_path = (plot_run(metrics_path, self.run_dir / "loss.png", unigram=self.unigram)
                     if self.ctx.is_main else None)
        sample = self.sample(self.data.sample_prompt)
        done = [r for r in history if not r["skipped"]]
        tokens_per_s = float(np.median([r["tokens_per_s"] for r in done])) if done else 0.0
        # The next-token loss (the optimised loss adds the weighted MTP term), comparable with val; the
        # progress bar showed the same average, loss.png its smoothed curve.
        final_loss = float(np.mean(recent)) if recent else float("nan")
        if history:
            self.log(f"final train loss {final_loss:.3f} (next-token, last 10 steps), val loss {last_val:.3f} "
                     f"(unigram baseline {self.unigram:.3f}), {tokens_per_s:,.0f} tokens/s")
        self.log(f"sample (temperature 0.8, prompt {self.data.sample_prompt!r}):\n{self.data.sample_prompt}{sample}")
        if self.planner is not None:
            self.log(f"time: {self.planner.used():.0f} s of the {a.time_budget_s:.0f} s budget, {self.step} steps")
        weights = "model shards (dcp_index.json)" if self.dims.world > 1 else "model.safetensors"
        self.log(f"run written to {self.run_dir}/: {weights} config.json tokenizer.json "
                 f"train_state.* metrics.jsonl {plot_path.name if plot_path else ''}")
        return RunSummary(self.run_dir, self.step, final_loss, last_val, self.unigram, tokens_per_s, sample, history)

    def _measured(self, kind: str, start: float) -> float:
        """Seconds since ``start``, which an evaluation or a checkpoint took; the budget's cost model learns them."""
        seconds = budget._now() - start
        if self.planner is not None:
            self.planner.costs.measure(kind, seconds)
        return seconds

    def _checkpoint_due(self) -> bool:
        due = self.clock.due(self.step)
        if self.clock.timed:
            due = bool(self.ctx.broadcast_int(int(due)))  # rank 0's clock decides for every rank
        return due

    def save(self) -> None:
        """Write a checkpoint. One process: the single-file format. Several ranks: the sharded format, each
        rank writing its own shards (rank 0 adds the rest of the state); all wait for it to be published, or
        with ``--checkpoint-async`` only for the state's copy to host memory (the writing goes on in the
        background; the next save and the end of the run wait for it).

        Pruning keeps the checkpoint this run resumed from (verified intact) and drops the damaged
        ones it skipped."""
        self._wait_for_save()
        start = time.monotonic()
        pruning = {"protect": [self.resume_checkpoint.name] if self.resume_checkpoint is not None else [],
                   "corrupt": set(self.damaged_checkpoints)}
        if self.dims.world > 1:
            saved = save_dcp_checkpoint(self.run_dir, self.step, self.model, self.optimizer, self.tokenizer.to_str(),
                                        self._train_state(optimizer=False), async_save=self.args.checkpoint_async,
                                        **pruning)
            self.pending_save = saved if self.args.checkpoint_async else None
        else:
            weights = self.ctx.full_model_state(self.model)   # None: the writer reads the model itself
            state = self._train_state()
            if self.ctx.is_main:
                save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer.to_str(), state,
                                weights=weights, **pruning)
        self.ctx.barrier()
        self.clock.written(time.monotonic() - start)
        self.damaged_checkpoints = {}  # that save's pruning deleted them; their names may now be good ones

    def _wait_for_save(self) -> None:
        """Wait until the asynchronous checkpoint in flight, if any, is published (re-raising its failure)."""
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.result()

    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int = 80) -> str:
        """A seeded sampled completion (temperature 0.8, top-p 0.95): greedy decoding of a small
        model mostly repeats one line, which shows less of what it learned."""
        if not hasattr(self.model, "generate"):
            return ""
        if not self.ctx.can_generate:
            return "(no sample: generation does not run under context parallelism)"
        ids = torch.tensor([self.tokenizer.encode(prompt).ids], device=self.device)
        eos = self.tokenizer.token_to_id(EOS)
        generator = torch.Generator(device=self.device).manual_seed(self.args.seed)
        # Decoding calls the blocks with a cache, a token at a time: compiled blocks (--compile) would compile
        # again for those calls, for one short sample; they run their eager code instead.
        with torch.compiler.set_stance("force_eager"):
            out = self.model.generate(ids, max_new_tokens, temperature=0.8, top_p=0.95, eos_token_id=eos,
                                      generator=generator)
        return self.tokenizer.decode(out[0, ids.shape[1]:].tolist())


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def next_token_loss(record: dict[str, Any]) -> float:
    """A step's next-token loss: ``main_loss`` when the model has MTP (the optimised ``loss`` then adds its
    weighted term), else ``loss``. What the progress bar, the final summary and loss.png show."""
    return record.get("main_loss", record["loss"])


def _postfix(record: dict[str, Any], val: float | None, recent: Sequence[float] = ()) -> dict[str, str]:
    """The progress bar's figures. ``loss``: the next-token loss averaged over ``recent`` (the last 10
    steps' next-token losses; this step's when empty), the final summary's train loss and loss.png's
    smoothed curve."""
    loss = sum(recent) / len(recent) if recent else next_token_loss(record)
    out = {"loss": f"{loss:.3f}", "val": f"{val:.3f}" if val is not None else "-",
           "tok/s": f"{record['tokens_per_s']:,.0f}", "lr": f"{record['lr']:.1e}"}
    imbalance = record.get("expert_load_max_over_mean")
    if imbalance is not None and math.isfinite(imbalance):
        out["load"] = f"{imbalance:.2f}"
    return out
