"""Stage 3 of the KDA backward (Triton): the gradients through the intra-chunk matrices Aqk and A.

With dAqk and dA (from the WY backward, ``bwd_wy.py``; dA as NPART partials) and the partial
dq / dk / dGamma / dbeta the WY kernel stored, per chunk and 16-token row tile i:
    row side     dq_t   += sum_{s <= t} dAqk[t, s] k_s e^(Gamma_t - Gamma_s)
                 x_t     = sum_{s <  t} dA[t, s]   k_s e^(Gamma_t - Gamma_s)      (gradient of beta_t k_t)
    column side  dk_s   += sum_{t >= s} (dAqk[t, s] q_t + dA[t, s] beta_t k_t) e^(Gamma_t - Gamma_s)
    dk += beta x,  dbeta += rowsum(k x),  dGamma += q dq_row + beta k x - k dk_col,
and dg = the suffix sum of dGamma over the chunk. Every product is a dense [16, 16] x [16, BK] tl.dot:
the row side against the reference Gamma at row tile i's FIRST token, the column side against Gamma at
column tile i's LAST token, so every exponential factor is <= 1 except on the diagonal blocks, where the
gate bound keeps it <= e^75 (no position-pair path). Key columns are independent (dg's suffix sum runs
down one column): each program owns a block of BK columns and writes its own partial dbeta.

With the fused pre-activations (K3's layer), the kernel also applies their chain rules (``preact_bwd.py``'s math):
with the L2 norm or the sigmoid, one key block holds every column, so that ``_combine`` holds whole rows of dq and dk
and the complete dbeta and maps them through the L2 norm and the sigmoid (K <= 128; above, ``preact_bwd.py``'s pass
runs after this stage); the suffix-sum pass maps dg through the gate. Their gradients come out in the raw inputs'
dtype.

``_bwd_intra_rows_kernel`` runs per (chunk x row tile, head, key block), its loops over the other tiles not unrolled
(fla's chunk_kda_bwd_kernel_intra is organised this way), dGamma stored and turned into dg by ``_suffix_sum_kernel``.
On Hopper the Gluon kernel ``gluon/bwd_intra.py`` replaces the rows kernel (``dispatch.py``); the suffix pass runs
after either.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .dispatch import PREACT_INSIDE_MAX_K
from .plan import INTERPRET, ChunkPlan, next_pow2
from .preact import L2_EPS
from .preact_bwd import PreactInputs, gate_grad, l2_bwd_rows, sigmoid_bwd
from .prologue import gate_params
from .triton_common import _chunk_bounds, _chunk_columns, _chunk_part, part_grid


# The suffix-sum pass's key columns per program (``_suffix_sum_kernel``: one per thread, BK / 32 warps).
SUFFIX_BK = 128


# Its rows per step (1, 2, 4, 8 or 16; each of a program's four steps in flight holds STEP rows): one on the GPU (each
# thread walks its column); 16 under the Triton interpreter, where every step's operations cost the same
# whatever their size (the whole chunk in one round of four steps: the CPU test suite's backward passes about 20x
# faster there). tests/ops/test_kda_triton.py runs the GPU's step under the interpreter too.
SUFFIX_STEP = 16 if INTERPRET else 1


@triton.jit
def _parts(ptr, off, stride, NPART: tl.constexpr):
    """Sum of NPART partial buffers stride elements apart (the K-split WY kernel's dA)."""
    acc = tl.load(ptr + off)
    for p in tl.static_range(1, NPART):
        acc += tl.load(ptr + tl.full([], p, tl.int64) * stride + off)  # int64: can pass 2^31
    return acc


@triton.jit
def _parts_masked(ptr, off, stride, mask, NPART: tl.constexpr):
    """``_parts`` for a masked row vector (the partial dbeta)."""
    acc = tl.load(ptr + off, mask=mask, other=0.0)
    for p in tl.static_range(1, NPART):
        acc += tl.load(ptr + tl.full([], p, tl.int64) * stride + off, mask=mask, other=0.0)
    return acc


@triton.jit
def _f32_tile(ptr, off, m):
    """fp32 tile at the offsets off (mask m; 0 where masked): Gamma and the WY kernel's partial dq / dk / dGamma."""
    return tl.load(ptr + off, mask=m, other=0.0)


@triton.jit
def _row_block(i, j, g_n, k_ptr, G_ptr, daqk_ptr, da_ptr, t0, L, hk, km, a_base, H, part_a,
               K: tl.constexpr, PREC: tl.constexpr, NPART: tl.constexpr):
    """Row side, row tile i against column tile j <= i: (dAqk_ij kc, dA_ij kc) with kc = k_j e^(g_n - Gamma_j),
    g_n = Gamma at row tile i's first token (<= 1 for j < i, <= e^75 for j == i)."""
    r16 = tl.arange(0, 16)
    cols = j * 16 + r16
    mj = (cols < L)[:, None] & km[None, :]
    oj = (t0 + cols)[:, None] * (H * K) + hk[None, :]
    Gj = _f32_tile(G_ptr, oj, mj)
    kc = tl.load(k_ptr + oj, mask=mj, other=0.0).to(tl.float32) \
        * tl.exp(tl.where(mj, g_n[None, :] - Gj, float("-inf")))
    bo = a_base + (i * 16 + r16)[:, None] * 64 + cols[None, :]
    return (tl.dot(tl.load(daqk_ptr + bo), kc, input_precision=PREC),
            tl.dot(_parts(da_ptr, bo, part_a, NPART), kc, input_precision=PREC))


@triton.jit
def _col_block(i, m, g_l, q_ptr, k_ptr, G_ptr, beta_ptr, daqk_ptr, da_ptr, t0, L, i_h, hk, km, a_base, H,
               part_a, K: tl.constexpr, PREC: tl.constexpr, NPART: tl.constexpr):
    """Column side, column tile i against row tile m >= i: dAqk_mi^T (q_m f) + dA_mi^T (beta_m k_m f) with
    f = e^(Gamma_m - g_l), g_l = Gamma at column tile i's last token (<= 1 for m > i, <= e^75 for m == i)."""
    r16 = tl.arange(0, 16)
    rm = m * 16 + r16
    vm = rm < L
    mm = vm[:, None] & km[None, :]
    om = (t0 + rm)[:, None] * (H * K) + hk[None, :]
    f = tl.exp(tl.where(mm, _f32_tile(G_ptr, om, mm) - g_l[None, :], float("-inf")))
    qf = tl.load(q_ptr + om, mask=mm, other=0.0).to(tl.float32) * f
    bm = tl.load(beta_ptr + (t0 + rm) * H + i_h, mask=vm, other=0.0).to(tl.float32)
    bkf = tl.load(k_ptr + om, mask=mm, other=0.0).to(tl.float32) * bm[:, None] * f
    bo = a_base + rm[:, None] * 64 + (i * 16 + r16)[None, :]
    return (tl.dot(tl.trans(tl.load(daqk_ptr + bo)), qf, input_precision=PREC)
            + tl.dot(tl.trans(_parts(da_ptr, bo, part_a, NPART)), bkf, input_precision=PREC))


@triton.jit
def _combine(i, i_k, acc_q, acc_b, acc_c, g_n, g_l, q_ptr, k_ptr, G_ptr, beta_ptr, dq_ptr, dk_ptr, dG_ptr,
             dbeta_in_ptr, dbeta_ptr, t0, L, i_h, hk, km, H, part_beta, part_db,
             K: tl.constexpr, NPART: tl.constexpr, qr_ptr, kr_ptr, br_ptr, dq_out, dk_out,
             L2: tl.constexpr, BSIG: tl.constexpr, EPS: tl.constexpr):
    """Row tile i: the factors outside the products, the WY kernel's partials added; stores dq, dk (to dq_out,
    dk_out) and this key block's partial dbeta, returns the tile's complete dGamma (masked). L2 / BSIG (the
    program holds every key column: one key block): dq, dk, dbeta are complete here, and the fused L2 norm's
    and beta sigmoid's chain rules map them to the raw q, k, beta (qr_ptr, kr_ptr, br_ptr) before the store."""
    r16 = tl.arange(0, 16)
    rows = i * 16 + r16
    vi = rows < L
    mi = vi[:, None] & km[None, :]
    oi = (t0 + rows)[:, None] * (H * K) + hk[None, :]
    Gi = _f32_tile(G_ptr, oi, mi)
    qi = tl.load(q_ptr + oi, mask=mi, other=0.0).to(tl.float32)
    ki = tl.load(k_ptr + oi, mask=mi, other=0.0).to(tl.float32)
    bi = tl.load(beta_ptr + (t0 + rows) * H + i_h, mask=vi, other=0.0).to(tl.float32)
    er = tl.exp(tl.where(mi, Gi - g_n[None, :], float("-inf")))  # in [e^-75, 1]
    dq_r = acc_q * er
    x = acc_b * er  # gradient of the row operand beta k
    dk_c = acc_c * tl.exp(tl.where(mi, g_l[None, :] - Gi, float("-inf")))  # in [e^-75, 1]
    dq = _f32_tile(dq_ptr, oi, mi) + dq_r
    dk = _f32_tile(dk_ptr, oi, mi) + dk_c + bi[:, None] * x
    if L2:
        dq = l2_bwd_rows(tl.load(qr_ptr + oi, mask=mi, other=0.0).to(tl.float32), dq, EPS)
        dk = l2_bwd_rows(tl.load(kr_ptr + oi, mask=mi, other=0.0).to(tl.float32), dk, EPS)
    tl.store(dq_out + oi, dq.to(dq_out.dtype.element_ty), mask=mi)
    tl.store(dk_out + oi, dk.to(dk_out.dtype.element_ty), mask=mi)
    dG = _f32_tile(dG_ptr, oi, mi) + qi * dq_r + (bi[:, None] * ki) * x - ki * dk_c
    db = tl.sum(ki * x, axis=1)
    if i_k == 0:  # the WY kernel's partial dbeta, added once
        db += _parts_masked(dbeta_in_ptr, (t0 + rows) * H + i_h, part_beta, vi, NPART)
    if BSIG:
        db = sigmoid_bwd(tl.load(br_ptr + (t0 + rows) * H + i_h, mask=vi, other=0.0).to(tl.float32), db)
    tl.store(dbeta_ptr + i_k.to(tl.int64) * part_db + (t0 + rows) * H + i_h, db.to(dbeta_ptr.dtype.element_ty),
             mask=vi)
    return tl.where(mi, dG, 0.0)


@triton.jit
def _bwd_intra_rows_kernel(
    q_ptr, k_ptr, G_ptr, beta_ptr, daqk_ptr, da_ptr, dq_ptr, dk_ptr, dG_ptr, dbeta_in_ptr, dbeta_ptr,
    cu_ptr, cidx_ptr, H, part_beta, part_a, part_db, qr_ptr, kr_ptr, br_ptr, dq_out, dk_out,
    K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, NPART: tl.constexpr, NKB: tl.constexpr,
    INTERP: tl.constexpr, L2: tl.constexpr, BSIG: tl.constexpr, EPS: tl.constexpr,
):
    """"rows": one (chunk x row tile, head, key block); stores the tile's complete dGamma over the partial
    (``_suffix_sum_kernel`` then makes it dg). L2 / BSIG: the fused pre-activations' chain rules in
    ``_combine``."""
    i_t, i_h, p = _chunk_part(4 * NKB)
    i = p // NKB  # row tile; its key blocks (same dA blocks) are neighbours
    i_k = p % NKB
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    if i * 16 < L:
        ck = i_k * BK + tl.arange(0, BK)
        km = ck < K
        hk = i_h * K + ck
        a_base = (i_t * H + i_h) * 4096
        g_n = tl.load(G_ptr + (t0 + i * 16) * (H * K) + hk, mask=km, other=0.0)
        g_l = tl.load(G_ptr + (t0 + tl.minimum(i * 16 + 15, L - 1)) * (H * K) + hk, mask=km, other=0.0)
        acc_q = tl.zeros([16, BK], dtype=tl.float32)
        acc_b = tl.zeros([16, BK], dtype=tl.float32)
        acc_c = tl.zeros([16, BK], dtype=tl.float32)
        n_tiles = (L + 15) // 16
        if INTERP:  # the interpreter cannot range() over a runtime bound (numpy 2; NOTES-kda.md)
            j = 0
            while j <= i:
                pq, pb = _row_block(i, j, g_n, k_ptr, G_ptr, daqk_ptr, da_ptr, t0, L, hk, km, a_base, H, part_a,
                                    K, PREC, NPART)
                acc_q += pq
                acc_b += pb
                j += 1
            m = i
            while m < n_tiles:
                acc_c += _col_block(i, m, g_l, q_ptr, k_ptr, G_ptr, beta_ptr, daqk_ptr, da_ptr, t0, L, i_h, hk, km,
                                    a_base, H, part_a, K, PREC, NPART)
                m += 1
        else:
            for j in range(0, i + 1):
                pq, pb = _row_block(i, j, g_n, k_ptr, G_ptr, daqk_ptr, da_ptr, t0, L, hk, km, a_base, H, part_a,
                                    K, PREC, NPART)
                acc_q += pq
                acc_b += pb
            for m in range(i, n_tiles):
                acc_c += _col_block(i, m, g_l, q_ptr, k_ptr, G_ptr, beta_ptr, daqk_ptr, da_ptr, t0, L, i_h, hk, km,
                                    a_base, H, part_a, K, PREC, NPART)
        dG = _combine(i, i_k, acc_q, acc_b, acc_c, g_n, g_l, q_ptr, k_ptr, G_ptr, beta_ptr, dq_ptr, dk_ptr, dG_ptr,
                      dbeta_in_ptr, dbeta_ptr, t0, L, i_h, hk, km, H, part_beta, part_db, K, NPART,
                      qr_ptr, kr_ptr, br_ptr, dq_out, dk_out, L2, BSIG, EPS)
        rows = i * 16 + tl.arange(0, 16)
        tl.store(dG_ptr + (t0 + rows)[:, None] * (H * K) + hk[None, :], dG,
                 mask=(rows < L)[:, None] & km[None, :])


@triton.jit
def _suffix_rows(x_ptr, z_ptr, first, top, L, cm, HK, STEP: tl.constexpr, GATE: tl.constexpr):
    """Rows top - STEP + 1 .. top of a chunk's key block (nothing loaded past the chunk or before its first row):
    dGamma and, with the gate, the raw z (fp32; else dGamma again); [BK] vectors for one row, else [STEP, BK]."""
    if STEP == 1:
        m = cm & (top >= 0) & (top < L)
        x = tl.load(x_ptr + first + top * HK, mask=m, other=0.0)
        z = x
        if GATE:
            z = tl.load(z_ptr + first + top * HK, mask=m, other=0.0).to(tl.float32)
    else:
        rows = top - STEP + 1 + tl.arange(0, STEP)
        m = cm[None, :] & ((rows >= 0) & (rows < L))[:, None]
        o = first[None, :] + rows[:, None] * HK
        x = tl.load(x_ptr + o, mask=m, other=0.0)
        z = x
        if GATE:
            z = tl.load(z_ptr + o, mask=m, other=0.0).to(tl.float32)
    return x, z


@triton.jit
def _suffix_step(acc, pd, pa, x, z, top, L, cm, first, HK, x_ptr, dz_ptr, rate, bias, g_min, STEP: tl.constexpr,
                 GATE: tl.constexpr):
    """Rows top - STEP + 1 .. top of ``_suffix_sum_kernel``, walking up: each row's dg is the running sum acc (the
    rows below) plus its own and the step's later rows' dGamma, stored in place; GATE: the gate's chain rule on it
    instead (``preact_bwd.gate_grad``), dz stored and the rows added to the parameters' partials. Returns acc
    with the step's rows added."""
    if STEP == 1:  # (the GPU's form)
        m = cm & (top < L)
        acc += x
        if GATE:
            t, xg = gate_grad(acc, z, rate, bias, g_min, m)
            tl.store(dz_ptr + first + top * HK, (t * rate).to(dz_ptr.dtype.element_ty), mask=m)
            pd += t * rate
            pa += t * xg
        else:
            tl.store(x_ptr + first + top * HK, acc, mask=m)
    else:
        rows = top - STEP + 1 + tl.arange(0, STEP)
        m = cm[None, :] & (rows < L)[:, None]
        o = first[None, :] + rows[:, None] * HK
        dg = tl.cumsum(x, axis=0, reverse=True) + acc[None, :]
        acc += tl.sum(x, axis=0)
        if GATE:
            t, xg = gate_grad(dg, z, rate, bias[None, :], g_min, m)
            tl.store(dz_ptr + o, (t * rate).to(dz_ptr.dtype.element_ty), mask=m)
            pd += tl.sum(t * rate, axis=0)
            pa += tl.sum(t * xg, axis=0)
        else:
            tl.store(x_ptr + o, dg, mask=m)
    return acc, pd, pa


@triton.jit
def _suffix_sum_kernel(x_ptr, cu_ptr, cidx_ptr, H, z_ptr, alog_ptr, dtb_ptr, dz_ptr, pa_ptr, pd_ptr, g_min,
                       K: tl.constexpr, BK: tl.constexpr, NKB: tl.constexpr, GATE: tl.constexpr,
                       STEP: tl.constexpr):
    """Per (chunk, head, key block): x_t <- sum_{t' >= t in the chunk} x_t' (dGamma -> dg), in place; GATE: the fused
    gate's chain rule instead, dz to dz_ptr (the raw z's layout) and this block's partial d dt_bias (pd, [NT, H, K])
    and d A_log (pa, [NT, H, NKB]).

    The chunk's rows are walked from its last to its first, STEP rows a step: on the GPU one (``SUFFIX_STEP``), each
    thread holding one column's running sums, so that the suffix sum and d dt_bias's column sums need no exchange
    between threads (only d A_log's one sum at the end); four steps at a time, the next four loaded before these are
    stored (the compiler keeps a load after any earlier store that might alias it). Faster than a [64, 64] tile per
    program with the sums by scans and reductions across threads."""
    tl.static_assert(64 % (4 * STEP) == 0, "SUFFIX_STEP: rows a step must divide a chunk in rounds of four steps")
    i_t, i_h, i_k = _chunk_part(NKB)
    t0, L, c, cm, first = _chunk_columns(i_t, i_h, i_k, cidx_ptr, cu_ptr, H, K, BK)
    HK = H * K
    acc = tl.zeros([BK], tl.float32)
    pd = tl.zeros([BK], tl.float32)
    pa = tl.zeros([BK], tl.float32)
    rate = 0.0
    bias = pd
    if GATE:
        rate, bias = gate_params(alog_ptr, dtb_ptr, i_h, c, cm, K)
    x0, z0 = _suffix_rows(x_ptr, z_ptr, first, 63, L, cm, HK, STEP, GATE)
    x1, z1 = _suffix_rows(x_ptr, z_ptr, first, 63 - STEP, L, cm, HK, STEP, GATE)
    x2, z2 = _suffix_rows(x_ptr, z_ptr, first, 63 - 2 * STEP, L, cm, HK, STEP, GATE)
    x3, z3 = _suffix_rows(x_ptr, z_ptr, first, 63 - 3 * STEP, L, cm, HK, STEP, GATE)
    for b in tl.static_range(64 // (4 * STEP)):
        top = 63 - 4 * STEP * b
        y0, w0 = _suffix_rows(x_ptr, z_ptr, first, top - 4 * STEP, L, cm, HK, STEP, GATE)
        y1, w1 = _suffix_rows(x_ptr, z_ptr, first, top - 5 * STEP, L, cm, HK, STEP, GATE)
        y2, w2 = _suffix_rows(x_ptr, z_ptr, first, top - 6 * STEP, L, cm, HK, STEP, GATE)
        y3, w3 = _suffix_rows(x_ptr, z_ptr, first, top - 7 * STEP, L, cm, HK, STEP, GATE)
        acc, pd, pa = _suffix_step(acc, pd, pa, x0, z0, top, L, cm, first, HK, x_ptr, dz_ptr, rate, bias, g_min, STEP,
                                   GATE)
        acc, pd, pa = _suffix_step(acc, pd, pa, x1, z1, top - STEP, L, cm, first, HK, x_ptr, dz_ptr, rate, bias,
                                   g_min, STEP, GATE)
        acc, pd, pa = _suffix_step(acc, pd, pa, x2, z2, top - 2 * STEP, L, cm, first, HK, x_ptr, dz_ptr, rate, bias,
                                   g_min, STEP, GATE)
        acc, pd, pa = _suffix_step(acc, pd, pa, x3, z3, top - 3 * STEP, L, cm, first, HK, x_ptr, dz_ptr, rate, bias,
                                   g_min, STEP, GATE)
        x0, z0, x1, z1, x2, z2, x3, z3 = y0, w0, y1, w1, y2, w2, y3, w3
    if GATE:
        tl.store(pd_ptr + (i_t * H + i_h) * K + c, pd, mask=cm)
        tl.store(pa_ptr + (i_t * H + i_h) * NKB + i_k, tl.sum(pa, axis=0))


def fuses_preact(preact: Optional[PreactInputs], K: int) -> bool:
    """Whether ``bwd_intra`` applies the fused pre-activations' chain rules itself: always for the gate alone, and
    for the L2 norm or the sigmoid when every key column fits one program (``dispatch.PREACT_INSIDE_MAX_K``)."""
    if preact is None or not preact.any():
        return False
    return not (preact.use_l2 or preact.use_beta_sigmoid) or K <= PREACT_INSIDE_MAX_K


def bwd_intra(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, beta: torch.Tensor, daqk: torch.Tensor,
              da: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dg: torch.Tensor, dbeta_parts: torch.Tensor,
              dbeta: torch.Tensor, plan: ChunkPlan, npart: int, prec: str, gluon: bool,
              preact: Optional[PreactInputs] = None):
    """In place: dq, dk gain the intra-chunk parts, dg (holding the partial dGamma) becomes dg, dbeta the sum of every
    partial (``dbeta_parts``: the WY backward's npart partials, or dbeta itself when npart == 1). gluon: the rows
    kernel as ``gluon/bwd_intra.py``'s (``dispatch.py``).

    preact (the fused pre-activations' raw inputs) when ``fuses_preact``: the gradients w.r.t. the raw inputs
    instead, returned as (dq, dk, dz, dbeta, d A_log, d dt_bias), each fused stage's in its raw input's dtype
    (dq, dk, dg, dbeta themselves for a stage that was not fused; None for the two parameters without the
    gate). Else returns None."""
    B, T, H, K = q.shape
    NT = plan.NT
    BKF = next_pow2(K)
    fuse = fuses_preact(preact, K)
    l2 = fuse and preact.use_l2
    bsig = fuse and preact.use_beta_sigmoid
    gate = fuse and preact.use_gate
    BK = BKF if (l2 or bsig) else min(64, BKF)
    nkb = 1 if gluon else triton.cdiv(K, BK)  # the Gluon kernel holds every key column of a (chunk, head)
    new = torch.empty_like if plan.covers(B * T) else torch.zeros_like
    dq_out = new(preact.q) if l2 else dq
    dk_out = new(preact.k) if l2 else dk
    dbeta_k = dbeta if nkb == 1 else torch.empty(nkb, B, T, H, device=q.device, dtype=torch.float32)
    if bsig:  # one key block: the kernel completes dbeta and stores it through the sigmoid's chain rule
        dbeta = dbeta_k = new(preact.beta)
    raw = (preact.q, preact.k, preact.beta) if fuse else (q, k, beta)
    if gluon:
        from .gluon import bwd_intra as gluon_bwd_intra

        gluon_bwd_intra.launch(q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta_k, plan, H, npart,
                               raw=raw if fuse else None, out=(dq_out, dk_out), l2=l2, bsig=bsig, eps=L2_EPS)
    else:
        _bwd_intra_rows_kernel[part_grid(NT, H, 4 * nkb)](
            q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta_k, plan.cu, plan.chunk_idx, H,
            B * T * H, NT * H * 4096, B * T * H, *raw, dq_out, dk_out, K=K, BK=BK, PREC=prec, NPART=npart, NKB=nkb,
            INTERP=INTERPRET, L2=l2, BSIG=bsig, EPS=L2_EPS, num_warps=4)
    BKs = min(SUFFIX_BK, BKF)
    nks = triton.cdiv(K, BKs)
    dz, d_alog, d_dtb = dg, None, None
    gate_args = (dg, dg, dg, dg, dg, dg, 0.0)
    if gate:
        dz = new(preact.z)
        pa = torch.empty(NT, H, nks, device=q.device, dtype=torch.float32)
        pd = torch.empty(NT, H, K, device=q.device, dtype=torch.float32)
        gate_args = (preact.z, preact.A_log, preact.dt_bias, dz, pa, pd, float(preact.g_min))
    _suffix_sum_kernel[part_grid(NT, H, nks)](dg, plan.cu, plan.chunk_idx, H, *gate_args, K=K, BK=BKs, NKB=nks,
                                              GATE=gate, STEP=SUFFIX_STEP, num_warps=max(1, BKs // 32))
    if gate:
        d_alog, d_dtb = pa.sum((0, 2)), pd.sum(0).view_as(preact.dt_bias)
    if nkb > 1:
        torch.sum(dbeta_k, dim=0, out=dbeta)
    return (dq_out, dk_out, dz, dbeta, d_alog, d_dtb) if fuse else None
