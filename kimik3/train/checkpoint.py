"""Training checkpoints that survive being killed at any moment, stored without pickle.

Layout of a run directory::

    checkpoints/step-000120/   config.json  model.safetensors  tokenizer.json
                               train_state.safetensors  train_state.json  manifest.json
    checkpoint -> checkpoints/step-000120          (a symlink, swapped atomically)
    config.json, model.safetensors, tokenizer.json,
    train_state.safetensors, train_state.json      (symlinks through ``checkpoint``)
    run.json  metrics.jsonl  loss.png

A checkpoint is written whole into a temporary directory, fsynced, checksummed (``manifest.json``:
the sha256 of every file, ``kimik3.train.integrity``) and renamed into ``checkpoints/``; only then
does the single ``checkpoint`` symlink move to it, with ``os.replace``. So a reader always sees one
complete checkpoint: the new one or the previous one. The top-level names let
``from_pretrained(run_dir)`` and ``kimik3 generate --run`` read the latest weights directly.

Resuming verifies the checksums; when the current checkpoint is damaged (a file missing, unreadable
or changed since it was written) it falls back to the newest intact one under ``checkpoints/``.
Checkpoints written without a manifest load unverified. A write killed half-way leaves only
temporaries (``checkpoints/.step-*.*``, ``.checkpoint.<pid>.tmp``), which ``remove_temporaries``
deletes when the run starts again.

A run on several ranks writes its checkpoints in the sharded format instead (``kimik3.train.dcp_checkpoint``:
each rank's shards, ``dcp_index.json`` and ``kimik3_dcp.json`` in place of ``model.safetensors``, the optimizer
state sharded too), under the same names, pointer, pruning, checksums and fallback; ``verify_checkpoint`` and
``point_to`` handle both formats (``is_dcp_checkpoint`` tells them apart).

Training state = tensors (optimizer moments, RNG state) in ``train_state.safetensors`` plus
everything else in ``train_state.json``: the nested structure of the optimizer state with
tensors replaced by references, the step and the run's arguments.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kimik3.model.pretrained import CONFIG_FILE, WEIGHTS_FILE, check_tensors, read_config, state_tensors
from kimik3.files import fsync_dir
from kimik3.parallel.full_state import is_sharded
from kimik3.tokenizer import TOKENIZER_CONFIG_FILE, write_tokenizer_config
from kimik3.train.integrity import IntegrityError, read_manifest, verify_manifest, write_manifest

TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
CHECKPOINT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE)
# Written into every checkpoint (and so seen at the run's top level) but not required of one: checkpoints made
# before the chat template moved into tokenizer_config.json lack it.
OPTIONAL_FILES = (TOKENIZER_CONFIG_FILE,)
# A checkpoint written by several ranks (``kimik3.train.dcp_checkpoint``) holds the sharded model and optimizer
# state instead of model.safetensors: these two files (``distributed_checkpoint.META_FILE``,
# ``dcp_storage.INDEX_FILE``) and the shard files the index lists, beside the files below.
DCP_FILES = ("kimik3_dcp.json", "dcp_index.json")
DCP_CHECKPOINT_FILES = (CONFIG_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE, *DCP_FILES)
# Linked at the run's top level when the current checkpoint has them.
TOP_LEVEL_FILES = (*CHECKPOINT_FILES, *OPTIONAL_FILES, *DCP_FILES)
POINTER = "checkpoint"
STORE = "checkpoints"
# (folder, name) of the temporaries a killed checkpoint write leaves: save_checkpoint's directory
# (tempfile.mkdtemp: ".step-NNNNNNN." + random [a-z0-9_]), a sharded checkpoint's (".step-NNNNNNN.partial") and
# the one it moved aside (".step-NNNNNNN.old." + random), and point_to's symlink.
CHECKPOINT_TEMPORARIES = ((STORE, r"\.step-\d+\.[a-z0-9_]+"), (STORE, r"\.step-\d+\.old\.[a-z0-9_]+"),
                          (".", r"\.checkpoint\.\d+\.tmp"))


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the run; the message names the file."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older intact one."""


# ---------------------------------------------------------------------- nested state <-> (tensors, JSON)
def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "s") -> Any:
    """Replace every tensor in a nested dict/list structure by ``{"tensor": key}``.

    Dicts become ``{"dict": [[key, value], ...]}`` so that int keys (optimizer param ids) survive.
    """
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"tensor": key}
    if isinstance(obj, dict):
        return {"dict": [[k, flatten_state(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"list" if isinstance(obj, list) else "tuple":
                [flatten_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"cannot store a {type(obj).__name__} in a training state")


def unflatten_state(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "dict" in node:
        return {k: unflatten_state(v, tensors) for k, v in node["dict"]}
    if "list" in node:
        return [unflatten_state(v, tensors) for v in node["list"]]
    if "tuple" in node:
        return tuple(unflatten_state(v, tensors) for v in node["tuple"])
    return node["value"]


# ---------------------------------------------------------------------- writing
def write_train_files(directory: Path, step: int, model: torch.nn.Module, tokenizer_json: str,
                      train_state: dict[str, Any]) -> None:
    """What a checkpoint of either format holds besides the model's (and the sharded one's optimizer) tensors: the
    config, the tokenizer and its config, and the training state (tensors to safetensors, the rest to JSON)."""
    (directory / CONFIG_FILE).write_text(model.config.to_json())
    (directory / TOKENIZER_FILE).write_text(tokenizer_json)
    write_tokenizer_config(directory, tokenizer_json)
    tensors: dict[str, torch.Tensor] = {}
    structure = flatten_state(train_state, tensors)
    save_file(tensors, str(directory / STATE_TENSORS_FILE), metadata={"step": str(step)})
    (directory / STATE_JSON_FILE).write_text(json.dumps({"step": step, "state": structure}, indent=1))


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, tokenizer_json: str,
                    train_state: dict[str, Any], keep: int = 2,
                    weights: dict[str, torch.Tensor] | None = None,
                    protect: Collection[str] = (), corrupt: Collection[str] = ()) -> Path:
    """Write the checkpoint of ``step`` and make it the run's current one. Returns its directory.

    ``train_state`` is any nested structure of dicts, lists, tensors and JSON scalars.
    ``weights``: the full state dict to write instead of ``model``'s own (a sharded model's
    gathered state, ``kimik3.parallel.full_state.full_model_state``); ``model`` then only supplies
    the config.
    ``keep``, ``protect``, ``corrupt``: what ``prune`` keeps afterwards.
    """
    run_dir = Path(run_dir)
    store = run_dir / STORE
    store.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=store))
    try:
        tensors_out = state_tensors(model) if weights is None else {
            name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
        save_file(tensors_out, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "step": str(step)})
        write_train_files(tmp, step, model, tokenizer_json, train_state)
        for file in CHECKPOINT_FILES + OPTIONAL_FILES:
            with open(tmp / file, "rb") as handle:
                os.fsync(handle.fileno())
        write_manifest(tmp, CHECKPOINT_FILES + OPTIONAL_FILES)
        fsync_dir(tmp)
        final = store / name
        _publish(tmp, final)
        fsync_dir(store)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    point_to(run_dir, name)
    prune(run_dir, keep, protect={name, *protect}, corrupt=corrupt)
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` onto ``final``. A checkpoint already there (the same step saved
    again) is first renamed aside under a temporary name, so ``final`` is never half deleted."""
    if not final.exists():
        os.replace(tmp, final)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.replace(final, aside)    # onto an empty directory: allowed, atomic
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def point_to(run_dir: str | Path, name: str) -> None:
    """Make ``checkpoints/<name>`` the run's current checkpoint (one atomic symlink swap)."""
    run_dir = Path(run_dir)
    link_tmp = run_dir / f".{POINTER}.{os.getpid()}.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(Path(STORE) / name)
    os.replace(link_tmp, run_dir / POINTER)
    # The files of the checkpoint's format are linked, the others' links removed (a run may change format
    # when it resumes on another number of ranks).
    for file in TOP_LEVEL_FILES:
        top = run_dir / file
        present = (run_dir / STORE / name / file).is_file()
        if present and not top.is_symlink():
            if top.exists():
                top.unlink()
            top.symlink_to(Path(POINTER) / file)
        elif not present and top.is_symlink():
            top.unlink()
    fsync_dir(run_dir)


def prune(run_dir: str | Path, keep: int, protect: Collection[str] = (), corrupt: Collection[str] = ()) -> None:
    """Keep the newest ``keep`` good checkpoints and those named in ``protect`` (the current one, the
    one the run resumed from); delete the rest. ``corrupt``: names known to be damaged, never
    counted as kept, so a bad checkpoint cannot push a good one out."""
    found = checkpoint_dirs(run_dir)
    good = [p.name for p in found if p.name not in corrupt]
    kept = set(good[:keep]) | set(protect)
    for stale in found:
        if stale.name not in kept:
            shutil.rmtree(stale, ignore_errors=True)


def remove_temporaries(run_dir: str | Path, patterns: Iterable[tuple[str, str]] = CHECKPOINT_TEMPORARIES
                       ) -> list[Path]:
    """Delete the temporaries an interrupted write left in ``run_dir``: the entries of each
    ``(folder, regex)`` whose whole name matches. Returns what was removed.

    Only for a run directory no other process is writing to (the start of a run or resume).
    """
    removed = []
    for folder, pattern in patterns:
        base = Path(run_dir) / folder
        if not base.is_dir():
            continue
        regex = re.compile(pattern)
        for entry in sorted(base.iterdir()):
            if not regex.fullmatch(entry.name):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


# ---------------------------------------------------------------------- reading
def _step_of(path: Path) -> int | None:
    match = re.fullmatch(r"step-(\d+)", path.name)
    return int(match.group(1)) if match else None


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Every published checkpoint directory of the run, newest (highest step) first."""
    store = Path(run_dir) / STORE
    if not store.is_dir():
        return []
    found = [p for p in store.iterdir() if _step_of(p) is not None and p.is_dir()]
    return sorted(found, key=_step_of, reverse=True)


def current_checkpoint(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    pointer = run_dir / POINTER
    if not pointer.exists():
        raise CheckpointError(f"{pointer}: no checkpoint in {run_dir} (nothing to resume)")
    return pointer.resolve()


def is_dcp_checkpoint(ckpt: Path) -> bool:
    """Whether ``ckpt`` is in the sharded (DCP) format: it has either of ``DCP_FILES``, or its manifest lists one
    (so a DCP checkpoint that lost both is still told apart, and reported as such)."""
    if any((ckpt / file).exists() for file in DCP_FILES):
        return True
    try:
        entries = read_manifest(ckpt)
    except IntegrityError:
        return False
    return entries is not None and any(file in entries for file in DCP_FILES)


def verify_checkpoint(ckpt: Path) -> bool:
    """Raise ``CheckpointError`` naming the first file of ``ckpt`` that is missing, unreadable or not
    what was written, in either format. Returns False for a checkpoint without a manifest (its checksums
    unknown)."""
    dcp = is_dcp_checkpoint(ckpt)
    for file in DCP_CHECKPOINT_FILES if dcp else CHECKPOINT_FILES:
        if not (ckpt / file).is_file():
            raise CheckpointError(f"{ckpt / file}: missing from the checkpoint")
    try:
        verified = verify_manifest(ckpt)
    except IntegrityError as err:
        raise CheckpointError(str(err)) from None
    if dcp:
        from kimik3.train.dcp_storage import read_index
        from kimik3.train.distributed_checkpoint import read_distributed_meta

        read_distributed_meta(ckpt)
        for file in sorted(set(read_index(ckpt).storage_data.values())):
            if not (ckpt / file).is_file():
                raise CheckpointError(f"{ckpt / file}: missing from the checkpoint (listed in {DCP_FILES[1]})")
    return verified


def intact_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, str]]:
    """The checkpoint to resume from: the current one if it verifies, else the newest intact one
    under ``checkpoints/``; with ``{name: what is wrong}`` for each damaged one skipped on the way.

    Raises ``CheckpointError`` when the run has no checkpoint, or none intact (naming each).
    """
    run_dir = Path(run_dir)
    candidates = checkpoint_dirs(run_dir)
    pointer = run_dir / POINTER
    if pointer.exists():
        current = run_dir / STORE / pointer.resolve().name
        candidates = [current] + [p for p in candidates if p.name != current.name]
    problems: dict[str, str] = {}
    for ckpt in candidates:
        try:
            verify_checkpoint(ckpt)
            return ckpt, problems
        except CheckpointError as err:
            problems[ckpt.name] = str(err)
    if not problems:
        raise CheckpointError(f"{pointer}: no checkpoint in {run_dir} (nothing to resume)")
    raise CheckpointError(f"no intact checkpoint left in {run_dir}: " + "; ".join(problems.values()))


def adopt_checkpoint(run_dir: str | Path, ckpt: Path, problems: dict[str, str],
                     warn: Callable[[str], None] | None = None) -> None:
    """Report each damaged checkpoint ``intact_checkpoint`` skipped through ``warn`` (default: a
    ``CheckpointWarning``) and make ``ckpt`` the current one (re-pointing the symlink if needed)."""
    run_dir = Path(run_dir)
    for problem in problems.values():
        message = f"{problem}: resuming from {ckpt} instead"
        if warn is None:
            warnings.warn(message, CheckpointWarning, stacklevel=3)
        else:
            warn(message)
    pointer = run_dir / POINTER
    if not pointer.exists() or pointer.resolve().name != ckpt.name:
        point_to(run_dir, ckpt.name)


def resume_checkpoint(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> Path:
    """The intact checkpoint to resume from (``intact_checkpoint``), made the current one."""
    ckpt, problems = intact_checkpoint(run_dir)
    adopt_checkpoint(run_dir, ckpt, problems, warn)
    return ckpt


def read_state_entry(ckpt: str | Path, key: str) -> Any:
    """One top-level entry of checkpoint ``ckpt``'s training state that holds no tensors (e.g. the run's args)."""
    path = Path(ckpt) / STATE_JSON_FILE
    try:
        entries = dict(json.loads(path.read_text())["state"]["dict"])
        return unflatten_state(entries[key], {})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: malformed training state ({err!r})") from None


def read_train_files(ckpt: Path, model: torch.nn.Module) -> tuple[int, dict[str, Any], str]:
    """What ``write_train_files`` wrote into checkpoint ``ckpt`` of either format, checked against ``model``'s
    config: (step, training state, tokenizer JSON). ``CheckpointError`` names the file at fault."""
    config, layout = read_config(ckpt)
    if layout != "kimik3":
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: a training checkpoint is in kimik3's layout, this one is "
                              f"{layout!r}")
    if config != model.config:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: the checkpoint's config differs from the run's model config")
    try:
        state_tensor_map = load_file(str(ckpt / STATE_TENSORS_FILE))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{ckpt / STATE_TENSORS_FILE}: unreadable or truncated safetensors file ({err})"
                              ) from None
    try:
        saved = json.loads((ckpt / STATE_JSON_FILE).read_text())
        state = unflatten_state(saved["state"], state_tensor_map)
        step = int(saved["step"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{ckpt / STATE_JSON_FILE}: malformed training state ({err})") from None
    try:
        tokenizer_json = (ckpt / TOKENIZER_FILE).read_text()
    except OSError as err:
        raise CheckpointError(f"{ckpt / TOKENIZER_FILE}: unreadable ({err.strerror or err})") from None
    return step, state, tokenizer_json


def load_checkpoint(run_dir: str | Path, model: torch.nn.Module, checkpoint: str | Path | None = None,
                    warn: Callable[[str], None] | None = None) -> tuple[int, dict[str, Any], str]:
    """Load weights into ``model`` (in place) and return (step, train_state, tokenizer_json).

    ``checkpoint``: the directory to load, already verified; by default ``resume_checkpoint``
    picks it (checksums verified, falling back past damaged ones, each reported through ``warn``).
    Everything is read and checked before the model is touched, so a bad file changes nothing.
    """
    ckpt = Path(checkpoint) if checkpoint is not None else resume_checkpoint(run_dir, warn)
    step, state, tokenizer_json = read_train_files(ckpt, model)
    try:
        weights = load_file(str(ckpt / WEIGHTS_FILE))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{ckpt / WEIGHTS_FILE}: unreadable or truncated safetensors file ({err})") from None
    check_tensors(model.state_dict(), weights, ckpt / WEIGHTS_FILE)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Every rank read the full file; each keeps its own shard of every DTensor.
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(weights[name])
    return step, state, tokenizer_json


# ---------------------------------------------------------------------- sharded (FSDP2) models
# Checkpoints hold full tensors whatever the run (``kimik3.parallel.full_state`` gathers them when
# writing); loading cuts each rank's shard back out, with no communication.
def _shard_like(value: Any, param: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if (isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            and tuple(value.shape) == tuple(param.shape)):
        return distribute_tensor(value.to(param.to_local().device), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value


def _shard_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(type(p).__name__ == "DTensor" for p in params):
        return state_dict
    per_param = {}
    for index, entry in state_dict["state"].items():
        param = params[int(index)]
        per_param[index] = {key: _shard_like(value, param) for key, value in entry.items()}
    return {**state_dict, "state": per_param}


def load_optimizer_state(optimizer: Any, state_dict: Any) -> None:
    """Load a full (single-process layout) optimizer state into an optimizer over sharded or plain params.

    Moments whose parameter is a DTensor are cut to this rank's shard first (no communication).
    """
    members = getattr(optimizer, "optimizers", None)
    if members is None:
        optimizer.load_state_dict(_shard_optimizer_state(optimizer, state_dict))
        return
    if isinstance(state_dict, dict) and set(state_dict) == set(members):
        state_dict = {key: _shard_optimizer_state(members[key], value) for key, value in state_dict.items()}
    optimizer.load_state_dict(state_dict)
