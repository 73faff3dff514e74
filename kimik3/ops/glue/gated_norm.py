"""KDA's output gated norm (the end of ``kimik3.model.kda.KDA.forward``) in one Triton kernel forward and two
backward.

Per row of width V (one head of one token), in fp32 (fp64 when an input is fp64):

    r = rsqrt(mean(x^2) + eps)    n = x r    y = n w    s = sigmoid(z)    out = y s   (stored in out_dtype)

with x = o (the recurrence's output), z = the output gate's pre-activation, w the norm weight [V]. The unfused
form is ~8 launches (o.float(), weight.float(), rms_norm, gate.float(), sigmoid, mul, .to()); here one program
per block of rows reads o and the gate once in their dtypes and writes out once.

Backward, per row with g = dL/dout:

    dz = g y s (1 - s)    gy = g s w    dx = r (gy - n mean(gy n))    dw = sum over rows of g s n

One kernel writes dx, dz and per-program partial sums of dw (its G programs each walk several row blocks), one
(``common.reduce_partials``) adds the partials in a fixed order and writes dw in the weight's dtype.

Layout: o is [..., H, V]; the gate is o's shape or [..., H * V] (the projection's output, same elements). Both
are read through two strides, one for the leading dims and one for H, with unit stride along V: a column slice
of a wider projection output, or any view whose leading dims merge into one stride, is read in place; anything
else (e.g. a transposed batch/time pair, a non-unit stride along V) is copied once by ``reshape``/``contiguous``.
The output and the grads are contiguous, out and dx in o's shape, dz in the gate's.

Shapes decide everything at launch (no host sync).

Legend: B batch, T tokens, H heads, V head dim, M = prod of the leading dims (B * T), R = M * H rows,
G backward programs.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import (
    _FLOATS,
    _jit,
    backward_programs,
    blocks,
    check_eps,
    check_float,
    check_param,
    check_triton_device,
    check_width,
    compute_f64,
    describe,
    on_device,
    reduce_partials,
    tl,
    triton,
    through_operator,
)

__all__ = ["gated_rms_norm", "gated_rms_norm_backward", "gated_rms_norm_forward"]


def _heads(o: torch.Tensor) -> tuple[int, int]:
    """(H, V) of o [..., H, V]; a 1-D o [V] is one row (H = 1)."""
    return (o.shape[-2] if o.ndim >= 2 else 1), o.shape[-1]


def _like_o(t, o: torch.Tensor, name: str) -> torch.Tensor:
    """t as a tensor of o's shape [..., H, V]: t itself, or t [..., H * V] unflattened (a view)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape == o.shape:
        return t
    if o.ndim >= 2 and t.shape == o.shape[:-2] + (o.shape[-2] * o.shape[-1],):
        return t.unflatten(-1, o.shape[-2:])
    flat = (*o.shape[:-2], o.shape[-2] * o.shape[-1]) if o.ndim >= 2 else tuple(o.shape)
    raise ValueError(f"{name} must have o's shape {tuple(o.shape)} or {flat} (heads flattened), got {describe(t)}")


def _rows_3d(t: torch.Tensor, H: int, V: int) -> torch.Tensor:
    """t [..., H, V] as [M, H, V] with unit stride along V: a view when the leading dims merge into one stride,
    else a copy."""
    t3 = t.reshape(-1, H, V)
    return t3 if t3.stride(-1) == 1 or V == 1 else t3.contiguous()


def _check(o, gate, weight, eps, out_dtype=None):
    """Checks, then (o3, gate3, eps, out_dtype): o and the gate as [M, H, V] (``_rows_3d``)."""
    check_float(o, "o")
    check_float(gate, "gate")
    H, V = _heads(o)
    gate = _like_o(gate, o, "gate")
    if gate.device != o.device:
        raise ValueError(f"gate is on {gate.device} but o on {o.device}")
    check_width(V, "gated_rms_norm")
    check_param(weight, V, o.device, "weight")
    check_triton_device(o, "gated_rms_norm")
    eps = check_eps(eps)
    if out_dtype is None:
        out_dtype = gate.dtype
    elif out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be None or a floating dtype (fp32, bf16, fp16 or fp64), got {out_dtype!r}")
    return _rows_3d(o, H, V), _rows_3d(gate, H, V), eps, out_dtype


def gated_rms_norm_forward(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = RMSNorm_V(o) * weight * sigmoid(gate) in one launch, forward only (no autograd graph). Arguments as
    ``gated_rms_norm``."""
    o3, z3, eps, out_dtype = _check(o, gate, weight, eps, out_dtype)
    M, H, V = o3.shape
    R = M * H
    out = torch.empty(o.shape, dtype=out_dtype, device=o.device)
    if R == 0:
        return out
    w = weight.contiguous()
    block_r, block_d, num_warps = blocks(R, V)
    with on_device(o.device):
        _gated_norm_fwd_kernel[(triton.cdiv(R, block_r),)](
            o3, o3.stride(0), o3.stride(1), z3, z3.stride(0), z3.stride(1), w, out, R, H, V, eps,
            BLOCK_R=block_r, BLOCK_D=block_d, F64=compute_f64(o3, z3, w), num_warps=num_warps,
        )
    return out


def gated_rms_norm_backward(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                            grad_out: torch.Tensor, *, programs: int | None = None):
    """(d_o, d_gate, d_weight), each in its input's dtype and shape (d_o and d_gate contiguous). grad_out: o's
    shape or [..., H * V], any float dtype. Two launches; ``programs`` overrides G (``common.backward_programs``);
    d_weight is deterministic (partials summed in a fixed order)."""
    o3, z3, eps, _ = _check(o, gate, weight, eps)
    g = _like_o(grad_out, o, "grad_out")
    if not g.is_floating_point():
        raise ValueError(f"grad_out must be a floating tensor, got {g.dtype}")
    if g.device != o.device:
        raise ValueError(f"grad_out is on {g.device} but o on {o.device}")
    M, H, V = o3.shape
    R = M * H
    g3 = _rows_3d(g, H, V)
    w = weight.contiguous()
    f64 = compute_f64(o3, z3, w, g3)
    d_o = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=o.device)
    block_r, block_d, num_warps = blocks(R, V)
    row_blocks = triton.cdiv(R, block_r)
    G = backward_programs(row_blocks, o.device, programs)
    partial = torch.empty(G, V, dtype=torch.float64 if f64 else torch.float32, device=o.device)
    if R == 0:
        partial.zero_()
    else:
        with on_device(o.device):
            _gated_norm_bwd_kernel[(G,)](
                o3, o3.stride(0), o3.stride(1), z3, z3.stride(0), z3.stride(1), g3, g3.stride(0), g3.stride(1),
                w, d_o, d_gate, partial, R, H, V, eps, triton.cdiv(row_blocks, G), G,
                BLOCK_R=block_r, BLOCK_D=block_d, F64=f64, num_warps=num_warps,
            )
    return d_o, d_gate, reduce_partials(partial, weight, None, f64)


@torch.library.custom_op("kimik3::gated_rms_norm", mutates_args=())
def _gated_rms_norm_op(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype) -> torch.Tensor:
    return gated_rms_norm_forward(o, gate, weight, eps, out_dtype)


@_gated_rms_norm_op.register_fake
def _(o, gate, weight, eps, out_dtype):
    return o.new_empty(o.shape, dtype=out_dtype)


@torch.library.custom_op("kimik3::gated_rms_norm_backward", mutates_args=())
def _gated_rms_norm_backward_op(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                                grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gated_rms_norm_backward(o, gate, weight, eps, grad_out)


@_gated_rms_norm_backward_op.register_fake
def _(o, gate, weight, eps, grad_out):
    return o.new_empty(o.shape), gate.new_empty(gate.shape), torch.empty_like(weight)


def _setup_grads(ctx, inputs, output) -> None:
    o, gate, weight, ctx.eps, _ = inputs
    ctx.save_for_backward(o, gate, weight)


def _grads(ctx, grad_out):
    o, gate, weight = ctx.saved_tensors
    return (*_gated_rms_norm_backward_op(o, gate, weight, ctx.eps, grad_out), None, None)


_gated_rms_norm_op.register_autograd(_grads, setup_context=_setup_grads)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """KDA's output gated norm in the Triton kernels, differentiable -> o's shape [..., H, V] in ``out_dtype``.

    out = rms_norm(o.float(), (V,), weight.float(), eps) * sigmoid(gate.float()), i.e. a per-head RMSNorm over V.
    o: [..., H, V] (or [V], one row) fp32, bf16, fp16 or fp64. gate: o's shape or [..., H * V], any float dtype.
    Strides: see the module docstring (unit stride along V and leading dims that merge: read in place; else one
    copy). weight: [V], any float dtype. eps: a Python float. out_dtype: default the gate's dtype. Grads of o, gate
    and weight in their dtypes and shapes. Math in fp32 (fp64 when an input is fp64). CUDA tensors, or CPU tensors
    under TRITON_INTERPRET=1. Forward: one launch; backward: two. A custom operator (``kimik3::gated_rms_norm``):
    torch.compile traces around it.
    """
    if not through_operator(o, gate, weight):
        return gated_rms_norm_forward(o, gate, weight, eps, out_dtype)
    # (the operator's forward checks the rest)
    return _gated_rms_norm_op(o, gate, weight, check_eps(eps), gate.dtype if out_dtype is None else out_dtype)


@_jit
def _gated_norm_fwd_kernel(
    x_ptr, s_xm, s_xh, z_ptr, s_zm, s_zh, w_ptr, out_ptr, R, H, V, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Program (row block): out[rows] = (x r) w sigmoid(z), stored contiguous [R, V] in out's dtype. Row i is
    (m, h) = divmod(i, H) of the [M, H, V] views."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < V
    mask = (rows < R)[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    m = rows64 // H
    h = rows64 - m * H
    x = tl.load(x_ptr + (m * s_xm + h * s_xh)[:, None] + cols[None, :], mask=mask, other=0.0).to(ct)
    z = tl.load(z_ptr + (m * s_zm + h * s_zh)[:, None] + cols[None, :], mask=mask, other=0.0).to(ct)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)
    s = 1.0 / (1.0 + tl.exp(-z))  # (exp overflows to inf for z << 0: s = 0, as torch.sigmoid)
    out = (x * r[:, None]) * w[None, :] * s
    tl.store(out_ptr + rows64[:, None] * V + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _gated_norm_bwd_kernel(
    x_ptr, s_xm, s_xh, z_ptr, s_zm, s_zh, g_ptr, s_gm, s_gh, w_ptr, dx_ptr, dz_ptr, part_ptr,
    R, H, V, eps, ITERS, G,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, F64: tl.constexpr,
):
    """Program p of G: row blocks p, p + G, ... (ITERS of them, the last ones possibly empty); writes dx and dz for
    them (contiguous [R, V]) and its partial sum of dw = sum g s n to part_ptr[p] ([G, V], fp32 or fp64)."""
    ct = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < V
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    dw = tl.zeros([BLOCK_D], dtype=ct)
    it = 0
    while it < ITERS:  # (a while loop: Triton 3.6's interpreter cannot take tensor bounds in range(), triton#9171)
        rows = (pid + it * G) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        m = rows64 // H
        h = rows64 - m * H
        x = tl.load(x_ptr + (m * s_xm + h * s_xh)[:, None] + cols[None, :], mask=mask, other=0.0).to(ct)
        z = tl.load(z_ptr + (m * s_zm + h * s_zh)[:, None] + cols[None, :], mask=mask, other=0.0).to(ct)
        g = tl.load(g_ptr + (m * s_gm + h * s_gh)[:, None] + cols[None, :], mask=mask, other=0.0).to(ct)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)
        n = x * r[:, None]
        s = 1.0 / (1.0 + tl.exp(-z))
        gs = g * s
        dz = gs * (n * w[None, :]) * (1.0 - s)
        gy = gs * w[None, :]
        c = tl.sum(gy * n, axis=1) / V  # mean(gy n) over the row
        dx = r[:, None] * (gy - n * c[:, None])
        out_offs = rows64[:, None] * V + cols[None, :]
        tl.store(dx_ptr + out_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + out_offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(tl.where(mask, gs * n, 0.0), axis=0)  # (a masked-off row has n = nan when eps = 0)
        it += 1
    tl.store(part_ptr + pid.to(tl.int64) * V + cols, dw, mask=cmask)
