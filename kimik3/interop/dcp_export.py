"""Export a sharded (DCP) training checkpoint to a model directory, streaming: one tensor at a time.

A run on several ranks checkpoints its weights as chunks spread over the ranks' shard files
(``kimik3.train.dcp_checkpoint``). Gathering them into a model first would need the whole model in
one process's memory; here each of our tensors is assembled alone from its chunks
(``kimik3.train.dcp_tensors.DcpTensors``), cast, renamed and split through the layout's rules
(``kimik3.interop.layout``: the same rules ``to_hf`` / ``to_torchtitan`` apply to a whole state dict),
and added to the output shard being filled, which is written out as soon as it is complete. Memory:
one output shard (at most ``max_shard_bytes``, or one tensor larger than that) plus one tensor.

The shards (``model-0000k-of-0000n.safetensors``, cut as ``save_pretrained`` cuts them) are planned
from the index and the config before any data is read, so their names and the index
(``model.safetensors.index.json``, written last) are known up front. Layouts:

- ``hf``: the released checkpoint's names and an HF ``config.json`` (``from_pretrained`` reads it);
- ``kimik3``: our names and config, sharded the same way (``from_pretrained`` reads it);
- ``torchtitan``: the port's names; its hyper-parameters are our config, written as ``kimik3_config.json``
  (the port has no config file of its own; ``from_pretrained`` does not read this layout).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimik3.files import atomic_write
from kimik3.interop.layout import SAME, Layout, _part_names, check_keys, rule_for
from kimik3.model.pretrained import CONFIG_FILE, HF_SHARD_BYTES, INDEX_FILE, read_config

EXPORT_LAYOUTS = ("hf", "kimik3", "torchtitan")
TORCHTITAN_CONFIG_FILE = "kimik3_config.json"


def _layout(name: str) -> Layout | None:
    if name == "hf":
        from kimik3.interop.hf import HF_LAYOUT

        return HF_LAYOUT
    if name == "torchtitan":
        from kimik3.interop.torchtitan import TORCHTITAN_LAYOUT

        return TORCHTITAN_LAYOUT
    if name == "kimik3":
        return None
    raise ValueError(f"layout must be one of {EXPORT_LAYOUTS}, got {name!r}")


class _Lazy(Mapping):
    """Our tensors by name, each read (and cast) only when looked up: for the layout's placeholders, which look
    at one tensor."""

    def __init__(self, names: list[str], read: Callable[[str], torch.Tensor]):
        self._names, self._read = names, read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def export_dcp(src: str | Path, dst: str | Path, layout: str = "hf", *, dtype: torch.dtype | None = None,
               max_shard_bytes: int | None = None, include_mtp: bool = True) -> dict[str, str]:
    """Write the weights of the DCP checkpoint ``src`` (a checkpoint directory, or a run directory whose current
    checkpoint is one) into ``dst`` in ``layout``, streaming (module docstring). ``dtype``: of the floating-point
    weights (default: the one stored; the fp32 islands stay fp32); ``max_shard_bytes``: default 5 GB.
    Returns the index's weight map (their name -> shard file)."""
    from kimik3.interop.hf import hf_config
    from kimik3.model.vision import causal_lm_class
    from kimik3.train.dcp_tensors import DcpTensors

    rules = _layout(layout)
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    max_shard_bytes = max_shard_bytes or HF_SHARD_BYTES
    src, dst = Path(src), Path(dst)
    config, config_layout = read_config(src)
    if config_layout != "kimik3":
        raise ValueError(f"{src / CONFIG_FILE}: a training checkpoint's config is in kimik3's layout, this one is "
                         f"{config_layout!r}")
    with DcpTensors(src) as reader:
        model = causal_lm_class(config)(config, device="meta")
        ours = model.state_dict()
        check_keys(reader.shapes, {name: tuple(t.shape) for name, t in ours.items()}, str(reader.path))
        dtype = dtype or reader.torch_dtypes["embed.weight"]
        model.cast(dtype)
        targets = {name: t.dtype for name, t in model.state_dict().items()}

        def read(name: str) -> torch.Tensor:
            return reader.read(name).to(targets[name])

        # Every output tensor: (their name, our key it comes from, which of its parts), in the order written.
        keys = [k for k in ours if include_mtp or not k.startswith("mtp.")]
        plan: list[tuple[str, str, int]] = []
        sizes: dict[str, int] = {}
        for key in keys:
            template, codec = rule_for(rules, key) if rules is not None else (key, SAME)
            shapes = codec.their_shapes(ours[key].shape)
            for index, (name, shape) in enumerate(zip(_part_names(template, len(shapes), codec), shapes)):
                plan.append((name, key, index))
                sizes[name] = torch.Size(shape).numel() * targets[key].itemsize
        placeholders: dict[str, torch.Tensor] = {}
        if rules is not None:
            if config.tie_embeddings and rules.write_tied_head:   # a copy of the embedding, read again
                plan.append((rules.head_key, "embed.weight", 0))
                sizes[rules.head_key] = sizes[rules.embed_key]
            # Their keys that ours lack (small: built from one of our tensors, read now).
            placeholders = rules.placeholders(_Lazy(keys, read), config)
            for name, tensor in placeholders.items():
                plan.append((name, "", 0))
                sizes[name] = tensor.numel() * tensor.element_size()

        shards: list[list[str]] = [[]]
        filled = 0
        for name, _, _ in plan:
            if shards[-1] and filled + sizes[name] > max_shard_bytes:
                shards.append([])
                filled = 0
            shards[-1].append(name)
            filled += sizes[name]
        files = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
        weight_map = {name: file for names, file in zip(shards, files) for name in names}

        dst.mkdir(parents=True, exist_ok=True)
        shard_of = {name: k for k, names in enumerate(shards) for name in names}
        pending: dict[str, torch.Tensor] = {}
        current: tuple[str, list[torch.Tensor]] | None = None   # our key last read, its parts
        for position, (name, key, index) in enumerate(plan):
            if not key:
                tensor = placeholders[name]
            else:
                if current is None or current[0] != key:
                    codec = rule_for(rules, key)[1] if rules is not None else SAME
                    current = (key, codec.parts(read(key)))
                tensor = current[1][index]
            pending[name] = tensor.contiguous()
            last = position + 1 == len(plan) or shard_of[plan[position + 1][0]] != shard_of[name]
            if last:
                file = files[shard_of[name]]
                part = pending
                atomic_write(dst / file, lambda tmp, part=part: save_file(part, str(tmp), metadata={"format": "pt"}))
                pending = {}
        if layout == "hf":
            config_name, config_text = CONFIG_FILE, json.dumps(hf_config(config, dtype), indent=2) + "\n"
        else:
            config_name = CONFIG_FILE if layout == "kimik3" else TORCHTITAN_CONFIG_FILE
            config_text = config.to_json()
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    atomic_write(dst / config_name, lambda tmp: tmp.write_text(config_text))
    atomic_write(dst / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))
    return weight_map
