"""MoonEP planner: a perfectly balanced expert-to-rank token plan with at most E/R foreign experts per rank.

Legend: E = experts, R = EP ranks, m = E/R (native experts per rank; expert e is native to rank
e // m), C = total/R (tokens every rank computes: S×K), O = overloaded ranks (native load > C),
U = the other ranks. Suffixes name shapes: ``quota_ER`` is [E, R].

``plan(loads_E, R)`` returns ``Plan.quota`` [E, R] int64: tokens of expert e computed on rank r.
Rows sum to ``loads_E``, every column sums to exactly C, and every rank hosts positive quota of at
most m experts that are not its own (the E/R redundant slots). docs/moonep.md has the proof.

The construction ("block line"), all fixed-shape tensor ops, no host synchronisation:
 1. Ranks in U keep all their native tokens; they need d_r = C - N_r more.
 2. The native experts of the ranks in O are laid end to end on one token line, rank by rank
    ("blocks", each block's experts largest first). The line is cut into consecutive pieces, one
    per rank: overloaded rank i (i-th in the order) gets a piece of C tokens that starts inside its
    own block, within C of the block's end; an underloaded rank j gets a piece of d_j tokens lying
    entirely inside a single block (the block whose surplus prefix first exceeds the deficit
    prefix before j). Both positions are prefix sums and a ``searchsorted``.
 3. quota[e, r] = overlap of expert e's interval with rank r's piece (+ the natives kept in 1).
So an overloaded rank's foreign experts all belong to the next block's owner, an underloaded
rank's to one block's owner: at most m either way. Work: O(E·R) elementwise (the size of the
output) plus a sort of the m natives of each rank; on the GPU, ~25 small kernels.

``plan`` validates values by default (negative loads, total not divisible by R), which reads
device values on the host; pass ``check=False`` on the critical path (shape, dtype and E % R are
still checked: they are host metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Plan", "lower_bounds", "plan", "tight_instance"]


@dataclass(slots=True, frozen=True)
class Plan:
    """A MoonEP plan. All tensors live on the loads' device; nothing here syncs with the host.

    quota: [E, R] int64, tokens of expert e computed on rank r.
    loads: [E] int64, the loads the plan was made for.
    capacity: 0-d int64, C = total / R (tokens every rank computes).
    foreign_experts: [R, m] int64, the non-native experts with positive quota on each rank,
        ascending expert id, padded with -1 (fits by the E/R theorem).
    foreign_quota: [R, m] int64, their token counts on that rank (0 where padded).
    """

    quota: torch.Tensor
    loads: torch.Tensor
    capacity: torch.Tensor
    foreign_experts: torch.Tensor
    foreign_quota: torch.Tensor
    num_ranks: int

    # ------------------------------------------------------------------ shapes
    @property
    def num_experts(self) -> int:
        return self.quota.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def owner(self) -> torch.Tensor:
        """[E] int64: native rank of every expert (e // m)."""
        return torch.arange(self.num_experts, device=self.quota.device) // self.experts_per_rank

    # ------------------------------------------------------------------ derived counts (0-d or small tensors)
    @property
    def rank_load(self) -> torch.Tensor:
        """[R] int64: tokens each rank computes (all equal to ``capacity``)."""
        return self.quota.sum(0)

    @property
    def foreign_mask(self) -> torch.Tensor:
        """[E, R] bool: rank r computes tokens of expert e and e is not native to r."""
        native_ER = self.owner[:, None] == torch.arange(self.num_ranks, device=self.quota.device)[None, :]
        return (self.quota > 0) & ~native_ER

    @property
    def foreign_count(self) -> torch.Tensor:
        """[R] int64: foreign experts (replicas) hosted by each rank."""
        return self.foreign_mask.sum(0)

    @property
    def max_foreign_per_rank(self) -> torch.Tensor:
        """0-d int64: the most foreign experts on one rank (<= E/R)."""
        return self.foreign_count.max()

    @property
    def total_replicas(self) -> torch.Tensor:
        """0-d int64: (expert, foreign rank) pairs with positive quota: expert weights on the wire."""
        return self.foreign_mask.sum()

    @property
    def owner_to_host(self) -> torch.Tensor:
        """[R, R] int64: tokens of rank o's native experts computed on rank h (diagonal: kept home)."""
        out = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.int64, device=self.quota.device)
        return out.index_add_(0, self.owner, self.quota)

    def split_by_source(self, counts_RE: torch.Tensor) -> torch.Tensor:
        """[R_src, E, R_dst] int64: tokens of expert e that source rank s sends to rank r.

        ``counts_RE`` [R, E]: tokens each source rank routed to each expert (its columns sum to
        ``loads``). Convention (shared with ``kimik3.parallel.moonep.destinations``): expert e's
        tokens, numbered by (source rank, local order), are cut into consecutive pieces of
        quota[e, 0], quota[e, 1], ... tokens, piece r computed on rank r."""
        counts_RE = counts_RE.to(torch.int64)
        src_end_RE = torch.cumsum(counts_RE, 0)
        src_start_RE = src_end_RE - counts_RE
        dst_end_ER = torch.cumsum(self.quota, 1)
        dst_start_ER = dst_end_ER - self.quota
        lo = torch.maximum(src_start_RE[:, :, None], dst_start_ER[None])
        hi = torch.minimum(src_end_RE[:, :, None], dst_end_ER[None])
        return (hi - lo).clamp_min(0)

    def send_counts(self, counts_RE: torch.Tensor) -> torch.Tensor:
        """[R_src, R_dst] int64: tokens source s sends to rank r (receive counts: the transpose).
        Every column sums to ``capacity``."""
        return self.split_by_source(counts_RE).sum(1)

    # ------------------------------------------------------------------ checking (syncs)
    def validate(self) -> None:
        """Check every invariant; raises AssertionError naming the first one broken."""
        q, loads, R, m = self.quota, self.loads, self.num_ranks, self.experts_per_rank
        assert q.dtype == torch.int64 and q.shape == (self.num_experts, R), f"quota shape/dtype {q.shape} {q.dtype}"
        assert bool((q >= 0).all()), "negative quota"
        assert torch.equal(q.sum(1), loads), "rows do not sum to loads"
        C = int(loads.sum()) // R
        assert int(self.capacity) == C, "capacity != total / R"
        assert bool((q.sum(0) == C).all()), f"rank loads {q.sum(0).tolist()} != {C}"
        fc = self.foreign_count
        assert int(fc.max()) <= m, f"a rank hosts {int(fc.max())} > E/R = {m} foreign experts"
        fe, fq = self.foreign_experts, self.foreign_quota
        assert fe.shape == (R, m) and fq.shape == (R, m), "foreign tables must be [R, E/R]"
        for r in range(R):
            ids = fe[r][fe[r] >= 0]
            expect = torch.nonzero(self.foreign_mask[:, r]).flatten()
            assert torch.equal(ids, expect), f"foreign_experts[{r}] wrong"
            assert torch.equal(fq[r][: ids.numel()], q[ids, r]) and bool((fq[r][ids.numel():] == 0).all()), \
                f"foreign_quota[{r}] wrong"


def _check_inputs(loads_E: torch.Tensor, num_ranks: int, check_values: bool) -> None:
    if not isinstance(loads_E, torch.Tensor):
        raise TypeError(f"loads must be a torch.Tensor, got {type(loads_E).__name__}")
    if loads_E.dtype.is_floating_point or loads_E.dtype.is_complex or loads_E.dtype == torch.bool:
        raise ValueError(f"loads must be an integer tensor, got {loads_E.dtype}")
    if loads_E.dim() != 1 or loads_E.numel() == 0:
        raise ValueError(f"loads must be a non-empty 1-D tensor [E], got shape {tuple(loads_E.shape)}")
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    experts = loads_E.numel()
    if experts % num_ranks:
        raise ValueError(f"E = {experts} experts do not split evenly over R = {num_ranks} ranks")
    if check_values:
        if bool((loads_E < 0).any()):
            raise ValueError("loads must be non-negative")
        total = int(loads_E.sum())
        if total % num_ranks:
            raise ValueError(f"total load {total} is not divisible by R = {num_ranks}: no perfectly balanced plan "
                             f"(pad the step to a multiple of R tokens)")


def plan(loads_E: torch.Tensor, num_ranks: int, *, check: bool = True) -> Plan:
    """Perfectly balanced plan for one MoE layer step.

    loads_E: [E] integer tensor (any integer dtype, any device): tokens routed to each expert over
        all ranks; total divisible by ``num_ranks``; E divisible by ``num_ranks``.
    check: validate values (reads two scalars on the host). ``check=False`` keeps the call free of
        host synchronisation; inputs are then trusted.
    Returns a ``Plan`` on the loads' device (quota int64 [E, R]).
    """
    _check_inputs(loads_E, num_ranks, check)
    R = num_ranks
    E = loads_E.numel()
    m = E // R
    dev = loads_E.device
    loads_E = loads_E.to(torch.int64)
    loads_Rm = loads_E.view(R, m)
    native_R = loads_Rm.sum(1)                                    # N_r
    C = loads_E.sum() // R                                        # 0-d, stays on device
    over_R = native_R > C
    surplus_R = (native_R - C).clamp_min(0)
    deficit_R = (C - native_R).clamp_min(0)

    # Rank order on the line (any order is correct; this one keeps replicas low): heaviest first.
    order_R = torch.argsort(native_R, descending=True, stable=True)
    over_P, surplus_P, deficit_P, native_P = over_R[order_R], surplus_R[order_R], deficit_R[order_R], native_R[order_R]
    S_P = torch.cumsum(surplus_P, 0)                              # surplus prefix (inclusive), nondecreasing
    D_P = torch.cumsum(deficit_P, 0)                              # deficit prefix (inclusive)
    D_excl_P = D_P - deficit_P
    nover_P = torch.cumsum(over_P.long(), 0)                      # 1-based index i of an overloaded rank
    nover_excl_P = nover_P - over_P.long()
    block_len_P = native_P * over_P
    block_start_P = torch.cumsum(block_len_P, 0) - block_len_P   # Q_{i-1}

    # Overloaded rank i: piece [(i-1)C + D_{n_i}, +C), D_{n_i} = first deficit prefix >= S_i.
    first = torch.searchsorted(D_P, S_P, side="left").clamp_max(R - 1)
    start_over_P = (nover_P - 1) * C + D_P[first]
    # Underloaded rank j: piece [D_{j-1} + (b-1)C, +d_j) in block b = first i with S_i > D_{j-1}.
    blk = torch.searchsorted(S_P, D_excl_P, side="right").clamp_max(R - 1)
    start_under_P = D_excl_P + nover_excl_P[blk] * C
    piece_start_P = torch.where(over_P, start_over_P, start_under_P)
    piece_len_P = torch.where(over_P, C.expand(R), deficit_P)

    inv = torch.empty_like(order_R)
    inv[order_R] = torch.arange(R, device=dev)
    piece_start_R = piece_start_P[inv]
    piece_end_R = piece_start_R + piece_len_P[inv]
    block_start_R = block_start_P[inv]

    # Expert intervals on the line: inside each overloaded block, largest expert first.
    vals_Rm, idx_Rm = torch.sort(loads_Rm, dim=1, descending=True, stable=True)
    off_Rm = torch.cumsum(vals_Rm, 1) - vals_Rm
    start_sorted_Rm = block_start_R[:, None] + off_Rm
    start_Rm = torch.empty_like(start_sorted_Rm).scatter_(1, idx_Rm, start_sorted_Rm)
    start_E = start_Rm.reshape(E)
    end_E = start_E + loads_E
    over_E = over_R.repeat_interleave(m)
    lo_ER = torch.maximum(start_E[:, None], piece_start_R[None, :])
    hi_ER = torch.minimum(end_E[:, None], piece_end_R[None, :])
    quota_ER = (hi_ER - lo_ER).clamp_min(0) * over_E[:, None]
    owner_E = torch.arange(E, device=dev) // m
    kept_E = torch.where(over_E, torch.zeros_like(loads_E), loads_E)
    quota_ER.scatter_add_(1, owner_E[:, None], kept_E[:, None])

    fe, fq = _foreign_tables(quota_ER, owner_E, R, m)
    return Plan(quota=quota_ER, loads=loads_E, capacity=C, foreign_experts=fe, foreign_quota=fq, num_ranks=R)


def _foreign_tables(quota_ER: torch.Tensor, owner_E: torch.Tensor, R: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, m] foreign expert ids (ascending, -1 padded) and their quotas, fixed shape, no sync."""
    E = quota_ER.shape[0]
    dev = quota_ER.device
    foreign_ER = (quota_ER > 0) & (owner_E[:, None] != torch.arange(R, device=dev)[None, :])
    key_RE = torch.where(foreign_ER.T, torch.arange(E, device=dev)[None, :], E)
    ids_Rm = torch.sort(key_RE, dim=1).values[:, :m]
    valid = ids_Rm < E
    safe = torch.where(valid, ids_Rm, 0)
    q_Rm = torch.gather(quota_ER.T, 1, safe) * valid
    return torch.where(valid, ids_Rm, -1), q_Rm


class GraphedPlanner:
    """``plan(...).quota`` replayed from a CUDA graph: one launch instead of ~50 small kernels.

    The planner's shapes are static (E, R fixed per layer) and it never syncs with the host, so it
    can be captured once and replayed every step: measured 0.18 ms per call at E=896, R=64 on an
    H200 against 1.7 ms launched eagerly (BENCHMARKS.md; that measurement captured ``plan`` by hand).
    ``__call__(loads)`` copies the loads into the captured input buffer, replays, and returns a
    fresh copy of the quota. CUDA tensors only. ``benchmarks/parallel_smoke.py`` checks it against
    ``plan`` on fresh loads and times it (0.182 ms per call, copies included, on an H200); the EP
    layer uses it through ``planned_quota``.
    """

    def __init__(self, num_experts: int, num_ranks: int, device: torch.device):
        if torch.device(device).type != "cuda":
            raise ValueError(f"GraphedPlanner needs a CUDA device, got {device}")
        self.loads = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.loads[0] = num_ranks        # any valid loads (total divisible by R) for the capture
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up off the default stream, as capture requires
            plan(self.loads, num_ranks, check=False)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # Captured lazily, inside a training step: "thread_local" lets other threads (NCCL's watchdog,
        # data loaders) keep making CUDA calls while this thread captures.
        with torch.no_grad(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.quota = plan(self.loads, num_ranks, check=False).quota
        self.num_ranks = num_ranks

    def __call__(self, loads_E: torch.Tensor) -> torch.Tensor:
        self.loads.copy_(loads_E)
        self.graph.replay()
        return self.quota.clone()


_GRAPHED: dict[tuple[int, int, torch.device], GraphedPlanner] = {}


def planned_quota(loads_E: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """``plan(loads, R, check=False).quota``, from a cached CUDA graph on CUDA devices."""
    if not loads_E.is_cuda:
        return plan(loads_E, num_ranks, check=False).quota
    key = (loads_E.numel(), num_ranks, loads_E.device)
    if key not in _GRAPHED:
        _GRAPHED[key] = GraphedPlanner(loads_E.numel(), num_ranks, loads_E.device)
    return _GRAPHED[key](loads_E)


def lower_bounds(loads_E: torch.Tensor, num_ranks: int) -> dict[str, int]:
    """Plan-independent lower bounds (host ints; for benchmarks and tests).

    A rank r with native load N_r < C must compute C - N_r tokens of foreign experts, each giving
    at most its whole load: it hosts at least k_r foreign experts, k_r the fewest foreign loads
    (largest first) summing to C - N_r.
      max_foreign: max_r k_r — no balanced plan has fewer foreign experts on its busiest rank.
      replicas: max(sum_r k_r, sum over overloaded ranks of max(1, sum_e (ceil(l_e / C) - 1))):
        receivers count at least their k_r; an overloaded rank's natives need >= 1 foreign host,
        and an expert with load l needs ceil(l / C) hosts.
    """
    _check_inputs(loads_E, num_ranks, True)
    loads = loads_E.to(torch.int64).cpu()
    E, R = loads.numel(), num_ranks
    m = E // R
    C = int(loads.sum()) // R
    native = loads.view(R, m).sum(1)
    deficit = (C - native).clamp_min(0)
    vals, idx = torch.sort(loads, descending=True)
    own = (idx // m)[None, :] == torch.arange(R)[:, None]                  # [R, E] in sorted order
    csum = torch.cumsum(torch.where(own, 0, vals[None, :]), 1)
    k = torch.where(deficit > 0, ((csum < deficit[:, None]) & ~own).sum(1) + 1, 0)
    if C > 0:
        per_expert = (-(-loads // C) - 1).clamp_min(0).view(R, m).sum(1)
    else:
        per_expert = torch.zeros(R, dtype=torch.int64)
    sender = torch.where(native > C, per_expert.clamp_min(1), 0)
    return {"max_foreign": int(k.max()), "replicas": max(int(k.sum()), int(sender.sum()))}


def tight_instance(num_experts: int, num_ranks: int, unit: int = 1) -> torch.Tensor:
    """Loads [E] on which every balanced plan puts >= ceil(m(R-1)/R) foreign experts on rank 0
    (= m, the E/R bound, whenever R > m): rank 0's natives are empty, every other expert has
    load R·unit, so C = (R-1)·m·unit and each foreign expert covers at most R·unit < C/(m-1)."""
    m = num_experts // num_ranks
    loads = torch.full((num_experts,), num_ranks * unit, dtype=torch.int64)
    loads[:m] = 0
    return loads
