"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards.

``kimik3.train.checkpoint`` gathers the whole model and optimizer state on rank 0 and writes one
safetensors file: simple, but a large run cannot hold its full state on one rank. Here each rank
writes only the DTensor shards it owns (FSDP2, expert parallelism; replicated tensors once), and
loading reshards: a checkpoint written by N ranks loads into M ranks, or into one process with no
process group at all, whatever each side's parallel layout.

Layout of a checkpoint directory (no file in it is a pickle; loading reads JSON and safetensors only)::

    <directory>/  shard-<i>-of-<n>.safetensors  the tensor chunks rank i of n wrote (its DTensor shards; a
                                                replicated tensor once, on one rank); each entry is named by
                                                its DCP key, the chunk's place in the full tensor is recorded
                  dcp_index.json                DCP's index: per tensor its dtype, global size and chunks
                                                (offsets, sizes, shard file); rank 0 writes it once every
                                                shard is complete. Resharding on load plans from it
                  kimik3_dcp.json               step, extra train state, world size, optimizer members and
                                                every non-tensor value of the state (``objects``); written
                                                last: a directory without it is incomplete

The storage (``kimik3.train.dcp_storage``) replaces DCP's default one, which writes tensors with
``torch.save`` and its index and non-tensor values with ``pickle`` (read back by unpickling: code
could run). DCP itself still plans the save and the load (which rank writes or reads which chunk).

What is saved (DCP flattens the nested keys):

- ``model``: ``get_model_state_dict(model)`` (canonical names: wrappers stripped; DTensors stay sharded);
- ``optim``: ``get_optimizer_state_dict(model, opt)`` (keyed by parameter name, not index). K3's
  ``MultiOptimizer`` (``kimik3.optim.muon``) wraps several torch optimizers (``muon``, ``adamw``);
  each member is saved under its own name, ``optim.<name>``, so members of different types never
  mix their state keys.

Tensors go to the shard files; every other value of the state (the optimizers' ``param_groups``: lr,
betas, Muon's ``split`` tuples, names; any non-tensor optimizer slot) goes to ``objects`` in
``kimik3_dcp.json`` with the nesting of the state, as JSON with explicit forms for what JSON lacks:
``{"__tuple__": [...]}``, ``{"__dtype__": "bfloat16"}``, ``{"__dict__": [[key, value], ...]}`` (a dict
whose keys are not all plain strings) and ``{"__list__": {index: ...}}`` (the non-tensor items of a
list that also holds tensors). A value of any other type is refused when saving (``TypeError``).
Loading puts each value back where the model and optimizer being loaded have one (rank 0's values
are recorded: they are the same on every rank).

Atomicity: the ranks write into the temporary sibling ``.<name>.partial``; after DCP's save (and a
barrier) rank 0 writes ``kimik3_dcp.json`` into it and renames it onto ``<directory>`` (a previous
checkpoint there is first renamed aside, so the name never points at a half-deleted one). A crash at
any point leaves the previous checkpoint intact and at most a ``.partial`` directory, which the next
save to the same name removes.

Asynchronous saves (``async_save=True``): the state is copied to host memory before the call returns,
so training may go on at once (and change the parameters); the writing, the barrier and the rename
run in background threads. The call returns a ``concurrent.futures.Future``: ``future.result()``
waits, returns the published directory and re-raises a failure. Wait on it (or call
``wait_for_saves()``) before the process exits or destroys its process group; a new save waits for
the previous one first. With a process group, an async save coordinates the ranks through a
dedicated gloo group (created on first use, collectively): the default group stays free for
training, and a CUDA run's NCCL group is never used from the background thread.

Every function here is collective when a process group is initialised: call it on every rank.
Without one (a single process) nothing is communicated.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kimik3.files import fsync_dir
from kimik3.train.checkpoint import CheckpointError
from kimik3.train.dcp_storage import INDEX_FILE, SafetensorsShardReader, SafetensorsShardWriter, dtype_name, \
    dtype_named, read_index

META_FILE = "kimik3_dcp.json"
FORMAT = "kimik3-dcp"
VERSION = 2   # 1: DCP's pickle storage (.metadata, __<rank>_0.distcp), not loadable here
PARTIAL_SUFFIX = ".partial"
PICKLE_INDEX_FILE = ".metadata"   # DCP's default (pickled) index: recognised only to refuse it

# DCP warns on every single-process save or load, even one that asks for it with no_dist=True.
_NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"

_pending: list[Future] = []
_group_cache: list[tuple[Any, Any]] = []   # [(default group, its gloo checkpoint group)]


# ---------------------------------------------------------------------- the state to save or fill
def _members(optimizer: Any) -> dict[str, torch.optim.Optimizer] | None:
    """The named members of a ``MultiOptimizer``; None for a plain torch optimizer."""
    members = getattr(optimizer, "optimizers", None)
    if isinstance(members, dict):
        return members
    if isinstance(optimizer, torch.optim.Optimizer):
        return None
    raise TypeError(f"optimizer must be a torch.optim.Optimizer or a MultiOptimizer, not {type(optimizer).__name__}")


def _optimizer_kind(optimizer: Any) -> list[str] | str | None:
    if optimizer is None:
        return None
    members = _members(optimizer)
    return "single" if members is None else list(members)


def _state_dict(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP saves it or loads into it (tensors alias the live ones).

    An optimizer that has not stepped yet gets its state created first (torch's
    ``get_optimizer_state_dict`` runs one step with zero gradients and lr 0): a load needs every
    slot to exist, and it then overwrites them.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        members = _members(optimizer)
        if members is None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        else:
            state["optim"] = {name: get_optimizer_state_dict(model, member) for name, member in members.items()}
    return state


# ---------------------------------------------------------------------- non-tensor values <-> JSON
_MARKERS = ("__tuple__", "__dtype__", "__dict__", "__list__")
_NOTHING = object()   # "no non-tensor value here"


def _where(path: tuple) -> str:
    return ".".join(str(key) for key in path)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(item) for item in value)
    return False


def _walked(value: Any) -> bool:
    """Whether ``_split`` / ``_restore`` walk into ``value`` (as DCP does) rather than take it as one JSON value:
    a list holding tensors, or a dict holding tensors or keyed by plain strings (not the markers) alone."""
    if isinstance(value, dict):
        return _has_tensor(value) or all(type(key) is str and key not in _MARKERS for key in value)
    return isinstance(value, list) and _has_tensor(value)


def _encode(value: Any, path: tuple) -> Any:
    """``value`` (no tensor in it) as JSON, with explicit forms for tuples, dtypes and dicts JSON cannot key."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(item, path + (i,)) for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, path + (i,)) for i, item in enumerate(value)]
    if isinstance(value, dict):
        if all(type(key) is str and not key.startswith("__") for key in value):
            return {key: _encode(item, path + (key,)) for key, item in value.items()}
        return {"__dict__": [[_encode(key, path), _encode(item, path + (key,))] for key, item in value.items()]}
    raise TypeError(f"{_where(path)}: a {type(value).__name__} cannot be saved (a non-tensor value must be None, "
                    "bool, int, float, str, a torch dtype, or a tuple, list or dict of them)")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if isinstance(value, dict):
        if len(value) == 1:
            ((key, inner),) = value.items()
            if key == "__tuple__":
                return tuple(_decode(item) for item in inner)
            if key == "__dtype__":
                return dtype_named(inner)
            if key == "__dict__":
                return {_decode(k): _decode(v) for k, v in inner}
        return {key: _decode(item) for key, item in value.items()}
    return value


def _split(value: Any, path: tuple = (), encode: bool = True) -> tuple[Any, Any]:
    """``(tensors, objects)`` of a state: ``tensors`` keeps its dicts (lists become dicts keyed by index, which
    DCP flattens to the same keys) with only the tensors in them, or None; ``objects`` is the JSON of every
    other value with the same nesting, or ``_NOTHING`` (always, without ``encode``)."""
    if isinstance(value, torch.Tensor):
        return value, _NOTHING
    if _walked(value):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        tensors, objects = {}, {}
        for key, item in items:
            if isinstance(value, dict) and (type(key) is not str or key in _MARKERS):
                raise TypeError(f"{_where(path + (key,))}: state dict keys must be strings (and none of {_MARKERS})")
            item_tensors, item_objects = _split(item, path + (key,), encode)
            if item_tensors is not None:
                tensors[str(key)] = item_tensors
            if item_objects is not _NOTHING:
                objects[str(key)] = item_objects
        if objects and isinstance(value, list):
            objects = {"__list__": objects}
        return tensors or None, objects or _NOTHING
    if _has_tensor(value):
        raise TypeError(f"{_where(path)}: a {type(value).__name__} holding tensors cannot be saved")
    return None, (_encode(value, path) if encode else _NOTHING)


def _restore(target: Any, objects: Any, final: Path, path: tuple = ()) -> None:
    """Put the saved non-tensor values ``objects`` (``_split``'s) into ``target`` (which ``_walked``) wherever
    ``target`` has a non-tensor value; ``CheckpointError`` where the checkpoint has none. Saved values the
    target has no place for are left out, as DCP leaves out the tensors it is not asked for."""
    if isinstance(target, dict):
        saved, items = (objects if isinstance(objects, dict) else {}), list(target.items())
    else:
        saved = objects.get("__list__", {}) if isinstance(objects, dict) else {}
        items = list(enumerate(target))
    for key, item in items:
        if isinstance(item, torch.Tensor):
            continue   # DCP loads it
        value = saved.get(str(key), _NOTHING)
        if _walked(item):
            _restore(item, value, final, path + (key,))
        elif value is _NOTHING:
            raise CheckpointError(f"{final / META_FILE}: no saved value for {_where(path + (key,))}")
        else:
            target[key] = _decode(value)


def _optimizer_sections(state: dict[str, Any], kind: list[str] | str | None) -> dict[tuple, dict[str, Any]]:
    """``{key path: optimizer state dict}`` for each optimizer (member) in ``state``."""
    if kind is None:
        return {}
    if kind == "single":
        return {("optim",): state["optim"]}
    return {("optim", name): state["optim"][name] for name in kind}


# ---------------------------------------------------------------------- coordination
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _checkpoint_group():
    """A gloo group over every rank, for DCP's planning and this module's barriers (None without a process
    group). One per default group: created collectively on first use, then reused."""
    if not _distributed():
        return None
    default = dist.distributed_c10d._get_default_group()
    for owner, group in _group_cache:
        if owner is default:
            return group
    group = dist.new_group(backend="gloo")
    _group_cache[:] = [(default, group)]
    return group


def _on_rank0(action: Callable[[], None], group) -> None:
    """Run ``action`` on rank 0 alone; every rank raises if it failed (so no rank waits forever on the others)."""
    error: BaseException | None = None
    if group is None or dist.get_rank() == 0:
        try:
            action()
        except Exception as err:  # noqa: BLE001 - reported to every rank, re-raised below
            error = err
    if group is not None:
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        dist.broadcast(failed, src=0, group=group)
        if error is None and bool(failed):
            raise CheckpointError("rank 0 failed to publish the distributed checkpoint (its error is in its log)")
    if error is not None:
        raise error


def _partial(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL_SUFFIX}"


def _publish(partial: Path, final: Path, meta_text: str, finalize: Callable[[Path], None] | None = None) -> None:
    """Rank 0: write the metadata file into the finished ``partial``, let ``finalize`` add its files, and rename
    it onto ``final``."""
    meta = partial / META_FILE
    with open(meta, "w") as handle:
        handle.write(meta_text)
        handle.flush()
        os.fsync(handle.fileno())
    if finalize is not None:
        finalize(partial)
    fsync_dir(partial)
    if final.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
        os.replace(final, aside)   # onto an empty directory: allowed, atomic
        os.replace(partial, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(partial, final)
    fsync_dir(final.parent)


def _finish(partial: Path, final: Path, meta_text: str, group, finalize: Callable[[Path], None] | None) -> Path:
    if group is not None:
        dist.barrier(group=group)   # every rank's shards are written
    _on_rank0(lambda: _publish(partial, final, meta_text, finalize), group)
    return final


def wait_for_saves() -> None:
    """Wait for every asynchronous save this process started (re-raising the first failure)."""
    while _pending:
        _pending.pop(0).result()


# ---------------------------------------------------------------------- saving
def save_distributed(directory: str | Path, model: nn.Module, optimizer: Any, step: int,
                     extra: dict[str, Any] | None = None, *, async_save: bool = False,
                     finalize: Callable[[Path], None] | None = None) -> Path | Future:
    """Save ``model`` and ``optimizer`` into ``directory``, each rank writing its own shards.

    ``model``: as trained (FSDP2 / expert-parallel DTensors or plain tensors). ``optimizer``: a torch
    optimizer, a ``MultiOptimizer`` (each member saved under its name), or None (the model alone).
    ``step`` and ``extra`` (JSON-able train state: rank 0's is recorded) go to ``kimik3_dcp.json``, with
    the state's non-tensor values (``TypeError`` for one of a type it cannot hold; see the module
    docstring). A checkpoint already at ``directory`` is replaced only once the new one is complete.

    ``finalize``: called on rank 0 alone with the temporary directory once every shard and ``kimik3_dcp.json``
    are in it, before it is published: files it writes there are published with the checkpoint, atomically
    (e.g. the training run's own files and a manifest of checksums). An exception from it publishes nothing.

    Returns the directory; with ``async_save`` a ``Future`` instead, already past the copy of the
    state (training may continue): ``future.result()`` waits until the checkpoint is published and
    returns the directory (see the module docstring).
    """
    import torch.distributed.checkpoint as dcp

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, not {type(extra).__name__}")
    distributed = _distributed()
    meta = {"format": FORMAT, "version": VERSION, "step": step, "extra": extra,
            "world_size": dist.get_world_size() if distributed else 1,
            "optimizer": _optimizer_kind(optimizer), "torch": torch.__version__}
    json.dumps(meta)   # checked on every rank before any collective, so a bad value fails everywhere at once
    wait_for_saves()   # one save at a time: they share the checkpoint group
    final = Path(directory).absolute()
    partial = _partial(final)
    group = _checkpoint_group()
    # DCP sees the tensors alone; every other value goes to kimik3_dcp.json (a TypeError here, on every rank).
    tensors, objects = _split(_state_dict(model, optimizer))
    meta["objects"] = {} if objects is _NOTHING else objects
    meta_text = json.dumps(meta, indent=1)

    def prepare() -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists():   # left by a save that was interrupted
            shutil.rmtree(partial)

    _on_rank0(prepare, group)   # (also the barrier: nobody writes into partial before it is clean)
    writer = SafetensorsShardWriter(partial)
    if not async_save:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            dcp.save(tensors or {}, storage_writer=writer, process_group=group, no_dist=not distributed)
        return _finish(partial, final, meta_text, group, finalize)

    # The default stager copies every tensor (DTensors' local shards included) before this returns.
    response = dcp.async_save(tensors or {}, storage_writer=writer, process_group=group, no_dist=not distributed)
    upload = getattr(response, "upload_completion", response)
    publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimik3-dcp-publish")

    def publish() -> Path:
        upload.result()   # a failed write raises here: nothing is renamed, the previous checkpoint stays
        return _finish(partial, final, meta_text, group, finalize)

    future = publisher.submit(publish)
    publisher.shutdown(wait=False)
    _pending.append(future)
    return future


# ---------------------------------------------------------------------- loading
def read_distributed_meta(directory: str | Path) -> dict[str, Any]:
    """The ``kimik3_dcp.json`` of a complete checkpoint; ``CheckpointError`` for a missing or incomplete one."""
    final = Path(directory)
    if not final.exists():
        partial = _partial(final.absolute())
        if partial.exists():
            raise CheckpointError(f"{final}: no such checkpoint; {partial} is an incomplete one (its save was "
                                  "interrupted), not loadable")
        raise CheckpointError(f"{final}: no such checkpoint directory")
    if not final.is_dir():
        raise CheckpointError(f"{final}: not a directory (a distributed checkpoint is a directory)")
    if final.name.startswith(".") and final.name.endswith(PARTIAL_SUFFIX):
        raise CheckpointError(f"{final}: an incomplete checkpoint (a save interrupted before it was published)")
    if (final / PICKLE_INDEX_FILE).is_file() and not (final / INDEX_FILE).is_file():
        raise CheckpointError(f"{final}: written in DCP's pickle format ({PICKLE_INDEX_FILE} and torch.save shards, "
                              "by an older kimik3): not loadable, as loading never unpickles")
    for name in (INDEX_FILE, META_FILE):
        if not (final / name).is_file():
            raise CheckpointError(f"{final}: incomplete or not a distributed checkpoint ({name} is missing)")
    try:
        meta = json.loads((final / META_FILE).read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        if int(meta["version"]) != VERSION:
            raise ValueError(f"version {meta['version']}, this code reads {VERSION}" +
                             (" (1: DCP's pickle format, never loaded)" if int(meta["version"]) < VERSION else ""))
        int(meta["step"])
        if not isinstance(meta["objects"], dict):
            raise ValueError("objects is not a JSON object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{final / META_FILE}: malformed ({err})") from None
    return meta


def _subtree(objects: Any, path: tuple) -> dict[str, Any]:
    for key in path:
        objects = objects.get(key, {}) if isinstance(objects, dict) else {}
    return objects if isinstance(objects, dict) else {}


def _check_and_trim(final: Path, state: dict[str, Any], kind: Any, saved: dict[str, Any], objects: Any) -> None:
    """Raise ``CheckpointError`` for model tensors the checkpoint lacks or holds in another shape; drop the
    optimizer slots of parameters the checkpoint has no state for (they had not been stepped: after the load
    they have none, as in the run that saved). ``saved``: the index's tensors; ``objects``: the other values."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    missing, shapes = [], []
    unexpected = sorted(key.removeprefix("model.") for key in saved
                        if key.startswith("model.") and key.removeprefix("model.") not in state["model"])
    for name, value in state["model"].items():
        entry = saved.get(f"model.{name}")
        if entry is None:
            missing.append(name)
        elif isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata) \
                and tuple(entry.size) != tuple(value.shape):
            shapes.append(f"{name}: {tuple(entry.size)} saved, {tuple(value.shape)} in the model")
    if missing:
        raise CheckpointError(f"{final}: the checkpoint has no {missing[0]!r}" +
                              (f" (nor {len(missing) - 1} more model entries)" if len(missing) > 1 else "") +
                              ": a different model?")
    if unexpected:
        raise CheckpointError(f"{final}: the model has no {unexpected[0]!r}" +
                              (f" (nor {len(unexpected) - 1} more checkpoint entries)" if len(unexpected) > 1 else "") +
                              ": a different model?")
    if shapes:
        raise CheckpointError(f"{final}: shapes differ from the model's: " + "; ".join(shapes[:3]) +
                              (f" (and {len(shapes) - 3} more)" if len(shapes) > 3 else ""))
    for path, section in _optimizer_sections(state, kind).items():
        prefix = ".".join(path)
        slots = section.get("state", {})
        for fqn in list(slots):
            saved_objects = _subtree(objects, path + ("state", fqn))
            if not all(f"{prefix}.state.{fqn}.{key}" in saved or key in saved_objects for key in slots[fqn]):
                del slots[fqn]


def load_distributed(directory: str | Path, model: nn.Module, optimizer: Any) -> tuple[int, dict[str, Any]]:
    """Load a ``save_distributed`` checkpoint into ``model`` and ``optimizer`` in place; returns (step, extra).

    ``model`` and ``optimizer`` are built (and parallelised) as for training, in any layout and world
    size, or plain in one process without a process group: DCP reads each rank's part of every tensor.
    The optimizer must be of the same kind (the same ``MultiOptimizer`` member names); None loads the
    model alone. ``extra`` is ``{}`` when the save recorded none.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    final = Path(directory)
    meta = read_distributed_meta(final)
    kind = _optimizer_kind(optimizer)
    saved_kind = meta.get("optimizer")
    if kind is not None and (sorted(kind) if isinstance(kind, list) else kind) != (
            sorted(saved_kind) if isinstance(saved_kind, list) else saved_kind):
        raise CheckpointError(f"{final / META_FILE}: the checkpoint's optimizer is {saved_kind!r}, this run's "
                              f"is {kind!r}")
    saved = dict(read_index(final).state_dict_metadata)
    wait_for_saves()   # an async save of this process may still use the checkpoint group
    distributed = _distributed()
    group = _checkpoint_group()
    state = _state_dict(model, optimizer)
    _check_and_trim(final, state, kind, saved, meta["objects"])
    _restore(state, meta["objects"], final)   # the non-tensor values, from the JSON
    tensors, _ = _split(state, encode=False)   # the tensors, read by DCP in place
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.load(tensors or {}, storage_reader=SafetensorsShardReader(final), process_group=group,
                 no_dist=not distributed)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        members = _members(optimizer)
        if members is None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        else:
            for name, member in members.items():
                set_optimizer_state_dict(model, member, state["optim"][name])
    return int(meta["step"]), meta.get("extra") or {}
