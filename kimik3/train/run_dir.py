"""A run directory before training starts: created empty for a new run, or read back for ``--resume``.

A new run needs an empty (or absent) ``--out``; a resumed one continues from its newest intact
checkpoint, or from step 0 with the arguments of ``run.json`` when it was stopped before its first
checkpoint. Either way the temporaries an interrupted write left are removed first, and the metrics
of the steps to be run again are dropped. Under several processes rank 0 alone touches the
directory, the others wait (the ``ParallelContext``'s barriers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kimik3.files import temporary_pattern, write_text_atomic
from kimik3.parallel.context import ParallelContext
from kimik3.train.args import RUN_FILE, TrainArgs, read_run_args
from kimik3.train.checkpoint import (
    CHECKPOINT_TEMPORARIES,
    POINTER,
    STATE_JSON_FILE,
    STORE,
    CheckpointError,
    checkpoint_dirs,
    intact_checkpoint,
    read_state_entry,
    remove_temporaries,
)
from kimik3.train.plot import parse_record

METRICS_FILE = "metrics.jsonl"
# The temporaries an interrupted write leaves in a run directory (atomic_write's, and plot_run's older form),
# removed when the run starts again; the checkpoints' own are in CHECKPOINT_TEMPORARIES.
RUN_TEMPORARIES = (*CHECKPOINT_TEMPORARIES,
                   *((".", temporary_pattern(name)) for name in (RUN_FILE, METRICS_FILE, "loss.png")),
                   (".", r"\.loss\.png\.tmp\.png"))


@dataclass(slots=True)
class ResumePoint:
    """Where ``--resume`` continues a run: its saved arguments and the checkpoint to load (None: the
    run stopped before its first one and restarts from step 0)."""

    args: TrainArgs
    checkpoint: Path | None
    damaged: dict[str, str] = field(default_factory=dict)   # checkpoint name -> what is wrong with it


def resume_point(run_dir: Path, overrides: TrainArgs) -> ResumePoint:
    """The saved arguments of the run to resume: from its newest intact checkpoint, or from its
    ``run.json`` when it was stopped before its first checkpoint (it then restarts from step 0).
    ``overrides``: the --steps, --checkpoint-every (when given) and --progress of this call."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume {run_dir}: no such run directory")
    checkpoint, damaged = None, {}
    if checkpoint_dirs(run_dir) or (run_dir / POINTER).exists():
        checkpoint, damaged = intact_checkpoint(run_dir)
        source = checkpoint / STATE_JSON_FILE
        saved = read_state_entry(checkpoint, "args")
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
    return ResumePoint(args, checkpoint, damaged)


def prepare_run_dir(args: TrainArgs, model_name: str, resuming: bool, ctx: ParallelContext,
                    log: Callable[[str], None]) -> Path:
    """The run directory, created (on rank 0) and cleared of temporaries; ``args.out`` is set to it
    (default ``runs/<model>-<time>``, rank 0's choice on every rank)."""
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.out = str(Path("runs") / f"{model_name}-{stamp}")
    args.out = ctx.broadcast_str(args.out)
    run_dir = Path(args.out)
    if not resuming and run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(_not_empty(run_dir))
    ctx.barrier()  # every rank has checked before rank 0 creates anything
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        removed = remove_temporaries(run_dir, RUN_TEMPORARIES)
        if removed:
            log(f"removed {len(removed)} temporaries left by an interrupted write: "
                + ", ".join(str(p.relative_to(run_dir)) for p in removed))
    ctx.barrier()
    return run_dir


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the records of the steps before ``step``, dropping any line that is not a record (the
    last one, torn by a kill in the middle of its write)."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        record = parse_record(line)
        if record is not None and record["step"] < step:
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))


def _not_empty(run_dir: Path) -> str:
    if (run_dir / RUN_FILE).is_file() or checkpoint_dirs(run_dir):
        return (f"output directory {run_dir} is not empty: it holds a run; continue it with --resume {run_dir} "
                "(from its last checkpoint, or from step 0 if it stopped before its first one), or choose "
                "another --out")
    return f"output directory {run_dir} is not empty and holds no run to --resume: choose another --out"


__all__ = ["METRICS_FILE", "RUN_TEMPORARIES", "ResumePoint", "prepare_run_dir", "resume_point", "truncate_metrics"]
