"""Stage 3 of the KDA backward (the Triton ``bwd_intra.py``'s ``_bwd_intra_rows_kernel``: the gradients through Aqk
and A) as a warp-specialised Gluon kernel for Hopper.

Per chunk of 64 tokens and head, with dAqk and dA (dA as NPART partials, from the WY backward), on the K = 128 key
columns:
    row side     dq_t   = sum_{s <= t} dAqk[t, s] k_s e^(Gamma_t - Gamma_s)
                 x_t    = sum_{s <  t} dA[t, s]   k_s e^(Gamma_t - Gamma_s)      (gradient of beta_t k_t)
    column side  dk_s   = sum_{t >= s} (dAqk[t, s] q_t + dA[t, s] beta_t k_t) e^(Gamma_t - Gamma_s)
then the WY backward's partials added, dGamma, dbeta and (``L2`` / ``BSIG``) the fused L2 norm's and beta sigmoid's
chain rules, as the Triton kernel's ``_combine``; dGamma is stored over the partial, and ``_suffix_sum_kernel`` turns
it into dg afterwards, as for the Triton kernel.

The Triton kernel runs one program per (chunk x 16-row tile, head) with [16, 16] x [16, K] products and an
exponential per element of every [16, K] operand. Here one program walks (chunk, head) items with 64-row products:
- the row side takes, for each 16-token column tile j, one [64, 16] x [16, 128] product: dAqk[:, tile j] (and
  dA's) times KC_j = k_j e^(Gamma_j0 - Gamma_j), referenced at the tile's first token Gamma_j0 (factors in
  [1, e^75] by the gate bound). The rows of tile i carry the reference Gamma_i0: before tile j's product the rows
  of tiles >= j are rescaled by the per-column factor e^(Gamma_j0 - Gamma_(j-1)0) <= 1, which moves their reference
  forward one tile (rows of earlier tiles get no terms from tile j: dAqk and dA are lower triangular);
- the column side likewise from the last row tile m down: dAqk[tile m, :]^T (read transposed) times
  q_m e^(Gamma_m - Gamma_mL), the reference Gamma_mL at tile m's last token moving back one tile at a time;
- an exponential per element only in the epilogue, where each row meets its own tile's reference.
Operands are 16-bit: the fp32 dAqk / dA slices and the fp32 [16, 128] tiles each split into a bf16 high part and its
bf16 remainder, three products each (hi hi, hi lo, lo hi), so the products hold about 16 mantissa bits against
tf32's 10 in the Triton kernel.

The kernel's shape: a persistent grid, one CTA per SM; a 1-warp loader partition streams each item's q, k, Gamma
tiles and Gamma's reference rows by TMA into a ``TILE_RING``-slot ring, and its dAqk and dA partials into a 1-slot
ring; the 8-warp consumer partition (two warpgroups, one per 64-column half of the keys in every [64, 128] product)
releases the matrix ring once its products are done, so that the next item's matrices load during the epilogue, and
the tile ring after the epilogue. One partition for both halves keeps a single copy of the (unrolled) code: with a
consumer partition per half, two copies, the warps stall on instruction fetch. The epilogue's global loads (the WY
backward's partial dq and dk, the raw q and k) wait in turn on one item at a time: whatever is added to that chain
costs its latency (the suffix pass fused into the column side's epilogue is slower than the pass it would replace).

``dispatch.py`` says where it runs (sm_90, bf16, K = 128, enough items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .runtime import (_item, _my_items, _wait_slot, release_ring, ring_barriers, run_persistent, split16,
                      tile_descriptor)

CONSUMER_WARPS = 8  # the consumer partition: two warpgroups, one per 64-column half of the keys
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
MAXNREG = 168  # registers per thread at launch: 12 warps (the loader's padded to a warpgroup)
TILE_RING = 2  # slots of the q, k, Gamma ring (64 KB each, with Gamma's reference rows 4 KB more)
CTAS_PER_SM = 1  # the rings take most of an SM's shared memory
NREF = gl.constexpr(8)  # Gamma's reference rows per item: the 4 tiles' first tokens, then their last


@gluon.jit
def _loader(t_ready, t_empty, m_ready, m_empty, q_s, k_s, G_s, refs_s, m_s, q_d, k_d, G_d, ref_d, a_d, da_d, cidx_ptr,
            cu_ptr, n_items, H, part_rows, K: gl.constexpr, NPART: gl.constexpr):
    """The loader partition: per item, its q, k, Gamma tiles and Gamma's reference rows once a tile slot is free, then
    dAqk and dA's partials once the matrix slot is. The reference rows (``NREF``): Gamma at each 16-token tile's first
    token, then at its last, clamped to the chunk's last valid token."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        item = pid + i * nprog
        i_t, i_h, _, t0, L = _item(item, H, cidx_ptr, cu_ptr, 1)
        ts = _wait_slot(t_empty, i, 1)
        bar = t_ready.index(ts)
        mbarrier.expect(bar, 64 * K * (2 + 2 + 4) + NREF * K * 4)
        col = i_h * K
        tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(ts))
        tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(ts))
        tma.async_copy_global_to_shared(G_d, [t0, col], bar, G_s.index(ts))
        for n in gl.static_range(NREF):
            row = gl.minimum(16 * (n % 4) + 15 * (n // 4), L - 1)
            tma.async_copy_global_to_shared(ref_d, [t0 + row, col], bar, refs_s.index(ts * NREF + n))
        ms = _wait_slot(m_empty, i, 1)
        bar = m_ready.index(ms)
        mbarrier.expect(bar, (1 + NPART) * 64 * 64 * 4)
        tma.async_copy_global_to_shared(a_d, [item * 64, 0], bar, m_s.index(ms * (1 + NPART)))
        for p in gl.static_range(NPART):
            tma.async_copy_global_to_shared(da_d, [p * part_rows + item * 64, 0], bar,
                                            m_s.index(ms * (1 + NPART) + 1 + p))


@gluon.jit
def _a_tile(mat, j: gl.constexpr, TRANS: gl.constexpr, AOP: gl.constexpr):
    """Columns [16 j, 16 j + 16) of the [64, 64] shared matrix mat (TRANS: its rows, transposed) as a [64, 16]
    fp32 left operand."""
    if TRANS:
        return mat.slice(j * 16, 16, dim=0).permute((1, 0)).load(AOP)
    return mat.slice(j * 16, 16, dim=1).load(AOP)


@gluon.jit
def _a_parts(m_s, base, NPART: gl.constexpr, j: gl.constexpr, TRANS: gl.constexpr, AOP: gl.constexpr):
    """The [64, 16] left operands of column tile j (TRANS: of row tile j, transposed) of dAqk (m_s.index(base)) and of
    dA (the sum of the NPART partials after it), each as 16-bit high and low parts."""
    a = _a_tile(m_s.index(base), j, TRANS, AOP)
    d = _a_tile(m_s.index(base + 1), j, TRANS, AOP)
    for p in gl.static_range(1, NPART):
        d += _a_tile(m_s.index(base + 1 + p), j, TRANS, AOP)
    a_hi, a_lo = split16(a)
    d_hi, d_lo = split16(d)
    return a_hi, a_lo, d_hi, d_lo


@gluon.jit
def _b_parts(b_s, first: gl.constexpr, x):
    """The fp32 [16, K] tile x as a right operand: its 16-bit high part and remainder in b_s slots first, first + 1."""
    hi, lo = split16(x)
    b_s.index(first).store(hi)
    b_s.index(first + 1).store(lo)


@gluon.jit
def _kc_tile(b_s, first: gl.constexpr, Gs, ks, refs_s, ref0, j: gl.constexpr, r16, L, BL: gl.constexpr):
    """The row side's right operand for column tile j, KC_j = k_j e^(Gamma_j0 - Gamma_j) (factors in [1, e^75]; rows
    past the chunk zero), as 16-bit parts in b_s slots first, first + 1, fenced for the products."""
    valid = gl.expand_dims(j * 16 + r16 < L, 1)
    e = gl.exp(refs_s.index(ref0 + j).load(BL) - Gs.slice(j * 16, 16).load(BL))
    _b_parts(b_s, first, gl.where(valid, ks.slice(j * 16, 16).load(BL).to(gl.float32) * e, 0.0))
    fence_async_shared()


@gluon.jit
def _mma3(a_hi, a_lo, b_s, first: gl.constexpr, acc):
    """acc + a b for the 16-bit parts of a (registers) and b (b_s slots first, first + 1): hi hi + hi lo + lo hi,
    issued asynchronously (the caller waits)."""
    acc = warpgroup_mma(a_hi, b_s.index(first), acc, is_async=True)
    acc = warpgroup_mma(a_hi, b_s.index(first + 1), acc, is_async=True)
    return warpgroup_mma(a_lo, b_s.index(first), acc, is_async=True)


@gluon.jit
def _per_tile_ref(refs_s, first, r, MMA: gl.constexpr):
    """[64, K] in the accumulator layout: every row t against reference row first + t // 16 of refs_s."""
    ref = refs_s.index(first).load(MMA)
    for w in gl.static_range(1, 4):
        ref = gl.where(gl.expand_dims(r >= w * 16, 1), refs_s.index(first + w).load(MMA), ref)
    return ref


@gluon.jit
def _l2_chain(x, dx, EPS: gl.constexpr):
    """The L2 norm's chain rule on the raw rows x, from the gradient dx w.r.t. the normalised rows:
    (dx - x r^2 sum(x dx)) r with r = 1 / |x| (``preact_bwd.l2_bwd_rows``). (Both row sums in one two-operand
    reduction, one exchange between the warpgroups instead of two, is slower.)"""
    rn = gl.rsqrt(gl.sum(x * x, axis=1) + EPS)
    return (dx - x * gl.expand_dims(rn * rn * gl.sum(x * dx, axis=1), 1)) * gl.expand_dims(rn, 1)


@gluon.jit
def _item_tiles(t0, L, i_h, r, c, HK, K: gl.constexpr):
    """The item's valid rows (a [64, 1] mask) and its [64, K] element offsets in a [tokens, H K] tensor. (Offsets
    within the item added to its first element's pointer, as the WY backward's stores, are slower here.)"""
    rows = gl.expand_dims(r < L, 1)
    return rows, gl.expand_dims((t0 + r).to(gl.int64) * HK, 1) + gl.expand_dims(i_h * K + c, 0)


@gluon.jit
def _row_factors(acc_q, acc_b, Gs, refs_s, ref0, r, rows, MMA: gl.constexpr):
    """The row side's accumulators with each row against its own tile's reference (factors in [e^-75, 1]): dq's
    intra-chunk part and x, the gradient of the row operand beta k."""
    er = gl.exp(gl.where(rows, Gs.load(MMA) - _per_tile_ref(refs_s, ref0, r, MMA), float("-inf")))
    return acc_q * er, acc_b * er


@gluon.jit
def _col_factor(acc_c, Gs, refs_s, ref0, r, rows, MMA: gl.constexpr):
    """The column side's accumulator against each row's own tile's reference: dk's intra-chunk part."""
    return acc_c * gl.exp(gl.where(rows, _per_tile_ref(refs_s, ref0 + 4, r, MMA) - Gs.load(MMA), float("-inf")))


@gluon.jit
def _beta_rows(beta_ptr, t0, tok, L, H, i_h):
    """beta at the item's tokens tok (fp32; 0 past the chunk's L valid rows)."""
    return gl.load(beta_ptr + (t0 + tok).to(gl.int64) * H + i_h, mask=tok < L, other=0.0).to(gl.float32)


@gluon.jit
def _store_dbeta(db, dbeta_in_ptr, dbeta_ptr, br_ptr, bo, r, L, part_beta, NPART: gl.constexpr, BSIG: gl.constexpr):
    """dbeta complete: the rows' sums of k x (db), the WY kernel's NPART partials, the sigmoid's chain rule (as
    ``preact_bwd.sigmoid_bwd``; loading the partials at the item's start, with beta, is slower)."""
    for p in gl.static_range(NPART):
        db += gl.load(dbeta_in_ptr + p * part_beta + bo, mask=r < L, other=0.0)
    if BSIG:
        s = 1.0 / (1.0 + gl.exp(-gl.load(br_ptr + bo, mask=r < L, other=0.0).to(gl.float32)))
        db = db * s * (1.0 - s)
    if NPART == 1:  # dbeta's one partial is dbeta itself, and each row's value lives in several threads: all of
        gl.thread_barrier()  # them read it before any writes it back
    gl.store(dbeta_ptr + bo, db.to(dbeta_ptr.dtype.element_ty), mask=r < L)


@gluon.jit
def _consumer(t_ready, t_empty, m_ready, m_empty, q_s, k_s, G_s, refs_s, m_s, b_s, beta_ptr, dq_ptr, dk_ptr, dG_ptr,
              dbeta_in_ptr, dbeta_ptr, qr_ptr, kr_ptr, br_ptr, dq_out, dk_out, cidx_ptr, cu_ptr, n_items, H, part_beta,
              K: gl.constexpr, NPART: gl.constexpr, L2: gl.constexpr, BSIG: gl.constexpr, EPS: gl.constexpr,
              DK_SM: gl.constexpr, dkr_s):
    """The consumer partition: every item's products and epilogue (module docstring), the two warpgroups splitting
    the key columns. The epilogue runs in two parts: the row side's (dq complete, dGamma's row terms reduced into its
    partial in global memory, dk's kept in dkr_s (DK_SM) or added to its partial, dbeta complete) between the row and
    the column products, the column side's after them. The row side's two [64, 128] accumulators are then not held
    through the column products, and no epilogue meets more than two (with one epilogue after both sides the
    compiler spills). DK_SM (dA as one partial): the row side's term of dk (beta x) waits in shared memory (32 KB
    fp32) until the column side completes dk, instead of being added to the partial dk in global memory and loaded
    back; with three partials of dA the matrix ring leaves no room for it."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 2], [1, 0])  # the [16, K] right operands
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))  # the accumulators' rows (tokens) and key columns
    c = gl.arange(0, K, layout=gl.SliceLayout(0, MMA))
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, BL))
    HK = H * K
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        bo = (t0 + r).to(gl.int64) * H + i_h  # the item's per-token scalars, loaded before its tiles are waited for
        beta = gl.expand_dims(gl.load(beta_ptr + bo, mask=r < L, other=0.0).to(gl.float32), 1)
        ts = _wait_slot(t_ready, i, 0)
        ms = _wait_slot(m_ready, i, 0)
        Gs = G_s.index(ts)
        ks = k_s.index(ts)
        qs = q_s.index(ts)
        ref0 = ts * NREF  # this item's reference rows of Gamma: refs_s.index(ref0 + [0, NREF))
        base = ms * (1 + NPART)
        # row side: column tile j's terms, the rows of tiles >= j referenced at Gamma_j0
        acc_q = gl.zeros([64, K], gl.float32, layout=MMA)
        acc_b = gl.zeros([64, K], gl.float32, layout=MMA)
        for j in gl.static_range(4):
            if j > 0:
                step = gl.exp(refs_s.index(ref0 + j).load(MMA) - refs_s.index(ref0 + j - 1).load(MMA))  # <= 1
                step = gl.where(gl.expand_dims(r >= j * 16, 1), step, 1.0)
                acc_q = acc_q * step
                acc_b = acc_b * step
            _kc_tile(b_s, 0, Gs, ks, refs_s, ref0, j, r16, L, BL)
            a_hi, a_lo, d_hi, d_lo = _a_parts(m_s, base, NPART, j, False, AOP)
            acc_q = _mma3(a_hi, a_lo, b_s, 0, acc_q)
            acc_b = _mma3(d_hi, d_lo, b_s, 0, acc_b)
            acc_q, acc_b = warpgroup_mma_wait(0, deps=[acc_q, acc_b])
        # the row side's epilogue: dq, dbeta complete, dGamma's and dk's row terms
        rows, off = _item_tiles(t0, L, i_h, r, c, HK, K)
        dq_r, x = _row_factors(acc_q, acc_b, Gs, refs_s, ref0, r, rows, MMA)
        gl.thread_barrier()
        ki = ks.load(MMA).to(gl.float32)
        # dGamma's updates (this, then the column side's) as reductions in memory (red.global.add, fire and forget:
        # no wait on the partial's load), each element's two from the one thread that holds it, in program order:
        # the sums of load-add-store, but for denormals, which the reduction flushes.
        gl.atomic_add(dG_ptr + off, qs.load(MMA).to(gl.float32) * dq_r + ki * (beta * x), mask=rows, sem="relaxed")
        _store_dbeta(gl.sum(ki * x, axis=1), dbeta_in_ptr, dbeta_ptr, br_ptr, bo, r, L, part_beta, NPART, BSIG)
        gl.thread_barrier()
        if DK_SM:  # (each thread reads back the elements it stores, barriers between)
            dkr_s.store(beta * x)
        else:
            gl.store(dk_ptr + off, gl.load(dk_ptr + off, mask=rows, other=0.0) + beta * x, mask=rows)
        dq = gl.load(dq_ptr + off, mask=rows, other=0.0) + dq_r
        if L2:
            dq = _l2_chain(gl.load(qr_ptr + off, mask=rows, other=0.0).to(gl.float32), dq, EPS)
        gl.store(dq_out + off, dq.to(dq_out.dtype.element_ty), mask=rows)
        # column side: row tile m's terms, the rows of tiles <= m referenced at Gamma_mL (its last token)
        acc_c = gl.zeros([64, K], gl.float32, layout=MMA)
        for m in gl.static_range(3, -1, -1):
            if m < 3:
                step = gl.exp(refs_s.index(ref0 + 5 + m).load(MMA) - refs_s.index(ref0 + 4 + m).load(MMA))  # <= 1
                acc_c = acc_c * gl.where(gl.expand_dims(r < m * 16 + 16, 1), step, 1.0)
            tok = m * 16 + r16
            valid = gl.expand_dims(tok < L, 1)
            f = gl.exp(Gs.slice(m * 16, 16).load(BL) - refs_s.index(ref0 + 4 + m).load(BL))  # in [1, e^75]
            bm = _beta_rows(beta_ptr, t0, tok, L, H, i_h)
            _b_parts(b_s, 0, gl.where(valid, qs.slice(m * 16, 16).load(BL).to(gl.float32) * f, 0.0))
            _b_parts(b_s, 2, gl.where(valid, ks.slice(m * 16, 16).load(BL).to(gl.float32) * f
                                      * gl.expand_dims(bm, 1), 0.0))
            fence_async_shared()
            a_hi, a_lo, d_hi, d_lo = _a_parts(m_s, base, NPART, m, True, AOP)
            acc_c = _mma3(a_hi, a_lo, b_s, 0, acc_c)
            acc_c = _mma3(d_hi, d_lo, b_s, 2, acc_c)
            acc_c = warpgroup_mma_wait(0, deps=[acc_c])
        fence_async_shared()
        mbarrier.arrive(m_empty.index(ms), count=1)  # the next item's matrices load during the epilogue
        # the column side's epilogue: dGamma's column term, dk complete (the rows and offsets, and k below, taken
        # again rather than held in registers through the column products)
        rows, off = _item_tiles(t0, L, i_h, r, c, HK, K)
        dk_c = _col_factor(acc_c, Gs, refs_s, ref0, r, rows, MMA)
        gl.thread_barrier()
        ki = ks.load(MMA).to(gl.float32)
        gl.atomic_add(dG_ptr + off, -(ki * dk_c), mask=rows, sem="relaxed")
        fence_async_shared()
        mbarrier.arrive(t_empty.index(ts), count=1)
        gl.thread_barrier()
        dk = gl.load(dk_ptr + off, mask=rows, other=0.0)
        if DK_SM:
            dk += dkr_s.load(MMA)
        dk += dk_c
        if L2:
            dk = _l2_chain(gl.load(kr_ptr + off, mask=rows, other=0.0).to(gl.float32), dk, EPS)
        gl.store(dk_out + off, dk.to(dk_out.dtype.element_ty), mask=rows)


@gluon.jit
def _gluon_bwd_intra_kernel(q_d, k_d, G_d, ref_d, a_d, da_d, beta_ptr, dq_ptr, dk_ptr, dG_ptr, dbeta_in_ptr,
                            dbeta_ptr, qr_ptr, kr_ptr, br_ptr, dq_out, dk_out, cidx_ptr, cu_ptr, NT, H, part_rows,
                            part_beta, K: gl.constexpr, NPART: gl.constexpr, L2: gl.constexpr, BSIG: gl.constexpr,
                            EPS: gl.constexpr, RING: gl.constexpr, DK_SM: gl.constexpr, num_warps: gl.constexpr):
    """Stage 3 over NT chunks x H heads (q_d, k_d, G_d: TMA descriptors of [64, K] tiles of q, k, Gamma as [tokens,
    H K], ref_d of Gamma's [1, K] rows; a_d, da_d: of dAqk as [NT H 64, 64] and dA's partials as [NPART NT H 64, 64],
    part_rows = NT H 64 apart)."""
    q_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, K], q_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, K], k_d.layout)
    G_s = gl.allocate_shared_memory(gl.float32, [RING, 64, K], G_d.layout)
    refs_s = gl.allocate_shared_memory(gl.float32, [RING * NREF, 1, K], ref_d.layout)
    m_s = gl.allocate_shared_memory(gl.float32, [1 + NPART, 64, 64], a_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [4, 16, K], gl.NVMMASharedLayout.get_default_for([16, K],
                                                                                                gl.bfloat16))
    # the row side's dk term (DK_SM; a row, unused, when off)
    dkr_s = gl.allocate_shared_memory(gl.float32, [64 if DK_SM else 1, K], G_d.layout)
    t_ready, t_empty = ring_barriers(RING, 1)
    m_ready, m_empty = ring_barriers(1, 1)
    gl.warp_specialize([
        (_consumer, (t_ready, t_empty, m_ready, m_empty, q_s, k_s, G_s, refs_s, m_s, b_s, beta_ptr, dq_ptr, dk_ptr,
                     dG_ptr, dbeta_in_ptr, dbeta_ptr, qr_ptr, kr_ptr, br_ptr, dq_out, dk_out, cidx_ptr, cu_ptr, NT * H,
                     H, part_beta, K, NPART, L2, BSIG, EPS, DK_SM, dkr_s)),
        (_loader, (t_ready, t_empty, m_ready, m_empty, q_s, k_s, G_s, refs_s, m_s, q_d, k_d, G_d, ref_d, a_d, da_d,
                   cidx_ptr, cu_ptr, NT * H, H, part_rows, K, NPART)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(t_ready, t_empty)
    release_ring(m_ready, m_empty)


def launch(q, k, G, beta, daqk, da, dq, dk, dG, dbeta_parts, dbeta, plan, H: int, npart: int,
           raw: Optional[tuple] = None, out: Optional[tuple] = None, l2: bool = False, bsig: bool = False,
           eps: float = 0.0, launcher: Optional[Callable] = None, programs: Optional[int] = None) -> None:
    """Stage 3 by ``_gluon_bwd_intra_kernel`` on ``bwd_intra.bwd_intra``'s tensors (token layout [B, T, H, K]; daqk
    as [NT, H, 64, 64], da as [npart, NT, H, 64, 64], fp32; npart 1 or 3): dG (the partial dGamma) becomes the
    complete dGamma in place, dbeta the whole dbeta (from dbeta_parts' npart partials). raw: the raw q, k, beta of
    the fused L2 norm (l2) and sigmoid (bsig), whose gradients go to out = (dq_out, dk_out) (default: dq, dk in
    place) and to dbeta. launcher, programs: ``runtime.run_persistent``'s."""
    K = q.shape[-1]
    tok = (q.numel() // (H * K), H * K)
    rows = plan.NT * H * 64
    qr, kr, br = raw if raw is not None else (q, k, beta)
    dq_out, dk_out = out if out is not None else (dq, dk)
    args = (tile_descriptor(q, gl.bfloat16, tok, (64, K)), tile_descriptor(k, gl.bfloat16, tok, (64, K)),
            tile_descriptor(G, gl.float32, tok, (64, K)), tile_descriptor(G, gl.float32, tok, (1, K), swizzled=False),
            tile_descriptor(daqk, gl.float32, (rows, 64)), tile_descriptor(da, gl.float32, (npart * rows, 64)),
            beta, dq, dk, dG, dbeta_parts, dbeta, qr, kr, br, dq_out, dk_out, plan.chunk_idx, plan.cu, plan.NT, H,
            rows, dbeta_parts.numel() // npart)
    run_persistent(_gluon_bwd_intra_kernel, plan.NT * H, q.device, args, launcher, programs, CTAS_PER_SM, K=K,
                   NPART=npart, L2=l2, BSIG=bsig, EPS=eps, RING=TILE_RING, DK_SM=npart == 1,
                   num_warps=CONSUMER_WARPS, maxnreg=MAXNREG)
