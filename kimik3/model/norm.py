"""RMSNorm, computed in float32 and cast back, with a learnable weight.

On CUDA it runs as one fused Triton kernel (``kimik3.ops.glue.rmsnorm``: same fp32 math, one launch forward, two
backward); the torch line below is its reference and the CPU path (``glue_backend`` chooses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimik3.model.param_rules import ParamRule, adamw
from kimik3.ops.glue import glue_backend, rms_norm


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, in fp32."""

    backend = "auto"  # as ``glue_backend``: "auto" (Triton on CUDA), "triton" or "torch"; settable per instance

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def optimizer_rules(self) -> list[tuple[str, ParamRule]]:
        return [("weight", adamw(False, "RMSNorm.weight"))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if glue_backend(x, self.backend) == "triton":
            return rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
