"""Quantisation-aware experts stored packed in a checkpoint: MXFP4 codes + E8M0 scales instead of the weights.

``save_pretrained(..., pack_experts=True)`` writes, for every routed-expert layer of a model with
``moe.expert_quant = "mxfp4"``, each of its three weights ``<layer>.<weight>`` as two tensors::

    <layer>.<weight>.mxfp4_codes    uint8 [E, out, in/2]   (``kimik3.quant.mx.quantize(w, "mxfp4", axis=-2)``)
    <layer>.<weight>.mxfp4_scales   uint8 [E, out, in/32]

(a layer already packed for serving is always written so). ``from_pretrained`` recognises them and builds those
layers packed (``RoutedExperts.use_packed``): the full-precision expert weights are never allocated, which is
where a serving process saves its memory (3.76x on the experts against bf16). A packed checkpoint serves; it
cannot resume training (the full-precision weights QAT updates are not in it). Our layout only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kimik3.quant.kernel_order import to_ocp_order
from kimik3.quant.mx import BLOCK_SIZE, MXTensor, quantize

CODES, SCALES = ".mxfp4_codes", ".mxfp4_scales"


def _expert_layers(model: nn.Module):
    from kimik3.model.moe import RoutedExperts

    return [(name, module) for name, module in model.named_modules() if isinstance(module, RoutedExperts)]


def packed_expert_tensors(model: nn.Module, pack: bool) -> tuple[dict[str, torch.Tensor], set[str]]:
    """For saving: the codes and scales to write (CPU tensors), and the full-precision weight names they replace.
    Layers already packed always; with ``pack`` every quantisation-aware layer (ValueError for a model without
    one)."""
    out: dict[str, torch.Tensor] = {}
    replaced: set[str] = set()
    layers = _expert_layers(model)
    if pack and not any(module.quant == "mxfp4" for _, module in layers):
        raise ValueError("pack_experts writes quantisation-aware experts as MXFP4: this model's config has no "
                         "moe.expert_quant = 'mxfp4'")
    for name, module in layers:
        packed = module.packed
        if packed is None:
            if not pack or module.quant != "mxfp4":
                continue
            packed = {w: quantize(getattr(module, w).detach().float(), "mxfp4", axis=-2) for w in module.EXPERT_WEIGHTS}
            replaced.update(f"{name}.{w}" for w in module.EXPERT_WEIGHTS)
        for w, mx in packed.items():
            mx = to_ocp_order(mx)     # (a layer holds its codes in kernel order; files keep the specification's)
            out[f"{name}.{w}{CODES}"] = mx.codes.detach().to("cpu").contiguous()
            out[f"{name}.{w}{SCALES}"] = mx.scales.detach().to("cpu").contiguous()
    return out, replaced


def adopt_packed_experts(model: nn.Module, shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor],
                         path) -> set[str]:
    """For loading, on the model built on the meta device: every expert layer whose codes and scales the files
    hold (``shapes``: their names and shapes) takes them (read on the CPU; ``move_packed_experts`` moves them
    once the model is placed) and drops its full-precision weights. Returns the names consumed. ValueError,
    naming ``path``, for packed experts the config does not quantise, a layer packed in part, or wrong shapes."""
    consumed: set[str] = set()
    for name, module in _expert_layers(model):
        keys = {w: (f"{name}.{w}{CODES}", f"{name}.{w}{SCALES}") for w in module.EXPERT_WEIGHTS}
        present = [k for pair in keys.values() for k in pair if k in shapes]
        if not present:
            continue
        if len(present) != 2 * len(keys):
            raise ValueError(f"{path}: layer {name!r} is packed in part: has {sorted(present)}")
        if module.quant != "mxfp4":
            raise ValueError(f"{path}: layer {name!r} is stored as MXFP4 but the config's moe.expert_quant is "
                             f"{module.quant!r}")
        packed = {}
        for w, (codes_key, scales_key) in keys.items():
            e, i, o = getattr(module, w).shape
            want = {codes_key: (e, o, i // 2), scales_key: (e, o, i // BLOCK_SIZE)}
            for key, shape in want.items():
                if tuple(shapes[key]) != shape:
                    raise ValueError(f"{path}: tensor {key!r} has shape {tuple(shapes[key])}, the config implies "
                                     f"{shape}")
            codes, scales = read(codes_key), read(scales_key)
            if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
                raise ValueError(f"{path}: {codes_key!r} and {scales_key!r} must be uint8")
            packed[w] = MXTensor(codes, scales, "mxfp4", BLOCK_SIZE, axis=1, shape=(e, i, o))
        module.use_packed(packed)
        consumed.update(present)
    return consumed


def move_packed_experts(model: nn.Module, device: torch.device) -> None:
    """The packed expert weights of ``model`` onto ``device``."""
    for _, module in _expert_layers(model):
        if module.packed is not None:
            module.move_packed(device)
