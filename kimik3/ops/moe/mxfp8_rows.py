"""The packed expert matmuls' input rows: MXFP8 (E4M3) values, written in the order the matmul kernel reads.

A quantisation-aware expert layer (``kimik3.quant.qat``) feeds each expert matmul its input fake-quantised to MXFP8
E4M3 in 32-element blocks along the reduction axis: ``expert_input(x)``. In packed serving these inputs are made by
one Triton kernel each, in the pass that produces the rows anyway:

- ``expert_rows_mxfp8(x_TL, order_R, top_k)``: the gate and up matmuls' rows, x_TL[order_R // top_k] (the MoE's
  gather of tokens into expert-sorted rows, ``to_expert_rows``) fake-quantised;
- ``situ_glu_mxfp8(gate_RF, up_RF, row_weight_R)``: the down matmul's rows, the SiTU-GLU of the gate and up outputs
  times the mixture weight, cast to the rows' dtype (``situ_glu_cast``), fake-quantised.

Unfused, each is a gather or the SiTU-GLU kernel plus a dozen torch launches of ``fake_quantize``; the values are
the same bit for bit (the fake quantisation below is ``kimik3.quant.mx``'s arithmetic: exact in fp32, ties to even,
saturation at 448, NaN blocks NaN throughout; the SiTU-GLU is ``kimik3.ops.glue.situ``'s).

With ``mma_order`` the rows are also written in the k order of ``mxfp4_wgmma``'s MMA, each 128-element step
permuted (column 128 c + h + 2 t + 8 q + 32 w holds element 128 c + 32 t + 8 w + 4 h + q) and zero-padded to a
whole step: the Hopper kernel then reads them by TMA with no pass of its own (``renumber_k``, the permutation
alone, serves rows made elsewhere).

Legend: T tokens, K experts a token, R = T K rows (sorted by expert), I the row width (the matmul's reduction axis,
a multiple of 32), F the hidden width.
"""

from __future__ import annotations

import torch

from kimik3.ops.glue.common import _jit, check_triton_device, describe, on_device, tl, triton
from kimik3.ops.glue.situ import _sigmoid_parts, _tanh_sech2
from kimik3.quant.mx import BLOCK_SIZE

__all__ = ["MMA_STEP", "expert_rows_mxfp8", "mma_k_order_reference", "mma_width", "renumber_k", "situ_glu_mxfp8"]

MMA_STEP = 128     # the K step whose elements the MMA order permutes
# The rows kernel's tile (expert_rows_mxfp8, renumber_k): 16 rows x 2 steps (256 elements), 4 warps (renumber_k at
# x.clone()'s speed, H100).
BLOCK_R, STEPS, WARPS = 16, 2, 4
# The SiTU-GLU kernel's: 8 rows x 1 step, 4 warps. Its arithmetic is issue-bound (~100 instructions an element), so
# smaller programs fill the SMs better, and a decode batch gets more of them (14 rows: 48 against 12 at 16 x 2):
# 1.15-1.24x faster at 448-7,168 rows, 2.1-2.5x at 14-112 (H100, benchmarks/NOTES-quant.md).
GLU_BLOCK_R, GLU_STEPS, GLU_WARPS = 8, 1, 4


def mma_width(I: int) -> int:
    """The width of rows of width ``I`` written in the MMA's order: whole 128-element steps."""
    return -(-I // MMA_STEP) * MMA_STEP


def mma_k_order_reference(x_RI: torch.Tensor) -> torch.Tensor:
    """x [R, I] in the MMA's k order (the module docstring), zero-padded to ``mma_width(I)``: the permutation in
    torch (the tests' reference)."""
    R, I = x_RI.shape
    steps = mma_width(I) // MMA_STEP
    padded = x_RI.new_zeros(R, steps * MMA_STEP)
    padded[:, :I] = x_RI
    k = torch.arange(MMA_STEP, device=x_RI.device)      # MMA k = h + 2 t + 8 q + 32 w <- 32 t + 8 w + 4 h + q
    h, t, q, w = k % 2, (k // 2) % 4, (k // 8) % 4, k // 32
    source = (torch.arange(steps, device=x_RI.device)[:, None] * MMA_STEP + (32 * t + 8 * w + 4 * h + q)).flatten()
    return padded[:, source]


def _check_rows(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D tensor [rows, width], got {describe(x)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be bf16 or fp32, got {x.dtype}")
    if x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"{name} has width {x.shape[1]}: MXFP8 blocks need a multiple of {BLOCK_SIZE}")


def renumber_k(x_RI: torch.Tensor) -> torch.Tensor:
    """x [R, I] (any strides) -> [R, mma_width(I)] in the MMA's k order, zeros past I, values unchanged: one pass
    over x, as long as a copy of it."""
    R, I = x_RI.shape
    out = torch.empty(R, mma_width(I), dtype=x_RI.dtype, device=x_RI.device)
    if R == 0:
        return out
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(out.shape[1], MMA_STEP * STEPS))
    with on_device(x_RI.device):
        _rows_kernel[grid](x_RI, x_RI.stride(0), x_RI.stride(1), x_RI, out, R, I, out.shape[1], TOP_K=1,
                           GATHER=False, QUANT=False, MMA=True, BLOCK_R=BLOCK_R, C=STEPS,
                           num_warps=WARPS)
    return out


def expert_rows_mxfp8(x_TI: torch.Tensor, order_R: torch.Tensor, top_k: int, *,
                      mma_order: bool = False) -> torch.Tensor:
    """Rows ``expert_input(x_TI[order_R // top_k])`` [R, I] in x's dtype, or [R, mma_width(I)] in the MMA's order
    with ``mma_order``, in one kernel (CUDA, or CPU under TRITON_INTERPRET=1). x_TI [T, I] bf16 or fp32 (I a
    multiple of 32, any strides); order_R: int64 or int32 [R = T top_k], the flat (token, slot) index of each
    row."""
    _check_rows(x_TI, "x_TI")
    if not isinstance(order_R, torch.Tensor) or order_R.ndim != 1 or order_R.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"order_R must be a 1-D int32 or int64 tensor, got {describe(order_R)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if order_R.device != x_TI.device:
        raise ValueError(f"order_R is on {order_R.device} but x_TI on {x_TI.device}")
    check_triton_device(x_TI, "expert_rows_mxfp8")
    R, I = order_R.shape[0], x_TI.shape[1]
    out = torch.empty(R, mma_width(I) if mma_order else I, dtype=x_TI.dtype, device=x_TI.device)
    if R == 0:
        return out
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(out.shape[1], MMA_STEP * STEPS))
    with on_device(x_TI.device):
        _rows_kernel[grid](x_TI, x_TI.stride(0), x_TI.stride(1), order_R, out, R, I, out.shape[1],
                           TOP_K=top_k, GATHER=True, QUANT=True, MMA=mma_order,
                           BLOCK_R=BLOCK_R, C=STEPS, num_warps=WARPS)
    return out


def situ_glu_mxfp8(gate_RF: torch.Tensor, up_RF: torch.Tensor, row_weight_R: torch.Tensor, *,
                   mma_order: bool = False) -> torch.Tensor:
    """``expert_input(situ_glu_cast(gate, up, row_weight))`` [R, F] in gate's dtype, or [R, mma_width(F)] in the
    MMA's order with ``mma_order``, in one kernel: the down matmul's rows. gate_RF, up_RF [R, F] bf16 or fp32 (F a
    multiple of 32, unit stride along F: the two halves of one [R, 2F] output are read in place); row_weight_R
    [R] (any float dtype and stride; fp32 as the MoE gives it)."""
    _check_rows(gate_RF, "gate_RF")
    if not isinstance(up_RF, torch.Tensor) or up_RF.shape != gate_RF.shape or up_RF.dtype != gate_RF.dtype:
        raise ValueError(f"up_RF must match gate_RF {tuple(gate_RF.shape)} {gate_RF.dtype}, got {describe(up_RF)}")
    R, F = gate_RF.shape
    if not isinstance(row_weight_R, torch.Tensor) or row_weight_R.shape != (R,):
        raise ValueError(f"row_weight_R must be a 1-D tensor [R={R}], got {describe(row_weight_R)}")
    if len({gate_RF.device, up_RF.device, row_weight_R.device}) != 1:
        raise ValueError(f"gate_RF, up_RF and row_weight_R must share a device, got {gate_RF.device}, "
                         f"{up_RF.device} and {row_weight_R.device}")
    check_triton_device(gate_RF, "situ_glu_mxfp8")
    if gate_RF.stride(1) != 1 or up_RF.stride(1) != 1:
        gate_RF, up_RF = gate_RF.contiguous(), up_RF.contiguous()
    out = torch.empty(R, mma_width(F) if mma_order else F, dtype=gate_RF.dtype, device=gate_RF.device)
    if R == 0:
        return out
    grid = (triton.cdiv(R, GLU_BLOCK_R), triton.cdiv(out.shape[1], MMA_STEP * GLU_STEPS))
    with on_device(gate_RF.device):
        _situ_glu_mxfp8_kernel[grid](gate_RF, gate_RF.stride(0), up_RF, up_RF.stride(0),
                                     row_weight_R, row_weight_R.stride(0), out, R, F, out.shape[1],
                                     MMA=mma_order, BLOCK_R=GLU_BLOCK_R, C=GLU_STEPS, num_warps=GLU_WARPS)
    return out


@_jit
def _fake_mxfp8_e4m3(v, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """v fp32 [BLOCK_R, 32 NB] -> its MXFP8 E4M3 fake quantisation (fp32), blocks of 32 along the columns, as
    ``kimik3.quant.mx`` computes it: X = floor(log2 max|v|) - 8 clamped to [-127, 127] (-127 for an all-zero
    block), elements v 2^-X rounded to 3 mantissa bits (binades below 2^-6 share its step: the subnormals) with ties
    to even, saturated to 448, times 2^X; the sign kept (zeros too); a block with a NaN or an infinity all NaN. Powers
    of two are built from their bits, so every product is exact."""
    b = tl.reshape(v, [BLOCK_R, NB, 32])
    a = tl.abs(b)
    finite = a < float("inf")                                           # (NaN compares false)
    special = tl.max(tl.where(finite, 0, 1), axis=2)
    amax = tl.max(tl.where(finite, a, 0.0), axis=2)
    amax_exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF           # biased; 0 for zero and subnormals
    X = tl.minimum(tl.maximum(amax_exp - 135, -127), 127)              # floor(log2 amax) - 8, clamped
    q = tl.where(finite, a, 0.0) * ((127 - X) << 23).to(tl.float32, bitcast=True)[:, :, None]    # |v| 2^-X
    e = tl.maximum(((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)                       # q's binade
    n = q * ((130 - e) << 23).to(tl.float32, bitcast=True)              # q / 2^(e - 3), under 16
    n = (n + 8388608.0) - 8388608.0                                     # to an integer, ties to even (n < 2^23)
    p = tl.minimum(n * ((124 + e) << 23).to(tl.float32, bitcast=True), 448.0)
    two_x = tl.where(X > -127, (X + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)     # 2^X (2^-127 subnormal)
    out = (p * two_x[:, :, None]).to(tl.int32, bitcast=True) | (b.to(tl.int32, bitcast=True) & -2147483648)
    out = tl.where(special[:, :, None] > 0, 0x7FC00000, out)            # torch's NaN
    return tl.reshape(out.to(tl.float32, bitcast=True), [BLOCK_R, NB * 32])


@_jit
def _mma_k_order(v, BLOCK_R: tl.constexpr, C: tl.constexpr):
    """A [BLOCK_R, 128 C] tile's steps in the MMA's k order: each step's axes [t, w, h, q] permuted to [w, q, t, h]
    (in registers)."""
    return tl.reshape(tl.permute(tl.reshape(v, [BLOCK_R, C, 4, 4, 2, 4]), [0, 1, 3, 5, 2, 4]), [BLOCK_R, 128 * C])


@_jit
def _rows_kernel(x_ptr, s_xt, s_xi, order_ptr, y_ptr, R, I, I_out, TOP_K: tl.constexpr, GATHER: tl.constexpr,
                 QUANT: tl.constexpr, MMA: tl.constexpr, BLOCK_R: tl.constexpr, C: tl.constexpr):
    """Program (BLOCK_R rows, 128 C columns): rows x[order[r] // TOP_K] (GATHER) or x[r], fake-quantised (QUANT),
    permuted (MMA), stored contiguous [R, I_out] (zeros past I)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * 128 * C + tl.arange(0, 128 * C)
    if GATHER:
        src = (tl.load(order_ptr + r, mask=r < R, other=0) // TOP_K).to(tl.int64)
    else:
        src = r.to(tl.int64)
    v = tl.load(x_ptr + src[:, None] * s_xt + k.to(tl.int64)[None, :] * s_xi, mask=(r < R)[:, None] & (k < I)[None, :],
                other=0.0)
    if QUANT:
        v = _fake_mxfp8_e4m3(v.to(tl.float32), BLOCK_R, 4 * C).to(y_ptr.dtype.element_ty)
    if MMA:
        v = _mma_k_order(v, BLOCK_R, C)
    tl.store(y_ptr + r.to(tl.int64)[:, None] * I_out + k[None, :], v, mask=(r < R)[:, None] & (k < I_out)[None, :])


@_jit
def _situ_glu_mxfp8_kernel(g_ptr, s_g, u_ptr, s_u, w_ptr, s_w, y_ptr, R, F, F_out, MMA: tl.constexpr,
                           BLOCK_R: tl.constexpr, C: tl.constexpr):
    """Program (BLOCK_R rows, 128 C columns): h = (4 tanh(g/4) sigmoid(g)) (25 tanh(u/25)) w[row] in fp32 (the
    SiTU-GLU kernel's arithmetic), rounded to y's dtype, fake-quantised, permuted (MMA), stored [R, F_out]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * 128 * C + tl.arange(0, 128 * C)
    rows = r.to(tl.int64)
    mask = (r < R)[:, None] & (k < F)[None, :]
    g = tl.load(g_ptr + rows[:, None] * s_g + k[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * s_u + k[None, :], mask=mask, other=0.0).to(tl.float32)
    tg, _ = _tanh_sech2(g * 0.25, False)
    tu, _ = _tanh_sech2(u / 25.0, False)
    s, _ = _sigmoid_parts(g)
    w = tl.load(w_ptr + rows * s_w, mask=r < R, other=0.0).to(tl.float32)
    h = (((4.0 * tg * s) * (25.0 * tu)) * w[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
    v = _fake_mxfp8_e4m3(h, BLOCK_R, 4 * C).to(y_ptr.dtype.element_ty)
    if MMA:
        v = _mma_k_order(v, BLOCK_R, C)
    tl.store(y_ptr + rows[:, None] * F_out + k[None, :], v, mask=(r < R)[:, None] & (k < F_out)[None, :])
