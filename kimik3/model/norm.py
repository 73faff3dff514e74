"""RMSNorm, computed in float32 and cast back, with a learnable weight.

On CUDA it runs as one fused Triton kernel (``kimik3.ops.glue.rmsnorm``: same fp32 math, one launch forward, two
backward); elsewhere ``rms_norm_torch``, torch ops with a hand-written backward (``glue_backend`` chooses).
``F.rms_norm`` is the reference of both (tests).
"""

from __future__ import annotations

import torch
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
        return rms_norm_torch(x, self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """``F.rms_norm(x, (D,), weight, eps)`` over the last dim in fp32 (fp64 when x or weight is fp64), in
    ``out_dtype`` (default x's), differentiable through a hand-written backward. Autograd through ``F.rms_norm``
    keeps and walks about ten full-size intermediates; this saves the normalised rows x r and r, and its backward is
    five passes over [..., D]:  dw = sum over rows of g x r,  dx = r (g w - x r mean(g w x r))."""
    return _RMSNormTorch.apply(x, weight, float(eps), out_dtype or x.dtype)


class _RMSNormTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        ct = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
        xf, wf = x.to(ct), weight.to(ct)
        # sum(x^2) in one pass (a norm), squared back: one rounding away from mean(x^2) in two
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        xn = xf * r
        ctx.save_for_backward(xn, r, wf)
        ctx.dtypes = x.dtype, weight.dtype
        return (xn * wf).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_y):
        xn, r, wf = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = grad_y.to(xn.dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * xn).reshape(-1, xn.shape[-1]).sum(0).to(w_dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = g * wf
            mean = (gw * xn).mean(-1, keepdim=True)
            grad_x = torch.addcmul(gw, xn, mean, value=-1).mul_(r).to(x_dtype)
        return grad_x, grad_w, None, None
