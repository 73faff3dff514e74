"""MXFP4 expert weights decoded to bf16 on the GPU: ``mxfp4_dequantize(w)`` -> w_EOI, and the tile decode
(``decode_words``) that both it and ``mxfp4_grouped_mm``'s kernels run in registers.

The weights are ``to_kernel_order(quantize(w_EIO, "mxfp4", axis=-2))``: codes [E, O, I/2] (uint8, two elements a
byte, each 32-bit word's bits in kernel order: ``kimik3.quant.kernel_order``) and scales [E, O, I/32] (uint8 E8M0
codes, 2^(code - 127), 255 = NaN), i.e. blocks along I, the reduction axis. The output is [E, O, I] bf16,
contiguous: ``w_EOI.transpose(1, 2)`` is the [E, I, O] weight that ``torch._grouped_mm`` takes (its column-major
form), equal bit for bit to ``dequantize(w, torch.bfloat16)`` (every MXFP4 value times a power of two is exact in
bf16, but for products past bf16's range, which saturate to inf there as here).

What it is for: at prefill sizes (hundreds of rows an expert) a matmul that decodes its weight tiles in registers
decodes each of them once per row tile, and its bf16 dot runs at half the tensor cores' rate behind the decode
(BENCHMARKS.md, "MXFP4"). Decoding the weights once (reads 4.25 bits and writes 16 an element: on K3's eight local
experts of 3,584 x 3,072, 47 MB in and 176 MB out) and calling the bf16 grouped GEMM costs one pass over the
weights in bf16 on top of the GEMM, which at 2,048 rows an expert is a small share of it.

Triton kernel (CUDA; CPU tensors under TRITON_INTERPRET=1 for the tests): a program decodes a [BLOCK_N, BLOCK_K] tile
of one expert. The shapes alone fix the grid (no host sync: capturable in a CUDA graph).

Legend: E experts, O out features (rows of a weight here), I in features (the reduction axis of the matmul), H = I/2
code bytes a row, B = I/32 scale blocks a row.
"""

from __future__ import annotations

from typing import Any

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, describe, on_device, tl, triton
from kimik3.quant.kernel_order import ORDERS
from kimik3.quant.mx import BLOCK_SIZE, MXTensor

__all__ = ["as_words", "check_mxfp4_weight", "decode_words", "mxfp4_dequantize", "permute_words"]

# A program's tile: 64 weight rows x 256 elements (128 code bytes a row: four 32-byte sectors), 4 warps.
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 256, 4


@_jit
def _halves(pair):
    """An int32 holding two bf16 bit patterns -> (the low one, the high one) as bf16."""
    return (pair.to(tl.int16).to(tl.bfloat16, bitcast=True),
            (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))


@_jit
def permute_words(t, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] with each run of 8 columns reordered by reversing the 3 bits of its index (column 8j + f <->
    8j + rev3(f)): the order ``decode_words`` gives the elements in, and back (the permutation is its own inverse).
    A register-level reshuffle."""
    return tl.reshape(tl.permute(tl.reshape(t, [ROWS, COLS // 8, 2, 2, 2]), [0, 1, 4, 3, 2]), [ROWS, COLS])


@_jit
def decode_words(words, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed codes as int32 words [BLOCK_N, BLOCK_K / 8] in kernel order (eight E2M1 codes a word, elements 8j ...
    8j + 7 of the row: ``kimik3.quant.kernel_order``) and their E8M0 scale codes [BLOCK_N, BLOCK_K / 32] -> the
    decoded weights [BLOCK_N, BLOCK_K] in bf16, exact, with column 8j + f holding element 8j + rev3(f)
    (``permute_words`` puts them in order; a matmul can permute its other operand instead).

    Elements n and n + 4 of a word decode as a pair into the two bf16 halves of an int32: each element's sign at bit
    15 of its half and its ``e1 e0 m`` at bits 8..6 (exponent field e, top mantissa bit m). That bf16 is the
    element's value times 2^-126, the subnormal code 1 (0.5) included, so one exact bf16 multiply by 2^126 gives the
    value with no select (on sm_90 ``HMUL2.BF16_V2`` without ``.FTZ``, which keeps subnormals). Kernel order puts a
    pair's eight bits there with at most two shifts and two logic operations (``decode_pair_bits``). The block scale
    2^(code - 127) is built from its bf16 bits (code 0: the subnormal 2^-127; 255: NaN) and multiplied in bf16,
    exact (an element has at most two significant bits)."""
    a_lo, a_hi = _halves(decode_pair_bits(words, 0))
    b_lo, b_hi = _halves(decode_pair_bits(words, 1))
    c_lo, c_hi = _halves(decode_pair_bits(words, 2))
    d_lo, d_hi = _halves(decode_pair_bits(words, 3))
    # join's new axis is the last: [.., q0, q1, q2] holds nibble q0 + 2 q1 + 4 q2 at flat index 4 q0 + 2 q1 + q2.
    t = tl.join(tl.join(tl.join(a_lo, b_lo), tl.join(c_lo, d_lo)), tl.join(tl.join(a_hi, b_hi), tl.join(c_hi, d_hi)))
    # 2^(code - 127) from its bf16 bits: the exponent field is the code itself, but for code 0 (2^-127, a bf16
    # subnormal) and code 255 (NaN). Two multiplies, not one by 2^(code - 1): that overflows bf16 from code 129 up.
    s = scales.to(tl.int16)
    bits = tl.where(s == 0, 0x0040, s << 7)
    bits = tl.where(s == 255, 0x7FC0, bits)
    scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    two_126 = tl.full([1, 1, 1], 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)  # (a bf16 literal: interpreter)
    w = tl.reshape(t, [BLOCK_N, BLOCK_K // 32, 32]) * two_126   # a word's 8 elements lie in one 32-element block
    return tl.reshape(w * scale[:, :, None], [BLOCK_N, BLOCK_K])


@_jit
def decode_pair_bits(words, q: tl.constexpr):
    """Elements q and q + 4 of each kernel-order int32 word placed into the two bf16 halves of an int32 (sign at bits
    15 / 31, ``e1 e0 m`` at 8..6 / 24..22: value x 2^-126): the bits ``kimik3.quant.kernel_order.KERNEL_BITS``
    gives them moved by one AND, a shift, two shifts or a rotation (ptxas makes the last a funnel shift). Also the
    Gluon kernels' (``mxfp4_mma.decode_pair``)."""
    if q == 0:
        pair = words & -0x7E3F7E40                                               # 0x81C081C0 as int32
    elif q == 1:
        pair = (words << 6) & -0x7E3F7E40
    elif q == 2:
        pair = ((words << 4) & -0x7E7F7E80) | ((words >> 4) & 0x00400040)        # 0x81808180: all but m, then m
    else:
        pair = ((words << 10) | ((words >> 22) & 0x3FF)) & -0x7E3F7E40            # rotated left by 10
    return pair


def as_words(codes_EOH: torch.Tensor) -> torch.Tensor:
    """The uint8 codes [E, O, H] as int32 words [E, O, H/4] (a view; a fresh contiguous copy first when the bytes
    of a row are not contiguous and 4-byte aligned). H is a multiple of 16 for MXFP4 (I a multiple of 32)."""
    if codes_EOH.stride(-1) != 1 or codes_EOH.storage_offset() % 4 or any(s % 4 for s in codes_EOH.stride()[:-1]):
        codes_EOH = codes_EOH.clone(memory_format=torch.contiguous_format)
    return codes_EOH.view(torch.int32)


def check_mxfp4_weight(w: Any, I: int | None = None, order: str | None = None) -> None:
    """ValueError naming the problem unless ``w`` is an MXFP4 ``MXTensor`` of expert weights [E, I, O] blocked along
    I (codes [E, O, I/2] and scales [E, O, I/32], uint8, on one device; I a positive multiple of 32). ``I``: the in
    features it must have (e.g. the activations'); ``order``: the code order it must be in."""
    if not isinstance(w, MXTensor):
        raise ValueError(f"the weight must be an MXTensor (kimik3.quant.quantize(w_EIO, 'mxfp4', axis=-2)), got "
                         f"{type(w).__name__}")
    if w.fmt != "mxfp4" or w.block_size != BLOCK_SIZE:
        raise ValueError(f"the weight must be MXFP4 in blocks of {BLOCK_SIZE}, got {w.fmt} in blocks of "
                         f"{w.block_size}")
    if w.order not in ORDERS or (order is not None and w.order != order):
        raise ValueError(f"the weight's codes are in {w.order!r} order; the GPU kernels read them in kernel order: "
                         f"convert once with kimik3.quant.to_kernel_order(w)" if order == "kernel" else
                         f"the weight's code order must be one of {ORDERS}, got {w.order!r}")
    codes_EOH, scales_EOB = w.codes, w.scales
    for name, t, what in (("codes", codes_EOH, "[E, O, I/2] (packed E2M1 codes)"),
                          ("scales", scales_EOB, "[E, O, I/32] (E8M0 codes)")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"the weight's {name} must be a tensor, got {type(t).__name__}")
        if t.ndim != 3 or t.dtype != torch.uint8:
            raise ValueError(f"the weight's {name} must be a 3-D uint8 tensor {what}, got {describe(t)}")
    E, O, H = codes_EOH.shape
    if w.axis % 3 != 1 or tuple(w.shape) != (E, 2 * H, O):
        raise ValueError(f"the weight must be [E, I, O] blocked along I (axis 1, quantize(w_EIO, 'mxfp4', axis=-2)): "
                         f"its codes are {tuple(codes_EOH.shape)} and it says shape {tuple(w.shape)}, axis {w.axis}")
    if I is None and (H < 1 or (2 * H) % BLOCK_SIZE):
        raise ValueError(f"the weight's codes [E, O, I/2] have {H} bytes a row: MXFP4 needs I = 2 x that a positive "
                         f"multiple of {BLOCK_SIZE}")
    if I is not None and H * 2 != I:
        raise ValueError(f"the weight's codes [E, O, I/2] have {H} bytes a row, but x_RI has I = {I} features "
                         f"(I/2 = {I // 2})")
    if scales_EOB.shape != (E, O, 2 * H // BLOCK_SIZE):
        raise ValueError(f"the weight's scales must be [E, O, I/32] = {(E, O, 2 * H // BLOCK_SIZE)}, got "
                         f"{describe(scales_EOB)}")
    if scales_EOB.device != codes_EOH.device:
        raise ValueError(f"the weight's scales are on {scales_EOB.device} but its codes on {codes_EOH.device}")


def mxfp4_dequantize(w: MXTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The MXFP4 weight ``w`` [E, I, O] (blocks along I, codes in kernel order) decoded: w_EOI [E, O, I] bf16,
    contiguous; ``.transpose(1, 2)`` is the [E, I, O] weight. ``out``: a bf16 [E, O, I] tensor of any strides to
    write into instead (e.g. the transpose of an [E, I, O] buffer: the row-major weight a bf16 GEMM reads fastest),
    returned. The Triton kernel: CUDA tensors, or CPU ones under TRITON_INTERPRET=1. No host sync."""
    check_mxfp4_weight(w, order="kernel")
    codes_EOH, scales_EOB = w.codes, w.scales
    check_triton_device(codes_EOH, "mxfp4_dequantize")
    E, O, H = codes_EOH.shape
    I = 2 * H
    if out is None:
        w_EOI = torch.empty(E, O, I, dtype=torch.bfloat16, device=codes_EOH.device)
    elif not isinstance(out, torch.Tensor) or out.shape != (E, O, I) or out.dtype != torch.bfloat16 \
            or out.device != codes_EOH.device:
        raise ValueError(f"out must be a bf16 tensor [E, O, I] = {(E, O, I)} on {codes_EOH.device}, got "
                         f"{describe(out)}")
    else:
        w_EOI = out
    if E * O == 0:
        return w_EOI
    words = as_words(codes_EOH)
    block_n = max(16, min(BLOCK_N, triton.next_power_of_2(O)))
    block_k = max(32, min(BLOCK_K, triton.next_power_of_2(I)))
    grid = (triton.cdiv(I, block_k), triton.cdiv(O, block_n), E)
    with on_device(codes_EOH.device):
        _mxfp4_dequantize_kernel[grid](
            words, *words.stride()[:2], scales_EOB, *scales_EOB.stride(), w_EOI, *w_EOI.stride(), O, I=I,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS,
        )
    return w_EOI


@_jit
def _mxfp4_dequantize_kernel(c_ptr, s_ce, s_co, sc_ptr, s_se, s_so, s_sb, w_ptr, s_we, s_wo, s_wi, O,
                             I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (K tile, N tile, expert): w[e, cols, ks] decoded from its code words and scales (w at any strides:
    Triton specialises a unit stride, and a store along O is made coalesced through shared memory)."""
    pid_k, pid_n, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < O
    ws = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    bs = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    words = tl.load(c_ptr + e64 * s_ce + cols.to(tl.int64)[:, None] * s_co + ws[None, :],
                    mask=nmask[:, None] & (ws < I // 8)[None, :], other=0)
    scales = tl.load(sc_ptr + e64 * s_se + cols.to(tl.int64)[:, None] * s_so + bs[None, :] * s_sb,
                     mask=nmask[:, None] & (bs < I // 32)[None, :], other=127)
    w = permute_words(decode_words(words, scales, BLOCK_N, BLOCK_K), BLOCK_N, BLOCK_K)
    tl.store(w_ptr + e64 * s_we + cols.to(tl.int64)[:, None] * s_wo + ks.to(tl.int64)[None, :] * s_wi, w,
             mask=nmask[:, None] & (ks < I)[None, :])
