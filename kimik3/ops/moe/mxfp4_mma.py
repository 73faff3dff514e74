"""The MXFP4 grouped matmul's route for decode sizes on a GPU without wgmma: the weights decoded straight into the
tensor cores' operand registers of ``mma.sync`` m16n8k16 (a Gluon kernel through ``mma_v2``), a few rows an expert.
On Hopper ``mxfp4_wgmma`` takes these sizes with the same decode.

``mxfp4_grouped_mm``'s other kernels multiply on the CUDA cores (gemv) or hand ``tl.dot`` a decoded tile, which
Triton moves through shared memory into the operand layout; either way a weight element costs ~6-7 instructions
(decode, layout, product). Here the product is the transposed one, y^T = W x^T per expert, so that the weights are
the MMA's A operand (16 weight columns an instruction) and the rows of x its B operand (8 rows, padded with zeros:
a decode step has a few rows an expert). The layouts are chosen so that nothing moves:

- A thread of a warp owns, for weight columns ``l`` and ``l + 8`` (l = lane / 4), the 32 elements of its quarter
  t = lane % 4 of every 128-element K step, i.e. 16 consecutive code bytes a column (one 128-bit load), as A's
  fragment wants them once K is renumbered within the step: the element at k = 32 t + 8 w + 4 h + q (word w of the
  thread's four, element q + 4 h of the word) is given the MMA's k index h + 2 t + 8 q + 32 w. The pair decode
  (``decode_pair``) places elements q and q + 4 of a word into the two bf16 halves of an int32: the halves are then
  MMA k indices k and k + 1, which is what one A register holds.
- B's fragment under the same renumbering: the thread with t and row l holds x[l, 32 t ... 32 t + 31] of each
  step, 32 consecutive elements in memory (four 128-bit loads), renumbered in registers only.
- The renumbering is reshapes and permutes of the loaded tiles whose layouts Gluon checks to be trivial
  (``convert_layout(assert_trivial=True)``): no shared memory, no shuffles.

A weight element then costs ~3 instructions (sm_90 SASS, against ~7 in the gemv route): nine integer operations
for a word's four pairs of elements (the codes in kernel order: ``kimik3.quant.kernel_order``), the exact bf16
multiplies by 2^126 (the pair decode gives the value times 2^-126) and by the block scale (``mul.rn.bf16x2``, two
elements each), and an eighth of an ``HMMA`` (an m16n8k16 takes 16 weight columns x 16 K, eight elements a
thread). The codes of the next K step are loaded before the current one is decoded (registers double-buffered), so
a program always has bytes in flight.

Programs: (expert, 16 x ``num_warps`` weight columns), expert-major; each takes its expert's rows 8 at a time (the
weights re-read from L2 for each further pass), and the group past ``offsets_E[E - 1]`` writes
its rows as zeros. Offsets are clamped to 0..R as read (bad offsets cannot make the kernel read or write outside x,
the weights or y). No host sync: the grid is fixed by the shapes.

Tests: tests/ops/test_mxfp4_mma.py runs the kernel through tests/gluon_emulator.py on the CPU (Gluon does not run
under the Triton interpreter) and compiles it for sm_90, checking the layouts are trivial and nothing spills.

Legend: R rows (sorted by expert), E experts, I in features (the reduction axis), O out features.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kimik3.ops.glue.common import on_device, triton
from kimik3.ops.moe.mxfp4_dequantize import as_words, decode_pair_bits

__all__ = ["FOLD_MAX_CODE", "MMA_STEPS", "MMA_WARPS", "decode_pair", "expert_tile", "mxfp4_mma", "scale_bits"]

# 16 weight columns a warp, 4 warps (K3's O = 3072 over 8 local experts: 384 programs), K steps of 128 elements x
# MMA_STEPS (two: 32 code bytes a weight column in flight a thread; faster than one at one row an expert, H100), 8
# rows of x a pass.
MMA_WARPS = 4
MMA_STEPS = 2
# 2^126 in both bf16 halves, then the scale: the pair decode gives value x 2^-126, and 2^126 x 2^(code - 127) as one
# factor would overflow bf16 from code 129 up. Where no scale code is over 128, one multiply by that factor
# (``scale_bits(FOLD=True)``) gives the same bits: both round the same exact product once.
_SCALE_ASM = gl.constexpr("{ .reg .b32 c, t; mov.b32 c, 0x7E807E80; mul.rn.bf16x2 t, $1, c; mul.rn.bf16x2 $0, t, $2; }")
_FOLDED_SCALE_ASM = gl.constexpr("mul.rn.bf16x2 $0, $1, $2;")
FOLD_MAX_CODE = gl.constexpr(128)


def mxfp4_mma(x_RI: torch.Tensor, codes_EOH: torch.Tensor, scales_EOB: torch.Tensor, offsets_E: torch.Tensor,
              *, launcher=None) -> torch.Tensor:
    """y_RO [R, O] bf16 = each expert's rows of x_RI (bf16, sorted by expert) times its dequantised MXFP4 weight.
    The arguments are ``mxfp4_grouped_mm``'s, already checked; a CUDA device of compute capability >= 9.0.
    ``launcher``: how to launch the kernel (``launcher(kernel, grid, *args, **kwargs)``; the tests' emulator), by
    default on the GPU."""
    R, I = x_RI.shape
    E, O, _ = codes_EOH.shape
    y_RO = torch.empty(R, O, dtype=torch.bfloat16, device=x_RI.device)
    if R == 0:
        return y_RO
    if x_RI.stride(1) != 1:
        x_RI = x_RI.contiguous()
    words = as_words(codes_EOH)
    grid = ((E + 1) * triton.cdiv(O, 16 * MMA_WARPS),)
    args = (x_RI, x_RI.stride(0), words, words.stride(0), words.stride(1), scales_EOB, scales_EOB.stride(0),
            scales_EOB.stride(1), scales_EOB.stride(2), offsets_E, y_RO, R, O, E)
    kwargs = dict(I=I, C=MMA_STEPS, num_warps=MMA_WARPS)
    if launcher is not None:
        launcher(_mxfp4_mma_kernel, grid, *args, **kwargs)
        return y_RO
    with on_device(x_RI.device):
        _mxfp4_mma_kernel[grid](*args, **kwargs)
    return y_RO


@gluon.constexpr_function
def _x_layout(C, W):
    """x's tile [8, C, 4, 32] as B's fragment wants it: the lane (l, t) holding elements 128 c + 32 t + 0..31 of row
    l in registers, every warp the same (B is shared by the warps, each with its own weight columns)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(5)] + [[0, 1 << i, 0, 0] for i in range(C.bit_length() - 1)],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[0, 0, 0, 0]] * (W.bit_length() - 1), block_bases=[], shape=[8, C, 4, 32])


@gluon.jit
def decode_pair(words, q: gl.constexpr, scale2, FOLD: gl.constexpr = False):
    """Elements q and q + 4 of each int32 word in kernel order (placed by ``mxfp4_dequantize.decode_pair_bits``, the
    Triton kernels' too) decoded into the two bf16 halves of an int32, times their block scale
    (scale2: the scale's bf16 bits in both halves, ``scale_bits`` with the same ``FOLD``), split into a trailing axis
    of 2 (low half first)."""
    pair = decode_pair_bits(words, q)
    pair = gl.inline_asm_elementwise(_FOLDED_SCALE_ASM if FOLD else _SCALE_ASM, "=r,r,r", [pair, scale2],
                                     dtype=gl.int32, is_pure=True, pack=1)
    return gl.join(pair.to(gl.int16).to(gl.bfloat16, bitcast=True),
                   (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True))


@gluon.jit
def expert_tile(off_ptr, R, O, E, BM: gl.constexpr):
    """This program's expert e, its tile of BM weight columns, and the expert's rows start..end: programs are
    (expert, column tile), expert-major, over E + 1 groups (e = E: the rows past the last offset); the offsets are
    clamped to 0..R as read."""
    pid = gl.program_id(0)
    n_tiles = (O + BM - 1) // BM
    e = pid // n_tiles
    start = gl.load(off_ptr + e - 1, mask=e > 0, other=0)
    end = gl.load(off_ptr + e, mask=e < E, other=R)
    start = gl.minimum(gl.maximum(start, 0), R)
    end = gl.minimum(gl.maximum(end, start), R)
    return e, pid % n_tiles, start, end


@gluon.jit
def scale_bits(scodes, FOLD: gl.constexpr = False):
    """E8M0 scale codes -> 2^(code - 127)'s bf16 bits in both halves of an int32 (code 0: the subnormal 2^-127;
    255: NaN); ``FOLD``: 2^126 x 2^(code - 127), for codes up to ``FOLD_MAX_CODE`` only."""
    s = scodes.to(gl.int32)
    if FOLD:
        bits = (s + 126) << 7
    else:
        bits = gl.where(s == 0, 0x0040, s << 7)
        bits = gl.where(s == 255, 0x7FC0, bits)
    return bits | (bits << 16)


@gluon.jit
def _mxfp4_mma_kernel(x_ptr, s_xr, c_ptr, s_ce, s_co, sc_ptr, s_se, s_so, s_sb, off_ptr, y_ptr, R, O, E,
                      I: gl.constexpr, C: gl.constexpr, num_warps: gl.constexpr):
    """Program (expert e, column tile): y[rows of e, cols] = x[rows of e] @ dequantize(W[e])[:, cols], in passes
    of 8 rows, the fp32 accumulator [cols, rows] stored in bf16; zeros for the group e = E (the rows past
    offsets[E - 1])."""
    W: gl.constexpr = num_warps
    BM: gl.constexpr = 16 * W          # weight columns: the MMA's M
    BK: gl.constexpr = 128 * C         # a K step
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    # Code words [W, 2, 8, C, 4, 4]: weight column 16 wp + 8 r + l, word 16 c + 4 t + w of the K step (elements
    # 128 c + 32 t + 8 w + 0..7); lanes (l, t), four words a thread.
    WL: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 1, 4], [1, 1, 8, 1, 4, 1], [W, 1, 1, 1, 1, 1],
                                        [5, 4, 3, 2, 1, 0])
    SL: gl.constexpr = gl.SliceLayout(5, WL)     # scale codes [W, 2, 8, C, 4]: block 4 c + t
    XL: gl.constexpr = _x_layout(C, W)

    e, pid_n, start, end = expert_tile(off_ptr, R, O, E, BM)

    # the weight columns [W, 2, 8] -> the scale pointers [W, 2, 8, 1, 1] and the code pointers [W, 2, 8, 1, 1, 1]
    L3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, SL))
    wp = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    r2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    l8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    cols = pid_n * BM + gl.expand_dims(gl.expand_dims(wp * 16, 1), 2) \
        + gl.expand_dims(gl.expand_dims(r2 * 8, 0), 2) + gl.expand_dims(gl.expand_dims(l8, 0), 1)
    cols = gl.expand_dims(gl.expand_dims(cols, 3), 4)
    live = (cols < O) & (e < E)           # the group past the last offset reads no weights: its rows come out 0
    s_cols = sc_ptr + e.to(gl.int64) * s_se + cols.to(gl.int64) * s_so
    c_cols = c_ptr + e.to(gl.int64) * s_ce + gl.expand_dims(cols.to(gl.int64) * s_co, 5)
    c_live = gl.expand_dims(live, 5)
    # the K step's scale blocks [1, 1, 1, C, 4] and words [1, 1, 1, C, 4, 4]
    cb = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, SL)))))
    tb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, SL)))))
    blocks = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(cb * 4, 0), 1), 2), 4) \
        + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(tb, 0), 1), 2), 3)
    wb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
        3, gl.SliceLayout(4, WL))))))
    word_ix = gl.expand_dims(blocks * 4, 5) \
        + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(wb, 0), 1), 2), 3), 4)

    # x's rows [8, 1, 1, 1] and the K step's elements [1, C, 4, 32]
    xr = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    xc = gl.arange(0, C, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, XL))))
    xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, XL))))
    xj = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, XL))))
    x_k = gl.expand_dims(gl.expand_dims(gl.expand_dims(xc * 128, 0), 2), 3) \
        + gl.expand_dims(gl.expand_dims(gl.expand_dims(xt * 32, 0), 1), 3) \
        + gl.expand_dims(gl.expand_dims(gl.expand_dims(xj, 0), 1), 2)
    x_r = gl.expand_dims(gl.expand_dims(gl.expand_dims(xr, 1), 2), 3)

    out_cols = pid_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, MMA))
    out_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    for r0 in range(start, end, 8):
        x_rows = x_ptr + (r0 + x_r).to(gl.int64) * s_xr
        x_live = (r0 + x_r) < end
        acc = gl.zeros([BM, 8], gl.float32, layout=MMA)
        words = gl.load(c_cols + word_ix, mask=c_live & (word_ix < I // 8), other=0)
        scodes = gl.load(s_cols + blocks * s_sb, mask=live & (blocks < I // 32), other=127)
        for k0 in range(0, I, BK):
            # The next step's codes first (past the end: masked, no traffic), in flight while this one decodes.
            kw = (k0 + BK) // 8 + word_ix
            kb = (k0 + BK) // 32 + blocks
            next_words = gl.load(c_cols + kw, mask=c_live & (kw < I // 8), other=0)
            next_scodes = gl.load(s_cols + kb * s_sb, mask=live & (kb < I // 32), other=127)

            # x, renumbered: element 128 c + 32 t + 8 w + 4 h + q is MMA k index h + 2 t + 8 q + 32 w + 128 c
            x = gl.load(x_rows + (k0 + x_k), mask=x_live & (k0 + x_k < I), other=0.0)
            x = gl.permute(gl.reshape(x, [8, C, 4, 4, 2, 4]), [1, 3, 5, 2, 4, 0])     # [C, w, q, t, h, 8]
            b = gl.convert_layout(gl.reshape(x, [BK, 8]), gl.DotOperandLayout(1, MMA, 2), assert_trivial=True)

            scale2 = gl.broadcast(gl.expand_dims(scale_bits(scodes), 5), words)[0]
            p = gl.join(gl.join(decode_pair(words, 0, scale2), decode_pair(words, 1, scale2)),
                        gl.join(decode_pair(words, 2, scale2), decode_pair(words, 3, scale2)))
            # [W, 2, 8, C, t, w, h, q0, q1] -> [W, 2, 8, C, w, q1, q0, t, h]: the same renumbering
            p = gl.permute(p, [0, 1, 2, 3, 5, 8, 7, 4, 6])
            a = gl.convert_layout(gl.reshape(p, [BM, BK]), A_L, assert_trivial=True)
            acc = mma_v2(a, b, acc)
            words = next_words
            scodes = next_scodes
        rows = r0 + out_rows
        gl.store(y_ptr + gl.expand_dims(rows.to(gl.int64) * O, 0) + gl.expand_dims(out_cols, 1),
                 acc.to(gl.bfloat16), mask=gl.expand_dims(rows < end, 0) & gl.expand_dims(out_cols < O, 1))
