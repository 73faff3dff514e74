"""Tests of the pooled decode step of KDA's short conv (kimik3/ops/glue/short_conv.py) against its reference,
``short_conv`` at T = 1 on the gathered pool rows (computed in fp32), its new states written back to those rows;
and of its verification form (``short_conv_steps``: T tokens, every token's state recorded, the pool untouched)
against T reference steps in a row and against the model's torch path (``kimik3.model.conv.short_conv_steps``).

Three weights (q, k, v) of 64 and 48 channels, two, and one; W = 4, 3 and 2; B = 1 and 5 with distinct slots in a
pool of 8 rows; padding rows (slot -1) that must leave every live row but the batch's alone; x a column slice of a
wider projection and a transposed weight; fp32, bf16 and fp64 inputs and pools, fp32 weights with bf16 x, another
out_dtype; several steps in a row; an empty batch; the input checks; and on a GPU a CUDA graph replay.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py).

Legend: B batch, C channels, W kernel width, P pool rows (the last one the scratch row).
"""

from __future__ import annotations


import pytest
import torch

from kimik3.model.conv import short_conv
from kimik3.model.conv import short_conv_steps as short_conv_steps_torch
from kimik3.ops.glue.short_conv import short_conv_decode, short_conv_steps
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


P = 8  # pool rows: slots 0..6 and the scratch row 7 (slot -1)
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def make_inputs(B, splits, W, x_dtype, w_dtype, pool_dtype, seed=0):
    """x [B, C], weights [C_i, W] (one per split), pool [P, C, W-1], all random on DEV."""
    gen = torch.Generator().manual_seed(seed)
    C = sum(splits)
    x = torch.randn(B, C, generator=gen).to(DEV, x_dtype)
    weights = tuple((0.5 * torch.randn(c, W, generator=gen)).to(DEV, w_dtype) for c in splits)
    pool = torch.randn(P, C, W - 1, generator=gen).to(DEV, pool_dtype)
    return x, weights, pool


def reference(x, weights, pool, slots, activation=True, out_dtype=None):
    """(y in out_dtype or x's, the pool after the step): ``short_conv`` in fp32 (fp64 when any input is) on the
    gathered rows, the new states written back in the pool's dtype (to a copy)."""
    ct = F64 if F64 in (x.dtype, pool.dtype, *(w.dtype for w in weights)) else F32
    weight = torch.cat([w.to(ct) for w in weights])
    y, state = short_conv(x.to(ct)[:, None], weight, pool[slots].to(ct), activation=activation)
    new_pool = pool.clone()
    new_pool[slots] = state.to(pool.dtype)
    return y[:, 0].to(out_dtype or x.dtype), new_pool


def assert_y(got, ref, what="y"):
    """fp32 / fp64: rel_rms under 1e-6 / 1e-12. bf16: every element within one bf16 step of the reference's."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if got.dtype in (F32, F64):
        tol = 1e-12 if got.dtype == F64 else 1e-6
        assert rel_rms(ref, got) < tol, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + 1e-30).all()), (what, (g - r).abs().max())


def step(x, weights, pool, slots, activation=True, out_dtype=None):
    with torch.no_grad():
        return short_conv_decode(x, weights, pool, slots, activation=activation, out_dtype=out_dtype)


CASES = [  # x, weights, pool dtypes; channel splits; W; B; activation; out_dtype
    (F32, F32, F32, (64, 64, 64), 4, 5, True, None),
    (F32, F32, F32, (192,), 4, 1, False, None),
    (BF16, BF16, BF16, (48, 48, 48), 4, 5, True, None),
    (BF16, F32, BF16, (48, 48, 48), 4, 1, True, None),
    (BF16, F32, F32, (64, 64, 64), 2, 5, True, None),
    (F32, BF16, BF16, (144,), 2, 5, True, None),
    (BF16, BF16, BF16, (70, 50), 3, 5, True, F32),
    (F64, F64, F64, (48, 48, 48), 4, 1, True, None),
]


@needs_kernels
@pytest.mark.parametrize("x_dtype,w_dtype,pool_dtype,splits,W,B,activation,out_dtype", CASES)
def test_matches_the_reference(x_dtype, w_dtype, pool_dtype, splits, W, B, activation, out_dtype):
    x, weights, pool = make_inputs(B, splits, W, x_dtype, w_dtype, pool_dtype)
    slots = torch.tensor([3, 0, 6, 5, 1][:B], device=DEV)
    y_ref, pool_ref = reference(x, weights, pool, slots, activation, out_dtype)
    y = step(x, weights, pool, slots, activation, out_dtype)
    assert_y(y, y_ref)
    assert torch.equal(pool, pool_ref)  # the shifted states are copies: exact


@needs_kernels
def test_padding_rows_touch_only_the_scratch_row():
    # Three padding rows (slot -1) among three live ones: the batch's rows advance exactly, every other live row
    # (4 and 6 here) keeps its bits; the scratch row is garbage by contract.
    x, weights, pool = make_inputs(6, (48, 48, 48), 4, BF16, BF16, BF16, seed=1)
    slots = torch.tensor([2, -1, 5, -1, -1, 0], device=DEV)
    y_ref, pool_ref = reference(x, weights, pool, slots)
    before = pool.clone()
    y = step(x, weights, pool, slots)
    live = slots >= 0
    assert_y(y[live], y_ref[live])
    assert torch.equal(pool[:P - 1], pool_ref[:P - 1])
    for row in (1, 3, 4, 6):
        assert torch.equal(pool[row], before[row]), row


@needs_kernels
def test_strided_x_and_weight():
    # x a column slice (row stride 3 C) of a wider projection output, the middle weight a transposed view.
    B, splits, W = 5, (64, 64, 64), 4
    C = sum(splits)
    _, weights, pool = make_inputs(B, splits, W, BF16, F32, BF16, seed=2)
    wide = torch.randn(B, 3 * C, generator=torch.Generator().manual_seed(3)).to(DEV, BF16)
    x = wide[:, C:2 * C]
    weights = (weights[0], weights[1].t().contiguous().t(), weights[2])
    assert x.stride() == (3 * C, 1) and weights[1].stride() == (1, 64)
    slots = torch.tensor([4, 1, 0, 6, 2], device=DEV)
    y_ref, pool_ref = reference(x, weights, pool, slots)
    y = step(x, weights, pool, slots)
    assert_y(y, y_ref)
    assert torch.equal(pool, pool_ref)


@needs_kernels
def test_several_steps_in_a_row():
    # Four decode steps of the same five sequences, batched in a different order each step (and a padding row
    # from the second on), against the reference run step by step on its own pool.
    B, splits, W = 5, (48, 48, 48), 4
    _, weights, pool = make_inputs(B, splits, W, BF16, F32, BF16, seed=4)
    pool_ref = pool.clone()
    gen = torch.Generator().manual_seed(5)
    orders = ([3, 0, 6, 5, 1], [1, 3, 0, 6, 5, -1], [6, -1, 5, 1, 0, 3], [0, 1, 3, 5, 6, -1])
    for t, order in enumerate(orders):
        slots = torch.tensor(order, device=DEV)
        x = torch.randn(len(order), sum(splits), generator=gen).to(DEV, BF16)
        y_ref, pool_ref = reference(x, weights, pool_ref, slots)
        y = step(x, weights, pool, slots)
        live = slots >= 0
        assert_y(y[live], y_ref[live], f"y at step {t}")
        assert torch.equal(pool[:P - 1], pool_ref[:P - 1]), t


@needs_kernels
def test_empty_batch():
    x, weights, pool = make_inputs(0, (8, 8, 8), 4, F32, F32, F32)
    before = pool.clone()
    y = step(x, weights, pool, torch.zeros(0, dtype=torch.int64, device=DEV))
    assert y.shape == (0, 24) and torch.equal(pool, before)


@needs_kernels
def test_bad_inputs_are_named():
    x, ws, pool = make_inputs(2, (8, 8, 8), 4, F32, F32, F32)
    slots = torch.tensor([0, 1], device=DEV)
    cases = [
        ((x.long(), ws, pool, slots), "x_BC must be"),
        ((x[0], ws, pool, slots), "x_BC must be"),
        ((x, (), pool, slots), "1 to 3 tensors \\[C_i, W\\]"),
        ((x, ws + ws[:1], pool, slots), "1 to 3 tensors \\[C_i, W\\]"),
        ((x, (ws[0], ws[1].long(), ws[2]), pool, slots), r"weights\[1\] must be"),
        ((x, (ws[0], ws[1][:, :3], ws[2]), pool, slots), "disagree on the kernel width"),
        ((x, ws[:2], pool, slots), "sum to 16"),
        ((x, (ws[0].to("meta"),) + ws[1:], pool, slots), r"weights\[0\] is on meta"),
        ((x, tuple(w[:, :1] for w in ws), pool[..., :0], slots), "W must be >= 2"),
        ((x, ws, pool[..., :2], slots), r"pool_PCW must be \[P >= 1, C=24, W-1=3\]"),
        ((x, ws, pool[:, :16], slots), "C=24"),
        ((x, ws, pool.long(), slots), "pool_PCW must be a floating"),
        ((x, ws, pool.transpose(1, 2).contiguous().transpose(1, 2), slots), "contiguous"),
        ((x, ws, pool, slots.int()), "slots_B must be a 1-D int64"),
        ((x, ws, pool, slots[:1]), "slots_B has 1 entries"),
        ((x, ws, pool, slots.to("meta")), "slots_B is on meta"),
        ((x, ws, pool.to("meta"), slots), "pool_PCW is on meta"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            step(*args)
    with pytest.raises(ValueError, match="out_dtype"):
        step(x, ws, pool, slots, out_dtype=torch.int32)
    # Forward only: refused while grad mode is on and an input requires grad, accepted under no_grad.
    wg = (ws[0].clone().requires_grad_(),) + ws[1:]
    with pytest.raises(RuntimeError, match="forward only"):
        short_conv_decode(x, wg, pool, slots)
    assert step(x, wg, pool, slots).shape == (2, 24)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    # The engine's use: captured once, replayed with new inputs and slots written into the same tensors.
    B, splits, W = 8, (1024, 1024, 1024), 4
    x, weights, pool = make_inputs(B, splits, W, BF16, BF16, BF16, seed=6)
    slots = torch.tensor([5, -1, 0, 3, -1, 1, 2, 4], device=DEV)
    with torch.inference_mode():
        step(x, weights, pool, slots)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step(x, weights, pool, slots)
        x.copy_(torch.randn_like(x))
        slots.copy_(torch.tensor([2, 6, -1, 0, 1, -1, 5, 3], device=DEV))
        y_ref, pool_ref = reference(x, weights, pool, slots)
        graph.replay()
    live = slots >= 0
    assert_y(y[live], y_ref[live], "replayed y")
    assert torch.equal(pool[:P - 1], pool_ref[:P - 1])


STEPS_CASES = [  # x, weights, pool dtypes; channel splits; W; B; T
    (BF16, BF16, BF16, (48, 48, 48), 4, 3, 4),
    (BF16, F32, F32, (70, 50), 3, 2, 5),     # a pool wider than x: the earlier tokens kept in fp32
    (F32, F32, BF16, (64, 64, 64), 4, 1, 2),  # a narrower pool: the earlier tokens rounded as a decode step does
    (F32, F32, F32, (144,), 2, 4, 1),
    (F64, F64, F64, (24, 24, 24), 4, 2, 3),
]


def steps_reference(x, weights, pool, slots):
    """(y [B, T, C], steps [T, B, C, W-1]): T reference decode steps in a row on a copy of the pool."""
    pool = pool.clone()
    ys, steps = [], []
    for t in range(x.shape[1]):
        y, pool = reference(x[:, t], weights, pool, slots)
        ys.append(y)
        steps.append(pool[slots])
    return torch.stack(ys, dim=1), torch.stack(steps)


@needs_kernels
@pytest.mark.parametrize("x_dtype,w_dtype,pool_dtype,splits,W,B,T", STEPS_CASES)
def test_steps_match_decode_steps_in_a_row(x_dtype, w_dtype, pool_dtype, splits, W, B, T):
    # The verification's tokens computed as T decode steps compute them; the pool only read.
    gen = torch.Generator().manual_seed(7)
    _, weights, pool = make_inputs(B, splits, W, x_dtype, w_dtype, pool_dtype, seed=8)
    x = torch.randn(B, T, sum(splits), generator=gen).to(DEV, x_dtype)
    slots = torch.tensor([5, 0, 3, 1][:B], device=DEV)
    y_ref, steps_ref = steps_reference(x, weights, pool, slots)
    before = pool.clone()
    steps = torch.full((T, B, sum(splits), W - 1), float("nan"), dtype=pool_dtype, device=DEV)
    with torch.no_grad():
        y = short_conv_steps(x, weights, pool, slots, steps)
    assert torch.equal(pool, before)
    assert torch.equal(steps, steps_ref)   # copies of inputs: exact
    for t in range(T):
        assert_y(y[:, t].contiguous(), y_ref[:, t], f"y at token {t}")
    # The model's torch path (the CPU's) records the same states and the same y within the dtype's rounding.
    steps_torch = torch.full_like(steps, float("nan"))
    with torch.no_grad():
        y_torch = short_conv_steps_torch(x, weights, pool, slots, steps_torch, backend="torch")
    assert torch.equal(steps_torch, steps_ref)
    tol = 1e-12 if x_dtype == F64 else 1e-5 if x_dtype == F32 and pool_dtype != BF16 else 1e-2
    assert rel_rms(y_ref.double(), y_torch.double()) < tol


@needs_kernels
def test_steps_strided_x_padding_rows_and_empty():
    # x a column slice of a wider [B, T, 3C] projection; a padding row (slot -1) reads the scratch row and writes
    # only its own steps; no tokens and no rows launch nothing.
    B, T, splits, W = 3, 3, (64, 64, 64), 4
    C = sum(splits)
    _, weights, pool = make_inputs(B, splits, W, BF16, F32, BF16, seed=9)
    wide = torch.randn(B, T, 3 * C, generator=torch.Generator().manual_seed(10)).to(DEV, BF16)
    x = wide[..., C:2 * C]
    slots = torch.tensor([4, -1, 2], device=DEV)
    y_ref, steps_ref = steps_reference(x, weights, pool, slots)
    steps = torch.zeros(T, B, C, W - 1, dtype=BF16, device=DEV)
    with torch.no_grad():
        y = short_conv_steps(x, weights, pool, slots, steps)
    assert torch.equal(steps, steps_ref)
    assert_y(y[[0, 2]].contiguous(), y_ref[[0, 2]])
    with torch.no_grad():
        assert short_conv_steps(x[:0], weights, pool, slots[:0], steps[:, :0]).shape == (0, T, C)
        assert short_conv_steps(x[:, :0], weights, pool, slots, steps[:0]).shape == (B, 0, C)


@needs_kernels
def test_steps_bad_inputs_are_named():
    B, T, W = 2, 3, 4
    _, ws, pool = make_inputs(B, (8, 8, 8), W, F32, F32, F32)
    x = torch.randn(B, T, 24, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    steps = torch.zeros(T, B, 24, W - 1, device=DEV)
    cases = [
        ((x[:, 0], ws, pool, slots, steps), r"x_BTC must be a floating tensor \[B, T, C\]"),
        ((x, ws, pool, slots[:1], steps), "x_BTC has B = 2 rows"),
        ((x, ws, pool, slots, steps[:2]), r"steps_TBCW must be .* \[3, 2, 24, 3\]"),
        ((x, ws, pool, slots, steps.transpose(0, 1).contiguous().transpose(0, 1)), "steps_TBCW must be a contig"),
        ((x, ws, pool, slots, steps.long()), "steps_TBCW must be a contiguous floating"),
        ((x, ws, pool, slots, steps.to("meta")), "steps_TBCW is on meta"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            with torch.no_grad():
                short_conv_steps(*args)
    with pytest.raises(RuntimeError, match="short_conv_steps is forward only"):
        short_conv_steps(x.requires_grad_(), ws, pool, slots, steps)
