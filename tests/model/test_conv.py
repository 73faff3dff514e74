"""The short convolution's CPU path (``short_conv_torch``: the reference's math, a hand-written backward) against
the reference ``short_conv`` through autograd: outputs, new states and every gradient (inputs, weight, carried
state), with and without the SiLU, a carried state, packed sequences, fewer tokens than the kernel is wide, no
tokens, bf16, and an fp64 gradcheck; and the KDA layer's choice of it off CUDA.

Legend: B batch, T tokens, C channels, W kernel width.
"""

from __future__ import annotations

import pytest
import torch

from kimik3.model.conv import apply_short_conv, short_conv, short_conv_torch
from tests.numerics import rel_rms


def _case(B, T, C, W, state, packed, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(C, W, generator=gen).to(dtype).requires_grad_()
    st = torch.randn(B, C, W - 1, generator=gen).to(dtype).requires_grad_() if state else None
    cu = torch.tensor([0, 1, T // 2, T]) if packed else None
    grads = (torch.randn(B, T, C, generator=gen).to(dtype), torch.randn(B, C, W - 1, generator=gen).to(dtype))
    return x, weight, st, cu, grads


def _run(fn, x, weight, st, cu, grads, activation):
    y, new_state = fn(x, weight, st, cu, activation)
    wrt = [x, weight] + ([st] if st is not None else [])
    return [y, new_state, *torch.autograd.grad((y, new_state), wrt, grads)]


@pytest.mark.parametrize("B, T, C, W, state, packed", [
    (2, 17, 5, 4, True, False),    # a carried state (chunked prefill)
    (1, 20, 7, 4, False, True),    # packed sequences: no tap reaches into the previous sequence
    (3, 2, 6, 4, True, False),     # fewer tokens than the kernel is wide: the taps read the state
    (2, 9, 3, 3, False, False),
    (2, 0, 3, 4, True, False),     # no tokens: the new state is the state
])
@pytest.mark.parametrize("activation", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hand_written_short_conv_matches_the_reference(B, T, C, W, state, packed, activation, dtype):
    case = _case(B, T, C, W, state, packed, dtype)
    got = _run(short_conv_torch, *case, activation)
    ref = _run(short_conv, *case, activation)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, i
        if r.numel() == 0:
            continue
        # fp32: the same sums, the in-place accumulation rounding its products once; bf16: within a few bf16 steps
        # of the reference's separately rounded products and sums, at the tensor's scale
        assert rel_rms(r, g) < (1e-6 if dtype == torch.float32 else 1e-2), (i, rel_rms(r, g))


def test_the_hand_written_short_conv_passes_gradcheck():
    gen = torch.Generator().manual_seed(1)
    x, weight, st = (torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
                     for shape in ((2, 6, 3), (3, 4), (2, 3, 3)))
    assert torch.autograd.gradcheck(lambda a, b, c: short_conv_torch(a, b, c), (x, weight, st))
    packed = x[:1].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: short_conv_torch(a, b, None, torch.tensor([0, 2, 6]), False),
                                    (packed, weight))


def test_the_layer_takes_the_hand_written_path_off_cuda_and_checks_its_arguments():
    x = torch.randn(1, 5, 6, requires_grad=True)
    weights = [torch.randn(2, 4, requires_grad=True) for _ in range(3)]
    y, _ = apply_short_conv(x, weights)
    assert type(y.grad_fn).__name__ == "_ShortConvTorchBackward"
    with pytest.raises(ValueError, match="cannot be combined"):
        short_conv_torch(x, torch.cat(weights), torch.zeros(1, 6, 3), torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="channels"):
        short_conv_torch(x, torch.randn(5, 4))
