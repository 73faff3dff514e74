"""Phase C of a forward alone under K3's contract, with the prologue folded in: a warp-specialised Gluon kernel.

Where ``gluon_wy.py`` reads the prologue's Gamma (fp32) and normalised q, k, this kernel takes the layer's raw z, q,
k and beta logits and computes, per chunk of 64 tokens and head (one work item, both 64-column halves of K = V =
128):

- the gate g = g_min sigmoid(exp(A_log) (z + dt_bias)) and its cumulative sum Gamma down each column;
- the rows' L2 scales of q and k (1 / sqrt(sum x^2 + eps), over both halves) and sigmoid(beta);
- W = T (beta k exp(Gamma)), U = T (beta v) with the chunk's T = (I + A)^-1 (``triton_local._local_a_kernel``), and
  the scan's operands qg = q exp(Gamma), kg = k exp(Gamma_C - Gamma), exp(Gamma_C), all as ``gluon_wy`` stores them.

A 1-warp loader streams each item's T (fp32) and its q, k, v, z tiles (bf16, two [64, 64] boxes each) by TMA into a
2-slot ring; the 8-warp consumer does the rest (``gluon_wy``'s products and layouts). Nothing of the prologue is
written, which is what the backward would need: ``triton_forward.LOCAL_FWD`` runs this path for forwards alone.
CI runs it through ``tests/gluon_emulator.py`` and compiles it for sm_90.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .gluon_wy import (_blocked, _item, _mma, _my_items, _wait_slot, launch_options, on_hopper, release_ring,
                       ring_barriers, run_persistent, tile_descriptor)

RING = 2  # ring slots (each one item's T, q, k, v, z: 80 KB)
CONSUMER_WARPS = 8
MAXNREG: Optional[int] = None
CTAS_PER_SM = 1
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _loader(ready, empty, t_s, q_s, k_s, v_s, z_s, t_d, q_d, k_d, v_d, z_d, cidx_ptr, cu_ptr, n_items, H):
    """Each item's T and its q, k, v, z tiles (both 64-column halves) by TMA, once the consumer has freed the slot."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        slot = _wait_slot(empty, i, 1)
        i_t, i_h, p, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 64 * 64 * 4 + 8 * 64 * 64 * 2)
        tma.async_copy_global_to_shared(t_d, [(i_t * H + i_h) * 64, 0], bar, t_s.index(slot))
        for b in gl.static_range(2):
            col = i_h * 128 + b * 64
            tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(v_d, [t0, col], bar, v_s.index(2 * slot + b))
            tma.async_copy_global_to_shared(z_d, [t0, col], bar, z_s.index(2 * slot + b))


@gluon.jit
def _gamma(z_s, rate, dtb_ptr, i_h, c, rows, g_min, b: gl.constexpr, BL: gl.constexpr):
    """Column half b's cumulative log-decay Gamma (fp32 [64, 64]), from its z tile: rows past the chunk add nothing."""
    dtb = gl.expand_dims(gl.load(dtb_ptr + i_h * 128 + b * 64 + c).to(gl.float32), 0)
    x = rate * (z_s.load(BL).to(gl.float32) + dtb)
    g = g_min / (1.0 + gl.exp(-x))  # g_min sigmoid(x)
    return gl.associative_scan(gl.where(rows, g, 0.0), 0, _add)


@gluon.jit
def _row_scale(x_s, slot, BL: gl.constexpr, EPS: gl.constexpr):
    """1 / sqrt(sum x^2 + EPS) of the chunk's rows of x (both halves in the ring slot), as a [64, 1] column."""
    x0 = x_s.index(2 * slot).load(BL).to(gl.float32)
    x1 = x_s.index(2 * slot + 1).load(BL).to(gl.float32)
    return gl.expand_dims(gl.rsqrt(gl.sum(x0 * x0, axis=1) + gl.sum(x1 * x1, axis=1) + EPS), 1)


@gluon.jit
def _consumer(ready, empty, t_s, q_s, k_s, v_s, z_s, b_s, beta_ptr, alog_ptr, dtb_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr,
              u_ptr, cidx_ptr, cu_ptr, n_items, H, g_min, EPS: gl.constexpr, NW: gl.constexpr):
    """The default partition: each item once its slot is ready, the slot handed back once its tiles are read."""
    BL: gl.constexpr = _blocked(NW)
    MMA: gl.constexpr = _mma(NW)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        si = _wait_slot(ready, i, 0)
        i_t, i_h, p, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        rows = gl.expand_dims(r < L, 1)  # the chunk's valid rows (the tiles may run past its sequence)
        tok = gl.expand_dims(t0.to(gl.int64) + r, 1) * (H * 128) + i_h * 128 + gl.expand_dims(c, 0)
        beta = gl.load(beta_ptr + (t0.to(gl.int64) + r) * H + i_h, mask=r < L, other=0.0).to(gl.float32)
        beta = gl.expand_dims(1.0 / (1.0 + gl.exp(-beta)), 1)
        rate = gl.exp(gl.load(alog_ptr + i_h).to(gl.float32))
        rq = _row_scale(q_s, si, BL, EPS)
        rk = _row_scale(k_s, si, BL, EPS)
        tm = gl.convert_layout(t_s.index(si).load(BL).to(gl.bfloat16), AOP)
        acc = gl.zeros([64, 64], gl.float32, layout=MMA)
        for b in gl.static_range(2):
            offs = tok + b * 64
            G = _gamma(z_s.index(2 * si + b), rate, dtb_ptr, i_h, c, rows, g_min, b, BL)
            # U = T (beta v)
            b_s.store(gl.where(rows, v_s.index(2 * si + b).load(BL).to(gl.float32) * beta, 0.0).to(gl.bfloat16))
            fence_async_shared()
            u = warpgroup_mma(tm, b_s, acc, use_acc=False)
            gl.store(u_ptr + offs, gl.convert_layout(u, BL), mask=rows)
            # W = T (beta k exp(Gamma))
            eG = gl.exp(G)
            kn = k_s.index(2 * si + b).load(BL).to(gl.float32) * rk
            b_s.store(gl.where(rows, kn * beta * eG, 0.0).to(gl.bfloat16))
            fence_async_shared()
            w = warpgroup_mma(tm, b_s, acc, use_acc=False)
            gl.store(w_ptr + offs, gl.convert_layout(w.to(gl.bfloat16), BL), mask=rows)
            # the scan operands and the chunk decay
            g_last = gl.sum(gl.where(gl.expand_dims(r == L - 1, 1), G, 0.0), axis=0)
            gl.store(kg_ptr + offs, (kn * gl.exp(gl.expand_dims(g_last, 0) - G)).to(gl.bfloat16), mask=rows)
            qn = q_s.index(2 * si + b).load(BL).to(gl.float32) * rq
            gl.store(qg_ptr + offs, (qn * eG).to(gl.bfloat16), mask=rows)
            gl.store(eg_ptr + (i_t * H + i_h) * 128 + b * 64 + c, gl.exp(g_last))
        fence_async_shared()  # the slot's reads, before the loader's next TMA write into it
        mbarrier.arrive(empty.index(si), count=1)


@gluon.jit
def _gluon_local_wy_kernel(t_d, q_d, k_d, v_d, z_d, beta_ptr, alog_ptr, dtb_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
                           cidx_ptr, cu_ptr, NT, H, g_min, EPS: gl.constexpr, RING: gl.constexpr,
                           num_warps: gl.constexpr):
    """Phase C with the prologue over NT chunks x H heads (the _d arguments: TMA descriptors of [64, 64] tiles, T as
    [NT H 64, 64] fp32 and q, k, v, z as [tokens, H 128] bf16)."""
    t_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], t_d.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], q_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], k_d.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], v_d.layout)
    z_s = gl.allocate_shared_memory(gl.bfloat16, [2 * RING, 64, 64], z_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], k_d.layout)  # the products' right-hand operand
    ready, empty = ring_barriers(RING, 1)
    n_items = NT * H
    gl.warp_specialize([
        (_consumer, (ready, empty, t_s, q_s, k_s, v_s, z_s, b_s, beta_ptr, alog_ptr, dtb_ptr, eg_ptr, w_ptr, qg_ptr,
                     kg_ptr, u_ptr, cidx_ptr, cu_ptr, n_items, H, g_min, EPS, num_warps)),
        (_loader, (ready, empty, t_s, q_s, k_s, v_s, z_s, t_d, q_d, k_d, v_d, z_d, cidx_ptr, cu_ptr, n_items, H)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor) -> Optional[str]:
    """None if this kernel computes phase C with the prologue for these raw inputs, else why not."""
    K, V = q.shape[-1], v.shape[-1]
    if K != 128 or V != 128:
        return f"K = V = 128 (got K={K}, V={V})"
    if any(x.dtype != torch.bfloat16 for x in (q, k, v, z)):
        return "bf16 q, k, v and gate input z"
    return on_hopper(q)


def launch(q, k, v, z, beta, A_log, dt_bias, tinv, w, u, qg, kg, eg, plan, H: int, g_min: float, eps: float,
           launcher: Optional[Callable] = None, programs: Optional[int] = None) -> None:
    """The kernel on ``triton_forward``'s tensors: raw q, k, v, z [B, T, H, 128] bf16 and beta logits [B, T, H]; A_log
    [H], dt_bias [H 128]; T as [NT, H, 64, 64] fp32; out W, qg, kg bf16 and U fp32 in token layout, exp(Gamma_C) [NT,
    H, 128]. launcher, programs: ``gluon_wy.run_persistent``."""
    tok = (q.numel() // (H * 128), H * 128)
    args = (tile_descriptor(tinv, gl.float32, (plan.NT * H * 64, 64)),
            *(tile_descriptor(x, gl.bfloat16, tok) for x in (q, k, v, z)), beta, A_log, dt_bias, eg, w, qg, kg, u,
            plan.chunk_idx, plan.cu, plan.NT, H, float(g_min))
    run_persistent(_gluon_local_wy_kernel, plan.NT * H, q.device, args, launcher, programs, CTAS_PER_SM, EPS=eps,
                   RING=RING, num_warps=CONSUMER_WARPS, **launch_options(MAXNREG))
