"""Tests of RMSNorm's torch path (``kimik3.model.norm.rms_norm_torch``: torch ops with a hand-written backward, the
CPU's) against ``F.rms_norm`` through autograd: forward and both gradients for fp32, bf16 and fp64 inputs, a bf16
weight, widths that are not powers of two, one row and none, strided input, ``out_dtype``, each gradient alone, fp64
gradcheck; and that the module and KDA's gated output norm take it on a CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimik3.model.norm import RMSNorm, rms_norm_torch
from tests.numerics import rel_rms

EPS = 1e-5


def inputs(lead, D, x_dtype, w_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, D, generator=gen) * 3).to(x_dtype).requires_grad_()
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(w_dtype).requires_grad_()
    grad = torch.randn(*lead, D, generator=gen).to(x_dtype)
    return x, w, grad


def reference(x, w, grad, out_dtype=None):
    ct = torch.float64 if torch.float64 in (x.dtype, w.dtype) else torch.float32
    y = F.rms_norm(x.to(ct), (x.shape[-1],), w.to(ct), EPS).to(out_dtype or x.dtype)
    return [y, *torch.autograd.grad(y, [x, w], grad.to(y.dtype))]


def ours(x, w, grad, out_dtype=None):
    y = rms_norm_torch(x, w, EPS, out_dtype)
    return [y, *torch.autograd.grad(y, [x, w], grad.to(y.dtype))]


def close(got, ref, tol):
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
    assert rel_rms(ref, got) < tol, rel_rms(ref, got)


@pytest.mark.parametrize("x_dtype, w_dtype, lead, D, tol", [
    (torch.float32, torch.float32, (2, 5), 96, 2e-6),
    (torch.float32, torch.float32, (1,), 200, 2e-6),
    (torch.float32, torch.bfloat16, (3, 4), 33, 2e-6),
    (torch.bfloat16, torch.float32, (7,), 96, 4e-3),
    (torch.float64, torch.float32, (2, 3), 17, 1e-12),
])
def test_forward_and_grads_match_f_rms_norm(x_dtype, w_dtype, lead, D, tol):
    x, w, grad = inputs(lead, D, x_dtype, w_dtype)
    for got, ref in zip(ours(x, w, grad), reference(x, w, grad)):
        close(got, ref, tol)


def test_out_dtype_strided_input_and_no_rows():
    x, w, grad = inputs((4, 6), 40, torch.bfloat16)
    for got, ref in zip(ours(x, w, grad, torch.float32), reference(x, w, grad, torch.float32)):
        close(got, ref, 4e-3 if got.dtype == torch.bfloat16 else 2e-6)
    wide = torch.randn(5, 80, requires_grad=True)
    strided = wide[:, ::2]                                  # a column stride of 2
    w = torch.rand(40, requires_grad=True)
    g = torch.randn(5, 40)
    for got, ref in zip(ours(strided, w, g), reference(strided, w, g)):
        close(got, ref, 2e-6)
    empty = torch.randn(0, 8, requires_grad=True)
    y = rms_norm_torch(empty, torch.ones(8, requires_grad=True), EPS)
    y.sum().backward()
    assert y.shape == (0, 8) and empty.grad.shape == (0, 8)


def test_each_gradient_alone():
    x, w, grad = inputs((3,), 24, torch.float32)
    ref = reference(x, w, grad)
    y = rms_norm_torch(x, w.detach(), EPS)
    (gx,) = torch.autograd.grad(y, [x], grad)
    close(gx, ref[1], 2e-6)
    y = rms_norm_torch(x.detach(), w, EPS)
    (gw,) = torch.autograd.grad(y, [w], grad)
    close(gw, ref[2], 2e-6)


def test_gradcheck_fp64():
    x, w, _ = inputs((2, 3), 7, torch.float64, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_torch(a, b, EPS), (x, w))


def test_module_and_gated_output_norm_take_it_on_cpu(monkeypatch):
    import kimik3.model.kda as kda
    import kimik3.model.norm as norm

    calls = []

    def counted(*a, **k):
        calls.append(1)
        return rms_norm_torch(*a, **k)

    monkeypatch.setattr(norm, "rms_norm_torch", counted)
    monkeypatch.setattr(kda, "rms_norm_torch", counted)
    RMSNorm(8)(torch.randn(2, 8))
    o, gate = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    out = kda.gated_output_norm(o, gate, torch.ones(8), EPS, torch.float32)
    assert len(calls) == 2
    expected = F.rms_norm(o, (8,), torch.ones(8), EPS) * torch.sigmoid(gate)
    assert rel_rms(expected, out) < 2e-6
