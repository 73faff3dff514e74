"""Tests of the packed expert matmuls' input rows (kimik3/ops/moe/mxfp8_rows.py): the Triton kernels against the
unfused torch ops they replace, bit for bit.

``expert_rows_mxfp8`` = ``fake_quantize(x[order // K], "mxfp8_e4m3")``, ``situ_glu_mxfp8`` =
``fake_quantize(situ_glu_cast(gate, up, w, dtype), "mxfp8_e4m3")``, each optionally in the MMA's k order
(``mma_k_order_reference``: the permutation written out in torch, padded to whole 128-element steps), and
``renumber_k`` = the permutation alone. Inputs cover every binade a bf16 holds (2^-133 to 2^127: blocks whose
scale clamps at 2^-127, subnormal bf16 values, saturation), zero blocks and signed zeros, ties, infinities and NaN
(their blocks NaN), widths that are not a multiple of the 128-element step and strided inputs.
"""

from __future__ import annotations

import pytest
import torch

from kimik3.ops.moe import mxfp8_rows as mr
from kimik3.quant.mx import fake_quantize
from tests.kernel_testing import DEV, interpreter_setup, needs_kernels  # noqa: F401

pytestmark = needs_kernels


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal bit for bit where the reference is a number (signed zeros included), NaN where it is NaN."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan), f"{int((out.isnan() != nan).sum())} NaN positions differ"
    bits = torch.int16 if ref.element_size() == 2 else torch.int32
    differ = (out.view(bits) != ref.view(bits)) & ~nan
    if differ.any():
        i = differ.nonzero()[0].tolist()
        raise AssertionError(f"{int(differ.sum())} elements differ, e.g. at {i}: {out[tuple(i)].item()!r} against "
                             f"{ref[tuple(i)].item()!r}")


def awkward(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows over every bf16 binade (a scale a block), with a zero block, signed zeros, ties and saturation, an
    infinity and a NaN, and blocks of subnormal values."""
    gen = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-133, 120, (rows, width // 32, 1), generator=gen).float()
    x = (torch.randn(rows, width // 32, 32, generator=gen) * scale).reshape(rows, width)
    x[0, :32] = 0.0
    x[0, 3] = -0.0
    if rows > 1:
        # a block of max 464 (scale 2^0): 448 and 464 saturate or tie to 448, 1 + 1/16 ties to 1, 1 + 3/16 to 1.25
        x[1, :8] = torch.tensor([464.0, 448.0, 480.0, 1.0625, 1.1875, -1.0625, 3.0, -0.0])
    if rows > 2 and width > 64:
        x[2, 40] = float("inf")
        x[2, 70] = float("nan")
    if rows > 3:
        x[3, -32:] = torch.randn(32, generator=gen) * 2.0 ** -130      # bf16 subnormals, scale 2^-127
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("T, I, top_k", [(5, 32, 1), (9, 416, 2), (3, 96, 3), (17, 256, 2)])
@pytest.mark.parametrize("mma_order", [False, True])
def test_expert_rows_match_fake_quantize(T, I, top_k, mma_order):
    x = awkward(T, I, torch.bfloat16)
    order = torch.randperm(T * top_k, generator=torch.Generator().manual_seed(T)).to(DEV)
    out = mr.expert_rows_mxfp8(x, order, top_k, mma_order=mma_order)
    ref = fake_quantize(x[order // top_k], "mxfp8_e4m3")
    assert_same_bits(out, mr.mma_k_order_reference(ref) if mma_order else ref)


def test_expert_rows_fp32_strided_and_int32_order():
    x = awkward(6, 288, torch.float32)[:, 32:]              # a row stride of 288, width 256
    order = torch.tensor([5, 0, 3, 3, 1], dtype=torch.int32, device=DEV)
    assert_same_bits(mr.expert_rows_mxfp8(x, order, 1), fake_quantize(x[order.long()], "mxfp8_e4m3"))


def test_expert_rows_none():
    out = mr.expert_rows_mxfp8(awkward(2, 64, torch.bfloat16), torch.zeros(0, dtype=torch.long, device=DEV), 2,
                               mma_order=True)
    assert out.shape == (0, 128)


@pytest.mark.parametrize("R, F", [(20, 320), (3, 32), (33, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mma_order", [False, True])
def test_situ_glu_matches_unfused(R, F, dtype, mma_order):
    """The halves of one [R, 2F] output read in place; gate and up over the activation's whole range."""
    from kimik3.model.ffn import situ_glu_cast

    gen = torch.Generator().manual_seed(R + F)
    gate_up = (torch.randn(R, 2 * F, generator=gen) * torch.tensor([4.0, 40.0]).repeat_interleave(F)).to(dtype)
    gate_up[0, :32] = 0.0
    gate_up = gate_up.to(DEV)
    w = torch.rand(R, generator=gen).to(DEV)
    gate, up = gate_up[:, :F], gate_up[:, F:]
    out = mr.situ_glu_mxfp8(gate, up, w, mma_order=mma_order)
    ref = fake_quantize(situ_glu_cast(gate, up, w, dtype), "mxfp8_e4m3")
    assert_same_bits(out, mr.mma_k_order_reference(ref) if mma_order else ref)


@pytest.mark.parametrize("R, I", [(1, 32), (17, 96), (33, 384), (5, 416)])
@pytest.mark.parametrize("strided", [False, True])
def test_renumber_k(R, I, strided):
    """The permutation alone: each 128-element step in the MMA's k order, zeros past I."""
    x = awkward(R, I + 64, torch.bfloat16)[:, 32:32 + I] if strided else awkward(R, I, torch.bfloat16)
    assert_same_bits(mr.renumber_k(x), mr.mma_k_order_reference(x))


def test_mma_order_reference_is_the_decode_order():
    """Column 128 c + h + 2 t + 8 q + 32 w holds element 128 c + 32 t + 8 w + 4 h + q."""
    x = torch.arange(256, dtype=torch.float32)[None]
    out = mr.mma_k_order_reference(x)[0]
    for c, h, t, q, w in [(0, 0, 0, 0, 0), (0, 1, 2, 3, 1), (1, 1, 3, 0, 3), (1, 0, 1, 2, 2)]:
        assert out[128 * c + h + 2 * t + 8 * q + 32 * w] == 128 * c + 32 * t + 8 * w + 4 * h + q


def test_bad_inputs_are_named():
    x = awkward(4, 64, torch.bfloat16)
    order = torch.arange(4, device=DEV)
    with pytest.raises(ValueError, match="multiple of 32"):
        mr.expert_rows_mxfp8(x[:, :48], order, 1)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        mr.expert_rows_mxfp8(x.half(), order, 1)
    with pytest.raises(ValueError, match="order_R"):
        mr.expert_rows_mxfp8(x, order.float(), 1)
    with pytest.raises(ValueError, match="top_k"):
        mr.expert_rows_mxfp8(x, order, 0)
    with pytest.raises(ValueError, match="up_RF"):
        mr.situ_glu_mxfp8(x, x[:, :32], torch.ones(4, device=DEV))
    with pytest.raises(ValueError, match="row_weight_R"):
        mr.situ_glu_mxfp8(x, x, torch.ones(3, device=DEV))
