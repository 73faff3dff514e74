"""Phase C of the Triton KDA forward (W, U and the scan operands) as a warp-specialised Gluon kernel for Hopper.

``triton_forward._intra_wy_kernel`` computes, per chunk of 64 tokens and head, W = T (beta k exp(Gamma)),
U = T (beta v), qg = q exp(Gamma), kg = k exp(Gamma_C - Gamma) and exp(Gamma_C), where T = (I + A)^-1 is the
chunk's solved WY matrix. This kernel computes the same, written in Gluon (``triton.experimental.gluon``,
Triton 3.6), where a kernel can keep a ring of tiles in shared memory, fill it by TMA and split its warps into
a loader and a consumer:

- one work item is (chunk, head, 64-column block p): W, qg, kg on key columns [64 p, 64 p + 64) and U on the
  same value columns (K == V);
- a persistent grid of one CTA per SM walks the items; a 1-warp loader partition streams each item's tiles
  (T, k, q, Gamma, v) by TMA into a 2-slot ring (a "ready" and an "empty" mbarrier per slot) while the 8-warp
  consumer partition multiplies on ``warpgroup_mma`` (bf16 operands, fp32 accumulation) and stores from
  registers, masked to the chunk's valid rows (varlen: a chunk's tiles may run into the next sequence, whose
  rows are zeroed before they enter a product; past the end of the tensor TMA reads zeros).

H200, B1 T8192 H96 D128 (the probe this came from, ``benchmarks/gluon_wy_probe.py``): 0.594 ms against the Triton
kernel's 0.717, both exact against each other.

For a forward alone (``launch(u=None, tbeta=)``, ``triton_forward.GLUON_SCAN_U``) the kernel forms no U: each chunk's
first column block stores -T diag(beta) in bf16 (8 KB per chunk and head) and ``gluon_scan`` forms U from it and v,
so v is not read and no fp32 U is written. H200, K3's shape, same run: 0.643 -> 0.525 ms.

It runs where ``supported`` says (sm_90, bf16, K == V, a multiple of 64; the precision variant's 16-bit W and WY
products), as ``triton_forward.GLUON_WY`` selects; everywhere else the Triton kernel runs. Gluon does not run under
the Triton interpreter: CI runs this kernel through ``tests/gluon_emulator.py`` and compiles it for sm_90.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

RING = 2  # ring slots
CONSUMER_WARPS = 8  # the default partition's warps (two warpgroups: the [64, 64] products split over N)
MAXNREG: Optional[int] = None  # registers per thread at launch (ptxas .maxnreg; None: the compiler's choice)
CTAS_PER_SM = 1  # the persistent grid's CTAs per SM
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)  # the TMA loader partition


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
def _item(item, H, cidx_ptr, cu_ptr, NP: gl.constexpr):
    """Work item -> (global chunk, head, column block, the chunk's first token, its valid rows)."""
    p = item % NP
    ch = item // NP
    i_h = ch % H
    i_t = ch // H
    i_n = gl.load(cidx_ptr + 2 * i_t)
    t0 = gl.load(cu_ptr + i_n) + gl.load(cidx_ptr + 2 * i_t + 1) * 64
    L = gl.minimum(gl.load(cu_ptr + i_n + 1) - t0, 64)
    return i_t, i_h, p, t0, L


@gluon.jit
def _item_ahead(pid, nprog, i, n_items, H, cidx_ptr, cu_ptr):
    """``_item`` of this persistent program's i-th item (``_my_items``), clamped to the last item: a consumer reads
    its next item's metadata while working on the current one, so that the loads' latency is hidden."""
    return _item(gl.minimum(pid + i * nprog, n_items - 1), H, cidx_ptr, cu_ptr, 1)


@gluon.jit
def _my_items(n_items):
    """This persistent program's share of n_items: (program id, program count, how many items it takes); its
    i-th item is pid + i * nprog."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    return pid, nprog, (n_items - pid + nprog - 1) // nprog


@gluon.jit
def _wait_slot(bars, i, FREE: gl.constexpr):
    """The ring slot of a program's i-th item (one barrier per slot in bars), once its barrier says so: FREE for
    the loader (the consumer has handed the slot back; a fresh slot's "previous" phase counts as done), else for
    the consumer (its tiles have landed)."""
    n: gl.constexpr = bars.shape[0]
    slot = i % n
    mbarrier.wait(bars.index(slot), ((i // n) & 1) ^ FREE)
    return slot


@gluon.jit
def split16(x):
    """fp32 x as a bf16 high part and the bf16 remainder (hi + lo holds ~16 mantissa bits): Gluon's twin of
    ``triton_scan._split16``."""
    hi = x.to(gl.bfloat16)
    return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def ring_barriers(RING: gl.constexpr, RELEASERS: gl.constexpr):
    """A ring's barriers, initialised: "ready" (one arrival, the loader's expect, plus the TMA bytes) and "empty"
    (RELEASERS arrivals: every consumer partition hands the slot back), one of each per slot."""
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=RELEASERS)
    return ready, empty


@gluon.jit
def release_ring(ready, empty):
    """Invalidate a ring's barriers (``ring_barriers``) at the kernel's end."""
    n: gl.constexpr = ready.shape[0]
    for s in gl.static_range(n):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


@gluon.jit
def _loader(ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, cidx_ptr, cu_ptr, n_items, H,
            K: gl.constexpr, NP: gl.constexpr, WITH_U: gl.constexpr):
    """The loader partition: each item's T, k, q, Gamma (and, WITH_U, v) tiles by TMA, once the consumer has freed
    the slot."""
    pid, nprog, count = _my_items(n_items)
    for i in range(count):
        slot = _wait_slot(empty, i, 1)
        i_t, i_h, p, t0, L = _item(pid + i * nprog, H, cidx_ptr, cu_ptr, NP)
        col = i_h * K + p * 64
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * 64 * 64 * 4 + (3 if WITH_U else 2) * 64 * 64 * 2)
        tma.async_copy_global_to_shared(t_d, [(i_t * H + i_h) * 64, 0], bar, t_s.index(slot))
        tma.async_copy_global_to_shared(k_d, [t0, col], bar, k_s.index(slot))
        tma.async_copy_global_to_shared(q_d, [t0, col], bar, q_s.index(slot))
        tma.async_copy_global_to_shared(G_d, [t0, col], bar, G_s.index(slot))
        if WITH_U:
            tma.async_copy_global_to_shared(v_d, [t0, col], bar, v_s.index(slot))


@gluon.jit
def _consumer(ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
              tb_ptr, cidx_ptr, cu_ptr, n_items, H, K: gl.constexpr, NP: gl.constexpr, NW: gl.constexpr,
              WITH_U: gl.constexpr):
    """The default partition: each item once its slot is ready, the slot handed back once its tiles are read. Without
    U (not WITH_U), each chunk's first column block stores -T diag(beta) in bf16 to tb_ptr instead, from which the
    state scan forms U itself (``gluon_scan``)."""
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
        if WITH_U:  # U = T (beta v)
            b_s.store(gl.where(rows, v_s.index(si).load(BL).to(gl.float32) * beta, 0.0).to(gl.bfloat16))
            fence_async_shared()
            u = warpgroup_mma(tm, b_s, acc, use_acc=False)
            gl.store(u_ptr + offs, gl.convert_layout(u, BL), mask=rows)
        elif p == 0:  # -T diag(beta), its columns past the chunk zero (their v rows belong to the next sequence)
            beta_c = gl.load(beta_ptr + (t0.to(gl.int64) + c) * H + i_h, mask=c < L, other=0.0).to(gl.float32)
            tb = gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0)
            gl.store(tb_ptr + (i_t * H + i_h).to(gl.int64) * 4096 + tb,
                     (-(t32 * gl.expand_dims(beta_c, 0))).to(gl.bfloat16))
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
def _gluon_wy_kernel(t_d, k_d, q_d, G_d, v_d, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr, tb_ptr, cidx_ptr,
                     cu_ptr, NT, H, K: gl.constexpr, RING: gl.constexpr, WITH_U: gl.constexpr,
                     num_warps: gl.constexpr):
    """Phase C over NT chunks x H heads x K / 64 column blocks (the _d arguments are TMA descriptors of [64, 64]
    tiles: T as [NT H 64, 64] fp32, k, q, v as [tokens, H K] bf16, Gamma as [tokens, H K] fp32). Not WITH_U: U is
    not formed (v not read), -T diag(beta) goes to tb_ptr ([NT, H, 64, 64] bf16) instead."""
    NP: gl.constexpr = K // 64
    t_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], t_d.layout)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, 64], k_d.layout)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [RING, 64, 64], q_d.layout)
    G_s = gl.allocate_shared_memory(gl.float32, [RING, 64, 64], G_d.layout)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [RING if WITH_U else 1, 64, 64], v_d.layout)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], k_d.layout)  # the products' right-hand operand
    ready, empty = ring_barriers(RING, 1)
    n_items = NT * H * NP
    gl.warp_specialize([
        (_consumer, (ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr,
                     u_ptr, tb_ptr, cidx_ptr, cu_ptr, n_items, H, K, NP, num_warps, WITH_U)),
        (_loader, (ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, cidx_ptr, cu_ptr, n_items, H,
                   K, NP, WITH_U)),
    ], [LOADER_WARPS], [LOADER_REGS])
    release_ring(ready, empty)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: torch.Tensor, tinv: torch.Tensor,
              w: torch.Tensor, u: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, DTC) -> Optional[str]:
    """None if this kernel computes phase C for these tensors, else why not (the Triton kernel runs instead)."""
    import triton.language as tl

    K, V = q.shape[-1], v.shape[-1]
    if K != V or K % 64:
        return f"K == V, a multiple of 64 (got K={K}, V={V})"
    if any(x.dtype != torch.bfloat16 for x in (q, k, v)) or DTC != tl.bfloat16:
        return "bf16 inputs and 16-bit WY products"
    if (w.dtype, qg.dtype, kg.dtype, u.dtype, G.dtype, tinv.dtype) != (torch.bfloat16,) * 3 + (torch.float32,) * 3:
        return "W, qg, kg in bf16 and U, Gamma, T in fp32"
    return on_hopper(q)


def on_hopper(x: torch.Tensor) -> Optional[str]:
    """None if x lives on an sm_90 GPU, where the Gluon kernels run, else the reason for ``supported``."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "a Hopper GPU (sm_90)"
    return None


def tile_descriptor(x: torch.Tensor, dtype, shape: tuple, block: Sequence[int] = (64, 64),
                    swizzled: bool = True) -> TensorDescriptor:
    """A TMA descriptor of ``block`` tiles (default [64, 64]) over x viewed as the 2-D ``shape``; unswizzled when not
    ``swizzled`` (32-bit rows that a consumer reads one at a time)."""
    x2 = x.view(shape)
    block = list(block)
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype) if swizzled else \
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), block, layout)


def launch_options(maxnreg: Optional[int]) -> dict:
    """The launch's register limit as a launch option (none when None)."""
    return {} if maxnreg is None else dict(maxnreg=maxnreg)


def run_persistent(kernel, n_items: int, device: torch.device, args: tuple, launcher: Optional[Callable],
                   programs: Optional[int], ctas_per_sm: int = 1, **meta) -> None:
    """Launch a persistent Gluon kernel over n_items on min(programs, n_items) programs. launcher: how to run it
    (default: on the GPU; ``tests/gluon_emulator.emulate`` on the CPU), programs: the persistent grid (default:
    ctas_per_sm CTAs per SM)."""
    if programs is None:
        programs = torch.cuda.get_device_properties(device).multi_processor_count * ctas_per_sm
    grid = (min(programs, n_items),)
    if launcher is None:
        kernel[grid](*args, **meta)
    else:
        launcher(kernel, grid, *args, **meta)


def launch(q, k, v, G, beta, tinv, w, u, qg, kg, eg, plan, H: int, K: int,
           launcher: Optional[Callable] = None, programs: Optional[int] = None,
           tbeta: Optional[torch.Tensor] = None) -> None:
    """Phase C by ``_gluon_wy_kernel`` on the tensors ``triton_forward`` holds (token layout [B, T, H, D], T as
    [NT, H, 64, 64]); launcher, programs: ``run_persistent``. tbeta: instead of U (u then None), store -T diag(beta)
    there ([NT, H, 64, 64] bf16), from which ``gluon_scan`` forms U (a forward alone: nothing else reads U)."""
    if (u is None) == (tbeta is None):
        raise ValueError("phase C stores U or -T diag(beta) (tbeta), one of the two")
    tok = (q.numel() // (H * K), H * K)
    args = (tile_descriptor(tinv, gl.float32, (plan.NT * H * 64, 64)), tile_descriptor(k, gl.bfloat16, tok),
            tile_descriptor(q, gl.bfloat16, tok), tile_descriptor(G, gl.float32, tok),
            tile_descriptor(v, gl.bfloat16, tok), beta, G, eg, w, qg, kg, u if u is not None else w,
            tbeta if tbeta is not None else w, plan.chunk_idx, plan.cu, plan.NT, H)
    run_persistent(_gluon_wy_kernel, plan.NT * H * (K // 64), q.device, args, launcher, programs, CTAS_PER_SM, K=K,
                   RING=RING, WITH_U=u is not None, num_warps=CONSUMER_WARPS, **launch_options(MAXNREG))
