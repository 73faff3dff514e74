"""Chunked KDA on the Triton / Gluon kernels as two custom operators, ``kimik3::kda_chunk_fwd`` (``forward.kda_fwd``,
returning the intermediates the backward reads) and ``kimik3::kda_chunk_bwd`` (``backward.kda_bwd`` from them),
joined by ``torch.library.register_autograd``, with the optional fused pre-activations (gate, q / k L2 norm, beta
sigmoid) differentiated inside the kernels.

Custom operators rather than an ``autograd.Function`` so that ``torch.compile`` traces a block around KDA in one
graph: the compiler sees each operator as one opaque call whose outputs' shapes the fake implementations give
(``_aux_shapes``), and never looks inside the kernels' host code (the chunk plan, the kernel choice, the launches).

Forward outputs, in order: o, then the final state when asked for, then (``need_aux``: a forward whose backward will
run) the intermediates named in ``_AUX``, then the kernel's q and k when the L2 norm is fused and its beta when the
sigmoid is (otherwise the backward reads the inputs themselves: an operator's outputs may not alias its inputs).
The number of chunks, which sizes the per-chunk intermediates, is B ceil(T / 64) without ``cu_seqlens`` and a
data-dependent size with it.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .backward import kda_bwd
from .forward import kda_fwd
from .plan import BT, make_plan
from .preact_bwd import PreactInputs

__all__ = ["chunk_kda_triton"]

# the forward's intermediates the backward reads (besides the kernel's q, k, beta)
_AUX = ("G", "aqk", "tinv", "w", "u", "qg", "kg", "eg", "h", "vn")


def _aux_shapes(q: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, NT, use_l2: bool,
                use_beta_sigmoid: bool) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each intermediate the forward operator returns, in output order (``forward.kda_fwd``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = torch.float32
    out = [((B, T, H, K), f32), ((NT, H, BT, BT), f32), ((NT, H, BT, BT), f32), ((B, T, H, K), q.dtype),
           ((B, T, H, V), f32), ((B, T, H, K), q.dtype), ((B, T, H, K), q.dtype), ((NT, H, K), f32),
           ((NT, H, K, V), q.dtype), ((B, T, H, V), f32)]
    if use_l2:
        out += [(tuple(q.shape), q.dtype)] * 2
    if use_beta_sigmoid:
        out.append((tuple(beta.shape), f32))
    return out


@torch.library.custom_op("kimik3::kda_chunk_fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         h0: Optional[torch.Tensor], A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
         cu_seqlens: Optional[torch.Tensor], scale: float, output_final_state: bool, g_min: float, use_gate: bool,
         use_l2: bool, use_beta_sigmoid: bool, need_aux: bool) -> list[torch.Tensor]:
    B, T = q.shape[:2]
    plan = make_plan(B, T, cu_seqlens, q.device)
    res = kda_fwd(q, k, v, g, beta, scale, h0, output_final_state, plan, A_log=A_log, dt_bias=dt_bias, g_min=g_min,
                  use_gate=use_gate, use_l2=use_l2, use_beta_sigmoid=use_beta_sigmoid, return_aux=need_aux)
    out = [res[0]] + ([res[1]] if output_final_state else [])
    if need_aux:
        aux = res[2]
        if aux is None:   # no chunk at all (T == 0): empty intermediates of the right shapes
            out += [q.new_empty(shape, dtype=dtype) for shape, dtype in
                    _aux_shapes(q, v, beta, 0, use_l2, use_beta_sigmoid)]
        else:
            out += [aux[x] for x in _AUX] + ([aux["q"], aux["k"]] if use_l2 else []) + (
                [aux["beta"]] if use_beta_sigmoid else [])
    return out


@_fwd.register_fake
def _fwd_fake(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, scale, output_final_state, g_min, use_gate, use_l2,
              use_beta_sigmoid, need_aux):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = [torch.empty_like(v)]
    if output_final_state:
        out.append(q.new_empty((N, H, K, V), dtype=torch.float32))
    if need_aux:
        NT = B * ((T + BT - 1) // BT) if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
        out += [q.new_empty(shape, dtype=dtype) for shape, dtype in _aux_shapes(q, v, beta, NT, use_l2,
                                                                                 use_beta_sigmoid)]
    return out


@torch.library.custom_op("kimik3::kda_chunk_bwd", mutates_args=())
def _bwd(do: torch.Tensor, dht: Optional[torch.Tensor], aux: Sequence[torch.Tensor], q: torch.Tensor,
         k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, h0: Optional[torch.Tensor],
         A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
         scale: float, g_min: float, use_gate: bool, use_l2: bool, use_beta_sigmoid: bool,
         need: int) -> list[torch.Tensor]:
    """The gradients of the inputs whose bit is set in ``need`` (bits 0-7: q, k, v, g, beta, h0, A_log, dt_bias), in
    that order."""
    B, T = q.shape[:2]
    plan = make_plan(B, T, cu_seqlens, q.device)
    saved = dict(zip(_AUX, aux))
    extra = list(aux[len(_AUX):])
    saved["q"], saved["k"] = (extra.pop(0), extra.pop(0)) if use_l2 else (q, k)
    saved["beta"] = extra.pop(0) if use_beta_sigmoid else beta
    preact = PreactInputs(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2, use_beta_sigmoid)
    res = kda_bwd(do, dht, saved, v, scale, plan, need_dh0=bool(need >> 5 & 1), preact=preact)
    out = []
    for i, (gx, x) in enumerate(zip(res, (q, k, v, g, beta, h0, A_log, dt_bias))):
        if need >> i & 1:
            out.append(gx.to(x.dtype).reshape(x.shape) if gx is not None else torch.zeros_like(x))
    return out


@_bwd.register_fake
def _bwd_fake(do, dht, aux, q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, scale, g_min, use_gate, use_l2,
              use_beta_sigmoid, need):
    inputs = (q, k, v, g, beta, h0, A_log, dt_bias)
    return [torch.empty_like(x) for i, x in enumerate(inputs) if need >> i & 1]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, scale, output_final_state, g_min, use_gate, use_l2, \
        use_beta_sigmoid, need_aux = inputs
    if not need_aux:
        ctx.aux_count = None
        return
    ctx.aux_count = len(output) - 1 - int(output_final_state)
    ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, *output[len(output) - ctx.aux_count:])
    ctx.args = (scale, g_min, use_gate, use_l2, use_beta_sigmoid, output_final_state)


def _backward(ctx, grads):
    if ctx.aux_count is None:
        raise RuntimeError("kda_chunk_fwd ran without its intermediates (need_aux=False) but a gradient is asked for: "
                           "call it through chunk_kda_triton, which keeps them whenever an input requires grad")
    scale, g_min, use_gate, use_l2, use_beta_sigmoid, output_final_state = ctx.args
    saved = ctx.saved_tensors
    q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens = saved[:9]
    aux = saved[9:]
    do = grads[0] if grads[0] is not None else torch.zeros_like(v)
    dht = grads[1] if output_final_state else None
    inputs = (q, k, v, g, beta, h0, A_log, dt_bias)
    need = sum(1 << i for i, (x, nd) in enumerate(zip(inputs, ctx.needs_input_grad[:8])) if nd and x is not None)
    out = iter(_bwd(do, dht, list(aux), q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, scale, g_min, use_gate,
                    use_l2, use_beta_sigmoid, need) if need else [])
    return tuple(next(out) if need >> i & 1 else None for i in range(8)) + (None,) * 8


_fwd.register_autograd(_backward, setup_context=_setup_context)


def chunk_kda_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    *, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, g_min: float = -5.0,
    use_gate_in_kernel: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Triton chunkwise KDA (inputs validated by the caller, ``chunk_kda``)."""
    K = q.shape[-1]
    if scale is None:
        scale = K**-0.5
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError("use_gate_in_kernel needs A_log [H] and dt_bias [H, K] (or [H * K])")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if use_gate_in_kernel:
        A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    else:
        A_log = dt_bias = None   # not read by the kernels without the fused gate
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    differentiable = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    need_aux = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in differentiable)
    out = _fwd(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, float(scale), bool(output_final_state),
               float(g_min), bool(use_gate_in_kernel), bool(use_qk_l2norm_in_kernel),
               bool(use_beta_sigmoid_in_kernel), need_aux)
    return out[0], (out[1] if output_final_state else None)
