"""Tests of KDA's fused output gated norm (kimik3/ops/glue/gated_norm.py) against its reference, the two lines at the
end of ``KDA.forward``: forward and the grads of o, gate and weight; fp32, bf16 and mixed inputs (fp32 o with a bf16
gate, the usual KDA case), head dims 64, 48 and 96, 1, 3 and 130 rows (several row blocks, and several a backward
program with a partial last one); strided inputs (read in place: a gate that is a column slice of a wider projection
output, o and the gate as halves of [..., H, 2 V] tensors; copied: a transposed o), an explicit out_dtype, no rows,
fp64 gradcheck, and the input checks.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), with the
interpreter's bf16 made the GPU's and every load and store bounds-checked (tests/triton_bounds.py).

Legend: B batch, T tokens, H heads, V head dim, R = B * T * H rows.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kimik3.ops.glue import MAX_WIDTH
from kimik3.ops.glue.gated_norm import _rows_3d, gated_rms_norm, gated_rms_norm_backward, gated_rms_norm_forward
from tests.numerics import rel_rms
from tests.kernel_testing import BF16_ULP, DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


EPS = 1e-5


def reference(o, gate, weight, eps, out_dtype=None):
    """KDA.forward's last two lines (kimik3/model/kda.py), the gate reshaped to o's [..., H, V]."""
    V = o.shape[-1]
    normed = F.rms_norm(o.float(), (V,), weight.float(), eps)
    return (normed * torch.sigmoid(gate.reshape(o.shape).float())).to(out_dtype or gate.dtype)


def rand(shape, dtype, seed, scale=1.0, shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(device=DEV, dtype=dtype).requires_grad_()


def make_inputs(lead, H, V, o_dtype, gate_dtype, w_dtype=torch.float32, flat_gate=True, seed=0):
    o = rand((*lead, H, V), o_dtype, seed, scale=3.0)
    gate = rand((*lead, H * V) if flat_gate else (*lead, H, V), gate_dtype, seed + 1, scale=2.0)
    weight = rand((V,), w_dtype, seed + 2, scale=0.3, shift=1.0)
    return o, gate, weight


def run_both(o, gate, weight, grad, out_dtype=None):
    """[out, d_o, d_gate, d_weight] of the kernels and of the reference."""
    ref = reference(o, gate, weight, EPS, out_dtype)
    ref = [ref, *torch.autograd.grad(ref, [o, gate, weight], grad)]
    out = gated_rms_norm(o, gate, weight, EPS, out_dtype)
    got = [out, *torch.autograd.grad(out, [o, gate, weight], grad)]
    return got, ref


def assert_matches(got, ref, what):
    """fp32: rel_rms under 2e-6. bf16: every element within one bf16 step of the reference's, rel_rms under 2e-3."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape, got.dtype, ref.dtype)
    if got.dtype == torch.float32:
        assert rel_rms(ref, got) < 2e-6, (what, rel_rms(ref, got))
    else:
        g, r = got.double(), ref.double()
        assert bool(((g - r).abs() <= r.abs() * BF16_ULP + 1e-30).all()), (what, (g - r).abs().max())
        assert rel_rms(ref, got) < 2e-3, (what, rel_rms(ref, got))


BF, F32 = torch.bfloat16, torch.float32
CASES = [  # o dtype, gate dtype, weight dtype, lead dims, H, V, gate flat [..., H * V]
    (F32, F32, F32, (1, 3), 1, 64, True),
    (F32, F32, F32, (2, 13), 5, 48, False),   # 130 rows
    (F32, BF, F32, (2, 13), 5, 96, True),     # the KDA case: fp32 o, bf16 gate and out
    (F32, BF, F32, (1, 1), 3, 64, True),
    (BF, BF, F32, (130,), 1, 64, False),
    (BF, BF, BF, (1,), 3, 96, True),
    (BF, F32, F32, (1,), 1, 48, False),
]


def case_id(value):
    """Test ids such as f32-bf16-f32-2x13-5-96-flat."""
    if isinstance(value, torch.dtype):
        return {F32: "f32", BF: "bf16"}[value]
    if isinstance(value, bool):
        return "flat" if value else "HV"
    return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)


@needs_kernels
@pytest.mark.parametrize("o_dtype,gate_dtype,w_dtype,lead,H,V,flat", CASES, ids=case_id)
def test_forward_and_grads_match_the_reference(o_dtype, gate_dtype, w_dtype, lead, H, V, flat):
    o, gate, weight = make_inputs(lead, H, V, o_dtype, gate_dtype, w_dtype, flat)
    grad = rand((*lead, H, V), gate_dtype, 9).detach()
    got, ref = run_both(o, gate, weight, grad)
    for g, r, name in zip(got, ref, ("out", "d_o", "d_gate", "d_weight")):
        assert_matches(g, r, name)


@needs_kernels
def test_out_dtype():
    o, gate, weight = make_inputs((3,), 2, 48, BF, BF)
    grad = rand((3, 2, 48), F32, 9).detach()
    got, ref = run_both(o, gate, weight, grad, out_dtype=F32)
    assert got[0].dtype == F32
    for g, r, name in zip(got, ref, ("out", "d_o", "d_gate", "d_weight")):
        assert_matches(g, r, name)


@needs_kernels
@pytest.mark.parametrize("layout", ["column_slice_gate", "head_slices"])
def test_strided_inputs(layout):
    # column_slice_gate: the gate the right half of a wider projection output [B, T, 2 H V] (row stride 2 H V, read
    # in place); o [B, T, H, V] a transposed [T, B, H, V] (its leading dims do not merge: one copy).
    # head_slices: o and the gate halves of [B, T, H, 2 V] tensors (head stride 2 V, read in place).
    B, T, H, V = 2, 5, 3, 48
    if layout == "column_slice_gate":
        gate = rand((B, T, 2 * H * V), BF, 1, scale=2.0)[..., H * V:]
        o = rand((T, B, H, V), F32, 2, scale=3.0).transpose(0, 1)
        o_in_place = False
    else:
        gate = rand((B, T, H, 2 * V), BF, 1, scale=2.0)[..., V:]
        o = rand((B, T, H, 2 * V), F32, 2, scale=3.0)[..., :V]
        o_in_place = True
    weight = rand((V,), F32, 3, scale=0.3, shift=1.0)
    assert _rows_3d(gate.reshape(B, T, H, V), H, V).data_ptr() == gate.data_ptr()
    assert (_rows_3d(o, H, V).data_ptr() == o.data_ptr()) == o_in_place
    grad = rand((B, T, H, V), BF, 4).detach()
    got, ref = run_both(o, gate, weight, grad)
    for g, r, name in zip(got, ref, ("out", "d_o", "d_gate", "d_weight")):
        assert_matches(g, r, name)
    assert got[1].shape == o.shape and got[2].shape == gate.shape


@needs_kernels
def test_no_rows():
    o, gate, weight = make_inputs((0,), 2, 8, F32, F32)
    out = gated_rms_norm(o, gate, weight, EPS)
    d_o, d_gate, d_w = torch.autograd.grad(out.sum(), [o, gate, weight])
    assert out.shape == d_o.shape == (0, 2, 8) and d_gate.shape == (0, 16) and not d_w.any()


@needs_kernels
def test_gradcheck_fp64():
    o, gate, weight = make_inputs((2,), 3, 5, torch.float64, torch.float64, torch.float64)
    assert torch.autograd.gradcheck(lambda o, z, w: gated_rms_norm(o, z, w, EPS), (o, gate, weight), fast_mode=True)


@needs_kernels
def test_backward_programs():
    o, gate, weight = make_inputs((20,), 2, 96, F32, BF)
    grad = rand((20, 2, 96), BF, 5).detach()
    args = (o.detach(), gate.detach(), weight.detach(), EPS, grad)
    d1 = gated_rms_norm_backward(*args, programs=1)
    d3 = gated_rms_norm_backward(*args, programs=3)
    assert torch.equal(d1[0], d3[0]) and torch.equal(d1[1], d3[1]) and rel_rms(d1[2], d3[2]) < 1e-6


@needs_kernels
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the padding row's 0/0
def test_eps_zero():
    # 3 rows in a block of 4: the padding row's norm is 0/0 there, which must stay out of d_weight.
    o, gate, weight = make_inputs((3,), 1, 48, F32, F32)
    grad = rand((3, 1, 48), F32, 6).detach()
    ref = reference(o, gate, weight, 0.0)
    ref = [ref, *torch.autograd.grad(ref, [o, gate, weight], grad)]
    out = gated_rms_norm(o, gate, weight, 0.0)
    got = [out, *torch.autograd.grad(out, [o, gate, weight], grad)]
    for g, r, name in zip(got, ref, ("out", "d_o", "d_gate", "d_weight")):
        assert_matches(g, r, name)


@needs_kernels
def test_bad_inputs_are_named():
    o, z, w = torch.randn(2, 3, 8, device=DEV), torch.randn(2, 24, device=DEV), torch.ones(8, device=DEV)
    wide = MAX_WIDTH + 1
    cases = [
        ((o.long(), z, w, 1e-5), "o must be"),
        ((o, z.long(), w, 1e-5), "gate must be"),
        ((o, torch.randn(2, 25, device=DEV), w, 1e-5), r"gate must have o's shape \(2, 3, 8\) or \(2, 24\)"),
        ((o, torch.randn(2, 8, 3, device=DEV), w, 1e-5), "gate must have o's shape"),
        ((o, z.to("meta"), w, 1e-5), "gate is on meta"),
        ((o, z, torch.ones(9, device=DEV), 1e-5), "weight"),
        ((o, z, w.long(), 1e-5), "weight must be a floating"),
        ((o, z, w.to("meta"), 1e-5), "weight is on meta"),
        ((o, z, w, torch.tensor(1e-5)), "eps"),
        ((o, z, w, 1e-5, torch.int32), "out_dtype"),
        ((torch.randn(1, wide, device=DEV), torch.randn(1, wide, device=DEV), torch.ones(wide, device=DEV), 1e-5),
         "widths"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            gated_rms_norm_forward(*args)
    with pytest.raises(ValueError, match="grad_out must have o's shape"):
        gated_rms_norm_backward(o, z, w, 1e-5, torch.zeros(3, 3, 8, device=DEV))
    with pytest.raises(ValueError, match="grad_out must be a floating"):
        gated_rms_norm_backward(o, z, w, 1e-5, torch.zeros(2, 24, device=DEV, dtype=torch.int32))


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    o, gate, weight = (t.detach() for t in make_inputs((8,), 4, 128, F32, BF))
    with torch.inference_mode():
        gated_rms_norm_forward(o, gate, weight, EPS)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gated_rms_norm_forward(o, gate, weight, EPS)
        o.copy_(torch.randn_like(o))
        graph.replay()
        ref = reference(o, gate, weight, EPS)
    assert_matches(out, ref, "replayed out")
