"""Stage 1 of the KDA backward (Triton): the state gradients, by a reverse scan over each sequence's chunks.

With dO = scale * do and dS' the gradient of a chunk's exit state (``backward.py`` has the whole math):
    dv_new = Aqk^T dO + kg dS',     dS = qg^T dO - W^T dv_new + eg * dS',
then dRv = T^T dv_new, which every part of the WY backward needs. Three kernels: ``_dvn_local_kernel`` (the
state-independent Aqk^T dO, in parallel over chunks, off the scan's serial path), ``_bwd_dh_kernel`` per (V block,
sequence x head) (the serial part; stores every chunk's exit-state gradient dh [NT, H, K, V] fp32, dv_new and the
initial state's gradient) and ``_drv_kernel`` (dRv over dv_new, in parallel). On Hopper the Gluon kernel
``gluon/bwd_scan.py`` does all three in one (``dispatch.py``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .plan import INTERPRET, ChunkPlan
from .triton_common import _chunk_block, _chunk_part, _chunk_tiles, _scan_program, _split16, _state_tile, part_grid


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
    16-bit remainder (do, qg, kg are 16-bit already). ACC (16-bit, a non-zero scale): the products
    accumulate into dv_new and dh in place (tl.dot's acc, W negated) instead of each landing in a temporary
    first. The scale = dscale (a power of two) x its mantissa part, unit = scale / dscale: dO enters its
    product times dscale, exact in 16 bits, and dh and dv_new are carried divided by unit (the dv_new buffer
    holds dscale Aqk^T dO), multiplied by it where they are stored. (Rounding dO * scale to 16 bits instead loses
    dh0 precision; dO unscaled with the scale applied to the product needs 120 KB of shared memory: one CTA per
    SM.)"""
    r, rv, mk, mv, ko, vo = _chunk_tiles(i_c, bos, eos, i_h, H, K, V, ck, cv)
    km = ck < K
    hoff = ((coff + i_c) * H + i_h) * (K * V) + ck[:, None] * V + cv[None, :]
    # the gradient of this chunk's exit state
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


@triton.jit
def _drv_kernel(tinv_ptr, dvn_ptr, cu_ptr, cidx_ptr, H, V: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                PREC: tl.constexpr):
    """dRv = T^T dv_new per (chunk, head, V block), written over dv_new: the WY kernel's
    three parts per chunk all need it and would each recompute it."""
    vo, mv, tmatT = _chunk_v_block(tinv_ptr, cu_ptr, cidx_ptr, H, V, BV, NV)
    tl.store(dvn_ptr + vo, tl.dot(tmatT, tl.load(dvn_ptr + vo, mask=mv, other=0.0), input_precision=PREC), mask=mv)


def scan_launch(scan_dt, acc: bool) -> Tuple[int, int, int]:
    """(V block, num_warps, num_stages) of the state-gradient scan on operands of scan_dt. fp32: 32 / 8 / 1 (fp32
    [K, BV] tiles must not be multi-buffered: at K = 128 two stages need more than an H200's 227 KB of shared memory;
    8 warps stop register spills). 16-bit with the products accumulated in place (acc): 64 / 4 / 2, two CTAs per SM,
    so K3's 192 chains run in one wave; without: 64 / 8 / 2."""
    if scan_dt == tl.float32:
        return 32, 8, 1
    return (64, 4, 2) if acc else (64, 8, 2)


def scale_split(scale: float, acc: bool) -> float:
    """dscale: the power of two in scale = dscale x (its mantissa part in [1, 2)) that the in-place 16-bit scan (acc)
    multiplies dO by exactly, carrying dv_new and dh in units of the mantissa part; 1 otherwise."""
    return 2.0 ** (math.frexp(scale)[1] - 1) if acc else 1.0


def launch(aqk, tinv, qg, kg, eg, w, do, dht: Optional[torch.Tensor], dh, dvn, dh0: Optional[torch.Tensor],
           plan: ChunkPlan, H: int, K: int, V: int, BKF: int, BV: int, scale: float, PREC: str, scan_dt,
           acc: bool) -> None:
    """dh, dvn (holding dRv = T^T dv_new at the end) and dh0 (when not None) from dO and the forward's operands. BV:
    the WY backward's V block (the parallel kernels use it too)."""
    dscale = scale_split(scale, acc)
    nv = triton.cdiv(V, BV)
    _dvn_local_kernel[part_grid(plan.NT, H, nv)](
        aqk, do, dvn, plan.cu, plan.chunk_idx, H, dscale if acc else float(scale),
        V=V, BV=BV, NV=nv, PREC=PREC, DT=scan_dt, num_warps=4,
    )
    BVs, warps, stages = scan_launch(scan_dt, acc)
    dummy = eg
    # the scan holds >= 32 state rows (masked): its fp32 branch at K = 16 (16-row state tiles) stored wrong dv_new on
    # the H200 while its 16-bit branch and K = 32 were right, and the interpreter is right at both
    _bwd_dh_kernel[(triton.cdiv(V, BVs), plan.N * H)](
        qg, kg, eg, w, do, dht if dht is not None else dummy, dh, dvn, dh0 if dh0 is not None else dummy,
        plan.cu, plan.chunk_off, H, float(scale), dscale,
        K=K, V=V, BKF=max(32, BKF), BV=BVs, PREC=PREC, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
        INTERP=INTERPRET, DT=scan_dt, ACC=acc, num_warps=warps, num_stages=stages,
    )
    _drv_kernel[part_grid(plan.NT, H, nv)](tinv, dvn, plan.cu, plan.chunk_idx, H, V=V, BV=BV, NV=nv, PREC=PREC,
                                           num_warps=4)
