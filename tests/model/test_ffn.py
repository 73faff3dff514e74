import pytest
import torch
import torch.nn.functional as F

import kimik3.model.row_chunks as row_chunks_module
from kimik3.model.ffn import GLUFeedForward, situ_glu, situ_glu_cast, situ_glu_chunked, situ_glu_reference
from tests.numerics import rel_rms


def test_situ_glu_is_bounded_by_100():
    grid = torch.cat([torch.linspace(-1e4, 1e4, 2001), torch.linspace(-30, 30, 601)]).double()
    gate, up = torch.meshgrid(grid, grid, indexing="ij")
    out = situ_glu(gate, up)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 100.0
    assert out.abs().max() > 99.0  # the bound is approached, not just respected trivially


def test_situ_glu_matches_swiglu_to_first_order_near_zero():
    torch.manual_seed(0)
    errors = []
    for scale in (1e-1, 1e-2, 1e-3):
        gate = torch.randn(4096, dtype=torch.float64) * scale
        up = torch.randn(4096, dtype=torch.float64) * scale
        swiglu = F.silu(gate) * up
        rel = ((situ_glu(gate, up) - swiglu).abs() / swiglu.abs().clamp_min(1e-300)).max().item()
        errors.append(rel)
        assert rel < scale  # relative error is second order, so far below the scale itself
    assert errors[0] > errors[1] > errors[2]


def test_glu_feed_forward_shape_and_fp32_activation():
    ffn = GLUFeedForward(16, 32)
    for p in ffn.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 5, 16)
    y = ffn(x)
    assert y.shape == x.shape
    ref = ffn.w_down(situ_glu(ffn.w_gate(x), ffn.w_up(x)))
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("shape, weighted", [((37, 16), True), ((3, 5, 24), False), ((0, 8), True), ((7, 8), True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_situ_glu_matches_the_formula_through_autograd(shape, weighted, dtype, monkeypatch):
    """``situ_glu_chunked`` (the CPU path: row chunks, a hand-written backward) against ``situ_glu_reference``: the
    output and the gate, up and row-weight grads, over several chunks with a partial last (the chunk made small),
    leading dims, no rows, bf16 inputs (fp32 math, each grad in its input's dtype); gates and ups large enough to
    saturate the tanh."""
    monkeypatch.setattr(row_chunks_module, "CHUNK_ELEMENTS", 64)
    gen = torch.Generator().manual_seed(0)
    gate = (3 * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()
    up = (30 * torch.randn(*shape, generator=gen)).to(dtype).requires_grad_()
    rows = gate.numel() // shape[-1]
    weight = torch.rand(rows, generator=gen).requires_grad_() if weighted else None
    grad = torch.randn(*shape, generator=gen).to(dtype)
    wrt = [gate, up] + ([weight] if weighted else [])
    results = []
    for fn in (situ_glu_chunked, situ_glu_reference):
        out = fn(gate, up, weight, None)
        results.append([out, *torch.autograd.grad(out, wrt, grad)])
    for i, (got, ref) in enumerate(zip(*results)):
        assert got.shape == ref.shape and got.dtype == ref.dtype, i
        if ref.numel() and ref.dtype == torch.bfloat16:   # the same fp32 values rounded once: a bf16 step at most
            assert bool(((got.double() - ref.double()).abs() <= ref.double().abs() * 2 ** -7 + 1e-30).all()), i
        elif ref.numel():
            assert rel_rms(ref, got) < 1e-6, (i, rel_rms(ref, got))


def test_situ_glu_cast_takes_the_chunked_path_off_cuda_and_computes_only_the_grads_asked():
    gate, up, weight = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8), torch.rand(4)
    out = situ_glu_cast(gate, up, weight)
    assert type(out.grad_fn).__name__ == "_SituGLUChunkedBackward"
    (d_gate,) = torch.autograd.grad(out, [gate], torch.ones(4, 8))   # up and the weight need none
    (ref,) = torch.autograd.grad(situ_glu_reference(gate, up, weight), [gate], torch.ones(4, 8))
    torch.testing.assert_close(d_gate, ref)
    with torch.no_grad():   # inference: the formula, no saved tensors
        assert torch.equal(situ_glu_cast(gate, up, weight), situ_glu_reference(gate, up, weight))
