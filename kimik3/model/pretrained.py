"""``save_pretrained`` / ``from_pretrained``: ``config.json`` + ``model.safetensors``, never pickle.

Writes go to temporary files in the target directory and are renamed into place, so a crash
leaves either the previous files or the new ones, never half of one. Loading checks every tensor
name, shape and dtype against a model built on the meta device before anything is materialised,
and names the file at fault.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kimik3.config.schema import K3Config
from kimik3.files import atomic_write

if TYPE_CHECKING:
    from kimik3.model.k3 import K3ForCausalLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers as contiguous CPU tensors (tied weights stored once)."""
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}


def save_pretrained(model: "K3ForCausalLM", directory: str | Path) -> None:
    directory = Path(directory)
    tensors = state_tensors(model)
    atomic_write(directory / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    atomic_write(directory / CONFIG_FILE, lambda tmp: tmp.write_text(model.config.to_json()))


def read_config(directory: Path) -> K3Config:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (expected a directory written by save_pretrained)")
    try:
        return K3Config.from_json(path)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable or truncated safetensors file ({err})") from None


def check_tensors(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor], path: Path) -> None:
    """Every expected name present with the same shape and none extra, else a ValueError naming ``path``."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, ref in expected.items():
        if tuple(found[name].shape) != tuple(ref.shape):
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(found[name].shape)}, "
                             f"the config implies {tuple(ref.shape)}")
        if not (found[name].is_floating_point() or not ref.is_floating_point()):
            raise ValueError(f"{path}: tensor {name!r} has dtype {found[name].dtype}, expected floating point")


def load_pretrained(cls: type["K3ForCausalLM"], directory: str | Path, *, device: torch.device | str,
                    dtype: torch.dtype) -> "K3ForCausalLM":
    """Build ``cls`` from ``directory`` on the meta device, check and assign the weights, then move
    the model to ``device`` in ``dtype``."""
    directory = Path(directory)
    config = read_config(directory)
    weights_path = directory / WEIGHTS_FILE
    tensors = read_weights(weights_path)
    model = cls(config, device="meta")
    check_tensors(model.state_dict(), tensors, weights_path)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.to(torch.device(device))
    model.cast(dtype)
    return model

