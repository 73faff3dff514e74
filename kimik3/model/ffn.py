"""SiTU-GLU and the dense SiTU-GLU feed-forward (notes §4).

SiTU-GLU(g, u) = [b1·tanh(g/b1) ⊙ sigmoid(g)] ⊙ [b2·tanh(u/b2)], with b1 = 4 and b2 = 25, so
|out| < b1·b2 = 100 for any input, while near zero it is g·sigmoid(g)·u to first order: SwiGLU's
local response without its unbounded outliers.
"""

from __future__ import annotations

import torch
from torch import nn

SITU_BETA_GATE = 4.0
SITU_BETA_UP = 25.0


def situ_glu(gate: torch.Tensor, up: torch.Tensor,
             beta_gate: float = SITU_BETA_GATE, beta_up: float = SITU_BETA_UP) -> torch.Tensor:
    """Elementwise SiTU-GLU of the gate and up projections (any shape, same dtype out)."""
    soft_gate = beta_gate * torch.tanh(gate / beta_gate) * torch.sigmoid(gate)
    return soft_gate * (beta_up * torch.tanh(up / beta_up))


class GLUFeedForward(nn.Module):
    """Dense SiTU-GLU FFN: ``w_down(situ_glu(w_gate x, w_up x))``; activation in fp32."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = situ_glu(self.w_gate(x).float(), self.w_up(x).float()).to(x.dtype)
        return self.w_down(hidden)
