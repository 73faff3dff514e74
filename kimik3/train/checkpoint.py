"""Training checkpoints that survive being killed at any moment, stored without pickle.

Layout of a run directory::

    checkpoints/step-000120/   config.json  model.safetensors  tokenizer.json
                               train_state.safetensors  train_state.json
    checkpoint -> checkpoints/step-000120          (a symlink, swapped atomically)
    config.json, model.safetensors, tokenizer.json,
    train_state.safetensors, train_state.json      (symlinks through ``checkpoint``)
    metrics.jsonl  loss.png

A checkpoint is written whole into a temporary directory, fsynced and renamed into
``checkpoints/``; only then does the single ``checkpoint`` symlink move to it, with
``os.replace``. So a reader always sees one complete checkpoint: the new one or the previous one.
The top-level names let ``from_pretrained(run_dir)`` and ``kimik3 generate --run`` read the latest
weights directly.

Training state = tensors (optimizer moments, RNG state) in ``train_state.safetensors`` plus
everything else in ``train_state.json``: the nested structure of the optimizer state with
tensors replaced by references, the step and the run's arguments.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kimik3.model.pretrained import CONFIG_FILE, WEIGHTS_FILE, check_tensors, read_config, state_tensors

TOKENIZER_FILE = "tokenizer.json"
STATE_TENSORS_FILE = "train_state.safetensors"
STATE_JSON_FILE = "train_state.json"
CHECKPOINT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE)
POINTER = "checkpoint"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the run; the message names the file."""


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
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, tokenizer_json: str,
                    train_state: dict[str, Any], keep: int = 2,
                    weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the checkpoint of ``step`` and make it the run's current one. Returns its directory.

    ``train_state`` is any nested structure of dicts, lists, tensors and JSON scalars.
    ``weights``: the full state dict to write instead of ``model``'s own (a sharded model's
    gathered state, ``full_model_state``); ``model`` then only supplies the config.
    """
    run_dir = Path(run_dir)
    store = run_dir / "checkpoints"
    store.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=store))
    try:
        tensors_out = state_tensors(model) if weights is None else {
            name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
        save_file(tensors_out, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "step": str(step)})
        (tmp / CONFIG_FILE).write_text(model.config.to_json())
        (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
        tensors: dict[str, torch.Tensor] = {}
        structure = flatten_state(train_state, tensors)
        save_file(tensors, str(tmp / STATE_TENSORS_FILE), metadata={"step": str(step)})
        (tmp / STATE_JSON_FILE).write_text(json.dumps({"step": step, "state": structure}, indent=1))
        for file in CHECKPOINT_FILES:
            with open(tmp / file, "rb") as handle:
                os.fsync(handle.fileno())
        final = store / name
        if final.exists():  # re-saving the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(store)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

    link_tmp = run_dir / f".{POINTER}.{os.getpid()}.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(Path("checkpoints") / name)
    os.replace(link_tmp, run_dir / POINTER)
    for file in CHECKPOINT_FILES:
        top = run_dir / file
        if not top.is_symlink():
            if top.exists():
                top.unlink()
            top.symlink_to(Path(POINTER) / file)
    _fsync_dir(run_dir)

    old = sorted(p for p in store.glob("step-*") if p.name != name)
    for stale in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


# ---------------------------------------------------------------------- reading
def current_checkpoint(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    pointer = run_dir / POINTER
    if not pointer.exists():
        raise CheckpointError(f"{pointer}: no checkpoint in {run_dir} (nothing to resume)")
    return pointer.resolve()


def read_state_entry(run_dir: str | Path, key: str) -> Any:
    """One top-level entry of the current training state that holds no tensors (e.g. the run's args)."""
    path = current_checkpoint(run_dir) / STATE_JSON_FILE
    try:
        entries = dict(json.loads(path.read_text())["state"]["dict"])
        return unflatten_state(entries[key], {})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: malformed training state ({err!r})") from None


def load_checkpoint(run_dir: str | Path, model: torch.nn.Module) -> tuple[int, dict[str, Any], str]:
    """Load weights into ``model`` (in place) and return (step, train_state, tokenizer_json).

    Everything is read and checked before the model is touched, so a bad file changes nothing.
    """
    ckpt = current_checkpoint(run_dir)
    for file in CHECKPOINT_FILES:
        if not (ckpt / file).is_file():
            raise CheckpointError(f"{ckpt / file}: missing from the checkpoint")
    config = read_config(ckpt)
    if config != model.config:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: the checkpoint's config differs from the run's model config")
    try:
        weights = load_file(str(ckpt / WEIGHTS_FILE))
        state_tensor_map = load_file(str(ckpt / STATE_TENSORS_FILE))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{ckpt}: unreadable or truncated safetensors file ({err})") from None
    check_tensors(model.state_dict(), weights, ckpt / WEIGHTS_FILE)
    try:
        meta = json.loads((ckpt / STATE_JSON_FILE).read_text())
        state = unflatten_state(meta["state"], state_tensor_map)
        step = int(meta["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{ckpt / STATE_JSON_FILE}: malformed training state ({err})") from None
    tokenizer_json = (ckpt / TOKENIZER_FILE).read_text()
    if _is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # Every rank read the full file; each keeps its own shard of every DTensor.
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(weights[name])
    return step, state, tokenizer_json


# ---------------------------------------------------------------------- sharded (FSDP2) models
# A distributed run writes the very files a single process writes: full tensors, the optimizer
# state in ``MultiOptimizer.state_dict()``'s own layout (param indices, not FQNs). So either kind
# of run resumes the other, and ``from_pretrained`` reads a distributed run's weights as is.
def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in model.state_dict().values())


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a possibly sharded model, as CPU tensors on rank 0.

    A collective when the model is sharded: every rank must call it; ranks other than 0 get {}.
    Each DTensor (FSDP2 shards over dp x cp, MoonEP experts over ep) is gathered whole with
    ``full_tensor()``, in state-dict order, which is the same on every rank.
    """
    if not _is_sharded(model):
        return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    keep = dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            state[name] = full.detach().to("cpu").contiguous()
    return state


def _gather(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().cpu()
    if isinstance(obj, dict):
        return {k: _gather(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_gather(v) for v in obj)
    return obj


def full_optimizer_state(optimizer: Any) -> Any:
    """``optimizer.state_dict()`` with every DTensor gathered whole (a collective: all ranks call it).

    Works for a torch Optimizer or a ``MultiOptimizer``; the result has the single-process layout.
    """
    return _gather(optimizer.state_dict())


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
