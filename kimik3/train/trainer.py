"""The single-machine training loop behind ``kimik3 train``.

One run: corpus -> tokenizer (cached) -> model -> per-head Muon + AdamW -> Quantile Balancing of
the router biases -> cosine schedule with context-length stages -> checkpoints, metrics, plot.

Exact resume: the batch of step s is a pure function of (seed, s) (``loader.batch_at``), the
model, optimizer and router biases are checkpointed, and no other state carries across steps, so
``--resume`` after an interruption reproduces the uninterrupted run's losses bit for bit on CPU.
Checkpoints come every 60 s of wall time by default (``--checkpoint-every``: a duration or a step
count), so a kill loses about a minute of work at most; a run killed before its first checkpoint
restarts from step 0 with the arguments it saved in ``run.json``.

Distributed (launched by torchrun, or ``kimik3 train --nproc N`` which relaunches through it; see
docs/parallel.md): every rank builds the same model, ``kimik3.parallel.parallelize`` shards it,
and each data-parallel rank trains on its own rows of the step's global batch, which is exactly
the single-process batch of that step; the logged loss is averaged over the ranks, so the losses
match a single-process run up to reduction order. Rank 0 alone writes metrics, plots and
checkpoints; checkpoints hold the full (gathered) state, in the single-process format, so either
kind of run resumes the other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kimik3.config.schema import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.optim.clip import clip_grad_norm
from kimik3.optim.schedule import cosine_lr, parse_stages, seq_len_at
from kimik3.parallel.mesh import ParallelDims
from kimik3.train.checkpoint import (
    CHECKPOINT_TEMPORARIES,
    POINTER,
    STATE_JSON_FILE,
    STORE,
    CheckpointError,
    adopt_checkpoint,
    checkpoint_dirs,
    full_model_state,
    full_optimizer_state,
    intact_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    read_state_entry,
    remove_temporaries,
    save_checkpoint,
)
from kimik3.files import temporary_pattern, write_text_atomic
from kimik3.train.checkpoint_clock import DEFAULT_CHECKPOINT_EVERY, CheckpointClock, parse_checkpoint_every
from kimik3.train.data import Corpus, load_corpus
from kimik3.train.loader import batch_at, eval_windows
from kimik3.train.plot import parse_record
from kimik3.tokenizer import EOS, load_tokenizer_from_json
from kimik3.train.tokenizer import encode_documents, tokenize_corpus

SAMPLE_PROMPT = "def fibonacci(n):\n"
RUN_FILE = "run.json"      # the run's arguments, written before its first step
METRICS_FILE = "metrics.jsonl"
# The temporaries an interrupted write leaves in a run directory (write_text_atomic's and plot_run's),
# removed when the run starts again; the checkpoints' own are in CHECKPOINT_TEMPORARIES.
RUN_TEMPORARIES = (*CHECKPOINT_TEMPORARIES, *((".", temporary_pattern(name)) for name in (RUN_FILE, METRICS_FILE)),
                   (".", r"\.loss\.png\.tmp\.png"))


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. repeated non-finite losses); the last good checkpoint is intact."""


@dataclass(slots=True)
class TrainArgs:
    """Everything that defines a run; saved in ``run.json`` before the first step and with every
    checkpoint, and restored by ``--resume``."""

    preset: str = "tiny"
    config_path: str | None = None
    data: str | None = None
    steps: int | None = None          # None: fit the time budget
    time_budget_s: float = 300.0
    out: str | None = None
    seed: int = 0
    seq_len: int | None = None        # None: context-length stages
    stages: str = "0:128,0.4:256,0.8:512"
    tokens_per_step: int = 4096
    batch_size: int | None = None     # None: tokens_per_step // seq_len
    lr: float = 4e-3
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    device: str = "cpu"
    eval_every: int = 25
    eval_windows: int = 16
    checkpoint_every: int | str | None = None  # steps (100) or a duration ("30s", "2m"); None: every 60 s
    max_nonfinite: int = 5
    balance: str = "quantile"         # quantile | sign | none
    ep_planner: str = "moonep"        # under expert parallelism: moonep (perfect balance) | none (owners only)
    qb_rate: float = 1.0              # Quantile Balancing step fraction (1.0: K3's one-shot update)
    progress: bool = True

    def validate(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.time_budget_s <= 0:
            raise ValueError(f"--time-budget must be > 0, got {self.time_budget_s}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"--seq-len must be >= 2, got {self.seq_len}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0.0 < self.qb_rate <= 1.0:
            raise ValueError(f"--qb-rate must be in (0, 1], got {self.qb_rate}")
        if self.balance not in ("quantile", "sign", "none"):
            raise ValueError(f"--balance must be quantile, sign or none, got {self.balance!r}")
        if self.ep_planner not in ("moonep", "none"):
            raise ValueError(f"--ep-planner must be moonep or none, got {self.ep_planner!r}")
        parse_checkpoint_every(self.checkpoint_every)
        parse_stages(self.stages)


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


def unigram_loss(train_ids: np.ndarray, val_ids: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the add-one unigram model of the train split on val."""
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val_ids].mean())


def resolve_model_config(args: TrainArgs) -> K3Config:
    return K3Config.from_json(args.config_path) if args.config_path else K3Config.preset(args.preset)


class Trainer:
    """Builds everything from ``TrainArgs`` and runs the loop (``run()``)."""

    def __init__(self, args: TrainArgs, resume: str | Path | None = None,
                 model_factory: Callable[[K3Config, torch.device, int], torch.nn.Module] | None = None,
                 log: Callable[[str], None] = print, parallel: ParallelDims | None = None,
                 activation_checkpointing: bool = False):
        self.resume_dir = Path(resume) if resume is not None else None
        self.resume_checkpoint: Path | None = None  # None on resume: restart from step 0 (run.json)
        self.damaged_checkpoints: dict[str, str] = {}
        if self.resume_dir is not None:
            args = self._args_from_run(self.resume_dir, args)
        if args.checkpoint_every is None:
            args.checkpoint_every = DEFAULT_CHECKPOINT_EVERY  # saved explicitly with the run
        args.validate()
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no GPU")
        self._setup_parallel(parallel)
        self.log = log if self.rank == 0 else (lambda _: None)
        if self.rank != 0:
            args.progress = False
        self.model_config = resolve_model_config(args)
        self.stages = parse_stages(args.stages)

        # Data first: a bad data path fails before any model is built.
        self.corpus: Corpus = load_corpus(args.data)
        if self.distributed and self.rank != 0:
            self._barrier()  # rank 0 trains (or finds) the cached tokenizer first; the others read it
        tokenized = tokenize_corpus(self.corpus, self.model_config.vocab_size)
        if self.distributed and self.rank == 0:
            self._barrier()
        self.tokenizer = tokenized.tokenizer
        self.train_ids, self.val_ids = tokenized.train_ids, tokenized.val_ids
        self.unigram = unigram_loss(self.train_ids, self.val_ids, self.model_config.vocab_size)

        if self.device.type == "cpu":
            # Decayed KDA states and tiny gradients reach subnormal floats, on which x86 takes a
            # microcode path up to ~100x slower; flushing them to zero costs nothing measurable.
            torch.set_flush_denormal(True)
        torch.manual_seed(args.seed)
        factory = model_factory or (lambda cfg, dev, seed: K3ForCausalLM(cfg, device=dev, dtype=torch.float32,
                                                                          seed=seed))
        self.model = factory(self.model_config, self.device, args.seed)
        self.model.train()
        if self.distributed or activation_checkpointing:
            from kimik3.parallel.apply import parallelize

            # Every rank built the same weights from the same seed; FSDP keeps each rank's shard.
            parallelize(self.model, self.dims, self.mesh, activation_checkpointing=activation_checkpointing,
                        ep_planner=self.args.ep_planner)
        from kimik3.optim import build_param_groups

        self.optimizer = build_param_groups(self.model, lr=args.lr, weight_decay=args.weight_decay)
        self.balancer = self._build_balancer()
        self.step = 0
        self.nonfinite_total = 0
        self.clock = CheckpointClock(parse_checkpoint_every(args.checkpoint_every), self.log)
        self.run_dir = self._prepare_run_dir()
        if self.resume_dir is not None:
            self._restore()

    # ------------------------------------------------------------------ setup helpers
    def _setup_parallel(self, parallel: ParallelDims | None) -> None:
        """Join the process group when launched by torchrun; build the mesh. World 1: nothing to do."""
        from kimik3.parallel.mesh import build_mesh, dp_rank, init_distributed

        self.distributed = init_distributed(self.device.type)
        world = torch.distributed.get_world_size() if self.distributed else 1
        self.dims = parallel if parallel is not None else ParallelDims.for_world(world)
        self.dims.check_world(world)
        self.rank = torch.distributed.get_rank() if self.distributed else 0
        self.mesh = None
        self.dp_rank = 0
        if self.distributed:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.mesh = build_mesh(self.dims, self.device.type)
            self.dp_rank = dp_rank(self.mesh)

    def _barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def _global_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The global value of a per-rank loss: summed over the cp ranks (under context parallelism
        each rank's loss is its *share* of its sequences' loss) and averaged over the dp ranks."""
        if not self.distributed:
            return value
        from kimik3.parallel.mesh import loss_group

        value = value.detach().float().clone()
        torch.distributed.all_reduce(value, group=loss_group(self.mesh))
        return value / self.dims.dp

    def _context_shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This cp rank's contiguous segment of each [B, T] tensor (labels are already shifted on the
        whole sequence, as KCP wants); unchanged without context parallelism."""
        if self.dims.cp == 1:
            return tensors
        from kimik3.parallel.kcp import shard_sequence
        from kimik3.parallel.mesh import cp_mesh

        group = cp_mesh(self.mesh).get_group()
        return tuple(shard_sequence(t, group, dim=1) for t in tensors)

    def _broadcast_int(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(t, src=0)
        return int(t.item())

    def _broadcast_str(self, value: str) -> str:
        """Rank 0's string on every rank (bytes through a tensor: no pickle)."""
        if not self.distributed:
            return value
        data = torch.tensor(list(value.encode()), dtype=torch.uint8) if self.rank == 0 else None
        size = self._broadcast_int(len(data) if data is not None else 0)
        buf = (data if data is not None else torch.empty(size, dtype=torch.uint8)).to(self.device)
        torch.distributed.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).decode()

    def _args_from_run(self, run_dir: Path, overrides: TrainArgs) -> TrainArgs:
        """The saved arguments of the run to resume: from its newest intact checkpoint, or from its
        ``run.json`` when it was stopped before its first checkpoint (it then restarts from step 0).
        ``overrides``: the --steps, --checkpoint-every (when given) and --progress of this call."""
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume {run_dir}: no such run directory")
        if checkpoint_dirs(run_dir) or (run_dir / POINTER).exists():
            self.resume_checkpoint, self.damaged_checkpoints = intact_checkpoint(run_dir)
            source = self.resume_checkpoint / STATE_JSON_FILE
            saved = read_state_entry(self.resume_checkpoint, "args")
        elif (run_dir / RUN_FILE).is_file():
            source = run_dir / RUN_FILE
            saved = read_run_args(run_dir)
        else:
            raise CheckpointError(f"{run_dir}: nothing to resume: it has neither a checkpoint ({STORE}/step-*) nor "
                                  f"{RUN_FILE} (the arguments a run writes before its first step)")
        try:
            args = TrainArgs(**saved)
        except TypeError as err:
            raise CheckpointError(f"{source}: unusable run arguments ({err})") from None
        args.out = str(run_dir)
        if overrides.steps is not None:
            args.steps = overrides.steps
        if overrides.checkpoint_every is not None:
            args.checkpoint_every = overrides.checkpoint_every
        args.progress = overrides.progress
        return args

    def _build_balancer(self):
        routers = self.model.routers() if hasattr(self.model, "routers") else []
        if not routers or self.args.balance == "none":
            return None
        if self.args.balance == "sign":
            from kimik3.train.balance import SignBalancer

            return SignBalancer(routers, all_reduce=self._balance_all_reduce())
        from kimik3.train.balance import QuantileBalancer

        return QuantileBalancer(routers, rate=self.args.qb_rate, all_reduce=self._balance_all_reduce())

    def _balance_all_reduce(self):
        if not self.distributed:
            return None
        from kimik3.parallel.mesh import balance_group

        group = balance_group(self.mesh)
        return lambda tensor: torch.distributed.all_reduce(tensor, group=group)

    def _prepare_run_dir(self) -> Path:
        if self.args.out is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.args.out = str(Path("runs") / f"{self.model_config.name}-{stamp}")
        self.args.out = self._broadcast_str(self.args.out)  # one run directory, rank 0's
        run_dir = Path(self.args.out)
        if self.resume_dir is None and run_dir.exists() and any(run_dir.iterdir()):
            raise ValueError(_not_empty(run_dir))
        self._barrier()  # every rank has checked before rank 0 creates anything
        if self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            removed = remove_temporaries(run_dir, RUN_TEMPORARIES)
            if removed:
                self.log(f"removed {len(removed)} temporaries left by an interrupted write: "
                         + ", ".join(str(p.relative_to(run_dir)) for p in removed))
        self._barrier()
        return run_dir

    def _train_state(self) -> dict[str, Any]:
        return {
            "args": dataclasses.asdict(self.args),
            # Distributed: DTensor moments gathered whole (a collective: every rank calls this).
            "optimizer": full_optimizer_state(self.optimizer) if self.distributed else self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "nonfinite_total": self.nonfinite_total,
            "corpus_fingerprint": self.corpus.fingerprint,
        }

    def _restore(self) -> None:
        if self.resume_checkpoint is None:
            if self.rank == 0:
                self._truncate_metrics(0)
            self._barrier()
            self.log(f"{self.run_dir} has no checkpoint (it was stopped before its first one): restarting it "
                     f"from step 0 with the arguments saved in {self.run_dir / RUN_FILE}")
            return
        if self.rank == 0:
            adopt_checkpoint(self.run_dir, self.resume_checkpoint, self.damaged_checkpoints,
                             warn=lambda message: self.log(f"warning: {message}"))
        self._barrier()
        step, state, tokenizer_json = load_checkpoint(self.run_dir, self.model, checkpoint=self.resume_checkpoint)
        if state.get("corpus_fingerprint") != self.corpus.fingerprint:
            raise CheckpointError(f"{self.run_dir / STATE_JSON_FILE}: the data changed since this run was "
                                  "checkpointed; resuming needs the same corpus")
        saved_tokenizer = load_tokenizer_from_json(tokenizer_json, self.run_dir / "tokenizer.json")
        if saved_tokenizer.get_vocab_size() > self.model_config.vocab_size:
            raise CheckpointError(f"{self.run_dir / 'tokenizer.json'}: vocabulary of "
                                  f"{saved_tokenizer.get_vocab_size()} exceeds the model's "
                                  f"{self.model_config.vocab_size}")
        if saved_tokenizer.to_str() != self.tokenizer.to_str():  # re-encode with the run's own tokenizer
            self.tokenizer = saved_tokenizer
            self.train_ids = encode_documents(saved_tokenizer, self.corpus.train)
            self.val_ids = encode_documents(saved_tokenizer, self.corpus.val)
        load_optimizer_state(self.optimizer, state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.nonfinite_total = int(state["nonfinite_total"])
        self.step = step
        if self.rank == 0:
            self._truncate_metrics(step)
        self._barrier()
        self.log(f"resumed {self.run_dir} at step {step} from {self.resume_checkpoint.relative_to(self.run_dir)}")

    def _truncate_metrics(self, step: int) -> None:
        """Keep the records of the steps before ``step``, dropping any line that is not a record (the
        last one, torn by a kill in the middle of its write)."""
        path = self.run_dir / METRICS_FILE
        if not path.exists():
            return
        kept = []
        for line in path.read_text(errors="replace").splitlines():
            record = parse_record(line)
            if record is not None and record["step"] < step:
                kept.append(line + "\n")
        write_text_atomic(path, "".join(kept))

    # ------------------------------------------------------------------ one step
    def batch_shape(self, step: int, total: int) -> tuple[int, int]:
        seq = self.args.seq_len or seq_len_at(step, total, self.stages)
        batch = self.args.batch_size or max(1, self.args.tokens_per_step // seq)
        return batch, seq

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def train_step(self, step: int, total: int) -> dict[str, Any]:
        batch, seq = self.batch_shape(step, total)
        inputs, labels = batch_at(self.train_ids, step, self.args.seed, batch, seq)
        if self.dims.dp > 1:
            # This rank's rows of the global batch: together the dp ranks train on the very batch a
            # single process would, and (every label counted, equal rows per rank) the mean of
            # their mean losses is the single-process loss.
            if batch % self.dims.dp:
                raise ValueError(f"the batch of {batch} sequences does not split over dp={self.dims.dp} ranks: "
                                 f"choose a --batch-size (or --tokens-per-step) divisible by {self.dims.dp}")
            rows = batch // self.dims.dp
            inputs = inputs[self.dp_rank * rows:(self.dp_rank + 1) * rows]
            labels = labels[self.dp_rank * rows:(self.dp_rank + 1) * rows]
        inputs, labels = self._context_shard(inputs, labels)
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        lr_scale = cosine_lr(step, total, 1.0, max(1, round(self.args.warmup_fraction * total)),
                             self.args.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_scale

        start = time.perf_counter()
        with self._autocast():
            out = self.model(inputs, labels=labels)
        if self.balancer is not None:
            self.balancer.observe(out.routing)   # bins the scores, then drops them before backward
        loss = out.loss
        record: dict[str, Any] = {"step": step, "seq_len": seq, "batch_size": batch,
                                  "lr": self.args.lr * lr_scale}
        global_loss = self._global_loss(loss.detach())  # one verdict for every rank
        finite = bool(torch.isfinite(global_loss))
        if finite:
            # FSDP averages gradients over dp x cp; cp shares must be summed, hence the factor.
            (loss * self.dims.cp if self.dims.cp > 1 else loss).backward()
            if self.mesh is not None:   # sharded gradients, possibly on several meshes (FSDP, EP)
                grad_norm = clip_grad_norm(self.model.parameters(), self.args.grad_clip)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
            finite = bool(torch.isfinite(grad_norm))
            record["grad_norm"] = float(grad_norm)
        if finite:
            self.optimizer.step()
            balance = self.balancer.step() if self.balancer is not None else {}
        else:
            self.nonfinite_total += 1
            balance = self.balancer.discard() if self.balancer is not None else {}
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start

        record.update(loss=float(global_loss), tokens_per_s=batch * seq / elapsed, step_time_s=elapsed,
                      elapsed_s=time.perf_counter() - self.started,
                      skipped=not finite, nonfinite_total=self.nonfinite_total)
        if out.main_loss is not None and out.mtp_loss is not None:
            record.update(main_loss=float(self._global_loss(out.main_loss.detach())),
                          mtp_loss=float(self._global_loss(out.mtp_loss.detach())))
        record["expert_load_max_over_mean"] = (balance["load_max_over_mean_mean"] if "load_max_over_mean_mean"
                                               in balance else _routing_imbalance(out.routing))
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        was_training = self.model.training
        self.model.eval()
        seq = self.args.seq_len or self.stages[-1].seq_len
        inputs, labels = eval_windows(self.val_ids, seq, self.args.eval_windows)
        losses = []
        for start in range(0, inputs.shape[0], 4):
            window, target = self._context_shard(inputs[start:start + 4], labels[start:start + 4])
            with self._autocast():
                out = self.model(window.to(self.device), labels=target.to(self.device))
            loss = out.main_loss if out.main_loss is not None else out.loss
            losses.append(float(self._global_loss(loss)))   # every dp rank evaluates the same windows
        self.model.train(was_training)
        return float(np.mean(losses))

    # ------------------------------------------------------------------ planning the budget
    def plan_steps(self) -> int:
        """Steps that fit the time budget, from the timing of forward+backward passes."""
        if self.args.steps is not None:
            return self.args.steps
        batch, seq = self.batch_shape(0, 1)
        inputs, labels = batch_at(self.train_ids, 0, self.args.seed, batch, seq)
        inputs, labels = inputs[:max(1, batch // self.dims.dp)], labels[:max(1, batch // self.dims.dp)]
        inputs, labels = self._context_shard(inputs, labels)
        timings = []
        for _ in range(3):   # not observed by the balancer: timing only
            start = time.perf_counter()
            with self._autocast():
                self.model(inputs.to(self.device), labels=labels.to(self.device)).loss.backward()
            timings.append(time.perf_counter() - start)
        self.model.zero_grad(set_to_none=True)
        step_time = 1.15 * min(timings[1:])  # optimizer, balancing and logging on top
        budget = self.args.time_budget_s - (time.perf_counter() - self.started) - 10.0
        evals = 1 + budget / step_time / self.args.eval_every
        budget -= evals * 0.5 * step_time  # an evaluation costs about half a step
        steps = max(10, int(budget / step_time))
        steps = self._broadcast_int(steps)  # every rank runs rank 0's plan
        self.log(f"planning {steps} steps (~{step_time:.2f} s each) to fit the {self.args.time_budget_s:.0f} s budget")
        return steps

    # ------------------------------------------------------------------ the loop
    def run(self, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunSummary:
        """Train to ``args.steps`` (planned from the time budget when unset); ``on_step`` sees each record."""
        self.started = time.perf_counter()
        a = self.args
        total = self.plan_steps() if self.resume_dir is None else (a.steps or 0)
        a.steps = total
        if self.rank == 0:
            write_run_args(self.run_dir, a)  # from here on, --resume can restart the run
        if self.step >= total:
            self.log(f"{self.run_dir} is already at step {self.step} >= --steps {total}: nothing to do")
        self.log(f"data: {self.corpus.description}: {len(self.corpus.train)} train / {len(self.corpus.val)} "
                 f"val documents, {len(self.train_ids):,} / {len(self.val_ids):,} tokens; unigram val loss "
                 f"{self.unigram:.3f}")
        metrics_path = self.run_dir / METRICS_FILE
        history: list[dict[str, Any]] = []
        consecutive_bad = 0
        last_val = None
        progress = _progress(total, self.step, a.progress)
        first_step = self.step
        self.clock.restart()
        try:
            with (open(metrics_path, "a") if self.rank == 0 else open(os.devnull, "w")) as metrics_file:
                while self.step < total:
                    record = self.train_step(self.step, total)
                    consecutive_bad = consecutive_bad + 1 if record["skipped"] else 0
                    if consecutive_bad >= a.max_nonfinite:
                        raise TrainingError(
                            f"{consecutive_bad} non-finite losses in a row at step {self.step}: stopping. The last "
                            f"good checkpoint is intact in {self.run_dir}; try a lower --lr.")
                    self.step += 1
                    if self.step % a.eval_every == 0 or self.step == total:
                        last_val = self.evaluate()
                        record["val_loss"] = last_val
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                    history.append(record)
                    progress.update(1)
                    progress.set_postfix(_postfix(record, last_val), refresh=False)
                    # No checkpoint in the middle of a run of skipped steps: the last one stays the last good one.
                    if self.step < total and consecutive_bad == 0 and self._checkpoint_due():
                        self.save()
                    if on_step is not None:
                        on_step(record)
        finally:
            progress.close()
        if self.step > first_step:  # a resumed run that had nothing to do keeps its checkpoint as is
            self.save()
        from kimik3.train.plot import plot_run

        plot_path = plot_run(metrics_path, self.run_dir / "loss.png", unigram=self.unigram) if self.rank == 0 else None
        sample = self.sample(SAMPLE_PROMPT)
        done = [r for r in history if not r["skipped"]]
        tokens_per_s = float(np.median([r["tokens_per_s"] for r in done])) if done else 0.0
        # The next-token loss (the optimised loss adds the weighted MTP term), comparable with val.
        final_loss = float(np.mean([r.get("main_loss", r["loss"]) for r in done[-10:]])) if done else float("nan")
        if history:
            self.log(f"final train loss {final_loss:.3f} (next-token, last 10 steps), val loss {last_val:.3f} "
                     f"(unigram baseline {self.unigram:.3f}), {tokens_per_s:,.0f} tokens/s")
        self.log(f"sample (temperature 0.8, prompt {SAMPLE_PROMPT!r}):\n{SAMPLE_PROMPT}{sample}")
        self.log(f"run written to {self.run_dir}/: model.safetensors config.json tokenizer.json "
                 f"train_state.* metrics.jsonl {plot_path.name if plot_path else ''}")
        return RunSummary(self.run_dir, self.step, final_loss, last_val, self.unigram, tokens_per_s, sample, history)

    def _checkpoint_due(self) -> bool:
        due = self.clock.due(self.step)
        if self.distributed and self.clock.timed:
            due = bool(self._broadcast_int(int(due)))  # rank 0's clock decides for every rank
        return due

    def save(self) -> None:
        """Write a checkpoint. Distributed: every rank gathers, rank 0 alone writes, then all wait.

        Pruning keeps the checkpoint this run resumed from (verified intact) and drops the damaged
        ones it skipped."""
        start = time.monotonic()
        pruning = {"protect": [self.resume_checkpoint.name] if self.resume_checkpoint is not None else [],
                   "corrupt": set(self.damaged_checkpoints)}
        if not self.distributed:
            save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer.to_str(), self._train_state(),
                            **pruning)
        else:
            weights = full_model_state(self.model)  # collective; the tensors land on rank 0 only
            state = self._train_state()             # collective too (optimizer moments)
            if self.rank == 0:
                save_checkpoint(self.run_dir, self.step, self.model, self.tokenizer.to_str(), state,
                                weights=weights, **pruning)
            self._barrier()
        self.clock.written(time.monotonic() - start)
        self.damaged_checkpoints = {}  # that save's pruning deleted them; their names may now be good ones

    @torch.no_grad()
    def sample(self, prompt: str, max_new_tokens: int = 80) -> str:
        """A seeded sampled completion (temperature 0.8, top-p 0.95): greedy decoding of a small
        model mostly repeats one line, which shows less of what it learned."""
        if not hasattr(self.model, "generate"):
            return ""
        if self.dims.cp > 1:
            return "(no sample: generation does not run under context parallelism)"
        ids = torch.tensor([self.tokenizer.encode(prompt).ids], device=self.device)
        eos = self.tokenizer.token_to_id(EOS)
        generator = torch.Generator(device=self.device).manual_seed(self.args.seed)
        out = self.model.generate(ids, max_new_tokens, temperature=0.8, top_p=0.95, eos_token_id=eos,
                                  generator=generator)
        return self.tokenizer.decode(out[0, ids.shape[1]:].tolist())


def write_run_args(run_dir: Path, args: TrainArgs) -> None:
    """Save the run's arguments in ``run_dir/run.json`` (atomically: temp file, fsync, rename)."""
    write_text_atomic(run_dir / RUN_FILE, json.dumps({"args": dataclasses.asdict(args)}, indent=1))


def read_run_args(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_FILE
    try:
        saved = json.loads(path.read_text())["args"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable run arguments ({err!r})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: unreadable run arguments (not an object)")
    return saved


def _routing_imbalance(routing) -> float | None:
    """Mean over the routers that ran of max / mean expert load (this rank's tokens); None without routers."""
    values = []
    for stats in routing:
        if stats is not None:
            loads = stats.loads_E.float()
            values.append(float(loads.max() / loads.mean().clamp_min(1e-9)))
    return float(np.mean(values)) if values else None


def _not_empty(run_dir: Path) -> str:
    if (run_dir / RUN_FILE).is_file() or checkpoint_dirs(run_dir):
        return (f"output directory {run_dir} is not empty: it holds a run; continue it with --resume {run_dir} "
                "(from its last checkpoint, or from step 0 if it stopped before its first one), or choose "
                "another --out")
    return f"output directory {run_dir} is not empty and holds no run to --resume: choose another --out"


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def _postfix(record: dict[str, Any], val: float | None) -> dict[str, str]:
    out = {"loss": f"{record['loss']:.3f}", "val": f"{val:.3f}" if val is not None else "-",
           "tok/s": f"{record['tokens_per_s']:,.0f}", "lr": f"{record['lr']:.1e}"}
    imbalance = record.get("expert_load_max_over_mean")
    if imbalance is not None and math.isfinite(imbalance):
        out["load"] = f"{imbalance:.2f}"
    return out
