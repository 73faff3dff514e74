"""The autograd Function of chunked KDA on the Triton / Gluon kernels: ``forward.kda_fwd`` saving its intermediates,
``backward.kda_bwd`` from them, with the optional fused pre-activations (gate, q / k L2 norm, beta sigmoid)
differentiated inside the kernels."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .backward import kda_bwd
from .forward import kda_fwd
from .plan import make_plan
from .preact_bwd import PreactInputs

__all__ = ["chunk_kda_triton"]

# the forward's intermediates the backward reads (besides the kernel's q, k, beta)
_AUX = ("G", "aqk", "tinv", "w", "u", "qg", "kg", "eg", "h", "vn")


class _TritonKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, A_log, dt_bias, scale, cu_seqlens, output_final_state,
                g_min, use_gate, use_l2, use_beta_sigmoid):  # type: ignore[override]
        B, T = q.shape[:2]
        plan = make_plan(B, T, cu_seqlens, q.device)
        grad = any(ctx.needs_input_grad[:8])
        res = kda_fwd(
            q, k, v, g, beta, scale, h0, output_final_state, plan,
            A_log=A_log, dt_bias=dt_bias, g_min=g_min,
            use_gate=use_gate, use_l2=use_l2, use_beta_sigmoid=use_beta_sigmoid,
            return_aux=grad,
        )
        o, ht = res[0], res[1]
        ctx.plan = plan
        if grad:
            aux = res[2]
            # the kernel's q, k, beta: the inputs themselves unless the L2 norm / sigmoid was fused
            extra = [aux["q"] if use_l2 else None, aux["k"] if use_l2 else None,
                     aux["beta"] if use_beta_sigmoid else None]
            ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, *extra, *(aux[x] for x in _AUX))
        ctx.args = (scale, g_min, use_gate, use_l2, use_beta_sigmoid, h0 is not None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        scale, g_min, use_gate, use_l2, use_beta_sigmoid, has_h0 = ctx.args
        saved = ctx.saved_tensors
        q, k, v, g, beta, h0, A_log, dt_bias = saved[:8]
        qn, kn, betan = saved[8:11]
        aux = dict(zip(_AUX, saved[11:]), q=qn if use_l2 else q, k=kn if use_l2 else k,
                   beta=betan if use_beta_sigmoid else beta)
        need = ctx.needs_input_grad[:8]
        preact = PreactInputs(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2, use_beta_sigmoid)
        res = kda_bwd(do, dht, aux, v, scale, ctx.plan, need_dh0=bool(has_h0 and need[5]), preact=preact)
        ref = (q, k, v, g, beta, h0, A_log, dt_bias)
        out = [None if (not nd or x is None or gx is None) else gx.to(x.dtype).view_as(x)
               for gx, x, nd in zip(res, ref, need)]
        return tuple(out) + (None,) * 7


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
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(q.device)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return _TritonKDAFunction.apply(
        q, k, v, g, beta, initial_state, A_log, dt_bias, float(scale), cu_seqlens, bool(output_final_state),
        float(g_min), bool(use_gate_in_kernel), bool(use_qk_l2norm_in_kernel), bool(use_beta_sigmoid_in_kernel),
    )
