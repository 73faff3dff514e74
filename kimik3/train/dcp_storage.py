"""Pickle-free storage for ``torch.distributed.checkpoint`` (DCP): safetensors shard files and a JSON index.

DCP's own ``FileSystemWriter`` / ``FileSystemReader`` write every tensor with ``torch.save`` and the
checkpoint's index (``Metadata``) with ``pickle.dump``, and read them back with ``torch.load`` and
``pickle.load``. This pair keeps DCP's planning (which rank writes which chunk, resharding on load)
and replaces only the storage:

- ``shard-<i>-of-<n>.safetensors``: what plan ``i`` of ``n`` (rank ``i``) writes, one safetensors
  entry per tensor chunk, named by its DCP key (``model.embed.weight``). The entry holds the chunk's
  elements only; where the chunk lies in the full tensor is in the index, and also in the header's
  ``__metadata__`` (``DCP_SHARDING_INFO``: ``{key: {"saved_offsets": [...]}}``, torch's convention,
  so ``torch.distributed.checkpoint.HuggingFaceStorageReader`` reads these files too). A rank
  with nothing to write (every tensor it holds deduplicated to another rank) writes no file.
- ``dcp_index.json``: DCP's ``Metadata`` as JSON, written by the coordinator (rank 0) once every
  rank's shard file is complete: per tensor its dtype (and the other ``TensorProperties``), global
  size and chunks (offsets, sizes, the shard file holding it), the planner's key paths, DCP's
  format version.

Only tensors are stored: a non-tensor value (DCP would pickle it as a ``BYTE_IO`` item) is refused
when the save is planned, so the caller must take such values out of the state first (see
``kimik3.train.distributed_checkpoint``). Loading reads the JSON index and slices the shard files
through safetensors (memory-mapped: only the rows a rank needs are read); nothing is unpickled.

Shard files are written in the machine's byte order, which must be little-endian as safetensors
requires (x86 and ARM Linux are).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from kimik3.train.checkpoint import CheckpointError

INDEX_FILE = "dcp_index.json"
INDEX_FORMAT = "kimik3-dcp-index"
INDEX_VERSION = 1
SHARD_SUFFIX = ".safetensors"
# DCP's checkpoint format version (torch's filesystem storage records "1.0.0"); its planners read it.
DCP_FORMAT_VERSION = "1.0.0"

_SHARD_NAME = re.compile(r"shard-\d{5,}-of-\d{5,}\.safetensors")

# torch dtype -> safetensors dtype, for the dtypes every safetensors >= 0.4 reads into torch.
_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}{SHARD_SUFFIX}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_named(name: Any) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ValueError for anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _name_of(table: dict[str, Any], value: Any, what: str) -> str:
    for name, known in table.items():
        if known == value:
            return name
    raise CheckpointError(f"a tensor {what} of {value} cannot be recorded in {INDEX_FILE}")


# ---------------------------------------------------------------------- the index: DCP's Metadata as JSON
def metadata_to_json(metadata: Metadata, files: dict[MetadataIndex, str]) -> dict[str, Any]:
    """``metadata`` (every entry a tensor) and the shard file of each chunk as a JSON-able dict."""
    tensors: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{key!r} is not a tensor ({type(entry).__name__}): only tensors are stored")
        props = entry.properties
        chunks = []
        for chunk in entry.chunks:
            location = files.get(MetadataIndex(key, chunk.offsets))
            if location is None:
                raise CheckpointError(f"{key!r}: no rank reported writing its chunk at {list(chunk.offsets)}")
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": location})
        tensors[key] = {
            "dtype": dtype_name(props.dtype), "size": list(entry.size), "chunks": chunks,
            "requires_grad": bool(props.requires_grad), "pin_memory": bool(props.pin_memory),
            "layout": _name_of(_LAYOUTS, props.layout, "layout"),
            "memory_format": _name_of(_MEMORY_FORMATS, props.memory_format, "memory format"),
        }
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):
        planner_data = {key: list(path) for key, path in planner_data.items()}
    elif planner_data is not None:
        raise CheckpointError(f"DCP's planner data is a {type(planner_data).__name__}, not a key -> path mapping")
    return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "dcp_version": metadata.version or DCP_FORMAT_VERSION,
            "tensors": tensors, "planner_data": planner_data}


def metadata_from_json(doc: Any) -> Metadata:
    """The ``Metadata`` (with ``storage_data``: chunk -> shard file name) of an index; ValueError if malformed."""
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else doc!r}, expected {INDEX_FORMAT!r}")
    if int(doc["version"]) > INDEX_VERSION:
        raise ValueError(f"index version {doc['version']} is newer than this code's {INDEX_VERSION}")
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, str] = {}
    for key, entry in doc["tensors"].items():
        properties = TensorProperties(
            dtype=dtype_named(entry["dtype"]), layout=_LAYOUTS[entry["layout"]],
            requires_grad=bool(entry["requires_grad"]), memory_format=_MEMORY_FORMATS[entry["memory_format"]],
            pin_memory=bool(entry["pin_memory"]))
        chunks = []
        for chunk in entry["chunks"]:
            offsets, sizes, location = torch.Size(chunk["offsets"]), torch.Size(chunk["sizes"]), chunk["file"]
            if not isinstance(location, str) or not _SHARD_NAME.fullmatch(location):
                raise ValueError(f"{key!r}: shard file {location!r} is not a shard file name")
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage_data[MetadataIndex(key, offsets)] = location
        state_dict_metadata[key] = TensorStorageMetadata(properties=properties, size=torch.Size(entry["size"]),
                                                         chunks=chunks)
    planner_data = doc.get("planner_data")
    if planner_data is not None:
        planner_data = {key: tuple(path) for key, path in planner_data.items()}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data, storage_data=storage_data,
                    storage_meta=StorageMeta(), version=str(doc["dcp_version"]))


def read_index(directory: str | Path) -> Metadata:
    """The ``Metadata`` of the checkpoint in ``directory``; ``CheckpointError`` if its index is missing or malformed."""
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a checkpoint of this format)")
    try:
        return metadata_from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path}: malformed ({err!r})") from None


def _write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling, fsynced, so ``path`` is whole or absent."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------- writing
def _write_shard(path: Path, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
    """Write the tensor chunks of ``items`` into the safetensors file ``path``, streaming one chunk at a time."""
    if sys.byteorder != "little":
        raise CheckpointError("safetensors files are little-endian; this machine is not")
    header: dict[str, Any] = {}
    sharding: dict[str, Any] = {}
    position = 0
    for item in items:
        key, data = item.index.fqn, item.tensor_data
        if data is None:
            raise CheckpointError(f"{key!r}: not a tensor")
        if key in header:   # one entry per key and file (a DTensor has one local chunk per rank)
            raise CheckpointError(f"{key!r}: two chunks of it on one rank, which this storage does not hold")
        dtype = data.properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key!r}: dtype {dtype} cannot be stored in safetensors")
        nbytes = math.prod(data.chunk.sizes) * dtype.itemsize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(data.chunk.sizes),
                       "data_offsets": [position, position + nbytes]}
        sharding[key] = {"saved_offsets": list(data.chunk.offsets)}
        position += nbytes
    header["__metadata__"] = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)   # the data starts 8-byte aligned, as safetensors writes it

    results = []
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(blob)))
        handle.write(blob)
        for item in items:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{item.index.fqn!r}: a {type(tensor).__name__}, not a tensor")
            tensor = tensor.detach()
            expected, found = (tuple(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype), \
                (tuple(tensor.shape), tensor.dtype)
            if found != expected:
                raise CheckpointError(f"{item.index.fqn!r}: planned as {expected}, got {found}")
            tensor = tensor.to("cpu").contiguous()
            if tensor.numel():
                handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=path.name))
        handle.flush()
        os.fsync(handle.fileno())
    return results


class _DirectoryCheckpoint:
    """What the writer and the reader share: the checkpoint is a local directory, ``self.path``."""

    path: Path

    @property
    def checkpoint_id(self) -> str | os.PathLike:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in str(checkpoint_id)


class SafetensorsShardWriter(_DirectoryCheckpoint, StorageWriter):
    """A DCP ``StorageWriter``: each rank's chunks into one safetensors file, the index as JSON (module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("SafetensorsShardWriter writes one index for all ranks: use_collectives must be True")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        objects = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if objects:
            raise TypeError(f"{objects[0]!r} is not a tensor: this storage holds tensors only (DCP would pickle it)")
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=shard_name(i, len(plans))) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = _write_shard(self.path / plan.storage_data, plan.items, planner) if plan.items else []
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = {result.index: result.storage_data for rank_results in results for result in rank_results}
        doc = metadata_to_json(metadata, files)
        _write_file(self.path / INDEX_FILE, json.dumps(doc, separators=(",", ":")).encode())


# ---------------------------------------------------------------------- reading
class SafetensorsShardReader(_DirectoryCheckpoint, StorageReader):
    """The DCP ``StorageReader`` of ``SafetensorsShardWriter``'s checkpoints: no pickle, no ``torch.load``."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self.storage_data: dict[MetadataIndex, str] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self) -> Metadata:   # (no **kwargs: there is no per-rank index to fall back on)
        metadata = read_index(self.path)
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.dtypes = {key: entry.properties.dtype for key, entry in metadata.state_dict_metadata.items()}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{item.storage_index.fqn!r}: not a tensor (this storage holds tensors only)")
            per_file.setdefault(self.storage_data[item.storage_index], []).append(item)
        for name, items in per_file.items():
            with safe_open(str(self.path / name), framework="pt", device="cpu") as shard:
                for item in items:
                    key = item.storage_index.fqn
                    piece = shard.get_slice(key)
                    if not any(item.storage_offsets) and list(item.lengths) == list(piece.get_shape()):
                        tensor = shard.get_tensor(key)   # the whole chunk (also a 0-d one)
                    else:
                        tensor = piece[tuple(slice(start, start + length)
                                             for start, length in zip(item.storage_offsets, item.lengths))]
                    target = planner.resolve_tensor(item).detach()
                    if tensor.dtype != self.dtypes[key] or target.shape != tensor.shape:
                        raise CheckpointError(f"{self.path / name}: {key!r} holds {tensor.dtype} "
                                              f"{tuple(tensor.shape)}, the index says {self.dtypes[key]} and the "
                                              f"load needs {tuple(target.shape)}")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future
