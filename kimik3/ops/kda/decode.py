"""Batched one-token KDA on a state pool: the dispatcher, its input checks and its torch path.

``kda_decode`` advances B sequences by one token each. Sequence b's state is row ``slots[b]`` of a pool
[P, H, K, V] fp32, updated in place; a negative slot skips its sequence (o = 0, no state touched). The
serving engine keeps every live sequence's state in such a pool, so a decode step reads and writes each
state once, with no gather into a batch and no scatter back.

Backends, as ``chunk_kda`` picks them (``dispatch.kda_backend``): the Triton kernel (``decode_kernel.py``) on CUDA
tensors, the torch path (gather, ``recurrent_kda_step``, scatter) on any other device.
"""

from __future__ import annotations

import torch

from .dispatch import kda_backend
from .naive import recurrent_kda_step
from .preact import torch_preactivations

__all__ = ["check_decode_inputs", "kda_decode", "kda_decode_torch"]


def check_decode_inputs(q, k, v, g, beta, state_pool, slots, use_gate_in_kernel, A_log, dt_bias) -> None:
    """Raise ValueError naming the first malformed argument (before anything is launched or written)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, K], got {tuple(q.shape)}")
    B, H, K = q.shape
    V = v.shape[-1]
    for name, x, shp in (("k", k, (B, H, K)), ("g", g, (B, H, K)), ("v", v, (B, H, V)), ("beta", beta, (B, H))):
        if tuple(x.shape) != shp:
            raise ValueError(f"{name} must have shape {shp}, got {tuple(x.shape)}")
    if state_pool.dtype != torch.float32 or state_pool.ndim != 4 or tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must be float32 [P, {H}, {K}, {V}], got {state_pool.dtype} "
                         f"{tuple(state_pool.shape)}")
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous (it is updated in place)")
    if slots.ndim != 1 or slots.shape[0] != B or slots.is_floating_point():
        raise ValueError(f"slots must be an integer tensor [B={B}], got {slots.dtype} {tuple(slots.shape)}")
    if use_gate_in_kernel and (A_log is None or dt_bias is None):
        raise ValueError("use_gate_in_kernel needs A_log [H] and dt_bias [H, K]")
    gate_params = (("A_log", A_log), ("dt_bias", dt_bias)) if use_gate_in_kernel else ()
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("slots", slots), *gate_params):
        if x.device != state_pool.device:
            raise ValueError(f"{name} is on {x.device} but state_pool on {state_pool.device}: every input of a "
                             "decode step must be on the pool's device")


def kda_decode_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None,
    *, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, g_min: float = -5.0,
    use_gate_in_kernel: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> torch.Tensor:
    """``kda_decode`` in plain torch: the fused pre-activations as ``chunk_kda``'s torch path computes them,
    then ``recurrent_kda_step`` on the gathered states, scattered back into the pool."""
    check_decode_inputs(q, k, v, g, beta, state_pool, slots, use_gate_in_kernel, A_log, dt_bias)
    q, k, g, beta = torch_preactivations(q, k, g, beta, A_log, dt_bias, g_min, use_gate_in_kernel,
                                          use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel)
    live = slots >= 0
    rows = slots.clamp_min(0)
    o, new_state = recurrent_kda_step(q, k, v, g, beta, state_pool[rows], scale)
    state_pool[slots[live]] = new_state[live]
    return torch.where(live[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


@torch.compiler.disable   # an opaque kernel call to torch.compile: traced, its launcher breaks on symbolic sizes
def kda_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, scale: float | None = None,
    *, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, g_min: float = -5.0,
    use_gate_in_kernel: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False, backend: str | None = None,
) -> torch.Tensor:
    """One KDA token for B sequences; updates ``state_pool`` in place and returns o [B, H, V] (v's dtype).

    q, k, g: [B, H, K] (g is the raw gate input z when use_gate_in_kernel); v: [B, H, V]; beta: [B, H];
    state_pool: [P, H, K, V] float32 contiguous; slots: [B] integer rows of the pool, distinct (negative:
    skip the sequence). The pre-activation flags mean what they mean for ``chunk_kda`` (g_min is its
    lower_bound). ``backend``: as ``kda_backend`` ("auto": Triton on CUDA tensors, else torch; "triton" on
    CPU tensors only under TRITON_INTERPRET=1)."""
    # (kda_backend's chunk-size check is for chunk_kda: the decode kernel has none, so pass the one it accepts)
    kw = {"A_log": A_log, "dt_bias": dt_bias, "g_min": g_min, "use_gate_in_kernel": use_gate_in_kernel,
          "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel, "use_beta_sigmoid_in_kernel": use_beta_sigmoid_in_kernel}
    if kda_backend(q, 64, backend) == "torch":
        return kda_decode_torch(q, k, v, g, beta, state_pool, slots, scale, **kw)
    check_decode_inputs(q, k, v, g, beta, state_pool, slots, use_gate_in_kernel, A_log, dt_bias)
    from .decode_kernel import launch_decode  # (imports triton)

    return launch_decode(q, k, v, g, beta, state_pool, slots, scale, **kw)
