"""The inter-chunk half of the Triton KDA forward: sequential state scans and the chunk output.

Per chunk (C = 64 tokens; W, U, qg = q e^Gamma, kg = k e^(Gamma_C - Gamma), eg = e^Gamma_C and Aqk
from the intra-chunk kernel in ``triton_forward.py``), with S the state entering the chunk:
    v_new = U - W S,   o = scale (qg S + Aqk v_new),   S <- eg * S + kg^T v_new.

Two ways to run it (``triton_forward.FWD_MODE``):
  split  ``_fwd_h_kernel`` (states only: stores each chunk's entry state h [NT, H, K, V] and v_new)
         then ``_output_kernel``, parallel over (V block, chunk, head). Half the serial work
         per step and fewer operands in flight (so the loop can be pipelined), at the cost of writing
         h; the Triton backward reuses h and v_new instead of re-running the scan (the default,
         measured on the H200: forward -0.26 ms, forward+backward -1.3 ms at K3's shape).
  fused  ``_state_out_kernel`` per (sequence, head, V block): the output is computed on the scan's
         serial path and no per-chunk state is written.
``_fwd_h_kernel`` is also the backward's state recompute when the forward ran fused.
Stored states h are fp32, or 16-bit when the scans run on 16-bit operands (``states_dtype``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# With 16-bit scans (the bf16 variants 'h', the default, and 'ach'), the chunk entry states h [NT, H, K, V] a
# scan stores for later kernels (the split forward's output, the backward's WY kernel) are kept in the inputs' 16-bit
# dtype: fp32 would be 0.8 GB at K3's shape (written once, read once), and the scans' own dots take h
# 16-bit anyway. H200, backward recompute: fwd+bwd 21.82 -> 21.44 ms at K3's shape (same run). The state
# gradients dh stay fp32: stored 16-bit too they took dk 1.5e-3 -> 3.5e-3 and dg 5e-4 -> 2.8e-3 vs the
# token loop on the interpreter's bf16 case (h alone: dg 5.3e-4 -> 7.3e-4, the rest unchanged).
STATES_16BIT = os.environ.get("KIMIK3_KDA_STATES_16BIT", "1") == "1"
# Chunk-local kernels split into parts (the forward's four column tiles of A and its K / V blocks of W, U; the
# backward's WY partials and intra key blocks) read the same chunk tiles in every part. Their parts run
# innermost on grid axis 0 (``part_grid`` / ``_chunk_part``), so a chunk's parts are scheduled together and
# share those reads through L2. H200, K3's shape, against the parts on axis 2 (same run): forward 4.98 -> 4.68
# ms, forward+backward 16.31 -> 15.57 ms (phase A 1.03 -> 0.86, the WY backward 5.20 -> 4.91).


def part_grid(NT: int, H: int, NP: int) -> tuple:
    """Launch grid for NT chunks x H heads x NP parts per (chunk, head); the kernel reads its indices with
    ``_chunk_part``."""
    return (NT * NP, H)


def states_dtype(scan_operands: torch.dtype) -> torch.dtype:
    """dtype of the stored chunk states for scans whose operands (qg, kg) are ``scan_operands``."""
    return scan_operands if (STATES_16BIT and scan_operands != torch.float32) else torch.float32


# --------------------------------------------------------------------------
# shared index helpers (inlined by the compiler)
# --------------------------------------------------------------------------


@triton.jit
def _scan_program(cu_ptr, coff_ptr, H, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr):
    """A scan program (V block, sequence x head): its head, its sequence's token range [bos, eos) and
    first global chunk, the state columns (ck over K, cv over this V block) and the offsets and mask
    of its [K, V] state tile in an [N, H, K, V] tensor."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // H).to(tl.int64)
    i_h = i_nh % H
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + i_n).to(tl.int64)
    ck = tl.arange(0, BKF)
    cv = i_v * BV + tl.arange(0, BV)
    s_off = (i_n * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    sm = (ck < K)[:, None] & (cv < V)[None, :]
    return i_h, bos, eos, coff, ck, cv, s_off, sm


@triton.jit
def _state_tile(ptr, s_off, sm, HAS: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr):
    """A scan program's starting [BKF, BV] fp32 tile: loaded from ``ptr`` (an initial state or its
    gradient) when the caller has one, else zeros."""
    if HAS:
        return tl.load(ptr + s_off, mask=sm, other=0.0).to(tl.float32)
    return tl.zeros([BKF, BV], dtype=tl.float32)


@triton.jit
def _load_rows(ptr, row_off, rmask, c0, climit, B: tl.constexpr):
    """[R, B] tile: element (r, c) at ptr + row_off[r] + c0 + c, masked by rmask[r] and c0 + c < climit (0 where
    masked). The WY backward kernel's form: with the equivalent [R, B] offsets its sm_90 code differs."""
    c = tl.arange(0, B)
    return tl.load(ptr + row_off[:, None] + c0 + c[None, :], mask=rmask[:, None] & (c0 + c < climit)[None, :],
                   other=0.0)


@triton.jit
def _chunk_part(NP: tl.constexpr):
    """(global chunk i_t as int64, head, part in [0, NP)) of a program launched on ``part_grid``."""
    pid = tl.program_id(0)
    return (pid // NP).to(tl.int64), tl.program_id(1), pid % NP


@triton.jit
def _chunk_bounds(i_t, cidx_ptr, cu_ptr, C: tl.constexpr = 64):
    """Chunk i_t of a plan of C-token chunks (global chunk index): its first token and its number of valid tokens
    (<= C). Per-chunk buffers ([NT, ...]) are indexed by i_t: it equals chunk_off[n] + (chunk within n)."""
    i_n = tl.load(cidx_ptr + 2 * i_t).to(tl.int64)
    i_c = tl.load(cidx_ptr + 2 * i_t + 1).to(tl.int64)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    t0 = bos + i_c * C
    return t0, tl.minimum(C, eos - t0)


@triton.jit
def _chunk_block(i_t, i_h, i_b, cidx_ptr, cu_ptr, H, D: tl.constexpr, B: tl.constexpr):
    """Chunk i_t's [64, B] tile of head i_h at columns block i_b in a [.., H, D] tensor (token layout): the
    chunk's first token, its rows and valid-row mask, the columns and their mask, the tile's mask and
    offsets."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    c = i_b * B + tl.arange(0, B)
    rv = r < L
    cm = c < D
    return t0, r, rv, c, cm, rv[:, None] & cm[None, :], (t0 + r)[:, None] * (H * D) + i_h * D + c[None, :]


@triton.jit
def _chunk_columns(i_t, i_h, i_b, cidx_ptr, cu_ptr, H, D: tl.constexpr, B: tl.constexpr):
    """Chunk i_t's first token and valid length, and column block i_b of head i_h in a [.., H, D] tensor (token
    layout): the B columns, their mask, and their offsets in the chunk's first row (the next row H D further)."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    c = i_b * B + tl.arange(0, B)
    return t0, L, c, c < D, (t0 * H + i_h) * D + c


@triton.jit
def _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H):
    """``_chunk_bounds`` of chunk i_t, its 64 row indices, and head i_h's beta on them (fp32, 0 past L)."""
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    beta = tl.load(beta_ptr + (t0 + r) * H + i_h, mask=r < L, other=0.0).to(tl.float32)
    return t0, L, r, beta


@triton.jit
def _chunk_tiles(i_c, bos, eos, i_h, H, K: tl.constexpr, V: tl.constexpr, ck, cv):
    """Chunk i_c of a sequence: its 64 row indices, the valid-row mask, the token-layout offsets and
    masks of its [64, K] and [64, V] tiles."""
    r = tl.arange(0, 64)
    t0 = bos + i_c * 64
    rv = r < tl.minimum(64, eos - t0)
    mk = rv[:, None] & (ck < K)[None, :]
    mv = rv[:, None] & (cv < V)[None, :]
    ko = (t0 + r)[:, None] * (H * K) + i_h * K + ck[None, :]
    vo = (t0 + r)[:, None] * (H * V) + i_h * V + cv[None, :]
    return r, rv, mk, mv, ko, vo


# --------------------------------------------------------------------------
# fused: the sequential state scan with the output on its serial path (forward default)
# --------------------------------------------------------------------------


@triton.jit
def _split16(x, DT: tl.constexpr):
    """fp32 x as a 16-bit high part and the 16-bit remainder (hi + lo holds ~16 mantissa bits)."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _scan_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr, h, i_c, bos, eos, coff, i_h, H, scale,
               K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, ck, cv,
               DT: tl.constexpr, PREC: tl.constexpr, KT_LOAD: tl.constexpr, HILO: tl.constexpr):
    """One chunk of the scan: output of chunk i_c and the state after it.

    HILO (16-bit DT): v_new and Aqk enter their products as a 16-bit high part plus a 16-bit
    remainder (x = hi + lo to ~16 mantissa bits), S, W, qg, kg as plain 16-bit operands. Rounding v_new
    and Aqk is what costs the all-16-bit scan its accuracy (NOTES-kda.md): with the split, the scan's
    products are near fp32 accuracy at 16-bit operand width.

    v2: the gated operands qg = q exp(Gamma), kg = k exp(Gamma_C - Gamma) and exp(Gamma_C) come
    precomputed from the intra kernel (no exp, no G tile on the serial path; less shared memory).
    """
    r, rv, mk, mv, ko, vo = _chunk_tiles(i_c, bos, eos, i_h, H, K, V, ck, cv)
    km = ck < K
    t0 = bos + i_c * 64
    w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(DT)
    u = tl.load(u_ptr + vo, mask=mv, other=0.0).to(tl.float32)
    qg = tl.load(qg_ptr + ko, mask=mk, other=0.0).to(DT)
    if KT_LOAD:  # load k exp(Gamma_C - Gamma) already transposed ([K, 64]) instead of tl.trans in registers
        kgT = tl.load(kg_ptr + (t0 + r)[None, :] * (H * K) + i_h * K + ck[:, None],
                      mask=km[:, None] & rv[None, :], other=0.0).to(DT)
    else:
        kgT = tl.trans(tl.load(kg_ptr + ko, mask=mk, other=0.0).to(DT))
    eg = tl.load(eg_ptr + ((coff + i_c) * H + i_h) * K + ck, mask=km, other=0.0)
    a = tl.load(aqk_ptr + ((coff + i_c) * H + i_h) * 4096 + r[:, None] * 64 + r[None, :])
    h_dt = h.to(DT)
    v_new = u - tl.dot(w, h_dt, input_precision=PREC)
    v_dt, v_lo = _split16(v_new, DT)
    a_dt, a_lo = _split16(a, DT)
    h = h * eg[:, None] + tl.dot(kgT, v_dt, input_precision=PREC)
    o = tl.dot(qg, h_dt, input_precision=PREC)
    o += tl.dot(a_dt, v_dt, input_precision=PREC)
    if HILO:  # the remainders' products (lo x lo left out)
        h += tl.dot(kgT, v_lo, input_precision=PREC)
        o += tl.dot(a_dt, v_lo, input_precision=PREC) + tl.dot(a_lo, v_dt, input_precision=PREC)
    tl.store(o_ptr + vo, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
    return h


@triton.jit
def _state_out_kernel(
    qg_ptr, kg_ptr, eg_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr, h0_ptr, ht_ptr,
    cu_ptr, coff_ptr, H, scale,
    K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
    INTERP: tl.constexpr, KT_LOAD: tl.constexpr, HILO: tl.constexpr,
):
    i_h, bos, eos, coff, ck, cv, s_off, sm = _scan_program(cu_ptr, coff_ptr, H, K, V, BKF, BV)
    h = _state_tile(h0_ptr, s_off, sm, HAS_H0, BKF, BV)
    NC = tl.cdiv(eos - bos, 64)
    if INTERP:  # the interpreter cannot range() over a loaded scalar (numpy 2); same body
        i_c = 0
        while i_c < NC:
            h = _scan_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr, h, i_c, bos, eos, coff, i_h, H, scale,
                           K, V, BKF, BV, ck, cv, DT, PREC, KT_LOAD, HILO)
            i_c += 1
    else:
        for i_c in range(0, NC):
            h = _scan_step(qg_ptr, kg_ptr, eg_ptr, w_ptr, u_ptr, aqk_ptr, o_ptr, h, i_c, bos, eos, coff, i_h, H, scale,
                           K, V, BKF, BV, ck, cv, DT, PREC, KT_LOAD, HILO)
    if STORE_HT:
        tl.store(ht_ptr + s_off, h, mask=sm)


# --------------------------------------------------------------------------
# states only: per-chunk entry states and v_new (the backward's recompute; the split forward)
# --------------------------------------------------------------------------


@triton.jit
def _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                K: tl.constexpr, V: tl.constexpr, ck, cv, PREC: tl.constexpr, DT: tl.constexpr,
                HILO: tl.constexpr):
    """DT 16-bit: W and the state as 16-bit operands, v_new split into high and low parts when HILO (the
    forward's variant 'h', as ``_scan_step``)."""
    r, rv, mk, mv, ko, vo = _chunk_tiles(i_c, bos, eos, i_h, H, K, V, ck, cv)
    km = ck < K
    hoff = ((coff + i_c) * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    tl.store(h_ptr + hoff, h.to(h_ptr.dtype.element_ty), mask=km[:, None] & (cv < V)[None, :])
    w = tl.load(w_ptr + ko, mask=mk, other=0.0).to(DT)
    u = tl.load(u_ptr + vo, mask=mv, other=0.0).to(tl.float32)
    kgT = tl.trans(tl.load(kg_ptr + ko, mask=mk, other=0.0).to(DT))
    eg = tl.load(eg_ptr + ((coff + i_c) * H + i_h) * K + ck, mask=km, other=0.0)
    v_new = u - tl.dot(w, h.to(DT), input_precision=PREC)
    tl.store(vn_ptr + vo, v_new, mask=mv)
    v_hi, v_lo = _split16(v_new, DT)  # fp32 DT: v_hi is v_new
    h = h * eg[:, None] + tl.dot(kgT, v_hi, input_precision=PREC)
    if HILO and DT != tl.float32:
        h += tl.dot(kgT, v_lo, input_precision=PREC)
    return h


@triton.jit
def _fwd_h_kernel(kg_ptr, eg_ptr, w_ptr, u_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr, cu_ptr, coff_ptr, H,
                  K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
                  PREC: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, INTERP: tl.constexpr,
                  DT: tl.constexpr, HILO: tl.constexpr):
    i_h, bos, eos, coff, ck, cv, s_off, sm = _scan_program(cu_ptr, coff_ptr, H, K, V, BKF, BV)
    h = _state_tile(h0_ptr, s_off, sm, HAS_H0, BKF, BV)
    NC = tl.cdiv(eos - bos, 64)
    if INTERP:  # the interpreter cannot range() over a loaded scalar (NOTES-kda.md)
        i_c = 0
        while i_c < NC:
            h = _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                            K, V, ck, cv, PREC, DT, HILO)
            i_c += 1
    else:
        for i_c in range(0, NC):
            h = _fwd_h_step(kg_ptr, eg_ptr, w_ptr, u_ptr, h_ptr, vn_ptr, h, i_c, bos, eos, coff, i_h, H,
                            K, V, ck, cv, PREC, DT, HILO)
    if STORE_HT:
        tl.store(ht_ptr + s_off, h, mask=sm)



# --------------------------------------------------------------------------
# output of the split forward: parallel over (chunk, head, V block)
# --------------------------------------------------------------------------


@triton.jit
def _output_kernel(qg_ptr, aqk_ptr, h_ptr, vn_ptr, o_ptr, cu_ptr, cidx_ptr, H, scale,
                   K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr, DT: tl.constexpr, HILO: tl.constexpr):
    """o = scale (qg S + Aqk v_new) for one chunk, from the entry state S and v_new the states-only
    scan stored: the output leaves the scan's serial path. DT 16-bit: 16-bit operands, with Aqk and
    v_new split into high and low parts when HILO, as in the fused scan. (The products are ``_scan_step``'s,
    written out again: there they interleave with the state update, and a shared helper reorders the
    measured fused scan's compiled code -- sm_90 spill 272 -> 236 B, untimed.)"""
    i_v = tl.program_id(0)
    i_t = tl.program_id(1).to(tl.int64)
    i_h = tl.program_id(2)
    t0, L = _chunk_bounds(i_t, cidx_ptr, cu_ptr)
    r = tl.arange(0, 64)
    ck = tl.arange(0, BKF)
    cv = i_v * BV + tl.arange(0, BV)
    rv = r < L
    km = ck < K
    vm = cv < V
    mv = rv[:, None] & vm[None, :]
    vo = (t0 + r)[:, None] * (H * V) + i_h * V + cv[None, :]
    qg = tl.load(qg_ptr + (t0 + r)[:, None] * (H * K) + i_h * K + ck[None, :], mask=rv[:, None] & km[None, :],
                 other=0.0).to(DT)
    h = tl.load(h_ptr + (i_t * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :],
                mask=km[:, None] & vm[None, :], other=0.0).to(DT)
    a = tl.load(aqk_ptr + (i_t * H + i_h) * 4096 + r[:, None] * 64 + r[None, :])
    vn = tl.load(vn_ptr + vo, mask=mv, other=0.0)
    a_hi, a_lo = _split16(a, DT)  # fp32 DT: a_hi is a
    vn_hi, vn_lo = _split16(vn, DT)
    o = tl.dot(qg, h, input_precision=PREC) + tl.dot(a_hi, vn_hi, input_precision=PREC)
    if HILO and DT != tl.float32:
        o += tl.dot(a_hi, vn_lo) + tl.dot(a_lo, vn_hi)
    tl.store(o_ptr + vo, (o * scale).to(o_ptr.dtype.element_ty), mask=mv)
