"""Tests of the multi-token short conv (kimik3/ops/glue/causal_conv.py: prefill and training, forward and backward)
against its reference, ``short_conv`` run in fp64 with autograd: y, the final state, and the grads of x, the weights
and the state.

W = 4, 2 (and 3 in the gradcheck and the packed sequences at every tile offset); three weights of 16 channels
(KDA's q, k, v) or one [40, W], three of 64 (two channel blocks, the second partial); T = 1, 2 (< W-1: the final
state keeps state columns), 3, 5 and 37 (several token blocks, several a backward program); B = 1, 2 and 3; with
and without a carried state; packed sequences with an empty one (int32 and int64 offsets, and tokens outside the
offsets), and 16 sequences starting at every offset of a token tile; SiLU on and off; fp32, bf16 x with fp32
weights (the model's case) and all bf16; x a column slice of a wider projection and a transposed weight; no
tokens; fp64 gradcheck; the backward's program count (deterministic, the same dx); the input checks.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py).

Legend: B batch, T tokens, C channels, W kernel width.
"""

from __future__ import annotations


import pytest
import torch

from kimik3.model.conv import short_conv
from kimik3.ops.glue.causal_conv import causal_conv, causal_conv_backward, causal_conv_forward
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
CU = [0, 3, 3, 10, 17]  # four packed sequences of 3, 0, 7 and 7 tokens


def make_inputs(B, T, splits, W, x_dtype, w_dtype, state_dtype, seed=0):
    """x [B, T, C], weights [C_i, W] (one per split), state [B, C, W-1] or None, leaves that require grad on DEV."""
    gen = torch.Generator().manual_seed(seed)
    C = sum(splits)
    x = torch.randn(B, T, C, generator=gen).to(DEV, x_dtype).requires_grad_()
    weights = tuple((0.5 * torch.randn(c, W, generator=gen)).to(DEV, w_dtype).requires_grad_() for c in splits)
    state = None
    if state_dtype is not None:
        state = torch.randn(B, C, W - 1, generator=gen).to(DEV, state_dtype).requires_grad_()
    return x, weights, state


def reference(x, weights, state, cu_seqlens, activation, grad_y):
    """[y, final_state, d_x, d_weight_i..., d_state]: ``short_conv`` in fp64 from the same input values, the grads
    by autograd."""
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    s64 = state.detach().double().requires_grad_() if state is not None else None
    y, final = short_conv(x64, torch.cat(w64), s64, cu_seqlens=cu_seqlens, activation=activation)
    leaves = [x64, *w64, *([s64] if s64 is not None else [])]
    return [y, final, *torch.autograd.grad(y, leaves, grad_y.double())]


def run(x, weights, state, cu_seqlens, activation, grad_y):
    """The same list from ``causal_conv`` and autograd through it."""
    y, final = causal_conv(x, weights, state, cu_seqlens, activation)
    leaves = [x, *weights, *([state] if state is not None else [])]
    return [y, final, *torch.autograd.grad(y, leaves, grad_y)]


def assert_close(got, ref, dtype, what, f32_tol=2e-6):
    """got in ``dtype`` against the fp64 reference: fp64 rel_rms under 1e-12, fp32 under f32_tol; bf16 every
    element within one bf16 step of the reference (plus 1e-5 of its rms, for sums that cancel), rel_rms under
    4e-3."""
    assert got.shape == ref.shape and got.dtype == dtype, (what, got.shape, ref.shape, got.dtype, dtype)
    if dtype == F64:
        assert rel_rms(ref, got) < 1e-12, (what, rel_rms(ref, got))
    elif dtype == F32:
        assert rel_rms(ref, got) < f32_tol, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        atol = 1e-5 * float(r.detach().square().mean().sqrt())
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + atol).all()), (what, (g - r).abs().max())
        assert rel_rms(ref, got) < 4e-3, (what, rel_rms(ref, got))


def check(x, weights, state, cu_seqlens, activation, seed=7):
    """causal_conv against the reference: y and the grads close, the final state exact."""
    gen = torch.Generator().manual_seed(seed)
    grad_y = torch.randn(x.shape, generator=gen).to(DEV, x.dtype)
    ref = reference(x, weights, state, cu_seqlens, activation, grad_y)
    got = run(x, weights, state, cu_seqlens, activation, grad_y)
    assert not got[1].requires_grad  # the final state is not differentiable
    fs_dtype = state.dtype if state is not None else x.dtype
    assert got[1].dtype == fs_dtype and torch.equal(got[1], ref[1].to(fs_dtype)), "final state"
    assert_close(got[0], ref[0], x.dtype, "y")
    assert_close(got[2], ref[2], x.dtype, "d_x")
    for i, w in enumerate(weights):
        assert_close(got[3 + i], ref[3 + i], w.dtype, f"d_weights[{i}]", f32_tol=1e-5)
    if state is not None:
        assert_close(got[-1], ref[-1], state.dtype, "d_state")


QKV, ONE, WIDE = (16, 16, 16), (40,), (64, 64, 64)
CASES = [  # x, weights, state dtypes (None: no state); channel splits; W; B; T; activation
    (F32, F32, F32, QKV, 4, 3, 37, True),
    (F32, F32, None, ONE, 4, 1, 37, False),
    (F32, F32, F32, ONE, 4, 3, 2, True),
    (F32, F32, F32, QKV, 4, 1, 1, True),
    (F32, F32, None, QKV, 2, 3, 5, True),
    (F32, F32, F32, ONE, 2, 1, 37, False),
    (BF16, F32, BF16, QKV, 4, 1, 37, True),
    (BF16, F32, None, QKV, 4, 3, 5, True),
    (BF16, BF16, BF16, ONE, 4, 2, 2, True),
    (BF16, BF16, None, ONE, 2, 1, 5, False),
    (BF16, F32, BF16, WIDE, 4, 1, 5, True),
    (F32, F32, None, QKV, 4, 2, 3, True),
]


@needs_kernels
@pytest.mark.parametrize("x_dtype,w_dtype,state_dtype,splits,W,B,T,activation", CASES)
def test_matches_short_conv(x_dtype, w_dtype, state_dtype, splits, W, B, T, activation):
    x, weights, state = make_inputs(B, T, splits, W, x_dtype, w_dtype, state_dtype)
    check(x, weights, state, None, activation)


@needs_kernels
@pytest.mark.parametrize("x_dtype,w_dtype,splits,W,activation,cu_dtype", [
    (F32, F32, QKV, 4, True, torch.int32),
    (F32, F32, ONE, 2, False, torch.int64),
    (BF16, F32, ONE, 4, True, torch.int32),
])
def test_packed_sequences(x_dtype, w_dtype, splits, W, activation, cu_dtype):
    # Tokens of another sequence (the empty one included) count as zeros in y and in every grad.
    x, weights, _ = make_inputs(1, CU[-1], splits, W, x_dtype, w_dtype, None, seed=1)
    check(x, weights, None, torch.tensor(CU, dtype=cu_dtype, device=DEV), activation)


@needs_kernels
@pytest.mark.parametrize("W", [4, 3])
def test_sequence_starts_at_every_tile_offset(W):
    # Sequences of 1, 2, ..., 16 tokens: their starts (the triangular numbers) fall at every offset of the 16-token
    # tiles of d and dw (at 16 of the 32 offsets of dx's tiles), so a tile's taps, and dx's terms past its end,
    # cross a sequence start at every position, the tile's edges included.
    cu = [0]
    for n in range(1, 17):
        cu.append(cu[-1] + n)
    assert len({c % 16 for c in cu[:-1]}) == 16
    x, weights, _ = make_inputs(1, cu[-1], QKV, W, F32, F32, None, seed=9)
    check(x, weights, None, torch.tensor(cu, dtype=torch.int32, device=DEV), True)


@needs_kernels
def test_tokens_outside_the_offsets():
    # short_conv's conventions: the tokens from cu_seqlens[-1] on form one more sequence; those before
    # cu_seqlens[0] (when it is not 0) see no other token.
    x, weights, _ = make_inputs(1, 13, QKV, 4, F32, F32, None, seed=2)
    check(x, weights, None, torch.tensor([2, 4, 4, 9], dtype=torch.int32, device=DEV), True)


@needs_kernels
def test_strided_x_and_transposed_weight():
    # x the middle third (row stride 3 C) of a wider bf16 projection output, the middle weight a transposed view,
    # fp32 weights, a bf16 state: read in place.
    B, T, C, W = 2, 5, 48, 4
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(B, T, 3 * C, generator=gen).to(DEV, BF16).requires_grad_()
    x = wide[..., C:2 * C]
    _, weights, state = make_inputs(B, T, QKV, W, BF16, F32, BF16, seed=4)
    mid = weights[1].detach().t().contiguous().t().requires_grad_()
    weights = (weights[0], mid, weights[2])
    assert x.stride() == (3 * T * C, 3 * C, 1) and mid.stride() == (1, 16)
    check(x, weights, state, None, True)
    # The forward reads x in place: the same y as from a contiguous copy.
    with torch.no_grad():
        y1, f1 = causal_conv_forward(x, weights, state)
        y2, f2 = causal_conv_forward(x.contiguous(), weights, state)
    assert torch.equal(y1, y2) and torch.equal(f1, f2)


@needs_kernels
def test_backward_programs_and_determinism():
    # 2 rows of 2 token blocks (d and dw's tiles, 16 tokens): one program walking the 4 tiles, or 3 programs (the
    # first walks two, from row 0 to row 1); dx does not depend on the programs.
    x, weights, _ = make_inputs(2, 20, QKV, 4, F32, F32, None, seed=5)
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(DEV)
    args = (grad_y, x.detach(), tuple(w.detach() for w in weights), None, None, True)
    dx1, dw1, _ = causal_conv_backward(*args, programs=1)
    dx3, dw3, _ = causal_conv_backward(*args, programs=3)
    again = causal_conv_backward(*args, programs=3)
    assert torch.equal(dx1, dx3)
    for a, b, c in zip(dw1, dw3, again[1]):
        assert rel_rms(a, b) < 1e-6 and torch.equal(b, c)  # another order of the partials; the same one: bitwise


@needs_kernels
def test_no_tokens():
    x, weights, state = make_inputs(2, 0, QKV, 4, F32, F32, F32)
    y, final = causal_conv(x, weights, state)
    assert y.shape == (2, 0, 48) and torch.equal(final, state.detach())
    y, final = causal_conv(x, weights)
    assert final.shape == (2, 48, 3) and not final.any()
    d_x, d_ws, d_state = causal_conv_backward(y, x.detach(), weights, state.detach())
    assert d_x.shape == (2, 0, 48) and not any(d.any() for d in d_ws) and not d_state.any()


@needs_kernels
def test_gradcheck_fp64():
    # W = 3 (a padded tap block), two weights; a state with T = 1 < W-1, then packed sequences.
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 5, 3, generator=gen, dtype=F64).to(DEV).requires_grad_()
    w1 = torch.randn(1, 3, generator=gen, dtype=F64).to(DEV).requires_grad_()
    w2 = torch.randn(2, 3, generator=gen, dtype=F64).to(DEV).requires_grad_()
    state = torch.randn(1, 3, 2, generator=gen, dtype=F64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w1, w2, s: causal_conv(x, (w1, w2), s)[0], (x[:, :1], w1, w2, state),
                                    fast_mode=True)
    cu = torch.tensor([0, 1, 1, 5], device=DEV)
    assert torch.autograd.gradcheck(lambda x, w1, w2: causal_conv(x, (w1, w2), None, cu)[0], (x, w1, w2),
                                    fast_mode=True)


@needs_kernels
def test_bad_inputs_are_named():
    x, ws, state = make_inputs(2, 5, (8, 8, 8), 4, F32, F32, F32)
    x, ws, state = x.detach(), tuple(w.detach() for w in ws), state.detach()
    cu = torch.tensor([0, 2, 5], device=DEV)
    cases = [
        ((x.long(), ws), "x_BTC must be"),
        ((x[0], ws), "x_BTC must be"),
        ((x, ()), "weights must be one tensor"),
        ((x, ws + ws[:1]), "weights must be one tensor"),
        ((x, (ws[0], ws[1].long(), ws[2])), r"weights\[1\] must be"),
        ((x, (ws[0], ws[1][:, :3], ws[2])), "disagree on the kernel width"),
        ((x, ws[:2]), "sum to 16"),
        ((x, (ws[0].to("meta"),) + ws[1:]), r"weights\[0\] is on meta"),
        ((x, tuple(w[:, :1] for w in ws)), "W must be >= 2"),
        ((x, ws, state[..., :2]), r"state_BCW must be \[B=2, C=24, W-1=3\]"),
        ((x, ws, state.long()), "state_BCW must be None or a floating"),
        ((x, ws, state.to("meta")), "state_BCW is on meta"),
        ((x[:1], ws, None, cu.float()), "cu_seqlens must be None or a 1-D int32/int64"),
        ((x[:1], ws, None, cu[None]), "cu_seqlens must be None or a 1-D int32/int64"),
        ((x[:1], ws, None, cu.to("meta")), "cu_seqlens is on meta"),
        ((x, ws, None, cu), "need B = 1"),
        ((x[:1], ws, state[:1], cu), "cannot be combined"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            causal_conv_forward(*args)
        with pytest.raises(ValueError, match=match):
            causal_conv_backward(torch.zeros_like(x) if args[0].ndim == 3 else x, *args)
    with pytest.raises(ValueError, match="grad_y must be"):
        causal_conv_backward(x[:1], x, ws, state)
    with pytest.raises(ValueError, match="grad_y must be"):
        causal_conv_backward(x.long(), x, ws, state)
    with pytest.raises(ValueError, match="programs"):
        causal_conv_backward(x, x, ws, state, programs=0)
