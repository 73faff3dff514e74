"""Muon on sharded (DTensor) parameters: which ones step on their local shard, and the distributed
Newton–Schulz of the ones whose blocks cross shards.

Legend: W = ranks of the sharded mesh dimension, H = blocks of a parameter, m x n = one block.

A parameter sharded on dim 0 (FSDP2's layout, MoonEP's expert stacks) steps on its local shard when every
block lies whole inside every rank's shard (``shard_layout``): expert stacks, head-aligned row blocks. The
others -- whole matrices, per-head column blocks, row blocks a shard boundary cuts -- need whole blocks
for Newton–Schulz. ``step_crossing`` orthogonalises each of them once, on one rank, instead of on every
rank:

1. Work units: a whole matrix is one unit; a parameter of H per-head blocks is cut into min(H, W) units of
   consecutive blocks (a unit is a rectangle of the 2-D matrix: rows [r0, r1) x columns [c0, c1)). Its cost
   is its blocks' Newton–Schulz FLOPs. Units go to ranks by longest-processing-time-first: largest cost
   first, to the least loaded rank (ties: the lowest rank). Only shapes enter, so every rank computes the
   same assignment with no communication.
2. In: one ``all_to_all_single`` per (mesh dimension, iteration dtype): every rank sends each unit's owner
   the rows of the unit it holds, cast to the iteration dtype (Newton–Schulz's first operation, so the
   owner computes on exactly the values a single process would). The split sizes follow from shapes: no
   host synchronisation.
3. Each rank runs Newton–Schulz on its units, blocks of one shape and options batched into one call, laid
   out as ``Muon``'s single-process step lays them out (per-head column blocks as strided views), so each
   block's result is the single-process one.
4. Out: one more ``all_to_all_single`` sends every rank exactly the rows of each result that its shard holds
   (a scatter; still in the iteration dtype: widening it to the parameter's dtype after the transfer is
   exact). An all-gather of the results would move W times more: every rank would receive every whole
   result and keep 1/W of it. In and out together move 2 x (W-1)/W^2 of the crossing matrices into each
   rank, against (W-1)/W for the all-gather of the directions that a replicated Newton–Schulz needs: equal
   at W = 2, less beyond, and the Newton–Schulz work is divided by W.
5. Each rank applies its shard of the update (decay, then the scaled update, as the single-process step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from kimik3.optim.newton_schulz import BlockLayout, block_layout, newton_schulz

# At most this much of stacked blocks (elements x the iteration's element size) goes through one
# Newton–Schulz call of a rank's share (as ``muon.NS_BUCKET_BYTES`` for the local step).
NS_BUCKET_BYTES = 256 * 2 ** 20


def _shard_dim(param: DTensor, name: str) -> int:
    """The mesh dimension ``param`` is sharded over on tensor dim 0 (the others replicate it).

    Muon takes DTensors sharded on dim 0 over one mesh dimension (FSDP2, HSDP, expert parallelism) or
    replicated; anything else gets a clear error rather than a silent gather."""
    shard_dims = [i for i, pl in enumerate(param.placements) if type(pl) is Shard and pl.dim == 0]
    others_ok = all(type(pl) is Replicate for i, pl in enumerate(param.placements) if i not in shard_dims)
    if len(shard_dims) > 1 or not others_ok:
        raise ValueError(f"Muon: {name} is laid out as {tuple(param.placements)} on a {param.device_mesh.ndim}-D "
                         f"mesh; Muon steps DTensors that are replicated or sharded on dim 0 over one mesh "
                         f"dimension (Shard(0), the rest Replicate)")
    return shard_dims[0] if shard_dims else -1


def row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """[start, end) of the rows each of ``world`` ranks holds of a dim-0 shard (``torch.chunk``'s cut, as
    DTensor's Shard: ceil(rows / world) a rank, the last ranks short or empty)."""
    per = math.ceil(rows / world) if rows else 0
    return [(min(r * per, rows), min((r + 1) * per, rows)) for r in range(world)]


def shard_layout(split: tuple, param: DTensor, name: str) -> BlockLayout | None:
    """The layout of this rank's shard of ``param`` when every block of ``split`` lies whole inside every
    rank's shard, else None (then ``step_crossing`` orthogonalises it).

    True for expert stacks [E, a, b] (a dim-0 shard holds whole experts), for ("rows", H) when every shard
    starts and ends on head boundaries, and for any split when the parameter is not divided (a mesh of one,
    replicated placements). Decided from shapes for all ranks at once, so that every rank takes the same
    path (a rank whose own shard happens to be aligned still joins the exchange of the others)."""
    dim = _shard_dim(param, name)
    local_shape = tuple(param.to_local().shape)
    world = param.device_mesh.size(dim) if dim >= 0 else 1
    if world == 1 or split[0] == "experts":  # not divided, or any set of dim-0 indices: whole experts
        return block_layout(split, local_shape, name)
    if split[0] != "rows":
        return None  # whole / column blocks span every row
    rows_per_block = param.shape[0] // split[1]
    if any(lo % rows_per_block or hi % rows_per_block for lo, hi in row_ranges(param.shape[0], world)):
        return None
    return block_layout(("rows", local_shape[0] // rows_per_block), local_shape, name)


@dataclass(eq=False)
class Crossing:
    """A sharded parameter whose blocks cross shards, momentum applied: what ``step_crossing`` needs."""

    param: DTensor
    direction: torch.Tensor   # the local shard of the momentum direction (plain tensor)
    layout: BlockLayout       # of the whole parameter
    group: dict
    ns_dtype: torch.dtype
    name: str
    update: torch.Tensor | None = field(default=None, repr=False)  # this rank's shard of the update

    @property
    def dim(self) -> int:
        return _shard_dim(self.param, self.name)


@dataclass(frozen=True)
class Unit:
    """Blocks [h0, h1) of one crossing parameter: the rectangle rows [r0, r1) x cols [c0, c1) of its matrix."""

    index: int    # of the parameter in the step's crossing list
    h0: int
    h1: int
    r0: int
    r1: int
    c0: int
    c1: int
    cost: float   # Newton–Schulz FLOPs


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of Newton–Schulz on one rows x cols matrix: per step, the Gram matrix (2 m^2 n), its square
    (2 m^3) and the product with X (2 m^2 n), m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return float(steps) * (4.0 * m * m * n + 2.0 * m ** 3)


def work_units(entries: list[Crossing], world: int) -> list[Unit]:
    """Every crossing parameter cut into units of consecutive blocks (a whole matrix: one unit)."""
    units = []
    for i, e in enumerate(entries):
        if e.param.ndim != 2:
            raise ValueError(f"Muon: {e.name} {tuple(e.param.shape)} has blocks across shards but is not a "
                             f"matrix; only 2-D parameters can cross (a dim-0 shard of a stack holds whole blocks)")
        lay, (rows, cols) = e.layout, e.param.shape
        pieces = min(lay.blocks, world)
        bounds = [lay.blocks * k // pieces for k in range(pieces + 1)]
        block_cost = ns_flops(lay.rows, lay.cols, int(e.group["ns_steps"]))
        for h0, h1 in zip(bounds[:-1], bounds[1:]):
            if lay.split[0] == "rows":
                rect = (h0 * lay.rows, h1 * lay.rows, 0, cols)
            elif lay.split[0] == "cols":
                rect = (0, rows, h0 * lay.cols, h1 * lay.cols)
            else:  # whole
                rect = (0, rows, 0, cols)
            units.append(Unit(i, h0, h1, *rect, cost=block_cost * (h1 - h0)))
    return units


def assign(units: list[Unit], world: int) -> list[int]:
    """Owner rank of each unit: longest processing time first (largest cost first, ties in unit order;
    to the least loaded rank, ties to the lowest rank). Deterministic: every rank gets the same answer."""
    load = [0.0] * world
    owner = [0] * len(units)
    for u in sorted(range(len(units)), key=lambda k: (-units[k].cost, k)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[u] = rank
        load[rank] += units[u].cost
    return owner


def _overlap(lo: int, hi: int, rng: tuple[int, int]) -> tuple[int, int]:
    """[lo, hi) intersected with ``rng``; empty ranges come back as (x, x)."""
    a, b = max(lo, rng[0]), min(hi, rng[1])
    return a, max(a, b)


def step_crossing(entries: list[Crossing]) -> None:
    """Orthogonalise every entry's blocks once across the ranks and step each rank's shard (module docstring).

    The momentum was applied; ``entry.direction`` is the local shard of the direction. Every rank passes
    the same parameters in the same order (they come from the same param groups)."""
    by_mesh: dict[tuple, list[Crossing]] = {}
    for e in entries:
        by_mesh.setdefault((e.param.device_mesh, e.dim, e.ns_dtype), []).append(e)
    for (mesh, dim, _), members in by_mesh.items():
        _exchange_and_orthogonalise(members, mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim))
    decay_of: dict[float, torch.Tensor] = {}
    for e in entries:
        lr, group = float(e.group["lr"]), e.group
        decay = 1.0 - lr * float(group["weight_decay"])
        local = e.param.to_local()
        if decay != 1.0:
            # As ``Muon.step``: a CPU float64 scalar tensor, which no device rounds to the parameter's dtype.
            local.mul_(decay_of.setdefault(decay, torch.tensor(decay, dtype=torch.float64)))
        update = e.update.to(torch.promote_types(local.dtype, e.ns_dtype))
        local.add_(update, alpha=-lr * float(group["rms_scale"]) * e.layout.lr_ratio)
        e.update = None


def _exchange_and_orthogonalise(entries: list[Crossing], pg, world: int, rank: int) -> None:
    """Steps 1-4 of the module docstring for parameters sharded over one process group, one iteration dtype."""
    dtype, device = entries[0].ns_dtype, entries[0].direction.device
    units = work_units(entries, world)
    owner = assign(units, world)
    rows_of = [row_ranges(e.param.shape[0], world) for e in entries]
    mine = [k for k in range(len(units)) if owner[k] == rank]

    # In: to each owner, in unit order, the rows of each of its units that this rank holds.
    send, send_sizes = [], [0] * world
    for k, u in enumerate(units):
        lo, hi = rows_of[u.index][rank]
        a, b = _overlap(u.r0, u.r1, (lo, hi))
        if b > a:
            piece = entries[u.index].direction[a - lo:b - lo, u.c0:u.c1].to(dtype)
            send.append((owner[k], k, piece.reshape(-1)))
            send_sizes[owner[k]] += piece.numel()
    recv_sizes = [0] * world
    for k in mine:
        u = units[k]
        for src in range(world):
            a, b = _overlap(u.r0, u.r1, rows_of[u.index][src])
            recv_sizes[src] += (b - a) * (u.c1 - u.c0)
    send.sort(key=lambda t: (t[0], t[1]))
    received = _all_to_all([t[2] for t in send], send_sizes, recv_sizes, pg, dtype, device)

    # Each owned unit's rectangle, its rows copied in source by source (sources hold consecutive rows).
    regions: dict[int, torch.Tensor] = {}
    offsets = [0] * world
    for k in mine:
        u = units[k]
        regions[k] = region = _region(entries[u.index].layout, u, dtype, device)
        for src in range(world):
            a, b = _overlap(u.r0, u.r1, rows_of[u.index][src])
            n = (b - a) * (u.c1 - u.c0)
            region[a - u.r0:b - u.r0].copy_(received[src][offsets[src]:offsets[src] + n].view(b - a, u.c1 - u.c0))
            offsets[src] += n
    results = _orthogonalise_units(entries, units, regions)

    # Out: to every rank, in unit order, the rows of each of this rank's results that its shard holds.
    out_pieces, out_sizes = [], [0] * world
    for dst in range(world):
        for k in mine:
            u = units[k]
            a, b = _overlap(u.r0, u.r1, rows_of[u.index][dst])
            if b > a:
                out_pieces.append(results[k][a - u.r0:b - u.r0].reshape(-1))
                out_sizes[dst] += (b - a) * (u.c1 - u.c0)
    back_sizes = [0] * world
    for k, u in enumerate(units):
        a, b = _overlap(u.r0, u.r1, rows_of[u.index][rank])
        back_sizes[owner[k]] += (b - a) * (u.c1 - u.c0)
    back = _all_to_all(out_pieces, out_sizes, back_sizes, pg, dtype, device)

    for e in entries:
        e.update = torch.empty(tuple(e.direction.shape), dtype=dtype, device=device)
    offsets = [0] * world
    for src in range(world):
        for k, u in enumerate(units):
            if owner[k] != src:
                continue
            lo, hi = rows_of[u.index][rank]
            a, b = _overlap(u.r0, u.r1, (lo, hi))
            n = (b - a) * (u.c1 - u.c0)
            if n:
                entries[u.index].update[a - lo:b - lo, u.c0:u.c1] = back[src][offsets[src]:offsets[src] + n].view(
                    b - a, u.c1 - u.c0)
            offsets[src] += n


def _all_to_all(pieces: list[torch.Tensor], send_sizes: list[int], recv_sizes: list[int], pg,
                dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One ``all_to_all_single`` of the concatenated ``pieces`` (sizes from shapes, known on every rank);
    returns what came from each source rank, flat."""
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    if sum(send_sizes) or sum(recv_sizes):
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg)
    return list(recv.split(recv_sizes))


def _region(layout: BlockLayout, unit: Unit, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty [r1 - r0, c1 - c0] rectangle for a unit. Contiguous, except a lone column block of a parameter
    of several: in the whole matrix that block is a strided view, and Newton–Schulz's Frobenius norm sums a
    strided block in another order than a contiguous one; rows twice as long keep it strided (only whether
    it is, not the stride, changes the order)."""
    rows, cols = unit.r1 - unit.r0, unit.c1 - unit.c0
    if layout.split[0] == "cols" and layout.blocks > 1 and unit.h1 - unit.h0 == 1:
        return torch.empty(rows, 2 * cols, dtype=dtype, device=device)[:, :cols]
    return torch.empty(rows, cols, dtype=dtype, device=device)


def _blocks(region: torch.Tensor, layout: BlockLayout, blocks: int) -> torch.Tensor:
    """A unit's rectangle as its [blocks, m, n] matrices, laid out as ``BlockLayout.to_blocks`` lays out the
    whole parameter (column blocks: strided views of the rectangle)."""
    return BlockLayout((layout.split[0], blocks) if layout.split[0] != "whole" else layout.split, blocks,
                       layout.rows, layout.cols).to_blocks(region)


def _orthogonalise_units(entries: list[Crossing], units: list[Unit], regions: dict[int, torch.Tensor]
                         ) -> dict[int, torch.Tensor]:
    """Newton–Schulz of this rank's units, blocks of one shape and options stacked into batched calls of at
    most ``NS_BUCKET_BYTES``; each result as its unit's rectangle (iteration dtype)."""
    buckets: dict[tuple, list[int]] = {}
    for k in regions:
        e, lay = entries[units[k].index], entries[units[k].index].layout
        g = e.group
        key = (lay.rows, lay.cols, lay.split[0] == "cols", g["ns_steps"],
               tuple(float(c) for c in g["ns_coefficients"]), float(g["eps"]))
        buckets.setdefault(key, []).append(k)
    results: dict[int, torch.Tensor] = {}
    for (rows, cols, is_cols, steps, coefficients, eps), members in buckets.items():
        dtype = regions[members[0]].dtype
        capacity = max(1, NS_BUCKET_BYTES // max(1, rows * cols * dtype.itemsize))
        batches, batch, used = [], [], 0
        for k in members:  # a unit is never split: it has at most a parameter's blocks
            n = units[k].h1 - units[k].h0
            if batch and used + n > capacity:
                batches.append(batch)
                batch, used = [], 0
            batch.append(k)
            used += n
        batches.append(batch)
        for batch in batches:
            blocks = [_blocks(regions[k], entries[units[k].index].layout, units[k].h1 - units[k].h0) for k in batch]
            if len(blocks) == 1:
                stacked_BMN = blocks[0]
            elif is_cols:  # as ``muon._step_chunk``: stacked along the head axis, each block keeps its strides
                stacked_BMN = torch.cat([b.transpose(0, 1) for b in blocks], dim=1).transpose(0, 1)
            else:
                stacked_BMN = torch.cat(blocks)
            ortho_BMN = newton_schulz(stacked_BMN, steps, coefficients, eps, dtype)
            for k, piece in zip(batch, ortho_BMN.split([units[k].h1 - units[k].h0 for k in batch]), strict=True):
                u = units[k]
                if is_cols:  # [blocks, rows, cols] -> [rows, blocks * cols]
                    piece = piece.permute(1, 0, 2)
                results[k] = piece.reshape(u.r1 - u.r0, u.c1 - u.c0)
    return results
