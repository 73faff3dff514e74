"""Phase C of the KDA forward (W, U, qg, kg) as a persistent Gluon kernel with a TMA ring, against our Triton kernel.

A probe of the one route left to the chunk targets (benchmarks/NOTES-kda.md, fourteenth session): Gluon
(``triton.experimental.gluon``, Triton 3.6) writes Hopper kernels with explicit layouts, shared-memory rings, TMA
and ``warpgroup_mma``. The kernel here is not used by the library. Gluon does not run under TRITON_INTERPRET: on a
CPU the variants are compiled for sm_90 (``--compile``) and run through ``tests/gluon_emulator.py`` against
phase C in torch (``--emulate``).

One work item = (chunk, head, half h): key columns [64 h, 64 h + 64) and value columns likewise. A CTA walks its
items (a persistent grid of CTAS x SMs programs). Each item's tiles (T fp32, k, q, v bf16, G fp32) arrive by TMA
into a ring of NB stages, NB - 1 items ahead of the compute. The outputs leave one of two ways:
- "staged": through shared memory and TMA stores, every input read first;
- "direct": plain stores from registers, each input read where it is used.
The "ws" variants are the direct form, warp-specialised: a 1-warp loader partition keeps the ring full, through
a ready and an empty barrier per slot, while the compute runs in the default partition.
Full chunks only (T a multiple of 64), B = 1, K = V = 128: K3's shape.

    python benchmarks/gluon_wy_probe.py [--out DIR]   # GPU: each variant against the Triton kernel, then timed
    python benchmarks/gluon_wy_probe.py --compile     # CPU: sm_90 compile of each variant (shared memory, registers)
    python benchmarks/gluon_wy_probe.py --emulate     # CPU: each variant emulated, against phase C in torch
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Report, bench, log  # noqa: E402

REPORT = Report(rows=[])
RESULTS, verdict = REPORT.results, REPORT.verdict


class Variant(NamedTuple):
    stages: int  # ring stages NB
    warps: int  # the compute's warps (a warp-specialised variant adds one loader warp)
    staged: bool  # outputs through shared memory and TMA stores (else plain stores)
    ctas: int  # CTAs per SM in the grid: they must fit the SM (--compile shows shared memory and registers)
    ws: bool = False  # warp-specialised: a 1-warp TMA loader partition, the compute in the default partition


VARIANTS = {"gluon-2": Variant(2, 4, True, 1), "gluon-2-direct": Variant(2, 4, False, 1),
            "gluon-1-direct": Variant(1, 4, False, 2), "gluon-1-direct-w8": Variant(1, 8, False, 2),
            "ws-2": Variant(2, 4, False, 1, True), "ws-2-w8": Variant(2, 8, False, 1, True),
            "ws-3-w8": Variant(3, 8, False, 1, True)}
LOADER_WARPS, LOADER_REGS = gl.constexpr(1), gl.constexpr(40)  # the loader partition's warps and registers


@gluon.jit
def _issue(item, slot, bars, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, H, K: gl.constexpr):
    """Start the TMA loads of one item's tiles (T, k, q, G, v) into ring slot ``slot``; its barrier completes when
    all of them have landed."""
    half = item % 2
    ch = item // 2
    i_h = ch % H
    i_t = ch // H
    col = i_h * K + half * 64
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * 64 * 64 * 4 + 3 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(t_d, [(i_t * H + i_h) * 64, 0], bar, t_s.index(slot))
    tma.async_copy_global_to_shared(k_d, [i_t * 64, col], bar, k_s.index(slot))
    tma.async_copy_global_to_shared(q_d, [i_t * 64, col], bar, q_s.index(slot))
    tma.async_copy_global_to_shared(G_d, [i_t * 64, col], bar, G_s.index(slot))
    tma.async_copy_global_to_shared(v_d, [i_t * 64, col], bar, v_s.index(slot))


@gluon.constexpr_function
def _blocked(num_warps):
    """The elementwise layout of a [64, 64] tile over num_warps warps."""
    return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _mma(num_warps, wn):
    """The wgmma accumulator layout of a [64, 64] product: num_warps // wn warps down M, wn across N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // wn, wn],
                                     instr_shape=[16, 64 // wn, 16])


@gluon.jit
def _ring(NB: gl.constexpr, t_d, k_d, q_d, G_d, v_d):
    """The NB-stage ring of one item's input tiles in shared memory: T, k, q, G, v."""
    return (gl.allocate_shared_memory(gl.float32, [NB, 64, 64], t_d.layout),
            gl.allocate_shared_memory(gl.bfloat16, [NB, 64, 64], k_d.layout),
            gl.allocate_shared_memory(gl.bfloat16, [NB, 64, 64], q_d.layout),
            gl.allocate_shared_memory(gl.float32, [NB, 64, 64], G_d.layout),
            gl.allocate_shared_memory(gl.bfloat16, [NB, 64, 64], v_d.layout))


@gluon.jit
def _item_direct(item, si, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr, H,
                 K: gl.constexpr, BL: gl.constexpr, MMA: gl.constexpr):
    """One item from ring slot si, each input read where it is used and each output stored from registers as soon
    as it is made (fewer live tiles than reading everything first). The caller fences the slot's reads."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    half = item % 2
    i_h = (item // 2) % H
    i_t = (item // 2) // H
    t0 = i_t * 64
    col = i_h * K + half * 64
    offs = gl.expand_dims(t0 + r, 1) * (H * K) + col + gl.expand_dims(c, 0)
    beta = gl.load(beta_ptr + (t0 + r) * H + i_h).to(gl.float32)
    tm = gl.convert_layout(t_s.index(si).load(BL).to(gl.bfloat16),
                           gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
    acc = gl.zeros([64, 64], gl.float32, layout=MMA)
    # U = T (beta v)
    b_s.store((v_s.index(si).load(BL).to(gl.float32) * gl.expand_dims(beta, 1)).to(gl.bfloat16))
    fence_async_shared()
    u = warpgroup_mma(tm, b_s, acc, use_acc=False)
    gl.store(u_ptr + offs, gl.convert_layout(u, BL))
    # W = T (beta k e^G)
    G = G_s.index(si).load(BL)
    eG = gl.exp(G)
    kr = k_s.index(si).load(BL).to(gl.float32)
    b_s.store((kr * gl.expand_dims(beta, 1) * eG).to(gl.bfloat16))
    fence_async_shared()
    w = warpgroup_mma(tm, b_s, acc, use_acc=False)
    gl.store(w_ptr + offs, gl.convert_layout(w.to(gl.bfloat16), BL))
    # the scan operands
    g_last = gl.load(G_ptr + (t0 + 63) * (H * K) + col + c)
    gl.store(kg_ptr + offs, (kr * gl.exp(gl.expand_dims(g_last, 0) - G)).to(gl.bfloat16))
    gl.store(qg_ptr + offs, (q_s.index(si).load(BL).to(gl.float32) * eG).to(gl.bfloat16))
    gl.store(eg_ptr + (i_t * H + i_h) * K + half * 64 + c, gl.exp(g_last))


@gluon.jit
def _wy_gluon(t_d, k_d, q_d, G_d, v_d, w_d, qg_d, kg_d, u_d, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
              NT, H, K: gl.constexpr, NB: gl.constexpr, WN: gl.constexpr, STAGE_OUT: gl.constexpr,
              num_warps: gl.constexpr):
    """W = T (beta k e^G), U = T (beta v), qg = q e^G, kg = k e^(G_C - G) and e^G_C for the items of this CTA
    (see the module docstring); the _d arguments are TMA descriptors of [64, 64] tiles, the _ptr ones the same
    tensors for plain loads and stores."""
    BL: gl.constexpr = _blocked(num_warps)
    MMA: gl.constexpr = _mma(num_warps, WN)
    AOP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    t_s, k_s, q_s, G_s, v_s = _ring(NB, t_d, k_d, q_d, G_d, v_d)
    bars = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NB):
        mbarrier.init(bars.index(i), count=1)
    # wgmma B operands and the output staging
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], k_d.layout)
    if STAGE_OUT:
        o16_s = gl.allocate_shared_memory(gl.bfloat16, [3, 64, 64], w_d.layout)
        o32_s = gl.allocate_shared_memory(gl.float32, [64, 64], u_d.layout)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_items = NT * H * 2
    count = (n_items - pid + nprog - 1) // nprog

    # prologue: the first NB - 1 items in flight
    for s in gl.static_range(NB - 1):
        if s < count:
            _issue(pid + s * nprog, s, bars, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, H, K)

    r = gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, BL))
    for i in range(count):
        # item i + NB - 1 into the slot item i - 1 used (its shared-memory reads were fenced last iteration)
        j = i + NB - 1
        if j < count:
            _issue(pid + j * nprog, j % NB, bars, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, H, K)

        item = pid + i * nprog
        si = i % NB
        mbarrier.wait(bars.index(si), (i // NB) & 1)
        if STAGE_OUT:  # every input first, the outputs staged in shared memory and stored by TMA
            half = item % 2
            i_h = (item // 2) % H
            i_t = (item // 2) // H
            t0 = i_t * 64
            col = i_h * K + half * 64
            beta = gl.load(beta_ptr + (t0 + r) * H + i_h).to(gl.float32)
            tm = gl.convert_layout(t_s.index(si).load(BL).to(gl.bfloat16), AOP)
            acc = gl.zeros([64, 64], gl.float32, layout=MMA)
            g_last = gl.load(G_ptr + (t0 + 63) * (H * K) + col + c)
            G = G_s.index(si).load(BL)
            kr = k_s.index(si).load(BL).to(gl.float32)
            qr = q_s.index(si).load(BL).to(gl.float32)
            vr = v_s.index(si).load(BL).to(gl.float32)
            fence_async_shared()  # the ring slot's generic reads before the next TMA write into it
            eG = gl.exp(G)
            kg = (kr * gl.exp(gl.expand_dims(g_last, 0) - G)).to(gl.bfloat16)
            qg = (qr * eG).to(gl.bfloat16)
            tma.store_wait(pendings=0)  # the staging buffers are free again
            # W = T (beta k e^G)
            b_s.store((kr * gl.expand_dims(beta, 1) * eG).to(gl.bfloat16))
            fence_async_shared()
            w = warpgroup_mma(tm, b_s, acc, use_acc=False).to(gl.bfloat16)
            # U = T (beta v)
            b_s.store((vr * gl.expand_dims(beta, 1)).to(gl.bfloat16))
            fence_async_shared()
            u = warpgroup_mma(tm, b_s, acc, use_acc=False)
            o16_s.index(0).store(w)
            o16_s.index(1).store(qg)
            o16_s.index(2).store(kg)
            o32_s.store(u)
            fence_async_shared()
            tma.async_copy_shared_to_global(w_d, [t0, col], o16_s.index(0))
            tma.async_copy_shared_to_global(qg_d, [t0, col], o16_s.index(1))
            tma.async_copy_shared_to_global(kg_d, [t0, col], o16_s.index(2))
            tma.async_copy_shared_to_global(u_d, [t0, col], o32_s)
            gl.store(eg_ptr + (i_t * H + i_h) * K + half * 64 + c, gl.exp(g_last))
        else:
            _item_direct(item, si, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr,
                         u_ptr, H, K, BL, MMA)
            fence_async_shared()  # the ring slot's generic reads before the next TMA write into it

    if STAGE_OUT:
        tma.store_wait(pendings=0)
    for s in gl.static_range(NB):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _loader(ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, NT, H, K: gl.constexpr,
            NB: gl.constexpr):
    """The loader partition of ``_wy_ws``: the TMA loads of each item once the consumer has freed its slot."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    count = (NT * H * 2 - pid + nprog - 1) // nprog
    for i in range(count):
        slot = i % NB
        mbarrier.wait(empty.index(slot), ((i // NB) & 1) ^ 1)
        _issue(pid + i * nprog, slot, ready, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, H, K)


@gluon.jit
def _consumer(ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
              NT, H, K: gl.constexpr, NB: gl.constexpr, WN: gl.constexpr, NW: gl.constexpr):
    """The default partition of ``_wy_ws``: each item once its slot is ready, then the slot handed back."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    for i in range((NT * H * 2 - pid + nprog - 1) // nprog):
        si = i % NB
        mbarrier.wait(ready.index(si), (i // NB) & 1)
        _item_direct(pid + i * nprog, si, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr,
                     kg_ptr, u_ptr, H, K, _blocked(NW), _mma(NW, WN))
        fence_async_shared()
        mbarrier.arrive(empty.index(si), count=1)  # the slot's tiles are read: the loader may refill it


@gluon.jit
def _wy_ws(t_d, k_d, q_d, G_d, v_d, w_d, qg_d, kg_d, u_d, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr, u_ptr,
           NT, H, K: gl.constexpr, NB: gl.constexpr, WN: gl.constexpr, STAGE_OUT: gl.constexpr,
           num_warps: gl.constexpr):
    """``_wy_gluon``'s direct form, warp-specialised: a loader partition keeps the ring full (ready / empty
    barriers per slot) while the default partition computes (same arguments as ``_wy_gluon``)."""
    t_s, k_s, q_s, G_s, v_s = _ring(NB, t_d, k_d, q_d, G_d, v_d)
    b_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], k_d.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NB):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (ready, empty, t_s, k_s, q_s, G_s, v_s, b_s, beta_ptr, G_ptr, eg_ptr, w_ptr, qg_ptr, kg_ptr,
                     u_ptr, NT, H, K, NB, WN, num_warps)),
        (_loader, (ready, empty, t_s, k_s, q_s, G_s, v_s, t_d, k_d, q_d, G_d, v_d, NT, H, K, NB)),
    ], [LOADER_WARPS], [LOADER_REGS])
    for s in gl.static_range(NB):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def make_inputs(T: int, H: int, K: int, device: str):
    """Phase C's inputs at K3's contract: normalised-scale bf16 q, k, v, the within-chunk cumulative log-decay G
    (fp32), beta, and a lower-triangular T per (chunk, head)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k = (rn(1, T, H, K).div(K**0.5).bfloat16() for _ in range(2))
    v = rn(1, T, H, K).bfloat16()
    G = (-torch.rand(1, T, H, K, device=device, generator=gen) * 0.3).view(1, T // 64, 64, H, K).cumsum(2)
    beta = torch.rand(1, T, H, device=device, generator=gen)
    tinv = rn(T // 64, H, 64, 64).tril() * 0.1
    return q, k, v, G.view(1, T, H, K), beta, tinv


def outputs(q: torch.Tensor):
    """Empty W, qg, kg (bf16), U (fp32) and exp(Gamma_C) for ``q``'s shape."""
    T, H, K = q.shape[1:]
    w, qg, kg = (torch.empty_like(q) for _ in range(3))
    u = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    return w, u, qg, kg, torch.empty(T // 64, H, K, device=q.device)


def torch_reference(q, k, v, G, beta, tinv):
    """Phase C in torch, rounded where the kernels round: T and the products' right-hand operands to bf16, W, qg
    and kg stored in bf16, U in fp32. Returns (W, U, qg, kg, exp(Gamma_C)) as ``outputs`` lays them out."""
    T, H, K = q.shape[1:]

    def chunks(x):
        return x.float().view(T // 64, 64, H, -1)

    t16 = tinv.bfloat16().float()
    b = chunks(beta.unsqueeze(-1))
    Gc = chunks(G)
    eG = Gc.exp()
    w = torch.einsum("nhij,njhk->nihk", t16, (chunks(k) * b * eG).bfloat16().float())
    u = torch.einsum("nhij,njhk->nihk", t16, (chunks(v) * b).bfloat16().float())
    qg = chunks(q) * eG
    kg = chunks(k) * (Gc[:, -1:] - Gc).exp()
    return (w.bfloat16().reshape(q.shape), u.reshape(q.shape), qg.bfloat16().reshape(q.shape),
            kg.bfloat16().reshape(q.shape), Gc[:, -1].exp())


def emulate_variants(T: int = 128, H: int = 2, K: int = 128, programs: int = 3) -> dict:
    """Each variant run on the CPU through ``tests/gluon_emulator.py`` (a persistent grid of ``programs``, so the
    rings wrap and the programs take unequal item counts), against ``torch_reference``: the largest difference
    of each output in units of its rounding (W, qg, kg: 2^-8 of the reference's magnitude, between half a bf16 ulp
    and one; U, exp(Gamma_C): relative to the output's largest value)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.gluon_emulator import emulate

    q, k, v, G, beta, tinv = make_inputs(T, H, K, "cpu")
    ref = torch_reference(q, k, v, G, beta, tinv)
    rows = {}
    for variant in VARIANTS:
        out = outputs(q)
        args, kw = gluon_args(q, k, v, G, beta, tinv, *out, variant)
        emulate(kernel_of(variant), (programs,), *args, timeout=10.0, **kw)
        errs = {}
        for name, r, o in zip(("w", "u", "qg", "kg", "eg"), ref, out):
            d = (r.float() - o.float()).abs()
            if o.dtype == torch.bfloat16:
                errs[name] = (d / (r.float().abs() * 2.0**-8).clamp_min(1e-30)).max().item()
            else:
                errs[name] = (d.max() / r.float().abs().max()).item()
        rows[variant] = errs
    return rows


def gluon_args(q, k, v, G, beta, tinv, w, u, qg, kg, eg, variant: str):
    """(positional arguments, keyword arguments) of ``_wy_gluon`` for one variant."""
    T, H, K = q.shape[1:]
    NT = T // 64
    NB, warps, staged = VARIANTS[variant][:3]

    def desc(x, dtype):
        x2 = x.reshape(NT * H * 64, 64) if x is tinv else x.reshape(T, H * K)
        layout = gl.NVMMASharedLayout.get_default_for([64, 64], dtype)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [64, 64], layout)

    args = (desc(tinv, gl.float32), desc(k, gl.bfloat16), desc(q, gl.bfloat16), desc(G, gl.float32),
            desc(v, gl.bfloat16), desc(w, gl.bfloat16), desc(qg, gl.bfloat16), desc(kg, gl.bfloat16),
            desc(u, gl.float32), beta, G, eg, w, qg, kg, u, NT, H)
    return args, {"K": K, "NB": NB, "WN": warps // 4, "STAGE_OUT": staged, "num_warps": warps}


def kernel_of(variant: str):
    """The Gluon kernel a variant launches (both take ``gluon_args``)."""
    return _wy_ws if VARIANTS[variant].ws else _wy_gluon


def compile_sm90(variant: str) -> dict:
    """Compile one variant for sm_90 on any machine (``kda_sm90_report.Sm90Compiler``): shared bytes, registers per
    thread and spills (ptxas)."""
    from kda_sm90_report import Sm90Compiler

    q, k, v, G, beta, tinv = make_inputs(128, 2, 128, "cpu")
    args, kw = gluon_args(q, k, v, G, beta, tinv, *outputs(q), variant)
    compiler = Sm90Compiler()
    compiler(kernel_of(variant), list(args), kw, (1,))
    row = compiler.rows[-1]
    return {"variant": variant, **{key: row[key] for key in ("shared_bytes", "registers", "spill_store_bytes",
                                                               "spill_load_bytes")}}


def run_gpu(T: int = 8192, H: int = 96, K: int = 128) -> None:
    """Each variant checked against the Triton kernel on the same inputs, then timed with it."""
    import triton.language as tl

    from kimik3.ops.kda import triton_forward as tf

    q, k, v, G, beta, tinv = make_inputs(T, H, K, "cuda")
    plan = tf.make_plan(1, T, None, q.device)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # unique traffic: q, k, v, G and T read, W, qg, kg and U written, once each
    nbytes = T * H * K * (3 * 2 + 4) + (T // 64) * H * 64 * 64 * 4 + T * H * K * (3 * 2 + 4)
    ref = outputs(q)

    def triton_call(out=ref):
        w, u, qg, kg, eg = out
        tf._launch_intra_wy(q, k, v, G, beta, tinv, w, u, qg, kg, eg, plan, H, K, K, 64, 64, tl.bfloat16, "tf32", 4)

    triton_call()
    rows = [{"variant": "triton (ours today)", "ms": bench(triton_call, warmup=25, rep=200)}]
    for variant, cfg in VARIANTS.items():
        out = outputs(q)
        args, kw = gluon_args(q, k, v, G, beta, tinv, *out, variant)

        def call(args=args, kw=kw, grid=(cfg.ctas * sms,), kernel=kernel_of(variant)):
            kernel[grid](*args, **kw)

        try:
            call()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (a fault is a result of the probe, not the end of the run)
            verdict(f"{variant} runs", False, repr(exc)[:300])
            continue
        worst = max(((a.float() - b.float()).abs().max() / a.float().abs().max()).item() for a, b in zip(ref, out))
        verdict(f"{variant} equals the Triton kernel", worst < 1e-6, f"max rel diff {worst:.1e}")
        rows.append({"variant": variant, "ms": bench(call, warmup=25, rep=200)})
    log(f"\nphase C at B1 T{T} H{H} D{K} ({nbytes / 1e9:.2f} GB of unique traffic), do_bench medians")
    log("| kernel | ms | TB/s | Triton / this |")
    for row in rows:
        row["TBps"] = nbytes / (row["ms"] * 1e-3) / 1e12
        log(f"| {row['variant']} | {row['ms']:.3f} | {row['TBps']:.2f} | {rows[0]['ms'] / row['ms']:.2f}x |")
    RESULTS["rows"] = rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", action="store_true", help="compile each variant for sm_90 only (no GPU)")
    parser.add_argument("--emulate", action="store_true",
                        help="run each variant on the CPU (tests/gluon_emulator.py) against phase C in torch")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        log("FAIL TRITON_INTERPRET=1 is set: Gluon kernels neither run nor compile under the interpreter; unset it")
        return 1
    t0 = time.time()
    if args.compile:
        log("| variant | shared KB | registers | spill bytes (store / load) |")
        for variant in VARIANTS:
            r = compile_sm90(variant)
            RESULTS["rows"].append(r)
            log(f"| {variant} | {r['shared_bytes'] / 1024:.0f} | {r['registers']} | "
                f"{r['spill_store_bytes']} / {r['spill_load_bytes']} |")
    elif args.emulate:
        log("| variant | W (2^-8 rel) | U (rel) | qg (2^-8 rel) | kg (2^-8 rel) | exp(Gamma_C) (rel) |")
        for variant, e in emulate_variants().items():
            ok = all(e[n] <= 1 for n in ("w", "qg", "kg")) and e["u"] < 1e-5 and e["eg"] < 1e-6
            verdict(f"{variant} emulated equals phase C in torch", ok, " ".join(f"{n} {x:.1e}" for n, x in e.items()))
            RESULTS["rows"].append({"variant": variant, **e})
            log(f"| {variant} | {e['w']:.2f} | {e['u']:.1e} | {e['qg']:.2f} | {e['kg']:.2f} | {e['eg']:.1e} |")
    elif not torch.cuda.is_available():
        log("FAIL no CUDA device: the kernel needs a Hopper GPU (--compile needs none)")
        return 1
    else:
        run_gpu()
    return REPORT.finish(t0, args.out, "gluon_wy_probe.json")


if __name__ == "__main__":
    sys.exit(main())
