"""Quantisation-aware training of the routed experts (seed section 8): MXFP4 weights, MXFP8 (E4M3) inputs.

Every matmul of a routed expert sees its weight and its input as they will be stored and fed at inference: both
fake-quantised (``kimik3.quant.mx``: quantised, then decoded) in 32-element blocks along the matmul's reduction axis
(the axis a packed kernel reads a scale for). Gradients pass straight through the rounding (the straight-through
estimator): d fake_quantize(x) / dx is taken as 1, so the full-precision weights keep learning while the forward
sees only representable values. The SiTU-GLU between the two matmuls is not quantised; its output is the down
projection's input, quantised like the others.

    w = expert_weight(w_EIO)      # [E, in, out]: blocks along "in"
    x = expert_input(x_RI)        # [R, in]: blocks along "in"
"""

from __future__ import annotations

import torch

from kimik3.quant.mx import fake_quantize

WEIGHT_FORMAT = "mxfp4"
INPUT_FORMAT = "mxfp8_e4m3"


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, axis: int) -> torch.Tensor:
        return fake_quantize(x, fmt, axis=axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def fake_quantize_ste(x: torch.Tensor, fmt: str, axis: int = -1) -> torch.Tensor:
    """``fake_quantize`` forward, identity backward."""
    return _StraightThrough.apply(x, fmt, axis)


def expert_weight(w_EIO: torch.Tensor) -> torch.Tensor:
    """A stacked expert weight [E, in, out] (x @ W) as MXFP4 holds it: blocks along ``in``."""
    return fake_quantize_ste(w_EIO, WEIGHT_FORMAT, axis=-2)


def expert_input(x_RI: torch.Tensor) -> torch.Tensor:
    """An expert matmul's input rows [..., in] as MXFP8 E4M3 holds them: blocks along ``in``."""
    return fake_quantize_ste(x_RI, INPUT_FORMAT, axis=-1)
