"""K3's per-head Muon, the AdamW remainder, and the one rule table that splits a model between them.

Muon (momentum orthogonalised by Newton–Schulz) replaces a matrix parameter's momentum by an
approximately orthogonal matrix with the same singular vectors, then scales it so that its RMS
matches a typical AdamW update (Moonlight's ``0.2 * sqrt(max(m, n))``), which lets Muon reuse
AdamW's learning rate and weight decay.

K3 applies it *per head*: an attention projection is cut into one block per head (its rows for
the input projections, its columns for the output projection) and every block is orthogonalised
on its own, so a head whose gradient is small still gets a full-size, well-conditioned update
instead of being drowned by the loudest heads of the same matrix. The stacked routed-expert
weights [E, a, b] likewise get one orthogonalisation per expert. All blocks of one parameter
have the same shape, so they go through Newton–Schulz as one batch of matrices: per-head costs
the same matmuls as whole-matrix Muon, with no Python loop over heads.

Legend: H = heads (or blocks), E = experts, m x n = the shape of one orthogonalised block.

Public pieces:
- ``newton_schulz``: quintic Newton–Schulz on [..., m, n] (every matrix on its own).
- ``Muon``: the optimizer; each param group carries a ``split`` saying how to cut its params.
- ``MultiOptimizer``: Muon + AdamW behind one optimizer-like object for the trainer.
- ``classify_parameters`` / ``build_param_groups``: the grouping of a ``K3ForCausalLM``, from the
  ``optimizer_rules()`` its modules declare (``kimik3/model/param_rules.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kimik3.model.param_rules import ParamRule, adamw, muon

# Keller Jordan's quintic coefficients: they maximise the slope at zero, so 5 steps push every
# singular value into roughly [0.7, 1.2] rather than converging exactly to 1 (good enough for
# an update direction, and what torch.optim.Muon uses).
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7
# Moonlight ("Muon is scalable for LLM training"): an orthogonal m x n matrix has RMS
# 1/sqrt(max(m, n)); AdamW updates have RMS ~0.2-0.4 in practice, so scaling by
# 0.2 * sqrt(max(m, n)) gives Muon updates of RMS ~0.2 * lr, AdamW's range.
DEFAULT_RMS_SCALE = 0.2

SPLIT_KINDS = ("whole", "rows", "cols", "experts")
_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- Newton–Schulz
def newton_schulz(G: torch.Tensor, steps: int = DEFAULT_NS_STEPS,
                  coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
                  eps: float = DEFAULT_NS_EPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate orthogonal factor of each matrix of ``G`` by quintic Newton–Schulz.

    G: [m, n] or [..., m, n], any float dtype. Every trailing [m, n] matrix is treated on its
    own (its own Frobenius normalisation, its own iteration), but all of them run as one
    batched matmul chain. Returns [..., m, n] in ``dtype`` (bf16 by default, like
    torch.optim.Muon; pass torch.float32 for accurate orthogonality in tests).

    Per matrix: X = G / max(||G||_F, eps) (so the spectral norm is <= 1), iterated as
    A = X X^T, X <- a X + (b A + c A^2) X, working on the wide orientation (transposed when
    m > n, so the Gram matrix is the smaller one). For a single matrix in bf16 this is
    numerically identical to torch.optim.Muon's ``_zeropower_via_newtonschulz``.
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(f"newton_schulz: G must be a tensor of shape [..., m, n], "
                         f"got {getattr(G, 'shape', type(G).__name__)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"newton_schulz: steps must be an int >= 0, got {steps!r}")
    if len(coefficients) != 3:
        raise ValueError(f"newton_schulz: coefficients must be three numbers (a, b, c), got {coefficients!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"newton_schulz: dtype must be a floating dtype, got {dtype}")
    a, b, c = (float(v) for v in coefficients)
    rows, cols = G.shape[-2:]
    batch_shape = G.shape[:-2]

    X_BMN = G.to(dtype).reshape(-1, rows, cols)
    transposed = rows > cols
    if transposed:
        X_BMN = X_BMN.mT
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1] where the
    # polynomial is designed to act; the clamp keeps an all-zero gradient at zero.
    norm_B11 = torch.linalg.vector_norm(X_BMN, dim=(-2, -1), keepdim=True).clamp(min=eps)
    X_BMN = X_BMN / norm_B11
    for _ in range(steps):
        gram_BMM = torch.bmm(X_BMN, X_BMN.mT)
        poly_BMM = torch.baddbmm(gram_BMM, gram_BMM, gram_BMM, beta=b, alpha=c)
        X_BMN = torch.baddbmm(X_BMN, poly_BMM, X_BMN, beta=a)
    if transposed:
        X_BMN = X_BMN.mT
    return X_BMN.reshape(*batch_shape, rows, cols)


# --------------------------------------------------------------------------- block layouts
def normalize_split(split: Any) -> tuple:
    """Validate a split spec and return it as a tuple: ("whole",), ("rows", H), ("cols", H) or ("experts",).

    Lists are accepted too (a split that went through JSON comes back as a list).
    """
    if isinstance(split, str) or not isinstance(split, (tuple, list)) or len(split) == 0:
        raise ValueError(f"split must be a tuple such as ('whole',), ('rows', H), ('cols', H) or "
                         f"('experts',), got {split!r}")
    kind = split[0]
    if kind not in SPLIT_KINDS:
        raise ValueError(f"split kind {kind!r} is unknown; expected one of {SPLIT_KINDS}")
    if kind in ("rows", "cols"):
        if len(split) != 2:
            raise ValueError(f"split ({kind!r}, H) needs exactly one head count H, got {split!r}")
        heads = split[1]
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"split ({kind!r}, H): head count H must be an int >= 1, got {heads!r}")
        return (kind, heads)
    if len(split) != 1:
        raise ValueError(f"split ({kind!r},) takes no argument, got {split!r}")
    return (kind,)


@dataclass(frozen=True)
class BlockLayout:
    """How one parameter is cut into ``blocks`` matrices of shape [rows, cols] and put back."""

    split: tuple
    blocks: int
    rows: int
    cols: int

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """Parameter-shaped tensor -> [blocks, rows, cols] (a view where the layout allows)."""
        kind = self.split[0]
        if kind == "whole" or kind == "rows":
            return t.reshape(self.blocks, self.rows, self.cols)
        if kind == "cols":
            # [out, H*X] -> [out, H, X] -> [H, out, X]: head h's columns become matrix h.
            return t.reshape(self.rows, self.blocks, self.cols).permute(1, 0, 2)
        return t  # experts: already [E, a, b]

    def from_blocks(self, t_BMN: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[blocks, rows, cols] -> the parameter's ``shape`` (inverse of ``to_blocks``)."""
        if self.split[0] == "cols":
            t_BMN = t_BMN.permute(1, 0, 2)
        return t_BMN.reshape(shape)

    @property
    def lr_ratio(self) -> float:
        """sqrt(max(rows, cols)) of one block: the block, not the whole tensor, is what is orthogonal."""
        return math.sqrt(max(self.rows, self.cols))


def block_layout(split: Any, shape: torch.Size | tuple[int, ...], name: str = "parameter") -> BlockLayout:
    """The ``BlockLayout`` of a parameter of ``shape`` under ``split``; ValueError if they do not fit."""
    kind, *args = normalize_split(split)
    shape = tuple(shape)
    if kind == "experts":
        if len(shape) != 3:
            raise ValueError(f"{name}: split ('experts',) needs a 3-D [E, a, b] tensor, got shape {shape}")
        return BlockLayout(("experts",), shape[0], shape[1], shape[2])
    if len(shape) != 2:
        raise ValueError(f"{name}: split {tuple([kind, *args])} needs a 2-D matrix, got shape {shape}")
    out_dim, in_dim = shape
    if kind == "whole":
        return BlockLayout(("whole",), 1, out_dim, in_dim)
    heads = args[0]
    if kind == "rows":
        if out_dim % heads:
            raise ValueError(f"{name}: split ('rows', {heads}): {out_dim} rows are not divisible by {heads} heads")
        return BlockLayout(("rows", heads), heads, out_dim // heads, in_dim)
    if in_dim % heads:
        raise ValueError(f"{name}: split ('cols', {heads}): {in_dim} columns are not divisible by {heads} heads")
    return BlockLayout(("cols", heads), heads, out_dim, in_dim // heads)


def _ns_dtype_name(dtype: Any) -> str:
    # Param groups hold the name, not the torch.dtype, so a group stays JSON-friendly.
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if name not in _NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {sorted(_NS_DTYPES)} (or the torch dtype), got {dtype!r}")
    return name


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
        lr: learning rate (float, >= 0). AdamW-scale values work (the update RMS is ~rms_scale*lr).
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
        """One Muon step on every parameter that has a gradient; returns closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        crossing = []  # sharded parameters whose blocks cross shards: gathered together below
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), float(group["momentum"])
            decay = 1.0 - lr * float(group["weight_decay"])
            ns_dtype = _NS_DTYPES[_ns_dtype_name(group["ns_dtype"])]
            names = group.get("param_names") or [f"param {i}" for i in range(len(group["params"]))]
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
                buf.lerp_(grad, 1.0 - momentum)
                direction = grad.lerp(buf, momentum) if group["nesterov"] else buf

                local_layout = _shard_layout(group["split"], p, name) if isinstance(p, DTensor) else None
                if local_layout is not None:  # every block lies whole in this rank's shard: no gather
                    direction, p, layout = direction.to_local(), p.to_local(), local_layout
                elif isinstance(p, DTensor):  # a block spans shards: Newton–Schulz needs it whole
                    crossing.append((p, direction, layout, group, ns_dtype, lr, decay))
                    continue
                _apply(p, self._orthogonalised(direction, layout, group, ns_dtype), layout, group, lr, decay)
        for i, full in _gather_whole([direction for _, direction, *_ in crossing]):
            p, _, layout, group, ns_dtype, lr, decay = crossing[i]
            update = _local_part(self._orthogonalised(full, layout, group, ns_dtype), p)
            _apply(p.to_local(), update, layout, group, lr, decay)
        return loss

    @staticmethod
    def _orthogonalised(direction: torch.Tensor, layout: BlockLayout, group: dict, ns_dtype) -> torch.Tensor:
        ortho_BMN = newton_schulz(layout.to_blocks(direction), group["ns_steps"], group["ns_coefficients"],
                                  group["eps"], ns_dtype)
        return layout.from_blocks(ortho_BMN, direction.shape)


def _apply(p: torch.Tensor, update: torch.Tensor, layout: BlockLayout, group: dict, lr: float, decay: float) -> None:
    p.mul_(decay)
    p.add_(update, alpha=-lr * float(group["rms_scale"]) * layout.lr_ratio)


GATHER_BUCKET_BYTES = 256 * 2 ** 20  # at most this much gathered at once (the whole matrices, all ranks)


def _gather_whole(directions: list[DTensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, whole tensor) for every DTensor of ``directions``, on every rank, bucket by bucket.

    Those sharded on dim 0 over one 1-D mesh (FSDP2's layout) travel together: one all-gather per
    (mesh, dtype) bucket of up to ``GATHER_BUCKET_BYTES`` of whole matrices, each local shard padded
    to the chunk size (DTensor shards dim 0 as ``torch.chunk`` does: ceil(n / W) rows per rank, the
    last ranks short or empty). A bucket's tensors are yielded before the next bucket is gathered,
    so the caller can use and drop them. Any other layout falls back to ``full_tensor()``."""
    from torch.distributed.tensor import Shard

    # (mesh, dtype) -> buckets of (index, rows per rank, elements per row)
    batches: dict[tuple, list[list[tuple[int, int, int]]]] = {}
    bucket_bytes: dict[tuple, int] = {}
    for i, d in enumerate(directions):
        if not (d.device_mesh.ndim == 1 and tuple(d.placements) == (Shard(0),) and d.shape[0] > 0):
            yield i, d.full_tensor()
            continue
        key, world = (d.device_mesh, d.dtype), d.device_mesh.size()
        rows, inner = math.ceil(d.shape[0] / world), math.prod(d.shape[1:])
        size = world * rows * inner * d.dtype.itemsize
        if key not in batches or bucket_bytes[key] + size > GATHER_BUCKET_BYTES:
            batches.setdefault(key, []).append([])
            bucket_bytes[key] = 0
        batches[key][-1].append((i, rows, inner))
        bucket_bytes[key] += size
    for (mesh, dtype), buckets in batches.items():
        world = mesh.size()
        for members in buckets:
            pieces = []
            for i, rows, inner in members:
                flat = directions[i].to_local().reshape(-1)
                pieces.append(torch.nn.functional.pad(flat, (0, rows * inner - flat.numel())))
            send = torch.cat(pieces)
            recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
            torch.distributed.all_gather_into_tensor(recv, send, group=mesh.get_group())
            per_rank = recv.view(world, send.numel())
            offset = 0
            for i, rows, inner in members:
                shape = directions[i].shape
                block = per_rank[:, offset:offset + rows * inner].reshape(world * rows, *shape[1:])
                yield i, block[:shape[0]]  # chunk padding sits at the end: the first n rows are the tensor
                offset += rows * inner


def _shard_layout(split: tuple, param: DTensor, name: str) -> BlockLayout | None:
    """The layout of this rank's shard of ``param`` when every block of ``split`` lies whole inside it,
    else None.

    Then Muon orthogonalises the local blocks alone -- the same per-block Newton–Schulz as on the
    gathered matrix, without the all-gather and with 1/world of the work. True for expert stacks
    [E, a, b] sharded on dim 0 (expert parallelism, FSDP2: a dim-0 shard holds whole experts), for
    ("rows", H) when the shard starts and ends on head boundaries, and for any split when the
    parameter is not actually divided (a mesh of one, replicated placements)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = param.placements
    if not all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in placements):
        return None
    local_shape = tuple(param.to_local().shape)
    if local_shape == tuple(param.shape) or split[0] == "experts":  # any set of dim-0 indices: whole experts
        return block_layout(split, local_shape, name)
    if split[0] != "rows" or not all(type(pl) in (Shard, Replicate) for pl in placements):
        return None  # whole / column blocks span every row; strided shards hold non-contiguous rows
    rows_per_block = param.shape[0] // split[1]
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    if local_shape[0] % rows_per_block or offset[0] % rows_per_block:
        return None
    return block_layout(("rows", local_shape[0] // rows_per_block), local_shape, name)


def _local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The part of the full-shape tensor ``full`` that this rank holds of the DTensor ``param``.

    Muon under FSDP2 (DTensor parameters sharded on dim 0) for a parameter whose blocks cross the shard
    boundaries (``_shard_layout`` returned None): every rank has the whole momentum direction
    (``_gather_whole``: all such matrices in one all-gather), orthogonalises every block of the whole
    matrix, and applies only its own shard of the update. The redundant Newton–Schulz is the simple
    choice: it gives exactly the single-process update (same input, same iteration) with no scatter;
    giving each rank a subset of whole matrices would divide the Newton–Schulz work by the world size
    at the price of a second collective, worth it only at scale.
    """
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank cuts its own shard from its own (identical) full tensor.
    return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


# --------------------------------------------------------------------------- Muon + AdamW
class MultiOptimizer:
    """Several optimizers (K3: ``muon`` and ``adamw``) driven as one.

    ``param_groups`` is the concatenation of the members' groups (the same dict objects, so a
    scheduler writing ``group["lr"]`` reaches the real optimizer); every group carries a
    ``"name"`` and a ``"base_lr"`` (its lr at build time; schedulers set lr = base_lr * factor).
    ``state_dict()`` is ``{member name: member.state_dict()}``.

    Note: torch.optim.lr_scheduler classes insist on a torch Optimizer instance; drive this
    object by writing ``group["lr"]`` directly, or give each member its own scheduler.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("MultiOptimizer: optimizers must name at least one optimizer")
        for key, opt in optimizers.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise ValueError(f"MultiOptimizer: optimizers[{key!r}] is a {type(opt).__name__}, "
                                 "not a torch.optim.Optimizer")
        self.optimizers = dict(optimizers)
        for key, opt in self.optimizers.items():
            for index, group in enumerate(opt.param_groups):
                group.setdefault("name", f"{key}.{index}")
                group.setdefault("base_lr", group["lr"])

    def __getitem__(self, key: str) -> torch.optim.Optimizer:
        return self.optimizers[key]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state of all members (parameters are disjoint across members)."""
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Evaluate ``closure`` once (if given), then step every member."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {key: opt.state_dict() for key, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"MultiOptimizer.load_state_dict: state_dict has members {sorted(state_dict)}, "
                             f"this optimizer has {sorted(self.optimizers)}")
        for key, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[key])

    def __repr__(self) -> str:
        groups = ", ".join(f"{g['name']}({len(g['params'])})" for g in self.param_groups)
        return f"MultiOptimizer({groups})"


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
                       rms_scale: float = DEFAULT_RMS_SCALE) -> MultiOptimizer:
    """K3's optimizer for ``model``: per-head Muon on matrices, AdamW on the rest (``classify_parameters``).

    ns_dtype: the Newton-Schulz iteration's dtype; None picks it from where the model lives, as the model's
    own dtype is picked: bf16 on CUDA (torch.optim.Muon's choice), fp32 elsewhere (a CPU has no fast bf16
    matmul: fp32 ran the iteration 27x faster on this project's 2-core machine, and is more accurate).

    lr: Muon's learning rate. Because the Muon update is RMS-matched to AdamW, the same value
    serves AdamW unless ``adamw_lr`` says otherwise; likewise ``adamw_weight_decay`` defaults to
    ``weight_decay`` (applied only to the decaying AdamW group: embedding, head, KDA beta/conv).

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
                                                weight_decay=adamw_weight_decay)
    if not optimizers:
        raise ValueError("build_param_groups: model has no trainable parameters")
    return MultiOptimizer(optimizers)
