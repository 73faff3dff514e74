"""KDA over a speculative verification: T tokens for each of B pooled sequences, the state after every token kept.

``kda_verify`` reads sequence b's state from row ``slots[b]`` of the pool [P, H, K, V] fp32 (never writing it),
advances it through the row's T tokens one at a time (the recurrence ``kda_decode`` runs for one token), and writes
the state after token t into ``steps[t, b]`` ([T, B, H, K, V] fp32), so that the serving engine can keep the state
after whichever token was accepted last (``kimik3.serve.paged_cache.StatePool.commit_steps``). A negative slot
marks a padding row: it starts from zeros and its o is 0.

Backends, as ``kda_decode``'s: the Triton kernel (``decode_kernel.launch_verify``: one launch walks all T tokens,
the state held in registers) on CUDA tensors, this file's torch path (``recurrent_kda_step`` token by token)
elsewhere.
"""

from __future__ import annotations

import torch

from .decode import check_decode_inputs
from .dispatch import kda_backend
from .naive import recurrent_kda_step
from .preact import torch_preactivations

__all__ = ["kda_verify", "kda_verify_torch"]


def _check(q, k, v, g, beta, state_pool, slots, steps, use_gate_in_kernel, A_log, dt_bias) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T = q.shape[:2]
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(x.shape[:2]) != (B, T):
            raise ValueError(f"{name} must start with [B, T] = [{B}, {T}], got {tuple(x.shape)}")
    check_decode_inputs(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_pool, slots, use_gate_in_kernel,
                        A_log, dt_bias)
    expected = (T, B, *state_pool.shape[1:])
    if steps.dtype != torch.float32 or tuple(steps.shape) != expected or not steps.is_contiguous():
        raise ValueError(f"steps must be contiguous float32 {expected}, got {steps.dtype} {tuple(steps.shape)}")


def kda_verify_torch(q, k, v, g, beta, state_pool, slots, steps, scale=None, *, A_log=None, dt_bias=None,
                     g_min=-5.0, use_gate_in_kernel=False, use_qk_l2norm_in_kernel=False,
                     use_beta_sigmoid_in_kernel=False) -> torch.Tensor:
    """``kda_verify`` in plain torch, token by token. Returns o [B, T, H, V]."""
    _check(q, k, v, g, beta, state_pool, slots, steps, use_gate_in_kernel, A_log, dt_bias)
    live = slots >= 0
    state = torch.where(live[:, None, None, None], state_pool[slots.clamp_min(0)], 0.0)
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, g_t, b_t = torch_preactivations(q[:, t], k[:, t], g[:, t], beta[:, t], A_log, dt_bias, g_min,
                                                  use_gate_in_kernel, use_qk_l2norm_in_kernel,
                                                  use_beta_sigmoid_in_kernel)
        o, state = recurrent_kda_step(q_t, k_t, v[:, t], g_t, b_t, state, scale)
        steps[t] = state
        outs.append(torch.where(live[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device)))
    return torch.stack(outs, dim=1)


@torch.compiler.disable   # an opaque kernel call to torch.compile (as kda_decode)
def kda_verify(q, k, v, g, beta, state_pool, slots, steps, scale=None, *, A_log=None, dt_bias=None, g_min=-5.0,
               use_gate_in_kernel=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
               backend: str | None = None) -> torch.Tensor:
    """T tokens for each of B sequences from their pooled states (see the module notes): o [B, T, H, V] in v's
    dtype; ``steps`` [T, B, H, K, V] receives every step's state; the pool is not written. q, k, g: [B, T, H, K];
    v: [B, T, H, V]; beta: [B, T, H]. ``backend``: as ``kda_decode``'s."""
    kw = {"A_log": A_log, "dt_bias": dt_bias, "g_min": g_min, "use_gate_in_kernel": use_gate_in_kernel,
          "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel}
    if kda_backend(q, 64, backend) == "torch":
        return kda_verify_torch(q, k, v, g, beta, state_pool, slots, steps, scale, **kw)
    _check(q, k, v, g, beta, state_pool, slots, steps, use_gate_in_kernel, A_log, dt_bias)
    from .decode_kernel import launch_verify  # (imports triton)

    return launch_verify(q, k, v, g, beta, state_pool, slots, steps, scale, **kw)
