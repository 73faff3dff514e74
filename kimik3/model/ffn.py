"""SiTU-GLU and the dense SiTU-GLU feed-forward (notes §4).

SiTU-GLU(g, u) = [b1·tanh(g/b1) ⊙ sigmoid(g)] ⊙ [b2·tanh(u/b2)], with b1 = 4 and b2 = 25, so
|out| < b1·b2 = 100 for any input, while near zero it is g·sigmoid(g)·u to first order: SwiGLU's
local response without its unbounded outliers.

The activation is computed in fp32 and cast back (``situ_glu_cast``): on CUDA one Triton kernel
(``kimik3.ops.glue.situ``, optionally times a per-row weight: the MoE mixture weights), elsewhere the torch code
below, its reference. The FFN's gate and up projections run as one matmul (``model/fused_linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from kimik3.model.fused_linear import project
from kimik3.ops.glue import glue_backend, situ_glu_fused

SITU_BETA_GATE = 4.0
SITU_BETA_UP = 25.0


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
    hidden = situ_glu(gate.float(), up.float())
    if row_weight is not None:
        hidden = hidden * row_weight[:, None]
    return hidden.to(out_dtype or gate.dtype)


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
