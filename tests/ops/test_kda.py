"""Tests for the Kimi Delta Attention operators (kimik3.ops.kda).

The float32 token loop ``naive_recurrent_kda`` is the oracle; ``chunk_kda``
must match it in value and in every gradient, for plain batches, packed
variable-length sequences, bf16 inputs and saturated (g = -5) gates.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim,
N sequences.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import cu_seqlens, kda_inputs, rel_rms
from kimik3.ops.kda import chunk_kda, naive_recurrent_kda, recurrent_kda_step

G_MIN = -5.0  # K3's gate lower bound; chunk_kda's overflow-free contract


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Run these tiny-shape tests single-threaded.

    Intra-op threads buy nothing at these sizes, and when pytest-xdist
    workers already occupy every core each parallel region can stall for a
    scheduler time slice (observed: ~8 ms per matmul, 100x slowdowns).
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def make_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                gate_spread: float = 1.5) -> List[torch.Tensor]:
    """``tests.numerics.kda_inputs`` on the CPU, every tensor in ``dtype``."""
    return kda_inputs(B, T, H, K, V, dtype=dtype, seed=seed, gate_spread=gate_spread)


def make_state(N: int, H: int, K: int, V: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(N, H, K, V, generator=gen)).requires_grad_()


def as_fp32_leaves(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Float32 copies of the same values, as fresh leaves."""
    return [x.detach().float().requires_grad_() for x in tensors]


def run_with_grads(fn, inputs, h0: Optional[torch.Tensor], seed: int = 7, **kwargs):
    """Run fn, back-propagate random upstream grads for o and the final state.

    Returns (o, final_state, [grads of inputs..., grad of h0 if given]).
    """
    o, state = fn(*inputs, initial_state=h0, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    ds = torch.randn(state.shape, generator=gen)
    leaves = list(inputs) + ([h0] if h0 is not None else [])
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (state * ds).sum(), leaves)
    return o, state, list(grads)


GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]


# --------------------------------------------------------------------------
# chunk vs naive, float32
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 15, 63, 64, 65, 500])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("K,V", [(16, 16), (12, 20)])
def test_chunk_matches_naive_fp32(T, with_h0, K, V):
    B, H = 2, 2
    inputs = make_inputs(B, T, H, K, V, seed=T)
    h0 = make_state(B, H, K, V) if with_h0 else None
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0)

    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V)
    assert rel_rms(o_ref, o) < 1e-5
    assert rel_rms(s_ref, s) < 1e-5
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < 1e-5, name


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes_match_naive(chunk_size):
    inputs = make_inputs(1, 150, 2, 16, 16, seed=3)
    h0 = make_state(1, 2, 16, 16)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0, chunk_size=chunk_size)
    assert rel_rms(o_ref, o) < 1e-5
    assert rel_rms(s_ref, s) < 1e-5
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < 1e-5, name


def test_scale_and_optional_state():
    q, k, v, g, beta = make_inputs(1, 40, 2, 16, 8, seed=4)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    o, s = chunk_kda(q, k, v, g, beta, scale=0.3)
    assert s is None
    assert rel_rms(o_ref, o) < 1e-5
    # default scale is K ** -0.5
    o_def, _ = chunk_kda(q, k, v, g, beta)
    o_exp, _ = chunk_kda(q, k, v, g, beta, scale=16**-0.5)
    assert torch.equal(o_def, o_exp)


@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda], ids=["chunk", "naive"])
def test_empty_sequence(fn):
    inputs = make_inputs(2, 0, 2, 8, 4)
    h0 = make_state(2, 2, 8, 4)
    o, s = fn(*inputs, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 4)
    torch.testing.assert_close(s, h0.detach(), rtol=0, atol=0)


def test_initial_state_not_modified():
    inputs = make_inputs(2, 70, 2, 16, 16)
    h0 = make_state(2, 2, 16, 16).detach()
    h0_copy = h0.clone()
    for fn in (chunk_kda, naive_recurrent_kda):
        _, s = fn(*inputs, initial_state=h0, output_final_state=True)
        assert torch.equal(h0, h0_copy)
        assert s.data_ptr() != h0.data_ptr()


# --------------------------------------------------------------------------
# bf16 inputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T,seed", [(63, 11), (130, 11), (128, 12)])
def test_chunk_bf16_matches_fp32_naive(T, seed):
    B, H, K, V = 2, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, dtype=torch.bfloat16, seed=seed)
    h0 = make_state(B, H, K, V)
    ref_inputs, ref_h0 = as_fp32_leaves(inputs), h0.detach().clone().requires_grad_()
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, ref_h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0)

    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert all(gr.dtype == torch.bfloat16 for gr in g[:5])
    assert rel_rms(o_ref, o) < 5e-3
    assert rel_rms(s_ref, s) < 5e-3
    tol = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 5e-3}
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < tol[name], name


# --------------------------------------------------------------------------
# variable-length (packed) sequences
# --------------------------------------------------------------------------

SEGMENTS_MIXED = [1, 1, 63, 64, 65, 130]
SEGMENTS_ONES = [1] * 7


@pytest.mark.parametrize("lengths", [SEGMENTS_MIXED, SEGMENTS_ONES, [5, 0, 70]], ids=["mixed", "ones", "empty"])
def test_varlen_matches_separate_sequences(lengths):
    H, K, V = 2, 16, 12
    T, N = sum(lengths), len(lengths)
    cu = cu_seqlens(lengths)
    inputs = make_inputs(1, T, H, K, V, seed=21)
    h0 = make_state(N, H, K, V)
    o, s, g = run_with_grads(chunk_kda, inputs, h0, cu_seqlens=cu)
    assert o.shape == (1, T, H, V) and s.shape == (N, H, K, V)

    # Oracle: the token loop on each segment separately, with the same
    # upstream gradients (sliced) as the packed run.
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen)
    ds = torch.randn(s.shape, generator=gen)
    leaves = inputs + [h0]
    loss = 0.0
    o_parts, s_parts = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seg = [x[:, bos:eos] for x in inputs]
        o_n, s_n = naive_recurrent_kda(*seg, initial_state=h0[n : n + 1], output_final_state=True)
        o_parts.append(o_n)
        s_parts.append(s_n)
        loss = loss + (o_n * do[:, bos:eos]).sum() + (s_n * ds[n : n + 1]).sum()
    g_ref = torch.autograd.grad(loss, leaves)
    o_ref, s_ref = torch.cat(o_parts, dim=1), torch.cat(s_parts, dim=0)

    assert rel_rms(o_ref, o) < 1e-5
    assert rel_rms(s_ref, s) < 1e-5
    for n in range(N):  # every sequence's state individually
        assert rel_rms(s_ref[n], s[n]) < 1e-5, n
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < 1e-5, name


def test_varlen_chunk_matches_naive_varlen():
    lengths = [3, 130, 64, 1, 77]
    H, K, V = 2, 12, 20
    cu = cu_seqlens(lengths).long()
    inputs = make_inputs(1, sum(lengths), H, K, V, seed=5)
    for h0 in (None, make_state(len(lengths), H, K, V)):
        o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0, cu_seqlens=cu)
        o, s, g = run_with_grads(chunk_kda, inputs, h0, cu_seqlens=cu)
        assert rel_rms(o_ref, o) < 1e-5
        assert rel_rms(s_ref, s) < 1e-5
        for name, a, b in zip(GRAD_NAMES, g_ref, g):
            assert rel_rms(a, b) < 1e-5, name


def test_varlen_equal_lengths_equals_batch():
    B, T, H, K, V = 3, 70, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, seed=9)
    h0 = make_state(B, H, K, V)
    o_b, s_b = chunk_kda(*inputs, initial_state=h0, output_final_state=True)
    packed = [x.reshape((1, B * T) + tuple(x.shape[2:])) for x in inputs]
    o_p, s_p = chunk_kda(*packed, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens([T] * B))
    torch.testing.assert_close(o_p.reshape(o_b.shape), o_b, rtol=0, atol=1e-6)
    torch.testing.assert_close(s_p, s_b, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------
# causality
# --------------------------------------------------------------------------


def check_causal(fn, B: int, T: int, p: int, seeds: tuple[int, int]) -> None:
    """Inputs from position p on replaced: outputs and gradients before p unchanged, none after."""
    H, K, V = 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, seed=seeds[0])
    other = make_inputs(B, T, H, K, V, seed=seeds[1])
    perturbed = [
        torch.cat([a.detach()[:, :p], b.detach()[:, p:]], dim=1).requires_grad_() for a, b in zip(inputs, other)
    ]
    h0 = make_state(B, H, K, V).detach()

    def past_loss(xs):
        o, _ = fn(*xs, initial_state=h0)
        return o, (o[:, :p] * torch.linspace(-1, 1, V)).sum()

    o1, l1 = past_loss(inputs)
    o2, l2 = past_loss(perturbed)
    torch.testing.assert_close(o1[:, :p], o2[:, :p], rtol=0, atol=1e-6)
    g1 = torch.autograd.grad(l1, inputs)
    g2 = torch.autograd.grad(l2, perturbed)
    for name, a, b in zip(GRAD_NAMES, g1, g2):
        torch.testing.assert_close(a[:, :p], b[:, :p], rtol=0, atol=1e-6, msg=name)
        assert a[:, p:].abs().max() <= 1e-6, name


@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda], ids=["chunk", "naive"])
@pytest.mark.parametrize("p", [1, 40, 64, 100])
def test_causality(fn, p):
    check_causal(fn, B=1, T=150, p=p, seeds=(31, 32))


# --------------------------------------------------------------------------
# saturated gates (g at the K3 bound)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("span", ["tile", "chunk", "all"])
@pytest.mark.parametrize("gate", [G_MIN, G_MIN + 1e-6])
def test_saturated_gates(dtype, span, gate):
    B, T, H, K, V = 1, 200, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, seed=41)
    sl = {"tile": slice(80, 96), "chunk": slice(64, 128), "all": slice(0, T)}[span]
    with torch.no_grad():
        inputs[3][:, sl] = gate
    inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    h0 = make_state(B, H, K, V)
    ref_inputs, ref_h0 = as_fp32_leaves(inputs), h0.detach().clone().requires_grad_()
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, ref_h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0)

    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(x).all() for x in g)
    if dtype == torch.float32:
        tol = dict.fromkeys(GRAD_NAMES, 1e-5)
        if span == "all":
            # With every gate at the bound the true dg is ~1e3 times smaller
            # than the O(1) pair terms whose cancellation produces it, so its
            # relative error is float32 rounding of those terms (~1e-5).
            tol["dg"] = 5e-5
        tol_o = 1e-5
    else:
        tol = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dg": 2e-2, "dbeta": 2e-2, "dh0": 5e-3}
        tol_o = 5e-3
    assert rel_rms(o_ref, o) < tol_o
    assert rel_rms(s_ref, s) < tol_o
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < tol[name], name


# --------------------------------------------------------------------------
# unpadded fast path (no cu_seqlens, T a multiple of the chunk size: strided
# input views, no gather) and the hand-written backward
# --------------------------------------------------------------------------


@pytest.mark.parametrize("B,T,chunk_size", [(2, 256, 64), (1, 192, 64), (3, 96, 32), (2, 256, 128), (1, 48, 16)])
@pytest.mark.parametrize("K,V", [(16, 16), (12, 20)])
def test_fast_path_matches_naive(B, T, chunk_size, K, V):
    H = 2
    inputs = make_inputs(B, T, H, K, V, seed=B * T + K)
    h0 = make_state(B, H, K, V)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_rms(o_ref, o) < 1e-5
    assert rel_rms(s_ref, s) < 1e-5
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < 1e-5, name


def test_fast_path_equals_packed():
    # Same sequences through the strided fast path (batch) and the gather path (packed).
    B, T, H, K, V = 3, 128, 2, 16, 12
    inputs = make_inputs(B, T, H, K, V, seed=61)
    h0 = make_state(B, H, K, V)
    o_b, s_b, g_b = run_with_grads(chunk_kda, inputs, h0)
    packed = [x.detach().reshape((1, B * T) + tuple(x.shape[2:])).requires_grad_() for x in inputs]
    h0_p = h0.detach().clone().requires_grad_()
    o_p, s_p, g_p = run_with_grads(chunk_kda, packed, h0_p, cu_seqlens=cu_seqlens([T] * B))
    torch.testing.assert_close(o_p.reshape(o_b.shape), o_b, rtol=0, atol=1e-6)
    torch.testing.assert_close(s_p, s_b, rtol=0, atol=1e-6)
    for name, a, b in zip(GRAD_NAMES, g_b, g_p):
        assert rel_rms(a, b.reshape(a.shape)) < 1e-6, name


def test_fast_path_strided_inputs():
    # q, k, v as views of one fused projection and g, beta as strided slices,
    # as the model produces them: same result as contiguous copies.
    B, T, H, K = 2, 128, 2, 16
    gen = torch.Generator().manual_seed(71)
    qkv = F.normalize(torch.randn(B, T, H, 3, K, generator=gen), dim=-1).requires_grad_()
    gb = torch.randn(B, T, H, K + 1, generator=gen).requires_grad_()
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    act = torch.sigmoid(gb)
    g, beta = (G_MIN * act)[..., :K], act[..., K]
    assert not any(x.is_contiguous() for x in (q, k, v, g, beta))
    h0 = make_state(B, H, K, K)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    dense = [x.detach().contiguous().requires_grad_() for x in (q, k, v, g, beta)]
    o_d, s_d, g_d = run_with_grads(chunk_kda, dense, h0.detach().clone().requires_grad_())
    torch.testing.assert_close(o, o_d, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, s_d, rtol=0, atol=1e-6)
    # Gradients reach the fused leaves through the views.
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen)
    ds = torch.randn(s.shape, generator=gen)
    d_qkv, d_gb = torch.autograd.grad((o * do).sum() + (s * ds).sum(), [qkv, gb])
    for i, name in enumerate(["dq", "dk", "dv"]):
        assert rel_rms(g_d[i], d_qkv[:, :, :, i]) < 1e-6, name
    assert torch.isfinite(d_gb).all()


@pytest.mark.parametrize("needs", [(False, False, True, False, False), (True, False, False, True, False),
                                   (False, False, False, False, True)])
def test_partial_requires_grad(needs):
    B, T, H, K, V = 1, 128, 2, 16, 16
    base = [x.detach() for x in make_inputs(B, T, H, K, V, seed=81)]
    ours = [x.clone().requires_grad_(n) for x, n in zip(base, needs)]
    ref = [x.clone().requires_grad_(n) for x, n in zip(base, needs)]
    o, _ = chunk_kda(*ours)
    o_ref, _ = naive_recurrent_kda(*ref)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((o * do).sum(), [x for x in ours if x.requires_grad])
    want = torch.autograd.grad((o_ref * do).sum(), [x for x in ref if x.requires_grad])
    for a, b in zip(want, got):
        assert rel_rms(a, b) < 1e-5


def test_no_grad_inputs_build_no_graph():
    inputs = [x.detach() for x in make_inputs(1, 128, 2, 16, 16, seed=82)]
    o, s = chunk_kda(*inputs, initial_state=make_state(1, 2, 16, 16).detach(), output_final_state=True)
    assert not o.requires_grad and not s.requires_grad


def test_inplace_input_edit_after_forward_is_not_silent():
    # The fast path may read the inputs through views: editing one before the
    # backward must either raise or leave the gradients unchanged.
    inputs = make_inputs(1, 128, 2, 16, 16, seed=84)
    o, _ = chunk_kda(*inputs)
    (want,) = torch.autograd.grad(o.sum(), inputs[1], retain_graph=True)
    with torch.no_grad():
        inputs[2].add_(1.0)
    try:
        (got,) = torch.autograd.grad(o.sum(), inputs[1])
    except RuntimeError as err:
        assert "inplace" in str(err)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("p", [1, 40, 64, 100, 127])
def test_fast_path_causality(p):
    check_causal(chunk_kda, B=2, T=128, p=p, seeds=(33, 34))


@pytest.mark.parametrize("span", ["tile", "chunk", "all"])
def test_fast_path_saturated_gates(span):
    B, T, H, K, V = 1, 192, 2, 16, 16
    inputs = make_inputs(B, T, H, K, V, seed=42)
    sl = {"tile": slice(80, 96), "chunk": slice(64, 128), "all": slice(0, T)}[span]
    with torch.no_grad():
        inputs[3][:, sl] = G_MIN
    h0 = make_state(B, H, K, V)
    ref_inputs, ref_h0 = as_fp32_leaves(inputs), h0.detach().clone().requires_grad_()
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, ref_inputs, ref_h0)
    o, s, g = run_with_grads(chunk_kda, inputs, h0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert all(torch.isfinite(x).all() for x in g)
    tol = dict.fromkeys(GRAD_NAMES, 1e-5)
    if span == "all":  # see test_saturated_gates
        tol["dg"] = 5e-5
    assert rel_rms(o_ref, o) < 1e-5
    assert rel_rms(s_ref, s) < 1e-5
    for name, a, b in zip(GRAD_NAMES, g_ref, g):
        assert rel_rms(a, b) < tol[name], name


# --------------------------------------------------------------------------
# single-token decode step
# --------------------------------------------------------------------------


def test_step_matches_naive():
    B, T, H, K, V = 2, 20, 2, 16, 12
    q, k, v, g, beta = [x.detach() for x in make_inputs(B, T, H, K, V, seed=51)]
    h0 = make_state(B, H, K, V).detach()
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state = h0
    for t in range(T):
        before = state.clone()
        o_t, new_state = recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert torch.equal(state, before)  # input state untouched
        assert o_t.shape == (B, H, V) and new_state.dtype == torch.float32
        torch.testing.assert_close(o_t, o_ref[:, t], rtol=0, atol=1e-6)
        state = new_state
    torch.testing.assert_close(state, s_ref, rtol=0, atol=1e-6)


def test_prefill_then_decode_equals_full_chunk():
    B, T, T0, H, K, V = 2, 90, 70, 2, 16, 16
    q, k, v, g, beta = [x.detach() for x in make_inputs(B, T, H, K, V, seed=52)]
    h0 = make_state(B, H, K, V).detach()
    o_full, s_full = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_pre, state = chunk_kda(
        q[:, :T0], k[:, :T0], v[:, :T0], g[:, :T0], beta[:, :T0], initial_state=h0, output_final_state=True
    )
    outs = [o_pre]
    for t in range(T0, T):
        o_t, state = recurrent_kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o_t[:, None])
    o_cat = torch.cat(outs, dim=1)
    assert rel_rms(o_full, o_cat) < 1e-5
    assert rel_rms(s_full, state) < 1e-5


def test_pooled_decode_torch_path_updates_its_rows_in_place():
    """kda_decode on CPU tensors (the torch path): each live slot's row advances as recurrent_kda_step
    advances it, with the K3 pre-activations fused; a negative slot gives o = 0; no other row moves."""
    from kimik3.ops.kda import kda_decode, torch_preactivations

    B, H, K, V, P = 3, 2, 8, 12, 6
    gen = torch.Generator().manual_seed(7)
    q, k, z = (torch.randn(B, H, K, generator=gen) for _ in range(3))
    v, b = torch.randn(B, H, V, generator=gen), torch.randn(B, H, generator=gen)
    a_log, dtb = torch.rand(H, generator=gen), torch.randn(H, K, generator=gen)
    pool = torch.randn(P, H, K, V, generator=gen)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1])
    o = kda_decode(q, k, v, z, b, pool, slots, A_log=a_log, dt_bias=dtb, g_min=G_MIN, use_gate_in_kernel=True,
                   use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    qq, kk, gg, bb = torch_preactivations(q, k, z, b, a_log, dtb, G_MIN, True, True, True)
    o_ref, s_ref = recurrent_kda_step(qq, kk, v, gg, bb, before[slots.clamp_min(0)])
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert torch.count_nonzero(o[row]) == 0
        else:
            torch.testing.assert_close(o[row], o_ref[row], rtol=0, atol=1e-6)
            torch.testing.assert_close(pool[slot], s_ref[row], rtol=0, atol=1e-6)
    untouched = [s for s in range(P) if s not in (4, 1)]
    assert torch.equal(pool[untouched], before[untouched])


def test_pooled_decode_rejects_bad_inputs_on_the_torch_path():
    from kimik3.ops.kda import kda_decode

    q, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool = torch.zeros(3, 2, 8, 8)
    with pytest.raises(ValueError, match="state_pool must be float32"):
        kda_decode(q, q, v, q, torch.rand(2, 2), pool.double(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slots must be an integer"):
        kda_decode(q, q, v, q, torch.rand(2, 2), pool, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="use_gate_in_kernel needs"):
        kda_decode(q, q, v, q, torch.rand(2, 2), pool, torch.tensor([0, 1]), use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="slots is on meta but state_pool on cpu"):
        kda_decode(q, q, v, q, torch.rand(2, 2), pool, torch.tensor([0, 1], device="meta"))
    assert torch.count_nonzero(pool) == 0


def test_step_bf16_output_dtype():
    q, k, v, g, beta = [x.detach()[:, 0] for x in make_inputs(2, 1, 2, 8, 8, dtype=torch.bfloat16)]
    state = torch.zeros(2, 2, 8, 8)
    o, s = recurrent_kda_step(q, k, v, g, beta, state, scale=0.5)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


# --------------------------------------------------------------------------
# input validation
# --------------------------------------------------------------------------


def _bad_cases():
    B, T, H, K, V = 1, 10, 2, 4, 6
    q, k, v, g, beta = [x.detach() for x in make_inputs(B, T, H, K, V)]
    q2, k2, v2, g2, beta2 = [x.detach() for x in make_inputs(2, T, H, K, V)]
    cu = torch.tensor([0, 4, 10])
    nan_g = g.clone()
    nan_g[0, 3, 1, 2] = float("nan")
    inf_g = g.clone()
    inf_g[0, 0, 0, 0] = float("inf")
    return [
        ("q", dict(q=q[0])),
        ("q", dict(q=q.to(torch.int64))),
        ("k", dict(k=k[:, :5])),
        ("v", dict(v=v[:, :, :1])),
        ("v", dict(v=v[0])),
        ("g", dict(g=g[..., :2])),
        ("g", dict(g=nan_g)),
        ("g", dict(g=inf_g)),
        ("beta", dict(beta=beta[..., None])),
        ("initial_state", dict(initial_state=torch.zeros(2, H, K, V))),
        ("initial_state", dict(initial_state=torch.zeros(1, H, V, K))),
        ("initial_state", dict(cu_seqlens=cu, initial_state=torch.zeros(1, H, K, V))),
        ("cu_seqlens", dict(q=q2, k=k2, v=v2, g=g2, beta=beta2, cu_seqlens=torch.tensor([0, 5, 10]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([1, 4, 10]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 4, 9]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 6, 4, 10]))),
        ("cu_seqlens", dict(cu_seqlens=torch.tensor([[0, 10]]))),
        ("cu_seqlens", dict(cu_seqlens=[0, 10])),
    ], dict(q=q, k=k, v=v, g=g, beta=beta)


@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda], ids=["chunk", "naive"])
def test_invalid_inputs_raise(fn):
    cases, base = _bad_cases()
    for name, override in cases:
        args = dict(base)
        args.update(override)
        with pytest.raises(ValueError, match=name):
            fn(**args)


def test_invalid_chunk_size_raises():
    q, k, v, g, beta = [x.detach() for x in make_inputs(1, 10, 2, 4, 4)]
    for bad in (0, 40, -16, 16.0):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_kda(q, k, v, g, beta, chunk_size=bad)


def test_step_invalid_inputs_raise():
    B, H, K, V = 2, 2, 4, 6
    q, k, g = torch.randn(B, H, K), torch.randn(B, H, K), -torch.rand(B, H, K)
    v, beta, state = torch.randn(B, H, V), torch.rand(B, H), torch.zeros(B, H, K, V)
    base = dict(q=q, k=k, v=v, g=g, beta=beta, state=state)
    cases = [
        ("q", dict(q=q[None])),
        ("k", dict(k=k[:, :1])),
        ("v", dict(v=v[:1])),
        ("g", dict(g=g[..., :2])),
        ("beta", dict(beta=beta[:, None])),
        ("state", dict(state=state[:1])),
        ("state", dict(state=state.to(torch.int32))),
    ]
    for name, override in cases:
        args = dict(base)
        args.update(override)
        with pytest.raises(ValueError, match=name):
            recurrent_kda_step(**args)


def test_chunk_path_under_activation_checkpointing():
    """The torch chunk path inside torch.utils.checkpoint (what --activation-checkpointing wraps every block in) over
    two whole chunks (the strided path, which reads its inputs back from the saved tensors) gives the gradients of the
    plain call: its backward unpacks its saved inputs once (a second
    unpack of a checkpointed tensor is an error)."""
    from torch.utils.checkpoint import checkpoint

    inputs = [x.requires_grad_() for x in kda_inputs(1, 128, 2, 16, 16, seed=3)]  # T % 64 == 0: the strided path

    def run(*xs):
        o, s = chunk_kda(*xs, backend="torch", output_final_state=True)
        return o.sum() + (s * s).sum()

    plain = torch.autograd.grad(run(*inputs), inputs)
    checked = torch.autograd.grad(checkpoint(run, *inputs, use_reentrant=False), inputs)
    for a, b in zip(plain, checked):
        assert torch.equal(a, b)
