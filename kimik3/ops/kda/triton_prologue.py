"""The prologue of the Triton KDA forward: what turns the layer's raw inputs into the chunk kernels' operands.

Per (chunk, head), or per row block: the optionally fused gate g = g_min * sigmoid(exp(A_log) (z + dt_bias)), the
within-chunk cumulative log-decay Gamma (fp32, token layout), the optional q / k L2 norms and beta's sigmoid
(written to side buffers only when fused). With the L2 norm fused, by default (``L2_ROWS``), the gate runs per
64-column block of each chunk (``_gate_cols_kernel``: the cumulative sum runs down each column, so blocks are
independent) and the norms over contiguous (token, head) rows (``_l2_norm_rows_kernel``). Otherwise the per-chunk
forms run: ``_prep0_kernel``, or with the norm fused and ``PREP_PARTS = 3`` ``_prep_parts_kernel``, three programs
per chunk and head.
``triton_forward.kda_fwd_triton`` calls ``launch_prologue``; the backward of these pre-activations is
``triton_preact.py``.
"""

from __future__ import annotations

import os
from typing import Tuple

import triton
import triton.language as tl

from . import L2_EPS
from .triton_scan import _chunk_block, _chunk_part, part_grid

# The prologue (``_prep0_kernel``) as one program per (chunk, head) doing the gate, the cumulative
# log-decay and both L2 norms (1), or as three programs per (chunk, head), each streaming one tensor (3:
# the gate, q's norm, k's norm; only with the L2 norm fused, else 1). H200, K3's shape, torch.profiler: 1
# 0.58 ms, 3 0.52 ms (fla: 0.36 for the same work in three kernels); forward -0.09 / -0.19 ms in two runs.
PREP_PARTS = int(os.environ.get("KIMIK3_KDA_PREP_PARTS", "3"))
# With the L2 norm fused: the norms of q and k as their own kernel over contiguous (token, head) rows
# (``_l2_norm_rows_kernel``, fla's layout: each program streams BR whole rows, BR * K * 2 contiguous bytes),
# the prologue kernel doing the gate alone; overrides PREP_PARTS. A chunk tile of one head is 64 rows of K
# elements at a stride of H * K. H200, K3's shape, same run (torch.profiler): the three-part prologue 0.513 ms,
# the two kernels 0.197 (norms, 4.1 TB/s) + 0.191 (gate) = 0.388 ms (fla's gate cumsum + two l2norms: 0.366);
# forward 2.906 -> 2.791 ms, forward+backward 11.860 -> 11.758. KIMIK3_KDA_L2_ROWS=0: the PREP_PARTS prologue.
# L2_ROWS_CONFIG: (rows per program, num_warps); GATE_COLS_WARPS: num_warps of ``_gate_cols_kernel``.
L2_ROWS = os.environ.get("KIMIK3_KDA_L2_ROWS", "1") == "1"
L2_ROWS_CONFIG: Tuple[int, int] = (64, 4)
GATE_COLS_WARPS = 4


@triton.jit
def _l2_scale(x, EPS: tl.constexpr):
    """x / sqrt(sum_row x^2 + EPS) for an fp32 tile whose rows are tokens."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + EPS)[:, None]


@triton.jit
def _l2_rows(x_ptr, out_ptr, offs, m, EPS: tl.constexpr):
    """``_l2_scale`` of one tile, loaded from x_ptr and stored at out_ptr."""
    x = _l2_scale(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), EPS)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _l2_norm_rows_kernel(q_ptr, k_ptr, qn_ptr, kn_ptr, R, K: tl.constexpr, BKF: tl.constexpr, BR: tl.constexpr,
                         EPS: tl.constexpr):
    """``_l2_rows`` over BR contiguous rows of the [R, K] view of q (grid axis 1 = 0) or k (1); R = B T H."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    c = tl.arange(0, BKF)
    m = (rows < R)[:, None] & (c < K)[None, :]
    offs = rows[:, None] * K + c[None, :]
    if tl.program_id(1) == 0:
        _l2_rows(q_ptr, qn_ptr, offs, m, EPS)
    else:
        _l2_rows(k_ptr, kn_ptr, offs, m, EPS)


@triton.jit
def _gate_gamma(g_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K: tl.constexpr, USE_GATE: tl.constexpr):
    """The (optionally fused) gate and the cumulative log-decay Gamma (fp32) of one [64, BK] chunk tile."""
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        a = tl.exp(tl.load(alog_ptr + i_h).to(tl.float32))
        dtb = tl.load(dtb_ptr + i_h * K + c, mask=cm, other=0.0).to(tl.float32)
        g = g_min * tl.sigmoid(a * (g + dtb[None, :]))
        g = tl.where(m, g, 0.0)
    return tl.cumsum(g, axis=0)


@triton.jit
def _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K: tl.constexpr,
                 USE_GATE: tl.constexpr):
    """``_gate_gamma`` of one chunk tile, stored at G_ptr. (Kept as two functions: inlined into one, ptxas gave
    ``_gate_cols_kernel`` 79 registers instead of 72, six CTAs per SM instead of seven.)"""
    tl.store(G_ptr + offs, _gate_gamma(g_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE), mask=m)


@triton.jit
def gate_params(alog_ptr, dtb_ptr, i_h, cols, cm, K: tl.constexpr):
    """Head i_h's gate parameters, fp32: its rate exp(A_log) and the dt_bias of its key columns cols (mask cm)."""
    rate = tl.exp(tl.load(alog_ptr + i_h).to(tl.float32))
    return rate, tl.load(dtb_ptr + i_h * K + cols, mask=cm, other=0.0).to(tl.float32)


@triton.jit
def _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H):
    """beta_t -> sigmoid(beta_t) on one chunk's rows (fp32)."""
    bo = (t0 + r) * H + i_h
    b = tl.load(beta_ptr + bo, mask=rv, other=0.0).to(tl.float32)
    tl.store(betan_ptr + bo, tl.sigmoid(b), mask=rv)


@triton.jit
def _prep0_kernel(
    g_ptr, G_ptr, q_ptr, k_ptr, qn_ptr, kn_ptr, beta_ptr, betan_ptr, alog_ptr, dtb_ptr,
    cu_ptr, cidx_ptr, H, g_min,
    K: tl.constexpr, BKF: tl.constexpr,
    USE_GATE: tl.constexpr, USE_L2: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr,
):
    """One (chunk, head): the gate, the cumulative log-decay, both L2 norms and beta's sigmoid."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, 0, cidx_ptr, cu_ptr, H, K, BKF)
    _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
    if USE_L2:
        _l2_rows(q_ptr, qn_ptr, offs, m, EPS)
        _l2_rows(k_ptr, kn_ptr, offs, m, EPS)
    if USE_BETA_SIG:
        _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H)


@triton.jit
def _gate_cols_kernel(g_ptr, G_ptr, beta_ptr, betan_ptr, alog_ptr, dtb_ptr, cu_ptr, cidx_ptr, H, g_min,
                      K: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, USE_GATE: tl.constexpr,
                      USE_BETA_SIG: tl.constexpr):
    """The gate and Gamma alone (``L2_ROWS``), one program per (chunk, head, BK-column block): the cumulative
    sum runs down each column, so the blocks are independent; the first also takes beta's sigmoid."""
    i_t, i_h, p = _chunk_part(NKB)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, p, cidx_ptr, cu_ptr, H, K, BK)
    _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
    if USE_BETA_SIG:
        if p == 0:
            _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H)


@triton.jit
def _prep_parts_kernel(
    g_ptr, G_ptr, q_ptr, k_ptr, qn_ptr, kn_ptr, beta_ptr, betan_ptr, alog_ptr, dtb_ptr,
    cu_ptr, cidx_ptr, H, g_min,
    K: tl.constexpr, BKF: tl.constexpr, USE_GATE: tl.constexpr, USE_BETA_SIG: tl.constexpr, EPS: tl.constexpr,
):
    """``_prep0_kernel`` with the L2 norm fused, as three programs per (chunk, head) (``PREP_PARTS`` 3), each
    streaming one tensor: part 0 the gate, Gamma and beta's sigmoid, part 1 q's L2 norm, part 2 k's."""
    i_t, i_h, p = _chunk_part(3)
    t0, r, rv, c, cm, m, offs = _chunk_block(i_t, i_h, 0, cidx_ptr, cu_ptr, H, K, BKF)
    if p == 0:
        _gate_cumsum(g_ptr, G_ptr, alog_ptr, dtb_ptr, offs, m, c, cm, i_h, g_min, K, USE_GATE)
        if USE_BETA_SIG:
            _beta_sigmoid(beta_ptr, betan_ptr, t0, r, rv, i_h, H)
    elif p == 1:
        _l2_rows(q_ptr, qn_ptr, offs, m, EPS)
    else:
        _l2_rows(k_ptr, kn_ptr, offs, m, EPS)


def launch_prologue(g, G, q, k, qn, kn, beta, betan, alog, dtb, plan, H, K, BKF, BK, g_min, use_gate, use_l2,
                    use_beta_sigmoid):
    """The gate, Gamma, the L2 norms and beta's sigmoid, as ``L2_ROWS`` / ``PREP_PARTS`` say. plan: the
    forward's ``ChunkPlan``; BKF: K padded to a power of two, BK: the column block (``triton_forward._cfg``)."""
    if PREP_PARTS not in (1, 3):
        raise ValueError(f"KIMIK3_KDA_PREP_PARTS must be 1 or 3, got {PREP_PARTS}")
    NT = plan.NT
    prep_args = (g, G, q, k, qn, kn, beta, betan, alog, dtb, plan.cu, plan.chunk_idx, H, g_min)
    prep_kw = dict(K=K, BKF=BKF, USE_GATE=use_gate, USE_BETA_SIG=use_beta_sigmoid, EPS=L2_EPS,
                   num_warps=4 if BKF <= 64 else 8)
    if L2_ROWS and use_l2:
        nkb = triton.cdiv(K, BK)
        _gate_cols_kernel[part_grid(NT, H, nkb)](
            g, G, beta, betan, alog, dtb, plan.cu, plan.chunk_idx, H, g_min,
            K=K, BK=BK, NKB=nkb, USE_GATE=use_gate, USE_BETA_SIG=use_beta_sigmoid, num_warps=GATE_COLS_WARPS,
        )
        rows, (BR, warps_r) = q.numel() // K, L2_ROWS_CONFIG
        _l2_norm_rows_kernel[(triton.cdiv(rows, BR), 2)](q, k, qn, kn, rows, K=K, BKF=BKF, BR=BR, EPS=L2_EPS,
                                                         num_warps=warps_r)
    elif PREP_PARTS == 3 and use_l2:
        _prep_parts_kernel[part_grid(NT, H, 3)](*prep_args, **prep_kw)
    else:
        _prep0_kernel[(NT, H)](*prep_args, USE_L2=use_l2, **prep_kw)
