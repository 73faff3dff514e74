"""What `kimik3 rl` and `kimik3 mopd` share around their iterations: the policy's base run, its Trainer (checkpoints,
resume, the run directory), and the loop that runs iterations, logs and stores their records, and checkpoints.

A post-training run is a Trainer whose "steps" are iterations: ``policy_trainer`` builds it from the base run's
saved model with a constant learning rate and no weight decay, and ``drive`` calls ``run.iteration(step)`` until
``--iterations``, appending each record to ``metrics.jsonl`` (the run's ``close`` is called however the loop ends).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Router-bias balancing in post-training updates (TrainArgs.balance): off. RL and distillation batches are a few
# prompts of one task family, padding included; a balancer that sets every router's biases to equalise expert
# loads on them re-routes the base model's tokens each update, whatever the reward, and that alone moves what the
# policy samples (docs/posttraining.md).
POSTTRAIN_BALANCE = "none"


def open_base(base: Path) -> tuple[Any, Any, Any]:
    """The base run's (config, tokenizer, chat encoder); a clear error when it holds no saved model."""
    from kimik3.config.schema import K3Config
    from kimik3.model.pretrained import has_weights
    from kimik3.serve.chat import ChatEncoder, load_chat_template
    from kimik3.tokenizer import load_tokenizer

    if not (base / "config.json").is_file() or not has_weights(base):
        raise FileNotFoundError(f"{base}: not a run with a saved model (config.json and weights): train one with "
                                "`kimik3 train` (and `kimik3 sft`)")
    config = K3Config.from_json(base / "config.json")
    tokenizer = load_tokenizer(base / "tokenizer.json", vocab_size=config.vocab_size)
    return config, tokenizer, ChatEncoder(tokenizer, load_chat_template(None, base))


def policy_trainer(base: Path, config: Any, source: Any, *, iterations: int, out: str, seed: int, lr: float,
                   device: str, checkpoint_every: str | None, progress: bool, resume: Path | None,
                   log: Callable[[str], None], balance: str = POSTTRAIN_BALANCE) -> Any:
    """A Trainer over the policy loaded from ``base`` (fp32 master weights; QAT as the base run's config says), one
    step per iteration, a constant learning rate and no weight decay. ``source``: the run's DataSource (its
    fingerprint and description)."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.trainer import TrainArgs, Trainer

    args = TrainArgs(config_path=str(base / "config.json"), steps=iterations, out=out, seed=seed, lr=lr,
                     weight_decay=0.0, device=device, checkpoint_every=checkpoint_every,
                     qat=config.moe.expert_quant, progress=progress, warmup_fraction=0.0, min_lr_ratio=1.0,
                     balance=balance, cuda_graph=False,   # RL updates are their own, not the Trainer's step
                     compile=False)   # their micro-batches vary in shape: compiled blocks would compile per shape

    def from_base(cfg: Any, dev: torch.device, _seed: int) -> torch.nn.Module:
        return K3ForCausalLM.from_pretrained(base, device=dev, dtype=torch.float32)

    return Trainer(args, resume=resume, model_factory=from_base, log=log, source=source)


def drive(trainer: Any, run: Any, *, summary: Callable[[dict[str, Any]], str], progress: bool,
          log: Callable[[str], None], on_iteration: Callable[[dict[str, Any]], None] | None = None,
          before: Callable[[], None] | None = None,
          annotate: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run ``run.iteration(step)`` from the trainer's step up to its ``steps``: each record is annotated (after the
    step count moves on), summarised in one line, appended to ``metrics.jsonl``, handed to ``on_iteration``; the
    trainer checkpoints on its clock and once at the end. ``before`` runs first, inside the same ``try`` whose
    ``finally`` closes the run. Returns this call's records."""
    from kimik3.train.args import write_run_args
    from kimik3.train.run_dir import METRICS_FILE
    from kimik3.train.trainer import _progress

    a = trainer.args
    for group in trainer.optimizer.param_groups:   # a constant learning rate
        group["lr"] = group["base_lr"]
    trainer.started = time.perf_counter()
    trainer.total = a.steps
    write_run_args(trainer.run_dir, a)
    records: list[dict[str, Any]] = []
    first = trainer.step
    try:
        if trainer.step >= a.steps:
            log(f"{trainer.run_dir} is already at iteration {trainer.step} >= --iterations {a.steps}: nothing to do")
        if before is not None:
            before()
        bar = _progress(a.steps, trainer.step, progress)
        say = bar.write if progress and log is print else log
        trainer.clock.restart()
        with open(trainer.run_dir / METRICS_FILE, "a") as metrics_file:
            while trainer.step < a.steps:
                record = run.iteration(trainer.step)
                trainer.step += 1
                if annotate is not None:
                    annotate(record)
                say(summary(record))
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                records.append(record)
                bar.update(1)
                if trainer.step < a.steps and trainer._checkpoint_due():
                    trainer.save()
                if on_iteration is not None:
                    on_iteration(record)
        bar.close()
    finally:
        run.close()
    if trainer.step > first:
        trainer.save()
    return records


def metrics_file(trainer: Any) -> Path:
    """The run's ``metrics.jsonl``."""
    from kimik3.train.run_dir import METRICS_FILE

    return trainer.run_dir / METRICS_FILE
