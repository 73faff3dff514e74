"""The forward alone (no backward to feed) under K3's contract: the prologue folded into the chunk-local kernels.

``kda_fwd_triton`` with the gate, the q / k L2 norms and beta's sigmoid fused normally runs them as a prologue that
writes the cumulative log-decay Gamma (fp32) and the normalised q, k for the chunk kernels to read back, because the
backward needs them. A forward alone needs none of them stored: here every chunk-local kernel computes them again
from the raw inputs (z, q, k, beta logits), which costs arithmetic but no traffic.

``_local_a_kernel`` (this file) does phases A and B of ``triton_forward`` for one (chunk, head) per program: the
gate and Gamma from z, the row norms of q and k, beta's sigmoid, Aqk and diag(beta) Akk by the four 16-column
tiles (each tile's columns recomputed from a [16, K] reload of z and k, whose Gamma continues the rows' cumulative
sum from the row before the tile), then the solve T = (I + A)^-1 (``triton_solve._solve``) in place. Phase C runs
as ``gluon_local_wy.py`` (Gluon, Hopper) on the raw inputs the same way, and the scan with the output in it
(``gluon_scan.py``). ``triton_forward.LOCAL_FWD`` selects the path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_prologue import _gate_gamma, gate_params
from .triton_scan import _chunk_block, _chunk_bounds
from .triton_solve import _solve


@triton.jit
def _l2_tile(x_ptr, offs, m, EPS: tl.constexpr):
    """One tile of x (rows: tokens) in fp32, each row divided by sqrt(its sum of squares + EPS)."""
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + EPS)[:, None]


@triton.jit
def _l2_inv(x_ptr, offs, m, EPS: tl.constexpr):
    """1 / sqrt(sum_row x^2 + EPS) of one tile of x (rows: tokens), fp32."""
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=1) + EPS)


@triton.jit
def _row_of(x, r, row):
    """Row ``row`` of the fp32 tile x (rows indexed by r) as a vector over its columns."""
    return tl.sum(tl.where(r[:, None] == row, x, 0.0), axis=0)


@triton.jit
def _local_a_kernel(q_ptr, k_ptr, z_ptr, beta_ptr, alog_ptr, dtb_ptr, aqk_ptr, tinv_ptr, cu_ptr, cidx_ptr, H, g_min,
                    K: tl.constexpr, EPS: tl.constexpr, SOLVE: tl.constexpr, SPREC: tl.constexpr):
    """Aqk (lower, diagonal included, into aqk_ptr) and T = (I + diag(beta) Akk)^-1 (into tinv_ptr, A first), both
    [NT, H, 64, 64] fp32 and written whole, for the (chunk, head) of this program, from the raw q, k, z [.., H, K]
    and beta logits [.., H] (module docstring). The column tile j's reference is Gamma at its last valid token, as in
    ``triton_forward._a_tile``: the gate bound keeps both factors finite."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, 0, cidx_ptr, cu_ptr, H, K, K)
    _, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    NEG = float("-inf")
    G = _gate_gamma(z_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, True)
    rate, dtb = gate_params(alog_ptr, dtb_ptr, i_h, c, cm, K)
    beta = tl.sigmoid(tl.load(beta_ptr + (t0 + r) * H + i_h, mask=rv, other=0.0).to(tl.float32))
    beta = tl.where(rv, beta, 0.0)
    # the rows' L2 scales; the tiles are loaded again where they are used (L1 / L2 hits): held in registers through
    # the column tiles they made the kernel spill
    rq = _l2_inv(q_ptr, offs, m, EPS)
    rk = _l2_inv(k_ptr, offs, m, EPS)
    a_base = (i_t * H + i_h) * 4096  # this (chunk, head)'s 64 x 64 matrices
    r16 = tl.arange(0, 16)
    for j in tl.static_range(4):
        eps_j = _row_of(G, r, tl.minimum(j * 16 + 15, L - 1))  # Gamma at the tile's last valid token
        row_ok = (rv & (r >= j * 16))[:, None] & cm[None, :]  # rows before tile j are in its past: never read
        e_r = tl.exp(tl.where(row_ok, G - eps_j[None, :], NEG))  # (0, e^75]
        # the tile's own rows as columns: Gamma continued from the row before the tile over a reload of z, k
        s = j * 16 + r16
        sv = s < L
        ms = sv[:, None] & cm[None, :]
        so = (t0 + s)[:, None] * (H * K) + i_h * K + c[None, :]
        gs = g_min * tl.sigmoid(rate * (tl.load(z_ptr + so, mask=ms, other=0.0).to(tl.float32) + dtb[None, :]))
        Gs = tl.cumsum(tl.where(ms, gs, 0.0), axis=0)
        if j > 0:
            Gs += _row_of(G, r, j * 16 - 1)[None, :]
        e_s = tl.exp(tl.where(ms, eps_j[None, :] - Gs, NEG))  # [e^-75, 1]
        kc = tl.trans((_l2_tile(k_ptr, so, ms, EPS) * e_s).to(tl.bfloat16))
        qr = tl.load(q_ptr + offs, mask=row_ok, other=0.0).to(tl.float32)
        acc_q = tl.dot((qr * (e_r * rq[:, None])).to(tl.bfloat16), kc)
        kr = tl.load(k_ptr + offs, mask=row_ok, other=0.0).to(tl.float32)
        acc_k = tl.dot((kr * (e_r * rk[:, None])).to(tl.bfloat16), kc)
        o2 = a_base + r[:, None] * 64 + s[None, :]
        tl.store(aqk_ptr + o2, tl.where(r[:, None] >= s[None, :], acc_q, 0.0))
        tl.store(tinv_ptr + o2, tl.where(r[:, None] > s[None, :], acc_k * beta[:, None], 0.0))
    tl.debug_barrier()  # every tile of A is in the buffer before the solve reads it
    _solve(tinv_ptr, a_base, SOLVE, SPREC, 0)


def launch_local_a(q, k, z, beta, A_log, dt_bias, aqk, tinv, plan, H: int, K: int, g_min: float, eps: float,
                   solve: int, warps: int = 4) -> None:
    """``_local_a_kernel`` over the plan's chunks x heads (token layout [B, T, H, K] bf16 q, k, z; beta logits
    [B, T, H]; A_log [H]; dt_bias [H K]; Aqk and T as [NT, H, 64, 64] fp32)."""
    if K & (K - 1) or K < 16:
        raise ValueError(f"the local forward needs K a power of two >= 16, got {K}")
    _local_a_kernel[(plan.NT, H)](q, k, z, beta, A_log, dt_bias, aqk, tinv, plan.cu, plan.chunk_idx, H, float(g_min),
                                  K=K, EPS=eps, SOLVE=solve, SPREC="tf32", num_warps=warps)


def forward_local(q, k, v, z, beta, A_log, dt_bias, g_min: float, scale: float, h0, o, ht, plan, gluon_local_wy,
                  gluon_scan, solve: int) -> None:
    """The forward alone on the local path (module docstring), into o (and ht, the final states, when given):
    ``_local_a_kernel``, then phase C by ``gluon_local_wy`` and the scan with the output by ``gluon_scan``."""
    from . import L2_EPS
    from . import triton_forward as tf

    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    aqk = torch.empty(plan.NT, H, 64, 64, device=dev, dtype=torch.float32)
    tinv = torch.empty_like(aqk)
    launch_local_a(q, k, z, beta, A_log, dt_bias, aqk, tinv, plan, H, K, g_min, L2_EPS, solve, tf.LOCAL_A_WARPS)
    w, qg, kg = (torch.empty_like(q) for _ in range(3))
    u = torch.empty(B, T, H, V, device=dev, dtype=torch.float32)
    eg = torch.empty(plan.NT, H, K, device=dev, dtype=torch.float32)
    gluon_local_wy.launch(q, k, v, z, beta, A_log, dt_bias, tinv, w, u, qg, kg, eg, plan, H, g_min, L2_EPS)
    h0 = h0.float().contiguous() if h0 is not None else None
    gluon_scan.launch(kg, eg, w, u, h0, None, None, ht, plan, H, K, V, qg=qg, aqk=aqk, o=o, scale=scale)
