"""SiTU-GLU and the dense SiTU-GLU feed-forward (notes §4).

SiTU-GLU(g, u) = [b1·tanh(g/b1) ⊙ sigmoid(g)] ⊙ [b2·tanh(u/b2)], with b1 = 4 and b2 = 25, so
|out| < b1·b2 = 100 for any input, while near zero it is g·sigmoid(g)·u to first order: SwiGLU's
local response without its unbounded outliers.

The activation is computed in fp32 and cast back (``situ_glu_cast``): on CUDA one Triton kernel
(``kimik3.ops.glue.situ``, optionally times a per-row weight: the MoE mixture weights), elsewhere torch ops with
a hand-written backward over row chunks (``situ_glu_chunked``). ``situ_glu_reference`` (``situ_glu`` through
autograd) is the reference of both. The FFN's gate and up projections run as one matmul (``model/fused_linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.fused_linear import project
from kimik3.model.row_chunks import row_chunks
from kimik3.ops.glue import glue_backend, situ_glu_fused

SITU_BETA_GATE = 4.0
SITU_BETA_UP = 25.0
SITU_BOUND = SITU_BETA_GATE * SITU_BETA_UP   # |out| < 100: the product of the two tanh scales


def situ_glu(gate: torch.Tensor, up: torch.Tensor,
             beta_gate: float = SITU_BETA_GATE, beta_up: float = SITU_BETA_UP) -> torch.Tensor:
    """Elementwise SiTU-GLU of the gate and up projections (any shape, same dtype out)."""
    soft_gate = beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate)
    return soft_gate * (beta_up * torch.tanh(up / beta_up))


def situ_glu_cast(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """``situ_glu`` of gate and up [..., F] in fp32, times ``row_weight`` [R] (fp32, one per row of the flattened
    leading dims) when given, cast to ``out_dtype`` (default: gate's). ``backend``: as ``glue_backend``."""
    if glue_backend(gate, backend) == "triton":
        return situ_glu_fused(gate, up, row_weight, out_dtype)
    return situ_glu_chunked(gate, up, row_weight, out_dtype)


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``situ_glu_cast`` as the formula reads, through autograd (the tests' reference)."""
    hidden = situ_glu(gate.float(), up.float())
    if row_weight is not None:
        hidden = hidden * row_weight.reshape(*gate.shape[:-1], 1)
    return hidden.to(out_dtype or gate.dtype)


def situ_glu_chunked(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``situ_glu_reference``'s values and gradients, computed a chunk of rows at a time (``row_chunks``: a
    chunk's passes stay in a core's cache) with a hand-written backward. With t = tanh(gate / 4),
    s = sigmoid(gate), v = tanh(up / 25) (saved) and out = 100 t s v w:

        d up = g 100 w t s (1 - v^2) / 25,   d gate = g 100 w v s ((1 - t^2) / 4 + t (1 - s)),
        d w = 100 sum_f g t s v.

    Without a gradient to compute (inference) it is the formula itself: the Function's saved tensors would be
    written for nothing."""
    inputs = (gate, up) if row_weight is None else (gate, up, row_weight)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return situ_glu_reference(gate, up, row_weight, out_dtype)
    return _SituGLUChunked.apply(gate, up, row_weight, out_dtype or gate.dtype)


class _SituGLUChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, row_weight, out_dtype):
        shape, F = gate.shape, gate.shape[-1]
        gate_RF, up_RF = gate.reshape(-1, F), up.reshape(-1, F)
        w_R = row_weight.reshape(-1).float() if row_weight is not None else None
        R = gate_RF.shape[0]
        out = torch.empty(R, F, dtype=out_dtype, device=gate.device)
        t, s, v = (torch.empty(R, F, dtype=torch.float32, device=gate.device) for _ in range(3))
        for rows in row_chunks(R, F):
            g = gate_RF[rows].float()
            torch.tanh(g / SITU_BETA_GATE, out=t[rows])
            torch.sigmoid(g, out=s[rows])
            torch.tanh(up_RF[rows].float() / SITU_BETA_UP, out=v[rows])
            h = (t[rows] * s[rows]).mul_(v[rows])
            out[rows] = h.mul_(w_R[rows, None] * SITU_BOUND if w_R is not None else SITU_BOUND)
        ctx.save_for_backward(t, s, v, w_R)
        ctx.meta = shape, gate.dtype, up.dtype, (row_weight.shape, row_weight.dtype) if row_weight is not None \
            else None
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        t, s, v, w_R = ctx.saved_tensors
        shape, gate_dtype, up_dtype, w_meta = ctx.meta
        R, F = t.shape
        need_gate, need_up, need_w = ctx.needs_input_grad[:3]
        grad_RF = grad.reshape(R, F)
        d_gate = torch.empty(R, F, dtype=gate_dtype, device=t.device) if need_gate else None
        d_up = torch.empty(R, F, dtype=up_dtype, device=t.device) if need_up else None
        d_w = torch.empty(R, dtype=torch.float32, device=t.device) if need_w else None
        for rows in row_chunks(R, F):
            g = grad_RF[rows].float()
            ts = t[rows] * s[rows]
            if need_w:
                torch.linalg.vecdot(g, ts * v[rows], out=d_w[rows])
                d_w[rows] *= SITU_BOUND
            gw = g * (w_R[rows, None] * SITU_BOUND) if w_R is not None else g * SITU_BOUND
            if need_up:   # gw t s (1 - v^2) / 25
                d_up[rows] = torch.addcmul(torch.ones_like(ts), v[rows], v[rows], value=-1).mul_(ts).mul_(gw) \
                    .div_(SITU_BETA_UP)
            if need_gate:   # gw v s ((1 - t^2) / 4 + t - t s)
                inner = torch.addcmul(torch.ones_like(ts), t[rows], t[rows], value=-1).div_(SITU_BETA_GATE)
                d_gate[rows] = inner.add_(t[rows]).sub_(ts).mul_(s[rows]).mul_(v[rows]).mul_(gw)
        return (d_gate.reshape(shape) if need_gate else None, d_up.reshape(shape) if need_up else None,
                d_w.reshape(w_meta[0]).to(w_meta[1]) if need_w else None, None)


class GLUFeedForward(nn.Module):
    """Dense SiTU-GLU FFN: ``w_down(situ_glu(w_gate x, w_up x))``; activation in fp32."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.w_gate, self.w_up]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, [self.w_gate, self.w_up])
        return self.from_projections(gate, up)

    def from_projections(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The FFN's output given its gate and up projections (computed by a caller that fused them with its
        own)."""
        return self.w_down(situ_glu_cast(gate, up))
