"""Gradient-norm clipping (kimik3.optim.clip) against torch's, on plain tensors and on DTensors
sharded over two gloo ranks (one all-reduce per set of reduction groups, not one per parameter)."""

from __future__ import annotations

import torch

from kimik3.optim.clip import clip_grad_norm
from tests.parallel.gloo import run_ranks

SHAPES = [(8, 6), (5,), (4, 3, 5), (7, 2)]


def _grads(scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [scale * torch.randn(shape, generator=gen) for shape in SHAPES]


def _params(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_plain_tensors_match_torch():
    for scale, max_norm in ((1.0, 1.0), (0.01, 10.0)):  # clipped, and left alone
        ours, ref = _params(_grads(scale)), _params(_grads(scale))
        norm = clip_grad_norm(ours, max_norm)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch.testing.assert_close(norm, norm_ref)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad)


def _sharded_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kimik3.parallel.mesh import ParallelDims, build_mesh, fsdp_mesh

    mesh = fsdp_mesh(build_mesh(ParallelDims(dp=world), "cpu"))
    grads = _grads(1.0)
    placements = [Shard(0), None, Shard(0), Replicate()]  # None: a plain tensor (the same on every rank)
    params = []
    for g, pl in zip(grads, placements):
        p = torch.nn.Parameter(torch.zeros_like(g) if pl is None else
                               distribute_tensor(torch.zeros_like(g), mesh, [pl], src_data_rank=None))
        p.grad = g.clone() if pl is None else distribute_tensor(g, mesh, [pl], src_data_rank=None)
        params.append(p)
    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    try:
        norm = clip_grad_norm(params, 1.0)
    finally:
        dist.all_reduce = original
    out = {"norm": norm, "all_reduces": torch.tensor(len(calls))}
    for i, p in enumerate(params):
        out[f"grad{i}"] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return out


def test_sharded_gradients_match_the_whole_model(tmp_path):
    ref = _params(_grads(1.0))
    norm_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    for out in run_ranks(_sharded_worker, 2, tmp_path):
        torch.testing.assert_close(out["norm"], norm_ref)
        for i, p in enumerate(ref):
            torch.testing.assert_close(out[f"grad{i}"], p.grad)
        assert int(out["all_reduces"]) == 1  # two sharded parameters, one group: one collective
