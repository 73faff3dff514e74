"""Several projections of one input as one matmul.

Legend: N_i = out features of the i-th projection, D = in features.

A layer often projects the same input through several ``nn.Linear`` (KDA: q, k, v, the forget gate's first
factor, beta and the output gate; Gated MLA: wq_a, wkv_a and the gate; a SiTU-GLU: gate and up). They stay
separate parameters (checkpoint names, per-head Muon rules), but run as one matmul over their concatenated
weights [sum N_i, D]: one launch instead of up to six, and the input read once. The outputs are column slices of
that one result (views: unit column stride, row stride sum N_i).

The concatenated weight is found in one of two ways, the math being the same:
- ``pack_projections(model)`` (inference: the serving runner calls it) moves each group's weights into one buffer
  as adjacent row blocks, so the concatenation is that buffer, read in place;
- otherwise (training: each weight a separate leaf that needs its own gradient, or weights never packed) it is a
  ``torch.cat`` of the weights each call, differentiable, costing one read of the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


def _packed(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The [sum N_i, D] tensor the weights are adjacent row blocks of, or None when they are not."""
    first = weights[0]
    cols = first.shape[1]
    ptr = first.data_ptr()
    for w in weights:
        if type(w) not in (torch.Tensor, nn.Parameter) or w.ndim != 2 or w.shape[1] != cols \
                or not w.is_contiguous() or w.dtype != first.dtype or w.device != first.device or w.data_ptr() != ptr:
            return None
        ptr += w.numel() * w.element_size()
    try:
        storages = {w.untyped_storage().data_ptr() for w in weights}
    except RuntimeError:   # a parameter whose storage was freed (FSDP's unsharded views between uses): not packed
        return None
    if len(storages) != 1:  # adjacent by chance in separate allocations
        return None
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, cols), (cols, 1))


def concat_weight(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """The projections' weights stacked along the output features: [sum N_i, D]."""
    weights = [lin.weight for lin in linears]
    # (under torch.compile: the cat, which traces; the storage inspection of ``_packed`` would break the graph)
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        packed = _packed(weights)
        if packed is not None:
            return packed
    return torch.cat(weights)


def project(x: torch.Tensor, linears: Sequence[nn.Linear], sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
    """[..., D] -> the projections' outputs side by side [..., sum N_i], split into ``sizes`` (default: one piece
    per projection), from one matmul (the linears have no bias).

    Where FSDP holds the projections sharded until each is called (``kimik3.parallel.fsdp`` shards the children of
    a module that keeps fp32 parameters as their own group), they are called one by one instead: calling them is
    what gathers their weights and, in backward, reduces their gradients."""
    sizes = list(sizes) if sizes is not None else [lin.out_features for lin in linears]
    if any(isinstance(lin.weight, DTensor) for lin in linears):
        return list(torch.cat([lin(x) for lin in linears], dim=-1).split(sizes, dim=-1))
    return list(F.linear(x, concat_weight(linears)).split(sizes, dim=-1))


def pack_projections(model: nn.Module) -> int:
    """Move the weights of every projection group (each module's ``projection_groups()``) into one buffer per group,
    as adjacent row blocks, so that ``concat_weight`` reads them in place. Values, names, dtypes and devices are
    unchanged; state-dict loading (an in-place copy) keeps the layout. For inference (the serving engine packs its
    model): a packed group's weights share one storage, which safetensors refuses to save as it is. Returns the
    number of groups packed."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            groups = getattr(module, "projection_groups", None)
            for group in groups() if groups is not None else ():
                weights = [lin.weight for lin in group]
                if _packed(weights) is not None:
                    continue
                if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
                    raise ValueError(f"{type(module).__name__}: a projection group's weights must share dtype, "
                                     f"device and in features to be packed")
                buffer = torch.cat([w.detach() for w in weights])
                start = 0
                for w in weights:
                    w.data = buffer[start:start + w.shape[0]]
                    start += w.shape[0]
                count += 1
    return count
