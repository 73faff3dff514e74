"""The Kimi Delta Attention layer (notes §2; numerics as released, DESIGN.md).

Legend: B = batch, T = tokens, D = model width, H = heads, K = V = head dim, R = gate rank.

x -> q, k, v projections -> causal depthwise conv (width 4) -> SiLU; q, k L2-normalised with
x / sqrt(sum x^2 + 1e-6); forget gate g = g_min * sigmoid(exp(A_log) * (f + dt_bias)) with the
low-rank f = forget_b(forget_a(x)), so g is in (g_min, 0) = (-5, 0); beta = sigmoid(Linear(x))
in fp32; the delta-rule recurrence (``kimik3.ops.kda``); per-head RMSNorm (fp32, eps 1e-5,
weighted) times sigmoid(output_gate(x)); output projection. The six projections of x run as one matmul
(``model/fused_linear.py``).

Context parallelism (``kimik3.parallel.kcp``) enters through one seam, ``KDA.context_parallel``: the two steps
that read earlier tokens (the short conv's left context and the recurrence's incoming state) ask it when set.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from kimik3.config.schema import K3Config
from kimik3.model.cache import KDAState
from kimik3.model.conv import apply_short_conv, conv_state_at, short_conv_step, short_conv_steps
from kimik3.model.fused_linear import project
from kimik3.model.norm import rms_norm_torch
from kimik3.model.param_rules import ParamRule, adamw, muon
from kimik3.ops.glue import gated_rms_norm, glue_backend
from kimik3.ops.kda import chunk_kda, kda_decode
from kimik3.ops.kda.verify import kda_verify


# The raw gate and beta logit of a padding token: sigmoid gives exactly 0, so its decay is exp(0) = 1 and its
# write beta is 0 - the recurrence passes the state through unchanged (finite: no inf arithmetic in the kernels).
PAD_LOGIT = -1e30


def gated_output_norm(o_BTHV: torch.Tensor, gate_BTHV: torch.Tensor, weight_V: torch.Tensor, eps: float,
                      out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """The layer's output before o_proj: per-head RMSNorm of o (fp32, weighted) times sigmoid(gate), cast to
    ``out_dtype``. On CUDA one Triton kernel (``kimik3.ops.glue.gated_norm``); the torch lines are its reference.
    ``backend``: as ``glue_backend``."""
    if glue_backend(o_BTHV, backend) == "triton":
        return gated_rms_norm(o_BTHV, gate_BTHV, weight_V, eps, out_dtype)
    normed = rms_norm_torch(o_BTHV, weight_V, eps, torch.float32)
    return (normed * torch.sigmoid(gate_BTHV.float())).to(out_dtype)


class KDAContextParallel(Protocol):
    """What a KDA layer asks when its sequences are split into contiguous segments over several ranks and it
    holds one segment (``kimik3.parallel.kcp`` implements it). Everything else in the layer is per token."""

    def conv_state(self, x_BTC: torch.Tensor, width: int) -> torch.Tensor | None:
        """The W-1 conv inputs just before this segment, [B, C, W-1] in x's dtype (None: zeros), given this
        segment's conv inputs x_BTC [B, T, C] and the kernel width W."""

    def chunk_kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  **options) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``kimik3.ops.kda.chunk_kda`` on this segment (same arguments and returns), entered with the state
        the earlier segments leave."""


class KDA(nn.Module):
    """KDA token mixer: [B, T, D] -> [B, T, D], optionally continuing a ``KDAState``.

    ``context_parallel``: None (the default) when the layer sees whole sequences; a ``KDAContextParallel``
    when it holds one segment of each (then it takes no state and no ``cu_seqlens``).
    """

    context_parallel: KDAContextParallel | None = None

    def __init__(self, config: K3Config):
        super().__init__()
        self.num_heads = config.kda.num_heads
        self.head_dim = config.kda_head_dim
        self.g_min = config.kda.g_min
        self.chunk_size = config.kda.chunk_size
        d, proj, rank = config.dim, self.num_heads * self.head_dim, config.kda_gate_rank
        self.q_proj = nn.Linear(d, proj, bias=False)
        self.k_proj = nn.Linear(d, proj, bias=False)
        self.v_proj = nn.Linear(d, proj, bias=False)
        # One depthwise kernel per channel of q, k and v: [3·H·K, W] stored as three parameters.
        self.q_conv = nn.Parameter(torch.empty(proj, config.kda.conv_kernel))
        self.k_conv = nn.Parameter(torch.empty(proj, config.kda.conv_kernel))
        self.v_conv = nn.Parameter(torch.empty(proj, config.kda.conv_kernel))
        self.forget_a = nn.Linear(d, rank, bias=False)
        self.forget_b = nn.Linear(rank, proj, bias=False)
        self.beta_proj = nn.Linear(d, self.num_heads, bias=False)
        self.output_gate = nn.Linear(d, proj, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, self.head_dim))
        self.output_norm_weight = nn.Parameter(torch.empty(self.head_dim))
        self.norm_eps = config.kda.norm_eps
        self.o_proj = nn.Linear(proj, d, bias=False)

    @property
    def _inputs(self) -> list[nn.Linear]:
        """The projections of the layer's input, in the order of their outputs in the one matmul that computes
        them (``kimik3.model.fused_linear``)."""
        return [self.q_proj, self.k_proj, self.v_proj, self.forget_a, self.beta_proj, self.output_gate]

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [self._inputs]

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        """Per-head Muon on the head-major projections, AdamW on the rest (``model/param_rules.py``)."""
        rows, cols = ("rows", self.num_heads), ("cols", self.num_heads)
        return [
            # Output features are head-major ([H*K, .]): one row block per head.
            *((f"{proj}.weight", muon(rows, f"KDA.{proj}"))
              for proj in ("q_proj", "k_proj", "v_proj", "output_gate", "forget_b")),
            ("o_proj.weight", muon(cols, "KDA.o_proj")),        # input features are head-major
            ("forget_a.weight", muon(("whole",), "KDA.forget_a")),  # D -> gate rank: no head axis
            # One row per head ([H, D]): a per-head block would be a single vector, whose
            # "orthogonalisation" is just sign(g) normalised; AdamW handles it better.
            ("beta_proj.weight", adamw(True, "KDA.beta_proj")),
            *((conv, adamw(True, f"KDA.{conv}")) for conv in ("q_conv", "k_conv", "v_conv")),  # [C, W] kernels
            # Gate offsets and decay rates set the operating point of the forget gate; decaying
            # them towards zero would change the function, not just limit capacity.
            ("A_log", adamw(False, "KDA.A_log")),
            ("dt_bias", adamw(False, "KDA.dt_bias")),
            ("output_norm_weight", adamw(False, "KDA.output_norm_weight")),
        ]

    def forward(self, x_BTD: torch.Tensor, state: KDAState | None = None,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = x_BTD.shape
        heads, head_dim = self.num_heads, self.head_dim
        split = self.context_parallel
        if split is not None and (state is not None or cu_seqlens is not None):
            raise ValueError("KDA: a context-parallel layer runs one segment of unpacked sequences: it takes "
                             "neither a cache state nor packed cu_seqlens")

        proj = heads * head_dim
        qkv_BTC, forget_a_BTR, beta_logit_BTH, gate_BTX = project(
            x_BTD, self._inputs, [3 * proj, self.forget_a.out_features, heads, proj])
        convs = (self.q_conv, self.k_conv, self.v_conv)
        if state is not None and state.stepwise:
            o_BTHV = self._stepwise(state, qkv_BTC, forget_a_BTR, beta_logit_BTH)
            out = gated_output_norm(o_BTHV, gate_BTX.unflatten(-1, (heads, head_dim)), self.output_norm_weight,
                                    self.norm_eps, x_BTD.dtype)
            return self.o_proj(out.reshape(batch, length, heads * head_dim))
        one_token = state is not None and length == 1
        # A padded multi-token chunk: the real tokens of each row (the rest must leave the state as they find it).
        valid_B = state.valid_B if state is not None and not one_token else None
        if one_token:
            # In place in the state's conv rows (one kernel on CUDA: nothing gathered, nothing scattered).
            qkv_BTC = state.conv_step_in_place(
                lambda pool_PCW, rows_B: short_conv_step(qkv_BTC[:, 0], convs, pool_PCW, rows_B))[:, None]
        else:
            if split is not None:
                conv_in = split.conv_state(qkv_BTC, self.q_conv.shape[1])
            else:
                conv_in = state.conv_inputs() if state is not None else None
            conv_x_BTC = qkv_BTC
            qkv_BTC, conv_state = apply_short_conv(qkv_BTC, convs, conv_in, cu_seqlens)
            if state is not None:
                if valid_B is not None:   # the inputs before the first padding token
                    conv_state = conv_state_at(conv_x_BTC, conv_in, valid_B, self.q_conv.shape[1])
                state.set_conv(conv_state)
        q_BTHK, k_BTHK, v_BTHV = (t.unflatten(-1, (heads, head_dim)) for t in qkv_BTC.chunk(3, dim=-1))
        raw_gate_BTHK = self.forget_b(forget_a_BTR).unflatten(-1, (heads, head_dim))
        if valid_B is not None:
            pad_BT = torch.arange(length, device=x_BTD.device)[None, :] >= valid_B[:, None]
            raw_gate_BTHK = raw_gate_BTHK.masked_fill(pad_BT[:, :, None, None], PAD_LOGIT)
            beta_logit_BTH = beta_logit_BTH.masked_fill(pad_BT[:, :, None], PAD_LOGIT)

        preacts = self._preacts()
        if one_token:
            o_BTHV = self._one_token(state, q_BTHK, k_BTHK, v_BTHV, raw_gate_BTHK, beta_logit_BTH, preacts)
        else:
            # The q/k L2 norm, the bounded gate and the beta sigmoid go into the op (same math as
            # l2_normalize / bounded_gate / sigmoid on the torch path; fused into the Triton kernels).
            recurrence = chunk_kda if split is None else split.chunk_kda
            o_BTHV, final = recurrence(q_BTHK, k_BTHK, v_BTHV, raw_gate_BTHK, beta_logit_BTH,
                                       initial_state=state.recurrent() if state is not None else None,
                                       output_final_state=state is not None, cu_seqlens=cu_seqlens,
                                       lower_bound=self.g_min, **preacts)
            if state is not None:
                state.set_recurrent(final)

        out = gated_output_norm(o_BTHV, gate_BTX.unflatten(-1, (heads, head_dim)), self.output_norm_weight,
                                self.norm_eps, x_BTD.dtype)
        return self.o_proj(out.reshape(batch, length, heads * head_dim))

    def _preacts(self) -> dict:
        return {"A_log": self.A_log, "dt_bias": self.dt_bias, "use_gate_in_kernel": True,
                "use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True}

    def _stepwise(self, state: KDAState, qkv_BTC: torch.Tensor, forget_a_BTR: torch.Tensor,
                  beta_logit_BTH: torch.Tensor) -> torch.Tensor:
        """A verification forward (``KDAState.stepwise``): the row's T tokens continue its pooled state, and the
        state after each token is recorded (conv inputs and recurrent state) instead of written back: the conv in
        ``short_conv_steps``, the recurrence in ``kda_verify`` (one kernel each on CUDA). Returns o [B, T, H, V].
        """
        heads, head_dim = self.num_heads, self.head_dim
        conv_BTC = short_conv_steps(qkv_BTC, (self.q_conv, self.k_conv, self.v_conv), state.conv_pool_PCW,
                                    state.slots_B, state.steps_conv_TBCW)
        q_BTHK, k_BTHK, v_BTHV = (x.unflatten(-1, (heads, head_dim)) for x in conv_BTC.chunk(3, dim=-1))
        raw_gate_BTHK = self.forget_b(forget_a_BTR).unflatten(-1, (heads, head_dim))
        return kda_verify(q_BTHK, k_BTHK, v_BTHV, raw_gate_BTHK, beta_logit_BTH, state.pool_PHKV, state.slots_B,
                          state.steps_TBHKV, g_min=self.g_min, **self._preacts())

    def _one_token(self, state: KDAState, q_BTHK: torch.Tensor, k_BTHK: torch.Tensor, v_BTHV: torch.Tensor,
                   raw_gate_BTHK: torch.Tensor, beta_logit_BTH: torch.Tensor, preacts: dict) -> torch.Tensor:
        """One token for every sequence: ``kda_decode`` advances each recurrent state in place wherever the state
        object keeps it (the Triton kernel on CUDA, the torch path elsewhere), from the raw gate, q / k and beta
        logit."""
        o_BHV = state.advance_in_place(
            lambda states_PHKV, rows_B: kda_decode(q_BTHK[:, 0], k_BTHK[:, 0], v_BTHV[:, 0], raw_gate_BTHK[:, 0],
                                                   beta_logit_BTH[:, 0], states_PHKV, rows_B, g_min=self.g_min,
                                                   **preacts))
        return o_BHV[:, None]
