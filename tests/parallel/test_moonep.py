"""MoonEP execution on gloo ranks equals the single-process LatentMoE, forward and backward."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from kimik3.config import K3Config
from kimik3.model.k3 import K3ForCausalLM
from kimik3.parallel.moonep import apply_expert_parallel, destinations, moonep_quota, native_quota, received_from
from tests.parallel.gloo import run_ranks

TOKENS_PER_RANK = 24


def water_filling(loads_E: torch.Tensor, ranks: int) -> torch.Tensor:
    """Experts laid out in order, the token line cut into equal pieces: balanced, many foreign experts
    (a stress test of the exchange, independent of the MoonEP planner)."""
    end = torch.cumsum(loads_E, 0)
    start = end - loads_E
    mean = int(loads_E.sum()) // ranks
    lo = torch.arange(ranks) * mean
    return (torch.minimum(end[:, None], lo[None, :] + mean) - torch.maximum(start[:, None], lo[None, :])).clamp(min=0)


def moe_and_inputs(total_tokens: int, quant: str | None = None):
    config = K3Config.preset("tiny")
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_quant=quant))
    model = K3ForCausalLM(config, seed=0)
    moe = model.layers[1].ffn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(total_tokens, config.dim, generator=g)
    # skew the router so that a few experts are hot (the case balancing is for)
    with torch.no_grad():
        moe.router.gate.weight[:3] += 0.5 * x.mean(0)
    upstream = torch.randn(total_tokens, config.dim, generator=g)
    return moe, x, upstream


def _ep_worker(rank: int, world: int, planners: str, quant: str = "") -> dict:
    """Each planner of the comma list in turn (a fresh layer each), in one process group."""
    result = {}
    for planner in planners.split(","):
        moe, x, upstream = moe_and_inputs(TOKENS_PER_RANK * world, quant or None)
        group = dist.group.WORLD
        apply_expert_parallel(moe, group, planner=water_filling if planner == "water" else planner)
        mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)
        out = moe(x[mine])
        (out * upstream[mine]).sum().backward()
        quota = moe.experts.last_quota
        grads = {name: p.grad for name, p in moe.named_parameters()}
        for name, grad in grads.items():
            if not name.startswith("experts."):
                dist.all_reduce(grad)       # replicated parameters: the data-parallel sum
        result.update({f"{planner}.out": out, f"{planner}.quota": quota,
                       **{f"{planner}.grad.{k}": v for k, v in grads.items()}})
    return result


@pytest.mark.parametrize("world,planners,quant", [(2, "none", ""), (4, "water,moonep", ""), (2, "water", "mxfp4")])
def test_expert_parallel_equals_one_process(tmp_path, world, planners, quant):
    # With quant "mxfp4" (QAT): foreign experts' weights are quantised where they are computed, the rows where they
    # land, and the straight-through gradients travel back to the owners: the one-process QAT layer's figures.
    results = run_ranks(_ep_worker, world, tmp_path, planners, quant)
    moe, x, upstream = moe_and_inputs(TOKENS_PER_RANK * world, quant or None)
    assert moe.experts.quant == (quant or None)
    out = moe(x)
    (out * upstream).sum().backward()
    experts = moe.experts.w_gate_ELF.shape[0]
    per_rank = experts // world
    for planner in planners.split(","):
        for rank, got in enumerate(results):
            torch.testing.assert_close(got[f"{planner}.out"], out[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK],
                                       rtol=1e-5, atol=1e-6, msg=lambda m, planner=planner: f"{planner}: {m}")
            for name, p in moe.named_parameters():
                want = p.grad
                if name.startswith("experts."):
                    want = want[rank * per_rank:(rank + 1) * per_rank]
                torch.testing.assert_close(got[f"{planner}.grad.{name}"], want, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, what=f"{planner} {name}": f"{what}: {m}")
            computed = got[f"{planner}.quota"].sum(0)
            if planner != "none":   # balanced: every rank computes exactly S x K rows
                assert torch.all(computed == TOKENS_PER_RANK * moe.router.top_k), planner


def test_destinations_cut_each_experts_pairs_in_source_order():
    counts_RE = torch.tensor([[3, 1], [2, 2]])          # rank 0: 3 of e0, 1 of e1; rank 1: 2 and 2
    quota_ER = torch.tensor([[4, 1], [0, 3]])           # e0: 4 rows on rank 0, 1 on rank 1
    ids_rank1 = torch.tensor([1, 0, 1, 0])
    dest = destinations(ids_rank1, counts_RE, quota_ER, rank=1)
    # rank 1's e0 pairs are e0's global pairs 3 and 4 -> ranks 0 and 1; e1's go to rank 1
    assert dest.tolist() == [1, 0, 1, 1]
    assert native_quota(torch.tensor([5, 0, 2, 1]), 2).tolist() == [[5, 0], [0, 0], [0, 2], [0, 1]]


@pytest.mark.parametrize("planner", [moonep_quota, native_quota])
def test_received_from_matches_what_every_source_sends(planner):
    """Each rank derives how many pairs of each expert every source sends it from the shared counts and
    plan (no exchange): it must equal what the sources' own ``destinations`` send it."""
    gen = torch.Generator().manual_seed(0)
    ranks, experts = 4, 8
    weights = torch.rand(experts, generator=gen) ** 3  # skewed routing
    ids_R = [torch.multinomial(weights, 40, replacement=True, generator=gen) for _ in range(ranks)]
    counts_RE = torch.stack([torch.bincount(ids, minlength=experts) for ids in ids_R])
    quota_ER = planner(counts_RE.sum(0), ranks)
    dest_R = [destinations(ids_R[s], counts_RE, quota_ER, s) for s in range(ranks)]
    for d in range(ranks):
        got_RE = received_from(counts_RE, quota_ER, d)
        for s in range(ranks):  # what s sends d, per expert
            assert got_RE[s].tolist() == torch.bincount(ids_R[s][dest_R[s] == d], minlength=experts).tolist()
