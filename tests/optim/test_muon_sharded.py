"""Muon on dim-0 sharded DTensors (gloo ranks): the distributed Newton–Schulz gives bitwise the single-process
step, divides the orthogonalisation among the ranks, and moves its data in two all-to-alls."""

from __future__ import annotations

import pytest
import torch

from kimik3.optim.sharded import Unit, assign, ns_flops, row_ranges
from tests.parallel.gloo import run_ranks

# name: (shape, split, dtype, ns_dtype, nesterov). Rows not divisible by 2 or 3, an empty shard at 3 ranks,
# column blocks, a tall matrix, row blocks that cross at 2 ranks and align at 3 (and the reverse), experts.
CASES = {
    "whole_7x6": ((7, 6), ("whole",), torch.float32, "float32", True),
    "whole_2x5": ((2, 5), ("whole",), torch.float32, "float32", True),      # 3 ranks: the last holds no row
    "tall_10x3": ((10, 3), ("whole",), torch.float32, "float32", False),
    "cols_5x6": ((5, 6), ("cols", 2), torch.float32, "float32", True),
    "cols_9x12": ((9, 12), ("cols", 3), torch.float32, "float32", True),
    "rows3_6x4": ((6, 4), ("rows", 3), torch.float32, "float32", True),     # crosses at 2 ranks, aligned at 3
    "rows4_8x6": ((8, 6), ("rows", 4), torch.float32, "float32", True),     # aligned at 2; at 3 only rank 2 is
    "experts": ((4, 3, 5), ("experts",), torch.float32, "float32", True),
    "bf16_whole_9x4": ((9, 4), ("whole",), torch.bfloat16, "bfloat16", True),
    "bf16ns_cols_7x8": ((7, 8), ("cols", 2), torch.float32, "bfloat16", True),
}
STEPS = 3


def _tensors(names):
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(CASES[n][0], generator=gen).to(CASES[n][2]) for n in names}
    grads = [{n: torch.randn(CASES[n][0], generator=gen).to(CASES[n][2]) for n in names} for _ in range(STEPS)]
    return weights, grads


def _optimizer(params, names):
    from kimik3.optim import Muon

    groups = [{"params": [params[n]], "param_names": [n], "split": CASES[n][1], "ns_dtype": CASES[n][3],
               "nesterov": CASES[n][4]} for n in names]
    return Muon(groups, lr=0.05, weight_decay=0.1, momentum=0.9)


def _worker(rank, world):
    """Every case of ``SUBSETS`` in turn, then the refusal of other layouts: one process group."""
    out = {}
    for tag, names in SUBSETS.items():
        out.update({f"{tag}.{k}": v for k, v in _subset(world, names).items()})
    _refuse(world)
    return out


def _subset(world, names):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import kimik3.optim.sharded as sharded

    mesh = init_device_mesh("cpu", (world,))
    weights, grads = _tensors(names)
    shard = lambda t: distribute_tensor(t.clone(), mesh, [Shard(0)], src_data_rank=None)  # noqa: E731
    params = {n: torch.nn.Parameter(shard(w)) for n, w in weights.items()}
    plain = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    optimizers = _optimizer(params, names), _optimizer(plain, names)

    blocks, calls = [0], []
    ns, a2a, gather = sharded.newton_schulz, dist.all_to_all_single, dist.all_gather_into_tensor
    sharded.newton_schulz = lambda G, *a, **k: (blocks.__setitem__(0, blocks[0] + G.shape[0]), ns(G, *a, **k))[1]
    dist.all_to_all_single = lambda *a, **k: (calls.append("all_to_all"), a2a(*a, **k))[1]
    dist.all_gather_into_tensor = lambda *a, **k: (calls.append("all_gather"), gather(*a, **k))[1]
    try:
        for step in range(STEPS):
            for n in names:
                params[n].grad = shard(grads[step][n])
                plain[n].grad = grads[step][n].clone()
            optimizers[0].step()
    finally:
        sharded.newton_schulz, dist.all_to_all_single, dist.all_gather_into_tensor = ns, a2a, gather
    for step in range(STEPS):
        for n in names:
            plain[n].grad = grads[step][n].clone()
        optimizers[1].step()
    out = {f"sharded.{n}": params[n].full_tensor() for n in names}
    out.update({f"plain.{n}": plain[n].detach() for n in names})
    out["ns_blocks"] = torch.tensor(blocks[0])
    out["calls"] = torch.tensor([calls.count("all_to_all"), calls.count("all_gather")])
    return out


def _crossing_blocks(names, world):
    """Blocks of the parameters that cross shards at ``world`` ranks (the distributed Newton–Schulz's work)."""
    from kimik3.optim.newton_schulz import block_layout

    total = 0
    for n in names:
        shape, split = CASES[n][0], CASES[n][1]
        if split[0] == "experts":
            continue
        layout = block_layout(split, shape)
        if split[0] == "rows":
            if all(lo % layout.rows == 0 and hi % layout.rows == 0 for lo, hi in row_ranges(shape[0], world)):
                continue
        total += layout.blocks
    return total


# every case together, and one crossing matrix alone (more ranks than matrices: one or two ranks idle)
SUBSETS = {"all": list(CASES), "one": ["whole_7x6", "experts"]}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_step_is_the_single_process_step_bitwise(tmp_path, world):
    outs = run_ranks(_worker, world, tmp_path, timeout=240)
    for tag, names in SUBSETS.items():
        _check(world, names, [{k.removeprefix(f"{tag}."): v for k, v in o.items() if k.startswith(f"{tag}.")}
                              for o in outs])


def _check(world, names, outs):
    for n in names:
        for rank, out in enumerate(outs):
            got, want = out[f"sharded.{n}"], out[f"plain.{n}"]
            assert got.dtype == want.dtype
            if got.dtype == torch.bfloat16:
                # Not the same arithmetic: on the CPU, bf16 ``add_(u, alpha=...)`` rounds differently in its
                # vectorised body and its scalar tail, so an element's result depends on where the tensor it
                # sits in ends (the shard or the whole matrix). fp32 parameters (the trainer's) are bitwise.
                torch.testing.assert_close(got, want, msg=n)
                continue
            assert torch.equal(got, want), (
                f"{n} at {world} ranks (rank {rank}): max diff {(got.float() - want.float()).abs().max():.3g}")
    # Every crossing block orthogonalised exactly once over the ranks (none twice, none skipped) ...
    crossing = _crossing_blocks(names, world)
    done = [int(o["ns_blocks"]) for o in outs]
    assert sum(done) == STEPS * crossing, (done, crossing)
    if crossing >= world:
        assert max(done) < STEPS * crossing, done  # ... and divided: no rank did them all
    # ... with two all-to-alls a step per (mesh, iteration dtype), and no all-gather.
    dtypes = {CASES[n][3] for n in names if _crossing_blocks([n], world)}
    for out in outs:
        assert out["calls"].tolist() == [2 * STEPS * len(dtypes), 0], out["calls"]


def test_assignment_balances_flops_deterministically():
    costs = [ns_flops(64, 1024, 5)] * 16 + [ns_flops(512, 1024, 5)] * 3 + [ns_flops(7, 6, 5)]
    units = [Unit(i, 0, 1, 0, 1, 0, 1, cost=c) for i, c in enumerate(costs)]
    for world in (2, 3, 4):
        owner = assign(units, world)
        assert owner == assign(units, world)
        load = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(world)]
        # longest-processing-time-first: within the largest unit of the optimum, and every rank has work
        assert max(load) - min(load) <= max(costs), (world, load)
        assert min(load) > 0
    assert assign(units[:1], 3) == [0]  # more ranks than units: the others own nothing


def test_row_ranges_follow_torch_chunk():
    for rows in (0, 1, 2, 5, 7, 8):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else []
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
            got = [r for r in row_ranges(rows, world) if r[1] > r[0]]
            assert got == want, (rows, world)


def _refuse(world):
    """Other layouts than dim-0 shards (here Shard(1)) get a clear error, not a silent gather."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from kimik3.optim import Muon

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)], src_data_rank=None))
    p.grad = distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)], src_data_rank=None)
    with pytest.raises(ValueError, match=r"Shard\(0\), the rest Replicate"):
        Muon([p], lr=0.1).step()
