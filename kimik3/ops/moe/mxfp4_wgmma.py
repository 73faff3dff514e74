"""The MXFP4 grouped matmul's route for decode sizes on Hopper: a warp-specialised Gluon kernel that streams x's
tiles and the weight codes into shared memory by TMA while its consumer warpgroups decode the codes straight into
``wgmma``'s A registers and multiply, y^T = W x^T per expert (up to 64 rows an expert).

The decode is mma.sync's (``mxfp4_mma``): a thread of a warp owns, for weight columns ``l`` and ``l + 8`` of its
16, the 32 elements of its quarter t = lane % 4 of every 128-element K step, i.e. 16 consecutive code bytes a
column, and ``decode_pair`` turns nibbles q and q + 4 of its word w into the A registers of MMA k indices
h + 2 t + 8 q + 32 w (h = 0, 1), for the element at k = 32 t + 8 w + 4 h + q. So the MMA multiplies the weights with
K renumbered within each 128-element step, and x must be renumbered the same way: x[:, 128 c + 32 t + 8 w + 4 h + q]
at column 128 c + h + 2 t + 8 q + 32 w of a copy padded to whole steps (zeros past I). The packed MoE's rows are
written so where they are made (``mxfp8_rows``: the gathered rows and the SiTU-GLU output, fake-quantised to MXFP8
in the same pass); other rows go through ``renumber_k`` first (one pass, as long as a copy of x: 2% of the call at
one row an expert, 10% at 64, with 112 experts). Stored so, x reaches shared memory by TMA with no registers, and
every program reads it in the MMA's order.

A program takes (expert e, 64 NC weight columns) and its expert's rows in passes of BR (8, 16, 32 or 64), or, in
the wide form (``wgmma_tile`` says when), where its expert has more than BR rows, of 2 BR below 64 and of 64 + 16 at
64 (the 16 rows in a ring and an accumulator of their own, multiplied by the same decoded A registers: a tensor's
dimensions are powers of two). Each program reads its expert's count; each further pass re-reads the codes from L2:

- a 1-warp loader partition fills an S-slot ring, per (pass, 128-element K step): x's tile as two [BR, 64] TMA boxes
  (wgmma's B, 128-byte swizzle; a 64 + 16-row pass adds two [16, 64] boxes to the tail's ring) and the step's
  code words, one [64 NC, 16] int32 box (its rows are the program's weight columns: a thread's 16 bytes are one
  128-bit shared load), on the slot's "ready" barrier;
- NC consumer partitions (one warpgroup each, 64 weight columns) wait for the slot, load their code words, decode
  each half of the K step into A registers and issue its wgmma (the second half decodes while the first
  multiplies), wait, and hand the slot back on its "empty" barrier (NC arrivals free it). Each consumer loads its
  columns' scale codes from global one K step ahead (one byte a column a step: under TMA's 16-byte minimum box).

The decode's instructions compete with the tensor cores' issue at 32-64 rows a pass, so they are kept few: the codes
in kernel order (``kimik3.quant.kernel_order``: a word's four pairs of elements out in nine integer operations, where
the OCP order takes fifteen) and one multiply a pair, 179 instructions a thread a K step at 64 rows (sm_90 SASS, the
loop with the wgmmas, loads and barriers; 227 in the OCP order). With them cut, the decode no longer sets the pace
there (without its multiply the kernel is 1-3% faster): at 64 rows the bytes an SM has in flight toward shared memory
do, mostly x's tiles (the ring's slots: with two instead of three the kernel is slower at three programs an SM or
four, and shared memory holds no more; benchmarks/NOTES-quant.md). Each consumer first reads the largest scale code
of its 64 columns (the bytes its K steps read next, so they then come from L2): up to 128, the two multiplies of a
pair (by 2^126, then by the scale) are one, by 2^126 x the scale, a bf16 as long as the code is at most 128 (blocks
of |w| < 16: trained weights' blocks), with the same bits; otherwise the warpgroup takes the two.

The partitions drift apart by up to S steps, so one warpgroup's decode overlaps another's tensor work and the
copies of the next steps. NC is 2 (two programs an SM: ``maxnreg`` 80 over 12 warps, the consumers at 112 and 104
registers, or 96 and 120 with the passes of 2 BR below 64, the loader's warpgroup at 24; 41-86 KB of shared
memory) or, for small grids, 1 (three programs an SM: 8 warps, the consumer at 136; ``wgmma_tile`` says when).
Against one 8-warp partition that stages x itself (x loaded from L2 and renumbered in registers in the step that
uses it), the NC = 2 form is 1.27-1.35x faster at 16-64 rows an expert with 112 experts, and 1.11-1.22x faster than
mma.sync at 1-8 (benchmarks/NOTES-quant.md).

The group past ``offsets_E[E - 1]`` writes its rows as zeros. Offsets are clamped to 0..R as read. No host sync: the
grid is fixed by the shapes. Tests: tests/ops/test_mxfp4_wgmma.py runs the kernel through tests/gluon_emulator.py
on the CPU and compiles it for sm_90.

Legend: R rows (sorted by expert), E experts, I in features (the reduction axis), O out features, S ring slots, BR
rows a pass.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kimik3.ops.glue.common import _sm_count, on_device, triton
from kimik3.ops.moe.mxfp4_mma import FOLD_MAX_CODE, decode_pair, expert_tile, scale_bits
from kimik3.ops.moe.mxfp8_rows import renumber_k

__all__ = ["mxfp4_wgmma", "wgmma_tile"]

# A program: NC consumer warpgroups of 64 weight columns each and a loader warp. Two (128 columns: every program
# reads its x tiles from L2, so wider programs read less of it) with two programs an SM, the kernel's 12 warps at
# ``maxnreg`` 80, the second consumer raised to WGMMA_REGS, the loader's warpgroup lowered to 24, the first consumer
# left the rest (112: no spills at 64 rows a pass, where 96 spilled). One (64 columns) with three programs an SM (8
# warps at 80: the consumer gets 136) where two a program would leave too few programs for the SMs to stay busy to
# the end, fewer than WGMMA_WAVES x 2 an SM (K3's 14 local experts on 64 GPUs: 1.4-2.7 such waves a matmul, 5-17%
# slower than with 64 columns a program; 112 experts: 10-21 waves, 1-4% faster; benchmarks/NOTES-quant.md).
WGMMA_COLUMNS = 64
WGMMA_MAXNREG = 80
WGMMA_WAVES = 4
WGMMA_REGS = gl.constexpr(104)
# With the passes of 2 BR compiled in too, the second consumer at 120 and the first at 96 (at 104 / 112 the 16-row
# form spills; the 32-row form, with the 64-row passes, spills one 4-byte value at every split).
WGMMA_WIDE_REGS = gl.constexpr(120)
_LOADER_REGS = gl.constexpr(24)
# Ring slots by rows a pass (benchmarks/NOTES-quant.md has the sweep at 8, 14 and 112 experts).
WGMMA_SLOTS = {8: 4, 16: 4, 32: 4, 64: 3}
# The rows past 64 that a wide pass at 64 a pass takes (its own ring and accumulator): 16 keeps the 64-row form's 3
# slots at three programs an SM with one consumer and two with two; experts of 65-80 rows take one pass, not two.
WGMMA_TAIL = 16
_TAIL = gl.constexpr(WGMMA_TAIL)


def wgmma_tile(R: int, E: int, O: int = 0, sms: int = 132) -> tuple[int, int, int, bool]:
    """(rows a pass BR, ring slots S, consumer warpgroups NC, wide) for ``R`` rows over ``E`` experts of ``O``
    outputs on a GPU of ``sms`` SMs: BR the mean rows an expert's next power of two from 8 to 64; wide where some
    expert can have more rows than BR and the mean is over half of BR (below 64) or over 48 (at 64): then the experts
    of more than BR rows take passes of 2 BR, or of 64 + 16 at 64 (a router spreads rows unevenly, and an expert
    past its pass's rows would take another pass over all its weights, which costs more than a wider pass), and the
    ring's slots are those of 2 BR (of 64 at 64; at a lower mean an expert rarely has more than BR rows and the
    narrower ring is faster); NC 2 (128 weight columns a program) unless that grid is under ``WGMMA_WAVES`` waves of
    two programs an SM, then 1."""
    rows = -(-R // max(E, 1))
    per_pass = 8
    while per_pass < 64 and per_pass < rows:
        per_pass *= 2
    if per_pass < 64:
        wide = R > per_pass and 2 * rows > per_pass
    else:
        wide = R > per_pass and 4 * rows > 3 * per_pass
    programs = (E + 1) * -(-O // (2 * WGMMA_COLUMNS))
    consumers = 2 if programs >= WGMMA_WAVES * 2 * sms else 1
    return per_pass, WGMMA_SLOTS[min(2 * per_pass, 64) if wide else per_pass], consumers, wide


def mxfp4_wgmma(x_RI: torch.Tensor, codes_EOH: torch.Tensor, scales_EOB: torch.Tensor, offsets_E: torch.Tensor,
                *, mma_order: bool = False, launcher=None) -> torch.Tensor:
    """y_RO [R, O] bf16 = each expert's rows of x_RI (bf16, sorted by expert) times its dequantised MXFP4 weight.
    The arguments are ``mxfp4_grouped_mm``'s, already checked; a Hopper GPU (``wgmma_available``). ``mma_order``:
    x_RI is [R, mma_width(I)] in the MMA's k order already (``mxfp8_rows``; contiguous, its base 16-byte aligned),
    else ``renumber_k`` writes it so.
    ``launcher``: how to launch the Gluon kernel (``launcher(kernel, grid, *args, **kwargs)``; the tests'
    emulator), by default on the GPU."""
    R = x_RI.shape[0]
    E, O, H = codes_EOH.shape
    I = 2 * H
    y_RO = torch.empty(R, O, dtype=torch.bfloat16, device=x_RI.device)
    if R == 0:
        return y_RO
    sms = _sm_count(x_RI.device.index if x_RI.device.index is not None else torch.cuda.current_device()) \
        if x_RI.is_cuda else 2
    per_pass, slots, consumers, wide = wgmma_tile(R, E, O, sms)
    columns = consumers * WGMMA_COLUMNS
    x_k = x_RI if mma_order else renumber_k(x_RI)     # (contiguous, 16-byte aligned: as TMA reads it)
    # TMA wants 16-byte aligned rows and base: the codes as one [E O, I / 8] int32 matrix
    if not codes_EOH.is_contiguous() or codes_EOH.data_ptr() % 16:
        codes_EOH = codes_EOH.clone(memory_format=torch.contiguous_format)
    words = codes_EOH.view(torch.int32).view(E * O, H // 4)
    def x_boxes(rows):   # x's TMA descriptor in [rows, 64] boxes
        return TensorDescriptor(x_k, list(x_k.shape), list(x_k.stride()), [rows, 64],
                                gl.NVMMASharedLayout.get_default_for([rows, 64], gl.bfloat16))

    x_d = x_boxes(per_pass)
    xw_d = x_boxes(WGMMA_TAIL if per_pass == 64 else 2 * per_pass) if wide else x_d
    c_d = TensorDescriptor(words, list(words.shape), list(words.stride()), [columns, 16],
                           gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    grid = ((E + 1) * triton.cdiv(O, columns),)
    args = (x_d, xw_d, c_d, scales_EOB, scales_EOB.stride(0), scales_EOB.stride(1), scales_EOB.stride(2), offsets_E,
            y_RO, R, O, E)
    kwargs = dict(I=I, BR=per_pass, WIDE=wide, BMC=columns, S=slots, NC=consumers, num_warps=4,
                  maxnreg=WGMMA_MAXNREG)
    if launcher is not None:
        launcher(_mxfp4_wgmma_kernel, grid, *args, **kwargs)
        return y_RO
    with on_device(x_RI.device):
        _mxfp4_wgmma_kernel[grid](*args, **kwargs)
    return y_RO


@gluon.jit
def _loader(ready, empty, xs, xt, cs, x_d, xw_d, c_d, off_ptr, R, O, E, I: gl.constexpr, BR: gl.constexpr,
            WIDE: gl.constexpr, BMC: gl.constexpr, S: gl.constexpr):
    """The loader partition: the passes of BR rows, or (``WIDE`` and the expert has more than BR rows) of 2 BR, of
    64 + 16 at 64."""
    e, pid_n, start, end = expert_tile(off_ptr, R, O, E, BMC)
    if e < E:
        if WIDE and end - start > BR:
            if BR == 64:
                _load_passes(ready, empty, xs, xt, cs, x_d, xw_d, c_d, e, pid_n, start, end, O, I, BR, _TAIL, BMC, S)
            else:
                _load_passes(ready, empty, xs, xt, cs, xw_d, xw_d, c_d, e, pid_n, start, end, O, I, 2 * BR, 0, BMC, S)
        else:
            _load_passes(ready, empty, xs, xt, cs, x_d, x_d, c_d, e, pid_n, start, end, O, I, BR, 0, BMC, S)


@gluon.jit
def _load_passes(ready, empty, xs, xt, cs, x_d, xt_d, c_d, e, pid_n, start, end, O, I: gl.constexpr,
                 PR: gl.constexpr, PT: gl.constexpr, BMC: gl.constexpr, S: gl.constexpr):
    """Per pass of PR + PT rows and K step, once the consumers have freed the slot: x's tile (two [PR, 64] boxes, into
    the first PR rows of the slot's tiles, and for a tail of PT rows two [PT, 64] boxes of xt_d into the tail's ring
    xt) and the step's code words of the program's columns."""
    NK: gl.constexpr = (I + 127) // 128
    i = 0
    for r0 in range(start, end, PR + PT):
        for k in range(NK):
            slot = i % S
            mbarrier.wait(empty.index(slot), ((i // S) & 1) ^ 1)   # a fresh slot's previous phase counts as done
            bar = ready.index(slot)
            mbarrier.expect(bar, (PR + PT) * 128 * 2 + BMC * 64)
            tma.async_copy_global_to_shared(x_d, [r0, k * 128], bar, xs.index(2 * slot).slice(0, PR))
            tma.async_copy_global_to_shared(x_d, [r0, k * 128 + 64], bar, xs.index(2 * slot + 1).slice(0, PR))
            if PT > 0:
                tma.async_copy_global_to_shared(xt_d, [r0 + PR, k * 128], bar, xt.index(2 * slot))
                tma.async_copy_global_to_shared(xt_d, [r0 + PR, k * 128 + 64], bar, xt.index(2 * slot + 1))
            tma.async_copy_global_to_shared(c_d, [e * O + pid_n * BMC, k * 16], bar, cs.index(slot))
            i += 1


@gluon.constexpr_function
def _words_layout():
    """A warpgroup's code words of a K step [64, 16] as the decode wants them in registers: weight column
    16 wp + 8 r + l, word 4 t + w to warp wp, register r and w, lane (l, t)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])


@gluon.jit
def _decode_half(words, scale2, A_L: gl.constexpr, FOLD: gl.constexpr):
    """Code words [4, 2, 8, t, w'] (w = 2 half + w') and their scales' bf16 bits (both halves of an int32,
    ``scale_bits`` with the same ``FOLD``) -> the A operand [64, 64] of the half's MMA k indices
    h + 2 t + 8 q + 32 w'."""
    p = gl.join(gl.join(decode_pair(words, 0, scale2, FOLD), decode_pair(words, 1, scale2, FOLD)),
                gl.join(decode_pair(words, 2, scale2, FOLD), decode_pair(words, 3, scale2, FOLD)))
    # [W, 2, 8, t, w', h, q0, q1] -> [W, 2, 8, w', q1, q0, t, h]: rows the columns, k = 32 w' + 8 q + 2 t + h
    p = gl.permute(p, [0, 1, 2, 4, 7, 6, 3, 5])
    return gl.convert_layout(gl.reshape(p, [64, 64]), A_L, assert_trivial=True)


@gluon.jit
def _max_scale_code(sc_ptr, s_se, s_so, s_sb, e, col0, O, E, NB: gl.constexpr):
    """The largest scale code of expert e's weight columns col0 ... col0 + 63 (0 for the group past the last
    offset), one warpgroup's scalar: the bytes its K steps read next, so they come from L2 there."""
    BL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    c = col0 + gl.arange(0, 64, layout=gl.SliceLayout(1, BL))
    b = gl.arange(0, 32, layout=gl.SliceLayout(0, BL))
    live = gl.expand_dims((c < O) & (e < E), 1)
    ptrs = sc_ptr + e.to(gl.int64) * s_se + gl.expand_dims(c.to(gl.int64) * s_so, 1) + gl.expand_dims(b * s_sb, 0)
    top = gl.zeros([64, 32], gl.int32, layout=BL)
    for b0 in gl.static_range(0, NB, 32):
        codes = gl.load(ptrs + b0 * s_sb, mask=live & gl.expand_dims(b0 + b < NB, 0), other=0)
        top = gl.maximum(top, codes.to(gl.int32))
    return gl.max(gl.max(top, axis=1), axis=0)


@gluon.jit
def _consumer(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E, I: gl.constexpr,
              BR: gl.constexpr, WIDE: gl.constexpr, BMC: gl.constexpr, S: gl.constexpr, CI: gl.constexpr):
    """Consumer partition CI (one warpgroup): weight columns 64 CI ... 64 CI + 63 of the program's BMC, every pass
    (of BR rows, or wider as the loader's). The decode's two multiplies a pair become one where none of these
    columns' scale codes is over FOLD_MAX_CODE (``scale_bits``; blocks of |w| >= 16 have more, which trained weights
    rarely do)."""
    e, pid_n, start, end = expert_tile(off_ptr, R, O, E, BMC)
    col0 = pid_n * BMC + CI * 64
    if _max_scale_code(sc_ptr, s_se, s_so, s_sb, e, col0, O, E, I // 32) <= FOLD_MAX_CODE:
        _consumer_passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I, BR,
                         WIDE, S, CI, True)
    else:
        _consumer_passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I, BR,
                         WIDE, S, CI, False)


@gluon.jit
def _consumer_passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E,
                     I: gl.constexpr, BR: gl.constexpr, WIDE: gl.constexpr, S: gl.constexpr, CI: gl.constexpr,
                     FOLD: gl.constexpr):
    """The passes of 2 BR rows (64 + 16 at 64) where ``WIDE`` and the expert has more than BR rows, else of BR (as the
    loader's)."""
    if WIDE and end - start > BR:
        if BR == 64:
            _passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I, BR,
                    _TAIL, S, CI, FOLD)
        else:
            _passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I, 2 * BR,
                    0, S, CI, FOLD)
    else:
        _passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I, BR, 0, S, CI,
                FOLD)


@gluon.jit
def _passes(ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, y_ptr, e, col0, start, end, O, E, I: gl.constexpr,
            BR: gl.constexpr, BT: gl.constexpr, S: gl.constexpr, CI: gl.constexpr, FOLD: gl.constexpr):
    """Consumer CI's passes of BR + BT rows over rows start..end: the ring's K steps decoded and multiplied, into
    an fp32 accumulator [64, BR] and, for a tail of BT rows, a second [64, BT] (the decoded A registers multiply
    both), stored in bf16."""
    NK: gl.constexpr = (I + 127) // 128
    NB: gl.constexpr = I // 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 16])
    MMA_T: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BT if BT > 0 else BR, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    A_T: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_T, k_width=2)
    # code words [4, 2, 8, 4 (t), 4 (w)]: weight column 16 wp + 8 r + l, word 4 t + w of the step
    WL: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    CL: gl.constexpr = _words_layout()
    SL: gl.constexpr = gl.SliceLayout(4, WL)   # scale codes [4, 2, 8, 4 (t)]: block 4 k + t
    L3: gl.constexpr = gl.SliceLayout(3, SL)
    wp = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    r2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    l8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    cols = col0 + gl.expand_dims(gl.expand_dims(wp * 16, 1), 2) \
        + gl.expand_dims(gl.expand_dims(r2 * 8, 0), 2) + gl.expand_dims(gl.expand_dims(l8, 0), 1)
    cols = gl.expand_dims(cols, 3)
    tb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, SL))))
    tb = gl.expand_dims(gl.expand_dims(gl.expand_dims(tb, 0), 1), 2)
    live = (cols < O) & (e < E)
    s_ptrs = sc_ptr + e.to(gl.int64) * s_se + cols.to(gl.int64) * s_so + tb * s_sb

    out_cols = col0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    out_rows = gl.arange(0, BR, layout=gl.SliceLayout(0, MMA))
    n_k = gl.minimum(E - e, 1) * NK      # the group past the last offset: no K steps, its rows come out 0
    i = 0
    for r0 in range(start, end, BR + BT):
        acc = gl.zeros([64, BR], gl.float32, layout=MMA)
        if BT > 0:
            acc_t = gl.zeros([64, BT], gl.float32, layout=MMA_T)
        scodes = gl.load(s_ptrs, mask=live & (tb < NB), other=127)
        for k in range(n_k):
            k_next = (k + 1) % NK                  # the next step's scales (the first step's again after the last)
            next_scodes = gl.load(s_ptrs + k_next * 4 * s_sb, mask=live & (k_next * 4 + tb < NB), other=127)
            slot = i % S
            mbarrier.wait(ready.index(slot), (i // S) & 1)
            words = gl.convert_layout(gl.reshape(cs.index(slot).slice(CI * 64, 64).load(CL), [4, 2, 8, 4, 4]), WL,
                                      assert_trivial=True)
            scale2 = gl.broadcast(gl.expand_dims(scale_bits(scodes, FOLD), 4), words)[0]
            # the K step's halves: words w = 0, 1 (MMA k 0..63) and w = 2, 3
            w0, w1 = gl.split(gl.permute(gl.reshape(words, [4, 2, 8, 4, 2, 2]), [0, 1, 2, 3, 5, 4]))
            s0, s1 = gl.split(gl.permute(gl.reshape(scale2, [4, 2, 8, 4, 2, 2]), [0, 1, 2, 3, 5, 4]))
            a0 = _decode_half(w0, s0, A_L, FOLD)
            acc = warpgroup_mma(a0, xs.index(2 * slot).slice(0, BR).permute((1, 0)), acc, is_async=True)
            if BT > 0:
                acc_t = warpgroup_mma(gl.convert_layout(a0, A_T, assert_trivial=True),
                                      xt.index(2 * slot).permute((1, 0)), acc_t, is_async=True)
            a1 = _decode_half(w1, s1, A_L, FOLD)
            acc = warpgroup_mma(a1, xs.index(2 * slot + 1).slice(0, BR).permute((1, 0)), acc, is_async=True)
            if BT > 0:
                acc_t = warpgroup_mma(gl.convert_layout(a1, A_T, assert_trivial=True),
                                      xt.index(2 * slot + 1).permute((1, 0)), acc_t, is_async=True)
                acc, acc_t, a0, a1 = warpgroup_mma_wait(0, deps=[acc, acc_t, a0, a1])
            else:
                acc, a0, a1 = warpgroup_mma_wait(0, deps=[acc, a0, a1])
            gl.thread_barrier()                       # the warpgroup's reads of the slot are done before it is freed
            mbarrier.arrive(empty.index(slot), count=1)
            scodes = next_scodes
            i += 1
        _store(y_ptr, acc, r0 + out_rows, out_cols, end, O)
        if BT > 0:
            _store(y_ptr, acc_t, r0 + BR + gl.arange(0, BT, layout=gl.SliceLayout(0, MMA_T)),
                   col0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA_T)), end, O)


@gluon.jit
def _store(y_ptr, acc, rows, cols, end, O):
    """An accumulator [64 weight columns cols, rows] into y's rows below end, in bf16. (The main accumulator's
    column and row indices are made once, before the passes: made in each pass, the 32-row form with its 64-row
    passes spills more.)"""
    gl.store(y_ptr + gl.expand_dims(rows.to(gl.int64) * O, 0) + gl.expand_dims(cols, 1), acc.to(gl.bfloat16),
             mask=gl.expand_dims(rows < end, 0) & gl.expand_dims(cols < O, 1))


@gluon.jit
def _mxfp4_wgmma_kernel(x_d, xw_d, c_d, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E, I: gl.constexpr,
                        BR: gl.constexpr, WIDE: gl.constexpr, BMC: gl.constexpr, S: gl.constexpr, NC: gl.constexpr,
                        num_warps: gl.constexpr):
    """Program (expert e, BMC = 64 NC weight columns): the ring, its barriers, and the partitions (NC consumer
    warpgroups, the first in the kernel's own 4 warps, and the loader). x_d: TMA descriptor of x in the MMA's k
    order in [BR, 64] boxes, xw_d in [2 BR, 64] below 64 and [16, 64] at 64 (``WIDE``; else x_d again); c_d: of the
    code words as [E O, I / 8] int32 in [BMC, 16] boxes."""
    xs = gl.allocate_shared_memory(gl.bfloat16, [2 * S, 2 * BR if WIDE and BR < 64 else BR, 64], x_d.layout)
    if WIDE and BR == 64:    # the 64 + 16-row passes' last 16 rows
        xt = gl.allocate_shared_memory(gl.bfloat16, [2 * S, _TAIL, 64], xw_d.layout)
    else:
        xt = xs
    cs = gl.allocate_shared_memory(gl.int32, [S, BMC, 16], c_d.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NC)     # every consumer hands a slot back
    if NC == 1:
        gl.warp_specialize([
            (_consumer, (ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E, I, BR, WIDE, BMC,
                         S, 0)),
            (_loader, (ready, empty, xs, xt, cs, x_d, xw_d, c_d, off_ptr, R, O, E, I, BR, WIDE, BMC, S)),
        ], [1], [_LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E, I, BR, WIDE, BMC,
                         S, 0)),
            (_consumer, (ready, empty, xs, xt, cs, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E, I, BR, WIDE, BMC,
                         S, 1)),
            (_loader, (ready, empty, xs, xt, cs, x_d, xw_d, c_d, off_ptr, R, O, E, I, BR, WIDE, BMC, S)),
        ], [4, 1], [WGMMA_WIDE_REGS if WIDE and BR < 64 else WGMMA_REGS, _LOADER_REGS])
    for s in gl.static_range(S):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
