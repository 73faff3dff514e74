"""The OCP Microscaling (MX v1.0) formats: MXFP4 (E2M1 elements) and MXFP8 (E4M3 or E5M2 elements).

A block of ``block_size`` (32) consecutive elements along one axis shares one E8M0 scale 2^X. Converting a block V:

    X   = floor(log2(max |V_i|)) - emax_elem, clamped to E8M0's [-127, 127]   (emax_elem: 2, 8, 15)
    P_i = V_i / 2^X rounded to the element format, to nearest with ties to even, saturated to its largest normal
          (6 for E2M1, 448 for E4M3, 57344 for E5M2); results below the smallest normal round onto the subnormals

and the block decodes to 2^X * P_i. An all-zero block takes X = -127 (its elements are zeros whatever X). A block
holding a NaN or an infinity gets the NaN scale (E8M0 code 255) and decodes to NaN entirely, as the specification
has it for a NaN scale; its element codes are then meaningless (zero).

Public:
    fake_quantize(x, fmt, block_size=32, axis=-1)  quantise and decode at once: x's shape and dtype
    quantize(x, fmt, block_size=32, axis=-1)       -> MXTensor: element codes (uint8; MXFP4 packs two a byte,
                                                       the element at the even index in the low nibble) and
                                                       E8M0 scale codes (uint8, one a block)
    dequantize(mx, dtype=torch.float32)            -> the decoded tensor

The arithmetic is exact in fp32 (fp64 for fp64 input): scaling by a power of two is exact down to fp32's
subnormals (2^-126, far below every element format's smallest subnormal, so nothing that survives rounding is
touched), and the rounding step is a power of two. Decoded values overflow only for blocks whose maximum exceeds
2^127.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True)
class ElementFormat:
    """A minifloat element format: exponent and mantissa bits, exponent bias, largest normal."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_normal: float

    @property
    def emax(self) -> int:
        """The exponent of the largest normal (emax_elem of the specification)."""
        return int(torch.tensor(self.max_normal, dtype=torch.float64).frexp()[1]) - 1

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FORMATS: dict[str, ElementFormat] = {
    "mxfp4": ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max_normal=6.0),
    "mxfp8_e4m3": ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_normal=448.0),
    "mxfp8_e5m2": ElementFormat("e5m2", ebits=5, mbits=2, bias=15, max_normal=57344.0),
}


def element_format(fmt: str) -> ElementFormat:
    if fmt not in FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}: one of {sorted(FORMATS)}")
    return FORMATS[fmt]


@dataclass
class MXTensor:
    """Quantised form of a tensor: ``codes`` (uint8; for MXFP4 two elements a byte along the blocked axis, moved
    last), ``scales`` (uint8 E8M0 codes, [..., blocks]), and what decoding needs to restore the shape. ``order``:
    how MXFP4 codes lie in their bytes, "ocp" (the specification's, ``quantize``'s) or "kernel" (the bits of each
    32-bit word rearranged for the GPU kernels: ``kimik3.quant.kernel_order``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: str
    block_size: int
    axis: int
    shape: tuple[int, ...]
    order: str = "ocp"

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def _blocks(x: torch.Tensor, block_size: int, axis: int) -> tuple[torch.Tensor, int]:
    """x with ``axis`` moved last and cut into blocks: [..., n_blocks, block_size] (fp32, fp64 for fp64 x), and
    the axis (>= 0)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not x.is_floating_point():
        raise ValueError(f"MX quantisation takes a floating tensor, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("MX quantisation needs at least one dimension to block along")
    axis = axis % x.ndim
    if x.shape[axis] % block_size:
        raise ValueError(f"the blocked axis {axis} has {x.shape[axis]} elements, not a multiple of the block size "
                         f"{block_size}")
    moved = x.movedim(axis, -1).to(torch.promote_types(x.dtype, torch.float32))
    return moved.reshape(*moved.shape[:-1], -1, block_size), axis


def _shared_exponent(blocks: torch.Tensor, elem: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: X (int64, clamped to [-127, 127]) and whether the block holds a NaN or an infinity."""
    special = (~torch.isfinite(blocks)).any(-1)
    amax = blocks.abs().nan_to_num(0.0, posinf=0.0).amax(-1)
    _, exp = torch.frexp(amax)               # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
    floor_log2 = torch.where(amax > 0, exp.to(torch.int64) - 1, torch.full_like(exp, -10_000, dtype=torch.int64))
    return (floor_log2 - elem.emax).clamp(-E8M0_BIAS, E8M0_BIAS), special


def _round_to_element(q: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """q (already divided by the block scale) rounded to the element format: nearest, ties to even,
    saturated to +-max_normal; subnormals included."""
    mag = q.abs()
    _, exp = torch.frexp(mag)
    e = (exp.to(torch.int64) - 1).clamp(min=elem.min_normal_exp)     # the binade (subnormals share the lowest)
    step = torch.ldexp(torch.ones_like(mag), (e - elem.mbits).to(torch.int32))
    rounded = torch.round(mag / step) * step                          # exact: step is a power of two
    return torch.copysign(rounded.clamp(max=elem.max_normal), q)


def _scaled(x: torch.Tensor, fmt: str, block_size: int, axis: int):
    elem = element_format(fmt)
    blocks, axis = _blocks(x, block_size, axis)
    X, special = _shared_exponent(blocks, elem)
    q = torch.ldexp(blocks.nan_to_num(0.0, posinf=0.0, neginf=0.0), -X[..., None].to(torch.int32))
    return elem, _round_to_element(q, elem), X, special, axis


def fake_quantize(x: torch.Tensor, fmt: str = "mxfp4", block_size: int = BLOCK_SIZE, axis: int = -1) -> torch.Tensor:
    """x quantised to ``fmt`` in blocks of ``block_size`` along ``axis`` and decoded again: same shape and dtype
    (the decoded values are exact in fp32 and bf16 except where the E8M0 scale goes past bf16's exponent range)."""
    _, p, X, special, axis = _scaled(x, fmt, block_size, axis)
    return _decoded(p, X, special, axis, x.dtype)


def _decoded(p: torch.Tensor, X: torch.Tensor, nan_blocks: torch.Tensor, axis: int, dtype: torch.dtype
             ) -> torch.Tensor:
    """Elements p [..., blocks, block_size] times their blocks' 2^X, NaN blocks NaN throughout, the blocked axis put
    back at ``axis``, in ``dtype``."""
    out = torch.ldexp(p, X[..., None].to(torch.int32))
    out = torch.where(nan_blocks[..., None], torch.full_like(out, float("nan")), out)
    return out.reshape(*out.shape[:-2], -1).movedim(-1, axis).to(dtype)


# E2M1 magnitudes by code (sign in bit 3): 0, 0.5 (subnormal), then 1, 1.5, 2, 3, 4, 6.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _encode(p: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """Element codes (uint8) of values already on the element grid."""
    if elem.name == "e2m1":
        table = torch.tensor(_E2M1_VALUES, dtype=p.dtype, device=p.device)
        index = torch.searchsorted(table, p.abs().contiguous())
        return (index | (torch.signbit(p).to(torch.int64) << 3)).to(torch.uint8)
    dtype = torch.float8_e4m3fn if elem.name == "e4m3" else torch.float8_e5m2
    return p.to(dtype).view(torch.uint8)   # exact: p is representable


def _decode(codes: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    if elem.name == "e2m1":
        table = torch.tensor(_E2M1_VALUES, dtype=torch.float64, device=codes.device)
        mag = table[(codes & 7).long()]
        return torch.where((codes & 8) != 0, -mag, mag)
    dtype = torch.float8_e4m3fn if elem.name == "e4m3" else torch.float8_e5m2
    return codes.view(dtype).to(torch.float64)


def quantize(x: torch.Tensor, fmt: str = "mxfp4", block_size: int = BLOCK_SIZE, axis: int = -1) -> MXTensor:
    """x as MX codes and E8M0 scales (see ``MXTensor``)."""
    elem, p, X, special, axis = _scaled(x, fmt, block_size, axis)
    codes = _encode(p, elem).reshape(*p.shape[:-2], -1)
    if elem.bits == 4:
        if codes.shape[-1] % 2:
            raise ValueError(f"MXFP4 packs two elements a byte: the blocked axis needs an even length, got "
                             f"{codes.shape[-1]}")
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.where(special, torch.full_like(X, E8M0_NAN), X + E8M0_BIAS).to(torch.uint8)
    return MXTensor(codes, scales, fmt, block_size, axis, tuple(x.shape))


def dequantize(mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``mx`` encodes, in ``dtype`` (MXFP4 codes in either order)."""
    elem = element_format(mx.fmt)
    codes = mx.codes
    if mx.order != "ocp":
        from kimik3.quant.kernel_order import to_ocp_order   # (it builds on this module)

        codes = to_ocp_order(mx).codes
    if elem.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    p = _decode(codes, elem).reshape(*codes.shape[:-1], -1, mx.block_size)
    return _decoded(p, mx.scales.to(torch.int64) - E8M0_BIAS, mx.scales == E8M0_NAN, mx.axis, dtype)
