"""KDA's causal depthwise short convolution over T tokens (``kimik3.model.conv.short_conv``: prefill and training)
in one Triton kernel forward and three backward.

Per row b and channel c, with e the extended input (the carried state, then x) and in fp32 (fp64 when an input is):

    e[t] = x[b, t, c] for 0 <= t < T,   e[t] = state[b, c, W-1+t] for -(W-1) <= t < 0 (zeros without a state)
    pre[t] = sum_{j<W} w[c, W-1-j] e[t-j]    y[b, t, c] = act(pre[t])    final_state[b, c, :] = e[T-W+1 .. T-1]

with act = SiLU (or the identity). With packed sequences (``cu_seqlens``, B = 1, no state) a term e[t-j] whose
token belongs to an earlier sequence counts as zero. The unfused form is ~10 launches a layer (the cat with the
state, W broadcast multiplies and adds, the SiLU); here each program reads its tile [BLOCK_T, BLOCK_C] of x and W-1
tokens before it (re-read through the cache, one load per tap), and writes y once.

Backward, with g = dL/dy and d = dL/dpre = g act'(pre) (act' = s (1 + pre (1 - s)), s = sigmoid(pre), for SiLU):

    dx[t] = sum_{j<W} w[c, W-1-j] d[t+j]    (t+j < T, in t's sequence)    dw[c, W-1-j] = sum over (b, t) of d[t] e[t-j]

and d_state the same sum as dx at the state's times -(W-1) .. -1. dx[t] needs d at the W times t .. t+W-1, each a
function of W inputs: rather than recompute pre at each of them (W^2 taps an element), the backward computes d once
into an fp32 buffer [B, T, C] (fp64 with fp64 inputs) and convolves it:

- d and dw (``_conv_bwd_d_kernel``): G programs a channel block, each walking the token tiles p, p + G, ... of
  the B * T_BLOCKS (row, token block) tiles. A tile loads the W taps e[t-j] as the forward does (the first one from
  memory, the others mostly through the cache) and g, computes pre and d, stores d, and adds d[t] e[t-j] to W
  accumulators held elementwise in registers (the taps are already there); at the end the program sums them over
  the tile's tokens into one partial sum of dw [C, W].
- the dw reduction (``_conv_dw_kernel``) adds the G partials in a fixed order (deterministic, no atomics) and
  writes each weight's grad in its dtype.
- dx (``_conv_bwd_dx_kernel``): one program a tile as in the forward, W taps of d forward in time (rows past the
  tile read through the cache); the first token block of a row also writes d_state.

An element costs W + 1 loads (x's taps and g), one exp and one store of d, then W loads of d and one store of dx:
from memory, x and g read once, d written and read once, dx written once.

Packed sequences are found on the device: each program binary-searches its tokens' offsets in ``cu_seqlens``
(log2 N steps over a small cached array), giving each token t its sequence's start and end; a tap t-j counts when
t-j >= start (for pre, and so for d and dw), a term d[t+j] of dx's sum when t+j < end (and t >= start, false only
before the first offset). Nothing is read back to the host: shapes decide everything.

Layout: x and grad_y are read through their three strides (a column slice of a wider projection output [B, T, N],
e.g. the q | k | v block, is read in place); the weights (1 to 3 tensors [C_i, W] whose rows stack to C: q_conv,
k_conv, v_conv) and the state through theirs, each channel from the weight that holds it. y, dx, d, the final
state, d_state and the weights' grads are contiguous.

Legend: B batch, T tokens, C channels, W kernel width, N packed sequences, G programs a channel block of the
backward's d-and-dw kernel (and its partial sums of dw).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kimik3.ops.glue.common import (
    _FLOATS,
    TILE_ELEMS,
    _jit,
    backward_programs,
    check_triton_device,
    compute_f64,
    describe,
    on_device,
    tl,
    triton,
    through_operator,
    MAX_CONV_WEIGHTS,
    check_conv_weights,
    sum_partials,
)

__all__ = ["MAX_WEIGHTS", "causal_conv", "causal_conv_backward", "causal_conv_forward"]

MAX_WEIGHTS = MAX_CONV_WEIGHTS
BLOCK_C_MAX = 128  # channels of a tile (contiguous in x: coalesced loads); tokens fill the rest of it
# The forward's tiles and dx's: TILE_ELEMS, 8 elements a thread (~40 and ~64 registers on sm_90). d-and-dw holds W
# taps and W accumulators an element besides the W weights a column: half the tile, 4 elements a thread (~80
# registers: 3 programs of 8 warps a multiprocessor; 8 elements a thread take ~160).
_D_TILE_ELEMS = TILE_ELEMS // 2
_D_PER_THREAD = 4
_DX_TILE_ELEMS = TILE_ELEMS
_DX_PER_THREAD = 8
_BLOCK_E = 256  # elements of dw [C * W] a program of the reduction adds over G
_BWD_PROGRAMS_PER_SM = 12  # d-and-dw programs (all channel blocks together) a multiprocessor on a GPU: 4 of 3


def _blocks(T: int, C: int, tile: int, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) from the shapes only: BLOCK_C the next power of two of C up to BLOCK_C_MAX,
    as many tokens as fit ``tile`` elements (at most the next power of two of T), ``per_thread`` elements a thread,
    1 to 8 warps."""
    block_c = min(BLOCK_C_MAX, triton.next_power_of_2(C))
    block_t = max(1, min(triton.next_power_of_2(max(T, 1)), tile // block_c))
    num_warps = max(1, min(8, block_t * block_c // (32 * per_thread)))
    return block_t, block_c, num_warps


def _check(x_BTC, weights, state_BCW, cu_seqlens, what) -> tuple[torch.Tensor, ...]:
    """Checks the arguments (shapes, dtypes, devices only); returns the weights as a tuple."""
    if not isinstance(x_BTC, torch.Tensor) or x_BTC.ndim != 3 or x_BTC.dtype not in _FLOATS:
        raise ValueError(f"x_BTC must be a floating tensor [B, T, C] (fp32, bf16, fp16 or fp64), got "
                         f"{describe(x_BTC)}")
    B, T, C = x_BTC.shape
    device = x_BTC.device
    weights = check_conv_weights(weights, C, device, "x_BTC")
    W = weights[0].shape[1]
    if state_BCW is not None:
        if not isinstance(state_BCW, torch.Tensor) or state_BCW.dtype not in _FLOATS:
            raise ValueError(f"state_BCW must be None or a floating tensor [B, C, W-1], got {describe(state_BCW)}")
        if tuple(state_BCW.shape) != (B, C, W - 1):
            raise ValueError(f"state_BCW must be [B={B}, C={C}, W-1={W - 1}] (W = {W} from the weights), got "
                             f"{tuple(state_BCW.shape)}")
        if state_BCW.device != device:
            raise ValueError(f"state_BCW is on {state_BCW.device} but x_BTC on {device}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be None or a 1-D int32/int64 tensor [N+1] of sorted offsets, got "
                             f"{describe(cu_seqlens)}")
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but x_BTC on {device}")
        if B != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need B = 1 (all of them along T), got B = {B}")
        if state_BCW is not None:
            raise ValueError("a carried state cannot be combined with packed cu_seqlens (each packed sequence "
                             "starts from zeros)")
    check_triton_device(x_BTC, what)
    return weights


def _starts(weights) -> tuple[int, ...]:
    """The first channel of each weight, and C: weight i holds channels [starts[i], starts[i+1])."""
    starts = [0]
    for w in weights:
        starts.append(starts[-1] + w.shape[0])
    return tuple(starts)


def _launch_args(x_BTC, weights, state_BCW, cu_seqlens) -> tuple[tuple, dict]:
    """The arguments the forward and backward kernels share (x, weights, state, cu_seqlens; placeholder pointers,
    never read, for an absent state or cu_seqlens) and their constexprs."""
    has_state, has_cu = state_BCW is not None, cu_seqlens is not None
    st = state_BCW if has_state else x_BTC
    s_st = state_BCW.stride() if has_state else (0, 0, 0)
    N = cu_seqlens.shape[0] - 1 if has_cu else 0
    top = 1 << (N.bit_length() - 1) if N > 0 else 0  # the binary search's first step
    args = (x_BTC, *x_BTC.stride(), weights, tuple(w.stride(0) for w in weights),
            tuple(w.stride(1) for w in weights), _starts(weights), st, *s_st,
            cu_seqlens if has_cu else x_BTC, N, top)
    consts = dict(NUM_W=len(weights), W=weights[0].shape[1], HAS_STATE=has_state, HAS_CU=has_cu)
    return args, consts


def causal_conv_forward(
    x_BTC: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    state_BCW: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [B, T, C] in x's dtype, final_state [B, C, W-1] in the state's dtype, or x's without one), one launch,
    forward only (no autograd graph). Arguments as ``causal_conv``."""
    weights = _check(x_BTC, weights, state_BCW, cu_seqlens, "causal_conv_forward")
    B, T, C = x_BTC.shape
    W = weights[0].shape[1]
    fs_dtype = state_BCW.dtype if state_BCW is not None else x_BTC.dtype
    y = torch.empty(B, T, C, dtype=x_BTC.dtype, device=x_BTC.device)
    if B == 0 or T == 0:  # nothing to convolve: the final state is the state
        if state_BCW is None:
            return y, torch.zeros(B, C, W - 1, dtype=fs_dtype, device=x_BTC.device)
        return y, state_BCW.clone(memory_format=torch.contiguous_format)
    final = torch.empty(B, C, W - 1, dtype=fs_dtype, device=x_BTC.device)
    block_t, block_c, num_warps = _blocks(T, C, TILE_ELEMS, 8)
    args, consts = _launch_args(x_BTC, weights, state_BCW, cu_seqlens)
    f64 = compute_f64(x_BTC, *weights, *([state_BCW] if state_BCW is not None else []))
    t_blocks = triton.cdiv(T, block_t)
    with on_device(x_BTC.device):
        _conv_fwd_kernel[(B * t_blocks, triton.cdiv(C, block_c))](
            *args, y, final, T, C, t_blocks, **consts, ACT=bool(activation), BLOCK_T=block_t, BLOCK_C=block_c,
            BLOCK_S=max(2, triton.next_power_of_2(W - 1)), BLOCK_W=triton.next_power_of_2(W), F64=f64,
            num_warps=num_warps,
        )
    return y, final


def causal_conv_backward(
    grad_y: torch.Tensor,
    x_BTC: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    state_BCW: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: bool = True,
    *,
    programs: int | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(d_x [B, T, C] in x's dtype, the weights' grads (a tuple, each [C_i, W] in its weight's dtype), d_state
    [B, C, W-1] in the state's dtype or None without one), all contiguous. grad_y: [B, T, C], any float dtype and
    strides. Three launches; deterministic. ``programs`` overrides G, the d-and-dw programs a channel block over
    which the token tiles are split (each writes one partial sum of dw; default: 12 a multiprocessor over all
    channel blocks on a GPU, 2 under the interpreter; never more than the tiles). dx does not depend on it."""
    weights = _check(x_BTC, weights, state_BCW, cu_seqlens, "causal_conv_backward")
    if not isinstance(grad_y, torch.Tensor) or grad_y.shape != x_BTC.shape or grad_y.dtype not in _FLOATS:
        raise ValueError(f"grad_y must be a floating tensor of x_BTC's shape {tuple(x_BTC.shape)}, got "
                         f"{describe(grad_y)}")
    if grad_y.device != x_BTC.device:
        raise ValueError(f"grad_y is on {grad_y.device} but x_BTC on {x_BTC.device}")
    B, T, C = x_BTC.shape
    W = weights[0].shape[1]
    device = x_BTC.device
    has_state = state_BCW is not None
    d_x = torch.empty(B, T, C, dtype=x_BTC.dtype, device=device)
    d_ws = tuple(torch.empty(w.shape, dtype=w.dtype, device=device) for w in weights)
    d_state = torch.empty(B, C, W - 1, dtype=state_BCW.dtype, device=device) if has_state else None
    if B == 0 or T == 0:
        for d in (*d_ws, *([d_state] if has_state else [])):
            d.zero_()
        return d_x, d_ws, d_state
    f64 = compute_f64(x_BTC, grad_y, *weights, *([state_BCW] if has_state else []))
    ct = torch.float64 if f64 else torch.float32
    args, consts = _launch_args(x_BTC, weights, state_BCW, cu_seqlens)
    block_w, block_s = triton.next_power_of_2(W), max(2, triton.next_power_of_2(W - 1))
    # d = dL/dpre and the partial sums of dw: G programs a channel block, each walking tiles p, p + G, ...
    block_t, block_c, num_warps = _blocks(T, C, _D_TILE_ELEMS, _D_PER_THREAD)
    t_blocks, c_blocks = triton.cdiv(T, block_t), triton.cdiv(C, block_c)
    tiles = B * t_blocks
    if programs is None:
        base = backward_programs(1 << 30, device)  # 2 a multiprocessor on a GPU, 2 under the interpreter
        programs = triton.cdiv(_BWD_PROGRAMS_PER_SM * base // 2, c_blocks) if device.type == "cuda" else base
    G = backward_programs(tiles, device, programs)
    d = torch.empty(B, T, C, dtype=ct, device=device)
    partial = torch.empty(G, C * W, dtype=ct, device=device)
    with on_device(device):
        _conv_bwd_d_kernel[(G, c_blocks)](
            *args, grad_y, *grad_y.stride(), d, partial, B, T, C, t_blocks, G // t_blocks, G % t_blocks, **consts,
            ACT=bool(activation), BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=block_w, F64=f64, num_warps=num_warps,
        )
        _conv_dw_kernel[(triton.cdiv(C * W, _BLOCK_E),)](
            partial, G, C * W, d_ws, _starts(weights), W,
            NUM_W=len(weights), BLOCK_G=min(16, triton.next_power_of_2(G)), BLOCK_E=_BLOCK_E, F64=f64, num_warps=4,
        )
        # dx (and d_state): one program a tile, as the forward
        block_t, block_c, num_warps = _blocks(T, C, _DX_TILE_ELEMS, _DX_PER_THREAD)
        t_blocks = triton.cdiv(T, block_t)
        _conv_bwd_dx_kernel[(B * t_blocks, triton.cdiv(C, block_c))](
            *args, d, d_x, d_state if has_state else d_x, T, C, t_blocks, **consts, BLOCK_T=block_t,
            BLOCK_C=block_c, BLOCK_S=block_s, BLOCK_W=block_w, F64=f64, num_warps=num_warps,
        )
    return d_x, d_ws, d_state


@torch.library.custom_op("kimik3::causal_conv", mutates_args=())
def _causal_conv_op(x_BTC: torch.Tensor, weights: list[torch.Tensor], state_BCW: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, activation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_conv_forward(x_BTC, weights, state_BCW, cu_seqlens, activation)


@_causal_conv_op.register_fake
def _(x_BTC, weights, state_BCW, cu_seqlens, activation):
    B, T, C = x_BTC.shape
    final_dtype = state_BCW.dtype if state_BCW is not None else x_BTC.dtype
    return x_BTC.new_empty((B, T, C)), x_BTC.new_empty((B, C, weights[0].shape[1] - 1), dtype=final_dtype)


@torch.library.custom_op("kimik3::causal_conv_backward", mutates_args=())
def _causal_conv_backward_op(grad_y: torch.Tensor, x_BTC: torch.Tensor, weights: list[torch.Tensor],
                             state_BCW: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                             activation: bool) -> list[torch.Tensor]:
    """[d_x, the weights' grads, d_state when there is a state]."""
    d_x, d_ws, d_state = causal_conv_backward(grad_y, x_BTC, weights, state_BCW, cu_seqlens, activation)
    return [d_x, *d_ws] + ([d_state] if d_state is not None else [])


@_causal_conv_backward_op.register_fake
def _(grad_y, x_BTC, weights, state_BCW, cu_seqlens, activation):
    return [x_BTC.new_empty(x_BTC.shape)] + [w.new_empty(w.shape) for w in weights] + (
        [state_BCW.new_empty(state_BCW.shape)] if state_BCW is not None else [])


def _setup_grads(ctx, inputs, output) -> None:
    x_BTC, weights, state_BCW, cu_seqlens, ctx.activation = inputs
    ctx.weights = len(weights)
    ctx.save_for_backward(x_BTC, state_BCW, cu_seqlens, *weights)
    ctx.mark_non_differentiable(output[1])


def _grads(ctx, grad_y, _grad_final):
    x_BTC, state_BCW, cu_seqlens, *weights = ctx.saved_tensors
    grads = _causal_conv_backward_op(grad_y, x_BTC, weights, state_BCW, cu_seqlens, ctx.activation)
    d_state = grads[1 + ctx.weights] if state_BCW is not None else None
    return grads[0], list(grads[1:1 + ctx.weights]), d_state, None, None


_causal_conv_op.register_autograd(_grads, setup_context=_setup_grads)


def causal_conv(
    x_BTC: torch.Tensor,
    weights: Sequence[torch.Tensor] | torch.Tensor,
    state_BCW: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``short_conv`` in the Triton kernels, differentiable in x, the weights and the state -> (y, final_state).

    Args:
        x_BTC: inputs [B, T, C], fp32, bf16, fp16 or fp64, any strides (a column slice of a wider projection
            output is read in place).
        weights: one tensor [C, W], or 1 to 3 tensors [C_i, W] with sum C_i = C, channel blocks in order
            (q_conv, k_conv, v_conv); any float dtypes and strides, read in place. ``weight[:, W-1]`` multiplies
            the current token. W >= 2.
        state_BCW: the previous W-1 inputs [B, C, W-1] (zeros when None), any float dtype and strides; not allowed
            with ``cu_seqlens``.
        cu_seqlens: [N+1] int32/int64 sorted offsets of packed sequences along T, normally 0 .. T (B must be 1);
            tokens of another sequence count as zeros. As in ``short_conv``, the tokens from the last offset on
            form one more sequence and those before the first see no other token. The values are not checked
            (reading them is a host sync).
        activation: SiLU on y (KDA's default) or not.
    Returns:
        (y [B, T, C] in x's dtype, final_state [B, C, W-1]: the last W-1 inputs, the state's columns first when
        T < W-1, in the state's dtype or x's without one). Computed in fp32 (fp64 when an input is fp64).
        final_state is not differentiable (marked so: a loss through it gets no gradient); grads of x, the
        weights and the state come in their dtypes.

    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. Forward: one launch; backward: three. A custom operator
    (``kimik3::causal_conv``): torch.compile traces around it.
    """
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    if not through_operator(x_BTC, state_BCW, *weights):
        return causal_conv_forward(x_BTC, weights, state_BCW, cu_seqlens, activation)
    weights = _check(x_BTC, weights, state_BCW, cu_seqlens, "causal_conv")   # the errors named here
    return _causal_conv_op(x_BTC, list(weights), state_BCW, cu_seqlens, bool(activation))


@_jit
def _bounds(cu_ptr, N, TOP, t, T):
    """(start, end) [BL] of the packed sequence holding each token t: cu[i] and cu[i+1] (T past the last offset)
    with i the number of cu[1..N] <= t, found by binary lifting over the sorted offsets (TOP: the largest power of
    two <= N, 0 when N = 0)."""
    idx = tl.zeros_like(t)
    step = TOP + 0 * tl.program_id(0)  # a runtime value even where TOP == 1 is specialised to a constant
    while step > 0:
        nxt = idx + step
        ok = nxt <= N
        v = tl.load(cu_ptr + nxt, mask=ok, other=0)
        idx = tl.where(ok & (v <= t), nxt, idx)
        step = step // 2
    start = tl.load(cu_ptr + idx).to(tl.int32)
    end = tl.load(cu_ptr + idx + 1, mask=idx < N, other=0).to(tl.int32)
    return start, tl.where(idx < N, end, T)


@_jit
def _ext(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r, cols, cmask, T,
         W: tl.constexpr, HAS_STATE: tl.constexpr, F64: tl.constexpr):
    """The extended input e [BL, BLOCK_C] of row b at times t = t0 + r (t0 a scalar, r [BL]): x[b, t] for
    0 <= t < T, state[b, :, W-1+t] for -(W-1) <= t < 0 (zeros without a state), zeros elsewhere. The row's base
    address is a 64-bit scalar, the per-element offsets 32-bit (fewer registers)."""
    ct = tl.float64 if F64 else tl.float32
    t = t0 + r
    in_x = (t >= 0) & (t < T)
    x_row = x_ptr + b * s_xb + tl.cast(t0, tl.int64) * s_xt  # (t0 may be a constant: T == 1 is specialised)
    e = tl.load(x_row + r[:, None] * s_xt + cols[None, :] * s_xc, mask=in_x[:, None] & cmask[None, :],
                other=0.0).to(ct)
    if HAS_STATE:
        if t0 < W:  # (every caller's t >= t0 - (W-1): only tiles at t0 < W reach the state; a branch keeps
            # the other tiles' loads free of it)
            in_s = (t < 0) & (t >= 1 - W)
            e += tl.load(st_ptr + b * s_sb + cols[None, :] * s_sc + (t + (W - 1))[:, None] * s_sk,
                         mask=in_s[:, None] & cmask[None, :], other=0.0).to(ct)
    return e


@_jit
def _taps(ws, s_wr, s_wc, starts, cols, NUM_W: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
          F64: tl.constexpr):
    """The weights of channels cols [BLOCK_C], as wt [BLOCK_W, BLOCK_C] with wt[k] = w[cols, k] (zeros past W and
    C), weight i holding channels [starts[i], starts[i+1]). Loaded once a program."""
    ct = tl.float64 if F64 else tl.float32
    k = tl.arange(0, BLOCK_W)
    wt = tl.zeros([BLOCK_W, cols.shape[0]], dtype=ct)
    for i in tl.static_range(NUM_W):
        mine = (cols >= starts[i]) & (cols < starts[i + 1])
        wt += tl.load(ws[i] + (cols - starts[i])[None, :] * s_wr[i] + k[:, None] * s_wc[i],
                      mask=(k < W)[:, None] & mine[None, :], other=0.0).to(ct)
    return wt


@_jit
def _wrow(wt, I: tl.constexpr, W: tl.constexpr):
    """w[cols, W-1-I] [BLOCK_C], row W-1-I of wt, picked with pure ops (which the compiler computes once for all
    their uses, as it would not share repeated loads)."""
    k = tl.arange(0, wt.shape[0])[:, None]
    return tl.sum(tl.where(k == W - 1 - I, wt, 0.0), axis=0)


@_jit
def _tap(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T, I: tl.constexpr,
         W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CU: tl.constexpr, F64: tl.constexpr):
    """Tap I of pre [BL, BLOCK_C] at times u = t0 + r: e[u-I], with HAS_CU zero where u-I < ``start`` [BL] (the
    first token of u's sequence; tap 0 always counts)."""
    e = _ext(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r - I, cols, cmask, T, W, HAS_STATE, F64)
    if HAS_CU:
        if I > 0:
            e = tl.where((t0 + r - I >= start)[:, None], e, 0.0)
    return e


@_jit
def _pre(x_ptr, s_xb, s_xt, s_xc, wt, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T,
         W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CU: tl.constexpr, F64: tl.constexpr):
    """pre [BL, BLOCK_C] at times u = t0 + r: sum_i w[:, W-1-i] e[u-i] (taps before ``start`` zeroed with
    HAS_CU)."""
    pre = _tap(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T, 0, W,
               HAS_STATE, HAS_CU, F64) * _wrow(wt, 0, W)[None, :]
    for i in tl.static_range(1, W):
        pre += _tap(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T, i, W,
                    HAS_STATE, HAS_CU, F64) * _wrow(wt, i, W)[None, :]
    return pre


@_jit
def _conv_fwd_kernel(
    x_ptr, s_xb, s_xt, s_xc, ws, s_wr, s_wc, starts, st_ptr, s_sb, s_sc, s_sk, cu_ptr, N, TOP,
    y_ptr, fs_ptr, T, C, T_BLOCKS,
    NUM_W: tl.constexpr, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CU: tl.constexpr, ACT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
    F64: tl.constexpr,
):
    """Program (row b and token block, channel block): y[b, t, cols] = act(pre), stored contiguous [B, T, C]; the
    last token block of a row also stores final_state[b, cols, :] = e[T-W+1 .. T-1] (contiguous [B, C, W-1])."""
    pid = tl.program_id(0)
    pid_t = pid % T_BLOCKS
    b = (pid // T_BLOCKS).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    t0 = pid_t * BLOCK_T
    r = tl.arange(0, BLOCK_T)
    wt = _taps(ws, s_wr, s_wc, starts, cols, NUM_W, W, BLOCK_W, F64)
    start = r
    if HAS_CU:
        start, _ = _bounds(cu_ptr, N, TOP, t0 + r, T)
    acc = _pre(x_ptr, s_xb, s_xt, s_xc, wt, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T, W, HAS_STATE,
               HAS_CU, F64)
    if ACT:
        acc = acc / (1.0 + tl.exp(-acc))
    y_row = y_ptr + (b * T + t0) * C
    tl.store(y_row + r[:, None] * C + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(t0 + r < T)[:, None] & cmask[None, :])
    if pid_t == T_BLOCKS - 1:
        k = tl.arange(0, BLOCK_S)
        e = _ext(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, T - (W - 1), k, cols, cmask, T, W,
                 HAS_STATE, F64)
        tl.store(fs_ptr + b * C * (W - 1) + cols[None, :] * (W - 1) + k[:, None], e.to(fs_ptr.dtype.element_ty),
                 mask=(k < W - 1)[:, None] & cmask[None, :])


@_jit
def _conv_bwd_d_kernel(
    x_ptr, s_xb, s_xt, s_xc, ws, s_wr, s_wc, starts, st_ptr, s_sb, s_sc, s_sk, cu_ptr, N, TOP,
    g_ptr, s_gb, s_gt, s_gc, d_ptr, part_ptr, B, T, C, T_BLOCKS, G_ROWS, G_BLOCKS,
    NUM_W: tl.constexpr, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CU: tl.constexpr, ACT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, F64: tl.constexpr,
):
    """Program (p of G, channel block): tiles p, p + G, ... of the B * T_BLOCKS tiles (row b, token block) in
    row-major order (G = G_ROWS * T_BLOCKS + G_BLOCKS); stores d = g act'(pre) for them (contiguous [B, T, C]) and
    its partial sums of dw, sum over its tiles of d[t] e[t-i] (the taps of pre, held from computing it, summed
    elementwise and over the tile's tokens at the end), to part_ptr[p, c * W + W-1-i] ([G, C * W])."""
    ct = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    r = tl.arange(0, BLOCK_T)
    wt = _taps(ws, s_wr, s_wc, starts, cols, NUM_W, W, BLOCK_W, F64)
    wk = ()
    for i in tl.static_range(W):
        wk = wk + (_wrow(wt, i, W)[None, :],)
    acc = (tl.zeros([BLOCK_T, BLOCK_C], dtype=ct),) * W  # acc[i]: d[t] e[t-i] summed over the tiles
    row = pid // T_BLOCKS
    blk = pid % T_BLOCKS
    while row < B:  # (a while loop: Triton 3.6's interpreter cannot take tensor bounds in range(), triton#9171)
        b = row.to(tl.int64)
        t0 = blk * BLOCK_T
        start = r
        if HAS_CU:
            start, _ = _bounds(cu_ptr, N, TOP, t0 + r, T)
        taps = ()
        pre = tl.zeros([BLOCK_T, BLOCK_C], dtype=ct)
        for i in tl.static_range(W):
            e = _tap(x_ptr, s_xb, s_xt, s_xc, st_ptr, s_sb, s_sc, s_sk, b, t0, r, start, cols, cmask, T, i, W,
                     HAS_STATE, HAS_CU, F64)
            taps = taps + (e,)
            pre += e * wk[i]
        rmask = (t0 + r < T)[:, None] & cmask[None, :]
        g_row = g_ptr + b * s_gb + tl.cast(t0, tl.int64) * s_gt
        d = tl.load(g_row + r[:, None] * s_gt + cols[None, :] * s_gc, mask=rmask, other=0.0).to(ct)
        if ACT:
            s = 1.0 / (1.0 + tl.exp(-pre))
            d = d * (s * (1.0 + pre * (1.0 - s)))
        tl.store(d_ptr + (b * T + t0) * C + r[:, None] * C + cols[None, :], d, mask=rmask)
        new = ()
        for i in tl.static_range(W):
            new = new + (acc[i] + d * taps[i],)
        acc = new
        blk += G_BLOCKS  # the next tile, p + G further (no division in the loop)
        wrap = blk >= T_BLOCKS
        blk = tl.where(wrap, blk - T_BLOCKS, blk)
        row += G_ROWS + wrap.to(tl.int32)
    part = part_ptr + pid.to(tl.int64) * C * W + cols * W
    for i in tl.static_range(W):
        tl.store(part + (W - 1 - i), tl.sum(acc[i], axis=0), mask=cmask)


@_jit
def _conv_bwd_dx_kernel(
    x_ptr, s_xb, s_xt, s_xc, ws, s_wr, s_wc, starts, st_ptr, s_sb, s_sc, s_sk, cu_ptr, N, TOP,
    d_ptr, dx_ptr, dst_ptr, T, C, T_BLOCKS,
    NUM_W: tl.constexpr, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_CU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
    F64: tl.constexpr,
):
    """Program (row b and token block, channel block): dx[b, t, cols] = sum_j w[cols, W-1-j] d[t+j] over t+j < T
    (with HAS_CU: j = 0, or t+j < end and t >= start), from d contiguous [B, T, C], stored contiguous [B, T, C];
    the first token block of a row also stores d_state[b, cols, :], the same sum at the state's times (contiguous
    [B, C, W-1]). x and the state are not read."""
    ct = tl.float64 if F64 else tl.float32
    pid = tl.program_id(0)
    pid_t = pid % T_BLOCKS
    b = (pid // T_BLOCKS).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    t0 = pid_t * BLOCK_T
    r = tl.arange(0, BLOCK_T)
    t = t0 + r
    wt = _taps(ws, s_wr, s_wc, starts, cols, NUM_W, W, BLOCK_W, F64)
    wk = ()
    for j in tl.static_range(W):
        wk = wk + (_wrow(wt, j, W)[None, :],)
    if HAS_CU:
        start, end = _bounds(cu_ptr, N, TOP, t, T)
    d_row = d_ptr + (b * T + t0) * C
    acc = tl.load(d_row + r[:, None] * C + cols[None, :], mask=(t < T)[:, None] & cmask[None, :],
                  other=0.0).to(ct) * wk[0]
    for j in tl.static_range(1, W):
        m = t + j < T
        if HAS_CU:
            m = m & (t + j < end) & (t >= start)
        acc += tl.load(d_row + (r + j)[:, None] * C + cols[None, :], mask=m[:, None] & cmask[None, :],
                       other=0.0).to(ct) * wk[j]
    tl.store(dx_ptr + (b * T + t0) * C + r[:, None] * C + cols[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & cmask[None, :])
    if HAS_STATE:
        if pid_t == 0:
            s = tl.arange(0, BLOCK_S) - (W - 1)  # the state's times; rows s >= 0 are padding
            ds = tl.zeros([BLOCK_S, BLOCK_C], dtype=ct)
            for j in tl.static_range(1, W):  # (d is zero before t = 0)
                ok = (s < 0) & (s + j >= 0) & (s + j < T)
                ds += tl.load(d_ptr + b * T * C + (s + j)[:, None] * C + cols[None, :],
                              mask=ok[:, None] & cmask[None, :], other=0.0).to(ct) * wk[j]
            tl.store(dst_ptr + b * C * (W - 1) + cols[None, :] * (W - 1) + (s + (W - 1))[:, None],
                     ds.to(dst_ptr.dtype.element_ty), mask=(s < 0)[:, None] & cmask[None, :])


@_jit
def _conv_dw_kernel(part_ptr, G, E, dws, starts, W, NUM_W: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_E: tl.constexpr, F64: tl.constexpr):
    """Program (block of dw's E = C * W elements): total = sum over G of the contiguous partials [G, E] (fixed
    order), stored into the weight that holds each element (weight i: elements [starts[i] W, starts[i+1] W) of
    the flattened [C, W]; its grad contiguous [C_i, W] in its dtype)."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    total = sum_partials(part_ptr, G, E, e, emask, BLOCK_G, BLOCK_E, F64)
    for i in tl.static_range(NUM_W):
        lo = starts[i] * W
        mine = emask & (e >= lo) & (e < starts[i + 1] * W)
        tl.store(dws[i] + (e - lo), total.to(dws[i].dtype.element_ty), mask=mine)
