"""Causal depthwise short convolution (KDA's q/k/v convs), with a carried state for decoding.

Legend: B = batch, T = tokens, C = channels, W = kernel width.

``y_t = sum_j weight[:, W-1-j] * x_{t-j}``: a left-padded depthwise conv written as W shifted
multiply-adds, so that packed sequences (``cu_seqlens``) never see a neighbour's tokens and the
same code serves prefill (T tokens) and chunked prefill (T tokens after a state). The state is the last W-1
*inputs* of the sequence, [B, C, W-1].

``short_conv`` is the reference. What the KDA layer calls picks the Triton kernels on CUDA (``glue_backend``),
which compute in fp32 and read the layer's three weights and strided inputs in place:
- ``apply_short_conv``: T tokens (prefill, training; ``kimik3.ops.glue.causal_conv``, differentiable; elsewhere
  ``short_conv_torch``, the reference's math with a hand-written backward);
- ``short_conv_step``: one token (decode) over states held as rows of a pool, updated in place;
- ``short_conv_steps``: a speculative verification's T tokens from pooled states, the state after every token
  recorded and the pool left as it is (both ``kimik3.ops.glue.short_conv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kimik3.model.packing import positions_in_sequence
from kimik3.ops.glue import causal_conv, glue_backend, short_conv_decode
from kimik3.ops.glue import short_conv_steps as short_conv_steps_fused


def short_conv(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    state_BCW: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv (+ SiLU) over T.

    Args:
        x_BTC: inputs [B, T, C].
        weight_CW: per-channel kernel [C, W]; ``weight[:, -1]`` multiplies the current token.
        state_BCW: the previous W-1 inputs [B, C, W-1] (zeros when None); not allowed with
            ``cu_seqlens``, where every packed sequence starts from zeros.
        cu_seqlens: [N+1] offsets of packed sequences along T (B must be 1).
    Returns:
        (y [B, T, C] in x's dtype, new_state [B, C, W-1]: the last W-1 inputs seen).
    """
    state_BCW = _checked_state(x_BTC, weight_CW, state_BCW, cu_seqlens)
    length, width = x_BTC.shape[1], weight_CW.shape[1]
    x_ext = torch.cat([state_BCW.transpose(1, 2).to(x_BTC.dtype), x_BTC], dim=1)  # [B, W-1+T, C]
    masks = _lag_masks(cu_seqlens, length, width, x_BTC.dtype)
    y = x_BTC * weight_CW[:, width - 1]
    for lag in range(1, width):
        term = x_ext[:, width - 1 - lag: width - 1 - lag + length] * weight_CW[:, width - 1 - lag]
        if masks is not None:  # tokens lag steps back belong to another sequence
            term = term * masks[lag - 1]
        y = y + term
    new_state = x_ext[:, x_ext.shape[1] - (width - 1):].transpose(1, 2)
    if activation:
        y = F.silu(y)
    return y, new_state


def _checked_state(x_BTC, weight_CW, state_BCW, cu_seqlens) -> torch.Tensor:
    """The state to start from ([B, C, W-1], zeros when None), after checking the arguments."""
    batch, _, channels = x_BTC.shape
    width = weight_CW.shape[1]
    if weight_CW.shape[0] != channels:
        raise ValueError(f"short_conv: weight has {weight_CW.shape[0]} channels, x has {channels}")
    if cu_seqlens is not None and state_BCW is not None:
        raise ValueError("short_conv: a carried state cannot be combined with packed cu_seqlens")
    if state_BCW is None:
        return x_BTC.new_zeros(batch, channels, width - 1)
    if state_BCW.shape != (batch, channels, width - 1):
        raise ValueError(f"short_conv: state must be {(batch, channels, width - 1)}, got {tuple(state_BCW.shape)}")
    return state_BCW


def short_conv_torch(x_BTC: torch.Tensor, weight_CW: torch.Tensor, state_BCW: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, activation: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``short_conv``'s values and gradients (arguments and results as there; the new state a contiguous copy),
    differentiable through a hand-written backward: autograd through the reference keeps a product and a sum an
    input tap and walks each twice; here the taps accumulate in place into the pre-activation, which is saved, and
    the backward makes one buffer for the inputs' grads, adds each tap's share into it in place and sums each
    tap's weight grad in one multiply and one reduction."""
    state_BCW = _checked_state(x_BTC, weight_CW, state_BCW, cu_seqlens)
    return _ShortConvTorch.apply(x_BTC, weight_CW, state_BCW, cu_seqlens, bool(activation))


class _ShortConvTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTC, weight_CW, state_BCW, cu_seqlens, activation):
        length, width = x_BTC.shape[1], weight_CW.shape[1]
        x_ext = torch.cat([state_BCW.transpose(1, 2).to(x_BTC.dtype), x_BTC], dim=1)  # [B, W-1+T, C]
        masks = _lag_masks(cu_seqlens, length, width, x_BTC.dtype)
        pre = x_BTC * weight_CW[:, width - 1]
        for lag in range(1, width):
            tap = x_ext[:, width - 1 - lag: width - 1 - lag + length]
            pre.addcmul_(tap if masks is None else tap * masks[lag - 1], weight_CW[:, width - 1 - lag])
        ctx.save_for_backward(x_ext, weight_CW, pre if activation else None, *(masks or ()))
        ctx.activation, ctx.state_dtype = activation, state_BCW.dtype
        new_state = x_ext[:, x_ext.shape[1] - (width - 1):].transpose(1, 2).contiguous()
        return (F.silu(pre) if activation else pre), new_state

    @staticmethod
    def backward(ctx, grad_y, grad_state):
        x_ext, weight_CW, pre, *lag_masks = ctx.saved_tensors
        width = weight_CW.shape[1]
        length = x_ext.shape[1] - (width - 1)
        d = grad_y.to(x_ext.dtype)
        if ctx.activation:   # silu'(pre) = sigmoid (1 + pre (1 - sigmoid))
            sig = torch.sigmoid(pre)
            d = torch.rsub(sig, 1).mul_(pre).add_(1).mul_(sig).mul_(d)
        d_ext = torch.zeros_like(x_ext)
        d_weight = torch.empty_like(weight_CW)
        for j in range(width):   # tap j multiplies x_ext[:, j:j+T], the inputs W-1-j tokens back
            lag = width - 1 - j
            d_tap = d if lag == 0 or not lag_masks else d * lag_masks[lag - 1]
            d_ext[:, j:j + length].addcmul_(d_tap, weight_CW[:, j])
            if ctx.needs_input_grad[1]:
                d_weight[:, j] = (d_tap * x_ext[:, j:j + length]).sum((0, 1))
        if grad_state is not None:   # the new state is x_ext's last W-1 rows
            d_ext[:, length:] += grad_state.transpose(1, 2).to(d_ext.dtype)
        d_x = d_ext[:, width - 1:] if ctx.needs_input_grad[0] else None
        d_state = d_ext[:, :width - 1].transpose(1, 2).to(ctx.state_dtype) if ctx.needs_input_grad[2] else None
        return d_x, (d_weight if ctx.needs_input_grad[1] else None), d_state, None, None


def _lag_masks(cu_seqlens, length, width, dtype) -> list[torch.Tensor] | None:
    """For packed sequences, per lag l = 1 .. W-1 (index l - 1) the [1, T, 1] mask of the tokens whose input l steps
    back lies in their own sequence; None without packing."""
    if cu_seqlens is None:
        return None
    pos = positions_in_sequence(cu_seqlens, length)
    return [(pos >= lag).to(dtype)[None, :, None] for lag in range(1, width)]


def apply_short_conv(x_BTC: torch.Tensor, weights: Sequence[torch.Tensor], state_BCW: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``short_conv`` (+ SiLU) with the kernel given as [C_i, W] pieces whose rows stack to C (KDA's three):
    (y [B, T, C] in x's dtype, the last W-1 inputs [B, C, W-1]). ``backend``: as ``glue_backend``."""
    if glue_backend(x_BTC, backend) == "triton":
        return causal_conv(x_BTC, tuple(weights), state_BCW, cu_seqlens)
    return short_conv_torch(x_BTC, torch.cat(list(weights)).to(x_BTC.dtype), state_BCW, cu_seqlens)


def conv_state_at(x_BTC: torch.Tensor, state_BCW: torch.Tensor | None, ends_B: torch.Tensor,
                  width: int) -> torch.Tensor:
    """The conv state after the first ``ends_B[b]`` tokens of row b (a device tensor [B], 0 <= ends <= T): the
    inputs at ends - (W-1) .. ends - 1, taken from ``state_BCW`` (the W-1 inputs before x; zeros when None) where
    they fall before x. [B, C, W-1] in x's dtype; gathers only, no host read."""
    batch, _, channels = x_BTC.shape
    lags = torch.arange(1 - width, 0, device=x_BTC.device)
    pos_BJ = ends_B[:, None].to(lags.dtype) + lags[None, :]            # positions in x; negative: in the state
    from_x = x_BTC.gather(1, pos_BJ.clamp(min=0)[:, :, None].expand(-1, -1, channels)).transpose(1, 2)
    if state_BCW is None:
        from_state = torch.zeros_like(from_x)
    else:
        index = (pos_BJ + (width - 1)).clamp(0, width - 2)[:, None, :].expand(-1, channels, -1)
        from_state = state_BCW.to(x_BTC.dtype).gather(2, index)
    return torch.where((pos_BJ >= 0)[:, None, :], from_x, from_state)


def short_conv_step(x_BC: torch.Tensor, weights: Sequence[torch.Tensor], pool_PCW: torch.Tensor,
                    rows_B: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """One token of ``short_conv`` (+ SiLU) for B sequences whose states are rows ``rows_B`` of ``pool_PCW``
    [P, C, W-1] (-1 names the last row, a scratch row for padding), updated in place.

    x_BC [B, C] (rows may be strided); ``weights``: [C_i, W] kernels whose rows stack to C (KDA's three).
    Returns y [B, C] in x's dtype. ``backend``: as ``glue_backend``."""
    if glue_backend(x_BC, backend) == "triton":
        return short_conv_decode(x_BC, tuple(weights), pool_PCW, rows_B)
    weight_CW = torch.cat(list(weights)).to(x_BC.dtype)
    y_B1C, state_BCW = short_conv(x_BC[:, None], weight_CW, pool_PCW[rows_B])
    pool_PCW[rows_B] = state_BCW.to(pool_PCW.dtype)
    return y_B1C[:, 0]


def short_conv_steps(x_BTC: torch.Tensor, weights: Sequence[torch.Tensor], pool_PCW: torch.Tensor,
                     rows_B: torch.Tensor, steps_TBCW: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """T tokens of ``short_conv`` (+ SiLU) for B sequences continuing the states in rows ``rows_B`` of ``pool_PCW``
    [P, C, W-1], which are not written: the state after token t goes to ``steps_TBCW[t]`` [B, C, W-1] instead (in
    its dtype), as T calls of ``short_conv_step`` would leave the pool after each.

    x_BTC [B, T, C]; ``weights``: [C_i, W] kernels whose rows stack to C. Returns y [B, T, C] in x's dtype.
    ``backend``: as ``glue_backend``."""
    if glue_backend(x_BTC, backend) == "triton":
        return short_conv_steps_fused(x_BTC, tuple(weights), pool_PCW, rows_B, steps_TBCW)
    width = weights[0].shape[1]
    state_BCW = pool_PCW[rows_B]
    y_BTC, _ = short_conv(x_BTC, torch.cat(list(weights)).to(x_BTC.dtype), state_BCW)
    # The state after token t: the last W-1 of [the pooled inputs, x_0 .. x_t].
    history_BCX = torch.cat([state_BCW, x_BTC.transpose(1, 2).to(state_BCW.dtype)], dim=2)
    steps_TBCW.copy_(history_BCX.unfold(2, width - 1, 1)[:, :, 1:].permute(2, 0, 1, 3))
    return y_BTC
