"""Stage 4 of the KDA forward (the Triton ``ops/kda/wy.py``'s ``_intra_wy_kernel``) as a warp-specialised Gluon
kernel for Hopper.

Per chunk of 64 tokens and head, with T = (I + A)^-1 the chunk's solved WY matrix: W = T (beta k exp(Gamma)),
U = T (beta v), qg = q exp(Gamma), kg = k exp(Gamma_C - Gamma) and exp(Gamma_C), as the Triton kernel:

- one work item is (chunk, head, 64-column block p): W, qg, kg on key columns [64 p, 64 p + 64) and U on the
  same value columns (K == V);
- a persistent grid of one CTA per SM walks the items; a 1-warp loader partition streams each item's tiles
  (T, k, q, Gamma, v) by TMA into a ``RING``-slot ring while the 8-warp consumer partition multiplies on
  ``warpgroup_mma`` (bf16 operands, fp32 accumulation) and stores from registers, masked to the chunk's valid rows
  (varlen: a chunk's tiles may run into the next sequence, whose rows are zeroed before they enter a product; past
  the end of the tensor TMA reads zeros).

``dispatch.py`` says where it runs (sm_90, bf16, K == V a multiple of 64, enough items).
"""

from __future__ import annotations

from typing import Callable, Optional

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .runtime import _item, _my_items, _wait_slot, release_ring, ring_barriers, run_persistent, tile_descriptor

RING = 2  # ring slots: the next item's tiles load while the consumer works on this one's
CONSUMER_WARPS = 8  # the default partition's warps (two warpgroups: the [64, 64] products split over N)
CTAS_PER_SM = 1  # the persistent grid's CTAs per SM (a CTA's ring and operand buffers take 136 KB)
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)  # the TMA loader partition, at few registers


@gluon.constexpr_function
def _blocked(num_warps):
    """The elementwise layout of a [64, 64] tile over num_warps warps."""
    return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma(num_warps):
    """The wgmma accumulator layout of a [64, 64] product: warpgroups across N."""
    wn = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, wn], instr_shape=[16, 64 // wn, 16])


@gluon.jit
def _loader(ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, cidx_ptr, cu_ptr, n_items, H,
            K: gl.constexpr, NP: gl.constexpr):
    """The loader partition: each item's T, k, q, Gamma and v tiles by TMA, once the consumer has freed the slot."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        slot = _wait_slot(empty, i, 1)
        i_t, i_h, p, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, NP)
        col = i_h * K + p * 64
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * 64 * 64 * 4 + 3 * 64 * 64 * 2)
        tma.async_copy_global_to_shared(t_d, [(i_t * H + i_h) * 64, 0], bar, t_s.index(slot))
        tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(slot))
        tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(slot))
        tma.async_copy_global_to_shared(G_d, [t0, col], bar, G_s.index(slot))
        tma.async_copy_global_to_shared(v_d, [t0, col], bar, v_s.index(slot))


@gluon.jit
def _consumer(ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
              cidx_ptr, cu_ptr, n_items, H, K: gl.constexpr, NP: gl.constexpr, NW: gl.constexpr):
    """The default partition: each item once its slot is ready, the slot handed back once its tiles are read."""
    BL: gl.constexpr = _blocked(NW)
    MMA: gl.constexpr = _mma(NW)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        si = _wait_slot(ready, i, 0)
        i_t, i_h, p, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, NP)
        rows = gl.expand_dims(r < L, 1)  # the chunk's valid rows (the tiles may run past its sequence)
        col = i_h * K + p * 64
        offs = gl.expand_dims(t0.to(gl.int64) + r, 1) * (H * K) + col + gl.expand_dims(c, 0)
        beta = gl.load(beta_ptr + (t0.to(gl.int64) + r) * H + i_h, mask=r < L, other=0.0).to(gl.float32)
        beta = gl.expand_dims(beta, 1)
        t32 = t_s.index(si).load(BL)
        tm = gl.convert_layout(t32.to(gl.bfloat16), AOP)
        acc = gl.zeros([64, 64], gl.float32, layout=MMA)
        # U = T (beta v)
        b_s.store(gl.where(rows, v_s.index(si).load(BL).to(gl.float32) * beta, 0.0).to(gl.bfloat16))
        fence_async_shared()
        u = warpgroup_mma(tm, b_s, acc, use_acc=False)
        gl.store(u_ptr + offs, gl.convert_layout(u, BL), mask=rows)
        # W = T (beta k exp(Gamma))
        G = G_s.index(si).load(BL)
        eG = gl.exp(G)
        kr = k_s.index(si).load(BL).to(gl.float32)
        b_s.store(gl.where(rows, kr * beta * eG, 0.0).to(gl.bfloat16))
        fence_async_shared()
        w = warpgroup_mma(tm, b_s, acc, use_acc=False)
        gl.store(w_ptr + offs, gl.convert_layout(w.to(gl.bfloat16), BL), mask=rows)
        # the scan operands and the chunk decay
        g_last = gl.expand_dims(gl.load(G_ptr + (t0.to(gl.int64) + L - 1) * (H * K) + col + c), 0)
        gl.store(kg_ptr + offs, (kr * gl.exp(g_last - G)).to(gl.bfloat16), mask=rows)
        gl.store(qg_ptr + offs, (q_s.index(si).load(BL).to(gl.float32) * eG).to(gl.bfloat16), mask=rows)
        gl.store(eg_ptr + (i_t * H + i_h) * K + p * 64 + c, gl.exp(gl.sum(g_last, 0)))
        fence_async_shared()  # the slot's reads, before the loader's next TMA write into it
        mbarrier.arrive(empty.index(si), count=1)


@gluon.jit
def _gluon_wy_kernel(t_d, k_d, q_d, G_d, v_d, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr, cidx_ptr, cu_ptr,
                     NT, H, K: gl.constexpr, RING: gl.constexpr, num_warps: gl.constexpr):
    """Stage 4 over NT chunks x H heads x K / 64 column blocks (the _d arguments are TMA descriptors of [64, 64]
    tiles: T as [NT H 64, 64] fp32, k, q, v as [tokens, H K] bf16, Gamma as [tokens, H K] fp32)."""
    NP: gl.constexpr = K // 64
    t_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], t_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, 64], k_d.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, 64], q_d.layout)
    G_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], G_d.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, 64], v_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], k_d.layout)  # the products' right-hand operand
    ready, empty = ring_barriers(RING, 1)
    n_items = NT * H * NP
    gl.warp_specialize([
        (_consumer, (ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr,
                     u_ptr, cidx_ptr, cu_ptr, n_items, H, K, NP, num_warps)),
        (_loader, (ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, cidx_ptr, cu_ptr, n_items, H,
                   K, NP)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def launch(q, k, v, G, beta, tinv, w, u, qg, kg, eg, plan, H: int, K: int,
           launcher: Optional[Callable] = None, programs: Optional[int] = None) -> None:
    """Stage 4 by ``_gluon_wy_kernel`` on the forward's tensors (token layout [B, T, H, D], T as [NT, H, 64, 64]
    fp32; U fp32); launcher, programs: ``runtime.run_persistent``."""
    tok = (q.numel() // (H * K), H * K)
    args = (tile_descriptor(tinv, gl.float32, (plan.NT * H * 64, 64)), tile_descriptor(k, gl.bfloat16, tok),
            tile_descriptor(q, gl.bfloat16, tok), tile_descriptor(G, gl.float32, tok),
            tile_descriptor(v, gl.bfloat16, tok), beta, G, eg, w, qg, kg, u, plan.chunk_idx, plan.cu, plan.NT, H)
    run_persistent(_gluon_wy_kernel, plan.NT * H * (K // 64), q.device, args, launcher, programs, CTAS_PER_SM, K=K,
                   RING=RING, num_warps=CONSUMER_WARPS)
