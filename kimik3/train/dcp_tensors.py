"""Whole tensors out of a sharded (DCP) checkpoint, one at a time, in one process with no process group.

A checkpoint of ``kimik3.train.distributed_checkpoint`` keeps every tensor as chunks spread over the ranks'
shard files; its JSON index (``dcp_index.json``, ``kimik3.train.dcp_storage``) records each tensor's dtype,
global size and, per chunk, its offsets, sizes and shard file. ``DcpTensors`` reads from the index alone the
names, shapes and dtypes of the tensors under one prefix (``model.``: the weights), and assembles a tensor
only when ``read`` asks for it, from its chunks in the shard files (memory-mapped by safetensors). So a
reader holds one tensor at a time, never the model: what ``from_pretrained`` of a DCP checkpoint and the
streaming export to the Hugging Face layout (``kimik3.interop.dcp_export``) need.

Its interface is ``kimik3.model.pretrained.WeightFiles``'s (``shapes``, ``dtypes`` as safetensors names,
``read``, ``path``; a context manager), so the loader takes either.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from kimik3.train.checkpoint import CheckpointError
from kimik3.train.dcp_storage import _SAFETENSORS_DTYPES, INDEX_FILE, read_index
from kimik3.train.distributed_checkpoint import META_FILE, read_distributed_meta

MODEL_PREFIX = "model."


def is_dcp_dir(directory: str | Path) -> bool:
    """Whether ``directory`` (a checkpoint, or a run directory whose current checkpoint is one) is a DCP checkpoint."""
    return (Path(directory) / META_FILE).is_file()


def dcp_dir(directory: str | Path) -> Path:
    """The real checkpoint directory of ``directory``: itself, or where the run directory's links lead."""
    return (Path(directory) / META_FILE).resolve().parent


class DcpTensors:
    """The tensors under ``prefix`` of the DCP checkpoint in ``directory`` (names without the prefix), read one
    whole tensor at a time (module docstring). ``CheckpointError`` names the file at fault."""

    def __init__(self, directory: str | Path, prefix: str = MODEL_PREFIX):
        self.directory = dcp_dir(directory)
        read_distributed_meta(self.directory)   # complete, of this format
        metadata = read_index(self.directory)
        self.path = self.directory / INDEX_FILE   # the file errors blame
        self._entries = {key.removeprefix(prefix): entry for key, entry in metadata.state_dict_metadata.items()
                         if key.startswith(prefix)}
        self._prefix = prefix
        self._files = metadata.storage_data
        self._handles: dict[str, object] = {}
        self.shapes = {name: tuple(entry.size) for name, entry in self._entries.items()}
        self.dtypes = {name: _SAFETENSORS_DTYPES[entry.properties.dtype] for name, entry in self._entries.items()}
        self.torch_dtypes = {name: entry.properties.dtype for name, entry in self._entries.items()}

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            path = self.directory / file
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (listed in {self.path})")
            try:
                self._handles[file] = safe_open(str(path), "pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({err})") from None
        return self._handles[file]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, assembled from its chunks; every element must be covered exactly once."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        entry = self._entries[name]
        key = self._prefix + name
        out = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        covered = 0
        for chunk in entry.chunks:
            file = self._files.get(MetadataIndex(key, chunk.offsets))
            if file is None:
                raise CheckpointError(f"{self.path}: no shard file for the chunk of {key!r} at {list(chunk.offsets)}")
            path = self.directory / file
            try:
                piece = self._handle(file).get_tensor(key)
            except (SafetensorError, OSError, ValueError) as err:
                raise CheckpointError(f"{path}: tensor {key!r} unreadable ({err})") from None
            if tuple(piece.shape) != tuple(chunk.sizes) or piece.dtype != out.dtype:
                raise CheckpointError(f"{path}: {key!r} holds {piece.dtype} {tuple(piece.shape)}, the index says "
                                      f"{out.dtype} {tuple(chunk.sizes)}")
            region = tuple(slice(start, start + size) for start, size in zip(chunk.offsets, chunk.sizes))
            out[region] = piece
            covered += piece.numel()
        if covered != out.numel():
            raise CheckpointError(f"{self.path}: the chunks of {key!r} cover {covered} of its {out.numel()} elements")
        return out

    def close(self) -> None:
        self._handles.clear()   # safe_open handles release their mapping when collected

    def __enter__(self) -> "DcpTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
