"""RMSNorm, computed in float32 and cast back, with a learnable weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.param_rules import ParamRule, adamw


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        return [("weight", adamw(False, "RMSNorm.weight"))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
