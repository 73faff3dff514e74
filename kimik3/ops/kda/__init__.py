"""Kimi Delta Attention (KDA) operators.

Public API:
    naive_recurrent_kda  float32 token-loop reference (the oracle).
    chunk_kda            chunkwise-parallel path used for training / prefill.
    recurrent_kda_step   one-token update used for decoding.
    kda_decode           one token for B sequences on a state pool updated in place (Triton on CUDA).

Layout follows fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H];
states [N, H, K, V] float32. See ``naive.py`` for the recurrence and
``chunk.py`` for the chunkwise algorithm and the gate-bound contract.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

import importlib.util
import os

from .chunk import SUBTILE, chunk_kda_torch
from .decode import kda_decode
from .naive import check_kda_inputs, naive_recurrent_kda, recurrent_kda_step

__all__ = [
    "chunk_kda", "naive_recurrent_kda", "recurrent_kda_step", "chunk_kda_torch", "kda_decode",
    "kda_backend", "SUBTILE", "L2_EPS", "l2_normalize", "bounded_gate",
]

# Inside the square root of the q / k L2 norm, x / sqrt(sum x^2 + L2_EPS), wherever it is computed: the K3
# layer, the torch pre-activations, the Triton prologue, the chain rules and the decode kernel.
L2_EPS = 1e-6

# Backend override for chunk_kda: "torch", "triton" or "auto" (default).
BACKEND_ENV = "KIMIK3_KDA_BACKEND"


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kda_backend(q: torch.Tensor, chunk_size: int = 64, backend: Optional[str] = None) -> str:
    """The backend ``chunk_kda`` uses for these inputs: "triton" or "torch".

    ``backend`` (else the environment variable KIMIK3_KDA_BACKEND, else "auto"): "auto" picks
    Triton for CUDA tensors when triton is installed and chunk_size == 64 (forward and backward
    kernels, verified and timed on the H200: BENCHMARKS.md), else torch. "triton" forces the Triton
    kernels (CPU tensors only work under TRITON_INTERPRET=1; ``KIMIK3_KDA_TRITON_BWD=torch`` selects
    the older hybrid backward that re-runs the torch path); errors are raised, never answered by a
    fallback.
    """
    choice = (backend or os.environ.get(BACKEND_ENV) or "auto").lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"KDA backend must be 'auto', 'torch' or 'triton', got {choice!r}")
    if choice == "auto":
        return "triton" if (q.is_cuda and chunk_size == 64 and _triton_available()) else "torch"
    if choice == "triton":
        if not _triton_available():
            raise RuntimeError("KDA backend 'triton' requested but triton is not installed")
        if chunk_size != 64:
            raise ValueError(f"the Triton KDA kernels use chunk_size 64, got {chunk_size}")
    return choice


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + L2_EPS) over the last dim, in fp32, cast back (K3's q / k normalisation)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + L2_EPS)).to(x.dtype)


def bounded_gate(raw_BTHK: torch.Tensor, a_log_H: torch.Tensor, dt_bias_HK: torch.Tensor,
                 g_min: float) -> torch.Tensor:
    """K3's bounded log-decay g_min * sigmoid(exp(A_log) * (raw + dt_bias)), fp32, in (g_min, 0)."""
    H, K = raw_BTHK.shape[-2], raw_BTHK.shape[-1]
    rate = a_log_H.float().exp().view(H, 1)
    return g_min * torch.sigmoid(rate * (raw_BTHK.float() + dt_bias_HK.float().view(H, K)))


def _torch_preactivations(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2, use_beta_sigmoid):
    """The optional fused pre-activations in plain torch (fp32 math, cast back like the K3 layer):
    g = g_min * sigmoid(exp(A_log) * (z + dt_bias)); q, k <- x / sqrt(sum x^2 + L2_EPS); beta <- sigmoid(beta)."""
    if use_gate:
        g = bounded_gate(g, A_log, dt_bias, g_min)
    if use_l2:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta.float())
    return q, k, g, beta


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
        q, k, g, beta = _torch_preactivations(q, k, g, beta, A_log, dt_bias, lower_bound, use_gate_in_kernel,
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
    from .triton_autograd import chunk_kda_triton

    # With the gate fused, g is the raw input z and the kernel's log-decay lower_bound * sigmoid(...) lies in
    # [lower_bound, 0] for any z, +-inf included (the output and dz stay finite; dA_log is NaN there, in the
    # torch path too); a NaN in z shows as NaN in the output, as in fla. So no NaN / +inf scan over z: it cost
    # 0.08 ms and a host sync per call at K3's shape (H200), on the model's hot path. A raw log-decay g is
    # still checked: +inf or NaN there would break the kernels' bound.
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, check_gate_finite=not use_gate_in_kernel)
    return chunk_kda_triton(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, g_min=lower_bound,
        use_gate_in_kernel=use_gate_in_kernel, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
    )
