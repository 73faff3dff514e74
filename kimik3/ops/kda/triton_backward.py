"""Triton backward of chunkwise KDA (chunk 64, 16-token sub-tiles), exploiting the gate bound.

Math (per chunk, state S entering it; ``chunk.py`` / ``docs/kda.md`` for the forward):
    Gamma = chunk-local cumsum of g,  qg = q e^Gamma,  kg = k e^(Gamma_C - Gamma),  eg = e^Gamma_C,
    Rk = beta k e^Gamma,  Rv = beta v,  T = (I + A)^-1 with A[t, s] = beta_t sum_c k_t k_s e^(Gamma_t - Gamma_s)
    (s < t),  W = T Rk,  U = T Rv,  v_new = U - W S,
    o = scale (qg S + Aqk v_new),  S' = eg * S + kg^T v_new   (Aqk lower, diagonal included).

Backward, with dO = scale * do and dS' the gradient of the chunk's exit state:
    dv_new = Aqk^T dO + kg dS'                         (reverse scan, kernel 2)
    dS     = qg^T dO - W^T dv_new + eg * dS'           (reverse scan, kernel 2)
    dqg = dO S^T, dkg = v_new dS'^T, deg = rowsum(S * dS'), dAqk = dO v_new^T   (kernel 3)
    dRv = T^T dv_new, dRk = -dRv S^T, dA = -(dRk W^T + dRv U^T) (strict lower)  (kernel 3)
    then the chain rule through the exponentials (dGamma = x * dx for every x = y e^(+-Gamma)) and
    through Aqk / A on dense 16 x 16 blocks (kernel 4), and dg = suffix sum of dGamma over the chunk.

Kernels:
  1. ``_fwd_h_kernel`` (``triton_scan.py``) per (sequence, head, V block): re-runs the forward scan
     from the forward's W, U, kg, eg and stores every chunk's entry state h [NT, H, K, V] (``states_dtype``)
     and v_new [B, T, H, V] fp32 -- skipped when the forward ran split (the default) and saved both.
  2. ``_dvn_local_kernel`` per (chunk, head, V block): Aqk^T dO into the dv_new buffer, then
     ``_bwd_dh_kernel`` per (sequence, head, V block): reverse scan adding kg dS'; stores dh (gradient of
     each chunk's exit state) [NT, H, K, V] fp32 (16-bit with ``DH_16BIT``), dv_new, and d initial_state.
  3. ``_bwd_wy_kernel``  per (chunk, head): the V-contractions above, the K-independent ones first
     (``_wy_v_side``), then per BK-column key block (``_wy_k_side``); writes dv, the partial
     dq / dk / dGamma / dbeta, and dAqk, dA [NT, H, 64, 64] fp32 (with ``GLUON_WY_BWD``, ``gluon_bwd_wy.py``'s
     kernel instead: one program per (chunk, head), dA and dbeta whole).
  4. ``triton_bwd_intra.py``: the gradients through Aqk and A on 16 x 16 blocks, the partials added,
     and dGamma turned into dg by a suffix sum over the chunk; with ``preact`` (K3's layer) the fused
     pre-activations' chain rules there too, else by ``triton_preact.py``'s pass.

All matmuls are tl.dot with fp32 accumulation. Operands: fp32 at tf32x3 for fp32 inputs; for 16-bit
inputs fp32 at tf32, except in the two scans when the forward scan took 16-bit operands (variant
without 's'): then they take 16-bit operands with hi / lo splits (the interpreter computes exactly
either way).
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_bwd_intra import bwd_intra
from . import triton_forward
from .triton_forward import INTERPRET, ChunkPlan, _dot_dtype, _gluon_taking, _next_pow2
from .triton_preact import PreactInputs, preact_bwd_triton
from .triton_scan import (_chunk_beta, _chunk_block, _chunk_part, _chunk_tiles, _fwd_h_kernel, _load_rows,
                          _scan_program, _split16, _state_tile, part_grid, states_dtype)

BWD_WARPS = None  # override num_warps of the chunk-local kernels (benchmark sweeps)
WY_BLOCKS: Optional[Tuple[int, int]] = None  # override the WY kernel's (key block, V block); default (64, 64)
# The WY kernel's key-block side loops over the V blocks in a loop the compiler keeps (tl.range, at
# WY_LOOP_STAGES stages) instead of unrolling it: sm_90 screen at K3's shape, 8 warps, 255 registers and no
# spill against 96 B spilled unrolled (one CTA per SM either way). H200, K3's shape, bf16, same run: the kernel
# 3.718 -> 3.322 ms, fwd+bwd 11.785 -> 11.381 ms (NOTES-kda.md, eleventh session). False: unrolled.
WY_DYN_LOOP = True
# Pipeline stages of that kept loop (1: none; 2, 3: the next V block's tiles loaded while this one's products
# run). The kernel runs one CTA per SM, so only in-program prefetching can hide its loads (sm_90 at K3's shape:
# shared memory 80 / 120 / 184 KB at 1 / 2 / 3 stages, 255 registers, no spill). H200, K3's shape, bf16, same
# run: fwd+bwd 11.114 ms at 1 stage, 10.899 at 2, 10.814 at 3 (NOTES-kda.md, eleventh session). 16-bit stored
# states only: with fp32 ones (fp32 inputs) three stages take 224 of the 227 KB and the kernel spills anyway.
# 3 since the twelfth session: the GPU test file (100 passed) and the bf16 training check passed with it, and in
# the same run fwd+bwd 11.120 -> 10.828 ms against 1 stage (fla 12.472). KIMIK3_KDA_WY_STAGES sets it.
WY_LOOP_STAGES = int(os.environ.get("KIMIK3_KDA_WY_STAGES", "3"))
# The K-independent part's V loop kept too (``_wy_v_side``), at the same stages (KIMIK3_KDA_WY_V_LOOP=0: unrolled).
# H200, K3's shape, bf16: the kernel 3.010 -> 2.890 ms, fwd+bwd 10.828 -> 10.715 ms (call 1) and 10.828 -> 10.690
# (call 2, with the GPU test file and the training check passing with it; NOTES-kda.md, twelfth session).
WY_V_LOOP = os.environ.get("KIMIK3_KDA_WY_V_LOOP", "1") == "1"
# Launch of the two backward scans (state recompute, which only runs after the fused forward, and the
# state-gradient scan): V block, warps, pipeline stages, from ``_scan_launch``; these three override it
# (benchmark sweeps, None = its defaults). fp32 scans: 32 / 8 / 1 -- their fp32 [K, BV] tiles must not be
# multi-buffered (at K = 128 two or three stages need 240-295 KB of shared memory, > 227 KB on the H200);
# 8 warps stop their register spills (sm_90 compile; -1.2 ms of 29.5 ms fwd+bwd at K3's shape). 16-bit
# scans: 64 / 8 / 2 (fwd+bwd 13.37 -> 12.99 ms against 32 / 8 / 2 with W stored 16-bit), except the
# state-gradient scan with its products accumulated in place (``DH_ACC_DOTS``): 64 / 4 / 2, two CTAs per
# SM and its 192 chains at K3's shape in one wave (sm_90: 228 B spilled); H200, K3's shape, same run: the
# scan 1.113 -> 1.057 ms, fwd+bwd 11.917 -> 11.784 ms against 32 / 4 / 2 (1.45 waves; NOTES-kda.md, seventh
# to ninth sessions).
SCAN_BV: Optional[int] = None
SCAN_STAGES: Optional[int] = None
SCAN_WARPS: Optional[int] = None
# WY backward split: one program per (chunk, head, BK-column key block) plus one per (chunk, head) for
# the K-independent products, each with its partial dA / dbeta summed in the intra kernel (three times
# the programs at K = 128, a third of the accumulators each). Default since its gradients passed on the
# H200 (fp32 and bf16) and it timed -1.7 ms of 29.5 ms fwd+bwd at K3's shape. KIMIK3_KDA_WY_SPLIT=0: one
# program per (chunk, head).
WY_SPLIT_K = os.environ.get("KIMIK3_KDA_WY_SPLIT", "1") == "1"
# The state-gradient scan's 16-bit products accumulated in place (``_bwd_dh_step`` ACC): fewer live [K, BV]
# temporaries on its serial path, so it fits 4 warps / 32 columns at 255 registers without spilling and
# 88 KB of shared memory: two CTAs per SM where the 8-warp form held one. H200, K3's shape, bf16, same run:
# the scan 1.32 -> 1.11 ms (torch.profiler; twice); at 64 columns since (``_scan_launch``). False: the 8-warp /
# 64-column form.
DH_ACC_DOTS = True
# The state-gradient scan by the warp-specialised Gluon kernel (``gluon_bwd_scan.py``: one CTA per sequence and
# head, both V halves in two consumer partitions sharing a TMA loader's ring of kg, qg, W, dO tiles) where
# ``gluon_bwd_scan.supported`` allows it and the forward's scan threshold (``triton_forward.GLUON_SCAN_MIN_ITEMS``)
# is met; else, or with KIMIK3_KDA_GLUON_DH_SCAN=0, the Triton ``_bwd_dh_kernel``. H200, K3's shape, same run: the
# scan 1.077 -> 0.755 ms, forward+backward 10.572 -> 10.269 ms.
GLUON_DH_SCAN = os.environ.get("KIMIK3_KDA_GLUON_DH_SCAN", "1") == "1"
# dRv = T^T dv_new by its own pass (``_drv_kernel``, over dv_new) instead of in each of the WY kernel's parts; the
# Gluon state-gradient scan stores it itself where it runs (``gluon_bwd_scan.FUSE_DRV``), and then the pass is skipped.
DRV_PASS = True
# The WY backward by the warp-specialised Gluon kernel (``gluon_bwd_wy.py``: one (chunk, head) per item, streamed by
# TMA in three stages through a ring, dA and dbeta written whole, so the intra backward takes one partial) where
# ``gluon_bwd_wy.supported`` allows it, dRv is in dv_new's place (``DRV_PASS``) and there are at least
# ``triton_forward.GLUON_MIN_ITEMS`` (chunk, head) items; else, or with KIMIK3_KDA_GLUON_WY_BWD=0, the Triton
# ``_bwd_wy_kernel`` in three parts. H200, K3's shape, same run: the WY backward 2.80 -> 2.41 ms, the intra backward
# (one dA partial) 2.94 -> 2.83 ms, forward+backward 9.754 -> 9.258 ms (B4 T4096 H64: 12.648 -> 12.009 ms); with
# fewer registers held through its key side since, 2.10 ms (forward+backward 8.93 ms), and 1.82 ms with the key side's
# stores addressed from the item's first element (forward+backward 8.48 ms, twenty-first session).
GLUON_WY_BWD = os.environ.get("KIMIK3_KDA_GLUON_WY_BWD", "1") == "1"
# The WY kernel's dO S^T on the 16-bit dO and stored states as they are (exact products) when both share a
# 16-bit dtype, instead of both widened to fp32 for a tf32 product.
WY_DQ16 = True
# The state gradients dh [NT, H, K, V] (written by the state-gradient scan, read by the WY kernel) stored in the
# inputs' 16-bit dtype when the scans take 16-bit operands, instead of fp32: at K3's shape the fp32 dh is 0.8 GB written
# and 0.8 GB read per backward, and fla 0.6.0 (our speed and precision peer) stores it in q's dtype. Each chunk's copy
# is rounded once from the scan's fp32 value; the scan's own chain stays fp32 (only the stored copy is rounded), and
# the WY kernel widens it back to fp32 on load. H200 (nineteenth session): K3's shape, forward+backward 0 to -0.04 ms
# (the WY kernel -0.05, the state-gradient scan +0.02), B4 T4096 H64 -0.12 ms; precision against fla
# (``benchmarks/kda_precision.py --try dh16``, T2048 H32, two seeds): dk 0.78x -> 0.90x fla's error, dz 1.03x ->
# 1.12x, the rest unchanged, in fla's class. Off: the gain does not pay for the precision. KIMIK3_KDA_DH16=1 turns it
# on.
DH_16BIT = os.environ.get("KIMIK3_KDA_DH16", "0") == "1"


# --------------------------------------------------------------------------
# kernel 2: reverse scan for the state gradients
# --------------------------------------------------------------------------


@triton.jit
def _chunk_v_block(mat_ptr, cu_ptr, cidx_ptr, H, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr):
    """A program on ``part_grid(NT, H, NV)``: its chunk's [64, BV] V-block offsets and mask in a [.., H, V]
    tensor, and the transpose of the chunk's [64, 64] matrix at mat_ptr (chunk-major, as Aqk and T)."""
    i_t, i_h, i_v = _chunk_part(NV)
    t0, r, rv, cv, vm, mv, vo = _chunk_block(i_t, i_h, i_v, cidx_ptr, cu_ptr, H, V, BV)
    return vo, mv, tl.trans(tl.load(mat_ptr + (i_t * H + i_h) * 4096 + r[:, None] * 64 + r[None, :]))


@triton.jit
def _dvn_local_kernel(aqk_ptr, do_ptr, dvn_ptr, cu_ptr, cidx_ptr, H, scale,
                      V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr):
    """The state-independent part of dv_new, scale Aqk^T dO, per (chunk, head, V block), written to the dv_new
    buffer for the state-gradient scan to complete (off its serial path). DT 16-bit: 16-bit operands with
    Aqk split into high and low parts, as the scan did; fp32: ``PREC``."""
    vo, mv, aT = _chunk_v_block(aqk_ptr, cu_ptr, cidx_ptr, H, V, BV, NV)
    if DT == tl.float32:
        dvl = tl.dot(aT, tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32), input_precision=PREC)
    else:
        do = tl.load(do_ptr + vo, mask=mv, other=0.0).to(DT)
        a_hi, a_lo = _split16(aT, DT)
        dvl = tl.dot(a_hi, do) + tl.dot(a_lo, do)
    tl.store(dvn_ptr + vo, dvl * scale, mask=mv)


@triton.jit
def _bwd_dh_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, do_ptr, dh_ptr, dvn_ptr, dh, i_c, bos, eos, coff, i_h, H,
                 scale, dscale, unit, K: tl.constexpr, V: tl.constexpr, ck, cv, PREC: tl.constexpr, DT: tl.constexpr,
                 ACC: tl.constexpr):
    """dv_new = (scale Aqk^T dO, from ``_dvn_local_kernel``) + kg dS', stored over it; then the state gradient
    entering the chunk. DT 16-bit: every product takes 16-bit operands, with dh split into a high part and a
    16-bit remainder (do, qg, kg are 16-bit already). ACC (``DH_ACC_DOTS``, 16-bit only): the products
    accumulate into dv_new and dh in place (tl.dot's acc, W negated) instead of each landing in a temporary
    first. The scale = dscale (a power of two) x its mantissa part, unit = scale / dscale: dO enters its
    product times dscale, exact in 16 bits, and dh and dv_new are carried divided by unit (the dv_new buffer
    holds dscale Aqk^T dO), multiplied by it where they are stored. (Rounding dO * scale to 16 bits instead cost
    dh0 1.17x fla's error: 2.70e-3 -> 3.16e-3, H200, kda_precision.py, two seeds. dO unscaled with the scale
    applied to the product took the scan to 120 KB of shared memory: one CTA per SM, sm_90 screen.)"""
    r, rv, mk, mv, ko, vo = _chunk_tiles(i_c, bos, eos, i_h, H, K, V, ck, cv)
    km = ck < K
    hoff = ((coff + i_c) * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    # the gradient of this chunk's exit state, rounded once where dh is stored 16-bit (``DH_16BIT``; the carried dh
    # stays fp32)
    tl.store(dh_ptr + hoff, (dh * unit if ACC else dh).to(dh_ptr.dtype.element_ty),
             mask=km[:, None] & (cv < V)[None, :])
    eg = tl.load(eg_ptr + ((coff + i_c) * H + i_h) * K + ck, mask=km, other=0.0)
    dvn = tl.load(dvn_ptr + vo, mask=mv, other=0.0)
    if DT == tl.float32:
        do = tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32) * scale
        qg = tl.load(qg_ptr + ko, mask=mk, other=0.0).to(tl.float32)
        kg = tl.load(kg_ptr + ko, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(tl.float32)
        dvn = tl.where(mv, dvn + tl.dot(kg, dh, input_precision=PREC), 0.0)
        tl.store(dvn_ptr + vo, dvn, mask=mv)
        dh = dh * eg[:, None] + tl.dot(tl.trans(qg), do, input_precision=PREC) \
            - tl.dot(tl.trans(w), dvn, input_precision=PREC)
    else:
        do = tl.load(do_ptr + vo, mask=mv, other=0.0).to(DT)  # scale applied to the product
        qg = tl.load(qg_ptr + ko, mask=mk, other=0.0).to(DT)
        kg = tl.load(kg_ptr + ko, mask=mk, other=0.0).to(DT)
        w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(DT)
        dh_hi, dh_lo = _split16(dh, DT)
        # (W is rounded to 16 bits here, so a dv_new remainder would buy nothing: measured on the interpreter)
        if ACC:  # dh, dvn in units of the scale's mantissa part
            dvn = tl.where(mv, tl.dot(kg, dh_lo, acc=tl.dot(kg, dh_hi, acc=dvn)), 0.0)
            tl.store(dvn_ptr + vo, dvn * unit, mask=mv)
            dh = tl.dot(tl.trans(qg), (do.to(tl.float32) * dscale).to(DT), acc=dh * eg[:, None])
            w_neg = (-w.to(tl.float32)).to(DT)  # exact; (the interpreter cannot negate 16-bit values)
            dh = tl.dot(tl.trans(w_neg), dvn.to(DT), acc=dh)
        else:
            dvn = tl.where(mv, dvn + tl.dot(kg, dh_hi) + tl.dot(kg, dh_lo), 0.0)
            tl.store(dvn_ptr + vo, dvn, mask=mv)
            dh = dh * eg[:, None] + tl.dot(tl.trans(qg), do) * scale - tl.dot(tl.trans(w), dvn.to(DT))
    return dh


@triton.jit
def _bwd_dh_kernel(qg_ptr, kg_ptr, eg_ptr, w_ptr, do_ptr, dht_ptr, dh_ptr, dvn_ptr, dh0_ptr,
                   cu_ptr, coff_ptr, H, scale, dscale,
                   K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, INTERP: tl.constexpr,
                   DT: tl.constexpr, ACC: tl.constexpr):
    i_h, bos, eos, coff, ck, cv, s_off, sm = _scan_program(cu_ptr, coff_ptr, H, K, V, BKF, BV)
    dh = _state_tile(dht_ptr, s_off, sm, HAS_DHT, BKF, BV)
    unit = scale / dscale  # ACC: the mantissa part of the scale, the units of the carried dh and dv_new
    if ACC:  # (``_bwd_dh_step``)
        dh = dh / unit
    NC = tl.cdiv(eos - bos, 64)
    if INTERP:
        i_c = NC - 1
        while i_c >= 0:
            dh = _bwd_dh_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, do_ptr, dh_ptr, dvn_ptr, dh, i_c, bos, eos,
                              coff, i_h, H, scale, dscale, unit, K, V, ck, cv, PREC, DT, ACC)
            i_c -= 1
    else:
        for j in range(0, NC):
            dh = _bwd_dh_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, do_ptr, dh_ptr, dvn_ptr, dh, NC - 1 - j, bos,
                              eos, coff, i_h, H, scale, dscale, unit, K, V, ck, cv, PREC, DT, ACC)
    if STORE_DH0:
        tl.store(dh0_ptr + s_off, dh * unit if ACC else dh, mask=sm)


# --------------------------------------------------------------------------
# kernel 3: V-contractions per chunk (WY backward), partial dq / dk / dGamma / dbeta, dv, dAqk, dA
# --------------------------------------------------------------------------


@triton.jit
def _drv_kernel(tinv_ptr, dvn_ptr, cu_ptr, cidx_ptr, H, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                PREC: tl.constexpr):
    """dRv = T^T dv_new per (chunk, head, V block), written over dv_new (``DRV_PASS``): the WY kernel's
    three parts per chunk all need it and would each recompute it."""
    vo, mv, tmatT = _chunk_v_block(tinv_ptr, cu_ptr, cidx_ptr, H, V, BV, NV)
    tl.store(dvn_ptr + vo, tl.dot(tmatT, tl.load(dvn_ptr + vo, mask=mv, other=0.0), input_precision=PREC), mask=mv)


@triton.jit
def _wy_drv(tmatT, dvn_ptr, row_off, rv, vb, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
            DRV_IN: tl.constexpr):
    """dRv = T^T dv_new on the chunk's rows (offsets row_off) at V columns vb + [0, BV): loaded when ``_drv_kernel``
    or the Gluon state-gradient scan wrote it over dv_new (DRV_IN), else computed."""
    x = _load_rows(dvn_ptr, row_off, rv, vb, V, BV)
    if DRV_IN:
        return x
    return tl.dot(tmatT, x, input_precision=PREC)


@triton.jit
def _wy_v_side(v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, rv, vbase, H, scale,
               V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DRV_IN: tl.constexpr, VDYN: tl.constexpr):
    """The K-independent products over every V block: dAqk = dO v_new^T, the U part of dA
    (-dRv U^T), dv = beta dRv (stored) and the v part of dbeta; dRv = T^T dv_new (``_wy_drv``). The V blocks
    unrolled, or with VDYN > 0 (``WY_V_LOOP``) a loop the compiler keeps, pipelined over VDYN stages."""
    r = tl.arange(0, 64)
    daqk = tl.zeros([64, 64], dtype=tl.float32)
    da = tl.zeros([64, 64], dtype=tl.float32)
    dbeta = tl.zeros([64], dtype=tl.float32)
    if VDYN:
        for vb in tl.range(0, V, BV, num_stages=VDYN):
            daqk, da, dbeta = _wy_v_step(vb, v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, daqk, da,
                                         dbeta, r, rv, vbase, H, scale, V, BV, PREC, DRV_IN)
    else:
        for vb in tl.static_range(0, V, BV):
            daqk, da, dbeta = _wy_v_step(vb, v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, daqk, da,
                                         dbeta, r, rv, vbase, H, scale, V, BV, PREC, DRV_IN)
    return daqk, da, dbeta


@triton.jit
def _wy_v_step(vb, v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, daqk, da, dbeta, r, rv, vbase, H,
               scale, V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DRV_IN: tl.constexpr):
    """One V block of ``_wy_v_side``'s products, added to its accumulators (dv stored)."""
    cv = vb + tl.arange(0, BV)
    mv = rv[:, None] & (cv < V)[None, :]
    vo = vbase + r[:, None] * (H * V) + cv[None, :]
    row_off = vbase + r * (H * V)
    do = tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32) * scale
    vn = _load_rows(vn_ptr, row_off, rv, vb, V, BV)
    drv = _wy_drv(tmatT, dvn_ptr, row_off, rv, vb, V, BV, PREC, DRV_IN)
    u = _load_rows(u_ptr, row_off, rv, vb, V, BV).to(tl.float32)
    vv = tl.load(v_ptr + vo, mask=mv, other=0.0).to(tl.float32)
    daqk += tl.dot(do, tl.trans(vn), input_precision=PREC)
    da -= tl.dot(drv, tl.trans(u), input_precision=PREC)
    tl.store(dv_ptr + vo, (drv * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv)
    dbeta += tl.sum(drv * vv, axis=1)
    return daqk, da, dbeta


@triton.jit
def _wy_k_step(vb, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, tmatT, dqg, dkg, drk, deg, r, rv, ck, km, vbase, hb, H,
               V: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, DRV_IN: tl.constexpr, DQ16: tl.constexpr):
    """One V block of ``_wy_k_side``'s products, added to its accumulators."""
    cv = vb + tl.arange(0, BV)
    vm = cv < V
    mv = rv[:, None] & vm[None, :]
    vo = vbase + r[:, None] * (H * V) + cv[None, :]
    hoff = hb + ck[:, None] * V + cv[None, :]
    hm = km[:, None] & vm[None, :]
    hs16 = tl.load(h_ptr + hoff, mask=hm, other=0.0)
    hs = hs16.to(tl.float32)
    dhs = _load_rows(dh_ptr, hb + ck * V, km, vb, V, BV).to(tl.float32)  # (16-bit with ``DH_16BIT``)
    row_off = vbase + r * (H * V)
    vn = _load_rows(vn_ptr, row_off, rv, vb, V, BV)
    drv = _wy_drv(tmatT, dvn_ptr, row_off, rv, vb, V, BV, PREC, DRV_IN)
    hsT = tl.trans(hs)
    if DQ16:
        dqg += tl.dot(tl.load(do_ptr + vo, mask=mv, other=0.0), tl.trans(hs16))
    else:
        dqg += tl.dot(tl.load(do_ptr + vo, mask=mv, other=0.0).to(tl.float32), hsT, input_precision=PREC)
    dkg += tl.dot(vn, tl.trans(dhs), input_precision=PREC)
    drk -= tl.dot(drv, hsT, input_precision=PREC)
    deg += tl.sum(hs * dhs, axis=1)
    return dqg, dkg, drk, deg


@triton.jit
def _wy_k_side(kb, q_ptr, k_ptr, G_ptr, w_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, dq_ptr, dk_ptr, dG_ptr,
               tmatT, beta, rv, L, t0, i_h, kbase, vbase, hb, H, scale,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
               DRV_IN: tl.constexpr, DQ16: tl.constexpr, DYN: tl.constexpr):
    """Key columns [kb, kb + BK): dqg = dO S^T, dkg = v_new dS'^T, dRk = -dRv S^T and deg over every V
    block (with DYN > 0 (``WY_DYN_LOOP``, the default) a loop the compiler keeps, pipelined over DYN stages
    (``WY_LOOP_STAGES``), else unrolled), then the chain rule through the exponentials; stores dq, dk and
    dGamma (partials the intra backward completes) and returns this block's part of dA (-dRk W^T) and of
    dbeta. DQ16: dO and the stored states S share a 16-bit dtype, so dO S^T takes them as they are (exact
    products, fp32 sums)."""
    r = tl.arange(0, 64)
    ck = kb + tl.arange(0, BK)
    km = ck < K
    dqg = tl.zeros([64, BK], dtype=tl.float32)
    dkg = tl.zeros([64, BK], dtype=tl.float32)
    drk = tl.zeros([64, BK], dtype=tl.float32)
    deg = tl.zeros([BK], dtype=tl.float32)
    if DYN:
        for vb in tl.range(0, V, BV, num_stages=DYN):
            dqg, dkg, drk, deg = _wy_k_step(vb, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, tmatT, dqg, dkg, drk, deg,
                                            r, rv, ck, km, vbase, hb, H, V, BV, PREC, DRV_IN, DQ16)
    else:
        for vb in tl.static_range(0, V, BV):
            dqg, dkg, drk, deg = _wy_k_step(vb, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr, tmatT, dqg, dkg, drk, deg,
                                            r, rv, ck, km, vbase, hb, H, V, BV, PREC, DRV_IN, DQ16)
    dqg *= scale
    mk = rv[:, None] & km[None, :]
    ko = kbase + r[:, None] * (H * K) + ck[None, :]
    q = tl.load(q_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    G = _load_rows(G_ptr, kbase + r * (H * K), rv, kb, K, BK)
    w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(tl.float32)
    g_last = tl.load(G_ptr + (t0 + L - 1) * (H * K) + i_h * K + ck, mask=km, other=0.0)
    eG = tl.where(mk, tl.exp(G), 0.0)
    eC = tl.where(mk, tl.exp(g_last[None, :] - G), 0.0)
    dG = dqg * (q * eG) - dkg * (k * eC) + drk * (beta[:, None] * k * eG)
    dgc = tl.sum(dkg * (k * eC), axis=0) + deg * tl.exp(g_last)
    dG += tl.where((r == L - 1)[:, None], dgc[None, :], 0.0)
    tl.store(dq_ptr + ko, dqg * eG, mask=mk)
    tl.store(dk_ptr + ko, dkg * eC + beta[:, None] * eG * drk, mask=mk)
    tl.store(dG_ptr + ko, dG, mask=mk)
    return -tl.dot(drk, tl.trans(w), input_precision=PREC), tl.sum(drk * k * eG, axis=1)


@triton.jit
def _bwd_wy_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, tinv_ptr, w_ptr, u_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
    dq_ptr, dk_ptr, dG_ptr, dv_ptr, dbeta_ptr, daqk_ptr, da_ptr,
    cu_ptr, cidx_ptr, H, scale, part_beta, part_a,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, NPART: tl.constexpr, DRV_IN: tl.constexpr, DQ16: tl.constexpr, DYN: tl.constexpr,
    VDYN: tl.constexpr,
):
    """One (chunk, head). Unsplit (``WY_SPLIT_K`` off), this program does the K-independent products
    (``_wy_v_side``) and then every BK-column key block (``_wy_k_side``), and writes dA and dbeta whole.
    Split (the default), part p < cdiv(K, BK) (``_chunk_part``) does key block p alone and p = cdiv(K, BK)
    the K-independent products; each writes its own partial dA and dbeta (part_a / part_beta elements
    apart), which kernel 4 (``triton_bwd_intra.py``) sums."""
    i_t, i_h, i_p = _chunk_part(NPART)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    rv = r < L
    # 64-bit offsets only in the scalar bases; the tiles' offsets stay 32-bit (fewer registers)
    a_base = (i_t * H + i_h) * 4096
    kbase = (t0 * H + i_h) * K  # token t0 + row, head i_h, in a [.., H, K] tensor: kbase + row * H * K
    vbase = (t0 * H + i_h) * V
    hb = (i_t * H + i_h) * (K * V)
    if DRV_IN:  # dRv = T^T dv_new comes from memory (``_drv_kernel``)
        tmatT = tl.zeros([64, 64], dtype=tl.float32)
    else:
        tmatT = tl.trans(tl.load(tinv_ptr + a_base + r[:, None] * 64 + r[None, :]))
    o2 = a_base + r[:, None] * 64 + r[None, :]
    NKB: tl.constexpr = (K + BK - 1) // BK
    if SPLIT:
        if i_p == NKB:
            daqk, da, dbeta = _wy_v_side(v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, rv, vbase, H,
                                         scale, V, BV, PREC, DRV_IN, VDYN)
            tl.store(daqk_ptr + o2, tl.where(r[:, None] >= r[None, :], daqk, 0.0))
        else:
            da, dbeta = _wy_k_side(i_p * BK, q_ptr, k_ptr, G_ptr, w_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
                                   dq_ptr, dk_ptr, dG_ptr, tmatT, beta, rv, L, t0, i_h, kbase, vbase, hb, H, scale,
                                   K, V, BK, BV, PREC, DRV_IN, DQ16, DYN)
    else:
        daqk, da, dbeta = _wy_v_side(v_ptr, u_ptr, vn_ptr, dvn_ptr, do_ptr, dv_ptr, tmatT, beta, rv, vbase, H,
                                     scale, V, BV, PREC, DRV_IN, VDYN)
        tl.store(daqk_ptr + o2, tl.where(r[:, None] >= r[None, :], daqk, 0.0))
        for kbi in tl.static_range(NKB):
            da_k, dbeta_k = _wy_k_side(kbi * BK, q_ptr, k_ptr, G_ptr, w_ptr, h_ptr, dh_ptr, vn_ptr, dvn_ptr, do_ptr,
                                       dq_ptr, dk_ptr, dG_ptr, tmatT, beta, rv, L, t0, i_h, kbase, vbase, hb, H,
                                       scale, K, V, BK, BV, PREC, DRV_IN, DQ16, DYN)
            da += da_k
            dbeta += dbeta_k
    i_p64 = i_p.to(tl.int64)  # partial offsets can pass 2^31 elements
    tl.store(da_ptr + i_p64 * part_a + o2, tl.where(r[:, None] > r[None, :], da, 0.0))
    tl.store(dbeta_ptr + i_p64 * part_beta + (t0 + r) * H + i_h, dbeta, mask=rv)


# --------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------


def _scan_launch(scan_dt, acc: bool) -> Tuple[int, int, int]:
    """(V block, num_warps, num_stages) of a backward scan on operands of scan_dt; acc: the state-gradient scan
    with its products accumulated in place. ``SCAN_BV`` / ``SCAN_WARPS`` / ``SCAN_STAGES`` override."""
    if scan_dt == tl.float32:
        bv, warps, stages = 32, 8, 1
    else:
        bv, warps, stages = (64, 4, 2) if acc else (64, 8, 2)
    return SCAN_BV or bv, SCAN_WARPS or warps, SCAN_STAGES or stages


def dh_dtype(q_dtype: torch.dtype, scan_dt) -> torch.dtype:
    """dtype of the stored state gradients dh for inputs of q_dtype whose backward scans take operands of scan_dt:
    q's 16-bit dtype with ``DH_16BIT`` and 16-bit scans, else fp32."""
    if DH_16BIT and q_dtype in (torch.bfloat16, torch.float16) and scan_dt != tl.float32:
        return q_dtype
    return torch.float32


def kda_bwd_triton(do: torch.Tensor, dht: Optional[torch.Tensor], aux: dict, v: torch.Tensor,
                   initial_state: Optional[torch.Tensor], scale: float, plan: ChunkPlan, need_dh0: bool = True,
                   preact: Optional[PreactInputs] = None):
    """Backward from the forward's ``aux`` (``kda_fwd_triton(..., return_aux=True)``). Returns (dq, dk, dv, dg,
    dbeta, dh0 or None, d A_log, d dt_bias). Without ``preact``: the core gradients, w.r.t. the kernel's q, k
    (after any L2 norm), v, g (the log-decay after any fused gate), beta (after any sigmoid) and the initial
    state, fp32 but dv in v's dtype (written once, by the WY kernel); the last two None. With ``preact`` (the
    fused pre-activations' raw inputs): dq, dk, dg, dbeta w.r.t. the raw q, k, gate input, beta, and the gate
    parameters' gradients (None without the gate), through the intra kernels (``FUSE_PREACT_BWD``) or one more
    pass (``triton_preact.preact_bwd_triton``)."""
    q, k, G, beta = aux["q"], aux["k"], aux["G"], aux["beta"]
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    N, NT = plan.N, plan.NT
    f32 = dict(device=dev, dtype=torch.float32)
    # every token lies in a chunk of the plan (cu_seqlens ends at T: ``check_kda_inputs``), and the kernels
    # below write every gradient element of their chunks: no zero fill (4 x 0.07 ms at K3's shape)
    alloc = torch.empty if plan.covers(B * T) else torch.zeros
    dq = alloc(B, T, H, K, **f32)
    dk = alloc(B, T, H, K, **f32)
    dg = alloc(B, T, H, K, **f32)
    dv = alloc(B, T, H, V, device=dev, dtype=v.dtype)
    dbeta = alloc(B, T, H, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if need_dh0 else None
    if NT == 0:
        if dh0 is not None:
            dh0.copy_(dht.float() if dht is not None else torch.zeros_like(dh0))
        return _preact_grads(preact, dq, dk, dv, dg, dbeta, dh0)
    PREC = "tf32x3" if q.dtype == torch.float32 else "tf32"
    if not 1 <= WY_LOOP_STAGES <= 4:
        raise ValueError(f"KIMIK3_KDA_WY_STAGES (the WY backward loop's pipeline stages) must be 1 to 4, "
                         f"got {WY_LOOP_STAGES}")
    BKF = _next_pow2(K)
    BVF = _next_pow2(V)
    # V blocks of at least 32 columns (masked when V < 32): a V = 16 backward hit an illegal address on
    # the H200 (Triton 3.6; K = 100 and 130, V = 16), while every V >= 24 shape with 32-column blocks
    # ran clean (``benchmarks/kda_gpu_probe.py``, NOTES-kda.md).
    BK, BV = WY_BLOCKS or (64, 64)
    BK, BV = min(BK, BKF), min(BV, max(32, BVF))
    # The state-gradient scan's fp32 branch at K = 16 (16-row state tiles) stored wrong dv_new on the H200
    # (dv 0.39 rel. RMS; an illegal address with 64-column V blocks) while its 16-bit branch and K = 32
    # were right, and the interpreter is right at both: the backward scans hold >= 32 state rows (masked).
    BKs = max(32, BKF)
    # the backward scans take 16-bit operands (with the hi / lo splits) when the forward scan did
    scan_dt = tl.float32 if aux["qg"].dtype == torch.float32 else _dot_dtype(aux["qg"].dtype)
    do = do.contiguous()
    dh = torch.empty(NT, H, K, V, device=dev, dtype=dh_dtype(q.dtype, scan_dt))
    dvn = torch.empty(B, T, H, V, **f32)
    dummy = G
    h, vn = aux.get("h"), aux.get("vn")
    if h is None:  # the forward ran fused: recompute the chunks' entry states and v_new
        BVs, warps_s, stages_s = _scan_launch(scan_dt, False)
        h = torch.empty(NT, H, K, V, device=dev, dtype=states_dtype(aux["qg"].dtype))  # 16-bit with 16-bit scans
        vn = torch.empty(B, T, H, V, **f32)
        h0 = initial_state.float().contiguous() if initial_state is not None else dummy
        _fwd_h_kernel[(triton.cdiv(V, BVs), N * H)](
            aux["kg"], aux["eg"], aux["w"], aux["u"], h0, h, vn, dummy, plan.cu, plan.chunk_off, H,
            K=K, V=V, BKF=BKs, BV=BVs, PREC=PREC, HAS_H0=initial_state is not None, STORE_HT=False,
            INTERP=INTERPRET, DT=scan_dt, HILO=aux.get("hilo", True), num_warps=warps_s, num_stages=stages_s,
        )
    dht_c = dht.float().contiguous() if dht is not None else dummy
    # scale Aqk^T dO, the part of dv_new that does not depend on the state, in parallel over chunks (on the WY
    # kernel's V blocks, as the dRv pass); the scan below adds kg dS' on its serial path
    nv = triton.cdiv(V, BV)
    acc = DH_ACC_DOTS and scan_dt != tl.float32 and scale != 0  # (a zero scale has no mantissa part to carry)
    # scale = dscale x its mantissa part in [1, 2); the in-place scan carries dv_new / the mantissa part
    dscale = 2.0 ** (math.frexp(scale)[1] - 1) if acc else 1.0
    gluon = _gluon_taking("gluon_bwd_scan", GLUON_DH_SCAN, NT * H * triton.cdiv(V, 64),
                          (aux["qg"], aux["kg"], aux["w"], do, acc), triton_forward.GLUON_SCAN_MIN_ITEMS)
    if gluon is None or not gluon.FUSE_LOCAL:  # the Gluon scan otherwise computes this part itself
        _dvn_local_kernel[part_grid(NT, H, nv)](
            aux["aqk"], do, dvn, plan.cu, plan.chunk_idx, H, dscale if acc else float(scale),
            V=V, BV=BV, NV=nv, PREC=PREC, DT=scan_dt, num_warps=4,
        )
    drv_in_scan = gluon is not None and gluon.FUSE_DRV and DRV_PASS  # the scan stores dRv over dv_new itself
    if gluon is not None:
        gluon.launch(aux["qg"], aux["kg"], aux["eg"], aux["w"], do, dht_c if dht is not None else None, dh, dvn, dh0,
                     plan, H, scale, dscale, aqk=aux["aqk"] if gluon.FUSE_LOCAL else None,
                     tinv=aux["tinv"] if drv_in_scan else None)
    else:
        BVs, warps_s, stages_s = _scan_launch(scan_dt, acc)
        _bwd_dh_kernel[(triton.cdiv(V, BVs), N * H)](
            aux["qg"], aux["kg"], aux["eg"], aux["w"], do, dht_c, dh, dvn, dh0 if dh0 is not None else dummy,
            plan.cu, plan.chunk_off, H, float(scale), dscale,
            K=K, V=V, BKF=BKs, BV=BVs, PREC=PREC, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
            INTERP=INTERPRET, DT=scan_dt, ACC=acc, num_warps=warps_s, num_stages=stages_s,
        )
    nkb = triton.cdiv(K, BK)
    gluon_wy = _gluon_taking("gluon_bwd_wy", GLUON_WY_BWD and DRV_PASS, NT * H,
                             (q, k, v, do, aux["w"], h, G, aux["u"], vn, dh))
    # split: one program per key block, one for the K-independent part (the Gluon kernel: one item per chunk and head)
    npart = nkb + 1 if (WY_SPLIT_K and gluon_wy is None) else 1
    daqk = torch.empty(NT, H, 64, 64, **f32)
    da = torch.empty(npart, NT, H, 64, 64, **f32)
    dbeta_parts = dbeta if npart == 1 else torch.empty(npart, B, T, H, **f32)
    if DRV_PASS and not drv_in_scan:  # dRv = T^T dv_new once per chunk, over dv_new (the WY kernel needs only it)
        _drv_kernel[part_grid(NT, H, nv)](aux["tinv"], dvn, plan.cu, plan.chunk_idx, H, V=V, BV=BV, NV=nv,
                                          PREC=PREC, num_warps=4)
    if gluon_wy is not None:
        gluon_wy.launch(q, k, v, G, beta, aux["w"], aux["u"], h, dh, vn, dvn, do, dq, dk, dg, dv, dbeta_parts, daqk, da,
                        plan, H, scale)
    else:
        h16 = h.dtype in (torch.bfloat16, torch.float16)
        stages = WY_LOOP_STAGES if h16 else 1  # (fp32 stored states: no room in shared memory)
        part_a, part_beta = NT * H * 4096, B * T * H
        warps = BWD_WARPS or (8 if BKF >= 128 else 4)  # sm_90 compile: the split spills 176 B at 8 warps, 1.7 KB at 4
        _bwd_wy_kernel[part_grid(NT, H, npart)](
            q, k, v, G, beta, aux["tinv"], aux["w"], aux["u"], h, dh, vn, dvn, do,
            dq, dk, dg, dv, dbeta_parts, daqk, da, plan.cu, plan.chunk_idx, H, float(scale), part_beta, part_a,
            K=K, V=V, BK=BK, BV=BV, PREC=PREC, SPLIT=npart > 1, NPART=npart, DRV_IN=DRV_PASS,
            DQ16=WY_DQ16 and h16 and do.dtype == h.dtype, DYN=stages if WY_DYN_LOOP else 0,
            VDYN=stages if WY_V_LOOP else 0, num_warps=warps,
        )
    # dg holds dGamma (partial) here; kernel 4 adds the intra-chunk part and turns it into dg in place (or
    # applies the fused pre-activations' chain rules too)
    raw = bwd_intra(q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta, plan, npart, PREC, BWD_WARPS, preact)
    if raw is not None:
        gq, gk, gz, gb, ga, gd = raw
        return gq, gk, dv, gz, gb, dh0, ga, gd
    return _preact_grads(preact, dq, dk, dv, dg, dbeta, dh0)


def _preact_grads(preact: Optional[PreactInputs], dq, dk, dv, dg, dbeta, dh0):
    """``kda_bwd_triton``'s result from the core gradients: the fused pre-activations' chain rules by their own
    pass when ``preact`` is given."""
    if preact is None or not preact.any():
        return dq, dk, dv, dg, dbeta, dh0, None, None
    p = preact
    gq, gk, gz, gb, ga, gd = preact_bwd_triton(p.q, p.k, p.z, p.beta, dq, dk, dg, dbeta, p.A_log, p.dt_bias, p.g_min,
                                               p.use_gate, p.use_l2, p.use_beta_sigmoid)
    return gq, gk, dv, gz, gb, dh0, ga, gd
