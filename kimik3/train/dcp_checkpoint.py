"""A training run's checkpoints in the sharded (DCP) format: what ``Trainer`` writes on more than one rank.

The run directory keeps ``kimik3.train.checkpoint``'s conventions (``checkpoints/step-NNNNNNN``, the
``checkpoint`` symlink, pruning, temporaries removed on restart, checksums verified on resume, falling
back past a damaged newest checkpoint); only the inside of a checkpoint differs::

    checkpoints/step-000120/   shard-<i>-of-<n>.safetensors  dcp_index.json  kimik3_dcp.json
                               config.json  tokenizer.json  tokenizer_config.json
                               train_state.safetensors  train_state.json  manifest.json

The model and optimizer state are ``kimik3.train.distributed_checkpoint``'s: each rank writes the shards
it owns (no gather), and loading reshards them onto any world size, one process included. The rest of the
training state (arguments, RNG state, counters, corpus fingerprint, budget plan) and the config and
tokenizer are the single-file format's files, written by rank 0 into the checkpoint's temporary directory
(``.step-NNNNNNN.partial``) before it is published, with ``manifest.json`` (sha256 of every file, shards
included) last: the directory appears complete, with one rename, or not at all. Nothing is pickled.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kimik3.model.pretrained import CONFIG_FILE
from kimik3.tokenizer import TOKENIZER_CONFIG_FILE
from kimik3.train.checkpoint import (
    STATE_JSON_FILE,
    STATE_TENSORS_FILE,
    STORE,
    TOKENIZER_FILE,
    CheckpointError,
    is_dcp_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    point_to,
    prune,
    read_train_files,
    write_train_files,
)
from kimik3.train.integrity import MANIFEST_FILE, write_manifest
from kimik3.train.distributed_checkpoint import load_distributed, read_distributed_meta, save_distributed

# The files rank 0 adds to the DCP ones (shards, index, kimik3_dcp.json).
RUN_FILES = (CONFIG_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE)


def _is_main() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _write_run_files(directory: Path, step: int, model: torch.nn.Module, tokenizer_json: str,
                     train_state: dict[str, Any]) -> None:
    """Rank 0, into the checkpoint's temporary directory: the run's own files, fsynced, then the manifest."""
    write_train_files(directory, step, model, tokenizer_json, train_state)
    for file in (*RUN_FILES, TOKENIZER_CONFIG_FILE):
        with open(directory / file, "rb") as handle:
            os.fsync(handle.fileno())
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    write_manifest(directory, files)


def save_dcp_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, optimizer: Any, tokenizer_json: str,
                        train_state: dict[str, Any], keep: int = 2, protect: Collection[str] = (),
                        corrupt: Collection[str] = (), async_save: bool = False) -> Path | Future:
    """Write the checkpoint of ``step`` and make it the run's current one; collective (every rank calls it).

    ``train_state``: the training state besides the model and optimizer (rank 0's is written: nested dicts,
    lists, tensors and JSON scalars). ``keep``, ``protect``, ``corrupt``: what ``prune`` keeps afterwards.
    ``async_save``: return once the state is copied to host memory (training may go on) with a ``Future`` that
    finishes when the checkpoint is published, pointed to and pruned (``result()`` re-raises a failure); wait
    for it before the next save and before the process ends.
    """
    run_dir = Path(run_dir)
    name = f"step-{step:07d}"
    final = run_dir / STORE / name
    saved = save_distributed(final, model, optimizer, step, async_save=async_save,
                             finalize=lambda tmp: _write_run_files(tmp, step, model, tokenizer_json, train_state))

    def point_and_prune() -> Path:
        if _is_main():
            point_to(run_dir, name)
            prune(run_dir, keep, protect={name, *protect}, corrupt=corrupt)
        return final

    if not async_save:
        return point_and_prune()
    publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimik3-run-checkpoint")
    future = publisher.submit(lambda: (saved.result(), point_and_prune())[1])
    publisher.shutdown(wait=False)
    return future


def load_dcp_checkpoint(ckpt: str | Path, model: torch.nn.Module, optimizer: Any
                        ) -> tuple[int, dict[str, Any], str]:
    """Load the (verified) DCP checkpoint ``ckpt`` into ``model`` and ``optimizer`` in place, on any world size;
    collective. Returns (step, train_state, tokenizer_json) as ``load_checkpoint`` does (without the optimizer
    state in ``train_state``: it is loaded). Every file is read and checked before the model is touched."""
    ckpt = Path(ckpt)
    step, state, tokenizer_json = read_train_files(ckpt, model)
    meta = read_distributed_meta(ckpt)
    if step != int(meta["step"]):
        raise CheckpointError(f"{ckpt / STATE_JSON_FILE}: step {step}, but the shards are of step {meta['step']}")
    load_distributed(ckpt, model, optimizer)
    return step, state, tokenizer_json


def load_run_checkpoint(run_dir: str | Path, ckpt: Path, model: torch.nn.Module, optimizer: Any
                        ) -> tuple[int, dict[str, Any], str]:
    """Load the run's (verified) checkpoint ``ckpt`` in either format into ``model`` and ``optimizer``, on any
    world size; collective. Returns (step, train_state, tokenizer_json)."""
    if is_dcp_checkpoint(ckpt):   # the model and the optimizer, resharded onto this run's ranks
        return load_dcp_checkpoint(ckpt, model, optimizer)
    step, state, tokenizer_json = load_checkpoint(run_dir, model, checkpoint=ckpt)
    load_optimizer_state(optimizer, state["optimizer"])   # full tensors, cut to this rank's shards
    return step, state, tokenizer_json
