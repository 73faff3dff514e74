"""Autograd wrapper of the Triton KDA forward, and the optional fused pre-activations.

Backward (version 2, default): Triton kernels (``triton_backward.kda_bwd_triton``) for the core
gradients w.r.t. the kernel's q, k, v, g (log-decay), beta and the initial state, from the forward's
saved intermediates (G, Aqk, T, W, U, qg, kg, exp(Gamma_C)), with the fused pre-activations' chain
rule (gate, q/k L2 norm, beta sigmoid) in one more Triton pass (``triton_preact.py``) or inside the
intra-chunk backward (``triton_bwd_intra.FUSE_PREACT_BWD``).

``KIMIK3_KDA_TRITON_BWD=torch`` selects version 1, the HYBRID backward: it recomputes the chunkwise
torch path (``chunk.chunk_kda_torch``, hand-written backward, exact to fp32) under autograd from the
saved inputs. Correct but slow; kept for A/B comparisons. Read at forward time.

Also: ``interpreter_bf16_fix()`` patches the Triton *interpreter's* bf16 arithmetic (tl.dot multiplies the raw
uint16 storage in Triton 3.6, and fp32 -> bf16 casts truncate): used by the CPU tests only.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .triton_forward import kda_fwd_triton, make_plan

__all__ = ["chunk_kda_triton", "torch_preactivations", "interpreter_bf16_fix", "triton_bwd_mode"]

BWD_ENV = "KIMIK3_KDA_TRITON_BWD"  # "triton" (default) or "torch" (the v1 hybrid)


def triton_bwd_mode() -> str:
    mode = os.environ.get(BWD_ENV, "triton").lower()
    if mode not in ("triton", "torch"):
        raise ValueError(f"{BWD_ENV} must be 'triton' or 'torch', got {mode!r}")
    return mode


def torch_preactivations(*args):
    """The fused pre-activations in torch (``kimik3.ops.kda._torch_preactivations``)."""
    from . import _torch_preactivations

    return _torch_preactivations(*args)


class _TritonKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, A_log, dt_bias, scale, cu_seqlens, output_final_state,
                g_min, use_gate, use_l2, use_beta_sigmoid):  # type: ignore[override]
        B, T = q.shape[:2]
        plan = make_plan(B, T, cu_seqlens, q.device)
        mode = triton_bwd_mode() if any(ctx.needs_input_grad[:8]) else None
        res = kda_fwd_triton(
            q, k, v, g, beta, scale, h0, output_final_state, plan,
            A_log=A_log, dt_bias=dt_bias, g_min=g_min,
            use_gate=use_gate, use_l2=use_l2, use_beta_sigmoid=use_beta_sigmoid,
            return_aux=mode == "triton",
        )
        o, ht = res[0], res[1]
        ctx.mode, ctx.plan = mode, plan
        if mode == "triton":
            aux = res[2]
            ctx.hilo = aux["hilo"]  # the forward scans' precision split, for the backward's state recompute
            keys = ("G", "aqk", "tinv", "w", "u", "qg", "kg", "eg", "h", "vn")  # h, vn: split forward only
            # the kernel's q, k, beta: the inputs themselves unless the L2 norm / sigmoid was fused
            extra = [aux["q"] if use_l2 else None, aux["k"] if use_l2 else None,
                     aux["beta"] if use_beta_sigmoid else None]
            ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, *extra, *(aux.get(x) for x in keys))
        else:
            ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias)
        ctx.args = (scale, cu_seqlens, g_min, use_gate, use_l2, use_beta_sigmoid, h0 is not None)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):  # type: ignore[override]
        if ctx.mode == "triton":
            return _triton_backward(ctx, do, dht)
        # HYBRID backward: recompute with the torch chunk path and differentiate it.
        from .chunk import chunk_kda_torch

        scale, cu_seqlens, g_min, use_gate, use_l2, use_beta_sigmoid, has_h0 = ctx.args
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() if (x is not None and x.is_floating_point()) else x for x in saved]
            q, k, v, g, beta, h0, A_log, dt_bias = leaves
            qq, kk, gg, bb = torch_preactivations(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2,
                                                  use_beta_sigmoid)
            o, ht = chunk_kda_torch(qq, kk, v, gg, bb, scale=scale, initial_state=h0,
                                    output_final_state=dht is not None, cu_seqlens=cu_seqlens)
            outs, grads_out = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads_out.append(dht)
            want = [x for x, nd in zip(leaves, ctx.needs_input_grad[:8]) if nd and x is not None]
            got = torch.autograd.grad(outs, want, grads_out, allow_unused=True) if want else ()
        it = iter(got)
        res = [next(it) if (nd and x is not None) else None for x, nd in zip(leaves, ctx.needs_input_grad[:8])]
        return tuple(res) + (None,) * 7


def _triton_backward(ctx, do, dht):
    """Triton core backward with the fused pre-activations' chain rule (Triton)."""
    from .triton_backward import kda_bwd_triton
    from .triton_preact import PreactInputs

    scale, cu_seqlens, g_min, use_gate, use_l2, use_beta_sigmoid, has_h0 = ctx.args
    saved = ctx.saved_tensors
    q, k, v, g, beta, h0, A_log, dt_bias = saved[:8]
    qn, kn, betan = saved[8:11]
    G, aqk, tinv, w, u, qg, kg, eg, h, vn = saved[11:]
    aux = dict(q=qn if use_l2 else q, k=kn if use_l2 else k, beta=betan if use_beta_sigmoid else beta,
               G=G, aqk=aqk, tinv=tinv, w=w, u=u, qg=qg, kg=kg, eg=eg, h=h, vn=vn, hilo=ctx.hilo)
    need = ctx.needs_input_grad[:8]
    preact = PreactInputs(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2, use_beta_sigmoid)
    res = kda_bwd_triton(do, dht, aux, v, h0, scale, ctx.plan, need_dh0=bool(has_h0 and need[5]), preact=preact)
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


def interpreter_bf16_fix() -> None:
    """Make the Triton interpreter compute with bf16 as the GPU does (test helper, idempotent). Triton 3.6's
    interpreter stores bf16 as uint16, and
    - np.matmul's the raw integers in tl.dot: such operands are converted to fp32 first (exact: bf16 -> fp32 is
      lossless);
    - rounds fp32 -> bf16 toward zero in ``.to(tl.bfloat16)``, where the GPU rounds to nearest even (1 + 3 * 2^-9
      becomes 1, not 1 + 2^-7): the cast goes through torch's round-to-nearest-even conversion instead.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    if getattr(builder_cls, "_kimik3_bf16_fixed", False):
        return
    orig_dot, orig_cast = builder_cls.create_dot, builder_cls.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def fix(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            return x

        return orig_dot(self, fix(a), fix(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interp.TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    builder_cls.create_dot, builder_cls.cast_impl = create_dot, cast_impl
    builder_cls._kimik3_bf16_fixed = True
