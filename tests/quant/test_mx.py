"""The MX formats (``kimik3.quant.mx``) against vectors derived by hand from the OCP MX v1.0 rules, and against an
independent implementation: a brute-force nearest-value search over every code of the element format (ties to the
even code), with ml_dtypes' element types for the codes' values."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kimik3.quant import FORMATS, dequantize, fake_quantize, quantize

ML_DTYPES = {"mxfp4": ml_dtypes.float4_e2m1fn, "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
             "mxfp8_e5m2": ml_dtypes.float8_e5m2}


def _block(values, fill=0.0):
    return torch.tensor(list(values) + [fill] * (32 - len(values)), dtype=torch.float32)


def test_mxfp4_hand_vectors_ties_saturation_and_subnormals():
    # max |x| = 6: X = floor(log2 6) - 2 = 0, the elements are rounded as they are.
    x = _block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -0.75, 0.1, -0.0])
    want = _block([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.0, -0.0])
    got = fake_quantize(x, "mxfp4")
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    # max |x| = 7.5: X = 0 still, so 7.5 saturates to 6.
    assert fake_quantize(_block([7.5, 1.0]), "mxfp4")[:2].tolist() == [6.0, 1.0]
    # max |x| = 8: X = 1, every element is divided by 2 first (3 -> 1.5 stays; 2.5 -> 1.25 ties to 1.0;
    # 0.6 -> 0.3, nearer the subnormal 0.5 than 0).
    assert fake_quantize(_block([8.0, 3.0, 2.5, 0.6]), "mxfp4")[:4].tolist() == [8.0, 3.0, 2.0, 1.0]
    mx = quantize(_block([8.0, 3.0, 2.5, 0.6]), "mxfp4")
    assert mx.scales.tolist() == [128]                       # E8M0 code of 2^1
    # codes 4.0 -> 0b0110, 1.5 -> 0b0011, 1.0 -> 0b0010, 0.5 -> 0b0001; the even element in the low nibble
    assert mx.codes[:2].tolist() == [0x36, 0x12]


def test_mxfp8_hand_vectors():
    # E4M3, max 448 (X = 0): 2^-10 ties between 0 and the smallest subnormal 2^-9 -> 0 (even code);
    # 3 * 2^-10 ties between 2^-9 and 2^-8 -> 2^-8; 464 ties between 448 and 480 (NaN code): saturated 448.
    x = _block([448.0, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, 464.0])
    assert fake_quantize(x, "mxfp8_e4m3")[:5].tolist() == [448.0, 0.0, 2.0 ** -8, 16.0, 448.0]
    # E5M2: max 57344 = 1.75 * 2^15 (X = 0); two mantissa bits: 4.5 ties between 4 and 5 -> 4 (even), 5.5 between
    # 5 and 6 -> 6, 9 between 8 and 10 -> 8; 2^-17 ties between 0 and the smallest subnormal 2^-16 -> 0.
    x = _block([57344.0, 4.5, 5.5, 9.0, 2.0 ** -17])
    assert fake_quantize(x, "mxfp8_e5m2")[:5].tolist() == [57344.0, 4.0, 6.0, 8.0, 0.0]
    # A block of small values: max 2^-20 -> X = -20 - 8 = -28 for E4M3, the elements keep 4 significant bits.
    x = _block([2.0 ** -20, 1.0625 * 2.0 ** -21])
    assert fake_quantize(x, "mxfp8_e4m3")[:2].tolist() == [2.0 ** -20, 1.0 * 2.0 ** -21]
    assert quantize(x, "mxfp8_e4m3").scales.tolist() == [127 - 28]


def test_zero_nan_inf_and_clamped_scales():
    zeros = torch.zeros(32)
    mx = quantize(zeros, "mxfp4")
    assert mx.scales.tolist() == [0] and torch.equal(dequantize(mx), zeros)
    for special in (float("nan"), float("inf"), -float("inf")):
        x = _block([1.0, special])
        for fmt in FORMATS:
            out = fake_quantize(x, fmt)
            assert torch.isnan(out).all(), fmt             # a NaN scale decodes the whole block to NaN
            assert quantize(x, fmt).scales.tolist() == [255]
    # Scales clamp to E8M0's range: a block of 2^-140 (fp32 subnormals) takes X = -127.
    tiny = _block([2.0 ** -140, 2.0 ** -141])
    assert quantize(tiny, "mxfp4").scales.tolist() == [0]
    assert fake_quantize(tiny, "mxfp8_e4m3")[:2].tolist() == [0.0, 0.0]   # below 2^-127 * 2^-9


def _grid(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative value of the element format, ascending (one zero), with its code: ml_dtypes'
    decoding of each code for the 8-bit formats, the E2M1 definition (checked against ml_dtypes) for MXFP4."""
    dtype = ML_DTYPES[fmt]
    bits = 4 if fmt == "mxfp4" else 8
    codes = np.arange(2 ** bits, dtype=np.uint8)
    if bits == 8:
        vals = codes.view(dtype).astype(np.float64)
    else:   # no 4-bit view of a byte in numpy
        vals = np.array([_e2m1_value(c) for c in range(16)], dtype=np.float64)
        assert np.array_equal(vals.astype(dtype).astype(np.float64), vals)
    keep = np.isfinite(vals) & (np.signbit(vals) == 0)
    grid, grid_codes = vals[keep], codes[keep]
    order = np.argsort(grid, kind="stable")
    grid, first = np.unique(grid[order], return_index=True)
    return grid, grid_codes[order][first]


def _reference(x: np.ndarray, fmt: str, block: int = 32) -> np.ndarray:
    """Independent: per block the scale by the rule, then the nearest of every value the element format has (ties
    to the even code), found by search over ``_grid``."""
    grid, grid_codes = _grid(fmt)
    emax = int(np.frexp(grid[-1])[1]) - 1
    xb = x.astype(np.float64).reshape(-1, block)
    amax = np.abs(xb).max(1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))), -1000)
    X = np.clip(e - emax, -127, 127)
    q = np.abs(xb) * np.exp2(-X)[:, None]
    hi = np.clip(np.searchsorted(grid, q), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = q - grid[lo], grid[hi] - q
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (grid_codes[hi] % 2 == 0))
    r = np.where(q >= grid[-1], grid[-1], np.where(pick_hi, grid[hi], grid[lo]))
    return (np.copysign(r, xb) * np.exp2(X)[:, None]).reshape(x.shape)


def _tie_blocks(fmt: str, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` values in blocks of 32 whose first element is the format's largest normal (X = 0 before scaling)
    and the rest midpoints between neighbouring element values (every tie the format has), each block scaled by a
    random power of two and the elements given random signs."""
    grid = torch.from_numpy(_grid(fmt)[0])
    mids = (grid[1:] + grid[:-1]) / 2
    picks = mids[torch.randint(0, len(mids), (count // 32, 31), generator=gen)]
    blocks = torch.cat([torch.full((count // 32, 1), FORMATS[fmt].max_normal, dtype=torch.float64), picks], 1)
    signs = torch.where(torch.rand(blocks.shape, generator=gen) < 0.5, -1.0, 1.0).double()
    scale = torch.exp2(torch.randint(-20, 20, (count // 32, 1), generator=gen).double())
    return (blocks * signs * scale).flatten().float()


def _e2m1_value(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_million_random_values_match_the_independent_reference(fmt):
    gen = torch.Generator().manual_seed(hash(fmt) % 2**31)
    n = 2 ** 20
    # Magnitudes over many binades, exact grid points and their midpoints (ties), zeros, and blocks whose maximum
    # sits just under a power of two (their elements saturate after rounding).
    mag = torch.exp2(torch.randn(n, generator=gen, dtype=torch.float64) * 6).float()
    x = mag * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    x[n // 4: n // 2] = _tie_blocks(fmt, n // 4, gen)
    x[n // 2: n // 2 + 4096] = 0.0
    x[n // 2 + 4096: n // 2 + 8192: 32] = 2.0 ** 5 * (2 - 2.0 ** -20)
    ours = fake_quantize(x, fmt).double().numpy()
    ref = _reference(x.numpy(), fmt)
    mismatch = ~((ours == ref) | (np.isnan(ours) & np.isnan(ref)))
    assert not mismatch.any(), (fmt, x.numpy()[mismatch][:5], ours[mismatch][:5], ref[mismatch][:5])
    # Element codes agree with ml_dtypes' encoding of the same (already representable) elements (8-bit formats).
    if fmt != "mxfp4":
        mx = quantize(x, fmt)
        p = dequantize(mx, torch.float64).view(-1, 32) / torch.exp2(mx.scales.double() - 127)[:, None]
        assert np.array_equal(p.numpy().astype(ML_DTYPES[fmt]).view(np.uint8).reshape(-1), mx.codes.numpy())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_shapes_axes_and_packing(fmt, dtype):
    x = torch.randn(3, 64, 5, dtype=dtype)
    mx = quantize(x, fmt, axis=1)
    assert mx.scales.shape == (3, 5, 2)
    assert mx.codes.shape == (3, 5, 32 if fmt == "mxfp4" else 64)   # two E2M1 codes a byte
    back = dequantize(mx, dtype)
    assert back.shape == x.shape and back.dtype == dtype
    assert torch.equal(back, fake_quantize(x, fmt, axis=1))
    assert torch.equal(fake_quantize(back, fmt, axis=1), back)   # idempotent
    assert mx.nbytes < x.numel() * x.element_size()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown MX format 'fp4'"):
        fake_quantize(torch.zeros(32), "fp4")
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        fake_quantize(torch.zeros(3, 40))
    with pytest.raises(ValueError, match="floating tensor"):
        quantize(torch.zeros(32, dtype=torch.int64))
