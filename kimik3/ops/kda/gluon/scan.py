"""Stage 5 of the KDA forward (the Triton ``fwd_scan.py``: ``_fwd_h_kernel``, then ``_output_kernel``) as one
warp-specialised Gluon kernel for Hopper: the state scan over 64-token chunks with the output.

Per sequence, head and 64-column V block, chunk by chunk, with S the state entering the chunk: v_new = U - W S (S
rounded to 16 bits), o = scale (qg S + Aqk v_new) and S <- exp(Gamma_C) S + kg^T v_new, with v_new entering the
products as a 16-bit high part plus its 16-bit remainder (and Aqk likewise: hi hi + hi lo + lo hi), as the Triton
kernels' 16-bit form; each chunk's entry state (bf16) and v_new (fp32) are stored, where the backward reads them.
The chain from one chunk to the next is serial; what this form changes is what waits on it:

- a 1-warp loader partition streams each chunk's W, kg and qg tiles ([64, 64] bf16 boxes, two of each at K = 128)
  and its Aqk (fp32) by TMA into a ``RING``-slot ring, so the next chunk's operands are in shared memory before the
  chain reaches them;
- a 4-warp consumer keeps the state as two fp32 ``warpgroup_mma`` accumulators ([64 state rows, 64 V columns]
  each) and writes its 16-bit copy to shared memory once per chunk as the next products' operand, which TMA also
  stores (off the chain); kg^T enters its products straight from the ring (the shared tile read transposed), so
  nothing is transposed in registers;
- the output is off the chain, so its products go where the chain waits: qg S is issued right after W S and runs
  while v_new is formed, Aqk v_new behind the state update's products; the slot goes back once the state's
  products are done.

Each program is one chain (no persistent loop). At V a multiple of 128 one CTA holds two 64-column blocks of V in
two consumer partitions that share the loader's tiles (``MAXNREG_SHARED``); otherwise one CTA per block
(``MAXNREG``). Either way one CTA fits an SM.

It runs in a training forward only (``forward.py``): a forward alone where it would apply runs on 16-token tiles
(``scan16.py``), so the states and v_new are always stored.

``dispatch.py`` says where it runs (sm_90, bf16, K = 128, V a multiple of 64, enough items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .runtime import _sequence, _wait_slot, release_ring, ring_barriers, run, split16, tile_descriptor

CONSUMER_WARPS = 4  # per consumer partition (one per 64-column block of V)
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
RING = 2  # ring slots, one chunk's W, kg, qg and Aqk tiles each
# Registers per thread at launch (ptxas .maxnreg) with one 64-column block of V per CTA: the CTA launches as two
# warpgroups (the loader's warp padded to one), 32 K registers at 128, half an SM's; the consumer's warpgroup raises
# itself to CONSUMER_REGS, the loader's drops to LOADER_REGS. (Its rings and buffers, 160 KB of shared memory with
# the output's tiles, hold it to one CTA per SM.)
MAXNREG = 128
# With two blocks of V per CTA (V a multiple of 128): 12 warps, one CTA per SM, the second consumer raised to
# CONSUMER_REGS. Sharing the loader's tiles between the two blocks is faster than a CTA per block.
MAXNREG_SHARED = 168
CONSUMER_REGS = gl.constexpr(232)


@gluon.jit
def _loader(ready, empty, w_s, g_s, q_s, a_s, w_d, g_d, q_d, a_d, cu_ptr, coff_ptr, H, K: gl.constexpr):
    """The loader partition: chunk c's W, kg and qg tiles (both K halves) and its Aqk (fp32), once the consumers have
    freed the slot."""
    i_h, bos, eos, nc, coff = _sequence(cu_ptr, coff_ptr, H)
    for c in range(nc):
        slot = _wait_slot(empty, c, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 8 * 64 * 64 * 2)  # (Aqk: two bf16 tiles' bytes)
        t0 = bos + c * 64
        tma.async_copy_global_to_shared(a_d, [((coff + c) * H + i_h) * 64, 0], bar, a_s.index(slot))
        for kb in gl.static_range(2):
            tma.async_copy_global_to_shared(w_d, [t0, i_h * K + kb * 64], bar, w_s.index(2 * slot + kb))
            tma.async_copy_global_to_shared(g_d, [t0, i_h * K + kb * 64], bar, g_s.index(2 * slot + kb))
            tma.async_copy_global_to_shared(q_d, [t0, i_h * K + kb * 64], bar, q_s.index(2 * slot + kb))


@gluon.jit
def _consumer(ready, empty, w_s, g_s, q_s, a_s, hs, vs, h_d, u_ptr, eg_ptr, h0_ptr, vn_ptr, ht_ptr, o_ptr, scale,
              cu_ptr, coff_ptr, H, K: gl.constexpr, V: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
              NW: gl.constexpr, HALF: gl.constexpr, NHALF: gl.constexpr):
    """A consumer partition: the scan's chain and output for 64 V columns, chunk by chunk (module docstring), each
    chunk's entry state and v_new stored (what the backward reads); the CTA's HALF-th of its NHALF column blocks."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 64, 16])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))  # tile rows (tokens, or state rows) and V columns
    col0 = (gl.program_id(0) * NHALF + HALF) * 64
    cv = col0 + gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)  # Aqk as a left operand
    i_h, bos, eos, nc, coff = _sequence(cu_ptr, coff_ptr, H)
    tile = gl.expand_dims(r, 1) * V + gl.expand_dims(cv, 0)  # a [64, 64] block of a [K, V] state
    state = gl.program_id(1).to(gl.int64) * (K * V)  # this sequence and head's state in [N, H, K, V]
    if HAS_H0:
        h_top = gl.load(h0_ptr + state + tile)
        h_bot = gl.load(h0_ptr + state + tile + 64 * V)
    else:
        h_top = gl.zeros([64, 64], gl.float32, layout=MMA)
        h_bot = gl.zeros([64, 64], gl.float32, layout=MMA)
    for c in range(nc):
        t0 = bos + c * 64
        rows = gl.expand_dims(r < eos - t0, 1)
        tok = gl.expand_dims((t0 + r).to(gl.int64), 1) * (H * V) + i_h * V + gl.expand_dims(cv, 0)
        u = gl.load(u_ptr + tok, mask=rows, other=0.0)
        ch = (coff + c) * H + i_h  # the global chunk's (chunk, head) index
        eg_top = gl.expand_dims(gl.load(eg_ptr + ch * K + r), 1)
        eg_bot = gl.expand_dims(gl.load(eg_ptr + ch * K + 64 + r), 1)
        # the state entering the chunk: its 16-bit copy is the next products' operand and the stored state
        tma.store_wait(0)  # the previous chunk's state stores have read hs
        hs.index(0).store(h_top.to(gl.bfloat16))
        hs.index(1).store(h_bot.to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(h_d, [ch * K, col0], hs.index(0))
        tma.async_copy_shared_to_global(h_d, [ch * K + 64, col0], hs.index(1))
        slot = _wait_slot(ready, c, 0)
        # v_new = U - W S, rows past the sequence zero (their W, kg rows belong to the next one)
        p = warpgroup_mma(w_s.index(2 * slot), hs.index(0), gl.zeros([64, 64], gl.float32, layout=MMA),
                          use_acc=False, is_async=True)
        p = warpgroup_mma(w_s.index(2 * slot + 1), hs.index(1), p, is_async=True)
        # qg S, off the chain: it runs while v_new is formed
        o = warpgroup_mma(q_s.index(2 * slot), hs.index(0), gl.zeros([64, 64], gl.float32, layout=MMA),
                          use_acc=False, is_async=True)
        o = warpgroup_mma(q_s.index(2 * slot + 1), hs.index(1), o, is_async=True)
        p = warpgroup_mma_wait(2, deps=[p])
        v = gl.where(rows, u - p, 0.0)
        gl.store(vn_ptr + tok, v, mask=rows)
        v_hi, v_lo = split16(v)
        vs.index(0).store(v_hi)
        vs.index(1).store(v_lo)
        fence_async_shared()
        # S <- exp(Gamma_C) S + kg^T v_hi + kg^T v_lo, kg^T read from the ring transposed (the four products in
        # flight together, one wait)
        h_top = warpgroup_mma(g_s.index(2 * slot).permute((1, 0)), vs.index(0), h_top * eg_top, is_async=True)
        h_bot = warpgroup_mma(g_s.index(2 * slot + 1).permute((1, 0)), vs.index(0), h_bot * eg_bot, is_async=True)
        h_top = warpgroup_mma(g_s.index(2 * slot).permute((1, 0)), vs.index(1), h_top, is_async=True)
        h_bot = warpgroup_mma(g_s.index(2 * slot + 1).permute((1, 0)), vs.index(1), h_bot, is_async=True)
        # + Aqk v_new (hi hi + hi lo + lo hi), behind the state update's products
        a_hi, a_lo = split16(a_s.index(slot).load(AOP))
        o = warpgroup_mma(a_hi, vs.index(0), o, is_async=True)
        o = warpgroup_mma(a_hi, vs.index(1), o, is_async=True)
        o = warpgroup_mma(a_lo, vs.index(0), o, is_async=True)
        h_top, h_bot = warpgroup_mma_wait(3, deps=[h_top, h_bot])
        fence_async_shared()  # (Aqk was read by plain loads) before the loader's next TMA write into the slot
        mbarrier.arrive(empty.index(slot), count=1)  # the slot's tiles are read
        o = warpgroup_mma_wait(0, deps=[o])
        gl.store(o_ptr + tok, (o * scale).to(o_ptr.dtype.element_ty), mask=rows)
    tma.store_wait(0)
    if STORE_HT:
        gl.store(ht_ptr + state + tile, h_top)
        gl.store(ht_ptr + state + tile + 64 * V, h_bot)


@gluon.jit
def _gluon_scan_kernel(w_d, g_d, q_d, a_d, h_d, u_ptr, eg_ptr, h0_ptr, vn_ptr, ht_ptr, o_ptr, scale, cu_ptr, coff_ptr,
                       H, K: gl.constexpr, V: gl.constexpr, HAS_H0: gl.constexpr, STORE_HT: gl.constexpr,
                       RING: gl.constexpr, NHALF: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    """The scan over (V / (64 NHALF), N H) programs, each with NHALF consumer partitions (one per 64-column block of
    V; two share the loader's tiles). w_d, g_d, q_d: TMA descriptors of [64, 64] tiles of W, kg and qg as [tokens,
    H K] bf16, and a_d of Aqk as [NT H 64, 64] fp32; h_d: of the states as [NT H K, V] bf16 (its layout is also the
    16-bit operand buffers')."""
    w_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], w_d.layout)
    g_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], g_d.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], q_d.layout)
    a_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], a_d.layout)
    hs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], h_d.layout)  # the state's two 64-row halves
    vs = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], h_d.layout)  # v_new's high part and remainder
    ready, empty = ring_barriers(RING, NHALF)  # every consumer releases a slot
    if NHALF == 1:
        gl.warp_specialize([
            (_consumer, (ready, empty, w_s, g_s, q_s, a_s, hs, vs, h_d, u_ptr, eg_ptr, h0_ptr, vn_ptr, ht_ptr, o_ptr,
                         scale, cu_ptr, coff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 0, NHALF)),
            (_loader, (ready, empty, w_s, g_s, q_s, a_s, w_d, g_d, q_d, a_d, cu_ptr, coff_ptr, H, K)),
        ], [LOADER_WARPS], [LOADER_REGS])
    else:  # the second block's own state and v_new buffers
        hs2 = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], h_d.layout)
        vs2 = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], h_d.layout)
        gl.warp_specialize([
            (_consumer, (ready, empty, w_s, g_s, q_s, a_s, hs, vs, h_d, u_ptr, eg_ptr, h0_ptr, vn_ptr, ht_ptr, o_ptr,
                         scale, cu_ptr, coff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 0, NHALF)),
            (_consumer, (ready, empty, w_s, g_s, q_s, a_s, hs2, vs2, h_d, u_ptr, eg_ptr, h0_ptr, vn_ptr, ht_ptr, o_ptr,
                         scale, cu_ptr, coff_ptr, H, K, V, HAS_H0, STORE_HT, num_warps, 1, NHALF)),
            (_loader, (ready, empty, w_s, g_s, q_s, a_s, w_d, g_d, q_d, a_d, cu_ptr, coff_ptr, H, K)),
        ], [num_warps, LOADER_WARPS], [REGS, LOADER_REGS])
    release_ring(ready, empty)


def launch(kg, eg, w, u, h0, h, vn, ht, plan, H: int, K: int, V: int, qg, aqk, o, scale: float,
           launcher: Optional[Callable] = None) -> None:
    """The scan and the output by ``_gluon_scan_kernel`` on the forward's tensors (token layout [B, T, H, D], U fp32;
    Aqk as [NT, H, 64, 64] fp32; h0 / ht as [N, H, K, V] fp32 or None); o = scale (qg S + Aqk v_new) in o's dtype,
    the chunks' entry states stored to h (bf16, [NT, H, K, V]) and v_new to vn (fp32, token layout).
    launcher: ``runtime.run``'s."""
    tok = (w.numel() // (H * K), H * K)
    args = (tile_descriptor(w, gl.bfloat16, tok), tile_descriptor(kg, gl.bfloat16, tok),
            tile_descriptor(qg, gl.bfloat16, tok), tile_descriptor(aqk, gl.float32, (-1, 64)),
            tile_descriptor(h, gl.bfloat16, (plan.NT * H * K, V)), u, eg, h0 if h0 is not None else eg, vn,
            ht if ht is not None else eg, o, float(scale), plan.cu, plan.chunk_off, H)
    nhalf = 2 if V % 128 == 0 else 1
    run(_gluon_scan_kernel, (V // (64 * nhalf), plan.N * H), args, launcher, K=K, V=V, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, RING=RING, NHALF=nhalf, REGS=CONSUMER_REGS, num_warps=CONSUMER_WARPS,
        maxnreg=MAXNREG if nhalf == 1 else MAXNREG_SHARED)
