"""Stage 2 of the KDA backward (the Triton ``bwd_wy.py``'s ``_bwd_wy_kernel``, the WY backward) as a warp-specialised
Gluon kernel for Hopper.

Per chunk of 64 tokens and head (``backward.py``'s docstring has the maths), from the state-gradient scan's dRv
(stored over dv_new) and the forward's v_new, U, W, states h and the scan's dh:
    V side   dAqk = scale dO v_new^T (lower, diagonal included), dA_v = -dRv U^T, dv = beta dRv,
             dbeta_v = rowsum(dRv v)
    K side   dqg = scale dO h^T, dkg = v_new dh^T, dRk = -dRv h^T, deg = rowsum_V(h dh)
    then the chain rule through the exponentials (partial dq, dk, dGamma, as the Triton ``_wy_k_side``),
    dA_k = -dRk W^T, dbeta_k = rowsum(dRk k e^Gamma); dA = dA_v + dA_k (strict lower) and dbeta = dbeta_v + dbeta_k
    whole.
The Triton kernel splits each (chunk, head) into three programs (the V side, two 64-column key blocks) that each
read dO, v_new and dRv, and writes dA and dbeta as three partials. Here one item is a (chunk, head) and writes dA and
dbeta whole (the intra backward then takes one partial).

The kernel's shape: a persistent grid, one CTA per SM; a 1-warp loader partition streams each item by TMA as three
stages through a ``RING``-slot ring of 112 KB slots: the two 64-column halves of V (v_new, dRv, U, dO, v and the
state tiles h, dh of those columns), then the key side's q, k, W, Gamma. A slot is seven fp32 [64, 64] units (three
allocations: shapes must be powers of two), each stage's tiles reinterpreted over them. The 8-warp consumer (two
warpgroups splitting N of every product) accumulates the V-contractions over the two halves, then applies the chain
rule and stores. Products: 16-bit operands where one side is 16-bit (dO, h, v's tiles; the fp32 side split into a
bf16 high part and remainder, two products), tf32 where both are fp32 (U dRv^T and v_new dh^T, as the Triton
kernel's tf32 products), and dA_k from dRk's 16-bit parts written into the key stage's free unit and over Gamma once
it is read.

``dispatch.py`` says where it runs (sm_90, bf16, K = V = 128, fewer than 2^31 state rows and dA elements, enough
items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .runtime import (_item, _item_ahead, _my_items, _wait_slot, release_ring, ring_barriers, run_persistent, split16,
                      tile_descriptor)

CONSUMER_WARPS = 8  # two warpgroups, splitting N of every product
# the loader partition at setmaxnreg's floor, so that the consumer's warps get 240 registers (the consumer is bound by
# registers: one item in flight)
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(24)
MAXNREG = 168  # registers per thread at launch: 12 warps (the loader's padded to a warpgroup)
CTAS_PER_SM = 1  # the ring's two slots take 224 KB of shared memory
RING = 2  # slots of seven fp32 [64, 64] units (112 KB each), allocated as 4 + 2 + 1 (shapes are powers of two)
STAGES = gl.constexpr(3)  # per item: V columns [0, 64), [64, 128), then the key side


@gluon.jit
def _stage_tiles(s4, s2, s1, st, do_d, h_d):
    """A V-half stage's tiles in ring slot st, over its seven fp32 [64, 64] units (s4: four per slot, s2: two as one
    [128, 64] tile, s1: one): v_new, dRv, U (fp32 [64, 64] each), dO and v (bf16 [64, 64], one unit together), dh
    (fp32 [128, 64]), h (bf16 [128, 64])."""
    dov = s4.index(st * 4 + 3)._reinterpret(gl.bfloat16, [2, 64, 64], do_d.layout)
    h = s1.index(st)._reinterpret(gl.bfloat16, [128, 64], h_d.layout)
    return s4.index(st * 4), s4.index(st * 4 + 1), s4.index(st * 4 + 2), dov.index(0), dov.index(1), h, s2.index(st)


@gluon.jit
def _key_tiles(s4, s2, st, G_d, q_d):
    """The key stage's tiles in ring slot st: q, k, W (bf16 [64, 128], a unit each), Gamma (fp32 [64, 128], two
    units)."""
    q = s4.index(st * 4)._reinterpret(gl.bfloat16, [64, 128], q_d.layout)
    k = s4.index(st * 4 + 1)._reinterpret(gl.bfloat16, [64, 128], q_d.layout)
    w = s4.index(st * 4 + 2)._reinterpret(gl.bfloat16, [64, 128], q_d.layout)
    return s2.index(st)._reinterpret(gl.float32, [64, 128], G_d.layout), q, k, w


@gluon.jit
def _loader(ready, empty, s4, s2, s1, vn_d, drv_d, u_d, do_d, v_d, h_d, dh_d, q_d, k_d, w_d, G_d, cidx_ptr,
            cu_ptr, n_items, H, K: gl.constexpr):
    """The loader partition: each item's three stages into the ring, each once its slot is free."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        hrow = (i_t * H + i_h) * K  # the item's state rows in h, dh as [NT H K, V]
        for half in gl.static_range(2):
            st = _wait_slot(empty, i * STAGES + half, 1)
            bar = ready.index(st)
            vn, drv, u, do, v, h, dh = _stage_tiles(s4, s2, s1, st, do_d, h_d)
            mbarrier.expect(bar, 64 * 64 * (4 * 3 + 2 * 2) + K * 64 * (2 + 4))
            col = i_h * K + half * 64  # (K == V)
            tma.async_copy_global_to_shared(vn_d, [t0, col], bar, vn)
            tma.async_copy_global_to_shared(drv_d, [t0, col], bar, drv)
            tma.async_copy_global_to_shared(u_d, [t0, col], bar, u)
            tma.async_copy_global_to_shared(do_d, [t0, col], bar, do)
            tma.async_copy_global_to_shared(v_d, [t0, col], bar, v)
            tma.async_copy_global_to_shared(h_d, [hrow, half * 64], bar, h)
            tma.async_copy_global_to_shared(dh_d, [hrow, half * 64], bar, dh)
        st = _wait_slot(empty, i * STAGES + 2, 1)
        bar = ready.index(st)
        G, q, k, w = _key_tiles(s4, s2, st, G_d, q_d)
        mbarrier.expect(bar, 64 * K * (4 + 2 * 3))
        col = i_h * K
        tma.async_copy_global_to_shared(G_d, [t0, col], bar, G)
        tma.async_copy_global_to_shared(q_d, [t0, col], bar, q)
        tma.async_copy_global_to_shared(k_d, [t0, col], bar, k)
        tma.async_copy_global_to_shared(w_d, [t0, col], bar, w)


@gluon.jit
def _store_matrix(ptr, x_t, i_t, i_h, H, L, rs, ct, DIAG: gl.constexpr):
    """A chunk's [64, 64] matrix from its transpose x_t ([s, t], rows rs, columns ct) into ptr's [NT, H, 64, 64] as
    [t, s]: the strictly lower triangle (and the diagonal when DIAG) of the chunk's L valid rows and columns; the
    rest zero. Addressed from the item's first element (a scalar pointer) plus offsets within it, as the key side's
    stores (``_consumer``)."""
    valid = gl.expand_dims(rs < L, 1) & gl.expand_dims(ct < L, 0)
    keep = gl.expand_dims(ct, 0) > gl.expand_dims(rs, 1)
    if DIAG:
        keep = keep | (gl.expand_dims(ct, 0) == gl.expand_dims(rs, 1))
    base = ptr + (i_t * H + i_h) * 4096
    gl.store(base + gl.expand_dims(rs, 1) + gl.expand_dims(ct, 0) * 64, gl.where(valid & keep, x_t, 0.0))


@gluon.jit
def _consumer(ready, empty, s4, s2, s1, do_d, h_d, G_d, q_d, G_ptr, beta_ptr, dq_ptr, dk_ptr, dG_ptr, dv_ptr,
              dbeta_ptr, daqk_ptr, da_ptr, cidx_ptr, cu_ptr, n_items, H, scale, K: gl.constexpr):
    """The consumer partition: each item's V-contractions over its two V halves, then the key side (module
    docstring); the two warpgroups split N of every product. Registers are what bounds it (one item in flight, 240
    per thread): dAqk is stored as soon as the V halves are done and U dRv^T becomes dA_k's starting accumulator, so
    that two [64, 64] accumulators fewer live through the key side; the key side's stores are addressed from the
    item's first element plus 32-bit offsets within it, instead of 64-bit offsets per element (fewer spills)."""
    M128: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
    M128T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 8])
    M64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    M64T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 8])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M64, k_width=2)
    A128: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=M128, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])  # [64 | 128, 64] elementwise tiles
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, M128))  # tokens (rows) and key columns of the [64, K] tiles
    c = gl.arange(0, K, layout=gl.SliceLayout(0, M128))
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, M64))  # the [64, 64] matrices' rows s and columns t (transposed)
    ct = gl.arange(0, 64, layout=gl.SliceLayout(0, M64))
    rb = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    cb = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    HK = H * K
    pid, nprog, count = _my_items(n_items)
    nxt_t, nxt_h, _, nxt_t0, nxt_L = _item_ahead(pid, nprog, 0, n_items, H, cidx_ptr, cu_ptr)
    for i in range(count):  # (each item's metadata read during the item before it)
        i_t, i_h, t0, L = nxt_t, nxt_h, nxt_t0, nxt_L
        nxt_t, nxt_h, _, nxt_t0, nxt_L = _item_ahead(pid, nprog, i + 1, n_items, H, cidx_ptr, cu_ptr)
        tok = (t0 + rb).to(gl.int64)
        beta_b = gl.load(beta_ptr + tok * H + i_h, mask=rb < L, other=0.0).to(gl.float32)
        daqk_t = gl.zeros([64, 64], gl.float32, layout=M64)  # [s, t]: the transposes of dAqk and U dRv^T
        udrv_t = gl.zeros([64, 64], gl.float32, layout=M64T)
        dqg = gl.zeros([64, K], gl.float32, layout=M128)
        dkg = gl.zeros([64, K], gl.float32, layout=M128T)
        drk = gl.zeros([64, K], gl.float32, layout=M128)  # dRv h^T (negated below)
        deg = gl.zeros([K], gl.float32, layout=gl.SliceLayout(1, BL))
        dbv = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, BL))
        for half in gl.static_range(2):
            st = _wait_slot(ready, i * STAGES + half, 0)
            vn, drv, u, do, v, h, dh = _stage_tiles(s4, s2, s1, st, do_d, h_d)
            vn_hi, vn_lo = split16(vn.load(A64))  # (rows past the chunk: masked where dAqk is stored)
            daqk_t = warpgroup_mma(vn_hi, do.permute((1, 0)), daqk_t, is_async=True)
            daqk_t = warpgroup_mma(vn_lo, do.permute((1, 0)), daqk_t, is_async=True)
            udrv_t = warpgroup_mma(u, drv.permute((1, 0)), udrv_t, is_async=True)
            dqg = warpgroup_mma(do, h.permute((1, 0)), dqg, is_async=True)
            dkg = warpgroup_mma(vn, dh.permute((1, 0)), dkg, is_async=True)
            daqk_t = warpgroup_mma_wait(3, deps=[daqk_t])  # v_new's parts free before dRv's are made
            d_hi, d_lo = split16(drv.load(A128))
            drk = warpgroup_mma(d_hi, h.permute((1, 0)), drk, is_async=True)
            drk = warpgroup_mma(d_lo, h.permute((1, 0)), drk, is_async=True)
            daqk_t, udrv_t, dqg, dkg, drk = warpgroup_mma_wait(0, deps=[daqk_t, udrv_t, dqg, dkg, drk])
            # deg over these V columns; dv = beta dRv and dbeta's v part, on the elementwise layout (after the
            # products: their operands' registers free)
            deg += gl.sum(h.load(BL).to(gl.float32) * dh.load(BL), axis=1)
            de = drv.load(BL)
            rows_b = gl.expand_dims(rb < L, 1)
            gl.store(dv_ptr + gl.expand_dims(tok * HK + i_h * K + half * 64, 1) + gl.expand_dims(cb, 0),
                     (de * gl.expand_dims(beta_b, 1)).to(dv_ptr.dtype.element_ty), mask=rows_b)
            dbv += gl.sum(gl.where(rows_b, de * v.load(BL).to(gl.float32), 0.0), axis=1)
            fence_async_shared()
            mbarrier.arrive(empty.index(st), count=1)
        # dAqk now, and U dRv^T as dA_k's starting accumulator (dA = -(U dRv^T + W dRk^T)): two tiles fewer below
        _store_matrix(daqk_ptr, daqk_t * scale, i_t, i_h, H, L, rs, ct, True)
        dak_t = gl.convert_layout(udrv_t, M64)
        # the key side: the chain rule through the exponentials (the Triton ``_wy_k_side``)
        st = _wait_slot(ready, i * STAGES + 2, 0)
        Gs, qs, ks, ws = _key_tiles(s4, s2, st, G_d, q_d)
        rows = gl.expand_dims(r < L, 1)
        item0 = t0.to(gl.int64) * HK + i_h * K  # the item's first element, then offsets within it
        dq_i, dk_i, dG_i = dq_ptr + item0, dk_ptr + item0, dG_ptr + item0
        off = gl.expand_dims(r * HK, 1) + gl.expand_dims(c, 0)
        G = Gs.load(M128)
        g_last = gl.expand_dims(gl.load(G_ptr + (t0 + L - 1).to(gl.int64) * HK + i_h * K + c), 0)  # its last token
        eG = gl.where(rows, gl.exp(G), 0.0)
        # dA^T's key part -W dRk^T onto U dRv^T, issued first and waited for last: dRk = -dRv h^T as 16-bit parts in
        # the slot's free unit and over Gamma (read above for the last time), the right operand of products with W's
        # tile
        drk = -drk
        r_hi, r_lo = split16(drk)
        free = s4.index(st * 4 + 3)._reinterpret(gl.bfloat16, [64, K], q_d.layout)
        over_g = s2.index(st)._reinterpret(gl.bfloat16, [2, 64, K], q_d.layout).index(0)
        free.store(r_hi)
        over_g.store(r_lo)
        fence_async_shared()
        dak_t = warpgroup_mma(ws, free.permute((1, 0)), dak_t, is_async=True)
        dak_t = warpgroup_mma(ws, over_g.permute((1, 0)), dak_t, is_async=True)
        # the partial dq, dk, dGamma, each term as soon as its factors are at hand (fewer registers live)
        dq = dqg * scale * eG
        gl.store(dq_i + off, dq, mask=rows)
        dG = dq * qs.load(M128).to(gl.float32)
        rk = drk * eG  # (after dq: dqg's registers free before rk's are taken)
        dkc = gl.convert_layout(dkg, M128) * gl.where(rows, gl.exp(g_last - G), 0.0)
        k = ks.load(M128).to(gl.float32)
        dG -= dkc * k
        dgc = gl.sum(dkc * k, axis=0) + gl.convert_layout(deg, gl.SliceLayout(0, M128)) * gl.exp(gl.sum(g_last, 0))
        beta = gl.expand_dims(gl.convert_layout(beta_b, gl.SliceLayout(1, M128)), 1)
        gl.store(dk_i + off, dkc + beta * rk, mask=rows)
        dG += beta * rk * k
        dbk = gl.sum(rk * k, axis=1)
        dG += gl.where(gl.expand_dims(r == L - 1, 1), gl.expand_dims(dgc, 0), 0.0)
        gl.store(dG_i + off, dG, mask=rows)
        dak_t = warpgroup_mma_wait(0, deps=[dak_t])
        fence_async_shared()
        mbarrier.arrive(empty.index(st), count=1)
        # dAqk and dA (stored as [t, s]: ``_store_matrix``); dbeta whole
        _store_matrix(da_ptr, -dak_t, i_t, i_h, H, L, rs, ct, False)
        db = dbv + gl.convert_layout(dbk, gl.SliceLayout(1, BL))
        gl.store(dbeta_ptr + tok * H + i_h, db, mask=rb < L)


@gluon.jit
def _gluon_bwd_wy_kernel(vn_d, drv_d, u_d, do_d, v_d, h_d, dh_d, q_d, k_d, w_d, G_d, beta_ptr, dq_ptr, dk_ptr,
                         dG_ptr, dv_ptr, dbeta_ptr, daqk_ptr, da_ptr, G_ptr, cidx_ptr, cu_ptr, NT, H, scale,
                         K: gl.constexpr, RING: gl.constexpr, num_warps: gl.constexpr):
    """The WY backward over NT chunks x H heads (module docstring). Descriptors: vn_d, drv_d, u_d of fp32 and do_d, v_d
    of bf16 [64, 64] tiles of [tokens, H V]; h_d (bf16) and dh_d (fp32) of [K, 64] tiles of the states as [NT H K, V];
    q_d, k_d, w_d (bf16) and G_d (fp32) of [64, K] tiles of [tokens, H K]; G_ptr: Gamma itself."""
    s4 = gl.allocate_shared_memory(gl.float32, [RING * 4, 64, 64], vn_d.layout)  # a slot's units (``_stage_tiles``)
    s2 = gl.allocate_shared_memory(gl.float32, [RING, 128, 64], dh_d.layout)
    s1 = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], vn_d.layout)
    ready, empty = ring_barriers(RING, 1)
    gl.warp_specialize([
        (_consumer, (ready, empty, s4, s2, s1, do_d, h_d, G_d, q_d, G_ptr, beta_ptr, dq_ptr, dk_ptr, dG_ptr,
                     dv_ptr, dbeta_ptr, daqk_ptr, da_ptr, cidx_ptr, cu_ptr, NT * H, H, scale, K)),
        (_loader, (ready, empty, s4, s2, s1, vn_d, drv_d, u_d, do_d, v_d, h_d, dh_d, q_d, k_d, w_d, G_d,
                   cidx_ptr, cu_ptr, NT * H, H, K)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def launch(q, k, v, G, beta, w, u, h, dh, vn, drv, do, dq, dk, dG, dv, dbeta, daqk, da, plan, H: int, scale: float,
           launcher: Optional[Callable] = None, programs: Optional[int] = None) -> None:
    """The WY backward by ``_gluon_bwd_wy_kernel`` on the backward's tensors (token layout [B, T, H, D]; h, dh as
    [NT, H, K, V]; drv: dRv, stored over dv_new). Writes the partial dq, dk, dGamma (fp32), dv (v's dtype), dbeta
    whole, dAqk and dA whole ([NT, H, 64, 64] fp32; dA as the one partial the intra backward sums). launcher,
    programs: ``runtime.run_persistent``'s."""
    K = q.shape[-1]
    tok = (q.numel() // (H * K), H * K)
    states = (plan.NT * H * K, K)
    args = (tile_descriptor(vn, gl.float32, tok), tile_descriptor(drv, gl.float32, tok),
            tile_descriptor(u, gl.float32, tok), tile_descriptor(do, gl.bfloat16, tok),
            tile_descriptor(v, gl.bfloat16, tok), tile_descriptor(h, gl.bfloat16, states, (K, 64)),
            tile_descriptor(dh, gl.float32, states, (K, 64)), tile_descriptor(q, gl.bfloat16, tok, (64, K)),
            tile_descriptor(k, gl.bfloat16, tok, (64, K)), tile_descriptor(w, gl.bfloat16, tok, (64, K)),
            tile_descriptor(G, gl.float32, tok, (64, K)), beta, dq, dk, dG, dv, dbeta, daqk, da, G, plan.chunk_idx,
            plan.cu, plan.NT, H, float(scale))
    run_persistent(_gluon_bwd_wy_kernel, plan.NT * H, q.device, args, launcher, programs, CTAS_PER_SM, K=K,
                   RING=RING, num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
