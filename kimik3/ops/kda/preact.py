"""K3's KDA pre-activations in torch: the bounded gate, the q / k L2 norm and beta's sigmoid.

``chunk_kda`` and ``kda_decode`` can take the raw inputs and apply these inside the kernels
(``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel``); the torch paths, the K3 layer
and the references apply them here, with the same math (fp32, cast back).
"""

from __future__ import annotations

import torch

# Inside the square root of the q / k L2 norm, x / sqrt(sum x^2 + L2_EPS), wherever it is computed: the K3
# layer, the torch pre-activations, the Triton prologue, the chain rules and the decode kernel.
L2_EPS = 1e-6


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


def torch_preactivations(q, k, g, beta, A_log, dt_bias, g_min, use_gate, use_l2, use_beta_sigmoid):
    """The optional fused pre-activations in plain torch (fp32 math, cast back like the K3 layer):
    g = g_min * sigmoid(exp(A_log) * (z + dt_bias)); q, k <- x / sqrt(sum x^2 + L2_EPS); beta <- sigmoid(beta)."""
    if use_gate:
        g = bounded_gate(g, A_log, dt_bias, g_min)
    if use_l2:
        q, k = l2_normalize(q), l2_normalize(k)
    if use_beta_sigmoid:
        beta = torch.sigmoid(beta.float())
    return q, k, g, beta
