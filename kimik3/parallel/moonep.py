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
 4. pairs (latent rows and mixture weights) travel with one equal-split ``all_to_all_single`` each: every
    rank sends every rank a slot of T x K rows (its rows for that rank first, zeros after); the receiver
    knows from the shared loads and plan how many rows of each expert fill the start of each slot, and
    gathers its quota total (S x K with MoonEP: a static size for the expert buffers);
 5. weights of the foreign experts a rank was given (at most E/R under MoonEP) travel from their
    owners in one more equal-split ``all_to_all_single`` (a slot of E/R experts per owner and host);
    autograd sends their gradients back to the owner and sums them there;
 6. grouped matmuls over (native + foreign) experts, then the rows travel back and are summed
    per token, exactly as ``kimik3.model.moe.RoutedExperts`` does on one device.

Every size is a shape (T, K, E, R), so under MoonEP the layer reads nothing back to the host: no
synchronisation with the device in forward or backward (``EPRoutedExperts`` says what the padded slots
cost, and where plain EP still reads one count). Applied from outside the model by ``apply_expert_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from kimik3.model.ffn import situ_glu_cast
from kimik3.model.moe import LatentMoE, RoutedExperts, expert_counts
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


# What the exchange may assume of a planner (``EPRoutedExperts``): ``balanced``, every rank computes exactly
# total / R rows (static buffers, no host read); ``hosts_foreign``, it may put an expert's rows on another rank
# than its owner (then the weights travel). A planner without these attributes is taken as neither balanced
# nor native-only.
moonep_quota.balanced, moonep_quota.hosts_foreign = True, True
native_quota.balanced, native_quota.hosts_foreign = False, False
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


@dataclass(eq=False)
class Dispatched:
    """One layer's rows on their computing rank (``EPRoutedExperts.dispatch``), and what the way back needs.

    P = T x K pairs here, slots of P rows per (source, destination) rank pair, S = local weight slots
    (natives, then R x m slots of foreign experts when the planner may host them)."""

    x_NL: torch.Tensor          # the rows this rank computes, sorted by local slot
    weights_N: torch.Tensor     # their fp32 mixture weights
    counts_S: torch.Tensor      # rows per local weight slot
    stacked: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # gate, up, down weights of the S slots
    sort_N: torch.Tensor        # position of each computed row in the received [R x P] buffer
    slot_P: torch.Tensor        # position of each local pair (in send order) in the sent [R x P] buffer
    token_P: torch.Tensor       # token of each local pair (in send order)


class EPRoutedExperts(RoutedExperts):
    """``RoutedExperts`` holding only this rank's E/R experts; forward runs the MoonEP exchange.

    The exchange has static shapes and reads nothing back to the host when the planner is balanced (every
    rank computes exactly total/R = T x K rows: MoonEP): a rank sends each rank one slot of P = T x K rows
    (the most any rank can get from it: all its pairs), its rows for that rank first, zeros after, in one
    equal-split ``all_to_all_single``; the receiver knows from the shared loads and plan where the real rows
    of each slot end and which expert each belongs to, and gathers exactly its T x K rows. Foreign experts'
    weights travel the same way: every owner sends every rank a slot of E/R experts (a rank hosts at most
    E/R foreign experts, so no owner sends it more), the ones hosted there first. Every EP rank must hold
    the same number of tokens (the trainer's batches do).

    Price: a rank puts R x P rows on the wire of which P are real, and R x E/R expert slots of which at most
    E/R are; at R = 2 that is twice the bytes of an exchange sized on the host, in exchange for no device
    -> host synchronisation per layer. The planner "none" (plain EP, the imbalanced baseline) computes a
    routing-dependent number of rows: sizing its expert buffers reads that one count to the host
    (``_rows_here``), the one host read of the path."""

    group: dist.ProcessGroup
    num_experts: int
    planner: Planner
    last_quota: torch.Tensor | None

    def forward(self, x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """As ``RoutedExperts.forward``; ``counts_E``: this rank's loads if the router counted them."""
        sent = self.dispatch(x_TL, weights_TK, ids_TK, counts_E)
        return self.combine(self.compute(sent), sent, x_TL)

    def dispatch(self, x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                 counts_E: torch.Tensor | None = None) -> Dispatched:
        """Steps 1-5: global loads, the plan, every pair to its computing rank, foreign experts' weights."""
        group, ranks = self.group, dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        experts, per_rank = self.num_experts, self.num_experts // ranks
        tokens, top_k = ids_TK.shape
        pairs = tokens * top_k
        device = x_TL.device

        # 1-3: global loads, the plan, every local pair's computing rank
        ids_P = ids_TK.flatten()
        local_E = (counts_E if counts_E is not None else expert_counts(ids_P, experts)).to(torch.int64)
        counts_RE = torch.empty(ranks * experts, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(counts_RE, local_E.contiguous(), group=group)
        counts_RE = counts_RE.view(ranks, experts)
        quota_ER = self.planner(counts_RE.sum(0), ranks)
        self.last_quota = quota_ER.detach()
        dest_P = destinations(ids_P, counts_RE, quota_ER, rank)

        # 4: pairs grouped by destination (then by expert), each destination's at the start of its slot of P rows
        order = torch.argsort(dest_P * experts + ids_P, stable=True)
        dest_sorted = dest_P[order]
        send_R = torch.zeros(ranks, dtype=torch.int64, device=device).scatter_add_(0, dest_P, torch.ones_like(dest_P))
        first_R = torch.cumsum(send_R, 0) - send_R
        slot_P = dest_sorted * pairs + torch.arange(pairs, device=device) - first_R[dest_sorted]
        token_P = torch.div(order, top_k, rounding_mode="floor")
        rows = x_TL.index_select(0, token_P)
        received = _exchange(rows.new_zeros(ranks * pairs, rows.shape[1]).index_copy(0, slot_P, rows), group)
        mixture = weights_TK.flatten()[order].float()
        mixture = _exchange(mixture.new_zeros(ranks * pairs, 1).index_copy(0, slot_P, mixture[:, None]), group)[:, 0]
        # the expert of every received row, from the plan (source s's rows for here, sorted by expert, fill the
        # start of slot s); `experts` marks the padding after them
        end_RE = torch.cumsum(received_from(counts_RE, quota_ER, rank), 1)
        within = torch.arange(pairs, device=device).expand(ranks, pairs).contiguous()
        ids_RP = torch.searchsorted(end_RE, within, right=True)

        # 5: foreign experts' weights from their owners; every expert id -> its local weight slot
        table_E, stacked = self._expert_slots(quota_ER, rank, ranks, per_rank, device)
        slots = stacked[0].shape[0]
        local_RP = torch.cat([table_E, table_E.new_full((1,), slots)])[ids_RP.flatten()]   # padding: slot S
        counts_S = torch.zeros(slots + 1, dtype=torch.int64, device=device).scatter_add_(
            0, local_RP, torch.ones_like(local_RP))[:slots]
        computed = self._rows_here(quota_ER, rank, pairs)
        sort_N = torch.argsort(local_RP, stable=True)[:computed]   # real rows by slot (then source), padding last
        if getattr(self.planner, "balanced", False):
            torch._assert_async(counts_S.sum() == computed)   # a rank with another token count would drop rows
        return Dispatched(received.index_select(0, sort_N), mixture.index_select(0, sort_N), counts_S, stacked,
                          sort_N, slot_P, token_P)

    def compute(self, sent: Dispatched) -> torch.Tensor:
        """Step 6: the experts over the computed rows, as on one device: [N, L]. Quantisation-aware experts
        (``quant``) quantise every slot's weights here, the foreign ones as their owners would (MXFP4 blocks lie
        within one expert), and the rows as ``RoutedExperts`` does (MXFP8 blocks lie within one row)."""
        x_NL, (w_gate, w_up, w_down) = self._input(sent.x_NL), sent.stacked
        dtype = x_NL.dtype
        gate = grouped_mm(x_NL, self._weight(w_gate, dtype), sent.counts_S)
        up = grouped_mm(x_NL, self._weight(w_up, dtype), sent.counts_S)
        hidden = self._input(situ_glu_cast(gate, up, sent.weights_N, dtype))
        return grouped_mm(hidden, self._weight(w_down, dtype), sent.counts_S)

    def combine(self, y_NL: torch.Tensor, sent: Dispatched, x_TL: torch.Tensor) -> torch.Tensor:
        """The rows back to their source slots, and each token's K rows summed: [T, L]."""
        ranks = dist.get_world_size(self.group)
        pairs = sent.slot_P.numel()
        back = y_NL.new_zeros(ranks * pairs, y_NL.shape[1]).index_copy(0, sent.sort_N, y_NL)
        back = _exchange(back, self.group).index_select(0, sent.slot_P)
        return torch.zeros_like(x_TL).index_add_(0, sent.token_P, back.to(x_TL.dtype))

    def _rows_here(self, quota_ER: torch.Tensor, rank: int, pairs: int) -> int:
        """Rows this rank computes: P under a balanced planner (every rank computes total / R, and every rank
        holds P pairs); otherwise this rank's quota, read to the host (plain EP's routing-dependent count)."""
        if getattr(self.planner, "balanced", False):
            return pairs
        return int(quota_ER[:, rank].sum())

    def _expert_slots(self, quota_ER: torch.Tensor, rank: int, ranks: int, per_rank: int, device: torch.device
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Expert id -> local weight slot, and the slots' weights: this rank's E/R natives, then (when the planner
        may host foreign experts) R slots of E/R from each owner, the experts it hosts here first, ascending."""
        experts, m = self.num_experts, per_rank
        w_gate, w_up, w_down = (_local(w) for w in (self.w_gate_ELF, self.w_up_ELF, self.w_down_EFL))
        expert_ids = torch.arange(experts, device=device)
        owner_E = expert_ids // m
        native_E = owner_E == rank
        table_E = torch.where(native_E, expert_ids - rank * m, m)   # m: no rows come (overwritten if hosted)
        if not getattr(self.planner, "hosts_foreign", True):
            return table_E, (w_gate, w_up, w_down)
        hosted_ER = (quota_ER > 0) & (owner_E[:, None] != torch.arange(ranks, device=device)[None, :])
        # as owner: for each host, my experts it computes, ascending, then fillers (never read there)
        mine_mR = hosted_ER[rank * m:(rank + 1) * m]
        key_mR = torch.where(mine_mR, torch.arange(m, device=device)[:, None], m)
        send_idx = torch.sort(key_mR, dim=0).values.T.flatten().clamp(max=m - 1)
        outgoing = torch.cat([w.index_select(0, send_idx).flatten(1) for w in (w_gate, w_up, w_down)], 1)
        incoming = _exchange(outgoing, self.group)
        # as host: foreign expert e of owner o sits in slot m + o * m + (its rank among o's experts hosted here)
        here_Rm = hosted_ER[:, rank].view(ranks, m)
        slot_E = (m + owner_E * m + (torch.cumsum(here_Rm.long(), 1) - 1).flatten())
        table_E = torch.where(here_Rm.flatten(), slot_E, torch.where(native_E, table_E, m + ranks * m))
        latent, hidden = self.w_gate_ELF.shape[1:]
        size = latent * hidden
        gate_f, up_f, down_f = incoming.split([size, size, size], dim=1)
        stacked = (torch.cat([w_gate, gate_f.view(-1, latent, hidden)]),
                   torch.cat([w_up, up_f.view(-1, latent, hidden)]),
                   torch.cat([w_down, down_f.view(-1, hidden, latent)]))
        return table_E, stacked


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts as a plain tensor (DTensor parameters: the local shard, differentiably)."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


def _exchange(rows: torch.Tensor, group) -> torch.Tensor:
    """Differentiable equal-split all_to_all_single along dim 0 (the backward sends gradients back): rank r
    gets the r-th of R equal slices of every rank's ``rows``. Sizes from shapes: no host synchronisation."""
    out = funcol.all_to_all_single_autograd(rows.contiguous(), None, None, group)
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
        if experts_module.packed is not None:
            raise ValueError("expert parallel: the routed experts are packed as MXFP4 codes (an inference model); "
                             "expert parallelism trains full-precision (or quantisation-aware) expert weights")
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
