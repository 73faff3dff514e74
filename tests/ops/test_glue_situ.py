"""Tests of the fused SiTU-GLU (kimik3/ops/glue/situ.py) against its reference, the model's torch code
(``ffn.situ_glu`` of the fp32 inputs, times the row weight, cast): forward and the gate, up and row-weight
gradients, fp32 and bf16 inputs, with and without a row weight, widths 100 and 384 (not powers of two), 1, 3 and
130 rows (several row blocks); rows walked in several column tiles (a small BLOCK_F_MAX), the halves of one
projection output read in place, a strided row weight and grad_out, saturating magnitudes (|x| up to 200, and
1e4), the tanh against torch's, no rows, fp64 gradcheck, and the input checks.

The gradients' reference is the same torch code run in fp64: torch's fp32 autograd of tanh and sigmoid
(1 - y^2 and y (1 - y) of the rounded outputs) loses the relative precision the kernel keeps where they saturate.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py).

Legend: F width, R rows.
"""

from __future__ import annotations


import pytest
import torch

from kimik3.model.ffn import situ_glu as situ_glu_ref
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


if HAS_KERNELS:
    import kimik3.ops.glue.situ as situ
    from kimik3.ops.glue.situ import _tanh_sech2, situ_glu, situ_glu_backward, situ_glu_forward


def randn(*shape, scale=3.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEV, dtype=dtype)


def model_code(gate, up, w):
    """The model's activation (``RoutedExperts.forward``): ffn.situ_glu, times the row weight, in the inputs'
    dtype (no cast)."""
    hidden = situ_glu_ref(gate, up).reshape(-1, gate.shape[-1])
    if w is not None:
        hidden = hidden * w[:, None]
    return hidden.view(gate.shape)


def reference(gate, up, w, grad, out_dtype=None, keep_fp64=False):
    """[out, d_gate, d_up, d_w] (d_w None without a weight): out by the model's code on the fp32 inputs, cast to
    out_dtype (default gate's); the grads by the same code in fp64, cast to the inputs' dtypes. With keep_fp64
    all four in fp64, uncast."""
    leaves = [t.detach().double().requires_grad_() for t in (gate, up, w) if t is not None]
    out64 = model_code(leaves[0], leaves[1], leaves[2] if w is not None else None)
    grads = [*torch.autograd.grad(out64, leaves, grad.double())] + ([None] if w is None else [])
    if keep_fp64:
        return [out64.detach(), *grads]
    out = model_code(gate.detach().float(), up.detach().float(), None if w is None else w.detach().float())
    return [out.to(out_dtype or gate.dtype)] + [None if d is None else d.to(t.dtype)
                                                for d, t in zip(grads, (gate, up, w))]


def dgate_terms(gate, up, w, grad):
    """The scale of d_gate's errors, in fp64: |o w b| s (sech^2(g/4) + |a| (1 - s)), the magnitude of its two
    terms (they cancel near the zeros of d(a s)/dg, g ~ -1.2, where any fp32 evaluation keeps d_gate to a few fp32
    ulps of this only), plus 1e-9 |o w b| s (1 + |a|) for the fp64 reference's own rounding (its 1 - tanh(g/4)^2
    is 0 from g ~ 76 on, where the kernel's sech^2 is not)."""
    g, u = gate.detach().double(), up.detach().double()
    s, a = torch.sigmoid(g), 4 * torch.tanh(g / 4)
    terms = (25 * torch.tanh(u / 25)).abs() * s * (torch.cosh(g / 4).pow(-2) + a.abs() * (1 - s) + 1e-9 * (1 + a.abs()))
    o = grad.detach().double().reshape(-1, g.shape[-1])
    if w is not None:
        o = o * w.detach().double()[:, None]
    return o.abs().view(g.shape) * terms


def assert_matches(got, ref, what, scale=None):
    """fp32: rel_rms under 2e-6. bf16: every element within one bf16 step of the reference's (plus 1e-6 of
    ``scale``, the magnitude of the terms where they cancel), rel_rms under 2e-3."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if got.dtype == torch.float32:
        assert rel_rms(ref, got) < 2e-6, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        slack = 0.0 if scale is None else 1e-6 * scale
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + slack + 1e-30).all()), (what, (g - r).abs().max())
        assert rel_rms(ref, got) < 2e-3, (what, rel_rms(ref, got))


def run_kernel(gate, up, w, grad, out_dtype=None):
    """[out, d_gate, d_up, d_w] through the autograd wrapper (d_w None without a weight)."""
    out = situ_glu(gate, up, w, out_dtype)
    leaves = [gate, up, *([w] if w is not None else [])]
    return [out, *torch.autograd.grad(out, leaves, grad)] + ([None] if w is None else [])


def check_all(got, ref, gate, up, w, grad):
    """got and ref [out, d_gate, d_up, d_w] match (``assert_matches``; d_gate with its terms' scale)."""
    scales = (None, dgate_terms(gate, up, w, grad), None, None)
    for g, r, name, scale in zip(got, ref, ("out", "d_gate", "d_up", "d_row_weight"), scales):
        if r is None:
            assert g is None, name
        else:
            assert_matches(g, r, name, scale)


CASES = [  # dtype, lead dims (R = their product), F, with a row weight
    (torch.float32, (3,), 100, True),
    (torch.float32, (2, 65), 384, False),
    (torch.float32, (1,), 384, True),
    (torch.bfloat16, (130,), 100, True),
    (torch.bfloat16, (3,), 384, False),
    (torch.bfloat16, (1, 1), 100, False),
    (torch.bfloat16, (130,), 384, True),
]


@needs_kernels
@pytest.mark.parametrize("dtype,lead,F,weighted", CASES)
def test_forward_and_grads_match_the_reference(dtype, lead, F, weighted):
    R = int(torch.tensor(lead).prod())
    gate = randn(*lead, F, seed=1, dtype=dtype).requires_grad_()
    up = randn(*lead, F, scale=10.0, seed=2, dtype=dtype).requires_grad_()
    w = torch.rand(R, generator=torch.Generator().manual_seed(3)).to(DEV).requires_grad_() if weighted else None
    grad = randn(*lead, F, scale=1.0, seed=4, dtype=dtype)
    check_all(run_kernel(gate, up, w, grad), reference(gate, up, w, grad), gate, up, w, grad)


@needs_kernels
def test_halves_of_one_projection_are_read_in_place(monkeypatch):
    # The FFN's layout: gate and up the two halves of one bf16 output [B, T, 2F] (row stride 2F), the mixture
    # weights a strided fp32 view; fp32 out of bf16 inputs. The kernels must get y's own storage, not copies.
    B, T, F = 2, 5, 100
    y = randn(B, T, 2 * F, seed=5, dtype=torch.bfloat16).requires_grad_()
    w_full = torch.rand(2 * B * T, generator=torch.Generator().manual_seed(6)).to(DEV).requires_grad_()
    w = w_full[::2]
    grad = randn(B, T, F, scale=1.0, seed=7, dtype=torch.float32)
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(args)
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(situ, "_situ_fwd_kernel", Spy(situ._situ_fwd_kernel))
    monkeypatch.setattr(situ, "_situ_bwd_kernel", Spy(situ._situ_bwd_kernel))
    gate, up = y.chunk(2, dim=-1)
    out = situ_glu(gate, up, w, torch.float32)
    got = [out, *torch.autograd.grad(out, [y, w_full], grad)]
    assert len(launches) == 2
    fwd, bwd = launches
    half = F * y.element_size()
    assert (fwd[0].data_ptr(), fwd[1], fwd[2].data_ptr(), fwd[3]) == (y.data_ptr(), 2 * F, y.data_ptr() + half, 2 * F)
    assert (bwd[2].data_ptr(), bwd[3], bwd[4].data_ptr(), bwd[5]) == (y.data_ptr(), 2 * F, y.data_ptr() + half, 2 * F)
    assert fwd[4].data_ptr() == w_full.data_ptr() and fwd[5] == 2

    ref_gate, ref_up = y.detach().chunk(2, dim=-1)
    ref = reference(ref_gate, ref_up, w.detach(), grad, torch.float32)
    assert_matches(got[0], ref[0], "out")
    assert_matches(got[1][..., :F], ref[1], "d_gate", dgate_terms(ref_gate, ref_up, w, grad))
    assert_matches(got[1][..., F:], ref[2], "d_up")
    assert_matches(got[2][::2], ref[3], "d_row_weight")
    assert not got[2][1::2].any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_magnitudes_saturate_exactly(dtype):
    # Every gate value meets every up value: 0, tiny, both sides of the series/exp switch (g/4 and u/25 at 0.25),
    # the saturation, 200 and 1e4. fp32 is compared element by element, against fp64.
    edges = [0.0, 1e-30, 1e-3, 0.5, 0.999, 1.0, 1.001, 3.0, 6.249, 6.25, 6.251, 20.0, 40.0, 90.0, 200.0, 1e4]
    vals = torch.tensor(edges + [-v for v in edges[1:]])
    n = vals.numel()
    gate = vals[:, None].expand(n, n).to(device=DEV, dtype=dtype).contiguous().requires_grad_()
    up = vals[None, :].expand(n, n).to(device=DEV, dtype=dtype).contiguous().requires_grad_()
    w = torch.linspace(-2, 2, n).to(DEV).requires_grad_()
    grad = randn(n, n, scale=1.0, seed=8, dtype=dtype)
    got, ref = run_kernel(gate, up, w, grad), reference(gate, up, w, grad)
    check_all(got, ref, gate, up, w, grad)
    assert all(bool(t.isfinite().all()) for t in got)
    if dtype == torch.float32:
        # Element by element against fp64: 4e-6 relative (d_row_weight: of the sum of its terms' magnitudes).
        ref64 = reference(gate, up, w, grad, keep_fp64=True)
        terms = (grad.double() * situ_glu_ref(gate.detach().double(), up.detach().double())).abs().sum(-1)
        for g, r, name in zip(got, ref64, ("out", "d_gate", "d_up", "d_row_weight")):
            scale = {"d_row_weight": terms, "d_gate": dgate_terms(gate, up, w, grad)}.get(name, r.abs())
            err = (g.double() - r).abs()
            assert bool((err <= scale * 4e-6 + 1e-37).all()), (name, (err / scale).nan_to_num().max())


@needs_kernels
@pytest.mark.parametrize("f64", [False, True])
def test_tanh_and_sech2_against_torch(f64):
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, t_ptr, s_ptr, N, BLOCK: tl.constexpr, F64: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        th, sech2 = _tanh_sech2(tl.load(x_ptr + offs, mask=mask, other=0.0), F64)
        tl.store(t_ptr + offs, th, mask=mask)
        tl.store(s_ptr + offs, sech2, mask=mask)

    dtype = torch.float64 if f64 else torch.float32
    mags = [0.0, 1e-30, 1e-6, 9.99e-4, 1e-3, 1.001e-3, 0.1, 0.2499, 0.25, 0.2501, 0.5, 1.0, 5.0, 9.0, 10.0, 20.0,
            200.0, 1e4]
    x = torch.tensor(mags + [-m for m in mags[1:]], dtype=torch.float64)
    x = torch.cat([x, torch.linspace(-12, 12, 193, dtype=torch.float64)]).to(device=DEV, dtype=dtype)
    th, sech2 = torch.empty_like(x), torch.empty_like(x)
    probe[(1,)](x, th, sech2, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), F64=f64)
    # Against fp64 (torch.tanh of the same inputs): a few ulps; sech^2 also where it underflows (fp32 from
    # |x| ~ 44, under 1e-37).
    x64 = x.double()
    rtol, atol = (1e-13, 1e-300) if f64 else (5e-7, 1e-37)
    ref_th, ref_sech2 = torch.tanh(x64), 1.0 / torch.cosh(x64).square()
    err_th, err_sech2 = (th.double() - ref_th).abs(), (sech2.double() - ref_sech2).abs()
    assert bool((err_th <= ref_th.abs() * rtol).all()), (err_th / ref_th.abs()).nan_to_num().max()
    assert bool((err_sech2 <= ref_sech2 * 4 * rtol + atol).all()), (err_sech2 / ref_sech2).nan_to_num().max()
    assert bool((th.abs() <= 1).all()) and torch.equal(th[x.abs() >= 20].abs(), torch.ones_like(th[x.abs() >= 20]))


@needs_kernels
def test_backward_walks_rows_in_several_tiles(monkeypatch):
    # A row wider than BLOCK_F_MAX: d_row_weight sums several column tiles; without it the tiles are programs.
    monkeypatch.setattr(situ, "BLOCK_F_MAX", 128)
    R, F = 3, 300
    gate, up = randn(R, F, seed=9).requires_grad_(), randn(R, F, scale=10.0, seed=10).requires_grad_()
    w = torch.rand(R, generator=torch.Generator().manual_seed(11)).to(DEV).requires_grad_()
    grad = randn(R, F, scale=1.0, seed=12)
    check_all(run_kernel(gate, up, w, grad), reference(gate, up, w, grad), gate, up, w, grad)
    check_all(run_kernel(gate, up, None, grad), reference(gate, up, None, grad), gate, up, None, grad)


@needs_kernels
def test_backward_direct_strided_grad_and_no_weight_grad():
    R, F = 5, 100
    gate, up = randn(R, F, seed=13), randn(R, F, scale=10.0, seed=14)
    w = torch.rand(R, generator=torch.Generator().manual_seed(15)).to(DEV)
    grad = randn(R, 2 * F, scale=1.0, seed=16)[:, F:]  # row stride 2F
    d_gate, d_up, d_w = situ_glu_backward(grad, gate, up, w)
    assert (d_gate.is_contiguous(), d_up.is_contiguous(), d_w.shape) == (True, True, (R,))
    again = situ_glu_backward(grad, gate, up, w)
    assert all(torch.equal(a, b) for a, b in zip((d_gate, d_up, d_w), again))  # deterministic
    no_dw = situ_glu_backward(grad, gate, up, w, row_weight_grad=False)
    assert no_dw[2] is None and torch.equal(no_dw[0], d_gate) and torch.equal(no_dw[1], d_up)
    ref = reference(gate, up, w, grad)
    for g, r, name in zip((d_gate, d_up, d_w), ref[1:], ("d_gate", "d_up", "d_row_weight")):
        assert_matches(g, r, name)
    # w without requires_grad through autograd: no d_w wanted, gate and up grads as before.
    g_leaf, u_leaf = gate.clone().requires_grad_(), up.clone().requires_grad_()
    dg, du = torch.autograd.grad(situ_glu(g_leaf, u_leaf, w), [g_leaf, u_leaf], grad)
    assert torch.equal(dg, d_gate) and torch.equal(du, d_up)


@needs_kernels
def test_no_rows():
    for w in (None, torch.ones(0, device=DEV, requires_grad=True)):
        gate = torch.zeros(0, 8, device=DEV, requires_grad=True)
        up = torch.zeros(0, 8, device=DEV, requires_grad=True)
        out = situ_glu(gate, up, w)
        grads = torch.autograd.grad(out.sum(), [gate, up, *([w] if w is not None else [])])
        assert out.shape == (0, 8) and all(g.shape == t.shape for g, t in zip(grads, (gate, up, w)))


@needs_kernels
def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(17)
    gate = (3 * torch.randn(3, 7, generator=gen, dtype=torch.float64)).to(DEV).requires_grad_()
    up = (30 * torch.randn(3, 7, generator=gen, dtype=torch.float64)).to(DEV).requires_grad_()
    w = torch.randn(3, generator=gen, dtype=torch.float64).to(DEV).requires_grad_()
    assert torch.autograd.gradcheck(situ_glu, (gate, up, w), fast_mode=True)
    assert torch.autograd.gradcheck(situ_glu, (gate, up), fast_mode=True)


@needs_kernels
def test_bad_inputs_are_named():
    g, u, w = torch.randn(2, 8, device=DEV), torch.randn(2, 8, device=DEV), torch.ones(2, device=DEV)
    cases = [
        ((g, torch.randn(2, 9, device=DEV)), r"up must have gate's shape \(2, 8\)"),
        ((g, torch.randn(1, 2, 8, device=DEV)), r"up must have gate's shape"),
        ((g.long(), u), "gate must be"),
        ((g, u.long()), "up must be"),
        ((torch.randn(2, 0, device=DEV), torch.randn(2, 0, device=DEV)), "D >= 1"),
        ((g, u.to("meta")), "up is on meta"),
        ((g, u, torch.ones(3, device=DEV)), r"row_weight must be None or a 1-D tensor \[R=2\]"),
        ((g, u, torch.ones(2, 1, device=DEV)), r"row_weight must be None or a 1-D tensor"),
        ((g, u, w.long()), "row_weight must be fp32"),
        ((g, u, w.to("meta")), "row_weight is on meta"),
        ((g, u, w, torch.int32), "out_dtype"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            situ_glu_forward(*args)
    with pytest.raises(ValueError, match="grad_out must have gate's shape"):
        situ_glu_backward(torch.zeros(3, 8, device=DEV), g, u, w)
    with pytest.raises(ValueError, match="grad_out must be"):
        situ_glu_backward(torch.zeros(2, 8, device=DEV, dtype=torch.long), g, u, w)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    gate, up = randn(8, 2048, dtype=torch.bfloat16, seed=18), randn(8, 2048, dtype=torch.bfloat16, seed=19)
    w = torch.rand(8, device=DEV)
    with torch.inference_mode():
        situ_glu(gate, up, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = situ_glu(gate, up, w)
        gate.copy_(torch.randn_like(gate))
        graph.replay()
    ref = model_code(gate.float(), up.float(), w).to(torch.bfloat16)
    assert_matches(out.clone(), ref, "replayed out")
