import torch
import torch.nn.functional as F

from kimik3.model.ffn import GLUFeedForward, situ_glu


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
