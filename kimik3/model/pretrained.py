"""``save_pretrained`` / ``from_pretrained``: ``config.json`` + safetensors weights, never pickle.

Two layouts, told apart on load by ``config.json`` (an HF config has ``model_type``):
- ``kimik3``: our parameter names and our config; one ``model.safetensors``;
- ``hf``: the released checkpoint's names and an HF-style config (``kimik3.interop.hf``), the weights in shards
  ``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``max_shard_bytes`` each).
A ``kimik3`` directory may be sharded the same way (``max_shard_bytes``).
``from_pretrained`` also reads a training run written on several ranks, whose weights are a sharded (DCP)
checkpoint (``kimik3.train.dcp_checkpoint``): each tensor is assembled from its chunks when it is loaded
(``kimik3.train.dcp_tensors``), one at a time as for the other forms.

Writes go to temporary files in the target directory and are renamed into place, so a crash
leaves either the previous files or the new ones, never half of one (the index is written last). Loading checks
every tensor name, shape and dtype (from the files' headers) against a model built on the meta device before
anything is materialised, and names the file at fault; it then allocates the model once, in its final dtypes on
the target device, and fills it one tensor at a time, so host memory holds one tensor, never the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from kimik3.config.schema import K3Config
from kimik3.files import atomic_write

if TYPE_CHECKING:
    from kimik3.model.k3 import K3ForCausalLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LAYOUTS = ("kimik3", "hf")
HF_SHARD_BYTES = 5 * 10**9   # Hugging Face's default shard size


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers as contiguous CPU tensors (tied weights stored once)."""
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}


def save_pretrained(model: "K3ForCausalLM", directory: str | Path, *, layout: str = "kimik3",
                    max_shard_bytes: int | None = None, pack_experts: bool = False) -> None:
    """Write ``config.json`` and the weights in ``layout`` ("kimik3" or "hf"). ``max_shard_bytes``: shard the
    weights (default: one file for "kimik3", 5 GB shards for "hf"). ``pack_experts``: quantisation-aware routed
    experts as MXFP4 codes + scales (``kimik3.quant.packed``; experts already packed for serving always are)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    from kimik3.interop import hf_config, to_hf
    from kimik3.quant.packed import packed_expert_tensors

    directory = Path(directory)
    tensors = state_tensors(model)
    packed, replaced = packed_expert_tensors(model, pack_experts)
    if packed and layout != "kimik3":
        raise ValueError(f"packed MXFP4 experts are written in the kimik3 layout only, not {layout!r}")
    tensors = {**{k: v for k, v in tensors.items() if k not in replaced}, **packed}
    if layout == "hf":
        tensors = to_hf(tensors, model.config)
        config_text = json.dumps(hf_config(model.config, model.dtype), indent=2) + "\n"
        max_shard_bytes = max_shard_bytes or HF_SHARD_BYTES
    else:
        config_text = model.config.to_json()
    if max_shard_bytes is None:
        atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    else:
        write_shards(tensors, directory, max_shard_bytes)
    atomic_write(directory / CONFIG_FILE, lambda tmp: tmp.write_text(config_text))


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The tensors' names in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int) -> None:
    """``model-0000k-of-0000n.safetensors`` and the index that maps every tensor to its shard (written last)."""
    shards = shard_plan(tensors, max_shard_bytes)
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        part = {name: tensors[name] for name in names}
        atomic_write(directory / file, lambda tmp, part=part: save_file(part, str(tmp), metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))


def read_config(directory: Path) -> tuple[K3Config, str]:
    """The directory's config and its layout ("hf" when ``config.json`` is an HF config, else "kimik3")."""
    from kimik3.interop import config_from_hf

    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (expected a directory written by save_pretrained)")
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "model_type" in data:
            return config_from_hf(data), "hf"
        return K3Config.from_json(path), "kimik3"
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def read_index(directory: Path) -> dict[str, str] | None:
    """The shard index's map from tensor name to file, or None when the directory holds one weights file."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        return None
    try:
        return json.loads(index_path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a safetensors index ({err})") from None


class WeightFiles:
    """The tensors of a checkpoint directory (its one weights file, or the shards its index lists), read one at a
    time: names, shapes and dtypes come from the files' headers, a tensor's data only when ``read`` asks for it, so
    loading holds one tensor in host memory at a time rather than the whole checkpoint. A context manager."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        weight_map = read_index(directory)
        self.path = directory / (WEIGHTS_FILE if weight_map is None else INDEX_FILE)  # the file errors blame
        files = [WEIGHTS_FILE] if weight_map is None else list(dict.fromkeys(weight_map.values()))
        self._handles, self._where, self.shapes, self.dtypes = [], {}, {}, {}
        try:
            for file in files:
                path = directory / file
                if not path.is_file():
                    raise FileNotFoundError(f"{path}: missing")
                try:
                    handle = safe_open(str(path), "pt")
                    names = list(handle.keys())
                    for name in names:
                        piece = handle.get_slice(name)
                        self.shapes[name], self.dtypes[name] = tuple(piece.get_shape()), piece.get_dtype()
                except (SafetensorError, OSError, ValueError) as err:
                    raise ValueError(f"{path}: unreadable or truncated safetensors file ({err})") from None
                self._handles.append(handle)
                if weight_map is not None:
                    listed = {n for n, f in weight_map.items() if f == file}
                    if set(names) != listed:
                        raise ValueError(f"{path}: holds {sorted(set(names) - listed)[:5]} beyond the index and "
                                         f"lacks {sorted(listed - set(names))[:5]} that it lists")
                self._where.update(dict.fromkeys(names, (handle, path)))
        except BaseException:
            self.close()
            raise

    def read(self, name: str) -> torch.Tensor:
        handle, path = self._where[name]
        try:
            return handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path}: tensor {name!r} unreadable ({err})") from None

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mapping when collected

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_sharded_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` (a checkpoint, or a run directory whose current checkpoint is one) holds its weights
    as a sharded (DCP) training checkpoint."""
    from kimik3.train.dcp_tensors import is_dcp_dir

    return is_dcp_dir(directory)


def weight_files(directory: Path):
    """The reader of ``directory``'s weights: ``WeightFiles``, or ``DcpTensors`` for a sharded checkpoint."""
    if is_sharded_checkpoint(directory):
        from kimik3.train.dcp_tensors import DcpTensors

        return DcpTensors(directory)
    return WeightFiles(directory)


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds weights in any form (one file, an index of shards, a sharded checkpoint)."""
    return ((directory / WEIGHTS_FILE).is_file() or (directory / INDEX_FILE).is_file()
            or is_sharded_checkpoint(directory))


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def stored_dtype(directory: Path) -> torch.dtype:
    """The dtype the directory's embedding is stored in (read from the files' headers, not their data)."""
    with weight_files(directory) as reader:
        for name, stored in reader.dtypes.items():
            if name.endswith("embed.weight") or name.endswith("embed_tokens.weight"):
                if stored not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{reader.path}: embedding stored as {stored}, not a float type kimik3 loads")
                return _SAFETENSORS_DTYPES[stored]
    raise ValueError(f"{directory}: no embedding tensor found to tell the stored dtype")


def check_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], path: Path) -> None:
    """Every expected name present with the same shape and none extra, else a ValueError naming ``path``."""
    check_shapes(expected, {name: tuple(t.shape) for name, t in found.items()},
                 {name for name, t in found.items() if not t.is_floating_point()}, path)


def check_shapes(expected: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], not_float: set[str],
                 path: Path) -> None:
    """``check_tensors`` from the names and shapes alone (``not_float``: the names stored as non-float types)."""
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, ref in expected.items():
        if tuple(shapes[name]) != tuple(ref.shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(shapes[name])}, "
                             f"the config implies {tuple(ref.shape)}")
        if name in not_float and ref.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} is not stored as a floating-point type")


def load_pretrained(cls: type["K3ForCausalLM"], directory: str | Path, *, device: torch.device | str,
                    dtype: torch.dtype) -> "K3ForCausalLM":
    """Build ``cls`` from ``directory``: the names and shapes are checked against the config from the files'
    headers first, then the model is allocated once on ``device`` in ``dtype`` (fp32 islands kept) and filled one
    tensor at a time (host memory: the largest tensor, not the checkpoint)."""
    from kimik3.interop.hf import hf_import_plan
    from kimik3.quant.packed import adopt_packed_experts, move_packed_experts

    directory = Path(directory)
    config, layout = read_config(directory)
    model = cls(config, device="meta")
    with weight_files(directory) as files:
        # Packed MXFP4 experts (our layout): those layers take their codes and scales and drop their weights.
        packed = adopt_packed_experts(model, files.shapes, files.read, files.path) if layout != "hf" else set()
        shapes = {n: shape for n, shape in files.shapes.items() if n not in packed}
        expected = model.state_dict()
        not_float = {n for n, d in files.dtypes.items() if d not in _SAFETENSORS_DTYPES and n not in packed}
        if layout == "hf":
            try:
                plan = hf_import_plan(files.shapes, config)
                plan.check_tied_head(files.read, "from_hf")
            except ValueError as err:
                raise ValueError(f"{files.path}: {err}") from None
            bad = [n for part in plan.parts.values() for n in part if n in not_float]
            if bad:
                raise ValueError(f"{files.path}: tensor {bad[0]!r} is not stored as a floating-point type")

            def build(key: str) -> torch.Tensor:
                return plan.build(key, files.read)
        else:
            check_shapes(expected, shapes, not_float, files.path)
            build = files.read
        model.cast(dtype)  # on the meta device: free, and the allocation below is in the final dtypes
        model.to_empty(device=torch.device(device))
        move_packed_experts(model, torch.device(device))
        with torch.no_grad():
            for key, target in model.state_dict().items():
                target.copy_(build(key))
    return model
