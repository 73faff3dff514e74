"""Stage 1 of the KDA backward (the Triton ``bwd_scan.py``: ``_dvn_local_kernel``, ``_bwd_dh_kernel`` and
``_drv_kernel``) as one warp-specialised Gluon kernel for Hopper.

Per sequence and head, chunk by chunk from the last, with dS the gradient of the state leaving the chunk: store dS,
then dv_new = scale Aqk^T dO + kg dS (Aqk^T and dS each as a 16-bit high part plus its 16-bit remainder), and
    dRv = T^T dv_new    stored in dv_new's place (what the WY backward reads): T^T's and dv_new's 16-bit parts,
                        hi hi + hi lo + lo hi, off the chain,
    dS <- exp(Gamma_C) dS + scale qg^T dO - W^T dv_new    (dv_new rounded to 16 bits).
As the Triton scan's in-place form, the chain carries dS and dv_new divided by the scale, so dO enters its product
exactly; here divided by the whole scale (the Triton kernel divides by its mantissa part and multiplies dO by the
power of two), which differs from it by powers of two only: the same operands, the same roundings.

The kernel's shape:
- one CTA per (sequence, head) holds both 64-column halves of V in two 4-warp consumer partitions, so the chunk's
  kg, qg and W tiles (which do not depend on V) are loaded once for both;
- a 1-warp loader partition streams each chunk's kg, qg, W (two [64, 64] bf16 boxes each at K = 128) and dO (one
  box per half) by TMA into a ``RING``-slot ring, which both consumers release;
- each consumer keeps its half of dS as two fp32 ``warpgroup_mma`` accumulators (64 state rows each), writes the
  16-bit high and low parts to shared memory once per chunk as the next products' operand, and reads qg^T and W^T
  straight from the ring (the shared tiles read transposed); Aqk^T and T^T enter as register operands, loaded from
  global memory.

``dispatch.py`` says where it runs (sm_90, bf16, K = V = 128, a non-zero scale, enough items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .runtime import _sequence, _wait_slot, release_ring, ring_barriers, run, split16, tile_descriptor

CONSUMER_WARPS = 4  # per consumer partition (one per 64-column half of V)
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)  # the second consumer partition's registers per thread (setmaxnreg)
RING = 2  # ring slots (each holds one chunk's kg, qg, W and dO tiles)
MAXNREG = 168  # registers per thread at launch: 12 warps (the loader's padded to a warpgroup), one CTA per SM


@gluon.jit
def _loader(ready, empty, kg_s, qg_s, w_s, do_s, kg_d, qg_d, w_d, do_d, cu_ptr, coff_ptr, H, K: gl.constexpr,
            V: gl.constexpr):
    """The loader partition: the chunks' tiles, last chunk first, each once both consumers have freed its slot."""
    i_h, bos, eos, nc, coff = _sequence(cu_ptr, coff_ptr, H)
    for c in range(nc):
        slot = _wait_slot(empty, c, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 8 * 64 * 64 * 2)
        t0 = bos + (nc - 1 - c) * 64
        for b in gl.static_range(2):  # the two 64-column blocks of K, and of V
            tma.async_copy_global_to_shared(kg_d, [t0, i_h * K + b * 64], bar, kg_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(qg_d, [t0, i_h * K + b * 64], bar, qg_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(w_d, [t0, i_h * K + b * 64], bar, w_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(do_d, [t0, i_h * V + b * 64], bar, do_s.index(2 * slot + b))


@gluon.jit
def _transposed_parts(mat_ptr, ch, ra, ca, valid):
    """The transpose of chunk-head ch's [64, 64] fp32 matrix at mat_ptr (Aqk or T, chunk-major) as a left operand,
    split into 16-bit high and low parts (``split16``); its columns from the chunk's valid row count on are zero
    (they would meet the next sequence's rows)."""
    m_t = gl.load(mat_ptr + ch * 4096 + gl.expand_dims(ca, 0) * 64 + gl.expand_dims(ra, 1),
                  mask=gl.expand_dims(ca < valid, 0), other=0.0)
    return split16(m_t)


@gluon.jit
def _consumer(ready, empty, kg_s, qg_s, w_s, do_s, hs, vs, eg_ptr, aqk_ptr, tinv_ptr, dht_ptr, dh_ptr, dvn_ptr, dh0_ptr,
              cu_ptr, coff_ptr, H, scale, K: gl.constexpr, V: gl.constexpr, HAS_DHT: gl.constexpr,
              STORE_DH0: gl.constexpr, NW: gl.constexpr, HALF: gl.constexpr):
    """A consumer partition: the chain for V columns [64 HALF, 64 HALF + 64) (module docstring), with Aqk at aqk_ptr
    and T at tinv_ptr; dRv stored at dvn_ptr (vs holds -dv_new's high part and its remainder)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 64, 16])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))  # tile rows (tokens, or state rows) and V columns
    cv = HALF * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    ra = gl.arange(0, 64, layout=gl.SliceLayout(1, AOP))  # Aqk^T's rows and columns as a left operand
    ca = gl.arange(0, 64, layout=gl.SliceLayout(0, AOP))
    i_h, bos, eos, nc, coff = _sequence(cu_ptr, coff_ptr, H)
    tile = gl.expand_dims(r, 1) * V + gl.expand_dims(cv, 0)  # a [64, 64] block of a [K, V] state
    s_off = gl.program_id(1).to(gl.int64) * (K * V) + tile  # [N, H, K, V]
    if HAS_DHT:
        d_top = gl.load(dht_ptr + s_off) / scale
        d_bot = gl.load(dht_ptr + s_off + 64 * V) / scale
    else:
        d_top = gl.zeros([64, 64], gl.float32, layout=MMA)
        d_bot = gl.zeros([64, 64], gl.float32, layout=MMA)
    for c in range(nc):
        cc = nc - 1 - c
        t0 = bos + cc * 64
        rows = gl.expand_dims(r < eos - t0, 1)
        tok = gl.expand_dims((t0 + r).to(gl.int64), 1) * (H * V) + i_h * V + gl.expand_dims(cv, 0)
        ch = ((coff + cc) * H + i_h).to(gl.int64)  # the global chunk's (chunk, head) index
        # Aqk^T as the products' left operand: high and low 16-bit parts, in registers
        a_hi, a_lo = _transposed_parts(aqk_ptr, ch, ra, ca, eos - t0)
        eg_top = gl.expand_dims(gl.load(eg_ptr + ch * K + r), 1)
        eg_bot = gl.expand_dims(gl.load(eg_ptr + ch * K + 64 + r), 1)
        # the gradient of the state leaving the chunk, and its 16-bit parts as the next products' operand
        gl.store(dh_ptr + ch * (K * V) + tile, d_top * scale)
        gl.store(dh_ptr + ch * (K * V) + tile + 64 * V, d_bot * scale)
        hi_top, lo_top = split16(d_top)
        hi_bot, lo_bot = split16(d_bot)
        hs.index(0).store(hi_top)
        hs.index(1).store(hi_bot)
        hs.index(2).store(lo_top)
        hs.index(3).store(lo_bot)
        fence_async_shared()
        slot = _wait_slot(ready, c, 0)
        d_o = do_s.index(2 * slot + HALF)
        # dv_new = Aqk^T dO + kg dS (high parts, then the remainders), rows past the sequence zero
        dv_local = warpgroup_mma(a_hi, d_o, gl.zeros([64, 64], gl.float32, layout=MMA), use_acc=False)
        dv_local = warpgroup_mma(a_lo, d_o, dv_local)
        dvn = warpgroup_mma(kg_s.index(2 * slot), hs.index(0), dv_local)
        dvn = warpgroup_mma(kg_s.index(2 * slot + 1), hs.index(1), dvn)
        dvn = warpgroup_mma(kg_s.index(2 * slot), hs.index(2), dvn)
        dvn = warpgroup_mma(kg_s.index(2 * slot + 1), hs.index(3), dvn)
        dvn = gl.where(rows, dvn, 0.0)
        neg_hi, neg_lo = split16(-dvn)
        vs.index(0).store(neg_hi)
        vs.index(1).store(neg_lo)
        fence_async_shared()
        # dRv = T^T dv_new, off the chain: T^T's and -dv_new's 16-bit parts (hi hi + hi lo + lo hi)
        t_hi, t_lo = _transposed_parts(tinv_ptr, ch, ra, ca, eos - t0)
        drv = warpgroup_mma(t_hi, vs.index(0), gl.zeros([64, 64], gl.float32, layout=MMA), use_acc=False)
        drv = warpgroup_mma(t_hi, vs.index(1), drv)
        drv = warpgroup_mma(t_lo, vs.index(0), drv)
        gl.store(dvn_ptr + tok, drv * -scale, mask=rows)
        if eos - t0 < 64:  # a sequence's last, partial chunk: its dO tile's rows past it are the next sequence's
            d_o.store(gl.where(rows, d_o.load(MMA), 0.0).to(gl.bfloat16))
            fence_async_shared()
        # dS <- exp(Gamma_C) dS + qg^T dO - W^T dv_new, qg^T and W^T read from the ring transposed
        d_top = warpgroup_mma(qg_s.index(2 * slot).permute((1, 0)), d_o, d_top * eg_top)
        d_top = warpgroup_mma(w_s.index(2 * slot).permute((1, 0)), vs.index(0), d_top)
        d_bot = warpgroup_mma(qg_s.index(2 * slot + 1).permute((1, 0)), d_o, d_bot * eg_bot)
        d_bot = warpgroup_mma(w_s.index(2 * slot + 1).permute((1, 0)), vs.index(0), d_bot)
        mbarrier.arrive(empty.index(slot), count=1)
    if STORE_DH0:
        gl.store(dh0_ptr + s_off, d_top * scale)
        gl.store(dh0_ptr + s_off + 64 * V, d_bot * scale)


@gluon.jit
def _gluon_dh_scan_kernel(kg_d, qg_d, w_d, do_d, eg_ptr, aqk_ptr, tinv_ptr, dht_ptr, dh_ptr, dvn_ptr, dh0_ptr, cu_ptr,
                          coff_ptr, H, scale, K: gl.constexpr, V: gl.constexpr, HAS_DHT: gl.constexpr,
                          STORE_DH0: gl.constexpr, RING: gl.constexpr, num_warps: gl.constexpr):
    """The scan over (1, N H) programs (the _d arguments: TMA descriptors of [64, 64] bf16 tiles of kg, qg, W as
    [tokens, H K] and dO as [tokens, H V])."""
    kg_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], kg_d.layout)
    qg_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], qg_d.layout)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], w_d.layout)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], do_d.layout)
    hs0 = gl.allocate_shared_memory(gl.bfloat16, [4, 64, 64], kg_d.layout)  # each half's dS parts
    hs1 = gl.allocate_shared_memory(gl.bfloat16, [4, 64, 64], kg_d.layout)
    vs0 = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], kg_d.layout)  # each half's -dv_new (hi, lo)
    vs1 = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], kg_d.layout)
    ready, empty = ring_barriers(RING, 2)  # every consumer releases a slot
    gl.warp_specialize([
        (_consumer, (ready, empty, kg_s, qg_s, w_s, do_s, hs0, vs0, eg_ptr, aqk_ptr, tinv_ptr, dht_ptr, dh_ptr, dvn_ptr,
                     dh0_ptr, cu_ptr, coff_ptr, H, scale, K, V, HAS_DHT, STORE_DH0, num_warps, 0)),
        (_consumer, (ready, empty, kg_s, qg_s, w_s, do_s, hs1, vs1, eg_ptr, aqk_ptr, tinv_ptr, dht_ptr, dh_ptr, dvn_ptr,
                     dh0_ptr, cu_ptr, coff_ptr, H, scale, K, V, HAS_DHT, STORE_DH0, num_warps, 1)),
        (_loader, (ready, empty, kg_s, qg_s, w_s, do_s, kg_d, qg_d, w_d, do_d, cu_ptr, coff_ptr, H, K, V)),
    ], [num_warps, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    release_ring(ready, empty)


def launch(qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H: int, scale: float, aqk, tinv,
           launcher: Optional[Callable] = None) -> None:
    """The scan by ``_gluon_dh_scan_kernel`` on the backward's tensors (token layout [B, T, H, D] bf16; eg as [NT, H,
    K], Aqk and T as [NT, H, 64, 64] fp32; dh as [NT, H, K, V] fp32; dht / dh0 as [N, H, K, V] fp32 or None): dh,
    dh0 and dvn, dv_new's buffer, which ends holding dRv = T^T dv_new (the chain carried divided by the whole scale,
    module docstring). launcher: ``runtime.run``'s."""
    K, V = qg.shape[-1], do.shape[-1]
    tok_k, tok_v = (qg.numel() // (H * K), H * K), (do.numel() // (H * V), H * V)
    args = (tile_descriptor(kg, gl.bfloat16, tok_k), tile_descriptor(qg, gl.bfloat16, tok_k),
            tile_descriptor(w, gl.bfloat16, tok_k), tile_descriptor(do, gl.bfloat16, tok_v), eg, aqk, tinv,
            dht if dht is not None else dh, dh, dvn, dh0 if dh0 is not None else dh, plan.cu, plan.chunk_off, H,
            float(scale))
    run(_gluon_dh_scan_kernel, (1, plan.N * H), args, launcher, K=K, V=V, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, RING=RING, num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
