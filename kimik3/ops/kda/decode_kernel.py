"""Decode (Triton): batched single-token KDA on a state pool updated in place.

One token for each of B sequences; each sequence b owns the state ``state_pool[slot[b]]`` of a pool
[P, H, K, V] fp32. Per (b, h, V block) program: S <- exp(g) * S (rows), S <- S + k (beta (v - S^T k))^T,
o = S^T (scale q); S is read once and written once (the op is state-bandwidth bound: 2 * K * V * 4
bytes per (b, h)). A negative slot skips the sequence (o = 0, no state touched), for padded batches.

Optional fusions as the K3 layer computes them: the gate g = g_min * sigmoid(exp(A_log) (z + dt_bias))
from the raw z, the q/k L2 norm (x / sqrt(sum x^2 + L2_EPS), fp32), beta = sigmoid(raw beta).
Forward only (serving).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .preact import L2_EPS

__all__ = ["launch_decode", "launch_verify"]


@triton.jit
def _gate_params(alog_ptr, dtb_ptr, i_h, ck, km, K, USE_GATE: tl.constexpr):
    """Head i_h's exp(A_log) and dt_bias [BK] for the fused gate (zeros when the gate comes precomputed)."""
    if USE_GATE:
        a = tl.exp(tl.load(alog_ptr + i_h).to(tl.float32))
        dtb = tl.load(dtb_ptr + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    else:
        a = 0.0
        dtb = tl.zeros(ck.shape, dtype=tl.float32)
    return a, dtb


@triton.jit
def _token_update(S, q, k, v, g, b, a, dtb, km, scale, g_min,
                  USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr):
    """One token's fused pre-activations and delta-rule update of a [BK, BV] state block: (new S, o [BV])."""
    if USE_GATE:
        g = tl.where(km, g_min * tl.sigmoid(a * (g + dtb)), 0.0)
    if USE_L2:
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
    if USE_BETA_SIG:
        b = tl.sigmoid(b)
    # Both K-reductions read the *loaded* state in one pass (no dependency between them):
    #   pred = (e S)^T k,  o = (e S + k delta^T)^T (scale q) = (e S)^T (scale q) + scale (q.k) delta
    e = tl.exp(g)
    qs = q * scale
    pred = tl.sum(S * (e * k)[:, None], axis=0)
    o1 = tl.sum(S * (e * qs)[:, None], axis=0)
    delta = b * (v - pred)
    S = S * e[:, None] + k[:, None] * delta[None, :]
    return S, o1 + tl.sum(qs * k, axis=0) * delta


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slot_ptr, o_ptr, alog_ptr, dtb_ptr,
    sq, sk, sv, sg, sb, H, scale, g_min,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    km = ck < K
    vm = cv < V
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    s_off = (slot * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    sm = km[:, None] & vm[None, :] & ok
    # Plain cached load and store: the state's lines stay in L2 between the two, and the store then writes
    # whole lines back (faster than evict_first or the .cg / .cs modifiers).
    S = tl.load(pool_ptr + s_off, mask=sm, other=0.0)
    base = i_bh.to(tl.int64)
    row = i_b.to(tl.int64)
    q = tl.load(q_ptr + row * sq + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * sk + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * sv + i_h * V + cv, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * sg + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    b = tl.load(beta_ptr + row * sb + i_h).to(tl.float32)
    a, dtb = _gate_params(alog_ptr, dtb_ptr, i_h, ck, km, K, USE_GATE)
    S, o = _token_update(S, q, k, v, g, b, a, dtb, km, scale, g_min, USE_GATE, USE_L2, USE_BETA_SIG, EPS)
    tl.store(pool_ptr + s_off, S, mask=sm)
    tl.store(o_ptr + base * V + cv, tl.where(ok, o, 0.0).to(o_ptr.dtype.element_ty), mask=vm)


def _default_blocks(BK: int, V: int, BH: int):
    BVF = max(16, triton.next_power_of_2(V))
    # Below 1024 (sequence, head) pairs the card is short of programs: 16-column blocks at one warp give the most of
    # them and were fastest for both kernels at every such shape swept (debug and K3 heads, batch 1-16, verify at
    # T = 2 and 4: benchmarks/decode_kernels.py, NOTES-serve.md). From 1024 pairs, 64-column blocks at 4 warps (the
    # H200 sweeps in benchmarks/NOTES-kda.md), halved while the state block is over 8,192 elements.
    if BH < 1024:
        return 16, 1
    BV = min(BVF, 64)
    while BK * BV > 8192 and BV > 16:
        BV //= 2
    return BV, 4


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, ...] with each row's elements contiguous (any stride between rows, e.g. column slices of one
    projection output): as it is; otherwise a contiguous copy."""
    inner = x[0] if x.shape[0] else x
    return x if x.shape[0] == 0 or inner.is_contiguous() else x.contiguous()


def launch_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, scale: Optional[float] = None,
    *, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, g_min: float = -5.0,
    use_gate_in_kernel: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    block_v: Optional[int] = None, num_warps: Optional[int] = None,
) -> torch.Tensor:
    """One KDA token for B sequences in the Triton kernel (``decode.kda_decode`` checks the inputs and dispatches here
    on CUDA); updates ``state_pool`` in place and returns o [B, H, V]. block_v, num_warps: the launch's V block and
    warps instead of the heuristic's (``benchmarks/kda_kernel.py``'s decode sweep).

    q, k, g: [B, H, K] (g is the raw gate input z when use_gate_in_kernel); v: [B, H, V];
    beta: [B, H]; state_pool: [P, H, K, V] float32 contiguous; slots: [B] integer indices into the
    pool (negative: skip). Slots must be distinct (each program owns its state rows). The inputs may have any
    stride between rows, as long as each row is contiguous.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (_rows(x) for x in (q, k, v, g, beta))
    o = torch.empty(B, H, V, device=q.device, dtype=v.dtype)
    if B == 0:
        return o
    BK = max(16, triton.next_power_of_2(K))
    BV, nw = _default_blocks(BK, V, B * H)
    BV = block_v or BV
    nw = num_warps or nw
    dummy = state_pool
    _decode_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, state_pool, slots.contiguous(), o,
        A_log.contiguous() if use_gate_in_kernel else dummy, dt_bias.contiguous() if use_gate_in_kernel else dummy,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), H, float(scale), float(g_min),
        K=K, V=V, BK=BK, BV=BV,
        USE_GATE=bool(use_gate_in_kernel), USE_L2=bool(use_qk_l2norm_in_kernel),
        USE_BETA_SIG=bool(use_beta_sigmoid_in_kernel), EPS=L2_EPS,
        num_warps=nw,
    )
    return o


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slot_ptr, steps_ptr, o_ptr, alog_ptr, dtb_ptr,
    sq, sk, sv, sg, sb, B, H, scale, g_min,
    T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr,
):
    # ``_decode_kernel`` walked over a row's T tokens: S is read from the pool once, and the state after token t is
    # written to steps[t, b] (the pool itself is not written). Inputs are [B, T, ...] rows with token stride s*
    # (row stride T * s*): token t of row b sits at (b * T + t) * s*.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    km = ck < K
    vm = cv < V
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    S = tl.load(pool_ptr + (slot * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :],
                mask=km[:, None] & vm[None, :] & ok, other=0.0)
    a, dtb = _gate_params(alog_ptr, dtb_ptr, i_h, ck, km, K, USE_GATE)
    for t in tl.static_range(T):
        tok = i_b.to(tl.int64) * T + t
        q = tl.load(q_ptr + tok * sq + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * sk + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * sv + i_h * V + cv, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * sg + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
        b = tl.load(beta_ptr + tok * sb + i_h).to(tl.float32)
        S, o = _token_update(S, q, k, v, g, b, a, dtb, km, scale, g_min, USE_GATE, USE_L2, USE_BETA_SIG, EPS)
        step = (t * B + i_b).to(tl.int64) * H + i_h
        tl.store(steps_ptr + step * (K * V) + ck[:, None] * V + cv[None, :], S, mask=km[:, None] & vm[None, :])
        tl.store(o_ptr + (tok * H + i_h) * V + cv, tl.where(ok, o, 0.0).to(o_ptr.dtype.element_ty), mask=vm)


def launch_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state_pool: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor, scale: Optional[float] = None,
    *, A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, g_min: float = -5.0,
    use_gate_in_kernel: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
) -> torch.Tensor:
    """T KDA tokens for each of B sequences from their pooled states, every step's state written to ``steps``
    [T, B, H, K, V] fp32 and the pool left as it is (``verify.kda_verify`` checks and dispatches here on CUDA).
    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]. Returns o [B, T, H, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    # One token per row of [B * T, ...], each token's elements contiguous.
    q, k, v, g, beta = (_rows(x.flatten(0, 1)) for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    if B == 0 or T == 0:
        return o
    BK = max(16, triton.next_power_of_2(K))
    BV, nw = _default_blocks(BK, V, B * H)
    dummy = state_pool
    _verify_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, state_pool, slots.contiguous(), steps, o,
        A_log.contiguous() if use_gate_in_kernel else dummy, dt_bias.contiguous() if use_gate_in_kernel else dummy,
        q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), B, H, float(scale), float(g_min),
        T=T, K=K, V=V, BK=BK, BV=BV,
        USE_GATE=bool(use_gate_in_kernel), USE_L2=bool(use_qk_l2norm_in_kernel),
        USE_BETA_SIG=bool(use_beta_sigmoid_in_kernel), EPS=L2_EPS,
        num_warps=nw,
    )
    return o
