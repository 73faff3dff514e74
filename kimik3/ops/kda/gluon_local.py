"""Phases A, B and C of the Triton KDA forward in one warp-specialised Gluon kernel for Hopper.

The split forward runs three kernels per chunk of 64 tokens and head after the prologue: phase A
(``triton_forward._intra_a_kernel``: Aqk and A = diag(beta) Akk), the solve (``_intra_solve_kernel``: T = (I + A)^-1)
and phase C (``gluon_wy``: W = T (beta k e^Gamma), U = T (beta v), qg = q e^Gamma, kg = k e^(Gamma_C - Gamma),
e^Gamma_C). Between them A and T go through global memory, and Gamma, q, k are read by two kernels. Here one work
item is a whole (chunk, head): a 1-warp loader partition brings its q, k, v, Gamma tiles and five of Gamma's rows (each
column tile's reference, the chunk's last token) by TMA into shared memory, and the 4-warp consumer partition computes
everything from there, with two CTAs per SM (``CTAS_PER_SM``) so that one CTA's loads run under the other's work:

- **Aqk and A.** Column tile j (tokens [16 j, 16 j + 16)) is referenced, as in the Triton kernel, at its last valid
  token, g_j: its right operand is k_s e^(g_j - Gamma_s) (factors in [e^-75, 1] by the gate bound), the rows q_t
  e^(Gamma_t - g_j) and k_t e^(Gamma_t - g_j) (in (0, e^75]; the rows before the tile, its past, zero in the exponent).
  Each tile is a [64, 128] x [128, 16] product on ``warpgroup_mma`` with bf16 operands, for q and for k.
- **T.** By recursive doubling on [64, 64] tf32 products: with T_s the inverse of (I + A)'s diagonal blocks of size s,
  T_2s = T_s - T_s (L_s T_s), L_s being A's blocks below those diagonal blocks within the blocks of size 2 s (exact
  block inversion, no cancellation); T_2 is formed directly, then s = 2 .. 32, two products each.
- **W, U and the scan operands.** After phase A, one pass over each 64-column half stores qg, kg and e^Gamma_C and
  writes beta k e^Gamma and beta v over k and v in shared memory, the right operands of W = T (.) and U = T (.), T in
  bf16 (as the Triton path rounds it).

Outputs are those of the split kernels (Aqk, W, U, qg, kg, e^Gamma_C; T into ``tinv`` when ``store_t``, as the
backward reads it). It runs where ``supported`` says (sm_90, K = V = 128, bf16 q / k / v, fp32 Gamma, 16-bit A and WY
products, W in bf16), as ``triton_forward.GLUON_LOCAL`` selects. CI runs it through ``tests/gluon_emulator.py`` and
compiles it for sm_90.

H200, K3's shape (B1 T8192 H96 D128), ``benchmarks/gluon_local_probe.py``, same run: 1.551 ms against the split
kernels' 1.358, so it is off by default (the forward 2.517 against 2.311 ms). Its first form, every loop unrolled (about
10 K PTX lines), took 2.31 ms, and 3.60 with T's doubling on bf16 high and low parts; ablating any one phase brought it
to about 1.1 ms, and rolling the loops over the key halves and the doubling steps (6.4 K lines) to 1.55 (1.73 on bf16
parts, which was removed): code that two CTAs per SM run at different points did not fit the instruction cache. What is
left is each item's serial chain in one warpgroup, about 33 us per item per CTA at two CTAs (eight consumer warps) per
SM; ablated, phase A's products take 0.60 ms of the 1.55, the solve 0.47, the scan operands' pass 0.34
(benchmarks/NOTES-kda.md, twenty-fifth session).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_wy import (_item, _my_items, _wait_slot, launch_options, on_hopper, release_ring, ring_barriers,
                       run_persistent, tile_descriptor)

RING = 1  # ring slots per CTA (each one item's q, k, v, Gamma: 80 KB)
CONSUMER_WARPS = 4  # one warpgroup: each warp's rows of a [64, N] product are one 16-token block
MAXNREG: Optional[int] = 128  # registers per thread at launch (ptxas .maxnreg): two CTAs of 8 warps (the loader's
# padded to a warpgroup) per SM; the consumer raises its own
CTAS_PER_SM = 2  # the persistent grid's CTAs per SM
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
# Timing ablation (benchmarks only; results are WRONG when non-zero): 1 skips the solve (T taken as A), 2 phase A's
# products, 3 the scan operands' pass (qg, kg, e^Gamma_C, W's and U's right operands)
ABLATE = 0
NEG_INF = gl.constexpr(float("-inf"))


@gluon.jit
def _loader(ready, empty, q_s, k_s, v_s, G_s, rows_s, q_d, k_d, v_d, G_d, row_d, cidx_ptr, cu_ptr, n_items, H):
    """Each item's q, k, v, Gamma tiles (both 64-column halves) and five of Gamma's rows (at the column tiles' last
    valid tokens, the last of them the chunk's) by TMA, once the consumer has freed the slot."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        slot = _wait_slot(empty, i, 1)
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * (3 * 64 * 64 * 2 + 64 * 64 * 4 + 5 * 64 * 4))
        for kb in gl.static_range(2):
            col = i_h * 128 + kb * 64
            s = 2 * slot + kb
            tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(s))
            tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(s))
            tma.async_copy_global_to_shared(v_d, [t0, col], bar, v_s.index(s))
            tma.async_copy_global_to_shared(G_d, [t0, col], bar, G_s.index(s))
            for j in gl.static_range(4):  # the column tiles' references: Gamma at each one's last valid token
                ref = gl.minimum(16 * j + 15, L - 1)
                tma.async_copy_global_to_shared(row_d, [t0 + ref, col], bar, rows_s.index(5 * s + j))
            tma.async_copy_global_to_shared(row_d, [t0 + L - 1, col], bar, rows_s.index(5 * s + 4))


@gluon.jit
def _tile(q_s, k_s, G_s, rows_s, b_s, si, j: gl.constexpr, ra, r16, L, A16: gl.constexpr, MMA16: gl.constexpr,
          BL16: gl.constexpr):
    """Column tile j of Aqk and Akk (fp32 [64, 16] accumulators, MMA16): for each 64-column key block, the rows
    q e^(Gamma - g_j), k e^(Gamma - g_j) (rows before the tile, its past, and past the chunk are zero in the exponent)
    against the tile's column operand k_s e^(g_j - Gamma_s) in b_s, both on bf16 operands."""
    acc_q = gl.zeros([64, 16], gl.float32, layout=MMA16)
    acc_k = gl.zeros([64, 16], gl.float32, layout=MMA16)
    rows = gl.expand_dims((ra >= j * 16) & (ra < L), 1)
    cols = gl.expand_dims(j * 16 + r16 < L, 1)
    for kb in range(2):  # (loops not unrolled where they need not be: the kernel's code must fit the instruction cache)
        s = 2 * si + kb
        Gs = G_s.index(s)
        ref = rows_s.index(5 * s + j)  # g_j
        e_s = gl.exp(gl.where(cols, ref.load(BL16) - Gs.slice(j * 16, 16).load(BL16), NEG_INF))  # [e^-75, 1]
        b_s.index(kb).store((k_s.index(s).slice(j * 16, 16).load(BL16).to(gl.float32) * e_s).to(gl.bfloat16))
        fence_async_shared()
        e_r = gl.exp(gl.where(rows, Gs.load(A16) - ref.load(A16), NEG_INF))  # (0, e^75]
        col = b_s.index(kb).permute((1, 0))
        acc_q = warpgroup_mma((q_s.index(s).load(A16).to(gl.float32) * e_r).to(gl.bfloat16), col, acc_q,
                              is_async=True)
        acc_k = warpgroup_mma((k_s.index(s).load(A16).to(gl.float32) * e_r).to(gl.bfloat16), col, acc_k,
                              is_async=True)
        acc_q, acc_k = warpgroup_mma_wait(0, deps=[acc_q, acc_k])
    return acc_q, acc_k


@gluon.jit
def _store_tile(aqk_ptr, a_s, a_base, acc_q, acc_k, beta, r, c, j: gl.constexpr):
    """Column tile j of Aqk (lower, the diagonal included) to memory and of A = diag(beta) Akk (strictly lower) to
    the solve's shared matrix."""
    col = gl.expand_dims(j * 16 + c, 0)
    rows = gl.expand_dims(r, 1)
    gl.store(aqk_ptr + a_base + rows * 64 + col, gl.where(rows >= col, acc_q, 0.0))
    a_s.slice(j * 16, 16, dim=1).store(gl.where(rows > col, acc_k * gl.expand_dims(beta, 1), 0.0))


@gluon.jit
def _below_blocks(r, c, lvl):
    """[64, 64] mask of L_s, s = 2^lvl: the s x s blocks just below the diagonal ones within each 2s x 2s diagonal
    block."""
    rr = gl.expand_dims(r, 1)
    cc = gl.expand_dims(c, 0)
    return ((rr >> (lvl + 1)) == (cc >> (lvl + 1))) & (((rr >> lvl) & 1) == 1) & (((cc >> lvl) & 1) == 0)


@gluon.jit
def _double(t, a_op, t_s, ro, co, lvl, MMAT: gl.constexpr, AT: gl.constexpr):
    """One doubling step: T_2s = T_s - T_s (L_s T_s) (``_solve``), the right operands through t_s transposed."""
    t_s.store(gl.permute(t, (1, 0)))
    fence_async_shared()
    zero = gl.zeros([64, 64], gl.float32, layout=MMAT)
    p = warpgroup_mma(gl.where(_below_blocks(ro, co, lvl), a_op, 0.0), t_s.permute((1, 0)), zero, use_acc=False)
    t_op = t_s.permute((1, 0)).load(AT)
    gl.thread_barrier()  # t_s read by every warp before it takes -P
    t_s.store(gl.permute(-p, (1, 0)))
    fence_async_shared()
    t = warpgroup_mma(t_op, t_s.permute((1, 0)), t)
    gl.thread_barrier()  # the product has read t_s before the next step overwrites it
    return t


@gluon.jit
def _solve(a_s, t_s, MMAT: gl.constexpr, AT: gl.constexpr):
    """T = (I + A)^-1 of the strictly lower A in a_s by recursive doubling (module docstring), on tf32 products
    through t_s (their right operands, stored transposed: tf32 operands are K-major). Returns T (fp32, MMAT)."""
    rt = gl.arange(0, 64, layout=gl.SliceLayout(1, MMAT))
    ct = gl.arange(0, 64, layout=gl.SliceLayout(0, MMAT))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, AT))
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, AT))
    gl.thread_barrier()  # every warp's tiles of A are in a_s
    a_op = a_s.load(AT)
    t = gl.where(gl.expand_dims(rt, 1) == gl.expand_dims(ct, 0), 1.0, 0.0)
    t = t - gl.where(_below_blocks(rt, ct, 0), a_s.load(MMAT), 0.0)  # T_2
    for lvl in range(1, 6):
        t = _double(t, a_op, t_s, ro, co, lvl, MMAT, AT)
    return t


@gluon.jit
def _consumer(ready, empty, q_s, k_s, v_s, G_s, rows_s, b_s, a_s, beta_ptr, aqk_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr,
              kg_ptr, eg_ptr, cidx_ptr, cu_ptr, n_items, H, STORE_T: gl.constexpr, ABLATE: gl.constexpr):
    """The default partition: each item's phases A, B, C once its slot is ready; the slot handed back after the
    WY products (its Gamma tile doubles as the solve's operand buffer)."""
    MMA16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    A16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA16, k_width=2)  # phase A's rows
    MMA64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    A64: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA64, k_width=2)  # T in bf16
    MMAT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 8])
    AT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMAT, k_width=1)  # the solve's tf32 operands
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # [64, 64] elementwise, [16, 64] operands
    ra = gl.arange(0, 64, layout=gl.SliceLayout(1, A16))
    rm = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA16))
    cm = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA16))
    rw = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA64))
    cw = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA64))
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, BL))
    HK = H * 128
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        t0 = t0.to(gl.int64)
        # the item's per-token scalars, loaded before its tiles are waited for
        b_first = beta_ptr + t0 * H + i_h
        beta = gl.expand_dims(gl.load(b_first + r * H, mask=r < L, other=0.0).to(gl.float32), 1)
        beta_m = gl.load(b_first + rm * H, mask=rm < L, other=0.0).to(gl.float32)
        a_base = (i_t * H + i_h).to(gl.int64) * 4096
        si = _wait_slot(ready, i, 0)
        # phase A: Aqk to memory, A to the solve's shared matrix
        for j in gl.static_range(4):
            if ABLATE == 2:
                acc_q = gl.zeros([64, 16], gl.float32, layout=MMA16)
                acc_k = gl.zeros([64, 16], gl.float32, layout=MMA16)
            else:
                acc_q, acc_k = _tile(q_s, k_s, G_s, rows_s, b_s, si, j, ra, r16, L, A16, MMA16, BL)
            _store_tile(aqk_ptr, a_s, a_base, acc_q, acc_k, beta_m, rm, cm, j)
        # the scan's operands, e^Gamma_C, and the WY products' right operands written over k and v
        rows = gl.expand_dims(r < L, 1)
        first = t0 * HK + i_h * 128  # the item's first element in the token layout (offsets within it: 32-bit)
        tok = gl.expand_dims(r * HK, 1) + gl.expand_dims(c, 0)
        gl.thread_barrier()  # every warp has read k for phase A before W's operand replaces it
        for kb in range(2 if ABLATE != 3 else 0):
            s = 2 * si + kb
            G = G_s.index(s).load(BL)
            eG = gl.exp(G)
            last = rows_s.index(5 * s + 4).load(BL)  # Gamma_C
            k = k_s.index(s).load(BL).to(gl.float32)
            qg = q_s.index(s).load(BL).to(gl.float32) * eG
            gl.store(qg_ptr + first + tok + kb * 64, qg.to(gl.bfloat16), mask=rows)
            gl.store(kg_ptr + first + tok + kb * 64, (k * gl.exp(last - G)).to(gl.bfloat16), mask=rows)
            gl.store(eg_ptr + (i_t * H + i_h).to(gl.int64) * 128 + kb * 64 + c, gl.exp(gl.sum(last, axis=0)))
            k_s.index(s).store(gl.where(rows, k * beta * eG, 0.0).to(gl.bfloat16))
            v_s.index(s).store(gl.where(rows, v_s.index(s).load(BL).to(gl.float32) * beta, 0.0).to(gl.bfloat16))
        if ABLATE == 1:
            gl.thread_barrier()
            t = a_s.load(MMA64)
        else:  # T = (I + A)^-1, through Gamma's first tile (read for the last time above)
            t = gl.convert_layout(_solve(a_s, G_s.index(2 * si), MMAT, AT), MMA64)
        if STORE_T:
            gl.store(tinv_ptr + a_base + gl.expand_dims(rw, 1) * 64 + gl.expand_dims(cw, 0), t)
        t16 = gl.convert_layout(t.to(gl.bfloat16), A64)
        fence_async_shared()
        rows_w = gl.expand_dims(rw < L, 1)
        tok_w = gl.expand_dims(rw * HK, 1) + gl.expand_dims(cw, 0)
        zero = gl.zeros([64, 64], gl.float32, layout=MMA64)
        w0 = warpgroup_mma(t16, k_s.index(2 * si), zero, use_acc=False, is_async=True)
        w1 = warpgroup_mma(t16, k_s.index(2 * si + 1), zero, use_acc=False, is_async=True)
        w0, w1 = warpgroup_mma_wait(0, deps=[w0, w1])
        gl.store(w_ptr + first + tok_w, w0.to(gl.bfloat16), mask=rows_w)
        gl.store(w_ptr + first + tok_w + 64, w1.to(gl.bfloat16), mask=rows_w)
        u0 = warpgroup_mma(t16, v_s.index(2 * si), zero, use_acc=False, is_async=True)
        u1 = warpgroup_mma(t16, v_s.index(2 * si + 1), zero, use_acc=False, is_async=True)
        u0, u1 = warpgroup_mma_wait(0, deps=[u0, u1])
        fence_async_shared()
        mbarrier.arrive(empty.index(si), count=1)  # the next item's tiles load while U is stored
        gl.store(u_ptr + first + tok_w, u0, mask=rows_w)
        gl.store(u_ptr + first + tok_w + 64, u1, mask=rows_w)


@gluon.jit
def _gluon_local_kernel(q_d, k_d, v_d, G_d, row_d, beta_ptr, aqk_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kg_ptr, eg_ptr,
                        cidx_ptr, cu_ptr, NT, H, STORE_T: gl.constexpr, ABLATE: gl.constexpr, RING: gl.constexpr,
                        num_warps: gl.constexpr):
    """Phases A, B, C over NT chunks x H heads (q_d, k_d, v_d, G_d: TMA descriptors of [64, 64] tiles of q, k, v and
    Gamma as [tokens, H 128]; row_d of Gamma's [1, 64] rows)."""
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], q_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], k_d.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], v_d.layout)
    G_s = gl.allocate_shared_memory(gl.float32, [2 * RING, 64, 64], G_d.layout)
    rows_s = gl.allocate_shared_memory(gl.float32, [10 * RING, 1, 64], row_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [2, 16, 64], gl.NVMMASharedLayout.get_default_for([16, 64],
                                                                                                    gl.bfloat16))
    a_s = gl.allocate_shared_memory(gl.float32, [64, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    ready, empty = ring_barriers(RING, 1)
    n_items = NT * H
    gl.warp_specialize([
        (_consumer, (ready, empty, q_s, k_s, v_s, G_s, rows_s, b_s, a_s, beta_ptr, aqk_ptr, tinv_ptr, w_ptr, u_ptr,
                     qg_ptr, kg_ptr, eg_ptr, cidx_ptr, cu_ptr, n_items, H, STORE_T, ABLATE)),
        (_loader, (ready, empty, q_s, k_s, v_s, G_s, rows_s, q_d, k_d, v_d, G_d, row_d, cidx_ptr, cu_ptr, n_items,
                   H)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
              qg: torch.Tensor, kg: torch.Tensor, DTA, DTC) -> Optional[str]:
    """None if this kernel computes phases A, B, C for these tensors, else why not (the split kernels run instead)."""
    import triton.language as tl

    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V != 128:
        return f"K = V = 128 (got K={K}, V={V})"
    if any(x.dtype != torch.bfloat16 for x in (q, k, v)) or DTA != tl.bfloat16 or DTC != tl.bfloat16:
        return "bf16 inputs with 16-bit A and WY products"
    if (w.dtype, qg.dtype, kg.dtype, u.dtype, G.dtype) != (torch.bfloat16,) * 3 + (torch.float32,) * 2:
        return "W, qg, kg in bf16 and U, Gamma in fp32"
    return on_hopper(q)


def launch(q, k, v, G, beta, aqk, tinv, w, u, qg, kg, eg, plan, H: int, store_t: bool,
           launcher: Optional[Callable] = None, programs: Optional[int] = None) -> None:
    """The kernel on ``triton_forward``'s tensors (token layout [B, T, H, 128]; Aqk and T as [NT, H, 64, 64] fp32;
    T written only when store_t); launcher, programs: ``gluon_wy.run_persistent``."""
    tok = (q.numel() // (H * 128), H * 128)
    args = (*(tile_descriptor(x, gl.bfloat16, tok) for x in (q, k, v)), tile_descriptor(G, gl.float32, tok),
            tile_descriptor(G, gl.float32, tok, block=(1, 64), swizzled=False), beta, aqk, tinv, w, u, qg, kg, eg,
            plan.chunk_idx, plan.cu, plan.NT, H)
    run_persistent(_gluon_local_kernel, plan.NT * H, q.device, args, launcher, programs, CTAS_PER_SM,
                   STORE_T=bool(store_t), ABLATE=ABLATE, RING=RING, num_warps=CONSUMER_WARPS,
                   **launch_options(MAXNREG))
