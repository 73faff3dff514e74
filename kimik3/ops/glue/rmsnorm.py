"""RMSNorm (``kimik3.model.norm.RMSNorm``) in one Triton kernel forward and two backward.

Per row of width D, in fp32 (as released): r = rsqrt(mean(x^2) + eps), y = (x r) * weight, stored in x's dtype
(the weight multiply in fp32, before the cast). The module's unfused form is ~4 launches (x.float(),
weight.float(), rms_norm, .to()); here one program per block of rows reads x once in its dtype, keeps the row in
registers and writes y once.

Backward, per row with g = dL/dy:  dx = r (g w - x r^2 (g w . x) / D),  dw = sum over rows of g x r. One kernel
writes dx and per-program partial sums of dw (its G programs each walk a run of row blocks in a pipelined loop,
``common.row_chunks``), one (``common.reduce_partials``) adds the partials in a fixed order and writes dw in the
weight's dtype.

Shapes decide everything at launch (no host sync). The torch reference, and the CPU path, is ``RMSNorm``'s own
code; ``glue_backend`` makes the choice.

Legend: B batch, T tokens, D width, R = B * T rows (all leading dims), G backward programs.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import (
    WIDE_REDUCE,
    _jit,
    blocks,
    check_eps,
    check_float,
    check_param,
    check_triton_device,
    check_width,
    compute_f64,
    describe,
    on_device,
    pipeline_stages,
    reduce_partials,
    row_chunks,
    rows_2d,
    tl,
    triton,
    through_operator,
)

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_forward"]


def _check(x, weight, eps) -> float:
    check_float(x, "x")
    check_width(x.shape[-1], "rms_norm")
    check_param(weight, x.shape[-1], x.device, "weight")
    check_triton_device(x, "rms_norm")
    return check_eps(eps)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = RMSNorm(x) * weight in one launch, forward only. Arguments as ``rms_norm``."""
    eps = _check(x, weight, eps)
    x2 = rows_2d(x)
    R, D = x2.shape
    y = torch.empty(R, D, dtype=x.dtype, device=x.device)
    if R == 0:
        return y.view(x.shape)
    w = weight.contiguous()
    block_r, block_d, num_warps = blocks(R, D)
    with on_device(x.device):
        _rmsnorm_fwd_kernel[(triton.cdiv(R, block_r),)](
            x2, x2.stride(0), w, y, R, D, eps,
            BLOCK_R=block_r, BLOCK_D=block_d, F64=compute_f64(x2, w), num_warps=num_warps,
        )
    return y.view(x.shape)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad_y: torch.Tensor,
                      *, programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype and shape, dweight in the weight's dtype). grad_y: like x. Two launches; ``programs``
    caps G (``common.row_chunks``)."""
    eps = _check(x, weight, eps)
    if not isinstance(grad_y, torch.Tensor) or grad_y.shape != x.shape:
        raise ValueError(f"grad_y must have x's shape {tuple(x.shape)}, got {describe(grad_y)}")
    if grad_y.device != x.device:
        raise ValueError(f"grad_y is on {grad_y.device} but x on {x.device}")
    x2, g2 = rows_2d(x), rows_2d(grad_y)
    R, D = x2.shape
    w = weight.contiguous()
    f64 = compute_f64(x2, w, g2)
    dx = torch.empty(R, D, dtype=x.dtype, device=x.device)
    block_r, block_d, num_warps = blocks(R, D)
    iters, G = row_chunks(triton.cdiv(R, block_r), x.device, programs)
    partial = torch.empty(G, D, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if R == 0:
        partial.zero_()
    else:
        stages = pipeline_stages(block_r * block_d * (x2.element_size() + g2.element_size()))
        with on_device(x.device):
            _rmsnorm_bwd_kernel[(G,)](
                x2, x2.stride(0), g2, g2.stride(0), w, dx, partial, R, D, eps,
                ITERS=iters, BLOCK_R=block_r, BLOCK_D=block_d, F64=f64, STAGES=stages, num_warps=num_warps,
            )
    return dx.view(x.shape), reduce_partials(partial, weight, None, f64, **WIDE_REDUCE)


@torch.library.custom_op("kimik3::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_forward(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("kimik3::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(x, weight, eps, grad_y)


@_rms_norm_backward_op.register_fake
def _(x, weight, eps, grad_y):
    return x.new_empty(x.shape), torch.empty_like(weight)


def _setup_grads(ctx, inputs, output) -> None:
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _grads(ctx, grad_y):
    x, weight = ctx.saved_tensors
    return (*_rms_norm_backward_op(x, weight, ctx.eps, grad_y), None)


_rms_norm_op.register_autograd(_grads, setup_context=_setup_grads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in the Triton kernels, differentiable -> [..., D] in x's dtype.

    x: [..., D] fp32, bf16, fp16 or fp64, any strides. weight: [D], any float dtype (its grad in it). eps: a
    Python float. Math in fp32 (fp64 when x or weight is fp64). CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1 (no dispatch here: ``glue_backend`` and ``RMSNorm`` choose). Forward: one launch;
    backward: two. A custom operator (``kimik3::rms_norm``): torch.compile traces around it.
    """
    if not through_operator(x, weight):
        return rms_norm_forward(x, weight, eps)
    return _rms_norm_op(x, weight, check_eps(eps))


@_jit
def _rmsnorm_fwd_kernel(
    x_ptr, s_x, w_ptr, y_ptr, R, D, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Program (row block): y[rows] = (x r) * w, stored contiguous [R, D] in y's dtype."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < R)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * s_x + cols[None, :], mask=mask, other=0.0).to(ct)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = (x * r[:, None]) * w[None, :]
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _rmsnorm_bwd_kernel(
    x_ptr, s_x, g_ptr, s_g, w_ptr, dx_ptr, part_ptr, R, D, eps,
    ITERS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr, STAGES: tl.constexpr,
):
    """Program p of G: the ITERS row blocks from p ITERS on (those past R masked off), in a loop pipelined over
    STAGES stages; writes dx for them and its partial sum of dw = sum g x r to part_ptr[p] ([G, D], fp32 or fp64).
    The loads clamp their rows to R - 1 instead of masking them (loop-invariant masks: the pipeline carries no
    per-stage mask tiles); the rows past R are neither stored nor summed."""
    ct = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    dw = tl.zeros([BLOCK_R, BLOCK_D], dtype=ct)
    row0 = pid.to(tl.int64) * (ITERS * BLOCK_R)
    for t in tl.range(0, ITERS, num_stages=STAGES):
        rows = row0 + t * BLOCK_R + tl.arange(0, BLOCK_R)
        rows_in = tl.minimum(rows, R - 1)
        x = tl.load(x_ptr + rows_in[:, None] * s_x + cols[None, :], mask=cmask[None, :], other=0.0).to(ct)
        g = tl.load(g_ptr + rows_in[:, None] * s_g + cols[None, :], mask=cmask[None, :], other=0.0).to(ct)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xr = x * r[:, None]
        gw = g * w[None, :]
        c = tl.sum(gw * xr, axis=1) / D  # (g w . x) r / D
        dx = r[:, None] * (gw - xr * c[:, None])
        rmask = rows < R
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        dw += tl.where(rmask[:, None], g * xr, 0.0)
    tl.store(part_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=cmask)
