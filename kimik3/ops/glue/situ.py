"""The SiTU-GLU activation (``kimik3.model.ffn.situ_glu``), optionally times a per-row weight, in one Triton kernel
forward and one backward.

Per element, in fp32 (fp64 when an input is fp64), with g the gate and u the up projection:

    a = 4 tanh(g/4)    s = sigmoid(g)    b = 25 tanh(u/25)    f = a s b    out = f w[row]   (stored in out_dtype)

w is the optional row weight (the MoE mixture weights, one per routed row). The unfused form is about a dozen
launches (two .float(), the scalings, tanh twice, sigmoid, the products, the weight, .to()); here each program reads
a tile of g and u once in their dtypes and writes out once.

Backward, with o = dL/dout and sech^2 x = 1 - tanh(x)^2:

    d_g = o w b (s sech^2(g/4) + a s (1 - s))    d_u = o w a s sech^2(u/25)    d_w[r] = sum over the row of o f

in one kernel: d_w's per-row sum is the programs' own (a program walks its rows' whole width, in a fixed order:
deterministic, no atomics); without it (no weight, or its grad not needed) the programs tile the width too.

The elementwise functions avoid overflow and cancellation at any magnitude: tanh and sech^2 from t = exp(-2|x|)
(tanh |x| = (1 - t) / (1 + t), sech^2 x = 4 t / (1 + t)^2, a Taylor series for tanh near 0 where 1 - t cancels),
sigmoid from e = exp(-|g|) with s (1 - s) = e / (1 + e)^2 (torch's fp32 autograd, 1 - y^2 and y (1 - y) of the
rounded outputs, loses these where the functions saturate).

Layout: gate and up are [..., F] with unit stride along F; their flattened rows are read through one row stride
each, so the two halves of one projection output [..., 2F] (``y.chunk(2, -1)``, row stride 2F) are read in place;
anything else (a non-unit stride along F, leading dims that do not merge) is copied once by ``reshape``. The row
weight is read through its stride. Outputs and grads are contiguous.

Shapes decide everything at launch (no host sync).

Legend: F width (the FFN's hidden size), R rows (all leading dims of gate flattened).
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import (
    _FLOATS,
    TILE_ELEMS,
    _jit,
    check_float,
    check_triton_device,
    compute_f64,
    describe,
    on_device,
    rows_2d,
    tl,
    triton,
    through_operator,
)

__all__ = ["situ_glu", "situ_glu_backward", "situ_glu_forward"]

# Columns of a tile: a row of width F is walked in tiles of up to this many elements (F may be any size).
BLOCK_F_MAX = 1024


def _blocks(R: int, F: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps) from the shapes only: BLOCK_F the next power of two of F up to BLOCK_F_MAX,
    as many rows as fit TILE_ELEMS (at most the next power of two of R), 8 elements a thread, 1 to 8 warps."""
    block_f = min(BLOCK_F_MAX, triton.next_power_of_2(F))
    block_r = max(1, min(triton.next_power_of_2(max(R, 1)), TILE_ELEMS // block_f))
    num_warps = max(1, min(8, block_r * block_f // 256))
    return block_r, block_f, num_warps


def _check(gate, up, row_weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks, then gate and up as [R, F] with unit stride along F (``rows_2d``: views where possible)."""
    check_float(gate, "gate")
    check_float(up, "up")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {describe(up)}")
    if up.device != gate.device:
        raise ValueError(f"up is on {up.device} but gate on {gate.device}")
    check_triton_device(gate, "situ_glu")
    g2, u2 = rows_2d(gate), rows_2d(up)
    if row_weight is not None:
        R = g2.shape[0]
        if not isinstance(row_weight, torch.Tensor) or row_weight.ndim != 1 or row_weight.shape[0] != R:
            raise ValueError(f"row_weight must be None or a 1-D tensor [R={R}], one per row of gate "
                             f"{tuple(gate.shape)} (its leading dims flattened), got {describe(row_weight)}")
        if row_weight.dtype not in _FLOATS:
            raise ValueError(f"row_weight must be fp32, bf16, fp16 or fp64, got {row_weight.dtype}")
        if row_weight.device != gate.device:
            raise ValueError(f"row_weight is on {row_weight.device} but gate on {gate.device}")
    return g2, u2


def situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out = situ_glu(gate, up) * row_weight[:, None] in one launch, forward only (no autograd graph). Arguments as
    ``situ_glu``."""
    g2, u2 = _check(gate, up, row_weight)
    if out_dtype is None:
        out_dtype = gate.dtype
    elif out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be None or a floating dtype (fp32, bf16, fp16 or fp64), got {out_dtype!r}")
    R, F = g2.shape
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    if R == 0:
        return out
    has_w = row_weight is not None
    w = row_weight if has_w else g2  # (a placeholder pointer when there is no weight: never read)
    f64 = compute_f64(g2, u2, *([row_weight] if has_w else [])) or out_dtype == torch.float64
    block_r, block_f, num_warps = _blocks(R, F)
    with on_device(gate.device):
        _situ_fwd_kernel[(triton.cdiv(R, block_r), triton.cdiv(F, block_f))](
            g2, g2.stride(0), u2, u2.stride(0), w, w.stride(0) if has_w else 0, out, R, F,
            HAS_W=has_w, BLOCK_R=block_r, BLOCK_F=block_f, F64=f64, num_warps=num_warps,
        )
    return out


def situ_glu_backward(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                      row_weight: torch.Tensor | None = None, *, row_weight_grad: bool = True):
    """(d_gate, d_up, d_row_weight): d_gate and d_up contiguous in gate's and up's dtypes and shapes; d_row_weight
    [R] in row_weight's dtype, or None without a row weight or with ``row_weight_grad=False``. grad_out: gate's
    shape, any float dtype, any strides. One launch; deterministic (no atomics)."""
    g2, u2 = _check(gate, up, row_weight)
    if not isinstance(grad_out, torch.Tensor) or grad_out.shape != gate.shape:
        raise ValueError(f"grad_out must have gate's shape {tuple(gate.shape)}, got {describe(grad_out)}")
    if grad_out.dtype not in _FLOATS:
        raise ValueError(f"grad_out must be fp32, bf16, fp16 or fp64, got {grad_out.dtype}")
    if grad_out.device != gate.device:
        raise ValueError(f"grad_out is on {grad_out.device} but gate on {gate.device}")
    o2 = rows_2d(grad_out)
    R, F = g2.shape
    has_w = row_weight is not None
    row_sum = has_w and bool(row_weight_grad)
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=gate.device)
    d_w = torch.empty(R, dtype=row_weight.dtype, device=gate.device) if row_sum else None
    if R == 0:
        return d_gate, d_up, d_w
    w = row_weight if has_w else g2  # (placeholder pointers when there is no weight or no d_w: never touched)
    f64 = compute_f64(g2, u2, o2, *([row_weight] if has_w else []))
    block_r, block_f, num_warps = _blocks(R, F)
    col_tiles = triton.cdiv(F, block_f)
    # With d_w a program walks its rows' whole width (col_tiles tiles), else one tile: more programs.
    grid = (triton.cdiv(R, block_r), 1 if row_sum else col_tiles)
    with on_device(gate.device):
        _situ_bwd_kernel[grid](
            o2, o2.stride(0), g2, g2.stride(0), u2, u2.stride(0), w, w.stride(0) if has_w else 0,
            d_gate, d_up, d_w if row_sum else d_gate, R, F, col_tiles if row_sum else 1,
            HAS_W=has_w, ROW_SUM=row_sum, BLOCK_R=block_r, BLOCK_F=block_f, F64=f64, num_warps=num_warps,
        )
    return d_gate, d_up, d_w


@torch.library.custom_op("kimik3::situ_glu", mutates_args=())
def _situ_glu_op(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    return situ_glu_forward(gate, up, row_weight, out_dtype)


@_situ_glu_op.register_fake
def _(gate, up, row_weight, out_dtype):
    return gate.new_empty(gate.shape, dtype=out_dtype)


@torch.library.custom_op("kimik3::situ_glu_backward", mutates_args=())
def _situ_glu_backward_op(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                          row_weight: torch.Tensor | None, row_weight_grad: bool) -> list[torch.Tensor]:
    """[d_gate, d_up] and d_row_weight when asked for."""
    d_gate, d_up, d_w = situ_glu_backward(grad_out, gate, up, row_weight, row_weight_grad=row_weight_grad)
    return [d_gate, d_up] + ([d_w] if d_w is not None else [])


@_situ_glu_backward_op.register_fake
def _(grad_out, gate, up, row_weight, row_weight_grad):
    out = [gate.new_empty(gate.shape), up.new_empty(up.shape)]
    if row_weight is not None and row_weight_grad:
        out.append(row_weight.new_empty((gate.numel() // max(gate.shape[-1], 1) if gate.ndim else 1,)))
    return out


def _setup_grads(ctx, inputs, output) -> None:
    gate, up, row_weight, _ = inputs
    ctx.save_for_backward(gate, up, row_weight)


def _grads(ctx, grad_out):
    gate, up, row_weight = ctx.saved_tensors
    want_w = row_weight is not None and ctx.needs_input_grad[2]
    grads = _situ_glu_backward_op(grad_out, gate, up, row_weight, want_w)
    return grads[0], grads[1], grads[2] if want_w else None, None


_situ_glu_op.register_autograd(_grads, setup_context=_setup_grads)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, row_weight: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """SiTU-GLU in the Triton kernels, differentiable -> gate's shape [..., F] in ``out_dtype``.

    out = (situ_glu(gate.float(), up.float()) * row_weight[:, None]).to(out_dtype), as ``RoutedExperts`` and
    ``GLUFeedForward`` compute it. gate, up: [..., F] of one shape, fp32, bf16, fp16 or fp64 (each its own), any F;
    strides: see the module docstring (the halves of one [..., 2F] projection output are read in place).
    row_weight: None, or [R] (R = prod of the leading dims), any float dtype and stride. out_dtype: default gate's
    dtype. Grads of gate, up and row_weight in their dtypes and shapes. Math in fp32 (fp64 when an input is fp64).
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (no dispatch here: ``glue_backend`` chooses). Forward:
    one launch; backward: one. A custom operator (``kimik3::situ_glu``): torch.compile traces around it.
    """
    if not through_operator(gate, up, row_weight):
        return situ_glu_forward(gate, up, row_weight, out_dtype)
    # (the operator's forward checks its inputs)
    return _situ_glu_op(gate, up, row_weight, gate.dtype if out_dtype is None else out_dtype)


@_jit
def _tanh_sech2(x, F64: tl.constexpr):
    """(tanh x, sech^2 x = 1 - tanh(x)^2), finite for any finite x and exact to a few ulps: t = exp(-2|x|) in
    (0, 1], tanh |x| = (1 - t) / (1 + t) and sech^2 x = 4 t / (1 + t)^2 (nothing overflows: t -> 0 saturates
    them to 1 and 0); for |x| < SMALL, where 1 - t cancels, tanh is its Taylor series to x^9 (truncation under
    1e-8 relative at |x| = 0.25, far under fp64's rounding at 1e-3)."""
    if F64:
        SMALL: tl.constexpr = 1e-3
    else:
        SMALL: tl.constexpr = 0.25
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    inv = 1.0 / (1.0 + t)
    xs = tl.minimum(ax, SMALL)  # (the series only where it is used: no overflow of x^2 elsewhere)
    x2 = xs * xs
    series = xs * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    th = tl.where(ax < SMALL, series, (1.0 - t) * inv)
    return tl.where(x < 0, -th, th), 4.0 * t * inv * inv


@_jit
def _sigmoid_parts(g):
    """(sigmoid g, sigmoid(g) (1 - sigmoid(g))) from e = exp(-|g|): no overflow, and s (1 - s) = e / (1 + e)^2
    keeps its relative precision where s rounds to 1."""
    e = tl.exp(-tl.abs(g))
    inv = 1.0 / (1.0 + e)
    return tl.where(g >= 0, inv, e * inv), e * inv * inv


@_jit
def _situ_fwd_kernel(
    g_ptr, s_g, u_ptr, s_u, w_ptr, s_w, out_ptr, R, F,
    HAS_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, F64: tl.constexpr,
):
    """Program (row block, column tile): out = (4 tanh(g/4) sigmoid(g)) (25 tanh(u/25)) [* w[row]], stored
    contiguous [R, F] in out's dtype."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = rows < R
    mask = rmask[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    g = tl.load(g_ptr + rows64[:, None] * s_g + cols[None, :], mask=mask, other=0.0).to(ct)
    u = tl.load(u_ptr + rows64[:, None] * s_u + cols[None, :], mask=mask, other=0.0).to(ct)
    tg, _ = _tanh_sech2(g * 0.25, F64)
    tu, _ = _tanh_sech2(u / 25.0, F64)
    s, _ = _sigmoid_parts(g)
    h = (4.0 * tg * s) * (25.0 * tu)
    if HAS_W:
        w = tl.load(w_ptr + rows64 * s_w, mask=rmask, other=0.0).to(ct)
        h = h * w[:, None]
    tl.store(out_ptr + rows64[:, None] * F + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _situ_bwd_kernel(
    o_ptr, s_o, g_ptr, s_g, u_ptr, s_u, w_ptr, s_w, dg_ptr, du_ptr, dw_ptr, R, F, ITERS,
    HAS_W: tl.constexpr, ROW_SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
    F64: tl.constexpr,
):
    """Program (row block, column block of ITERS tiles): writes d_g and d_u (contiguous [R, F]) for its tiles;
    with ROW_SUM (then one column block, the whole width) also d_w[rows] = sum over the row of o f, its tiles
    added in order."""
    ct = tl.float64 if F64 else tl.float32
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    if HAS_W:
        w = tl.load(w_ptr + rows64 * s_w, mask=rmask, other=0.0).to(ct)
    acc = tl.zeros([BLOCK_R, BLOCK_F], dtype=ct)
    c0 = tl.program_id(1) * ITERS * BLOCK_F
    it = 0
    while it < ITERS:  # (a while loop: Triton 3.6's interpreter cannot take tensor bounds in range(), triton#9171)
        cols = c0 + it * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        o = tl.load(o_ptr + rows64[:, None] * s_o + cols[None, :], mask=mask, other=0.0).to(ct)
        g = tl.load(g_ptr + rows64[:, None] * s_g + cols[None, :], mask=mask, other=0.0).to(ct)
        u = tl.load(u_ptr + rows64[:, None] * s_u + cols[None, :], mask=mask, other=0.0).to(ct)
        tg, sech2_g = _tanh_sech2(g * 0.25, F64)
        tu, sech2_u = _tanh_sech2(u / 25.0, F64)
        s, ds = _sigmoid_parts(g)
        a = 4.0 * tg
        b = 25.0 * tu
        if ROW_SUM:
            acc += o * ((a * s) * b)  # (masked-off lanes: o = 0 and f = 0)
        if HAS_W:
            o = o * w[:, None]
        dg = o * b * (s * sech2_g + a * ds)
        du = o * (a * s) * sech2_u
        offs = rows64[:, None] * F + cols[None, :]
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=mask)
        it += 1
    if ROW_SUM:
        tl.store(dw_ptr + rows64, tl.sum(acc, axis=1).to(dw_ptr.dtype.element_ty), mask=rmask)
