"""A run's arguments (``TrainArgs``) and their file ``run.json``.

``run.json`` is written before the first step, so a run stopped before its first checkpoint can be
restarted with ``--resume``; every checkpoint also carries the arguments (``kimik3.train.run_dir``
reads them back from whichever is newer).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimik3.config.schema import K3Config
from kimik3.files import write_text_atomic
from kimik3.optim.schedule import parse_stages
from kimik3.train.checkpoint import CheckpointError
from kimik3.train.checkpoint_clock import parse_checkpoint_every

RUN_FILE = "run.json"      # the run's arguments, written before its first step


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
    cuda_graph: bool = True           # on one CUDA device and process: the step replayed as a CUDA graph
    compile: bool | None = None       # torch.compile each block (CUDA only); None: on for one CUDA process
    eval_every: int = 25
    eval_windows: int = 16
    checkpoint_every: int | str | None = None  # steps (100) or a duration ("30s", "2m"); None: every 60 s
    checkpoint_async: bool = False    # sharded checkpoints (several ranks) written in the background
    max_nonfinite: int = 5
    balance: str = "quantile"         # quantile | sign | none
    ep_planner: str = "moonep"        # under expert parallelism: moonep (perfect balance) | none (owners only)
    qb_rate: float = 1.0              # Quantile Balancing step fraction (1.0: K3's one-shot update)
    qat: str | None = None            # quantisation-aware routed experts: None | "mxfp4" (moe.expert_quant)
    progress: bool = True
    vision: bool = False              # train the multimodal model on generated image-text samples + the text corpus
    vision_blank: bool = False        # the text-only baseline: the same samples with every image blanked
    vision_text_fraction: float = 0.25  # of the batch rows: text corpus only
    vision_init: str | None = None    # a tower file (safetensors, vision_contrastive) to start the tower from

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
        if self.qat not in (None, "mxfp4"):
            raise ValueError(f"--qat must be mxfp4 (or not given), got {self.qat!r}")
        if not 0.0 <= self.vision_text_fraction < 1.0:
            raise ValueError(f"--vision-text-fraction must be in [0, 1), got {self.vision_text_fraction}")
        if self.vision_blank and not self.vision:
            raise ValueError("--vision-blank is the text-only baseline of a --vision run: give --vision too")
        if self.vision_init is not None and not self.vision:
            raise ValueError("--vision-init starts the vision tower of a --vision run: give --vision too")
        parse_checkpoint_every(self.checkpoint_every)
        parse_stages(self.stages)


def resolve_model_config(args: TrainArgs) -> K3Config:
    """The preset or config file, with ``--qat`` setting the routed experts' quantisation."""
    config = K3Config.from_json(args.config_path) if args.config_path else K3Config.preset(args.preset)
    if args.vision and config.vision is None and not args.config_path:   # --preset tiny --vision: tiny-vl
        config = K3Config.preset(f"{args.preset}-vl")
    if args.qat is not None and config.moe.expert_quant != args.qat:
        config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_quant=args.qat))
        config.validate()
    return config


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


__all__ = ["RUN_FILE", "TrainArgs", "read_run_args", "resolve_model_config", "write_run_args"]
