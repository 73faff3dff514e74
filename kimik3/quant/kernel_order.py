"""MXFP4 codes in kernel order: the bits of each 32-bit word (eight E2M1 codes) rearranged so that the GPU kernels
decode a word in nine integer operations where the OCP order takes fifteen.

The OCP order (``quantize``'s, the checkpoints'): code bytes in memory, two elements a byte, the element at the even
index in the low nibble; read four bytes at a time as a little-endian int32 word, element 8j + n (n = 0..7) of the
row is nibble n, bits 4n ... 4n + 3 (m, e0, e1, sign from the lowest: ``s e1 e0 m``).

The kernels decode a word in pairs of elements n and n + 4 (n = 0..3), each into an int32 holding two bf16 bit
patterns: the element's sign at bit 15 (31 for the second), its ``e1 e0 m`` at bits 8..6 (24..22); times 2^126 and
the block scale that is the element's value (``kimik3.ops.moe.mxfp4_dequantize.decode_words``). In the OCP order each
pair takes two shifts and two logic operations. In kernel order the pair's eight bits already sit at those places
(pair 0: one AND), or one shift (pair 1: << 6) or one rotation (pair 3: by 10) away, or two shifts (pair 2: the
mantissa bits >> 4, the rest << 4): nine operations a word. No rearrangement of 32 bits lets all four pairs out with
one shift and one AND each (the four target sets would have to tile the word under rotations, and they cannot).

Only the bits within each word move: a word holds the same eight elements in either order, so the kernels' tiles,
the renumbering of K, and the scales are unchanged. ``to_kernel_order`` / ``to_ocp_order`` convert an ``MXTensor``
(one elementwise pass over the codes, done once when the weights are loaded or saved).
"""

from __future__ import annotations

import dataclasses

import torch

from kimik3.quant.mx import MXTensor

__all__ = ["KERNEL_BITS", "ORDERS", "kernel_codes", "ocp_codes", "to_kernel_order", "to_ocp_order", "to_order"]

ORDERS = ("ocp", "kernel")

# KERNEL_BITS[n]: the word bits that element n's m, e0, e1 and sign take in kernel order (OCP: 4n ... 4n + 3).
KERNEL_BITS = (
    (6, 7, 8, 15), (0, 1, 2, 9), (10, 3, 4, 11), (28, 29, 30, 5),            # elements 0..3: the pairs' low halves
    (22, 23, 24, 31), (16, 17, 18, 25), (26, 19, 20, 27), (12, 13, 14, 21),  # elements 4..7: their high halves
)


def _tables(forward: bool) -> torch.Tensor:
    """The permutation as two lookup tables [2, 65536] int32: what each value of a word's low and high 16 bits
    becomes (OR the two to convert a word)."""
    dst = {}
    for n, bits in enumerate(KERNEL_BITS):
        for b, kernel in enumerate(bits):
            ocp = 4 * n + b
            dst[ocp if forward else kernel] = kernel if forward else ocp
    value = torch.arange(1 << 16, dtype=torch.int64)
    out = torch.zeros(2, 1 << 16, dtype=torch.int64)
    for half in range(2):
        for bit in range(16):
            out[half] |= ((value >> bit) & 1) << dst[16 * half + bit]
    return (out - ((out >> 31) << 32)).to(torch.int32)


_TABLES = {True: _tables(True), False: _tables(False)}
_CHUNK = 1 << 22     # words converted at a time (bounds the temporaries at a few tens of MB)


def _permute(codes: torch.Tensor, forward: bool) -> torch.Tensor:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 4:
        raise ValueError(f"MXFP4 codes must be uint8 with a multiple of 4 bytes along the last axis (whole 32-bit "
                         f"words), got {getattr(codes, 'dtype', type(codes).__name__)} "
                         f"{tuple(getattr(codes, 'shape', ()))}")
    low, high = _TABLES[forward].to(codes.device)
    out = codes.clone(memory_format=torch.contiguous_format)    # (one copy, contiguous, to convert in place)
    words = out.view(torch.int32).view(-1)
    halves = out.view(torch.int16).view(-1, 2)
    for start in range(0, words.numel(), _CHUNK):
        h = halves[start:start + _CHUNK].to(torch.int32) & 0xFFFF
        words[start:start + _CHUNK] = low[h[:, 0]] | high[h[:, 1]]
    return out


def kernel_codes(codes: torch.Tensor) -> torch.Tensor:
    """OCP-order MXFP4 codes (uint8 [..., H], H a multiple of 4) -> the same elements in kernel order (a new
    contiguous tensor of the same shape)."""
    return _permute(codes, True)


def ocp_codes(codes: torch.Tensor) -> torch.Tensor:
    """Kernel-order MXFP4 codes -> OCP order (``kernel_codes``' inverse)."""
    return _permute(codes, False)


def to_kernel_order(mx: MXTensor) -> MXTensor:
    """``mx`` (MXFP4) with its codes in kernel order (itself if they are)."""
    _check(mx)
    return mx if mx.order == "kernel" else dataclasses.replace(mx, codes=kernel_codes(mx.codes), order="kernel")


def to_ocp_order(mx: MXTensor) -> MXTensor:
    """``mx`` with its codes in the OCP order (itself if they are)."""
    if mx.order == "ocp":
        return mx
    _check(mx)
    return dataclasses.replace(mx, codes=ocp_codes(mx.codes), order="ocp")


def to_order(mx: MXTensor, order: str) -> MXTensor:
    """``mx`` with its codes in ``order`` ("ocp" or "kernel")."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return to_kernel_order(mx) if order == "kernel" else to_ocp_order(mx)


def _check(mx: MXTensor) -> None:
    if not isinstance(mx, MXTensor) or mx.fmt != "mxfp4":
        raise ValueError(f"kernel order is an MXFP4 code layout, got {type(mx).__name__}"
                         + (f" of {mx.fmt}" if isinstance(mx, MXTensor) else ""))
