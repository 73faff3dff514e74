"""Triton forward of chunkwise KDA exploiting K3's gate bound (g >= g_min = -5).

Layout and contract as ``chunk.chunk_kda_torch`` (fla layout: q, k, g [B, T, H, K]; v [B, T, H, V];
beta [B, T, H]; states [N, H, K, V] fp32; ``cu_seqlens`` packs N sequences into B == 1). Internally
every call is treated as packed: B rows of T tokens are the sequences [b T, (b + 1) T).

Three kernels (chunk C = 64 tokens, sub-tiles of 16; math as in ``chunk.py``):

1. the prologue (``triton_prologue.py``): optional fused gate g = g_min * sigmoid(exp(A_log) (z + dt_bias)),
   the within-chunk cumulative log-decay Gamma (fp32, token layout), optional q/k L2 norm and beta
   sigmoid (written to side buffers only when fused).
2. ``_intra``  per (chunk, head): Aqk (lower, diagonal included) and diag(beta) Akk (strictly lower)
   as dense tl.dot matmuls, one 64 x 16 column tile j at a time against the reference
   eps_j = Gamma at the tile's last token: column factors exp(eps_j - Gamma_s) are in [e^-75, 1] and
   row factors exp(Gamma_t - eps_j) in (0, e^75] for the rows that are not in tile j's future
   (rows before the tile are masked to zero *in the exponent*, before exp, so nothing overflows and
   no tile reads a future token). This is where the bound is used: a 16-token tile accumulates at
   most 15 * 5 = 75 in log space, so the diagonal tiles need no position-pair loop.
   Then T = (I + diag(beta) Akk)^-1 by 16 x 16 forward substitution on the diagonal blocks and
   block forward substitution across row tiles (in place in a scratch buffer), and the WY/UT
   representation W = T (beta k exp(Gamma)), U = T (beta v). The three phases are @triton.jit helpers
   (``_a_tile``, ``triton_solve._solve``, ``_wy_k_block`` / ``_wy_v_block``), run by default as three kernels
   with many light programs (``KIMIK3_KDA_INTRA=fused``: all three in one program per (chunk, head)); on Hopper
   phase C runs as a Gluon kernel instead (``gluon_wy.py``, ``GLUON_WY``).
3. the inter-chunk scan (``triton_scan.py``): per (sequence, head, V block) the sequential scan over the
   sequence's chunks, v_new = U - W S, S <- exp(Gamma_C) S + (k exp(Gamma_C - Gamma))^T v_new, with the state
   kept in fp32 registers; by default it stores each chunk's entry state and v_new, and the output
   o = scale (q exp(Gamma) S + Aqk v_new) runs in parallel over chunks after it (``KIMIK3_KDA_FWD=fused``:
   one ``_state_out`` kernel with the output on the scan's serial path, nothing per chunk stored). On Hopper the
   Gluon scan (``gluon_scan.py``) computes the output itself, off its chain (``GLUON_SCAN_OUT``), and stores the
   states and v_new only for the backward.

Accumulation is always fp32. fp32 inputs: every matmul at "tf32x3" (about fp32 accuracy on tensor
cores). 16-bit inputs: the precision variant (``kda_fwd_triton``; default 'h') picks tf32 or 16-bit
operands per product group; the default takes every product on 16-bit operands, with v_new and Aqk split
into high and low parts in the scan (fla 0.6.0's precision class, ``benchmarks/kda_precision.py``).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import L2_EPS, triton_prep16, triton_prologue
from .triton_intra16 import _diag16_kernel, _intra16_kernel
from .triton_scan import (_chunk_beta, _chunk_part, _fwd_h_kernel, _output_kernel, _state_out_kernel, part_grid,
                          states_dtype)
from .triton_solve import _solve

BT = 64  # chunk size (tokens)
BC = 16  # sub-tile rows: the gate bound makes 16 * 5 = 80 the largest in-tile log-decay

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# see kda_fwd_triton. 'ach' (16-bit scans with hi / lo splits, tf32 intra-chunk products) timed 7.54 -> 6.04 ms
# forward and 26.7 -> 22.5 ms forward+backward at B1 T8192 H96 D128 on the H200 against 'acsw' (all tf32). 'h'
# (the intra-chunk products on 16-bit operands too) timed 3.81 -> 3.47 ms forward and 13.11 -> 12.77 ms
# forward+backward against 'ach' (same run), and is in fla 0.6.0's precision class: on the same bf16 inputs,
# K3's contract, T2048 H32, every error against the fp32 token loop (o, state, all gradients) is 0.77-1.03x
# fla's ('ach' 0.64-1.00x; benchmarks/kda_precision.py); the bf16 training check passes with it.
DEFAULT_VARIANT = os.environ.get("KIMIK3_KDA_VARIANT", "h")
# Launch overrides (benchmark sweeps; None = heuristic): scan (BV, num_warps[, num_stages]), intra num_warps.
SCAN_CONFIG: Optional[Tuple[int, int]] = None
INTRA_WARPS: Optional[int] = None
# phase-B solve: 4 (default) / 3 = 16 x 16 blocks in registers (diagonal inverses by the four blocks' forward
# substitutions interleaved (4) or by a 16 x 16 Neumann product (3), then block rows; ``_solve_blocks``), 0 =
# forward substitution of each diagonal block and block row in turn through the buffer. H200, K3's shape, split
# intra: the solve kernel 0.845 ms (0, 4 warps) -> 0.189 ms (4, 1 warp; 2 warps 0.357, 4 warps 0.596),
# forward 4.68 -> 4.20 ms, forward+backward 15.57 -> 14.82 ms (same run).
# (64 x 64 Neumann products, once 1 and 2, gave illegal addresses on the H200 and were removed.)
SOLVE = int(os.environ.get("KIMIK3_KDA_SOLVE", "4"))
SCAN_KT_LOAD = os.environ.get("KIMIK3_KDA_KT_LOAD", "0") == "1"  # scan: load kg transposed from memory
# Inter-chunk half (``triton_scan.py``): "split" (default: a states-only scan storing h and v_new, then a
# parallel output kernel; the backward reuses both instead of re-running the scan) or "fused" (the scan with
# the output on its serial path, nothing per chunk stored). H200, K3's shape, bf16 (variant 'ach', same run):
# forward 5.24 -> 4.99 ms, forward+backward 20.44 -> 19.12 ms, for h (16-bit) + v_new (fp32) kept for the
# backward: 0.8 GB per call at that shape.
FWD_MODE = os.environ.get("KIMIK3_KDA_FWD", "split")
# split mode's scan (BV, num_warps, num_stages). At 64 / 4 / 2 the scan takes 234 registers and 104 KB, two CTAs
# per SM, so its 192 chains at K3's shape run in one wave (0.73; benchmarks/kda_sm90_report.py); at 32 / 4 / 2
# (180 registers, 2 CTAs) the 384 chains took 1.45 waves. H200, K3's shape, same run: forward 3.056 -> 2.892 ms
# (64 / 4 / 1: 2.975; 64 / 8 / 2, one CTA per SM, timed +0.13 in the fourth session). Triton's maxnreg launch
# option (ptxas .maxnreg) was tried at 32 / 4 / 1 / 168 to fit three CTAs: an illegal memory access at K3's
# shape on the H200 (sm_90 screen: 120 B spilled), so it is not offered.
SPLIT_CONFIG: Tuple[int, int, int] = (64, 4, 2)
# split mode's output kernel (V block, num_warps): it streams qg, Aqk, h and v_new once per V block, so a
# wider block reads qg and Aqk fewer times.
OUTPUT_CONFIG: Tuple[int, int] = (64, 4)
# Intra-chunk kernels: "split" (default: three kernels, A per column tile, B per chunk, C per K / V block;
# with variant 'ach' the forward timed 6.04 -> 5.21 ms against "fused" at K3's shape on the H200),
# "fused" (phases A, B, C in one program per (chunk, head)) or "tiles16" (``triton_intra16.py``: one
# program per (chunk, head) holding [16, 16] blocks in registers). H200, K3's shape, tenth session, same run:
# split 2.906 ms forward, fused 4.343. One program per (chunk, head) walking the phases in series is
# latency-bound, not traffic-bound: a one-pass form that also held the prologue (Gamma, q, k in registers,
# half the traffic) took 4.470 and was removed (NOTES-kda.md, tenth session).
INTRA_MODE = os.environ.get("KIMIK3_KDA_INTRA", "split")
# num_warps of the split A, B, C kernels (B: its [16, 16] dots lay out one warp's rows, so more warps repeat them)
INTRA_SPLIT_WARPS: Tuple[int, int, int] = (4, 1, 4)
# The split phase A kernel's K block (its loop over K in blocks of A_BK); None: the intra kernels' 64. At 64:
# 128 registers, 4 CTAs per SM.
A_BK: Optional[int] = None
# Phase C's (K block, V block) per program; None: the intra kernels' 64 / 64. Narrower blocks take fewer
# registers per program, so more CTAs per SM stream the chunk tiles (at 64 / 64: 168 registers, 3 CTAs per SM).
# Each program reads the chunk's fp32 T (16 KB); L2 catches the re-reads: one program per (chunk, head) over
# all blocks, reading T once (fla's layout), timed forward 2.906 -> 3.010 ms (two CTAs per SM) and was removed.
WY_BLOCKS: Optional[Tuple[int, int]] = None
# Phase C by the warp-specialised Gluon kernel (``gluon_wy.py``: a TMA loader partition and a 2-slot ring, the
# products on warpgroup_mma) wherever ``gluon_wy.supported`` allows it (sm_90, bf16, K == V a multiple of 64, and
# a Triton with Gluon); else, or with KIMIK3_KDA_GLUON_WY=0, the Triton ``_intra_wy_kernel``. H200, K3's shape,
# same run: phase C 0.728 -> 0.645 ms, forward 2.794 -> 2.718 ms, forward+backward 10.812 -> 10.720 ms, the
# outputs bit-identical.
GLUON_WY = os.environ.get("KIMIK3_KDA_GLUON_WY", "1") == "1"
# ... from this many work items (chunks x heads x 64-column blocks) up: a Gluon launch encodes its TMA descriptors
# on the host, which a small, host-bound call would pay for without the kernel's gain. Measured on the H200
# (benchmarks/kda_gluon_dispatch.py, the forward with phase C on each kernel, H 8-96, T 256-8192): the Gluon form
# was never slower from 4096 items up (x1.02-1.03), and at 1024-2048 items, where the forward is host-bound, it
# lost 7-25 % (host jitter of the same size).
GLUON_MIN_ITEMS = 4096
# The split forward's state scan by the warp-specialised Gluon kernel (``gluon_scan.py``: a TMA loader partition
# streaming each chunk's W and kg tiles into a 2-slot ring, the state held as wgmma accumulators, both V halves in
# one CTA) where ``gluon_scan.supported`` allows it, from GLUON_SCAN_MIN_ITEMS chunks x heads x 64-column V blocks
# up; else, or with KIMIK3_KDA_GLUON_SCAN=0, the Triton ``_fwd_h_kernel``. H200, K3's shape, same run (sixteenth
# session's closing call): the scan 0.565 -> 0.490 ms, forward 2.711 -> 2.628 ms with the state-gradient scan's
# change. Against the Triton scan (benchmarks/kda_gluon_dispatch.py) it was never slower from 6144 items up and 9-17 %
# slower below 4096, where the forward is host-bound.
GLUON_SCAN = os.environ.get("KIMIK3_KDA_GLUON_SCAN", "1") == "1"
GLUON_SCAN_MIN_ITEMS = 6144
# The output o = scale (qg S + Aqk v_new) computed by the Gluon scan itself (``gluon_scan.py``, OUT: qg S while
# v_new is formed, Aqk v_new behind the state update's products) where that scan runs, instead of by the parallel
# ``_output_kernel`` after it; a forward without the backward then stores no per-chunk state or v_new at all. H200,
# same runs: forward 2.627 -> 2.311 ms and forward+backward 8.248 -> 8.076 at K3's shape, 3.415 -> 2.897 and 10.666
# -> 10.320 at B4 T4096 H64 (outputs 2.6e-5 relative RMS apart, gradients identical). KIMIK3_KDA_GLUON_SCAN_OUT=0:
# the output kernel.
GLUON_SCAN_OUT = os.environ.get("KIMIK3_KDA_GLUON_SCAN_OUT", "1") == "1"
# Phase A by the warp-specialised Gluon kernel (``gluon_phase_a.py``: one (chunk, head) per item, its four column
# tiles from one TMA load of q, k, Gamma) where ``gluon_phase_a.supported`` allows it: KIMIK3_KDA_GLUON_A=1.
GLUON_A = os.environ.get("KIMIK3_KDA_GLUON_A", "0") == "1"
# Phases A, B, C by one warp-specialised Gluon kernel (``gluon_local.py``: one (chunk, head) per item, its q, k, v,
# Gamma by TMA, Aqk, T, W, U and the scan operands from shared memory, two CTAs per SM) where ``gluon_local.supported``
# allows it, instead of the split kernels' three launches: KIMIK3_KDA_GLUON_LOCAL=1. H200, K3's shape, same run
# (benchmarks/gluon_local_probe.py): 1.551 ms against their 1.358 (the forward 2.517 against 2.311), the outputs within
# 2e-5 relative RMS.
GLUON_LOCAL = os.environ.get("KIMIK3_KDA_GLUON_LOCAL", "0") == "1"
# A forward alone (no backward to read U) on the Gluon phase C and the Gluon scan with the output: U = T (beta v) is
# formed in the scan, as one more product in the accumulator of W S (issued before the state it waits on), from
# -T diag(beta) in bf16 that phase C stores instead of U; phase C then reads no v and writes no fp32 U (0.4 + 0.2 GB
# at K3's shape). H200, same run: forward 2.319 -> 2.122 ms at K3's shape (phase C 0.643 -> 0.525, the scan 0.558 ->
# 0.491), 2.902 -> 2.653 at B4 T4096 H64; a forward alone's o and state errors against the fp32 token loop 3.97e-3 ->
# 3.95e-3 and 2.51e-3 -> 2.42e-3 (benchmarks/kda_precision.py). KIMIK3_KDA_GLUON_SCAN_U=0: phase C forms U and the
# scan reads it.
GLUON_SCAN_U = os.environ.get("KIMIK3_KDA_GLUON_SCAN_U", "1") == "1"
# A forward alone on 16-token tiles (``triton_prep16`` + ``gluon_scan16``) instead of the 64-token kernels: one
# chunk-parallel Triton kernel forms every tile's operands from the raw inputs (gate, norms and beta's sigmoid fused;
# a tile's [16, 16] matrices are single dense products by the gate bound), and one Gluon scan keeps the state in its
# accumulators and computes the output. Where ``gluon_scan16.supported`` allows it (sm_90, bf16, K = 128), with the
# precision variant 'h' and at least GLUON_SCAN_MIN_ITEMS scan items. H200, same run: forward 2.107 -> 1.234 ms at K3's
# shape (fla 2.610), 2.659 -> 1.453 at B4 T4096 H64 (fla 3.343); a forward alone's o and state errors against the fp32
# token loop 3.95e-3 -> 3.32e-3 and 2.42e-3 -> 2.29e-3. The training forward (return_aux) keeps the 64-token kernels,
# whose intermediates the backward reads. KIMIK3_KDA_CHUNK16=0: the 64-token forward.
CHUNK16 = os.environ.get("KIMIK3_KDA_CHUNK16", "1") == "1"
# W = T (beta k exp(Gamma)) stored in the 16-bit input dtype (U stays fp32: v_new = U - W S needs its
# low bits). Every scan takes W as a 16-bit operand, so the scans compute the same; the WY backward's
# dA = -dRk W^T sees W at 8 mantissa bits instead of tf32's 10. Halves W's traffic (written once, read by
# three kernels). KIMIK3_KDA_W16=0: W fp32 as U.
W_16BIT = os.environ.get("KIMIK3_KDA_W16", "1") == "1"
# tiles16: (K / V block, num_warps[, 1 = phase C as the split mode's own kernel[, 1 = the diagonal blocks
# as their own kernel, one 1-warp program per 16-row tile]])
INTRA16_CONFIG: Tuple[int, ...] = (32, 4)
# Timing ablation of the intra kernel (benchmarks only; results are WRONG when non-zero): 1 skips the
# phase-B solve (T = A), 2 skips phase A's dots, 3 skips phase C (W, U and the scan operands).
INTRA_ABLATE = 0


def _scratch(shape: tuple, device: torch.device) -> torch.Tensor:
    """An fp32 buffer the kernels write in full before anything reads it. Under the interpreter (the tests) it
    starts as NaN, so a kernel change that leaves part of it unwritten fails the tests instead of reading the zeros
    of a fresh page."""
    if INTERPRET:
        return torch.full(shape, float("nan"), device=device)
    return torch.empty(shape, device=device, dtype=torch.float32)


def _next_pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(int(x)))


def _dot_dtype(dtype: torch.dtype):
    return tl.bfloat16 if dtype == torch.bfloat16 else (tl.float16 if dtype == torch.float16 else tl.float32)


# --------------------------------------------------------------------------
# host-side chunk plan
# --------------------------------------------------------------------------


class ChunkPlan(NamedTuple):
    cu: torch.Tensor  # [N + 1] int32 token offsets (packed)
    chunk_idx: torch.Tensor  # [NT, 2] int32: (sequence, chunk within sequence)
    chunk_off: torch.Tensor  # [N + 1] int32: first global chunk of each sequence
    N: int
    NT: int
    seq_lens: Tuple[int, ...]
    offsets: Tuple[int, ...]  # cu, on the host

    def tiles(self, size: int) -> "ChunkPlan":
        """The same sequences' plan in chunks of ``size`` tokens (``triton_prep16``'s 16-token tiles)."""
        return _plan_cached(self.offsets, self.cu.device, size)

    def covers(self, n_tokens: int) -> bool:
        """Whether the plan's sequences hold all n_tokens tokens (B * T), so that kernels writing every token of
        every chunk leave no element of a [B, T, ...] output unwritten (no zero fill needed)."""
        return sum(self.seq_lens) == n_tokens


@functools.lru_cache(maxsize=64)
def _plan_cached(offsets: Tuple[int, ...], device: torch.device, size: int = BT) -> ChunkPlan:
    lens = tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    idx, off = [], [0]
    for n, L in enumerate(lens):
        nc = (L + size - 1) // size
        idx.extend((n, c) for c in range(nc))
        off.append(off[-1] + nc)
    ci = torch.tensor(idx if idx else [[0, 0]], dtype=torch.int32).view(-1, 2)
    return ChunkPlan(
        torch.tensor(offsets, dtype=torch.int32, device=device),
        ci.to(device),
        torch.tensor(off, dtype=torch.int32, device=device),
        len(lens),
        len(idx),
        lens,
        offsets,
    )


def make_plan(B: int, T: int, cu_seqlens: Optional[torch.Tensor], device: torch.device, size: int = BT) -> ChunkPlan:
    """The sequences' chunks of ``size`` tokens (the forward's 64; the 16-token tiles of ``triton_prep16``)."""
    if cu_seqlens is None:
        offsets = tuple(b * T for b in range(B + 1))
    else:
        offsets = tuple(int(x) for x in cu_seqlens.tolist())
    return _plan_cached(offsets, device, size)


# --------------------------------------------------------------------------
# kernel 2: intra-chunk matrices, inverse, WY representation
# --------------------------------------------------------------------------


@triton.jit
def _a_tile(j, q_ptr, k_ptr, G_ptr, aqk_ptr, tinv_ptr, a_base, t0, L, beta, i_h, H,
            K: tl.constexpr, BK: tl.constexpr, DTA: tl.constexpr, PREC: tl.constexpr, ABLATE: tl.constexpr):
    """Phase A for the 64 x 16 column tile j: Aqk (lower) and diag(beta) Akk (strictly lower), against the
    reference eps_j = Gamma at the tile's last valid token (the gate bound keeps both factors finite)."""
    r = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    rv = r < L
    NEG = float("-inf")
    s = j * 16 + r16  # columns of tile j
    sv = s < L
    ref = tl.minimum(j * 16 + 15, L - 1)  # eps_j: Gamma at the tile's last (valid) token
    row_ok = rv & (r >= j * 16)  # rows before tile j are in its past: never read
    acc_q = tl.zeros([64, 16], dtype=tl.float32)
    acc_k = tl.zeros([64, 16], dtype=tl.float32)
    for kb in tl.static_range(0, K, BK):
        c = kb + tl.arange(0, BK)
        cm = c < K
        g_ref = tl.load(G_ptr + (t0 + ref) * (H * K) + i_h * K + c, mask=cm, other=0.0)
        mr = row_ok[:, None] & cm[None, :]  # rows in tile j's past are not loaded
        ro = (t0 + r)[:, None] * (H * K) + i_h * K + c[None, :]
        Gr = tl.load(G_ptr + ro, mask=mr, other=0.0)
        qr = tl.load(q_ptr + ro, mask=mr, other=0.0).to(tl.float32)
        kr = tl.load(k_ptr + ro, mask=mr, other=0.0).to(tl.float32)
        ms = sv[:, None] & cm[None, :]
        so = (t0 + s)[:, None] * (H * K) + i_h * K + c[None, :]
        Gs = tl.load(G_ptr + so, mask=ms, other=0.0)
        ks = tl.load(k_ptr + so, mask=ms, other=0.0).to(tl.float32)
        e_r = tl.exp(tl.where(mr, Gr - g_ref[None, :], NEG))  # (0, e^75]
        e_s = tl.exp(tl.where(ms, g_ref[None, :] - Gs, NEG))  # [e^-75, 1]
        kc = tl.trans((ks * e_s).to(DTA))
        if ABLATE != 2:
            acc_q += tl.dot((qr * e_r).to(DTA), kc, input_precision=PREC)
            acc_k += tl.dot((kr * e_r).to(DTA), kc, input_precision=PREC)
    o2 = a_base + r[:, None] * 64 + s[None, :]
    tl.store(aqk_ptr + o2, tl.where(r[:, None] >= s[None, :], acc_q, 0.0))
    tl.store(tinv_ptr + o2, tl.where(r[:, None] > s[None, :], acc_k * beta[:, None], 0.0))


@triton.jit
def _wy_k_block(kb, t_all, q_ptr, k_ptr, G_ptr, w_ptr, qg_ptr, kg_ptr, eg_ptr, beta, t0, L, i_t, i_h, H,
                K: tl.constexpr, BK: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, key columns [kb, kb + BK): W = T (beta k exp(Gamma)) and the scan operands, which do not
    depend on the state (so they stay off the scan's serial path): q exp(Gamma), k exp(Gamma_C - Gamma)
    and the chunk decay exp(Gamma_C)."""
    r = tl.arange(0, 64)
    c = kb + tl.arange(0, BK)
    mr = (r < L)[:, None] & (c < K)[None, :]
    ro = (t0 + r)[:, None] * (H * K) + i_h * K + c[None, :]
    Gr = tl.load(G_ptr + ro, mask=mr, other=0.0)
    kr = tl.load(k_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    eG = tl.exp(Gr)
    rk = tl.where(mr, kr * beta[:, None] * eG, 0.0)
    w = tl.dot(t_all, rk.to(DTC), input_precision=PREC)
    tl.store(w_ptr + ro, w.to(w_ptr.dtype.element_ty), mask=mr)
    g_last = tl.load(G_ptr + (t0 + L - 1) * (H * K) + i_h * K + c, mask=c < K, other=0.0)
    qr = tl.load(q_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    tl.store(qg_ptr + ro, tl.where(mr, qr * eG, 0.0).to(qg_ptr.dtype.element_ty), mask=mr)
    kg = tl.where(mr, kr * tl.exp(g_last[None, :] - Gr), 0.0)
    tl.store(kg_ptr + ro, kg.to(kg_ptr.dtype.element_ty), mask=mr)
    tl.store(eg_ptr + (i_t * H + i_h) * K + c, tl.exp(g_last), mask=c < K)


@triton.jit
def _wy_v_block(vb, t_all, v_ptr, u_ptr, beta, t0, L, i_h, H,
                V: tl.constexpr, BV: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, value columns [vb, vb + BV): U = T (beta v)."""
    r = tl.arange(0, 64)
    c = vb + tl.arange(0, BV)
    mr = (r < L)[:, None] & (c < V)[None, :]
    ro = (t0 + r)[:, None] * (H * V) + i_h * V + c[None, :]
    vr = tl.load(v_ptr + ro, mask=mr, other=0.0).to(tl.float32)
    u = tl.dot(t_all, (vr * beta[:, None]).to(DTC), input_precision=PREC)
    tl.store(u_ptr + ro, u.to(u_ptr.dtype.element_ty), mask=mr)


@triton.jit
def _intra_kernel(
    q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, aqk_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
    cu_ptr, cidx_ptr, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DTA: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
    SOLVE: tl.constexpr, ABLATE: tl.constexpr,
):
    """Fused intra-chunk kernel, one program per (chunk, head): phases A, B, C in one CTA (the 64 x 64
    matrices pass through the aqk / tinv buffers of this chunk, behind barriers)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    a_base = (i_t * H + i_h) * 4096  # chunk-major 64 x 64 buffers of this (chunk, head)
    for j in tl.static_range(4):
        _a_tile(j, q_ptr, k_ptr, G_ptr, aqk_ptr, tinv_ptr, a_base, t0, L, beta, i_h, H, K, BK, DTA, PREC, ABLATE)
    tl.debug_barrier()
    t_all = _solve(tinv_ptr, a_base, SOLVE, SPREC, ABLATE).to(DTC)
    if ABLATE == 3:
        return
    for kb in tl.static_range(0, K, BK):
        _wy_k_block(kb, t_all, q_ptr, k_ptr, G_ptr, w_ptr, qg_ptr, kg_ptr, eg_ptr, beta, t0, L, i_t, i_h, H,
                    K, BK, DTC, PREC)
    for vb in tl.static_range(0, V, BV):
        _wy_v_block(vb, t_all, v_ptr, u_ptr, beta, t0, L, i_h, H, V, BV, DTC, PREC)


# The same three phases as three kernels (KIMIK3_KDA_INTRA=split): more programs, fewer live tiles each.


@triton.jit
def _intra_a_kernel(q_ptr, k_ptr, G_ptr, beta_ptr, aqk_ptr, tinv_ptr, cu_ptr, cidx_ptr, H,
                    K: tl.constexpr, BK: tl.constexpr, DTA: tl.constexpr, PREC: tl.constexpr):
    """Phase A, one program per (chunk, head, column tile)."""
    i_t, i_h, j = _chunk_part(4)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    _a_tile(j, q_ptr, k_ptr, G_ptr, aqk_ptr, tinv_ptr, (i_t * H + i_h) * 4096, t0, L, beta, i_h, H, K, BK, DTA,
            PREC, 0)


@triton.jit
def _intra_solve_kernel(tinv_ptr, H, SOLVE: tl.constexpr, SPREC: tl.constexpr):
    """Phase B, one program per (chunk, head): T written over A."""
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    _solve(tinv_ptr, (i_t * H + i_h) * 4096, SOLVE, SPREC, 0)


@triton.jit
def _intra_wy_kernel(q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
                     cu_ptr, cidx_ptr, H,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NKB: tl.constexpr,
                     NP: tl.constexpr, DTC: tl.constexpr, PREC: tl.constexpr):
    """Phase C, one program per (chunk, head, K block or V block)."""
    i_t, i_h, p = _chunk_part(NP)
    t0, L, r, beta = _chunk_beta(i_t, i_h, beta_ptr, cidx_ptr, cu_ptr, H)
    t_all = tl.load(tinv_ptr + (i_t * H + i_h) * 4096 + r[:, None] * 64 + r[None, :]).to(DTC)
    if p < NKB:
        _wy_k_block(p * BK, t_all, q_ptr, k_ptr, G_ptr, w_ptr, qg_ptr, kg_ptr, eg_ptr, beta, t0, L, i_t, i_h, H,
                    K, BK, DTC, PREC)
    else:
        _wy_v_block((p - NKB) * BV, t_all, v_ptr, u_ptr, beta, t0, L, i_h, H, V, BV, DTC, PREC)


# --------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------


def _cfg(K: int, V: int):
    """(K padded to a power of two, the K block and the V block of the intra-chunk kernels)."""
    BKF = _next_pow2(K)
    return BKF, min(64, BKF), min(64, _next_pow2(V))


@functools.lru_cache(maxsize=None)
def _gluon(name: str):
    """The Gluon kernel module ``name`` (``gluon_wy``, ``gluon_phase_a``, ``gluon_scan``, ``gluon_bwd_scan``,
    ``gluon_bwd_wy``, ``gluon_bwd_intra``), or None where this Triton has no Gluon (imported only where it may run)."""
    import importlib

    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:
        return None


def _gluon_for(name: str, on: bool, x: torch.Tensor, items: int, min_items: Optional[int] = None):
    """``_gluon(name)`` where a Gluon kernel may take this call (switched on, CUDA tensors, at least min_items work
    items, by default ``GLUON_MIN_ITEMS``), else None; the kernel's own ``supported`` decides the rest."""
    enough = items >= (GLUON_MIN_ITEMS if min_items is None else min_items)
    return _gluon(name) if on and x.is_cuda and enough else None


def _gluon_taking(name: str, on: bool, items: int, supported_args: tuple, min_items: Optional[int] = None):
    """The Gluon kernel module that runs this call, or None for the Triton kernel: ``_gluon_for`` (on the device of
    the first of supported_args) and the module's ``supported(*supported_args)``."""
    gluon = _gluon_for(name, on, supported_args[0], items, min_items)
    return gluon if gluon is not None and gluon.supported(*supported_args) is None else None


def _gluon_wy_taking(qn, kn, v, G, tinv, w, u, qg, kg, plan, H, K, DTC):
    """The Gluon phase C module where it runs this call (``GLUON_WY``, no ``WY_BLOCKS``, its ``supported``), else
    None. u: U or a tensor of its shape and dtype (device "meta" where U is not allocated)."""
    return _gluon_taking("gluon_wy", GLUON_WY and WY_BLOCKS is None, plan.NT * H * triton.cdiv(K, 64),
                         (qn, kn, v, G, tinv, w, u, qg, kg, DTC))


def _launch_intra_wy(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, V, BK, BV, DTC, PREC, warps,
                     tbeta=None):
    """Phase C as its own kernel: one program per (chunk, head, K block or V block), at ``WY_BLOCKS`` when set;
    the Gluon kernel (``gluon_wy.py``) instead where ``GLUON_WY`` is on and it supports the tensors. tbeta: -T
    diag(beta) stored instead of U (u None; the Gluon kernel only)."""
    gluon_wy = _gluon("gluon_wy") if tbeta is not None else \
        _gluon_wy_taking(qn, kn, v, G, tinv, w, u, qg, kg, plan, H, K, DTC)
    if gluon_wy is not None:
        gluon_wy.launch(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, tbeta=tbeta)
        return
    if WY_BLOCKS is not None:
        BK, BV = min(WY_BLOCKS[0], _next_pow2(K)), min(WY_BLOCKS[1], _next_pow2(V))
    nkb = triton.cdiv(K, BK)
    nparts = nkb + triton.cdiv(V, BV)
    _intra_wy_kernel[part_grid(plan.NT, H, nparts)](
        qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan.cu, plan.chunk_idx, H,
        K=K, V=V, BK=BK, BV=BV, NKB=nkb, NP=nparts, DTC=DTC, PREC=PREC, num_warps=warps,
    )


def _launch_split_intra(qn, kn, v, G, betan, aqk, tinv, w, u, qg, kg, eg, plan, H, K, V, BKF, BK, BV, DTA, DTC, PREC,
                        SPREC, tbeta=None):
    """Phases A, B, C as three kernels (``INTRA_MODE`` "split"): phase A per column tile (by ``gluon_phase_a`` where
    ``GLUON_A`` is on and it applies), the solve per (chunk, head), phase C (``_launch_intra_wy``; tbeta: there)."""
    wa, ws, wc = INTRA_SPLIT_WARPS
    NT = plan.NT
    gluon_a = _gluon_taking("gluon_phase_a", GLUON_A and A_BK is None, NT * H * triton.cdiv(K, 64), (qn, kn, G, DTA))
    if gluon_a is not None:
        gluon_a.launch(qn, kn, G, betan, aqk, tinv, plan, H, K)
    else:
        _intra_a_kernel[part_grid(NT, H, 4)](qn, kn, G, betan, aqk, tinv, plan.cu, plan.chunk_idx, H,
                                             K=K, BK=min(A_BK or BK, BKF), DTA=DTA, PREC=PREC, num_warps=wa)
    _intra_solve_kernel[(NT, H)](tinv, H, SOLVE=SOLVE, SPREC=SPREC, num_warps=ws)
    _launch_intra_wy(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, V, BK, BV, DTC, PREC, wc, tbeta)


def kda_fwd_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
    plan: ChunkPlan,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None, g_min: float = -5.0,
    use_gate: bool = False, use_l2: bool = False, use_beta_sigmoid: bool = False,
    return_aux: bool = False, variant: Optional[str] = None,
):
    """Forward only. All tensors contiguous on one device. Returns (o, final_state or None[, aux]). A forward alone
    (not return_aux) runs on 16-token tiles where ``CHUNK16`` says (``triton_prep16`` + ``gluon_scan16``), else, as
    the training forward always does, on the 64-token kernels.

    variant (16-bit inputs only; fp32 inputs always compute in fp32 / tf32x3): which products take
    16-bit operands. A string of letters, default ``DEFAULT_VARIANT``:
      'a' the intra-chunk A matrices in tf32 (else 16-bit operands),
      's' the sequential scan's matmuls in tf32 (else 16-bit; the state is rounded per chunk),
      'c' the WY products W = T (beta k exp(Gamma)), U = T (beta v) in tf32,
      'w' W and U stored in fp32 (else in the input dtype),
      'h' (with a 16-bit scan, i.e. no 's') v_new and Aqk split into 16-bit high and low parts in the
          scan's products (near-fp32 accuracy at 16-bit operand width; ``triton_scan._scan_step``).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    DT = _dot_dtype(q.dtype)
    PREC = "tf32x3" if DT == tl.float32 else "tf32"
    variant = DEFAULT_VARIANT if variant is None else variant
    if not set(variant) <= set("acswh"):
        raise ValueError(f"KDA precision variant (KIMIK3_KDA_VARIANT) takes letters of 'acswh', got {variant!r}")
    DTA = tl.float32 if "a" in variant else DT
    DTS = tl.float32 if "s" in variant else DT
    DTC = tl.float32 if "c" in variant else DT
    BKF, BK, BV_intra = _cfg(K, V)
    if K > 256 or V > 512:
        raise ValueError(f"triton KDA supports K <= 256 and V <= 512, got K={K} V={V}")
    if SOLVE not in (0, 3, 4):
        raise ValueError(f"KIMIK3_KDA_SOLVE must be 0, 3 or 4, got {SOLVE}")
    if INTRA_MODE not in ("fused", "split", "tiles16"):
        raise ValueError(f"KIMIK3_KDA_INTRA must be 'fused', 'split' or 'tiles16', got {INTRA_MODE!r}")
    if FWD_MODE not in ("fused", "split"):
        raise ValueError(f"KIMIK3_KDA_FWD must be 'fused' or 'split', got {FWD_MODE!r}")
    N, NT = plan.N, plan.NT
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    if NT == 0:
        if ht is not None:
            ht.copy_(initial_state.float() if initial_state is not None else torch.zeros_like(ht))
        return (o, ht, None) if return_aux else (o, ht)

    scan_items = NT * H * triton.cdiv(V, 64)  # (chunk, head, 64 V columns): what the Gluon scans' threshold counts
    scan16 = None
    if not return_aux and variant == "h":
        scan16 = _gluon_taking("gluon_scan16", CHUNK16, scan_items, (q, v), GLUON_SCAN_MIN_ITEMS)
    if scan16 is not None:
        tplan = plan.tiles(triton_prep16.TILE)
        prep = triton_prep16.prep16_outputs(tplan, H, K, dev, q.dtype)
        triton_prep16.launch(q, k, g, beta, A_log, dt_bias, prep, tplan, H, K, scale, g_min, use_gate, use_l2,
                             use_beta_sigmoid, L2_EPS)
        scan16.launch(prep, v, initial_state.float().contiguous() if initial_state is not None else None, ht, o,
                      tplan, H, K, V)
        return o, ht
    G = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    qn, kn, betan = q, k, beta
    if use_l2:
        qn, kn = torch.empty_like(q), torch.empty_like(k)
    if use_beta_sigmoid:
        betan = torch.empty(beta.shape, device=dev, dtype=torch.float32)
    dummy = G
    alog_, dtb_ = (A_log, dt_bias) if use_gate else (dummy, dummy)
    triton_prologue.launch_prologue(g, G, q, k, qn, kn, beta, betan, alog_, dtb_, plan, H, K, BKF, BK,
                                    float(g_min), use_gate, use_l2, use_beta_sigmoid)
    # W/U in fp32 when the scan is 16-bit too: a 16-bit W loaded straight into the scan's bf16 dot
    # gave wrong results / illegal addresses on the H200 (Triton 3.6; variants '', 'a', 'c' at
    # T2048 H96 D128, the scan of the first version) while every variant with 'w' or 's' was right --
    # see NOTES-kda.md. W_16BIT: W alone in the 16-bit dtype again (the scans round it to 16 bits anyway).
    wu_dtype = torch.float32 if (DT == tl.float32 or "w" in variant or DTS != tl.float32) else q.dtype
    w_dtype = q.dtype if (W_16BIT and DT != tl.float32 and "w" not in variant) else wu_dtype
    aqk = _scratch((NT, H, 64, 64), dev)
    tinv = _scratch((NT, H, 64, 64), dev)
    w = torch.empty(B, T, H, K, device=dev, dtype=w_dtype)
    u_spec = torch.empty(B, T, H, V, device="meta", dtype=wu_dtype)
    sc_dtype = torch.float32 if DTS == tl.float32 else q.dtype  # scan operands qg, kg
    qg = torch.empty(B, T, H, K, device=dev, dtype=sc_dtype)
    kg = torch.empty(B, T, H, K, device=dev, dtype=sc_dtype)
    eg = torch.empty(NT, H, K, device=dev, dtype=torch.float32)
    SPREC = "tf32x3" if (DT == tl.float32 or DTA == tl.float32) else "tf32"
    hilo = "h" in variant and DTS != tl.float32  # the scans' v_new / Aqk hi-lo splits
    gluon_local_on = INTRA_MODE == "split" and _gluon_taking(
        "gluon_local", GLUON_LOCAL, NT * H * triton.cdiv(K, 64),
        (qn, kn, v, G, w, u_spec, qg, kg, DTA, DTC)) is not None
    # the scan with the output, and which of its forms (storing the states only for the backward)
    h_spec = torch.empty(NT, H, K, V, device="meta", dtype=states_dtype(sc_dtype))
    scan_out = _gluon_taking("gluon_scan", FWD_MODE == "split" and GLUON_SCAN and GLUON_SCAN_OUT, scan_items,
                             (w, kg, u_spec, h_spec if return_aux else None, hilo, qg, aqk), GLUON_SCAN_MIN_ITEMS)
    u_in_scan = (GLUON_SCAN_U and scan_out is not None and not return_aux and INTRA_MODE == "split"
                 and not gluon_local_on
                 and _gluon_wy_taking(qn, kn, v, G, tinv, w, u_spec, qg, kg, plan, H, K, DTC) is not None)
    u = None if u_in_scan else torch.empty(u_spec.shape, device=dev, dtype=wu_dtype)
    tbeta = torch.empty(NT, H, 64, 64, device=dev, dtype=torch.bfloat16) if u_in_scan else None
    if INTRA_MODE == "fused":
        _intra_kernel[(NT, H)](
            qn, kn, v, G, betan, aqk, tinv, w, u, qg, kg, eg, plan.cu, plan.chunk_idx, H,
            K=K, V=V, BK=BK, BV=BV_intra, DTA=DTA, DTC=DTC, PREC=PREC, SPREC=SPREC,
            SOLVE=SOLVE, ABLATE=INTRA_ABLATE, num_warps=INTRA_WARPS or (8 if DT != tl.float32 else 4),
        )
    elif gluon_local_on:
        _gluon("gluon_local").launch(qn, kn, v, G, betan, aqk, tinv, w, u, qg, kg, eg, plan, H, store_t=return_aux)
    elif INTRA_MODE == "split":
        _launch_split_intra(qn, kn, v, G, betan, aqk, tinv, w, u, qg, kg, eg, plan, H, K, V, BKF, BK, BV_intra, DTA,
                            DTC, PREC, SPREC, tbeta)
    elif INTRA_MODE == "tiles16":
        BK16, warps16, split_wy, split_diag = (tuple(INTRA16_CONFIG) + (0, 0))[:4]
        if split_diag:
            _diag16_kernel[(NT, H, 4)](qn, kn, G, betan, aqk, tinv, plan.cu, plan.chunk_idx, H,
                                       K=K, BK=min(BK16, BKF), DTA=DTA, PREC=PREC, num_warps=1)
        _intra16_kernel[(NT, H)](
            qn, kn, v, G, betan, aqk, tinv, w, u, qg, kg, eg, plan.cu, plan.chunk_idx, H,
            K=K, V=V, BK=min(BK16, BKF), BV=min(BK16, _next_pow2(V)), DTA=DTA, DTC=DTC, PREC=PREC, SPREC=SPREC,
            WITH_WY=not split_wy, DIAG=not split_diag, num_warps=warps16,
        )
        if split_wy:
            _launch_intra_wy(qn, kn, v, G, betan, tinv, w, u, qg, kg, eg, plan, H, K, V, BK, BV_intra, DTC, PREC,
                             INTRA_SPLIT_WARPS[2])
    else:  # validated above
        raise AssertionError(INTRA_MODE)
    h0 = initial_state.float().contiguous() if initial_state is not None else dummy
    # what the Triton backward reads (the split forward adds the states h and v_new)
    aux = dict(G=G, aqk=aqk, tinv=tinv, w=w, u=u, q=qn, k=kn, beta=betan, qg=qg, kg=kg, eg=eg, hilo=hilo)
    if FWD_MODE == "split":  # the scans on the variant's operand width, as the fused scan
        # the Gluon scan with the output (above), else without it: each form is asked about what it takes
        gluon_scan = scan_out
        out_in_scan = gluon_scan is not None
        if gluon_scan is None:
            gluon_scan = _gluon_taking("gluon_scan", GLUON_SCAN, scan_items, (w, kg, u_spec, h_spec, hilo),
                                       GLUON_SCAN_MIN_ITEMS)
        # the chunks' entry states and v_new: what the backward reads, and the output kernel's input
        store = return_aux or not out_in_scan
        h = torch.empty(h_spec.shape, device=dev, dtype=h_spec.dtype) if store else None
        vn = torch.empty(B, T, H, V, device=dev, dtype=torch.float32) if store else None
        if gluon_scan is not None:
            gluon_scan.launch(kg, eg, w, u, h0 if initial_state is not None else None, h, vn, ht, plan, H, K, V,
                              **(dict(qg=qg, aqk=aqk, o=o, scale=scale) if out_in_scan else {}),
                              **(dict(tbeta=tbeta, v=v) if u_in_scan else {}))
        else:
            BV_h, warps_h, stages_h = SPLIT_CONFIG
            BV_h = min(BV_h, _next_pow2(V))
            _fwd_h_kernel[(triton.cdiv(V, BV_h), N * H)](
                kg, eg, w, u, h0, h, vn, ht if ht is not None else dummy, plan.cu, plan.chunk_off, H,
                K=K, V=V, BKF=BKF, BV=BV_h, PREC=PREC, HAS_H0=initial_state is not None, STORE_HT=ht is not None,
                INTERP=INTERPRET, DT=DTS, HILO=hilo, num_warps=warps_h, num_stages=stages_h,
            )
        if not out_in_scan:
            BV_o, warps_o = OUTPUT_CONFIG
            BV_o = min(BV_o, _next_pow2(V))
            _output_kernel[(triton.cdiv(V, BV_o), NT, H)](
                qg, aqk, h, vn, o, plan.cu, plan.chunk_idx, H, float(scale),
                K=K, V=V, BKF=BKF, BV=BV_o, PREC=PREC, DT=DTS, HILO=hilo, num_warps=warps_o,
            )
        return (o, ht, dict(aux, h=h, vn=vn)) if return_aux else (o, ht)
    # H200 sweep at B1 T8192 H96 D128 (NOTES-kda.md): BV 64 / 4 warps; 2 stages when the operands are
    # 16-bit (fp32 operands pipelined at BV 64 exceed the 227 KB of shared memory)
    BV_scan = min(64, _next_pow2(V))
    scan_warps, scan_stages = 4, (2 if DTS != tl.float32 else 1)
    if SCAN_CONFIG is not None:
        BV_scan, scan_warps = min(SCAN_CONFIG[0], _next_pow2(V)), SCAN_CONFIG[1]
        scan_stages = SCAN_CONFIG[2] if len(SCAN_CONFIG) > 2 else 1
    _state_out_kernel[(triton.cdiv(V, BV_scan), N * H)](
        qg, kg, eg, w, u, aqk, o, h0, ht if ht is not None else dummy,
        plan.cu, plan.chunk_off, H, float(scale),
        K=K, V=V, BKF=BKF, BV=BV_scan, DT=DTS, PREC=PREC,
        HAS_H0=initial_state is not None, STORE_HT=ht is not None, INTERP=INTERPRET, KT_LOAD=SCAN_KT_LOAD,
        HILO=hilo,
        num_warps=scan_warps, num_stages=scan_stages,
    )
    return (o, ht, aux) if return_aux else (o, ht)
