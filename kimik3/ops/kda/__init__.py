"""Kimi Delta Attention (KDA) operators.

Public API:
    naive_recurrent_kda  float32 token-loop reference (the oracle).
    chunk_kda            chunkwise-parallel path used for training / prefill.
    recurrent_kda_step   one-token update used for decoding.
    kda_decode           one token for B sequences on a state pool updated in place (Triton on CUDA).
    explain_kernels      which kernel runs at every stage for given inputs (``dispatch.py``).

Layout follows fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
states [N, H, K, V] float32. See ``naive.py`` for the recurrence and
``chunk.py`` for the chunkwise algorithm and the gate-bound contract.

Files, by what they hold:
    naive.py, chunk*.py      the reference and the chunkwise torch path (any device)
    preact.py                K3's pre-activations in torch (bounded gate, L2 norm, sigmoid)
    dispatch.py              which backend and which kernel per stage (the table)
    forward.py, backward.py  the Triton pipelines, stage by stage; autograd.py joins them
    prologue.py, intra.py, solve.py, wy.py, fwd_scan.py, prep16.py      forward stages (Triton)
    bwd_scan.py, bwd_wy.py, bwd_intra.py, preact_bwd.py                 backward stages (Triton)
    gluon/                   the Hopper Gluon forms of some stages, and their runtime
    plan.py, triton_common.py  the chunk plan and the shared Triton helpers
    decode.py, decode_kernel.py  one-token decode on a state pool (dispatch + torch path, Triton kernel)
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .chunk import SUBTILE, chunk_kda_torch
from .decode import kda_decode
from .dispatch import explain as explain_kernels
from .dispatch import kda_backend
from .naive import check_kda_inputs, naive_recurrent_kda, recurrent_kda_step
from .preact import L2_EPS, bounded_gate, l2_normalize, torch_preactivations

__all__ = [
    "chunk_kda", "naive_recurrent_kda", "recurrent_kda_step", "chunk_kda_torch", "kda_decode", "explain_kernels",
    "kda_backend", "SUBTILE", "L2_EPS", "l2_normalize", "bounded_gate", "torch_preactivations",
]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    *,
    backend: Optional[str] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: float = -5.0,
    use_gate_in_kernel: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunkwise KDA; arguments and returns as ``chunk.chunk_kda_torch``.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: optional [N, H, K, V]; cu_seqlens: optional [N + 1] ints
    (B == 1). Returns o [B, T, H, V] (v's dtype) and the final state
    [N, H, K, V] float32 (None unless output_final_state).

    Backend: see ``kda_backend`` (CUDA + triton -> Triton kernels, else torch).
    Optional fused pre-activations (both backends, same math):
    use_gate_in_kernel: g is the raw gate input z and the log-decay is
    lower_bound * sigmoid(exp(A_log) * (z + dt_bias)) (A_log [H], dt_bias [H, K]);
    use_qk_l2norm_in_kernel: q, k are L2-normalised (eps 1e-6 inside the sqrt);
    use_beta_sigmoid_in_kernel: beta is the raw logit.
    """
    which = kda_backend(q, chunk_size, backend)
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError("use_gate_in_kernel needs A_log [H] and dt_bias [H, K]")
    if which == "torch":
        q, k, g, beta = torch_preactivations(q, k, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                                             use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel)
        return chunk_kda_torch(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_size=chunk_size,
        )
    from .autograd import chunk_kda_triton  # (imports triton)

    # With the gate fused, g is the raw input z and the kernel's log-decay lower_bound * sigmoid(...) lies in
    # [lower_bound, 0] for any z, +-inf included (the output and dz stay finite; dA_log is NaN there, in the
    # torch path too); a NaN in z shows as NaN in the output, as in fla. So no NaN / +inf scan over z: it would
    # cost a host sync per call on the model's hot path. A raw log-decay g is still checked: +inf or NaN there
    # would break the kernels' bound.
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, check_gate_finite=not use_gate_in_kernel)
    return chunk_kda_triton(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, g_min=lower_bound,
        use_gate_in_kernel=use_gate_in_kernel, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )
