"""Phase A of the Triton KDA forward (the intra-chunk matrices Aqk and diag(beta) Akk) as a warp-specialised Gluon
kernel for Hopper.

``triton_forward._intra_a_kernel`` computes, per chunk of 64 tokens and head, one 64 x 16 column tile j of
Aqk = (q e^(Gamma - eps_j)) (k e^(eps_j - Gamma))^T (lower, the diagonal included) and of diag(beta) Akk (strictly
lower) per program, against the reference eps_j = Gamma at the tile's last valid token (the gate bound keeps both
factors finite). Its four programs per chunk each read the chunk's q, k and Gamma. Here one work item is a whole
(chunk, head): a 1-warp loader partition streams its q, k, Gamma tiles (every 64-column K block) by TMA into a
ring (``RING`` slots) while a 4-warp consumer builds the four column tiles from shared memory on ``warpgroup_mma``
(bf16 operands, fp32 accumulation; the column operand (k e^(eps_j - Gamma))^T goes through shared memory), two
CTAs per SM (``CTAS_PER_SM``, ``MAXNREG``). Varlen: rows at or past the chunk's valid length contribute zeros.
Slower than the Triton kernel on the H200 (0.674 against 0.58 ms at K3's shape), so off by default.

Where it runs: ``supported`` (sm_90, bf16 q / k, K a multiple of 64, 16-bit A products), as ``triton_forward.GLUON_A``
selects. CI runs it through ``tests/gluon_emulator.py`` and compiles it for sm_90.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from .gluon_wy import (_item, _my_items, _wait_slot, launch_options, on_hopper, release_ring, ring_barriers,
                       run_persistent, tile_descriptor)

CONSUMER_WARPS = 4
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)
# Two CTAs per SM, each with a 1-slot ring (76 KB) and launched at 128 registers per thread (the consumer raises
# itself to 232): H200, K3's shape, same run, 0.674 ms against 0.878 at one CTA per SM with a 2-slot ring -- and
# 0.584 for the Triton kernel, which stays the default.
RING = 1  # ring slots (each holds one item's q, k, Gamma)
MAXNREG: Optional[int] = 128  # registers per thread at launch (ptxas .maxnreg; None: the compiler's choice)
CTAS_PER_SM = 2  # the persistent grid's CTAs per SM


@gluon.jit
def _loader(ready, empty, q_s, k_s, G_s, q_d, k_d, G_d, cidx_ptr, cu_ptr, n_items, H, K: gl.constexpr,
            NKB: gl.constexpr):
    """The loader partition: each item's q, k, Gamma tiles (all K blocks) by TMA, once the slot is free."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        slot = _wait_slot(empty, i, 1)
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, NKB * 64 * 64 * (2 + 2 + 4))
        for kb in gl.static_range(NKB):
            col = i_h * K + kb * 64
            tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(slot * NKB + kb))
            tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(slot * NKB + kb))
            tma.async_copy_global_to_shared(G_d, [t0, col], bar, G_s.index(slot * NKB + kb))


@gluon.jit
def _consumer(ready, empty, q_s, k_s, G_s, b_s, beta_ptr, G_ptr, aqk_ptr, tinv_ptr, cidx_ptr, cu_ptr, n_items, H,
              K: gl.constexpr, NKB: gl.constexpr, NW: gl.constexpr):
    """The default partition: the four column tiles of each item once its slot is ready."""
    BL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # [64, 64] and [16, 64] tiles
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, 16, 16])
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, BL))
    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))  # the accumulators' rows and columns
    so = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA))
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        si = _wait_slot(ready, i, 0)
        i_t, i_h, _, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, 1)
        beta = gl.load(beta_ptr + (t0.to(gl.int64) + ro) * H + i_h, mask=ro < L, other=0.0).to(gl.float32)
        a_base = (i_t * H + i_h).to(gl.int64) * 4096
        for j in gl.static_range(4):
            ref = gl.minimum(j * 16 + 15, L - 1)  # eps_j: Gamma at the tile's last valid token
            rows = gl.expand_dims((r >= j * 16) & (r < L), 1)  # rows before tile j are its past: zero
            cols = gl.expand_dims((j * 16 + r16) < L, 1)
            acc_q = gl.zeros([64, 16], gl.float32, layout=MMA)
            acc_k = gl.zeros([64, 16], gl.float32, layout=MMA)
            for kb in gl.static_range(NKB):
                s = si * NKB + kb
                g_ref = gl.expand_dims(gl.load(G_ptr + (t0.to(gl.int64) + ref) * (H * K) + i_h * K + kb * 64 + c), 0)
                e_r = gl.exp(gl.where(rows, G_s.index(s).load(BL) - g_ref, float("-inf")))  # (0, e^75]
                e_s = gl.exp(gl.where(cols, g_ref - G_s.index(s).slice(j * 16, 16).load(BL), float("-inf")))
                b_s.store((k_s.index(s).slice(j * 16, 16).load(BL).to(gl.float32) * e_s).to(gl.bfloat16))
                fence_async_shared()
                qa = gl.convert_layout((q_s.index(s).load(BL).to(gl.float32) * e_r).to(gl.bfloat16), AOP)
                ka = gl.convert_layout((k_s.index(s).load(BL).to(gl.float32) * e_r).to(gl.bfloat16), AOP)
                acc_q = warpgroup_mma(qa, b_s.permute((1, 0)), acc_q)
                acc_k = warpgroup_mma(ka, b_s.permute((1, 0)), acc_k)
            o2 = a_base + gl.expand_dims(ro, 1) * 64 + j * 16 + gl.expand_dims(so, 0)
            lower = gl.expand_dims(ro, 1) >= gl.expand_dims(j * 16 + so, 0)
            strict = gl.expand_dims(ro, 1) > gl.expand_dims(j * 16 + so, 0)
            gl.store(aqk_ptr + o2, gl.where(lower, acc_q, 0.0))
            gl.store(tinv_ptr + o2, gl.where(strict, acc_k * gl.expand_dims(beta, 1), 0.0))
        fence_async_shared()
        mbarrier.arrive(empty.index(si), count=1)


@gluon.jit
def _gluon_a_kernel(q_d, k_d, G_d, beta_ptr, G_ptr, aqk_ptr, tinv_ptr, cidx_ptr, cu_ptr, NT, H, K: gl.constexpr,
                    RING: gl.constexpr, num_warps: gl.constexpr):
    """Phase A over NT chunks x H heads (q_d, k_d, G_d: TMA descriptors of [64, 64] tiles of q, k, Gamma as
    [tokens, H K]); Aqk and T's buffer A as [NT, H, 64, 64] fp32."""
    NKB: gl.constexpr = K // 64
    q_s = gl.allocate_shared_memory(gl.bfloat16, [RING * NKB, 64, 64], q_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [RING * NKB, 64, 64], k_d.layout)
    G_s = gl.allocate_shared_memory(gl.float32, [RING * NKB, 64, 64], G_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [16, 64], gl.NVMMASharedLayout.get_default_for([16, 64],
                                                                                                  gl.bfloat16))
    ready, empty = ring_barriers(RING, 1)  # the consumer releases a slot
    n_items = NT * H
    gl.warp_specialize([
        (_consumer, (ready, empty, q_s, k_s, G_s, b_s, beta_ptr, G_ptr, aqk_ptr, tinv_ptr, cidx_ptr, cu_ptr, n_items,
                     H, K, NKB, num_warps)),
        (_loader, (ready, empty, q_s, k_s, G_s, q_d, k_d, G_d, cidx_ptr, cu_ptr, n_items, H, K, NKB)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def supported(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, DTA) -> Optional[str]:
    """None if this kernel computes phase A for these tensors, else why not (the Triton kernel runs instead)."""
    import triton.language as tl

    if q.shape[-1] % 64:
        return f"K a multiple of 64 (got {q.shape[-1]})"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or DTA != tl.bfloat16 or G.dtype != torch.float32:
        return "bf16 q, k with 16-bit A products and fp32 Gamma"
    return on_hopper(q)


def launch(q, k, G, beta, aqk, tinv, plan, H: int, K: int, launcher: Optional[Callable] = None,
           programs: Optional[int] = None) -> None:
    """Phase A by ``_gluon_a_kernel`` (token layout [B, T, H, K]; Aqk and A as [NT, H, 64, 64]); launcher, programs:
    ``gluon_wy.run_persistent``."""
    tok = (q.numel() // (H * K), H * K)
    args = (tile_descriptor(q, gl.bfloat16, tok), tile_descriptor(k, gl.bfloat16, tok),
            tile_descriptor(G, gl.float32, tok), beta, G, aqk, tinv, plan.chunk_idx, plan.cu, plan.NT, H)
    run_persistent(_gluon_a_kernel, plan.NT * H, q.device, args, launcher, programs, CTAS_PER_SM, K=K, RING=RING,
                   num_warps=CONSUMER_WARPS, **launch_options(MAXNREG))
