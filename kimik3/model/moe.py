"""Stable LatentMoE (notes §4): sigmoid router, latent routed experts, shared experts.

Legend: T = tokens (flattened batch), D = model width, E = routed experts, K = experts per token,
L = latent width, F = expert hidden width, R = routed rows (T x K, sorted by expert).

Routing (released numerics): router logits in fp32 -> sigmoid scores; the top-k is taken on
``scores + expert_bias`` but the mixture weights are the *unbiased* scores of the chosen experts,
normalised to sum to one (x route_scale). The bias therefore moves which experts are chosen,
never how much each chosen one counts. The router also takes the (k+1)-th biased score (the
cutoff a non-chosen expert would have to beat); ``cutoff - score`` is an expert's routing margin,
which Quantile Balancing (``kimik3.train.balance``) turns into the next bias.

Routed path: W_down (D -> L) -> experts (SiTU-GLU in fp32) -> weighted sum -> RMSNorm -> W_up
(L -> D). Shared experts run at full width on the same input and are added. The experts run over rows sorted by
expert as grouped matmuls; a few rows at inference on CUDA (serving decode) as two kernels without a sort
(``kimik3.ops.moe.small_batch``).

Routing statistics: every router call made while a ``RoutingRecord`` is open adds its
``RoutingStats`` (expert loads; with ``record_scores``, in training mode, also the scores, cutoffs
and choices Quantile Balancing bins) to that record. ``K3ForCausalLM`` opens one record per call
of the model and returns it on its output (``K3Output.routing``), so balancing and metrics read
the statistics of the forward they ran, and nothing stays behind on the modules. The record is
found through a context variable rather than passed down, because the blocks between the model
and its routers take no such argument; recomputation in backward (activation checkpointing) runs
after the record closed, and inside ``routing_discarded``, so each token is counted once. A router hands
its statistics to ``_report_routing``, which torch.compile runs after a compiled block's graph (a
reorderable logging function, given tensors only: the router is named by a key), so that reading the
record makes no graph break and the routers of all blocks share one compiled graph.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.model.ffn import GLUFeedForward, situ_glu_cast
from kimik3.model.fused_linear import project
from kimik3.model.norm import RMSNorm
from kimik3.model.param_rules import ParamRule, muon
from kimik3.ops.glue import glue_backend
from kimik3.ops.glue.common import through_operator
from kimik3.ops.moe import (SMALL_BATCH_MAX_ROWS, ExpertGroups, from_expert_rows, grouped_mm, grouped_mm_on_device,
                            inverse_permutation, mxfp4_grouped_mm, route_backend, routed_experts_small, sigmoid_topk,
                            to_expert_rows)
from kimik3.ops.moe.mxfp4_grouped_mm import mxfp4_mma_order
from kimik3.ops.moe.mxfp8_rows import expert_rows_mxfp8, situ_glu_mxfp8
from kimik3.ops.precision import no_autocast
from kimik3.quant.kernel_order import to_kernel_order
from kimik3.quant.mx import MXTensor, quantize
from kimik3.quant.qat import expert_input, expert_weight


@dataclass(slots=True)
class RoutingStats:
    """What one router call saw, for balancing and metrics (all detached).

    ``scores_TE``, ``cutoff_T`` and ``ids_TK`` are present only when the router records scores
    (``Router.record_scores``) and ran in training mode. A consumer done with them (Quantile
    Balancing, once it has binned them) calls ``drop_scores``, so that they are not held through
    backward.
    """

    loads_E: torch.Tensor                   # int64 tokens routed to each expert
    scores_TE: torch.Tensor | None = None   # fp32 sigmoid scores
    cutoff_T: torch.Tensor | None = None    # fp32 (k+1)-th biased score per token (-inf when K == E)
    ids_TK: torch.Tensor | None = None      # int64 chosen experts, best first

    def drop_scores(self) -> None:
        self.scores_TE = self.cutoff_T = self.ids_TK = None


class RoutingRecord:
    """The ``RoutingStats`` of every router call made while it is open (``with RoutingRecord() as r:``).

    A router called more than once inside one record has its calls merged: loads summed, per-token
    tensors concatenated in call order. Records nest; the innermost open one receives the calls.
    """

    def __init__(self) -> None:
        self._stats: dict[int, RoutingStats] = {}
        self._tokens: list[Token] = []

    def __enter__(self) -> Self:
        self._tokens.append(_OPEN_RECORD.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_RECORD.reset(self._tokens.pop())

    def add(self, router: Router, stats: RoutingStats) -> None:
        seen = self._stats.get(id(router))
        if seen is None:
            self._stats[id(router)] = stats
            return
        seen.loads_E = seen.loads_E + stats.loads_E
        for name in ("scores_TE", "cutoff_T", "ids_TK"):
            before, now = getattr(seen, name), getattr(stats, name)
            setattr(seen, name, torch.cat([before, now]) if before is not None and now is not None else None)

    def stats(self, routers: Sequence[Router]) -> tuple[RoutingStats | None, ...]:
        """One entry per router of ``routers``, in that order: what it saw, or None if it was not called."""
        return tuple(self._stats.get(id(router)) for router in routers)


_OPEN_RECORD: ContextVar[RoutingRecord | None] = ContextVar("kimik3_routing_record", default=None)


# Routers by their record key (``Router._record_key``): the report gets tensors, not modules.
_ROUTERS: weakref.WeakValueDictionary[int, "Router"] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _report_routing(key: torch.Tensor, loads_E: torch.Tensor, scores_TE: torch.Tensor | None,
                    cutoff_T: torch.Tensor | None, ids_TK: torch.Tensor | None) -> None:
    """One router call's statistics to the open ``RoutingRecord``, if any (``key``: the router's CPU key)."""
    record = _OPEN_RECORD.get()
    if record is None:
        return
    stats = RoutingStats(loads_E)
    if scores_TE is not None:
        stats.scores_TE, stats.cutoff_T, stats.ids_TK = scores_TE, cutoff_T, ids_TK
    record.add(_ROUTERS[int(key)], stats)


# A compiled block calls it after its graph, with the graph's tensors (no graph break, no guard on the record).
torch._dynamo.config.reorderable_logging_functions.add(_report_routing)


def routing_recorded() -> bool:
    """Whether a ``RoutingRecord`` is open: router calls made now report to it."""
    return _OPEN_RECORD.get() is not None


@contextmanager
def routing_discarded(recorded: bool) -> Iterator[None]:
    """Router calls made inside report to a record of their own that is then dropped (``recorded``), or to none,
    whatever is open outside: activation checkpointing's recomputation, whose tokens its forward counted
    already, and which runs the very ops of its forward (those of a recorded call when the forward's was)."""
    token = _OPEN_RECORD.set(RoutingRecord() if recorded else None)
    try:
        yield
    finally:
        _OPEN_RECORD.reset(token)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How often each expert id occurs in ``ids``: int64 [E]. A scatter-add, not ``torch.bincount``, whose CUDA
    version reads the largest id back to the host to size its output: the decode step must not wait on the host
    (it is replayed as a CUDA graph by the serving engine)."""
    flat = ids.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32 [T, E]. bf16 x and w on CUDA outside autograd (serving): one cuBLAS GEMM that accumulates
    and writes fp32 (``torch.mm``'s ``out_dtype``; a product of two bf16 values is exact in fp32, so this is the
    fp32 product of the upcast operands up to summation order), instead of upcasting both (two copy kernels, and at
    K3's width 26 MB written a layer) before an fp32 GEMM. Otherwise: upcast, then the fp32 GEMM."""
    if (x_TD.is_cuda and x_TD.ndim == 2 and x_TD.dtype == torch.bfloat16 and w_ED.dtype == torch.bfloat16
            and not (torch.is_grad_enabled() and (x_TD.requires_grad or w_ED.requires_grad))):
        return torch.mm(x_TD, w_ED.t(), out_dtype=torch.float32)
    return F.linear(x_TD.float(), w_ED.float())


class Router(nn.Module):
    """Sigmoid top-k router with a selection-only per-expert bias (a persistent fp32 buffer)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, route_scale: float = 1.0):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.route_scale = route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        # Set by Quantile Balancing: training-mode calls also report their scores, cutoffs and choices.
        self.record_scores = False
        self._new_record_key()

    def _new_record_key(self) -> None:
        """This router's key for ``_report_routing``: a CPU tensor (a plain attribute, so not moved with the model
        nor saved with it), unique to this instance."""
        key = next(_KEYS)
        self._record_key = torch.tensor(key, device="cpu")
        _ROUTERS[key] = self

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._new_record_key()   # a copy (copy.deepcopy, pickle) reports as a router of its own

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # The router gate [E, D] is a real linear map of the hidden state, and torchtitan's
        # kimi_k3 recipe leaves it in the catch-all Muon group as a whole matrix (its AdamW
        # patterns cover only norms, biases, A_log, dt_bias, embeddings, lm_head, AttnRes and
        # convs). Its rows are experts, not heads, and one expert's row alone is a vector, so
        # there is no per-block split to make: whole-matrix Muon.
        return [("gate.weight", muon(("whole",), "Router.gate"))]

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns fp32 mixture weights [T, K], int64 expert ids [T, K] and each expert's load (int64 [E], the
        rows it got); reports the call's ``RoutingStats`` to the open ``RoutingRecord``, if any."""
        with no_autocast(x_TD.device):  # router logits in fp32, as released
            logits_TE = router_logits(x_TD, self.gate.weight)
        if route_backend(logits_TE) == "triton":
            # One kernel: sigmoid, the biased top-(k+1), the normalised weights and the loads.
            weights_TK, ids_TK, cutoff_T, counts_E = sigmoid_topk(logits_TE, self.expert_bias, self.top_k,
                                                                  self.route_scale)
        else:
            weights_TK, ids_TK, cutoff_T, counts_E = self._select(logits_TE)
        if self.record_scores and self.training:
            _report_routing(self._record_key, counts_E, torch.sigmoid(logits_TE.detach()), cutoff_T, ids_TK)
        else:
            _report_routing(self._record_key, counts_E, None, None, None)
        return weights_TK, ids_TK, counts_E

    def _select(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selection in torch (the CPU path; ``kimik3.ops.moe.route`` fuses it): weights, ids, the (k+1)-th
        biased score (-inf when K == E) and the loads."""
        scores_TE = torch.sigmoid(logits_TE)
        biased_TE = scores_TE.detach() + self.expert_bias
        take = min(self.top_k + 1, self.num_experts)
        top_vals, top_ids = torch.topk(biased_TE, take, dim=-1, sorted=True)
        ids_TK = top_ids[:, : self.top_k]
        weights_TK = scores_TE.gather(-1, ids_TK)
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        cutoff_T = top_vals[:, self.top_k] if take > self.top_k else torch.full_like(top_vals[:, 0], float("-inf"))
        return weights_TK, ids_TK, cutoff_T, expert_counts(ids_TK, self.num_experts)


class RoutedExperts(nn.Module):
    """``num_experts`` SiTU-GLU experts stored as stacked 3-D weights, run as grouped matmuls."""

    def __init__(self, num_experts: int, latent_dim: int, hidden: int, quant: str | None = None):
        super().__init__()
        self.w_gate_ELF = nn.Parameter(torch.empty(num_experts, latent_dim, hidden))
        self.w_up_ELF = nn.Parameter(torch.empty(num_experts, latent_dim, hidden))
        self.w_down_EFL = nn.Parameter(torch.empty(num_experts, hidden, latent_dim))
        # ``K3Config.moe.expert_quant``: "mxfp4" runs every expert matmul on MXFP4 weights and MXFP8 inputs
        # (``kimik3.quant.qat``), in training and in every later forward alike.
        self.quant = quant
        self.packed: dict[str, MXTensor] | None = None   # ``pack_mxfp4``: the weights as codes + scales
        self.packed_gate_up: MXTensor | None = None   # gate and up packed as one [E, L, 2F] (``packed``'s are views)

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        # Stored [E, in, out] (x @ W); orthogonalisation and the max(m, n) scale do not care
        # about orientation, so no transpose is needed. One block per expert.
        return [(name, muon(("experts",), f"RoutedExperts.{name}"))
                for name in ("w_gate_ELF", "w_up_ELF", "w_down_EFL")]

    def forward(self, x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum over each token's experts: [T, L] -> [T, L]. ``counts_E``: the rows of each expert in
        ``ids_TK`` when the router counted them already."""
        if self.packed is not None:
            return self._packed_forward(x_TL, weights_TK, ids_TK, counts_E)
        num_tokens, top_k = ids_TK.shape
        if self.quant is None and self._few_rows(x_TL, num_tokens * top_k):
            # Serving decode: two kernels, no sort (each (token, expert) row reads its expert's weights).
            return routed_experts_small(x_TL, weights_TK, ids_TK, self.w_gate_ELF, self.w_up_ELF, self.w_down_EFL)
        order_R, inverse_R, groups = self._sort_rows(ids_TK, counts_E)
        x_RL = self._input(to_expert_rows(x_TL, order_R, inverse_R, top_k))
        w_gate, w_up = (self._weight(getattr(self, n), x_RL.dtype) for n in ("w_gate_ELF", "w_up_ELF"))
        gate_RF, up_RF = grouped_mm(x_RL, w_gate, groups), grouped_mm(x_RL, w_up, groups)
        # Mixture weights applied after the experts, in fp32, as released.
        hidden_RF = self._input(situ_glu_cast(gate_RF, up_RF, weights_TK.flatten()[order_R], x_RL.dtype))
        y_RL = grouped_mm(hidden_RF, self._weight(self.w_down_EFL, x_RL.dtype), groups)
        # Back to token order, then each token's K rows summed by one reduction (accumulated in fp32): the same
        # result on every run, unlike an atomic scatter-add, so a decode replayed as a graph matches it eagerly.
        return from_expert_rows(y_RL, order_R, inverse_R, top_k).sum(1)

    def _sort_rows(self, ids_TK: torch.Tensor, counts_E: torch.Tensor | None):
        """The (token, slot) rows sorted by expert: ``order_R`` (each row's flat (token, slot) index), its inverse,
        and the experts' ``ExpertGroups`` (from ``counts_E`` when the router counted them)."""
        flat_ids_R = ids_TK.flatten()
        order_R = torch.argsort(flat_ids_R, stable=True)
        counts_E = expert_counts(flat_ids_R, self.w_gate_ELF.shape[0]) if counts_E is None else counts_E
        return order_R, inverse_permutation(order_R), ExpertGroups.of(counts_E)

    @torch.compiler.disable   # (inference on packed weights: direct kernel launches, opaque to torch.compile)
    def _packed_forward(self, x_TL: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor,
                        counts_E: torch.Tensor | None) -> torch.Tensor:
        """``forward`` on the packed MXFP4 weights, the fake-quantised forward's values: gate and up as one matmul
        of 2F columns; with the kernels (CUDA) the rows gathered and fake-quantised to MXFP8 in one, the SiTU-GLU
        and the down matmul's MXFP8 input in one, both written in the Hopper kernel's k order where that kernel
        runs (``mxfp4_mma_order``), so it reads them as they are; on the CPU the same values by torch ops."""
        top_k = ids_TK.shape[1]
        num_experts, _, hidden = self.w_gate_ELF.shape
        order_R, inverse_R, groups = self._sort_rows(ids_TK, counts_E)
        kernels = glue_backend(x_TL) == "triton"
        mma = mxfp4_mma_order(order_R.numel(), num_experts, x_TL.dtype, x_TL.device)
        gate_up, down = self.packed_gate_up, self.packed["w_down_EFL"]
        if kernels:
            x_RL = expert_rows_mxfp8(x_TL, order_R, top_k, mma_order=mma)
        else:
            x_RL = expert_input(to_expert_rows(x_TL, order_R, inverse_R, top_k))
        gate_up_R2F = mxfp4_grouped_mm(x_RL, gate_up, groups, mma_order=mma)
        gate_RF, up_RF, row_weight_R = gate_up_R2F[:, :hidden], gate_up_R2F[:, hidden:], weights_TK.flatten()[order_R]
        if kernels:
            hidden_RF = situ_glu_mxfp8(gate_RF, up_RF, row_weight_R, mma_order=mma)
        else:
            hidden_RF = expert_input(situ_glu_cast(gate_RF, up_RF, row_weight_R, x_TL.dtype))
        y_RL = mxfp4_grouped_mm(hidden_RF, down, groups, mma_order=mma)
        return from_expert_rows(y_RL, order_R, inverse_R, top_k).sum(1)

    EXPERT_WEIGHTS = ("w_gate_ELF", "w_up_ELF", "w_down_EFL")

    @torch.no_grad()
    def pack_mxfp4(self) -> int:
        """Inference under ``quant == "mxfp4"``: store the three expert weights as MXFP4 codes + E8M0 scales
        (``self.packed``) and free the full-precision ones (they leave the module's parameters; meta tensors of
        their shapes remain: this module can no longer train). The matmuls then run ``mxfp4_grouped_mm`` on the
        packed weights, the values the fake-quantised forward multiplies by. Returns the packed weights' bytes."""
        if self.quant != "mxfp4":
            raise ValueError(f"pack_mxfp4 packs quantisation-aware experts (quant='mxfp4'), these have "
                             f"quant={self.quant!r}")
        if self.packed is None:
            self.use_packed({name: quantize(getattr(self, name).float(), "mxfp4", axis=-2)
                             for name in self.EXPERT_WEIGHTS})
        return sum(mx.nbytes for mx in self.packed.values())

    def use_packed(self, packed: dict[str, MXTensor]) -> None:
        """Take ``packed`` (``quantize(w, "mxfp4", axis=-2)`` of each expert weight, e.g. read from a checkpoint
        written with packed experts) as the weights, dropping the full-precision parameters. They are held with
        their codes in kernel order (``kimik3.quant.kernel_order``: what the GPU kernels read)."""
        if set(packed) != set(self.EXPERT_WEIGHTS):
            raise ValueError(f"packed expert weights must be {self.EXPERT_WEIGHTS}, got {sorted(packed)}")
        for name in self.EXPERT_WEIGHTS:
            weight = getattr(self, name)
            if packed[name].shape != tuple(weight.shape) or packed[name].fmt != "mxfp4":
                raise ValueError(f"{name}: packed as {packed[name].fmt} {packed[name].shape}, the layer holds "
                                 f"{tuple(weight.shape)}")
            self._parameters.pop(name, None)
            # The shape stays readable (the expert count, the widths); the values live in ``packed``.
            object.__setattr__(self, name, torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
        gate, up, down = (to_kernel_order(packed[name]) for name in self.EXPERT_WEIGHTS)
        E, L, F = gate.shape
        self._hold_packed(MXTensor(torch.cat([gate.codes, up.codes], 1), torch.cat([gate.scales, up.scales], 1),
                                   "mxfp4", gate.block_size, axis=1, shape=(E, L, 2 * F), order="kernel"), down)

    def move_packed(self, device: torch.device) -> None:
        """The packed weights onto ``device`` (gate and up stay one tensor)."""
        gate_up, down = self.packed_gate_up, self.packed["w_down_EFL"]
        self._hold_packed(*(dataclasses.replace(mx, codes=mx.codes.to(device), scales=mx.scales.to(device))
                            for mx in (gate_up, down)))

    def _hold_packed(self, gate_up: MXTensor, down: MXTensor) -> None:
        """``packed_gate_up`` and ``packed``, whose gate and up are views of its two halves (written through them,
        e.g. by a rollout's weight update, the matmul sees the change)."""
        E, L, F2 = gate_up.shape
        F = F2 // 2
        self.packed_gate_up = gate_up
        self.packed = {name: MXTensor(gate_up.codes[:, cols], gate_up.scales[:, cols], "mxfp4", gate_up.block_size,
                                      axis=1, shape=(E, L, F), order=gate_up.order)
                       for name, cols in (("w_gate_ELF", slice(0, F)), ("w_up_ELF", slice(F, F2)))}
        self.packed["w_down_EFL"] = down

    def _weight(self, w_EIO: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An expert weight as the matmuls take it: in ``dtype``, MXFP4 values under ``quant``."""
        return (expert_weight(w_EIO) if self.quant is not None else w_EIO).to(dtype)

    def _input(self, x_RI: torch.Tensor) -> torch.Tensor:
        """An expert matmul's input rows: MXFP8 values under ``quant``."""
        return expert_input(x_RI) if self.quant is not None else x_RI

    def _few_rows(self, x_TL: torch.Tensor, rows: int) -> bool:
        """Whether the rows go through ``routed_experts_small``: CUDA, eager inference (a direct Triton launch, as
        the glue ops make where ``through_operator`` says no: nothing needs a gradient, torch.compile not tracing),
        and either at most ``SMALL_BATCH_MAX_ROWS`` (token, expert) rows or a dtype ``grouped_mm`` can only loop over
        on the host (fp32: the loop reads the group sizes, which a serving CUDA graph cannot capture; these kernels
        take any number of rows without a sync). Otherwise the sorted rows and grouped matmuls."""
        return (glue_backend(x_TL) == "triton" and not through_operator(x_TL, self.w_gate_ELF)
                and (rows <= SMALL_BATCH_MAX_ROWS or not grouped_mm_on_device(x_TL, self.w_gate_ELF)))


class LatentMoE(nn.Module):
    """Stable LatentMoE layer: [..., D] -> [..., D]."""

    def __init__(self, config: K3Config):
        super().__init__()
        m = config.moe
        self.router = Router(config.dim, m.num_experts, m.top_k, m.route_scale)
        self.routed_down = nn.Linear(config.dim, m.latent_dim, bias=False)
        self.experts = RoutedExperts(m.num_experts, m.latent_dim, m.expert_hidden, m.expert_quant)
        self.routed_norm = RMSNorm(m.latent_dim, config.norm_eps)
        self.routed_up = nn.Linear(m.latent_dim, config.dim, bias=False)
        self.shared = GLUFeedForward(config.dim, m.shared_total_hidden) if m.num_shared_experts else None

    @property
    def _inputs(self) -> list[nn.Linear]:
        """The bf16 projections of the layer's input, run as one matmul (``kimik3.model.fused_linear``): the
        latent down-projection and the shared experts' gate and up (the router's stays apart: fp32)."""
        return [self.routed_down] + ([self.shared.w_gate, self.shared.w_up] if self.shared is not None else [])

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [self._inputs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        weights_TK, ids_TK, counts_E = self.router(x_TD)
        projected = project(x_TD, self._inputs)
        routed_TL = self.experts(projected[0], weights_TK, ids_TK, counts_E=counts_E)
        out_TD = self.routed_up(self.routed_norm(routed_TL))
        if self.shared is not None:
            out_TD = out_TD + self.shared.from_projections(projected[1], projected[2])
        return out_TD.reshape(shape)
