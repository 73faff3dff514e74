"""KDA's causal depthwise short convolution (``kimik3.model.conv.short_conv``) over a pool of per-sequence conv
states, in one Triton kernel each: one decode token, the state advanced in place (``short_conv_decode``); or a
speculative verification's T tokens, every token's state recorded and the pool left alone (``short_conv_steps``).

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

``short_conv_steps`` runs T such steps from the same pooled state without writing it: token t's extended row e_t
(the last W inputs up to x_t) is loaded directly, from the pool where it reaches before x_0 and from x otherwise,
with the inputs before x_t rounded to the pool's dtype as a decode step would have stored them; y_t = act(e_t . w)
and steps[t, b] = e_t[:, 1:] (the state after token t, in the steps' dtype). Each token is thus computed exactly as
T decode steps in a row compute it, in one launch instead of a gather, a conv, a concatenation and a copy.

Legend: B batch (decode rows), T tokens of a verification, C channels (q | k | v), W kernel width, P pool rows
(slots + the scratch row).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kimik3.ops.glue.common import (MAX_CONV_WEIGHTS, _jit, check_conv_weights, check_triton_device, compute_f64,
                                    describe, on_device, tl, triton)

__all__ = ["MAX_WEIGHTS", "short_conv_decode", "short_conv_steps"]

MAX_WEIGHTS = MAX_CONV_WEIGHTS
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TILE_ELEMS = 512  # a program's [BLOCK_C, BLOCK_W] tile: 4 elements a thread at 4 warps


def _check(x_BC, weights, pool_PCW, slots_B, out_dtype, name="short_conv_decode") -> tuple[torch.Tensor, ...]:
    """Checks the arguments (shapes, dtypes, devices only); returns the weights as a tuple. ``x_BC``: [B, C], or
    [B, T, C] for ``short_conv_steps`` (named x_BTC)."""
    x_name, ndim, shape = ("x_BC", 2, "[B, C]") if name == "short_conv_decode" else ("x_BTC", 3, "[B, T, C]")
    if not isinstance(x_BC, torch.Tensor) or x_BC.ndim != ndim or x_BC.dtype not in _FLOATS:
        raise ValueError(f"{x_name} must be a floating tensor {shape} (fp32, bf16, fp16 or fp64), got "
                         f"{describe(x_BC)}")
    B, C = x_BC.shape[0], x_BC.shape[-1]
    device = x_BC.device
    weights = check_conv_weights(weights, C, device, x_name)
    W = weights[0].shape[1]
    if not isinstance(pool_PCW, torch.Tensor) or pool_PCW.ndim != 3 or pool_PCW.dtype not in _FLOATS:
        raise ValueError(f"pool_PCW must be a floating tensor [P, C, W-1], got {describe(pool_PCW)}")
    if pool_PCW.shape[0] < 1 or pool_PCW.shape[1:] != (C, W - 1):
        raise ValueError(f"pool_PCW must be [P >= 1, C={C}, W-1={W - 1}] (W = {W} from the weights), got "
                         f"{tuple(pool_PCW.shape)}")
    if not pool_PCW.is_contiguous():
        raise ValueError(f"pool_PCW must be contiguous (the kernels address its rows as [C, W-1] blocks), got "
                         f"strides {pool_PCW.stride()}")
    if pool_PCW.device != device:
        raise ValueError(f"pool_PCW is on {pool_PCW.device} but {x_name} on {device}")
    if not isinstance(slots_B, torch.Tensor) or slots_B.ndim != 1 or slots_B.dtype != torch.int64:
        raise ValueError(f"slots_B must be a 1-D int64 tensor [B], got {describe(slots_B)}")
    if slots_B.shape[0] != B:
        raise ValueError(f"slots_B has {slots_B.shape[0]} entries, {x_name} has B = {B} rows")
    if slots_B.device != device:
        raise ValueError(f"slots_B is on {slots_B.device} but {x_name} on {device}")
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise ValueError(f"out_dtype must be None or fp32, bf16, fp16 or fp64, got {out_dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x_BC, pool_PCW, *weights)):
        raise RuntimeError(f"{name} is forward only (inference, no autograd): an input requires grad while grad "
                           "mode is on; call it under torch.no_grad() or torch.inference_mode()")
    check_triton_device(x_BC, name)
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
    block_c, block_w = _blocks(C, W)
    with on_device(x_BC.device):
        _short_conv_decode_kernel[(B, triton.cdiv(C, block_c))](
            x_BC, x_BC.stride(0), x_BC.stride(1), *_weight_args(weights),
            pool_PCW, pool_PCW.shape[0], slots_B, y, C,
            NUM_W=len(weights), W=W, BLOCK_C=block_c, BLOCK_W=block_w, ACT=bool(activation),
            F64=compute_f64(x_BC, pool_PCW, *weights), num_warps=4,
        )
    return y


def _blocks(C: int, W: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_W): the kernel's width, padded to a power of two, and channels to fill ``_TILE_ELEMS``."""
    block_w = triton.next_power_of_2(W)
    return min(triton.next_power_of_2(C), max(16, _TILE_ELEMS // block_w)), block_w


def _weight_args(weights: tuple[torch.Tensor, ...]) -> tuple:
    """The kernels' weight arguments: the tensors, their row and column strides, and each one's first channel (plus
    the end)."""
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + w.shape[0])
    return weights, tuple(w.stride(0) for w in weights), tuple(w.stride(1) for w in weights), tuple(starts)


@torch.compiler.disable  # as short_conv_decode
def short_conv_steps(
    x_BTC: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    pool_PCW: torch.Tensor,
    slots_B: torch.Tensor,
    steps_TBCW: torch.Tensor,
    activation: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """T tokens of the short conv for each of B pooled sequences (a speculative verification), in one launch: y for
    every token, and the state after every token written to ``steps_TBCW``; the pool is read, never written.

    Args:
        x_BTC: the tokens' inputs [B, T, C] (fp32, bf16, fp16 or fp64), any strides.
        weights, activation, out_dtype: as ``short_conv_decode``'s.
        pool_PCW: the states [P, C, W-1] before the tokens, contiguous, any float dtype.
        slots_B: int64 [B], pool rows as torch indexes them (-1: the scratch row, for padding rows; unchecked).
        steps_TBCW: [T, B, C, W-1], contiguous, any float dtype: receives the state after token t at [t, b].
    Returns:
        y [B, T, C], contiguous: what T calls of ``short_conv_decode`` return one token after the other, computed
        the same way (the inputs before each token rounded to the pool's dtype, as those calls store them).

    Forward only; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.
    """
    weights = _check(x_BTC, weights, pool_PCW, slots_B, out_dtype, "short_conv_steps")
    B, T, C = x_BTC.shape
    W = weights[0].shape[1]
    expected = (T, B, C, W - 1)
    if (not isinstance(steps_TBCW, torch.Tensor) or tuple(steps_TBCW.shape) != expected
            or steps_TBCW.dtype not in _FLOATS or not steps_TBCW.is_contiguous()):
        raise ValueError(f"steps_TBCW must be a contiguous floating tensor [T, B, C, W-1] = {list(expected)}, got "
                         f"{describe(steps_TBCW)}")
    if steps_TBCW.device != x_BTC.device:
        raise ValueError(f"steps_TBCW is on {steps_TBCW.device} but x_BTC on {x_BTC.device}")
    y = torch.empty(B, T, C, dtype=out_dtype or x_BTC.dtype, device=x_BTC.device)
    if B == 0 or T == 0:
        return y
    block_c, block_w = _blocks(C, W)
    with on_device(x_BTC.device):
        _short_conv_steps_kernel[(B, triton.cdiv(C, block_c))](
            x_BTC, *x_BTC.stride(), *_weight_args(weights),
            pool_PCW, pool_PCW.shape[0], slots_B, steps_TBCW, y, B, C,
            NUM_W=len(weights), W=W, T=T, BLOCK_C=block_c, BLOCK_W=block_w, ACT=bool(activation),
            F64=compute_f64(x_BTC, pool_PCW, *weights), num_warps=4,
        )
    return y


@_jit
def _program(slots_ptr, P, C, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """This program's sequence b, channels (and their mask), kernel columns j and pool row."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + b)
    row = tl.where(slot < 0, slot + P, slot)  # torch's negative indexing: -1 is the scratch row P-1
    return b, cols, cols < C, j, row


@_jit
def _conv_out(w, e, ACT: tl.constexpr):
    """act(e . w) per channel: the row-wise dot of the extended rows with the taps, SiLU when ACT."""
    acc = tl.sum(w * e, axis=1)
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@_jit
def _conv_weights(ws, s_wr, s_wc, starts, cols, j, NUM_W: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_W: tl.constexpr, ct: tl.constexpr):
    """The kernel's taps [BLOCK_C, BLOCK_W] for channels ``cols`` (zero beyond W): weight i holds channels
    [starts[i], starts[i+1])."""
    w = tl.zeros([BLOCK_C, BLOCK_W], dtype=ct)
    for i in tl.static_range(NUM_W):
        mine = (cols >= starts[i]) & (cols < starts[i + 1])
        w_ptr = ws[i] + (cols - starts[i])[:, None] * s_wr[i] + j[None, :] * s_wc[i]
        w += tl.load(w_ptr, mask=mine[:, None] & (j < W)[None, :], other=0.0).to(ct)
    return w


@_jit
def _short_conv_steps_kernel(
    x_ptr, s_xb, s_xt, s_xc, ws, s_wr, s_wc, starts, pool_ptr, P, slots_ptr, steps_ptr, y_ptr, B, C,
    NUM_W: tl.constexpr, W: tl.constexpr, T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    ACT: tl.constexpr, F64: tl.constexpr,
):
    """Program (sequence b, channel block): for t < T, e_t[:, j] = input W-1-j tokens before x_t (from the pool
    before x_0); y[b, t] = act(e_t . w), steps[t, b] = e_t[:, 1:]. The pool is only read."""
    ct = tl.float64 if F64 else tl.float32
    b, cols, cmask, j, row = _program(slots_ptr, P, C, BLOCK_C, BLOCK_W)
    w = _conv_weights(ws, s_wr, s_wc, starts, cols, j, NUM_W, W, BLOCK_C, BLOCK_W, ct)
    for t in tl.static_range(T):
        pos = t + j                        # e_t's columns in [pool row (W-1 inputs), x_0 .. x_{T-1}]
        in_pool = pos < W - 1
        s = tl.load(pool_ptr + row * C * (W - 1) + cols[:, None] * (W - 1) + tl.minimum(pos, W - 2)[None, :],
                    mask=cmask[:, None] & (in_pool & (j < W))[None, :], other=0.0).to(ct)
        xt = tl.maximum(pos - (W - 1), 0)
        x = tl.load(x_ptr + b * s_xb + xt[None, :] * s_xt + cols[:, None] * s_xc,
                    mask=cmask[:, None] & ((pos >= W - 1) & (j < W))[None, :], other=0.0)
        # the current token as it comes, the earlier ones as a decode step stores them in the pool
        x_held = x.to(pool_ptr.dtype.element_ty).to(ct)
        e = tl.where(in_pool[None, :], s, tl.where((j == W - 1)[None, :], x.to(ct), x_held))
        acc = _conv_out(w, e, ACT)
        tl.store(y_ptr + (b * T + t) * C + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)
        step_row = steps_ptr + ((t * B + b) * C + cols[:, None]) * (W - 1)
        tl.store(step_row + (j - 1)[None, :], e.to(steps_ptr.dtype.element_ty),
                 mask=cmask[:, None] & ((j >= 1) & (j < W))[None, :])


@_jit
def _short_conv_decode_kernel(
    x_ptr, s_xb, s_xc, ws, s_wr, s_wc, starts, pool_ptr, P, slots_ptr, y_ptr, C,
    NUM_W: tl.constexpr, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, ACT: tl.constexpr,
    F64: tl.constexpr,
):
    """Program (sequence b, channel block): e = [pool[row, c, :], x[b, c]] [BLOCK_C, W]; y[b, c] = act(e . w[c]),
    pool[row, c, :] = e[:, 1:]. Weight i holds channels [starts[i], starts[i+1])."""
    ct = tl.float64 if F64 else tl.float32
    b, cols, cmask, j, row = _program(slots_ptr, P, C, BLOCK_C, BLOCK_W)
    cell = pool_ptr + row * C * (W - 1) + cols[:, None] * (W - 1) + j[None, :]  # &pool[row, c, j]
    s = tl.load(cell, mask=cmask[:, None] & (j < W - 1)[None, :], other=0.0).to(ct)
    x = tl.load(x_ptr + b * s_xb + cols * s_xc, mask=cmask, other=0.0).to(ct)
    e = tl.where((j == W - 1)[None, :], x[:, None], s)
    w = _conv_weights(ws, s_wr, s_wc, starts, cols, j, NUM_W, W, BLOCK_C, BLOCK_W, ct)
    acc = _conv_out(w, e, ACT)
    tl.store(y_ptr + b * C + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)
    # e[:, j] is stored at column j-1, which another thread of this program may hold in s: every read of the row
    # must be done before any write.
    tl.debug_barrier()
    tl.store(cell - 1, e.to(pool_ptr.dtype.element_ty), mask=cmask[:, None] & (j >= 1)[None, :] & (j < W)[None, :])
