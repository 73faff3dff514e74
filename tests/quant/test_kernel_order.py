"""Tests of MXFP4 codes in kernel order (kimik3/quant/kernel_order.py): the bit layout is a permutation of each
word, it converts both ways, every pair of elements is one AND / shift / two shifts / rotation away from its bf16
placement, and the MXTensor conversions keep the values. The kernels that read the order are tested bit for bit in
tests/ops (every E2M1 code under many scales)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kimik3.quant import dequantize, quantize, to_kernel_order, to_ocp_order
from kimik3.quant.kernel_order import KERNEL_BITS, kernel_codes, ocp_codes, to_order

MASK32 = 0xFFFFFFFF


def test_kernel_bits_permute_the_word():
    assert sorted(b for bits in KERNEL_BITS for b in bits) == list(range(32))


def every_word_codes() -> torch.Tensor:
    """[2, 3, 4 * 300] uint8: every byte value at every byte of a word, and random words."""
    gen = torch.Generator().manual_seed(0)
    walk = torch.arange(256, dtype=torch.uint8).repeat_interleave(4)
    walk = torch.stack([walk.roll(i) for i in range(4)]).flatten()
    rand = torch.randint(0, 256, (2 * 3 * 4 * 300 - walk.numel(),), dtype=torch.uint8, generator=gen)
    return torch.cat([walk, rand]).reshape(2, 3, 4 * 300)


def test_conversions_are_inverse_and_move_each_bit_where_kernel_bits_says():
    codes = every_word_codes()
    kernel = kernel_codes(codes)
    assert kernel.shape == codes.shape and kernel.dtype == torch.uint8
    assert torch.equal(ocp_codes(kernel), codes)
    assert not torch.equal(kernel, codes)
    ocp_words = codes.view(torch.int32).to(torch.int64) & MASK32
    kernel_words = kernel.view(torch.int32).to(torch.int64) & MASK32
    for n, bits in enumerate(KERNEL_BITS):
        for b, bit in enumerate(bits):
            assert torch.equal((ocp_words >> (4 * n + b)) & 1, (kernel_words >> bit) & 1), (n, b)
    # strided and chunked input: the same result
    wide = torch.zeros(2, 3, 2 * 4 * 300, dtype=torch.uint8)
    wide[:, :, ::2] = codes
    assert torch.equal(kernel_codes(wide[:, :, ::2]), kernel)


def test_the_kernels_pair_decode_places_each_pair():
    """The decode the kernels run (``decode_pair_bits``: AND; << 6; << 4 and >> 4; a rotation by 10), transcribed
    on int64 words in kernel order, gives for elements q and q + 4 their bf16 placement: sign at bit 15 / 31,
    ``e1 e0 m`` at bits 8..6 / 24..22 (as read off the OCP nibbles)."""
    codes = every_word_codes()
    ocp = codes.view(torch.int32).to(torch.int64) & MASK32
    w = kernel_codes(codes).view(torch.int32).to(torch.int64) & MASK32
    p = 0x81C081C0
    decoded = [w & p, (w << 6) & p, ((w << 4) & 0x81808180) | ((w >> 4) & 0x00400040),
               (((w << 10) | (w >> 22)) & MASK32) & p]
    for q in range(4):
        lo, hi = (ocp >> (4 * q)) & 0xF, (ocp >> (4 * q + 16)) & 0xF
        want = ((lo & 8) << 12) | ((lo & 7) << 6) | ((hi & 8) << 28) | ((hi & 7) << 22)
        assert torch.equal(decoded[q] & MASK32, want), q


def test_mxtensor_conversions_keep_the_values():
    w = torch.randn(3, 64, 8) * torch.exp2(torch.randint(-4, 5, (3, 1, 8)).float())
    mx = quantize(w, "mxfp4", axis=-2)
    assert mx.order == "ocp"
    kernel = to_kernel_order(mx)
    assert kernel.order == "kernel" and kernel.scales is mx.scales and kernel.shape == mx.shape
    assert torch.equal(dequantize(kernel), dequantize(mx))
    assert to_kernel_order(kernel) is kernel and to_ocp_order(mx) is mx
    assert torch.equal(to_ocp_order(kernel).codes, mx.codes)
    assert to_order(mx, "kernel").order == "kernel" and to_order(kernel, "ocp").order == "ocp"


def test_bad_inputs_are_named():
    mx = quantize(torch.randn(2, 64, 4), "mxfp4", axis=-2)
    with pytest.raises(ValueError, match="kernel order is an MXFP4 code layout, got MXTensor of mxfp8_e4m3"):
        to_kernel_order(quantize(torch.randn(2, 64), "mxfp8_e4m3"))
    with pytest.raises(ValueError, match="got Tensor"):
        to_kernel_order(mx.codes)
    with pytest.raises(ValueError, match="order must be one of"):
        to_order(mx, "le")
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        kernel_codes(torch.zeros(3, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        ocp_codes(torch.zeros(3, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        to_kernel_order(dataclasses.replace(mx, codes=mx.codes[..., :2]))
