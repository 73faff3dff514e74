"""Tests of the fused router selection (kimik3/ops/moe/route.py) against its reference, ``Router._select``'s torch
ops: ids, weights, cutoff and counts for (E, K) = (32, 4) (the debug model), (16, 2), (896, 16) (K3), (8, 8) (K == E:
no cutoff), (33, 5) (E not a power of two), (1, 1) and (4096, 2) (the largest E), over 1, 7 and 65 rows; strided
logits, exact ties (the lower expert index first), scores where every sigmoid is exact (cutoff and weights bit for
bit), NaN logits, the weights' gradient (fp32 against autograd through the reference, fp64 gradcheck), no rows,
the backend choice and the input checks.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), every
load and store bounds-checked (tests/triton_bounds.py). There the kernel's exp is numpy's, which differs from
torch's CPU exp by an ulp on many inputs, so random cutoffs are compared to 2^-21 and weights to 1e-6 relative.

Legend: T tokens (rows), E experts, K experts per token.
"""

from __future__ import annotations


import pytest
import torch

from kimik3.ops.moe.route import (
    MAX_EXPERTS,
    route_backend,
    sigmoid_topk,
    sigmoid_topk_backward,
    sigmoid_topk_forward,
)
from tests.numerics import rel_rms
from tests.kernel_testing import DEV, HAS_KERNELS, interpreter_setup, needs_kernels, ON_GPU  # noqa: F401 (interpreter_setup: autouse)


CUTOFF_ATOL = 2.0 ** -21  # two fp32 steps at biased scores in [1, 2): the sigmoids may differ by an ulp
INF = float("inf")


def reference(logits_TE, bias_E, top_k, route_scale, stable=False):
    """``Router._select`` in torch: (weights, ids, cutoff, counts). ``stable``: a stable sort in place of
    ``torch.topk``, which on CPU does not break ties towards the lower index."""
    E = logits_TE.shape[1]
    scores_TE = torch.sigmoid(logits_TE)
    biased_TE = scores_TE.detach() + bias_E
    if stable:
        top_vals, top_ids = torch.sort(biased_TE, dim=-1, descending=True, stable=True)
    else:
        top_vals, top_ids = torch.topk(biased_TE, min(top_k + 1, E), dim=-1, sorted=True)
    ids_TK = top_ids[:, :top_k]
    weights_TK = scores_TE.gather(-1, ids_TK)
    weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20) * route_scale
    cutoff_T = top_vals[:, top_k] if top_k < E else torch.full_like(top_vals[:, 0], -INF)
    flat = ids_TK.flatten()
    counts_E = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return weights_TK, ids_TK, cutoff_T, counts_E


def make_inputs(T, E, seed=0, dtype=torch.float32):
    """Logits randn * 3 (no ties among the biased scores in practice) and a bias of spread 0.3."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, E, generator=gen, dtype=torch.float64) * 3).to(DEV, dtype)
    bias = (torch.randn(E, generator=gen, dtype=torch.float64) * 0.3).to(DEV, dtype)
    return logits, bias


def assert_selection(got, ref, exact=False):
    w, ids, cut, counts = got
    rw, rids, rcut, rcounts = ref
    assert w.dtype == rw.dtype and cut.dtype == rcut.dtype and ids.dtype == counts.dtype == torch.int64
    assert w.shape == rw.shape and cut.shape == rcut.shape and counts.shape == rcounts.shape
    assert torch.equal(ids, rids), (ids, rids)
    assert torch.equal(counts, rcounts), (counts, rcounts)
    assert torch.equal(torch.isinf(cut), torch.isinf(rcut)) and torch.equal(cut[rcut.isinf()], rcut[rcut.isinf()])
    if exact:
        assert torch.equal(w, rw) and torch.equal(cut, rcut), ((w - rw).abs().max(), (cut - rcut).abs().max())
    else:
        assert bool(((w - rw).abs() <= 1e-6 * rw.abs()).all()), ((w - rw).abs() / rw.abs()).max()
        fin = rcut.isfinite()
        assert bool(((cut - rcut)[fin].abs() <= CUTOFF_ATOL).all()), (cut - rcut)[fin].abs().max()


CASES = [(E, K, T) for E, K in ((32, 4), (16, 2), (8, 8), (33, 5)) for T in (1, 7, 65)]
CASES += [(896, 16, 1), (896, 16, 3), (1, 1, 7), (MAX_EXPERTS, 2, 2)]


@needs_kernels
@pytest.mark.parametrize("E,K,T", CASES)
def test_forward_matches_the_reference(E, K, T):
    logits, bias = make_inputs(T, E, seed=E + K + T)
    scale = 2.5 if K % 2 == 0 else 1.0
    got = sigmoid_topk_forward(logits, bias, K, scale)
    assert_selection(got, reference(logits, bias, K, scale))
    if K == E:
        assert bool((got[2] == -INF).all())


@needs_kernels
def test_strided_logits_and_autograd_entry_point():
    # A column slice (row stride 2 E) through sigmoid_topk, with and without grad: the same selection.
    wide, bias = make_inputs(7, 64, seed=3)
    logits, bias = wide[:, :32], bias[:32]
    ref = reference(logits, bias, 4, 1.0)
    assert_selection(sigmoid_topk(logits, bias, 4, 1.0), ref)
    with torch.inference_mode():
        assert_selection(sigmoid_topk(logits, bias, 4, 1.0), ref)
    out = sigmoid_topk(logits.clone().requires_grad_(), bias, 4, 1.0)
    assert out[0].requires_grad and not any(t.requires_grad for t in out[1:])


@needs_kernels
def test_exact_when_every_sigmoid_is_exact():
    # Logits -inf, 0, +inf give scores 0, 1/2, 1 in every implementation: cutoff and weights match bit for bit.
    # Row 0 has only zero scores: its weights are 0 / (0 + 1e-20) = 0.
    gen = torch.Generator().manual_seed(5)
    E, K, T = 24, 5, 9
    logits = torch.tensor([-INF, 0.0, INF])[torch.randint(0, 3, (T, E), generator=gen)]
    logits[0] = -INF
    bias = torch.randn(E, generator=gen) * 0.3
    logits, bias = logits.to(DEV), bias.to(DEV)
    for scale in (1.0, 2.5):
        got = sigmoid_topk_forward(logits, bias, K, scale)
        assert_selection(got, reference(logits, bias, K, scale), exact=True)
    assert not got[0][0].any()


@needs_kernels
def test_ties_go_to_the_lower_index():
    # All scores 1/2, so the biased scores tie exactly where the biases do.
    bias = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.3, 0.2, 0.0, 0.3], device=DEV)
    logits = torch.zeros(2, 8, device=DEV)
    biased = (0.5 + bias).tolist()  # fp32 sums, as the kernel's
    w, ids, cut, counts = sigmoid_topk_forward(logits, bias, 3, 1.0)
    assert ids.tolist() == [[1, 2, 4]] * 2 and cut.tolist() == [biased[7]] * 2  # the 4th of the 0.8 ties
    assert torch.equal(w, torch.full((2, 3), 1 / 3, device=DEV))
    w, ids, cut, counts = sigmoid_topk_forward(logits, bias, 5, 1.0)
    assert ids.tolist() == [[1, 2, 4, 7, 3]] * 2 and cut.tolist() == [biased[5]] * 2  # the 2nd of the 0.7 ties
    assert counts.tolist() == [0, 2, 2, 2, 2, 0, 0, 2]
    w, ids, cut, counts = sigmoid_topk_forward(torch.zeros(1, 8, device=DEV), torch.zeros(8, device=DEV), 8, 1.0)
    assert ids.tolist() == [list(range(8))] and cut.item() == -INF


@needs_kernels
def test_random_rows_with_duplicated_experts():
    # Expert j copies expert i's logit and bias (i < j): an exact tie, which i wins; else as the (stable) reference.
    logits, bias = make_inputs(7, 32, seed=6)
    pairs = [(2, 9), (5, 30), (11, 12)]
    logits[:, [2, 5, 11]] += 6.0  # the pairs among the chosen, or at the cutoff
    for i, j in pairs:
        logits[:, j], bias[j] = logits[:, i], bias[i]
    w, ids, cut, counts = sigmoid_topk_forward(logits, bias, 4, 1.0)
    for t in range(7):
        row = ids[t].tolist()
        for i, j in pairs:
            if j in row:
                assert i in row and row.index(i) < row.index(j)
    assert_selection((w, ids, cut, counts), reference(logits, bias, 4, 1.0, stable=True))
    assert (ids[:, :, None] == torch.tensor([9, 30, 12], device=DEV)).any(), "no tie was among the chosen"


@needs_kernels
def test_nan_logits_rank_first_as_in_topk():
    logits, bias = make_inputs(3, 16, seed=7)
    logits[1, [4, 9]] = float("nan")
    w, ids, cut, counts = sigmoid_topk_forward(logits, bias, 3, 1.0)
    ref = reference(logits, bias, 3, 1.0)
    assert torch.equal(ids, ref[1]) and ids[1, :2].tolist() == [4, 9]
    assert torch.equal(counts, ref[3]) and w[1].isnan().all() and not w[[0, 2]].isnan().any()


GRAD_CASES = [(32, 4, 7, 1.0), (33, 5, 65, 2.5), (8, 8, 7, 2.5), (896, 16, 2, 1.0)]


@needs_kernels
@pytest.mark.parametrize("E,K,T,scale", GRAD_CASES)
def test_weight_grads_match_autograd_through_the_reference(E, K, T, scale):
    logits, bias = make_inputs(T, E, seed=E + T)
    grad = torch.randn(T, K, generator=torch.Generator().manual_seed(8)).to(DEV)
    x_ref = logits.clone().requires_grad_()
    ref = torch.autograd.grad(reference(x_ref, bias, K, scale)[0], x_ref, grad)[0]
    x = logits.clone().requires_grad_()
    got = torch.autograd.grad(sigmoid_topk(x, bias, K, scale)[0], x, grad)[0]
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got != 0, ref != 0) and int((got != 0).sum(1).max()) <= K
    assert rel_rms(ref, got) < 2e-6, rel_rms(ref, got)


@needs_kernels
def test_gradcheck_fp64():
    logits, bias = make_inputs(3, 6, seed=9, dtype=torch.float64)
    logits.requires_grad_()
    for K, scale in ((2, 2.5), (6, 1.0)):
        assert torch.autograd.gradcheck(lambda x: sigmoid_topk(x, bias, K, scale)[0], (logits,))


def test_backward_formula_fp64():
    # The backward alone, no kernel: against autograd through s / (sum s + 1e-20) * c on fixed ids.
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(4)])
    grad = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    s = torch.sigmoid(logits).gather(1, ids)
    ref = torch.autograd.grad(s / (s.sum(-1, keepdim=True) + 1e-20) * 1.5, logits, grad)[0]
    got = sigmoid_topk_backward(grad, s.detach(), ids, 9, 1.5)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-15)


@needs_kernels
def test_no_rows():
    logits = torch.zeros(0, 32, device=DEV, requires_grad=True)
    w, ids, cut, counts = sigmoid_topk(logits, torch.zeros(32, device=DEV), 4, 1.0)
    assert w.shape == ids.shape == (0, 4) and cut.shape == (0,) and torch.equal(counts, torch.zeros_like(counts))
    (dx,) = torch.autograd.grad(w.sum(), logits)
    assert dx.shape == (0, 32)


def test_route_backend():
    x = torch.zeros(2, 32)
    assert route_backend(x) == "torch" and route_backend(x, "torch") == "torch"
    with pytest.raises(ValueError, match="backend"):
        route_backend(x, "fast")
    if HAS_KERNELS:
        assert route_backend(x.to(DEV), "triton") == "triton"
        assert route_backend(x.to(DEV)) == ("triton" if ON_GPU else "torch")
        assert route_backend(torch.zeros(1, MAX_EXPERTS + 1, device=DEV)) == "torch"


@needs_kernels
def test_bad_inputs_are_named():
    x, b = make_inputs(2, 8)
    cases = [
        ((x[0], b, 2, 1.0), "2-D"),
        ((x[None], b, 2, 1.0), "2-D"),
        ((x.bfloat16(), b, 2, 1.0), "fp32"),
        ((x.long(), b, 2, 1.0), "fp32"),
        ((torch.zeros(1, MAX_EXPERTS + 1, device=DEV), torch.zeros(MAX_EXPERTS + 1, device=DEV), 2, 1.0), "experts"),
        ((x, torch.zeros(9, device=DEV), 2, 1.0), "bias_E"),
        ((x, b[None], 2, 1.0), "bias_E"),
        ((x, b.long(), 2, 1.0), "floating"),
        ((x, b.to("meta"), 2, 1.0), "bias_E is on meta"),
        ((x, b, 0, 1.0), "top_k"),
        ((x, b, 9, 1.0), "top_k"),
        ((x, b, True, 1.0), "top_k"),
        ((x, b, 2.0, 1.0), "top_k"),
        ((x, b, 2, torch.tensor(1.0)), "route_scale"),
        ((x, b, 2, float("nan")), "route_scale"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            sigmoid_topk_forward(*args)
        with pytest.raises(ValueError, match=match):
            sigmoid_topk(*args)


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_scores_are_torch_sigmoid_bit_for_bit():
    # libdevice's exp and a correctly rounded division: torch's CUDA sigmoid formula, so the cutoff is exact.
    logits, bias = make_inputs(257, 896, seed=11)
    got = sigmoid_topk_forward(logits, bias, 16, 1.0)
    ref = reference(logits, bias, 16, 1.0)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_cuda_graph_capture_and_replay():
    logits, bias = make_inputs(8, 896, seed=12)
    with torch.inference_mode():
        sigmoid_topk_forward(logits, bias, 16, 1.0)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = sigmoid_topk_forward(logits, bias, 16, 1.0)
        logits.copy_(make_inputs(8, 896, seed=13)[0])
        graph.replay()
    assert_selection(got, reference(logits, bias, 16, 1.0))


@needs_kernels
@pytest.mark.parametrize("T", [1, 65])   # one program (the counts stored whole) and several (atomic adds)
def test_every_output_is_written_whole(monkeypatch, T):
    # The outputs start as torch.empty (the counts too, when one program holds every row): poisoned here, so an
    # element the kernel leaves unwritten shows.
    empty = torch.empty

    def poisoned(*shape, **kw):
        out = empty(*shape, **kw)
        return out.fill_(-7 if not out.is_floating_point() else float("nan"))
    monkeypatch.setattr(torch, "empty", poisoned)
    logits, bias = make_inputs(T, 33, seed=T)
    got = sigmoid_topk_forward(logits, bias, 5, 1.0)
    monkeypatch.undo()
    assert_selection(got, reference(logits, bias, 5, 1.0))
    assert int(got[3].sum()) == 5 * T
