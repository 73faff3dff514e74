"""Tests of the fused RMSNorm (kimik3/ops/glue/rmsnorm.py) against its reference, ``F.rms_norm`` in fp32: forward
and both gradients, fp32 and bf16 inputs, widths that are not powers of two (96, 200), 1, 3 and 130 rows (several row
blocks, and several a backward program with a partial last one); a bf16 weight, strided inputs, no rows, fp64
gradcheck, the module's dispatch, and the input checks.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py).

Legend: B batch, T tokens, D width, R rows.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kimik3.model.norm import RMSNorm
from kimik3.ops.glue import MAX_WIDTH, rms_norm, rms_norm_backward, rms_norm_forward
from kimik3.ops.glue.common import row_chunks
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


def make_norm(D, seed=0, dtype=torch.float32) -> RMSNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(D)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    return norm.to(device=DEV, dtype=dtype)


def make_x(lead, D, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, D, generator=gen) * 3).to(device=DEV, dtype=dtype).requires_grad_()


def reference(norm, x, grad):
    """``F.rms_norm`` in fp32 through autograd (the reference of the module's kernel and of its torch path)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), norm.weight.float(), norm.eps).to(x.dtype)
    return [y, *torch.autograd.grad(y, [x, norm.weight], grad)]


def assert_matches(got, ref, what):
    """fp32: rel_rms under 2e-6. bf16: every element within one bf16 step of the reference's, rel_rms under 2e-3."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if got.dtype == torch.float32:
        assert rel_rms(ref, got) < 2e-6, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + 1e-30).all()), (what, (g - r).abs().max())
        assert rel_rms(ref, got) < 2e-3, (what, rel_rms(ref, got))


CASES = [  # dtype, lead dims (R = their product), D
    (torch.float32, (1, 3), 96),
    (torch.float32, (2, 65), 200),
    (torch.float32, (1,), 200),
    (torch.bfloat16, (130,), 96),
    (torch.bfloat16, (3,), 200),
    (torch.bfloat16, (1, 1), 96),
]


@needs_kernels
@pytest.mark.parametrize("dtype,lead,D", CASES)
def test_forward_and_grads_match_the_module(dtype, lead, D):
    norm = make_norm(D)
    x = make_x(lead, D, dtype)
    grad = torch.randn(*lead, D, generator=torch.Generator().manual_seed(2)).to(device=DEV, dtype=dtype)
    ref = reference(norm, x, grad)
    y = rms_norm(x, norm.weight, norm.eps)
    got = [y, *torch.autograd.grad(y, [x, norm.weight], grad)]
    for g, r, name in zip(got, ref, ("y", "dx", "dweight")):
        assert_matches(g, r, name)


@needs_kernels
def test_bf16_weight_and_strided_input_through_the_module():
    # The model in bf16: a bf16 weight (multiplied in fp32, its grad rounded to bf16), x a column slice (row stride
    # 2 D); the module's dispatch with backend "triton".
    D = 200
    norm = make_norm(D, dtype=torch.bfloat16)
    wide = make_x((2, 5), 2 * D, torch.bfloat16)
    x = wide[..., :D]
    grad = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3)).to(device=DEV, dtype=torch.bfloat16)
    ref = reference(norm, x, grad)
    norm.backend = "triton"
    y = norm(x)
    got = [y, *torch.autograd.grad(y, [x, norm.weight], grad)]
    for g, r, name in zip(got, ref, ("y", "dx", "dweight")):
        assert_matches(g, r, name)


@needs_kernels
def test_no_rows():
    norm = make_norm(8)
    x = make_x((0,), 8, torch.float32)
    y = rms_norm(x, norm.weight, norm.eps)
    dx, dw = torch.autograd.grad(y.sum(), [x, norm.weight])
    assert y.shape == dx.shape == (0, 8) and not dw.any()


@needs_kernels
def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, generator=gen, dtype=torch.float64).to(DEV).requires_grad_()
    w = (1 + 0.3 * torch.randn(7, generator=gen, dtype=torch.float64)).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w), fast_mode=True)


@needs_kernels
def test_backward_programs():
    norm = make_norm(96)
    x = make_x((40,), 96, torch.float32)
    grad = torch.randn(40, 96, generator=torch.Generator().manual_seed(5)).to(DEV)
    args = (x.detach(), norm.weight.detach(), norm.eps, grad)
    dx1, dw1 = rms_norm_backward(*args, programs=1)
    dx3, dw3 = rms_norm_backward(*args, programs=3)
    assert torch.equal(dx1, dx3) and rel_rms(dw1, dw3) < 1e-6


@needs_kernels
def test_row_chunks_past_the_rows_with_eps_zero():
    # 130 rows of D = 256 are 17 row blocks of 8 (the last one of 2 rows); programs=4: 4 programs of 5 blocks, the
    # last one with 2 blocks and 3 past the rows. Those rows are loaded clamped to the last row; with eps = 0 a zero
    # row would give r = inf: nothing of theirs may leak into dw.
    norm = make_norm(256)
    norm.eps = 0.0
    x = make_x((130,), 256, torch.float32)
    grad = torch.randn(130, 256, generator=torch.Generator().manual_seed(6)).to(DEV)
    ref = reference(norm, x, grad)
    dx1, dw1 = rms_norm_backward(x.detach(), norm.weight.detach(), 0.0, grad, programs=1)
    dx4, dw4 = rms_norm_backward(x.detach(), norm.weight.detach(), 0.0, grad, programs=4)
    assert torch.equal(dx1, dx4)
    for got, name in ((dx4, "dx"), (dw1, "dweight"), (dw4, "dweight")):
        assert_matches(got, ref[1] if name == "dx" else ref[2], name)


def test_row_chunks():
    # (ITERS, G): every program has rows, G within [1/2, 1] of the programs asked for (4/5 once ITERS > 8), ITERS
    # above 8 of the form m 2^e with m in 4..7 (few kernel specialisations).
    cpu = torch.device("cpu")
    for row_blocks in (1, 2, 3, 17, 100, 1058, 8192, 8193, 9000, 123457):
        for programs in (1, 2, 3, 264, 396, 1056):
            iters, G = row_chunks(row_blocks, cpu, programs)
            target = min(programs, row_blocks)
            assert (G - 1) * iters < row_blocks <= G * iters, (row_blocks, programs, iters, G)
            assert 2 * G >= target >= G and (iters <= 8 or 5 * G >= 4 * target), (row_blocks, programs, iters, G)
            e = max(0, iters.bit_length() - 3)
            assert iters <= 8 or (iters % (1 << e) == 0 and 4 <= iters >> e <= 7), iters
    assert row_chunks(8192, cpu, 264) == (32, 256)  # the training shape: R = 16384 rows of D = 1024


def test_module_auto_on_cpu_keeps_the_torch_code(monkeypatch):
    import kimik3.model.norm as module

    def boom(*a, **k):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(module, "rms_norm", boom)
    RMSNorm(8)(torch.randn(2, 8))
    with pytest.raises(ValueError, match="backend"):
        norm = RMSNorm(8)
        norm.backend = "fast"
        norm(torch.randn(2, 8))


@needs_kernels
def test_bad_inputs_are_named():
    x, w = torch.randn(2, 8, device=DEV), torch.ones(8, device=DEV)
    cases = [
        ((x.long(), w, 1e-5), "x must be"),
        ((x, torch.ones(9, device=DEV), 1e-5), "weight"),
        ((x, w.long(), 1e-5), "weight must be a floating"),
        ((x, w, torch.tensor(1e-5)), "eps"),
        ((x, w.to("meta"), 1e-5), "weight is on meta"),
        ((torch.randn(1, MAX_WIDTH + 1, device=DEV), torch.ones(MAX_WIDTH + 1, device=DEV), 1e-5), "widths"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            rms_norm_forward(*args)
    with pytest.raises(ValueError, match="grad_y"):
        rms_norm_backward(x, w, 1e-5, torch.zeros(3, 8, device=DEV))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    norm = make_norm(1024, dtype=torch.bfloat16)
    x = make_x((8,), 1024, torch.bfloat16).detach()
    with torch.inference_mode():
        rms_norm(x, norm.weight, norm.eps)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = rms_norm(x, norm.weight, norm.eps)
        x.copy_(torch.randn_like(x))
        graph.replay()
        norm.backend = "torch"
        ref = norm(x)
    assert_matches(y, ref, "replayed y")
