"""The serial half of a forward alone on 16-token tiles: the state scan over the tiles, with the output, as a
warp-specialised Gluon kernel for Hopper that keeps the state in its ``warpgroup_mma`` accumulators (``prep16.py``
writes the tiles' operands, in parallel, before it).

Per sequence, head and 64 V columns, tile by tile, with S the state entering the tile:

    v_new = (T diag(beta)) v - W S,   o = qd S + Aqk v_new,   S <- e^Gamma_C S + kr^T v_new.

The tiles are 16 tokens, too few rows for a ``warpgroup_mma`` (64 at least), so the products run transposed, with
the state held as S^T ([64 V columns, 128 keys] in fp32, two [64, 64] accumulators over the key halves):
- v_new^T = -(v^T (-T diag(beta))^T + S^T W^T): the first product from shared memory (off the chain: it does not
  wait on the state), then S^T's 16-bit copy enters as the left operand straight from its registers (the
  accumulator's layout is the left operand's, so nothing moves), and W's tile read transposed from the ring;
- o^T = S^T qd^T + v_new^T Aqk^T (Aqk's 16-bit high and low parts: hi hi + hi lo + lo hi), issued beside the chain;
- S^T <- S^T e^Gamma_C + v_new^T kr, v_new^T entering from registers as a 16-bit high part and its remainder, kr's
  tile as it lies in the ring. The state never passes through shared memory.

A 1-warp loader streams each tile's W, kr, qd (two [16, 64] boxes each), v (one per 64-column block of V) and the
three [16, 16] matrices by TMA into a ``RING``-slot ring; one CTA per (sequence, head, 128 V columns) with a
consumer warpgroup per 64-column block sharing the loader's tiles (as ``scan.py``), or one block per CTA when V is
not a multiple of 128. Each tile's e^Gamma_C is loaded a step ahead: the decay is on the chain. o is stored from
registers, masked to the sequence's tokens.

``dispatch.py`` says where it runs (a forward alone on sm_90, bf16, K = 128, V a multiple of 64, enough items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .runtime import _sequence, _wait_slot, release_ring, ring_barriers, run, split16, tile_descriptor

CONSUMER_WARPS = 4  # per consumer partition (one per 64-column block of V)
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
RING = 6  # ring slots, one tile's operands each (17.5 KB at 128 V columns): the loader runs several tiles ahead
MAXNREG = 168  # registers per thread at launch with two blocks of V per CTA: 12 warps, one CTA per SM
MAXNREG_HALF = 128  # with one block per CTA (V not a multiple of 128): two warpgroups, two CTAs per SM
CONSUMER_REGS = gl.constexpr(232)  # what each consumer warpgroup raises itself to (setmaxnreg)


@gluon.jit
def _loader(ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, w_d, r_d, q_d, v_d, tb_d, ah_d, al_d, cu_ptr,
            toff_ptr, H, V: gl.constexpr, NHALF: gl.constexpr):
    """The loader partition: tile c's operands into ring slot c % RING once every consumer has freed it."""
    i_h, bos, eos, nc, toff = _sequence(cu_ptr, toff_ptr, H, 16)
    for c in range(nc):
        slot = _wait_slot(empty, c, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, (6 + NHALF) * 16 * 64 * 2 + 3 * 16 * 16 * 2)
        row = ((toff + c) * H + i_h) * 16  # the tile's first row in the chunk-major [NT16 H 16, .] views
        for kb in gl.static_range(2):
            tma.async_copy_global_to_shared(w_d, [row, kb * 64], bar, w_s.index(2 * slot + kb))
            tma.async_copy_global_to_shared(r_d, [row, kb * 64], bar, r_s.index(2 * slot + kb))
            tma.async_copy_global_to_shared(q_d, [row, kb * 64], bar, q_s.index(2 * slot + kb))
        for hb in gl.static_range(NHALF):
            col = i_h * V + (gl.program_id(0) * NHALF + hb) * 64
            tma.async_copy_global_to_shared(v_d, [bos + c * 16, col], bar, v_s.index(NHALF * slot + hb))
        tma.async_copy_global_to_shared(tb_d, [row, 0], bar, tb_s.index(slot))
        tma.async_copy_global_to_shared(ah_d, [row, 0], bar, ah_s.index(slot))
        tma.async_copy_global_to_shared(al_d, [row, 0], bar, al_s.index(slot))


@gluon.jit
def _consumer(ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, eg_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr, toff_ptr, H,
              K: gl.constexpr, V: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr, NW: gl.constexpr,
              HALF: gl.constexpr, NHALF: gl.constexpr):
    """A consumer partition: the scan's chain for the CTA's HALF-th block of 64 V columns (module docstring)."""
    S64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 64, 16])
    S16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 16, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S16, k_width=2)  # left of the N = 16 products
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S64, k_width=2)  # left of the state update
    i_h, bos, eos, nc, toff = _sequence(cu_ptr, toff_ptr, H, 16)
    col0 = (gl.program_id(0) * NHALF + HALF) * 64
    sv = gl.arange(0, 64, layout=gl.SliceLayout(1, S64))  # S^T's rows: V columns col0 + sv
    sk = gl.arange(0, 64, layout=gl.SliceLayout(0, S64))  # S^T's columns: keys within a half
    st = gl.expand_dims(sk, 0) * V + gl.expand_dims(col0 + sv, 1)  # S^T[v, k] = S[k, v] in a [K, V] state
    state = gl.program_id(1).to(gl.int64) * (K * V)  # this sequence and head's state in [N, H, K, V]
    if HAS_H0:
        s0 = gl.load(h0_ptr + state + st)
        s1 = gl.load(h0_ptr + state + st + 64 * V)
    else:
        s0 = gl.zeros([64, 64], gl.float32, layout=S64)
        s1 = gl.zeros([64, 64], gl.float32, layout=S64)
    ov = gl.arange(0, 64, layout=gl.SliceLayout(1, S16))  # o^T's rows: V columns
    ot = gl.arange(0, 16, layout=gl.SliceLayout(0, S16))  # o^T's columns: the tile's tokens
    o_cols = gl.expand_dims(i_h * V + col0 + ov, 1)
    # e^Gamma_C of the tile the next step takes, loaded a step ahead: the decay is on the chain
    eg_row = eg_ptr + (toff * H + i_h) * K + sk
    eg_next0 = gl.load(eg_row)
    eg_next1 = gl.load(eg_row + 64)
    for c in range(nc):
        t0 = bos + c * 16
        eg0 = gl.expand_dims(eg_next0, 0)
        eg1 = gl.expand_dims(eg_next1, 0)
        eg_row = eg_ptr + ((toff + gl.minimum(c + 1, nc - 1)) * H + i_h) * K + sk
        eg_next0 = gl.load(eg_row)
        eg_next1 = gl.load(eg_row + 64)
        slot = _wait_slot(ready, c, 0)
        # -v_new^T = v^T (-T diag(beta))^T + S^T W^T; the first product does not wait on the state
        p = warpgroup_mma(v_s.index(NHALF * slot + HALF).permute((1, 0)), tb_s.index(slot).permute((1, 0)),
                          gl.zeros([64, 16], gl.float32, layout=S16), use_acc=False, is_async=True)
        a0 = gl.convert_layout(s0.to(gl.bfloat16), A16)
        a1 = gl.convert_layout(s1.to(gl.bfloat16), A16)
        p = warpgroup_mma(a0, w_s.index(2 * slot).permute((1, 0)), p, is_async=True)
        p = warpgroup_mma(a1, w_s.index(2 * slot + 1).permute((1, 0)), p, is_async=True)
        o = warpgroup_mma(a0, q_s.index(2 * slot).permute((1, 0)), gl.zeros([64, 16], gl.float32, layout=S16),
                          use_acc=False, is_async=True)
        o = warpgroup_mma(a1, q_s.index(2 * slot + 1).permute((1, 0)), o, is_async=True)
        s0 = s0 * eg0  # (the fp32 state is free once its 16-bit copy is taken)
        s1 = s1 * eg1
        p = warpgroup_mma_wait(2, deps=[p])
        v_hi, v_lo = split16(-p)  # v_new^T; rows past the sequence are zero (their W, -T diag(beta) rows are)
        u_hi = gl.convert_layout(v_hi, A64)
        u_lo = gl.convert_layout(v_lo, A64)
        s0 = warpgroup_mma(u_hi, r_s.index(2 * slot), s0, is_async=True)
        s1 = warpgroup_mma(u_hi, r_s.index(2 * slot + 1), s1, is_async=True)
        s0 = warpgroup_mma(u_lo, r_s.index(2 * slot), s0, is_async=True)
        s1 = warpgroup_mma(u_lo, r_s.index(2 * slot + 1), s1, is_async=True)
        o_hi = gl.convert_layout(v_hi, A16)
        o_lo = gl.convert_layout(v_lo, A16)
        o = warpgroup_mma(o_hi, ah_s.index(slot).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma(o_hi, al_s.index(slot).permute((1, 0)), o, is_async=True)
        o = warpgroup_mma(o_lo, ah_s.index(slot).permute((1, 0)), o, is_async=True)
        s0, s1, o = warpgroup_mma_wait(0, deps=[s0, s1, o])
        mbarrier.arrive(empty.index(slot), count=1)  # the slot's tiles are read
        tok = gl.expand_dims((t0 + ot).to(gl.int64), 0) * (H * V)
        gl.store(o_ptr + tok + o_cols, o.to(o_ptr.dtype.element_ty), mask=gl.expand_dims(ot < eos - t0, 0))
    if STORE_HT:
        gl.store(ht_ptr + state + st, s0)
        gl.store(ht_ptr + state + st + 64 * V, s1)


@gluon.jit
def _gluon_scan16_kernel(w_d, r_d, q_d, v_d, tb_d, ah_d, al_d, eg_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr, toff_ptr, H,
                         K: gl.constexpr, V: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                         RING: gl.constexpr, NHALF: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    """The scan over (V / (64 NHALF), N H) programs, each with NHALF consumer partitions sharing one loader. w_d, r_d,
    q_d: TMA descriptors of [16, 64] boxes of W, kr, qd as [NT16 H 16, K]; v_d: of v as [tokens, H V]; tb_d, ah_d,
    al_d: of [16, 16] boxes of -T diag(beta) and Aqk's high and low parts as [NT16 H 16, 16]; all bf16."""
    w_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 16, 64], w_d.layout)
    r_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 16, 64], r_d.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 16, 64], q_d.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [NHALF * RING, 16, 64], v_d.layout)
    tb_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 16, 16], tb_d.layout)
    ah_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 16, 16], ah_d.layout)
    al_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 16, 16], al_d.layout)
    ready, empty = ring_barriers(RING, NHALF)  # every consumer releases a slot
    if NHALF == 1:
        gl.warp_specialize([
            (_consumer, (ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, eg_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr,
                         toff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 0, NHALF)),
            (_loader, (ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, w_d, r_d, q_d, v_d, tb_d, ah_d, al_d,
                       cu_ptr, toff_ptr, H, V, NHALF)),
        ], [LOADER_WARPS], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, eg_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr,
                         toff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 0, NHALF)),
            (_consumer, (ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, eg_ptr, h0_ptr, ht_ptr, o_ptr, cu_ptr,
                         toff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 1, NHALF)),
            (_loader, (ready, empty, w_s, r_s, q_s, v_s, tb_s, ah_s, al_s, w_d, r_d, q_d, v_d, tb_d, ah_d, al_d,
                       cu_ptr, toff_ptr, H, V, NHALF)),
        ], [num_warps, LOADER_WARPS], [REGS, LOADER_REGS])
    release_ring(ready, empty)


def launch(prep, v, h0, ht, o, tplan, H: int, K: int, V: int, launcher: Optional[Callable] = None) -> None:
    """The scan by ``_gluon_scan16_kernel``: prep, ``prep16.prep16_outputs`` as the prep kernel filled them; v and o in
    token layout [B, T, H, V] (bf16); h0 / ht as [N, H, K, V] fp32 or None. launcher: ``runtime.run``'s."""
    w, kr, qd, eg, tb, a_hi, a_lo = prep
    rows = tplan.NT * H * 16
    if rows >= 2**31:  # the TMA boxes' rows are addressed in 32 bits
        raise ValueError(f"the 16-token scan addresses fewer than 2^31 tile rows (got {rows})")
    box = (16, 64)
    args = (tile_descriptor(w, gl.bfloat16, (rows, K), box), tile_descriptor(kr, gl.bfloat16, (rows, K), box),
            tile_descriptor(qd, gl.bfloat16, (rows, K), box),
            tile_descriptor(v, gl.bfloat16, (v.numel() // (H * V), H * V), box),
            tile_descriptor(tb, gl.bfloat16, (rows, 16), (16, 16)),
            tile_descriptor(a_hi, gl.bfloat16, (rows, 16), (16, 16)),
            tile_descriptor(a_lo, gl.bfloat16, (rows, 16), (16, 16)),
            eg, h0 if h0 is not None else eg, ht if ht is not None else eg, o, tplan.cu, tplan.chunk_off, H)
    nhalf = 2 if V % 128 == 0 else 1
    run(_gluon_scan16_kernel, (V // (64 * nhalf), tplan.N * H), args, launcher, K=K, V=V, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, RING=RING, NHALF=nhalf, REGS=CONSUMER_REGS, num_warps=CONSUMER_WARPS,
        maxnreg=MAXNREG if nhalf == 2 else MAXNREG_HALF)
