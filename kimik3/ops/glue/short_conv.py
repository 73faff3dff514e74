"""KDA's causal depthwise short convolution (``kimik3.model.conv.short_conv``) for one decode token, over a pool of
per-sequence conv states advanced in place, in one Triton kernel.

Per sequence b with state s = pool[slot_b] (its last W-1 inputs, oldest first) and current input x [C], in fp32:

    y = act(sum_{j<W-1} weight[:, j] s[:, j] + weight[:, W-1] x)     pool[slot_b] = [s[:, 1:], x]

with act = SiLU (or the identity). This is ``short_conv(x[:, None], weight, pool[slots])`` at T = 1 followed by
``pool[slots] = new_state``: the gather, the conv's ~2W launches, the cat of q_conv | k_conv | v_conv and the
scatter, fused into one launch that reads each state once and writes it once.

Each program (sequence b, block of channels) holds the extended row e = [s, x] [BLOCK_C, W] in registers: y is
the row-wise dot of e with the weights, and the new state is e[:, 1:], stored one column to the left of where e
was read from. The weights may come as up to three tensors (KDA's q_conv, k_conv, v_conv) read in place, each
channel from the one that holds it.

The serving engine replays the decode step as a CUDA graph: shapes decide everything at launch (no host sync, no
value-dependent shapes). Slots index the pool as torch indexing does; the pool's last row is a scratch row (slot
-1) that every padding row of a batch reads and writes; those programs race with each other there, which only
makes the scratch row's contents and the padding rows' outputs garbage, as they are by contract. Slots of live
sequences must be distinct and in range (not checked: reading them is a host sync).

Legend: B batch (decode rows), C channels (q | k | v), W kernel width, P pool rows (slots + the scratch row).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kimik3.ops.glue.common import (MAX_CONV_WEIGHTS, _jit, check_conv_weights, check_triton_device, compute_f64,
                                    describe, on_device, tl, triton)

__all__ = ["MAX_WEIGHTS", "short_conv_decode"]

MAX_WEIGHTS = MAX_CONV_WEIGHTS
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TILE_ELEMS = 512  # a program's [BLOCK_C, BLOCK_W] tile: 4 elements a thread at 4 warps


def _check(x_BC, weights, pool_PCW, slots_B, out_dtype) -> tuple[torch.Tensor, ...]:
    """Checks the arguments (shapes, dtypes, devices only); returns the weights as a tuple."""
    if not isinstance(x_BC, torch.Tensor) or x_BC.ndim != 2 or x_BC.dtype not in _FLOATS:
        raise ValueError(f"x_BC must be a floating tensor [B, C] (fp32, bf16, fp16 or fp64), got {describe(x_BC)}")
    B, C = x_BC.shape
    device = x_BC.device
    weights = check_conv_weights(weights, C, device, "x_BC")
    W = weights[0].shape[1]
    if not isinstance(pool_PCW, torch.Tensor) or pool_PCW.ndim != 3 or pool_PCW.dtype not in _FLOATS:
        raise ValueError(f"pool_PCW must be a floating tensor [P, C, W-1], got {describe(pool_PCW)}")
    if pool_PCW.shape[0] < 1 or pool_PCW.shape[1:] != (C, W - 1):
        raise ValueError(f"pool_PCW must be [P >= 1, C={C}, W-1={W - 1}] (W = {W} from the weights), got "
                         f"{tuple(pool_PCW.shape)}")
    if not pool_PCW.is_contiguous():
        raise ValueError(f"pool_PCW must be contiguous (it is updated in place), got strides {pool_PCW.stride()}")
    if pool_PCW.device != device:
        raise ValueError(f"pool_PCW is on {pool_PCW.device} but x_BC on {device}")
    if not isinstance(slots_B, torch.Tensor) or slots_B.ndim != 1 or slots_B.dtype != torch.int64:
        raise ValueError(f"slots_B must be a 1-D int64 tensor [B], got {describe(slots_B)}")
    if slots_B.shape[0] != B:
        raise ValueError(f"slots_B has {slots_B.shape[0]} entries, x_BC has B = {B} rows")
    if slots_B.device != device:
        raise ValueError(f"slots_B is on {slots_B.device} but x_BC on {device}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be None or fp32, bf16, fp16 or fp64, got {out_dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_BC, pool_PCW, *weights)):
        raise RuntimeError("short_conv_decode is forward only (inference, no autograd): an input requires grad "
                           "while grad mode is on; call it under torch.no_grad() or torch.inference_mode()")
    check_triton_device(x_BC, "short_conv_decode")
    return weights


@torch.compiler.disable  # an opaque kernel call to torch.compile: traced, its launcher breaks on symbolic sizes
def short_conv_decode(
    x_BC: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    pool_PCW: torch.Tensor,
    slots_B: torch.Tensor,
    activation: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One decode step of the short conv over pooled states, in one launch; advances ``pool_PCW[slots_B]`` in place.

    Args:
        x_BC: the current token's inputs [B, C] (fp32, bf16, fp16 or fp64), any strides (e.g. a column slice of a
            wider projection's output).
        weights: 1 to 3 tensors [C_i, W] with sum C_i = C, channel blocks in order (q_conv, k_conv, v_conv), or
            one tensor [C, W]; any float dtypes and strides. ``weight[:, W-1]`` multiplies the current token.
        pool_PCW: the states [P, C, W-1], contiguous, any float dtype; rows ``slots_B`` are read and rewritten as
            [s[:, 1:], x] in its dtype. The other rows are never touched.
        slots_B: int64 [B], pool rows as torch indexes them (-1 is the last row, the scratch row that padding
            rows name); live slots must be distinct and within [-P, P-1] (unchecked: no host sync).
        activation: SiLU on y (KDA's default) or not.
        out_dtype: y's dtype (default x's).
    Returns:
        y [B, C], contiguous: ``short_conv(x[:, None], cat(weights), pool[slots], activation=activation)[0][:, 0]``
        computed in fp32 (fp64 when any input is fp64).

    Forward only: inputs that require grad are refused while grad mode is on. CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1.
    """
    weights = _check(x_BC, weights, pool_PCW, slots_B, out_dtype)
    B, C = x_BC.shape
    W = weights[0].shape[1]
    y = torch.empty(B, C, dtype=out_dtype or x_BC.dtype, device=x_BC.device)
    if B == 0:
        return y
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + w.shape[0])
    block_w = triton.next_power_of_2(W)
    block_c = min(triton.next_power_of_2(C), max(16, _TILE_ELEMS // block_w))
    with on_device(x_BC.device):
        _short_conv_decode_kernel[(B, triton.cdiv(C, block_c))](
            x_BC, x_BC.stride(0), x_BC.stride(1),
            weights, tuple(w.stride(0) for w in weights), tuple(w.stride(1) for w in weights), tuple(starts),
            pool_PCW, pool_PCW.shape[0], slots_B, y, C,
            NUM_W=len(weights), W=W, BLOCK_C=block_c, BLOCK_W=block_w, ACT=bool(activation),
            F64=compute_f64(x_BC, pool_PCW, *weights), num_warps=4,
        )
    return y


@_jit
def _short_conv_decode_kernel(
    x_ptr, s_xb, s_xc, ws, s_wr, s_wc, starts, pool_ptr, P, slots_ptr, y_ptr, C,
    NUM_W: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, ACT: tl.constexpr,
    F64: tl.constexpr,
):
    """Program (sequence b, channel block): e = [pool[row, c, :], x[b, c]] [BLOCK_C, W]; y[b, c] = act(e . w[c]),
    pool[row, c, :] = e[:, 1:]. Weight i holds channels [starts[i], starts[i+1])."""
    ct = tl.float64 if F64 else tl.float32
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    j = tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + b)
    row = tl.where(slot < 0, slot + P, slot)  # torch's negative indexing: -1 is the scratch row P-1
    cell = pool_ptr + row * C * (W - 1) + cols[:, None] * (W - 1) + j[None, :]  # &pool[row, c, j]
    s = tl.load(cell, mask=cmask[:, None] & (j < W - 1)[None, :], other=0.0).to(ct)
    x = tl.load(x_ptr + b * s_xb + cols * s_xc, mask=cmask, other=0.0).to(ct)
    e = tl.where((j == W - 1)[None, :], x[:, None], s)
    w = tl.zeros([BLOCK_C, BLOCK_W], dtype=ct)
    for i in tl.static_range(NUM_W):
        mine = (cols >= starts[i]) & (cols < starts[i + 1])
        w_ptr = ws[i] + (cols - starts[i])[:, None] * s_wr[i] + j[None, :] * s_wc[i]
        w += tl.load(w_ptr, mask=mine[:, None] & (j < W)[None, :], other=0.0).to(ct)
    acc = tl.sum(w * e, axis=1)
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + b * C + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)
    # e[:, j] is stored at column j-1, which another thread of this program may hold in s: every read of the row
    # must be done before any write.
    tl.debug_barrier()
    tl.store(cell - 1, e.to(pool_ptr.dtype.element_ty), mask=cmask[:, None] & (j >= 1)[None, :] & (j < W)[None, :])
