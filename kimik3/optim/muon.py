"""K3's per-head Muon, the AdamW remainder, and the one rule table that splits a model between them.

Muon (momentum orthogonalised by Newton–Schulz) replaces a matrix parameter's momentum by an
approximately orthogonal matrix with the same singular vectors, then scales it so that its RMS
matches a typical AdamW update (Moonlight's ``0.2 * sqrt(max(m, n))``), which lets Muon reuse
AdamW's learning rate and weight decay.

K3 applies it *per head*: an attention projection is cut into one block per head (its rows for
the input projections, its columns for the output projection) and every block is orthogonalised
on its own, so a head whose gradient is small still gets a full-size, well-conditioned update
instead of being drowned by the loudest heads of the same matrix. The stacked routed-expert
weights [E, a, b] likewise get one orthogonalisation per expert.

One step costs a few kernel launches per block *shape*, not per parameter: the momentum, the decay
and the update are ``torch._foreach_*`` ops over all parameters of a group, and every block of the
same [m, n] shape (and Newton–Schulz options) goes through Newton–Schulz in one batch, across
parameters and groups (K3 has hundreds of per-head / per-expert parameters but a few dozen shapes).

Legend: H = heads (or blocks), E = experts, m x n = the shape of one orthogonalised block.

Public pieces:
- ``Muon``: the optimizer; each param group carries a ``split`` saying how to cut its params.
- ``classify_parameters`` / ``build_param_groups``: the grouping of a ``K3ForCausalLM``, from the
  ``optimizer_rules()`` its modules declare (``kimik3/model/param_rules.py``).
- re-exported: ``newton_schulz`` and the block layouts (``newton_schulz.py``), ``MultiOptimizer``
  (``multi.py``: Muon + AdamW behind one optimizer-like object for the trainer).

Sharded (DTensor) parameters: see ``sharded.py`` (which step on their local shard, and the distributed
Newton–Schulz of the ones whose blocks cross shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kimik3.model.param_rules import ParamRule, adamw, muon
from kimik3.optim.multi import MultiOptimizer
from kimik3.optim.newton_schulz import (
    _NS_DTYPES,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    SPLIT_KINDS,
    BlockLayout,
    _ns_dtype_name,
    block_layout,
    newton_schulz,
    normalize_split,
)
from kimik3.optim.sharded import Crossing, shard_layout, step_crossing

__all__ = ["DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_EPS", "DEFAULT_NS_STEPS", "DEFAULT_RMS_SCALE", "SPLIT_KINDS",
           "BlockLayout", "MultiOptimizer", "Muon", "ParamRule", "block_layout", "build_param_groups",
           "classify_parameters", "newton_schulz", "normalize_split"]

# Moonlight ("Muon is scalable for LLM training"): an orthogonal m x n matrix has RMS
# 1/sqrt(max(m, n)); AdamW updates have RMS ~0.2-0.4 in practice, so scaling by
# 0.2 * sqrt(max(m, n)) gives Muon updates of RMS ~0.2 * lr, AdamW's range.
DEFAULT_RMS_SCALE = 0.2
# At most this much of stacked blocks (elements x the larger of the gradient's and the iteration's
# element size) goes through one Newton–Schulz call; its matmul temporaries are a few times that.
NS_BUCKET_BYTES = 256 * 2 ** 20


# --------------------------------------------------------------------------- the optimizer
class Muon(torch.optim.Optimizer):
    """Muon with per-block (per-head / per-expert) orthogonalisation.

    Per parameter p with gradient g (shapes as p; ``split`` from p's group):

        buf <- momentum * buf + (1 - momentum) * g                  (momentum_buffer, p's dtype)
        d   <- (1 - momentum) * g + momentum * buf   if nesterov else buf
        O   <- newton_schulz(d cut into blocks [H, m, n]) put back in p's shape   (``ns_dtype``)
        p   <- p * (1 - lr * weight_decay)                          (decoupled decay)
        p   <- p - lr * rms_scale * sqrt(max(m, n)) * O

    The momentum is the EMA form torch.optim.Muon uses; it is (1 - momentum) times the classic
    ``buf = momentum * buf + g`` and the Frobenius normalisation inside Newton–Schulz removes
    that constant, so the direction is the same. With split ("whole",) this is step-for-step
    identical to ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``.

    Args:
        params: tensors, (name, tensor) pairs, or param-group dicts (which may set any option
            below, ``split`` in particular).
        lr: learning rate (float, >= 0). AdamW-scale values work (the update RMS is ~rms_scale*lr). A 0-dim
            tensor is read where it lies at every step (a CUDA-graphed step: the schedule writes it in place).
        weight_decay: decoupled decay factor (>= 0), applied as p *= 1 - lr * weight_decay.
        momentum: in [0, 1).
        nesterov: use the Nesterov look-ahead (default True).
        split: how each parameter is cut into blocks (see ``block_layout``); default ("whole",).
        ns_steps, ns_coefficients, eps: Newton–Schulz options (see ``newton_schulz``).
        ns_dtype: dtype of the iteration, "bfloat16" (default) or "float32"/"float64".
        rms_scale: the 0.2 of the update scale.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, split: tuple = ("whole",), ns_steps: int = DEFAULT_NS_STEPS,
                 ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_NS_EPS, ns_dtype: torch.dtype | str = torch.bfloat16,
                 rms_scale: float = DEFAULT_RMS_SCALE):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        split=split, ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps,
                        ns_dtype=ns_dtype, rms_scale=rms_scale)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, then validation of the group's options against its params."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["split"] = normalize_split(group["split"])
        group["ns_dtype"] = _ns_dtype_name(group["ns_dtype"])
        for key in ("lr", "weight_decay", "rms_scale", "eps"):
            if not float(group[key]) >= 0.0:
                raise ValueError(f"Muon: {key} must be >= 0, got {group[key]!r}")
        if not 0.0 <= float(group["momentum"]) < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {group['momentum']!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"Muon: ns_steps must be an int >= 0, got {steps!r}")
        names = group.get("param_names") or [f"param {i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"], strict=True):
            if torch.is_complex(p):
                raise ValueError(f"Muon: {name} is complex; Muon supports real parameters only")
            block_layout(group["split"], p.shape, name)  # raises if the split does not fit

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Muon step on every parameter that has a gradient; returns closure's loss if given.

        Plain parameters and shard-local DTensor ones are stepped together: per group the momentum and
        the decay as foreach ops, then one Newton–Schulz call and one foreach add per batch of equal
        blocks (``_ns_chunks``). DTensor parameters whose blocks cross shards are orthogonalised once across
        the ranks, each rank taking a FLOP-balanced share (``kimik3.optim.sharded.step_crossing``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batched: list[_Entry] = []  # plain tensors, and the local shards of shard-local DTensors
        crossing: list[Crossing] = []  # sharded parameters whose blocks cross shards: distributed below
        for group in self.param_groups:
            lr, momentum = group["lr"], float(group["momentum"])
            if isinstance(lr, torch.Tensor):
                # A learning rate held in a tensor (a CUDA-graphed step reads it where it lies, so a schedule can
                # change it between replays): the decay factor stays a tensor too, always applied.
                decay = 1.0 - lr.double() * float(group["weight_decay"])
            else:
                decay = 1.0 - float(lr) * float(group["weight_decay"])
            ns_dtype = _NS_DTYPES[_ns_dtype_name(group["ns_dtype"])]
            names = group.get("param_names") or [f"param {i}" for i in range(len(group["params"]))]
            members: list[_Entry] = []
            for name, p in zip(names, group["params"], strict=True):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"Muon: {name} has a sparse gradient, which Muon does not support")
                # Re-derived each step (cheap): load_state_dict may have replaced the group's split.
                layout = block_layout(group["split"], p.shape, name)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                if isinstance(p, DTensor):
                    # Gradient and momentum laid out like the parameter: elementwise ops on the local
                    # shards are the DTensor ops, so a shard-local parameter joins the plain ones.
                    same_spec = all(isinstance(t, DTensor) and t.device_mesh == p.device_mesh
                                    and t.placements == p.placements for t in (grad, buf))
                    if not same_spec:
                        raise ValueError(f"Muon: {name}'s gradient or momentum is not laid out as the parameter "
                                         f"({p.placements} on {p.device_mesh})")
                    local_layout = shard_layout(group["split"], p, name)
                    if local_layout is None:  # a block spans shards: Newton–Schulz needs it whole
                        buf.lerp_(grad, 1.0 - momentum)
                        direction = grad.lerp(buf, momentum) if group["nesterov"] else buf
                        crossing.append(Crossing(p, direction.to_local(), layout, group, ns_dtype, name))
                        continue
                    # every block lies whole in every shard: stepped here, no exchange
                    p, grad, buf, layout = p.to_local(), grad.to_local(), buf.to_local(), local_layout
                members.append(_Entry(p, grad, buf, layout, group, ns_dtype))
            for same in _by_device_and_dtype(members):
                torch._foreach_lerp_([e.buf for e in same], [e.grad for e in same], 1.0 - momentum)
                if isinstance(decay, torch.Tensor) or decay != 1.0:  # x * 1.0 is x: skip the launch
                    torch._foreach_mul_([e.param for e in same], _decay_factor(decay, same[0].param.device))
            batched += members
        for chunk in _ns_chunks(batched):
            _step_chunk(chunk)
        if crossing:
            step_crossing(crossing)
        return loss


@dataclass(eq=False)
class _Entry:
    """One parameter of a batched step: the tensors stepped in place (a DTensor's local shard), its
    block layout, its group, and the momentum direction / update pieces while its blocks are in flight."""

    param: torch.Tensor
    grad: torch.Tensor
    buf: torch.Tensor
    layout: BlockLayout
    group: dict
    ns_dtype: torch.dtype
    direction: torch.Tensor | None = None
    pieces: list[torch.Tensor] = field(default_factory=list)


def _decay_factor(decay: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """The factor ``p.mul_(decay)`` takes on ``device``: a tensor as it is; a float as a CPU float64 scalar tensor
    on the CPU, where the float overload's kernel first rounds the factor to the parameters' dtype (0.998 ->
    0.99609375 for bf16), and as the float itself elsewhere (CUDA multiplies by it in fp32 either way, and the
    copy of a host tensor cannot be captured in a CUDA graph)."""
    if isinstance(decay, torch.Tensor):
        return decay.to(device)
    return torch.tensor(decay, dtype=torch.float64) if device.type == "cpu" else decay


def _by_device_and_dtype(entries: list[_Entry]) -> Iterator[list[_Entry]]:
    """``entries`` split into lists of one device and dtype: what a fused (single-launch) foreach op takes."""
    lists: dict[tuple, list[_Entry]] = {}
    for e in entries:
        lists.setdefault((e.param.device, e.param.dtype, e.grad.dtype), []).append(e)
    yield from lists.values()


def _ns_chunks(entries: list[_Entry]) -> Iterator[list[tuple[_Entry, int, int]]]:
    """The Newton–Schulz batches of a step: lists of (entry, first block, end block).

    Entries are bucketed by everything one ``newton_schulz`` call fixes: the block shape [m, n] as it is
    (a tall block is not merged with its transpose: the iteration's transposed view rounds differently
    from a transposed copy), whether the blocks are per-head columns (stacked in their own strided
    layout, see ``_step_chunk``), steps, coefficients, eps, iteration dtype, device, and the parameter
    and gradient dtypes (one conversion of the result per batch). A bucket is cut into batches of at
    most ``NS_BUCKET_BYTES`` of blocks; an entry larger than that goes alone, in slices of whole blocks.
    """
    buckets: dict[tuple, list[_Entry]] = {}
    for e in entries:
        g = e.group
        key = (e.layout.rows, e.layout.cols, e.layout.split[0] == "cols", g["ns_steps"],
               tuple(float(c) for c in g["ns_coefficients"]), float(g["eps"]), e.ns_dtype, e.param.device,
               e.param.dtype, e.grad.dtype)
        buckets.setdefault(key, []).append(e)
    for members in buckets.values():
        first = members[0]
        block_bytes = first.layout.rows * first.layout.cols * max(first.grad.element_size(), first.ns_dtype.itemsize)
        capacity = max(1, NS_BUCKET_BYTES // max(1, block_bytes))
        chunk, used = [], 0
        for e in members:
            blocks = e.layout.blocks
            if blocks > capacity:
                yield from ([(e, h0, min(h0 + capacity, blocks))] for h0 in range(0, blocks, capacity))
                continue
            if used + blocks > capacity:
                yield chunk
                chunk, used = [], 0
            chunk.append((e, 0, blocks))
            used += blocks
        if chunk:
            yield chunk


def _step_chunk(chunk: list[tuple[_Entry, int, int]]) -> None:
    """Orthogonalise blocks [h0, h1) of every entry of ``chunk`` (one bucket of ``_ns_chunks``) in one
    Newton–Schulz call, then add the scaled update of every entry whose blocks are all done.

    The momentum and the decay were applied already (``Muon.step``). Newton–Schulz treats each matrix of
    a batch on its own, so this is each parameter's own update."""
    nesterov: dict[float, list[_Entry]] = {}
    for e, h0, _ in chunk:
        if h0 == 0:  # the entry's first blocks: its direction is made here, once
            if e.group["nesterov"]:
                nesterov.setdefault(float(e.group["momentum"]), []).append(e)
            else:
                e.direction = e.buf
    for momentum, entries in nesterov.items():
        directions = torch._foreach_lerp([e.grad for e in entries], [e.buf for e in entries], momentum)
        for e, direction in zip(entries, directions, strict=True):
            e.direction = direction

    first = chunk[0][0]
    blocks = [e.layout.to_blocks(e.direction)[h0:h1] for e, h0, h1 in chunk]
    if len(blocks) == 1:
        stacked_BMN = blocks[0]
    elif first.layout.split[0] == "cols":
        # A per-head column block is a strided view ([m, H, n] memory); stacked along that head axis,
        # every block keeps the strides it has alone, and with them its rounding in fp32.
        stacked_BMN = torch.cat([b.transpose(0, 1) for b in blocks], dim=1).transpose(0, 1)
    else:
        stacked_BMN = torch.cat(blocks)
    ortho_BMN = newton_schulz(stacked_BMN, first.group["ns_steps"], first.group["ns_coefficients"],
                              first.group["eps"], first.ns_dtype)
    # One conversion for the batch, to the dtype in which ``p.add_(update)`` computes (the promoted one:
    # rounding a float32 update to bf16 parameters before the add would round twice) and to contiguous
    # rows (a tall block's result is a transposed view), so that the per-parameter updates below are
    # views and the adds of a same-dtype batch take one fused launch.
    ortho_BMN = ortho_BMN.to(torch.promote_types(first.param.dtype, first.ns_dtype),
                             memory_format=torch.contiguous_format).contiguous()

    # The update is -lr * rms_scale * lr_ratio * O: keyed by (lr, rms_scale, lr_ratio), lr a float or a 0-dim tensor.
    adds: dict[tuple[float | torch.Tensor, float, float], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for (e, h0, h1), piece in zip(chunk, ortho_BMN.split([h1 - h0 for _, h0, h1 in chunk]), strict=True):
        if (h0, h1) != (0, e.layout.blocks):  # a slice of an entry larger than a batch
            e.pieces.append(piece)
            if h1 < e.layout.blocks:
                continue
            piece = torch.cat(e.pieces)
        lr = e.group["lr"]
        key = (lr if isinstance(lr, torch.Tensor) else float(lr), float(e.group["rms_scale"]), e.layout.lr_ratio)
        params, updates = adds.setdefault(key, ([], []))
        params.append(e.param)
        updates.append(e.layout.from_blocks(piece, e.param.shape))
        e.direction, e.pieces = None, []
    for (lr, rms_scale, lr_ratio), (params, updates) in adds.items():
        if isinstance(lr, torch.Tensor):
            factor = (lr.double() * -rms_scale * lr_ratio).to(updates[0].device)
            torch._foreach_add_(params, torch._foreach_mul(updates, factor))
        else:
            torch._foreach_add_(params, updates, alpha=-lr * rms_scale * lr_ratio)


# --------------------------------------------------------------------------- K3 grouping
def _module_rules(module: nn.Module) -> list[tuple[str, ParamRule]]:
    """The (local parameter name, rule) pairs ``module`` declares (``optimizer_rules()``, see
    ``kimik3.model.param_rules``); an ``nn.Embedding`` takes AdamW with decay."""
    declared = getattr(module, "optimizer_rules", None)
    if declared is not None:
        return list(declared())
    if isinstance(module, nn.Embedding):
        return [("weight", adamw(True, "Embedding.weight"))]
    return []


def classify_parameters(model: nn.Module) -> dict[str, ParamRule]:
    """Decide the optimizer group of every parameter of ``model`` (a K3ForCausalLM or any of its parts).

    Rules are declared by the modules that own the parameters (``optimizer_rules()``, visited
    parents first, so a container's rules win over the generic one for the Linears it owns);
    leftovers are handled by two generic rules: the weight of any other nn.Linear -> Muon ("whole",) and its bias,
    like any other 1-D parameter -> AdamW without decay. Returns {parameter name: ParamRule} in
    ``named_parameters`` order. Raises ValueError listing every parameter that no rule claims or
    that more than one rule claims (e.g. a new 3-D parameter, or one tensor shared by two modules).
    """
    # Claims are keyed by tensor identity, so one Parameter reachable under two names (shared
    # between two modules) collects two claims and is reported instead of silently stepped twice.
    claims: dict[int, list[tuple[str, ParamRule]]] = {}
    claimed_names: set[str] = set()

    def claim(param: nn.Parameter, name: str, rule: ParamRule) -> None:
        claims.setdefault(id(param), []).append((name, rule))
        claimed_names.add(name)

    for prefix, module in model.named_modules():  # pre-order: containers before their children
        dot = f"{prefix}." if prefix else ""
        for local_name, rule in _module_rules(module):
            claim(module.get_parameter(local_name), dot + local_name, rule)
        if isinstance(module, nn.Linear) and f"{dot}weight" not in claimed_names:
            claim(module.weight, f"{dot}weight", muon(("whole",), "Linear.weight"))

    named = list(model.named_parameters())
    for name, param in named:
        if id(param) not in claims and param.ndim == 1:
            claim(param, name, adamw(False, "1-D parameter"))

    uncovered = [f"{name} {tuple(p.shape)}" for name, p in named if id(p) not in claims]
    doubled = [f"{name} (claimed as {', '.join(f'{n} by {r.source}' for n, r in claims[id(p)])})"
               for name, p in named if len(claims.get(id(p), ())) > 1]
    if uncovered or doubled:
        lines = []
        if uncovered:
            lines.append("not covered by any optimizer rule: " + "; ".join(uncovered))
        if doubled:
            lines.append("covered more than once: " + "; ".join(doubled))
        raise ValueError("classify_parameters: " + " | ".join(lines))
    return {name: claims[id(param)][0][1] for name, param in named}


def build_param_groups(model: nn.Module, lr: float, weight_decay: float = 0.1, *, adamw_lr: float | None = None,
                       adamw_weight_decay: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.95),
                       adamw_eps: float = 1e-8, momentum: float = 0.95, nesterov: bool = True,
                       ns_steps: int = DEFAULT_NS_STEPS, ns_dtype: torch.dtype | str | None = None,
                       rms_scale: float = DEFAULT_RMS_SCALE, capturable: bool = False) -> MultiOptimizer:
    """K3's optimizer for ``model``: per-head Muon on matrices, AdamW on the rest (``classify_parameters``).

    ns_dtype: the Newton-Schulz iteration's dtype; None picks it from where the model lives, as the model's
    own dtype is picked: bf16 on CUDA (torch.optim.Muon's choice), fp32 elsewhere (a CPU has no fast bf16
    matmul: fp32 ran the iteration 27x faster on this project's 2-core machine, and is more accurate).

    lr: Muon's learning rate. Because the Muon update is RMS-matched to AdamW, the same value
    serves AdamW unless ``adamw_lr`` says otherwise; likewise ``adamw_weight_decay`` defaults to
    ``weight_decay`` (applied only to the decaying AdamW group: embedding, head, KDA beta/conv).

    capturable: AdamW keeps its step count on the device, so the whole optimizer step can be captured in a CUDA
    graph (``kimik3.train.captured_step``; Muon keeps no count). Fused AdamW then, CUDA only.

    Groups (one per distinct Muon split, two for AdamW), each with "name" and "base_lr":
    ``muon.whole``, ``muon.rows<H>``, ``muon.cols<H>``, ``muon.experts``, ``adamw.decay``,
    ``adamw.no_decay``. Only trainable parameters (requires_grad) are put in groups, but every
    parameter must be classifiable.
    """
    rules = classify_parameters(model)
    if ns_dtype is None:
        on_cuda = any(p.is_cuda for p in model.parameters())
        ns_dtype = torch.bfloat16 if on_cuda else torch.float32
    adamw_lr = lr if adamw_lr is None else adamw_lr
    adamw_weight_decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    params = dict(model.named_parameters())

    muon_groups: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    adamw_groups: dict[bool, list[tuple[str, nn.Parameter]]] = {}
    for name, rule in rules.items():
        param = params[name]
        if not param.requires_grad:
            continue
        if rule.optimizer == "muon":
            muon_groups.setdefault(rule.split, []).append((name, param))
        else:
            adamw_groups.setdefault(rule.decay, []).append((name, param))

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if muon_groups:
        groups = [{"params": members, "split": split,
                   "name": "muon." + (split[0] if len(split) == 1 else f"{split[0]}{split[1]}")}
                  for split, members in muon_groups.items()]
        optimizers["muon"] = Muon(groups, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                  nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype, rms_scale=rms_scale)
    if adamw_groups:
        groups = [{"params": adamw_groups[decay], "weight_decay": adamw_weight_decay if decay else 0.0,
                   "name": "adamw.decay" if decay else "adamw.no_decay"}
                  for decay in (True, False) if decay in adamw_groups]
        optimizers["adamw"] = torch.optim.AdamW(groups, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                                weight_decay=adamw_weight_decay,
                                                **(dict(capturable=True, fused=True) if capturable else {}))
    if not optimizers:
        raise ValueError("build_param_groups: model has no trainable parameters")
    return MultiOptimizer(optimizers)
