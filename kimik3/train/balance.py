"""Quantile Balancing (QB): K3's auxiliary-loss-free router biases (notes §4).

Legend: T = tokens, E = routed experts, K = experts per token (top_k), B = histogram bins,
L = routers (MoE layers). Scores are fp32 sigmoid router scores in [0, 1]; biases, margins and
bin edges are in the same units ("score units").

The router picks the top-K of ``scores + bias`` (``kimik3.model.moe.Router``); the bias moves
which experts are chosen, never their mixture weights. For token t and expert j let
``threshold_tj`` be the biased score expert j must beat to be chosen; then j is chosen on t
exactly when ``b_j > required_tj = threshold_tj - score_tj`` (the routing margin is
``-required_tj``). Every expert gets the target load T*K/E when ``b_j`` is the (K/E)-quantile of
its ``required_tj`` over the tokens. QB sets all biases to those quantiles at once, then
mean-centres them (adding a constant to every bias changes no selection).

Two thresholds are offered (``threshold=``):

* ``"others"`` (default): the K-th largest biased score among the *other* experts. That is the
  exact condition "j is chosen iff b_j > required_tj, every other bias held fixed". It equals the
  router's ``cutoff_T`` (the (K+1)-th biased score) on tokens where j is chosen and the K-th
  biased score where it is not; both come out of the router's top-(K+1), so it costs no extra
  top-k.
* ``"cutoff"``: the (K+1)-th biased score for every expert, as in the public torchtitan port of
  K3. On tokens where j is *not* chosen it understates the bar by the gap between the K-th and
  (K+1)-th biased scores, and that error is largest for the experts that are rarely chosen. Both
  thresholds have the same fixed point (perfect balance), but from a skewed start one
  ``"cutoff"`` update leaves roughly O(1/K) relative imbalance (max/mean 1.1-1.3 on skewed
  synthetic scores at E=64 K=4 and E=256 K=8; ``tests/train/test_balance.py`` pins > 1.10) and
  needs 3-4 updates to reach 1.05 (``benchmarks/balance.py``), while one ``"others"`` update
  lands near 1.02-1.05 when experts are not strongly correlated (below).

When one update suffices: all biases move at once, so each expert's quantile was read against
thresholds that then shift. Two effects remain after one ``"others"`` update from a skewed start:
(1) correlated experts. Experts that favour the same tokens all raise (or lower) their biases for
those tokens and then split them. With independent per-expert noise the residual is second order
(max/mean ~1.02-1.03 at E=64 K=4 with unlimited tokens); with a router fed a 16-dim token
vector shared by 32 experts one update lands near 1.2 and a second one below 1.05 (both in
``tests/train/test_balance.py``); with the rank-8 token structure of ``benchmarks/balance.py``
one update reaches <= 1.05 at E=64-896 (T >= 262k). (2) Sampling: the quantile is read off T tokens, a
relative load error of about z / sqrt(T*K/E) (z ~ 2.5-3.5 for the largest of E experts), so
one-step balance within 5% needs a few thousand tokens per expert per step. K3's global batches
hold far more than that. With small batches the full-gain update also carries one batch's
sampling noise into the next bias, while the sign update's small fixed steps average over many: at E=16
K=2 T=4096 (the tiny preset's scale) the steady states are QB 1.12 vs sign 1.10 over a floor of
1.09 (benchmarks/balance.py --settings 16:2:4096), though sign first spends (bias range)/gamma steps
getting there.

Histogram estimator: instead of sorting all T x E values (and gathering them across ranks), the
routing statistics of each training forward (``K3Output.routing``, handed to ``observe``) are binned
as ``required_TE`` into a counts matrix ``histogram_EB`` of B uniform bins over
a range that provably holds every value (see ``bin_range``); ``step()`` all-reduces the counts of
every router in ONE collective (a single flat int32 buffer: sum over routers of E*(B+1)*4 bytes,
the extra column being the expert loads used for the metrics; K3's 92 layers x 896 experts x
1001 columns is 330 MB per optimizer step) and reads each quantile off the cumulative counts,
interpolating linearly inside the bin where the target count falls.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kimik3.model.moe import Router, RoutingStats, expert_counts

THRESHOLDS = ("others", "cutoff")

# Tokens binned per chunk are bounded so the int64 bin indices of a large micro-batch
# (K3: 16k tokens x 896 experts) never need more than ~2^23 elements at once.
_MAX_CHUNK_ELEMENTS = 1 << 23


# ---------------------------------------------------------------------------- argument checks
def _check_threshold(threshold: str) -> None:
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold must be one of {THRESHOLDS}, got {threshold!r}")


def _check_routing(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> None:
    if scores_TE.ndim != 2:
        raise ValueError(f"scores_TE must be [tokens, experts], got shape {tuple(scores_TE.shape)}")
    num_experts = scores_TE.shape[1]
    if bias_E.shape != (num_experts,):
        raise ValueError(f"bias_E must be [{num_experts}] (one per expert of scores_TE), "
                         f"got shape {tuple(bias_E.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def _check_cutoff(cutoff_T: torch.Tensor, scores_TE: torch.Tensor) -> None:
    if cutoff_T.shape != scores_TE.shape[:1]:
        raise ValueError(f"cutoff_T must be [{scores_TE.shape[0]}] (one per token of scores_TE), "
                         f"got shape {tuple(cutoff_T.shape)}")


# ---------------------------------------------------------------------------- routing pieces
def route_biased(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's selection as a function (for synthetic scores, tests and benchmarks).

    scores_TE [T, E] fp32 in [0, 1]; bias_E [E] fp32. Returns ``ids_TK`` [T, K] int64 (sorted by
    biased score, best first), ``cutoff_T`` [T] fp32 (the (K+1)-th biased score; -inf when
    K == E) and ``loads_E`` [E] int64 (tokens routed to each expert). Same arithmetic as
    ``Router.forward``, so the values match it bit for bit.
    """
    _check_routing(scores_TE, bias_E, top_k)
    num_experts = scores_TE.shape[1]
    biased_TE = scores_TE + bias_E
    top_vals, top_ids = torch.topk(biased_TE, min(top_k + 1, num_experts), dim=-1, sorted=True)
    ids_TK = top_ids[:, :top_k]
    cutoff_T = top_vals[:, top_k] if top_k < num_experts else torch.full_like(top_vals[:, 0], -math.inf)
    loads_E = expert_counts(ids_TK, num_experts)
    return ids_TK, cutoff_T, loads_E


def required_bias(scores_TE: torch.Tensor, cutoff_T: torch.Tensor, bias_E: torch.Tensor, top_k: int, *,
                  threshold: str = "others", ids_TK: torch.Tensor | None = None) -> torch.Tensor:
    """The bias each expert needs to be chosen on each token: ``required_TE`` [T, E] fp32.

    With ``threshold="others"``, expert j is chosen on token t iff ``bias_E[j] > required_TE[t, j]``
    (other biases fixed), exactly; with ``"cutoff"`` that holds where j is chosen and is an
    underestimate elsewhere (see the module docstring). ``cutoff_T`` [T] is the (K+1)-th biased
    score (``RoutingStats.cutoff_T``); ``ids_TK`` [T, K] the chosen experts, recomputed from
    ``scores_TE + bias_E`` when not given. Requires K < E.
    """
    _check_routing(scores_TE, bias_E, top_k)
    _check_cutoff(cutoff_T, scores_TE)
    _check_threshold(threshold)
    if top_k >= scores_TE.shape[1]:
        raise ValueError(f"top_k={top_k} == num_experts: every expert is always chosen, no bias is required")
    if threshold == "cutoff":
        return cutoff_T[:, None] - scores_TE
    biased_TE = scores_TE + bias_E
    if ids_TK is None:
        ids_TK = torch.topk(biased_TE, top_k, dim=-1).indices
    elif ids_TK.shape != (scores_TE.shape[0], top_k):
        raise ValueError(f"ids_TK must be [{scores_TE.shape[0]}, {top_k}], got shape {tuple(ids_TK.shape)}")
    # min, not the last column, so ids_TK need not be sorted.
    kth_T = biased_TE.gather(1, ids_TK).min(dim=1).values
    chosen_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, ids_TK, True)
    # Without j, the bar is the K-th best of the rest: the (K+1)-th overall where j is among the
    # K chosen, the K-th overall where it is not.
    threshold_TE = torch.where(chosen_TE, cutoff_T[:, None], kth_T[:, None])
    return threshold_TE - scores_TE


def bin_range(bias_E: torch.Tensor, top_k: int, threshold: str = "others") -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram range ``(low, high)`` (0-d fp32 tensors, no host sync) that holds every required bias.

    Let b_(i) be the i-th largest bias. With scores in [0, 1]:
    the K-th largest biased score lies in [b_(K), b_(K) + 1] (the K experts of largest bias each
    score at least their bias, and only the < K experts with a bias above b_(K) can exceed
    b_(K) + 1); likewise the (K+1)-th lies in [b_(K+1), b_(K+1) + 1]. Subtracting a score in
    [0, 1] gives required biases in [b_(K+1) - 1, b_(K+1) + 1] for ``"cutoff"`` and
    [b_(K+1) - 1, b_(K) + 1] for ``"others"``. The width is 2 (plus the usually tiny gap
    b_(K) - b_(K+1)) whatever the spread of the biases, so one dead expert with a huge bias does
    not coarsen everyone's bins as a [min(b) - 1, max(b) + 1] range would. The sought quantile is
    one of the values, so it lies inside too. Requires K < E.
    """
    _check_threshold(threshold)
    if not 1 <= top_k < bias_E.numel():
        raise ValueError(f"top_k must be in [1, num_experts={bias_E.numel()}), got {top_k}")
    top_vals = torch.topk(bias_E.detach().float(), top_k + 1).values
    low = top_vals[top_k] - 1.0
    high = (top_vals[top_k - 1] if threshold == "others" else top_vals[top_k]) + 1.0
    return low, high


def accumulate_histogram(histogram_EB: torch.Tensor, required_TE: torch.Tensor,
                         low: torch.Tensor | float, high: torch.Tensor | float) -> None:
    """Add ``required_TE`` [T, E] into ``histogram_EB`` [E, B] (contiguous int32/int64), in place.

    Bin b covers [low + b*w, low + (b+1)*w) with w = (high - low) / B; values outside (only ever
    by float rounding, given ``bin_range``) land in the end bins.
    """
    if histogram_EB.ndim != 2 or not histogram_EB.is_contiguous():
        raise ValueError(f"histogram_EB must be a contiguous [experts, bins] tensor, got shape "
                         f"{tuple(histogram_EB.shape)}")
    num_experts, num_bins = histogram_EB.shape
    if required_TE.ndim != 2 or required_TE.shape[1] != num_experts:
        raise ValueError(f"required_TE must be [tokens, {num_experts}], got shape {tuple(required_TE.shape)}")
    scale = num_bins / (high - low)
    row_offset_E = torch.arange(num_experts, device=required_TE.device) * num_bins
    flat = histogram_EB.view(-1)
    step = max(1, _MAX_CHUNK_ELEMENTS // num_experts)
    for start in range(0, required_TE.shape[0], step):
        chunk_TE = required_TE[start:start + step]
        bins_TE = ((chunk_TE - low) * scale).floor_().clamp_(0, num_bins - 1).long()
        index = (bins_TE + row_offset_E).flatten()
        # index_add_ (not bincount) keeps CUDA free of the host sync bincount needs to size its output.
        flat.index_add_(0, index, torch.ones(1, dtype=flat.dtype, device=flat.device).expand(index.numel()))


def histogram_quantile(histogram_EB: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float,
                       fraction: float) -> torch.Tensor:
    """Per-row value below which ``fraction`` of the counts lie: [E] fp32.

    Counts are taken as spread uniformly inside each bin (linear interpolation of the cumulative
    count). Rows without counts give NaN.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    num_bins = histogram_EB.shape[1]
    cumulative_EB = histogram_EB.cumsum(dim=1, dtype=torch.int64)
    total_E = cumulative_EB[:, -1]
    target_E = total_E.double() * fraction
    # First bin whose cumulative count reaches the target; the target is > 0 and < total, so that
    # bin holds at least one count.
    bin_E = (cumulative_EB.double() < target_E[:, None]).sum(dim=1).clamp_(max=num_bins - 1)
    in_bin_E = histogram_EB.gather(1, bin_E[:, None]).squeeze(1).double()
    before_E = cumulative_EB.gather(1, bin_E[:, None]).squeeze(1).double() - in_bin_E
    within_E = ((target_E - before_E) / in_bin_E).clamp(0.0, 1.0)
    width = (high - low) / num_bins
    return (low + (bin_E.double() + within_E) * width).float()


def _centred(values_E: torch.Tensor) -> torch.Tensor:
    # Only bias differences move the top-k; centring keeps the biases near 0, where fp32 is finest.
    return values_E - values_E.mean()


# ---------------------------------------------------------------------------- one-shot functions
def quantile_bias_exact(scores_TE: torch.Tensor, cutoff_T: torch.Tensor, bias_E: torch.Tensor, top_k: int, *,
                        threshold: str = "others", ids_TK: torch.Tensor | None = None) -> torch.Tensor:
    """The QB bias computed exactly by sorting (the test oracle): [E] fp32, mean-centred.

    For each expert: sort its T required biases and take the value with T*K/E of them below (at
    sorted position T*K/E - 1/2, linearly interpolated: the midpoint between the last token it
    should win and the first it should not). Returns ``bias_E`` unchanged (a copy) when there are
    no tokens or K == E (no selection to balance). Inputs as in ``required_bias``.
    """
    _check_routing(scores_TE, bias_E, top_k)
    _check_cutoff(cutoff_T, scores_TE)
    _check_threshold(threshold)
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0 or top_k == num_experts:
        return bias_E.detach().float().clone()
    required_TE = required_bias(scores_TE, cutoff_T, bias_E, top_k, threshold=threshold, ids_TK=ids_TK)
    sorted_TE = required_TE.double().sort(dim=0).values
    position = min(max(num_tokens * top_k / num_experts - 0.5, 0.0), num_tokens - 1.0)
    below = math.floor(position)
    above = min(below + 1, num_tokens - 1)
    weight = position - below
    quantile_E = sorted_TE[below] * (1.0 - weight) + sorted_TE[above] * weight
    return _centred(quantile_E).float()


def quantile_bias_histogram(scores_TE: torch.Tensor, cutoff_T: torch.Tensor, bias_E: torch.Tensor, top_k: int, *,
                            num_bins: int = 1000, threshold: str = "others",
                            ids_TK: torch.Tensor | None = None) -> torch.Tensor:
    """One QB update from one batch, through the histogram (what ``QuantileBalancer`` does): [E] fp32.

    Same inputs and edge cases as ``quantile_bias_exact``.
    """
    _check_routing(scores_TE, bias_E, top_k)
    _check_cutoff(cutoff_T, scores_TE)
    if num_bins < 2:
        raise ValueError(f"num_bins must be >= 2, got {num_bins}")
    num_tokens, num_experts = scores_TE.shape
    if num_tokens == 0 or top_k == num_experts:
        return bias_E.detach().float().clone()
    low, high = bin_range(bias_E, top_k, threshold)
    histogram_EB = torch.zeros(num_experts, num_bins, dtype=torch.int32, device=scores_TE.device)
    required_TE = required_bias(scores_TE, cutoff_T, bias_E, top_k, threshold=threshold, ids_TK=ids_TK)
    accumulate_histogram(histogram_EB, required_TE, low, high)
    return _centred(histogram_quantile(histogram_EB, low, high, top_k / num_experts))


def sign_update(bias_E: torch.Tensor, loads_E: torch.Tensor, gamma: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free step: ``bias + gamma * sign(mean_load - load)``, a new [E] fp32 tensor.

    Under-loaded experts gain ``gamma`` (score units), over-loaded ones lose it, experts at the
    mean keep their bias. Not centred, as published.
    """
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if loads_E.shape != bias_E.shape:
        raise ValueError(f"loads_E must match bias_E's shape {tuple(bias_E.shape)}, got {tuple(loads_E.shape)}")
    loads_E = loads_E.double()
    return (bias_E.double() + gamma * torch.sign(loads_E.mean() - loads_E)).float()


def load_imbalance(loads_E: torch.Tensor) -> float:
    """max / mean of the expert loads [E] (1.0 = perfectly balanced); NaN when no token was routed."""
    if loads_E.numel() == 0:
        raise ValueError("loads_E is empty")
    loads_E = loads_E.double()
    mean = float(loads_E.mean())
    return float(loads_E.max()) / mean if mean > 0 else math.nan


# ---------------------------------------------------------------------------- stateful balancers
class _RouterBalancer:
    """Shared plumbing: validation, ``observe`` of the routing statistics of training forwards, one
    flat int32 buffer per balancer (so a step is one all-reduce), metrics."""

    def __init__(self, routers: Sequence[Router], *, all_reduce: Callable[[torch.Tensor], None] | None = None):
        routers = list(routers)
        if not routers:
            raise ValueError("routers is empty: give the model's routers (K3ForCausalLM.routers())")
        for index, router in enumerate(routers):
            if not isinstance(router, Router):
                raise ValueError(f"routers[{index}] is a {type(router).__name__}, not a kimik3 Router")
        if len({id(r) for r in routers}) != len(routers):
            raise ValueError("routers lists the same Router twice")
        devices = {r.expert_bias.device for r in routers}
        if len(devices) > 1:
            raise ValueError(f"routers live on several devices {sorted(map(str, devices))}; "
                             "one balancer per device (one all-reduce each)")
        self.routers = routers
        self.all_reduce = all_reduce

    # -- buffer layout: subclasses fill self._slices[i] = {name: (offset, shape)}
    def _allocate(self, layouts: list[dict[str, tuple[int, ...]]]) -> None:
        self._slices: list[dict[str, tuple[int, tuple[int, ...]]]] = []
        offset = 0
        for layout in layouts:
            entry = {}
            for name, shape in layout.items():
                entry[name] = (offset, shape)
                offset += math.prod(shape)
            self._slices.append(entry)
        self._buffer = torch.zeros(offset, dtype=torch.int32, device=self.routers[0].expert_bias.device)

    def _view(self, index: int, name: str) -> torch.Tensor:
        offset, shape = self._slices[index][name]
        return self._buffer[offset:offset + math.prod(shape)].view(shape)

    @property
    def comm_bytes(self) -> int:
        """Bytes all-reduced per ``step()`` (one collective)."""
        return self._buffer.numel() * self._buffer.element_size()

    def loads(self, index: int) -> torch.Tensor:
        """Tokens routed to each expert of router ``index`` since the last step (local until ``step()``)."""
        return self._view(index, "loads")

    @torch.no_grad()
    def observe(self, routing: Sequence[RoutingStats | None]) -> None:
        """Add the routing statistics of one training forward (``K3Output.routing``: one entry per
        router of ``routers``, in that order; None for a router that did not run).

        Call it after every training-mode forward whose tokens should count (each micro-batch of
        gradient accumulation), before the next ``step()``; evaluation forwards are not observed.
        """
        if len(routing) != len(self.routers):
            raise ValueError(f"routing has {len(routing)} entries, the balancer {len(self.routers)} routers: "
                             "give the K3Output.routing of the model whose routers() the balancer was built on")
        for index, stats in enumerate(routing):   # all checked before anything is added
            if stats is not None and not isinstance(stats, RoutingStats):
                raise ValueError(f"routing[{index}] is a {type(stats).__name__}, not RoutingStats")
            if stats is not None:
                self._check(index, stats)
        if self._buffer.device != self.routers[0].expert_bias.device:  # the model was moved after construction
            self._buffer = self._buffer.to(self.routers[0].expert_bias.device)
        for index, stats in enumerate(routing):
            if stats is not None:
                self.loads(index).add_(stats.loads_E.to(torch.int32))
                self._observe(index, self.routers[index], stats)

    def _check(self, index: int, stats: RoutingStats) -> None:
        pass

    def _observe(self, index: int, router: Router, stats: RoutingStats) -> None:
        pass

    def _all_reduce(self) -> None:
        if self.all_reduce is not None:
            self.all_reduce(self._buffer)

    def _metric_values(self, change: torch.Tensor | None) -> torch.Tensor:
        """The metrics of the counts since the last step, on the device: [L ratios, L token counts, the largest
        bias change] (fp64; NaN change when there is none)."""
        ratios, tokens = [], []
        for index, router in enumerate(self.routers):
            loads_E = self.loads(index).double()
            ratios.append(loads_E.max() / loads_E.mean())  # NaN (0/0) for a router that saw nothing
            tokens.append(loads_E.sum() / router.top_k)
        last = (change.double().reshape(1) if change is not None
                else torch.full((1,), math.nan, dtype=torch.float64, device=self._buffer.device))
        return torch.cat([torch.stack(ratios), torch.stack(tokens), last])

    def metrics_of(self, values: torch.Tensor | Sequence[float]) -> dict:
        """``step_on_device``'s tensor (or its values, read already) as ``step()``'s metrics dict."""
        values_L = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        count = len(self.routers)
        ratio_L, tokens_L, change = values_L[:count], values_L[count:2 * count], values_L[-1]
        seen = [r for r in ratio_L if not math.isnan(r)]
        metrics = {
            "load_max_over_mean": ratio_L,
            "load_max_over_mean_mean": sum(seen) / len(seen) if seen else math.nan,
            "load_max_over_mean_max": max(seen) if seen else math.nan,
            "tokens": int(max(tokens_L)),
        }
        if not math.isnan(change):
            metrics["bias_update_max"] = change
        return metrics

    @torch.no_grad()
    def step(self) -> dict:
        """All-reduce the counts, update every bias, clear; returns metrics of the tokens since the last step.

        Metrics: ``load_max_over_mean`` (per router, max/mean expert load of those tokens under the
        biases they were routed with; NaN for a router that saw none), its ``_mean`` and ``_max``
        over routers, ``tokens`` (tokens seen, all ranks) and ``bias_update_max`` (largest
        |new - old| bias, score units).
        """
        return self.metrics_of(self.step_on_device())

    @torch.no_grad()
    def step_on_device(self, apply: torch.Tensor | None = None) -> torch.Tensor:
        """``step()`` without reading anything back to the host, so that it can be captured in a CUDA graph: the
        biases move only where ``apply`` (a bool tensor; None: always) is true, the counts are cleared either
        way. Returns the metrics as a tensor for ``metrics_of``."""
        self._all_reduce()
        values = self._metric_values(self._update_biases(apply))
        self._clear()
        return values

    def _update_biases(self, apply: torch.Tensor | None) -> torch.Tensor:
        """Set every router's bias from the counts, where ``apply``; returns the largest change (a tensor)."""
        raise NotImplementedError

    def discard(self) -> dict:
        """Drop what was accumulated since the last step without touching any bias (no communication).

        Returns the local metrics of the dropped window. Use after a skipped optimizer step.
        """
        metrics = self.metrics_of(self._metric_values(None))
        self._clear()
        return metrics

    def _clear(self) -> None:
        self._buffer.zero_()

    def remove(self) -> None:
        """Give the routers back their own settings (the biases keep their values)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class QuantileBalancer(_RouterBalancer):
    """Sets every router's ``expert_bias`` from histogram quantiles of the required biases, once per step.

    ``routers``: the model's routers (``K3ForCausalLM.routers()``), all on one device.
    ``num_bins``: B, bins per expert; resolution 2/B in score units (1000 -> 0.002), refined by
    interpolation. ``threshold``: ``"others"`` (default, exact) or ``"cutoff"`` (the torchtitan
    port's (K+1)-th score); see the module docstring. ``all_reduce``: sums a tensor in place over
    the ranks whose tokens are pooled (every rank that routes different tokens); None (default):
    this process's tokens alone.
    ``rate``: the fraction of the way to the quantile bias taken per step; 1.0 (default) is K3's
    one-shot update, right at K3's batch sizes; below 1 it averages the sampling noise of small
    batches (a few thousand tokens per step) over about 1/rate steps.
    ``keep_scores``: leave the scores, cutoffs and choices in the observed ``RoutingStats`` after
    binning (by default ``observe`` drops them: autograd holds the scores only until backward, and
    keeping them would hold L x T x E fp32 through backward and the optimizer step).

    The balancer sets each router's ``record_scores`` (``remove()`` restores it), so that
    training-mode forwards report the per-token scores it bins. Each observed forward (``observe``:
    each micro-batch of gradient accumulation) adds its tokens to every router's histogram; forwards
    not observed (evaluation, activation checkpointing's recomputation, which runs outside any
    record) add nothing. ``step()``, once per optimizer step and on every rank together,
    all-reduces the counts (the only communication), writes the new biases in place and clears the
    histograms. Routers with top_k == num_experts are left alone (everything is always chosen), and
    so is any router that saw no token since the last step. Biases must change only through
    ``step()`` between steps: each router's bin range is fixed at its first observation after a step.
    """

    def __init__(self, routers: Sequence[Router], num_bins: int = 1000, *, threshold: str = "others",
                 all_reduce: Callable[[torch.Tensor], None] | None = None, keep_scores: bool = False,
                 rate: float = 1.0):
        if not isinstance(num_bins, int) or num_bins < 2:
            raise ValueError(f"num_bins must be an int >= 2, got {num_bins!r}")
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"rate must be in (0, 1], got {rate!r}")
        self.rate = rate
        _check_threshold(threshold)
        super().__init__(routers, all_reduce=all_reduce)
        self.num_bins = num_bins
        self.threshold = threshold
        self.keep_scores = keep_scores
        self._allocate([{"histogram": (r.num_experts, num_bins) if r.top_k < r.num_experts else (0, num_bins),
                         "loads": (r.num_experts,)} for r in self.routers])
        self._ranges: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.routers)
        self._record_before = [r.record_scores for r in self.routers]
        for router in self.routers:
            router.record_scores = True

    def histogram(self, index: int) -> torch.Tensor:
        """Counts ``histogram_EB`` [E, B] int32 of router ``index`` since the last step (a view)."""
        return self._view(index, "histogram")

    def _range(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ranges[index] is None:
            router = self.routers[index]
            self._ranges[index] = bin_range(router.expert_bias, router.top_k, self.threshold)
        return self._ranges[index]

    def _check(self, index: int, stats: RoutingStats) -> None:
        if stats.scores_TE is None or stats.cutoff_T is None or stats.ids_TK is None:
            raise ValueError(f"routing[{index}] has no scores: QuantileBalancer observes training-mode forwards "
                             "of routers with record_scores on (it sets them; was remove() called, or is this an "
                             "eval-mode forward?)")

    def _observe(self, index: int, router: Router, stats: RoutingStats) -> None:
        ids_TK = stats.ids_TK
        if router.top_k < router.num_experts and stats.scores_TE.shape[0] > 0:
            low, high = self._range(index)
            histogram_EB = self.histogram(index)
            step = max(1, _MAX_CHUNK_ELEMENTS // router.num_experts)
            for start in range(0, stats.scores_TE.shape[0], step):
                rows = slice(start, start + step)
                required_TE = required_bias(stats.scores_TE[rows], stats.cutoff_T[rows], router.expert_bias,
                                            router.top_k, threshold=self.threshold, ids_TK=ids_TK[rows])
                accumulate_histogram(histogram_EB, required_TE, low, high)
        if not self.keep_scores:
            stats.drop_scores()

    def _update_biases(self, apply: torch.Tensor | None) -> torch.Tensor:
        changes = []
        for index, router in enumerate(self.routers):
            if router.top_k >= router.num_experts:
                continue
            histogram_EB = self.histogram(index)
            low, high = self._range(index)
            quantile_E = histogram_quantile(histogram_EB, low, high, router.top_k / router.num_experts)
            old_E = router.expert_bias
            seen = histogram_EB[0].sum() > 0
            if apply is not None:
                seen = seen & apply
            # torch.where, not an `if`, so a router that saw nothing costs no host sync.
            target_E = _centred(quantile_E).to(old_E.dtype)
            new_E = torch.where(seen, old_E + self.rate * (target_E - old_E), old_E)
            changes.append((new_E - old_E).abs().max())
            old_E.copy_(new_E)
        if not changes:
            return torch.zeros((), dtype=torch.float64, device=self._buffer.device)
        return torch.stack(changes).max()

    def _clear(self) -> None:
        super()._clear()
        self._ranges = [None] * len(self.routers)

    def remove(self) -> None:
        """Restore each router's ``record_scores`` (the biases keep their values)."""
        for router, before in zip(self.routers, self._record_before):
            router.record_scores = before


class SignBalancer(_RouterBalancer):
    """DeepSeek-V3's aux-loss-free balancing with the same interface as ``QuantileBalancer``.

    Each observed forward adds the expert loads; ``step()`` all-reduces them (E int32 per router,
    one collective, through ``all_reduce``) and applies ``sign_update`` with ``gamma`` to every
    router's bias.
    """

    def __init__(self, routers: Sequence[Router], gamma: float = 1e-3, *,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        if gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        super().__init__(routers, all_reduce=all_reduce)
        self.gamma = gamma
        self._allocate([{"loads": (r.num_experts,)} for r in self.routers])

    def _update_biases(self, apply: torch.Tensor | None) -> torch.Tensor:
        """Nudge every bias by +-gamma (where ``apply``); the change reported is gamma (0 where not applied)."""
        for index, router in enumerate(self.routers):
            loads_E = self.loads(index)
            if router.top_k < router.num_experts:
                seen = loads_E.sum() > 0
                if apply is not None:
                    seen = seen & apply
                router.expert_bias.copy_(torch.where(seen, sign_update(router.expert_bias, loads_E, self.gamma)
                                                     .to(router.expert_bias.dtype), router.expert_bias))
        gamma = torch.full((), self.gamma, dtype=torch.float64, device=self._buffer.device)  # a fill: capturable
        return gamma if apply is None else gamma * apply


__all__ = [
    "QuantileBalancer",
    "SignBalancer",
    "THRESHOLDS",
    "accumulate_histogram",
    "bin_range",
    "histogram_quantile",
    "load_imbalance",
    "quantile_bias_exact",
    "quantile_bias_histogram",
    "required_bias",
    "route_biased",
    "sign_update",
]
