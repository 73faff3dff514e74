"""Token-level Kimi Delta Attention (KDA) recurrence.

This module holds the one-token-at-a-time form of KDA:

* ``naive_recurrent_kda`` -- the float32 token loop used as the numerical
  oracle for every faster path (slow, but obviously correct);
* ``recurrent_kda_step`` -- a single decode step, used by the serving engine
  and the model's cached decode;
* ``check_kda_inputs`` -- argument validation shared by all KDA entry points.

Per token t, with a per-head state S of shape [K, V]:

    S   = diag(exp(g_t)) S                         # channel-wise decay of rows
    S   = S + beta_t * k_t (v_t - S^T k_t)^T       # delta rule on the decayed state
    o_t = S^T (scale * q_t)

Shape legend (suffixes on tensor names):
    B  batch size
    T  sequence length (tokens)
    H  number of heads
    K  key / query head dim
    V  value head dim
    N  number of independent sequences: B, or len(cu_seqlens) - 1 when
       packed variable-length sequences are given
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from kimik3.ops.precision import no_autocast

__all__ = ["naive_recurrent_kda", "recurrent_kda_step", "check_kda_inputs", "KdaProblem"]


class KdaProblem(NamedTuple):
    """Sizes of a validated KDA call."""

    B: int
    T: int
    H: int
    K: int
    V: int
    # One (start, end) token range per independent sequence, into the T axis
    # (cu_seqlens given) or the whole T axis of each batch row (no cu_seqlens).
    seq_bounds: Tuple[Tuple[int, int], ...]

    @property
    def N(self) -> int:
        return len(self.seq_bounds)


def _check_float(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _check_gate_finite(g: torch.Tensor) -> None:
    # -inf is a legal (if extreme) log-decay for the token loop; +inf and NaN
    # never are, and would silently poison the whole state.
    # One reduction: amax propagates NaN, and is +inf iff some entry is.
    if g.numel() and not bool(g.detach().amax() < float("inf")):
        raise ValueError("g (log-decay) contains NaN or +inf values")


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    check_gate_finite: bool = True,
) -> KdaProblem:
    """Validate the arguments of a sequence-level KDA call.

    Args:
        q, k, g: [B, T, H, K] floating point.
        v: [B, T, H, V] floating point.
        beta: [B, T, H] floating point.
        initial_state: optional [N, H, K, V].
        cu_seqlens: optional 1-D integer tensor [N + 1] of token offsets;
            requires B == 1, starts at 0, ends at T, non-decreasing.
        check_gate_finite: refuse NaN / +inf in g (one reduction over g and a host sync). Off where g is
            the raw gate input of a fused, bounded gate (there +inf is harmless, NaN shows in the output).

    Returns:
        A ``KdaProblem`` with the sizes and per-sequence token ranges.

    Raises:
        ValueError: naming the offending argument.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dims), got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the same shape as q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the same shape as q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if check_gate_finite:
        _check_gate_finite(g)

    if cu_seqlens is None:
        seq_bounds = tuple((0, T) for _ in range(B))
    else:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"cu_seqlens must be an integer tensor, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                f"cu_seqlens must be 1-D with at least 2 entries [N + 1], got shape {tuple(cu_seqlens.shape)}"
            )
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (packed sequences), got batch size {B}")
        offsets = [int(x) for x in cu_seqlens.tolist()]
        if offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
        if offsets[-1] != T:
            raise ValueError(f"cu_seqlens must end at T={T}, got {offsets[-1]}")
        if any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
        seq_bounds = tuple(zip(offsets[:-1], offsets[1:]))

    N = len(seq_bounds)
    if initial_state is not None:
        _check_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state must have shape [N, H, K, V] = [{N}, {H}, {K}, {V}] "
                f"(N = {'number of sequences in cu_seqlens' if cu_seqlens is not None else 'batch size'}), "
                f"got {tuple(initial_state.shape)}"
            )
    return KdaProblem(B, T, H, K, V, seq_bounds)


def _token_update(
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g_BHK: torch.Tensor,
    beta_BH: torch.Tensor,
    state_BHKV: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One KDA token on float32 tensors (q already scaled); out of place, fp32 even under autocast."""
    with no_autocast(q_BHK.device):
        state_BHKV = state_BHKV * g_BHK.exp().unsqueeze(-1)
        pred_BHV = (k_BHK.unsqueeze(-2) @ state_BHKV).squeeze(-2)
        delta_BHV = beta_BH.unsqueeze(-1) * (v_BHV - pred_BHV)
        state_BHKV = state_BHKV + k_BHK.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        o_BHV = (q_BHK.unsqueeze(-2) @ state_BHKV).squeeze(-2)
    return o_BHV, state_BHKV


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference KDA: a float32 loop over tokens.

    Args:
        q, k: [B, T, H, K] queries / keys (any float dtype).
        v: [B, T, H, V] values.
        g: [B, T, H, K] per-channel log-decay (natural log, <= 0).
        beta: [B, T, H] delta-rule write strength in (0, 1).
        scale: multiplier on q; default K ** -0.5.
        initial_state: optional [N, H, K, V] state entering each sequence
            (cast to float32); zeros when omitted.
        output_final_state: also return the state after the last token.
        cu_seqlens: optional [N + 1] integer offsets of packed sequences
            (requires B == 1); the state restarts at each sequence start.

    Returns:
        o: [B, T, H, V] in v's dtype.
        final_state: [N, H, K, V] float32, or None unless output_final_state.

    All arithmetic is float32 and differentiable through torch autograd.
    """
    p = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = p.K**-0.5
    q_BTHK = q.float() * scale
    k_BTHK, v_BTHV, g_BTHK, beta_BTH = k.float(), v.float(), g.float(), beta.float()

    if cu_seqlens is None:
        # Batch rows are independent sequences of equal length: one token
        # loop serves all of them, batched.
        segments = [(slice(None), 0, p.T, slice(None))]
    else:
        # Packed sequences in the single batch row, each with its own state.
        segments = [(slice(0, 1), bos, eos, slice(n, n + 1)) for n, (bos, eos) in enumerate(p.seq_bounds)]

    o_tokens = []  # one [rows, H, V] per token, in packed order
    final_states = []
    for rows, bos, eos, state_rows in segments:
        if initial_state is not None:
            state_BHKV = initial_state[state_rows].float()
        else:
            state_BHKV = q_BTHK.new_zeros(q_BTHK[rows, 0:0].shape[0], p.H, p.K, p.V)
        for t in range(bos, eos):
            o_BHV, state_BHKV = _token_update(
                q_BTHK[rows, t], k_BTHK[rows, t], v_BTHV[rows, t], g_BTHK[rows, t], beta_BTH[rows, t], state_BHKV
            )
            o_tokens.append(o_BHV)
        final_states.append(state_BHKV)

    o_BTHV = torch.stack(o_tokens, dim=1) if o_tokens else v_BTHV.new_zeros(p.B, 0, p.H, p.V)
    final_state = torch.cat(final_states, dim=0) if output_final_state else None
    return o_BTHV.to(v.dtype), final_state


def recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Advance KDA by one token (decode).

    Args:
        q, k: [B, H, K] query / key of the new token.
        v: [B, H, V] value.
        g: [B, H, K] per-channel log-decay (<= 0).
        beta: [B, H] write strength in (0, 1).
        state: [B, H, K, V] state before the token (float32 expected; other
            float dtypes are upcast). Not modified.
        scale: multiplier on q; default K ** -0.5.

    Returns:
        o: [B, H, V] in v's dtype.
        new_state: [B, H, K, V] float32 (a new tensor).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state", state)):
        _check_float(name, x)
    if q.ndim != 3:
        raise ValueError(f"q must have shape [B, H, K] (3 dims), got {tuple(q.shape)}")
    B, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the same shape as q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the same shape as q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [B, H, V] = [{B}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[2]
    if beta.shape != q.shape[:2]:
        raise ValueError(f"beta must have shape [B, H] = [{B}, {H}], got {tuple(beta.shape)}")
    if tuple(state.shape) != (B, H, K, V):
        raise ValueError(f"state must have shape [B, H, K, V] = [{B}, {H}, {K}, {V}], got {tuple(state.shape)}")
    # No NaN/+inf scan of g here: it would force a device sync on every
    # decoded token, and the sequence-level entry points already guard prefill.
    if scale is None:
        scale = K**-0.5
    o_BHV, state_BHKV = _token_update(
        q.float() * scale, k.float(), v.float(), g.float(), beta.float(), state.float()
    )
    return o_BHV.to(v.dtype), state_BHKV
