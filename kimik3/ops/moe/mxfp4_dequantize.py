"""MXFP4 expert weights decoded to bf16 on the GPU: ``mxfp4_dequantize(codes_EOH, scales_EOB)`` -> w_EOI, and the
tile decode (``decode_tile``) that both it and ``mxfp4_grouped_mm``'s kernel run in registers.

The weights are ``kimik3.quant.mx.quantize(w_EIO, "mxfp4", axis=-2)``'s: codes [E, O, I/2] (uint8, the element at the
even I index in the low nibble) and scales [E, O, I/32] (uint8 E8M0 codes, 2^(code - 127), 255 = NaN). The output is
[E, O, I] bf16, contiguous: ``w_EOI.transpose(1, 2)`` is the [E, I, O] weight that ``torch._grouped_mm`` takes (its
column-major form), equal bit for bit to ``dequantize(mx, torch.bfloat16)`` (every MXFP4 value times a power of two
is exact in bf16, but for products past bf16's range, which saturate to inf there as here).

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

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, describe, on_device, tl, triton
from kimik3.quant.mx import BLOCK_SIZE

__all__ = ["decode_tile", "mxfp4_dequantize"]

# A program's tile: 64 weight rows x 256 elements (128 code bytes a row: four 32-byte sectors), 4 warps.
BLOCK_N, BLOCK_K, NUM_WARPS = 64, 256, 4


@_jit
def decode_tile(codes, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed codes [BLOCK_N, BLOCK_K / 2] (uint8) and their E8M0 scale codes [BLOCK_N, BLOCK_K / 32] -> the
    decoded weights [BLOCK_N, BLOCK_K] in bf16, exact (element 2j from byte j's low nibble, 2j + 1 from its high
    one).

    An E2M1 nibble ``s e1 e0 m`` is placed into a bf16 bit pattern (sign at bit 15, ``e1 e0 m`` at bits 8..6:
    exponent field e, top mantissa bit m): that bf16 is the element's value times 2^-126, the subnormal code 1 (0.5)
    included, so one exact bf16 multiply by 2^126 gives the value with no select (on sm_90 it compiles to
    ``HMUL2.BF16_V2`` without ``.FTZ``, which keeps subnormals). The block scale 2^(code - 127) is built from its
    bf16 bits and multiplied in bf16, exact (an element has at most two significant bits)."""
    # In int16 (not int32 or via fp16): the fewest instructions an element on sm_90 (~8, for Triton 3.6, from the
    # SASS).
    c = codes.to(tl.int16)
    lo = (((c << 6) & 0x1C0) | ((c << 12) & -0x8000)).to(tl.bfloat16, bitcast=True)
    hi = (((c << 2) & 0x1C0) | ((c << 8) & -0x8000)).to(tl.bfloat16, bitcast=True)
    # 2^(code - 127) from its bf16 bits: the exponent field is the code itself, but for code 0 (2^-127, a bf16
    # subnormal) and code 255 (NaN). Two multiplies, not one by 2^(code - 1): that overflows bf16 from code 129 up.
    s = scales.to(tl.int16)
    bits = tl.where(s == 0, 0x0040, s << 7)
    bits = tl.where(s == 255, 0x7FC0, bits)
    scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    two_126 = tl.full([1, 1, 1], 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)  # (a bf16 literal: interpreter)
    w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K // 32, 32]) * two_126
    return tl.reshape(w * scale[:, :, None], [BLOCK_N, BLOCK_K])


def _check(codes_EOH: torch.Tensor, scales_EOB: torch.Tensor) -> None:
    for name, t in (("codes_EOH", codes_EOH), ("scales_EOB", scales_EOB)):
        if not isinstance(t, torch.Tensor) or t.ndim != 3 or t.dtype != torch.uint8:
            raise ValueError(f"{name} must be a 3-D uint8 tensor, got "
                             f"{describe(t) if isinstance(t, torch.Tensor) else type(t).__name__}")
    E, O, H = codes_EOH.shape
    if H < 1 or (2 * H) % BLOCK_SIZE:
        raise ValueError(f"codes_EOH [E, O, I/2] has {H} bytes a row: MXFP4 needs I = 2 x that a positive multiple of "
                         f"{BLOCK_SIZE}")
    if scales_EOB.shape != (E, O, 2 * H // BLOCK_SIZE):
        raise ValueError(f"scales_EOB must be [E, O, I/32] = {(E, O, 2 * H // BLOCK_SIZE)}, got {describe(scales_EOB)}")
    if scales_EOB.device != codes_EOH.device:
        raise ValueError(f"scales_EOB is on {scales_EOB.device} but codes_EOH on {codes_EOH.device}")


def mxfp4_dequantize(codes_EOH: torch.Tensor, scales_EOB: torch.Tensor) -> torch.Tensor:
    """The MXFP4 weight (codes [E, O, I/2], scales [E, O, I/32], uint8, blocks along I) decoded: w_EOI [E, O, I]
    bf16, contiguous; ``.transpose(1, 2)`` is the [E, I, O] weight. The Triton kernel: CUDA tensors, or CPU ones
    under TRITON_INTERPRET=1. No host sync."""
    _check(codes_EOH, scales_EOB)
    check_triton_device(codes_EOH, "mxfp4_dequantize")
    E, O, H = codes_EOH.shape
    I = 2 * H
    w_EOI = torch.empty(E, O, I, dtype=torch.bfloat16, device=codes_EOH.device)
    if E * O == 0:
        return w_EOI
    block_n = max(16, min(BLOCK_N, triton.next_power_of_2(O)))
    block_k = max(32, min(BLOCK_K, triton.next_power_of_2(I)))
    grid = (triton.cdiv(I, block_k), triton.cdiv(O, block_n), E)
    with on_device(codes_EOH.device):
        _mxfp4_dequantize_kernel[grid](
            codes_EOH, *codes_EOH.stride(), scales_EOB, *scales_EOB.stride(), w_EOI, O, I=I,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS,
        )
    return w_EOI


@_jit
def _mxfp4_dequantize_kernel(c_ptr, s_ce, s_co, s_ch, sc_ptr, s_se, s_so, s_sb, w_ptr, O,
                             I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (K tile, N tile, expert): w[e, cols, ks] decoded from its codes and scales."""
    pid_k, pid_n, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = cols < O
    hs = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    bs = pid_k * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    codes = tl.load(c_ptr + e64 * s_ce + cols.to(tl.int64)[:, None] * s_co + hs[None, :] * s_ch,
                    mask=nmask[:, None] & (hs < I // 2)[None, :], other=0)
    scales = tl.load(sc_ptr + e64 * s_se + cols.to(tl.int64)[:, None] * s_so + bs[None, :] * s_sb,
                     mask=nmask[:, None] & (bs < I // 32)[None, :], other=127)
    w = decode_tile(codes, scales, BLOCK_N, BLOCK_K)
    tl.store(w_ptr + (e64 * O + cols.to(tl.int64)[:, None]) * I + ks[None, :], w,
             mask=nmask[:, None] & (ks < I)[None, :])
