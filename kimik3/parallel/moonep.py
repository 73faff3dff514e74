"""MoonEP execution: expert parallelism where every rank computes exactly S×K token-expert rows.

Legend: R = EP ranks, E = experts (E/R native to each rank: expert e lives on rank e // (E/R)),
T = tokens on this rank, K = experts per token, P = token-expert pairs here (T×K), L = latent width,
F = expert hidden width, N = rows this rank computes (= S×K when every rank holds S tokens).

One MoE layer step, per rank (``EPRoutedExperts.forward``):
 1. local loads per expert -> all-gather -> loads [R, E] (a few KB);
 2. the planner turns the global loads into ``quota[E, R]``: rows of expert e computed on rank r.
    With MoonEP every rank computes the mean exactly (``moonep_plan``); "none" keeps every expert
    on its owner (plain EP, imbalanced);
 3. each pair gets its computing rank: expert e's pairs, in (source rank, local order), are cut
    into consecutive pieces of quota[e, 0], quota[e, 1], ... rows;
 4. pairs (latent rows and mixture weights) travel with ``all_to_all_single``; every rank receives
    exactly its quota total (S×K with MoonEP: a static size for the expert buffers);
 5. weights of the foreign experts a rank was given (at most E/R under MoonEP) travel from their
    owners in one more ``all_to_all_single``; autograd sends their gradients back to the owner
    and sums them there;
 6. grouped matmuls over (native + foreign) experts, then the rows travel back and are summed
    per token, exactly as ``kimik3.model.moe.RoutedExperts`` does on one device.

The all-to-alls take their split sizes on the host (NCCL's ``all_to_all_single`` wants Python
lists), so each layer copies two [R] count vectors and the [E, R] "who hosts which foreign expert"
mask to the host in one transfer (one synchronisation point); the planner itself has no host
synchronisation. Applied from outside the model by ``apply_expert_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from kimik3.model.ffn import situ_glu
from kimik3.model.moe import LatentMoE, RoutedExperts
from kimik3.ops.moe import grouped_mm

Planner = Callable[[torch.Tensor, int], torch.Tensor]   # loads [E] -> quota [E, R]


def native_quota(loads_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """No balancing: every expert computed by its owner."""
    experts = loads_E.shape[0]
    owner_E = torch.arange(experts, device=loads_E.device) // (experts // num_ranks)
    quota_ER = torch.zeros(experts, num_ranks, dtype=torch.long, device=loads_E.device)
    return quota_ER.scatter_(1, owner_E[:, None], loads_E.long()[:, None])


def moonep_quota(loads_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    from kimik3.parallel.moonep_plan import planned_quota

    # No host sync on the critical path; on CUDA the plan is replayed from a captured graph
    # (0.18 ms at E=896, R=64 on an H200 against 1.75 ms launched eagerly: BENCHMARKS.md).
    return planned_quota(loads_E, num_ranks)


PLANNERS: dict[str, Planner] = {"moonep": moonep_quota, "none": native_quota}


def destinations(ids_P: torch.Tensor, counts_RE: torch.Tensor, quota_ER: torch.Tensor, rank: int) -> torch.Tensor:
    """Computing rank of each local pair (in ``ids_P`` order).

    Expert e's pairs are numbered globally by (source rank, local order); quota[e] cuts that line
    into consecutive pieces, piece r computed on rank r."""
    experts = counts_RE.shape[1]
    order = torch.argsort(ids_P, stable=True)
    sorted_ids = ids_P[order]
    local_counts_E = counts_RE[rank]
    first_E = torch.cumsum(local_counts_E, 0) - local_counts_E          # first sorted slot of each expert
    within = torch.arange(ids_P.numel(), device=ids_P.device) - first_E[sorted_ids]
    before_E = counts_RE[:rank].sum(0) if rank else torch.zeros(experts, dtype=torch.long, device=ids_P.device)
    global_pos = before_E[sorted_ids] + within
    cut_ER = torch.cumsum(quota_ER, 1)                                  # end of each rank's piece
    dest_sorted = (global_pos[:, None] >= cut_ER[sorted_ids]).sum(1)
    dest = torch.empty_like(dest_sorted)
    dest[order] = dest_sorted
    return dest


def received_from(counts_RE: torch.Tensor, quota_ER: torch.Tensor, rank: int) -> torch.Tensor:
    """Pairs ``rank`` receives from each source rank for each expert: [R, E].

    Expert e's pairs lie on one line in source-rank order (source s holds positions
    [start_se, start_se + counts_se)); ``rank`` computes the piece [cut_e,rank - quota_e,rank, cut_e,rank).
    Every rank holds the same counts and plan, so no exchange of counts (or of expert ids: a source
    sends its pairs for ``rank`` sorted by expert) is needed."""
    start_RE = torch.cumsum(counts_RE, 0) - counts_RE
    hi_E = torch.cumsum(quota_ER, 1)[:, rank]
    lo_E = hi_E - quota_ER[:, rank]
    overlap_RE = torch.minimum(start_RE + counts_RE, hi_E[None, :]) - torch.maximum(start_RE, lo_E[None, :])
    return overlap_RE.clamp(min=0)


class EPRoutedExperts(RoutedExperts):
    """``RoutedExperts`` holding only this rank's E/R experts; forward runs the MoonEP exchange."""

    group: dist.ProcessGroup
    num_experts: int
    planner: Planner
    last_quota: torch.Tensor | None

    def forward(self, x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """As ``RoutedExperts.forward``; ``counts_E`` (this rank's loads) is not needed: the plan counts them."""
        group, ranks = self.group, dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        experts, per_rank = self.num_experts, self.num_experts // ranks
        top_k = ids_TK.shape[1]
        device = x_TL.device

        # 1-3: global loads, the plan, every local pair's computing rank
        ids_P = ids_TK.flatten()
        local_E = torch.bincount(ids_P, minlength=experts)
        counts_RE = torch.empty(ranks * experts, dtype=local_E.dtype, device=device)
        dist.all_gather_into_tensor(counts_RE, local_E, group=group)
        counts_RE = counts_RE.view(ranks, experts)
        quota_ER = self.planner(counts_RE.sum(0), ranks)
        self.last_quota = quota_ER.detach()
        dest_P = destinations(ids_P, counts_RE, quota_ER, rank)

        # 4: send pairs grouped by destination (then by expert), receive this rank's quota
        order = torch.argsort(dest_P * experts + ids_P, stable=True)
        send_R = torch.bincount(dest_P, minlength=ranks)
        recv_RE = received_from(counts_RE, quota_ER, rank)  # known from the plan: no count exchange
        recv_R = recv_RE.sum(1)
        owner_E = torch.arange(experts, device=device) // per_rank
        hosted_ER = (quota_ER > 0) & (owner_E[:, None] != torch.arange(ranks, device=device)[None, :])
        # The one host synchronisation of the layer: NCCL's all-to-all wants its split sizes as lists.
        host = torch.cat([send_R, recv_R, hosted_ER.flatten().long()]).cpu()
        send_sizes, recv_sizes = host[:ranks].tolist(), host[ranks:2 * ranks].tolist()
        hosted = host[2 * ranks:].view(experts, ranks).bool()
        token_P = order // top_k
        rows_out = _exchange(x_TL[token_P], recv_sizes, send_sizes, group)
        weights_out = _exchange(weights_TK.flatten()[order].float()[:, None], recv_sizes, send_sizes, group)[:, 0]
        # each source's block arrives sorted by expert: the ids follow from the plan, no exchange
        ids_out = torch.arange(experts, device=device).repeat(ranks).repeat_interleave(
            recv_RE.flatten(), output_size=sum(recv_sizes))  # the size given: no second host sync

        # 5: foreign experts' weights from their owners
        table_E, stacked = self._expert_table(hosted, rank, ranks, per_rank, device)

        # 6: the experts, as on one device, then the way back
        local_ids = table_E[ids_out]
        sort = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=stacked[0].shape[0])
        x_NL = rows_out[sort]
        gate = grouped_mm(x_NL, stacked[0].to(x_NL.dtype), counts)
        up = grouped_mm(x_NL, stacked[1].to(x_NL.dtype), counts)
        hidden = (situ_glu(gate.float(), up.float()) * weights_out[sort, None]).to(x_NL.dtype)
        y_sorted = grouped_mm(hidden, stacked[2].to(x_NL.dtype), counts)
        y_NL = torch.empty_like(y_sorted).index_copy(0, sort, y_sorted)
        back = _exchange(y_NL, send_sizes, recv_sizes, group)
        return torch.zeros_like(x_TL).index_add_(0, token_P, back.to(x_TL.dtype))

    def _expert_table(self, hosted: torch.Tensor, rank: int, ranks: int, per_rank: int, device: torch.device
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Expert id -> row of the local weight stack [natives, then foreign experts sent here].

        ``hosted``: host bool [E, R], foreign expert e computes on rank r."""
        experts = self.num_experts
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        w_gate, w_up, w_down = (_local(w) for w in (self.w_gate_ELF, self.w_up_ELF, self.w_down_EFL))
        table_E = torch.full((experts,), -1, dtype=torch.long, device=device)
        table_E[mine] = torch.arange(per_rank, device=device)
        if not hosted.any():  # every expert on its owner (the same answer on every rank): no exchange
            return table_E, (w_gate, w_up, w_down)
        send = [torch.nonzero(hosted[mine, d]).flatten().tolist() for d in range(ranks)]   # my experts for d
        receive = torch.nonzero(hosted[:, rank]).flatten().tolist()                         # foreign here
        sent = torch.tensor([e for d in range(ranks) for e in send[d]], dtype=torch.long, device=w_gate.device)
        # only the experts that leave are flattened and copied
        outgoing = torch.cat([w_gate[sent].flatten(1), w_up[sent].flatten(1), w_down[sent].flatten(1)], 1)
        recv_sizes = [int(hosted[d * per_rank:(d + 1) * per_rank, rank].sum()) for d in range(ranks)]
        incoming = _exchange(outgoing, recv_sizes, [len(s) for s in send], self.group)
        latent, hidden = self.w_gate_ELF.shape[1:]
        size = latent * hidden
        gate_f, up_f, down_f = incoming.split([size, size, size], dim=1)
        stacked = (torch.cat([w_gate, gate_f.view(-1, latent, hidden)]),
                   torch.cat([w_up, up_f.view(-1, latent, hidden)]),
                   torch.cat([w_down, down_f.view(-1, hidden, latent)]))
        if receive:   # received in owner order = ascending expert id, which `receive` is
            table_E[torch.tensor(receive, device=device)] = torch.arange(per_rank, per_rank + len(receive),
                                                                         device=device)
        return table_E, stacked


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts as a plain tensor (DTensor parameters: the local shard, differentiably)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _exchange(rows: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single along dim 0 (the backward sends gradients back)."""
    out = funcol.all_to_all_single_autograd(rows.contiguous(), recv_sizes, send_sizes, group)
    return funcol.wait_tensor(out)


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup | DeviceMesh,
                          planner: str | Planner = "moonep") -> None:
    """Keep this rank's E/R experts of every LatentMoE and route through the MoonEP exchange.

    ``group``: the EP process group, or a 1-D DeviceMesh over it; with a mesh the expert weights
    become DTensors sharded on dim 0, so full-state checkpoints gather and scatter them like any
    FSDP parameter (a distributed run's checkpoint loads in one process and vice versa)."""
    mesh = group if isinstance(group, DeviceMesh) else None
    process_group = mesh.get_group() if mesh is not None else group
    ranks, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    plan_fn = PLANNERS[planner] if isinstance(planner, str) else planner
    for module in model.modules():
        if not isinstance(module, LatentMoE):
            continue
        experts_module = module.experts
        if getattr(experts_module, "quant", None) is not None:
            raise ValueError(f"expert parallel: the routed experts are quantised ({experts_module.quant!r}); "
                             "quantisation-aware experts run on one rank or under FSDP, not under MoonEP yet")
        experts = experts_module.w_gate_ELF.shape[0]
        if experts % ranks:
            raise ValueError(f"expert parallel: {experts} experts do not split over {ranks} ranks")
        per_rank = experts // ranks
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for name in ("w_gate_ELF", "w_up_ELF", "w_down_EFL"):
            full = getattr(experts_module, name)
            local = full.detach()[mine].clone()
            if mesh is not None:
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(experts_module, name, nn.Parameter(local, requires_grad=full.requires_grad))
        experts_module.__class__ = EPRoutedExperts
        experts_module.group = process_group
        experts_module.num_experts = experts
        experts_module.planner = plan_fn
        experts_module.last_quota = None
