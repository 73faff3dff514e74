"""The Gluon KDA kernels (kimik3/ops/kda/gluon_wy.py for phase C, gluon_phase_a.py for phase A, gluon_local.py for
phases A-C in one kernel, gluon_scan.py for the split forward's state scan, gluon_bwd_scan.py for the backward's
state-gradient scan, gluon_bwd_intra.py for its intra-chunk gradients) against the Triton kernels they can replace.
Gluon does not run under the Triton interpreter: on the CPU a Gluon kernel runs through the Gluon emulator
(tests/gluon_emulator.py), the Triton kernel under the interpreter, and the Gluon kernels are also compiled for sm_90;
on a GPU both run."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from tests.numerics import cu_seqlens, rel_rms  # noqa: E402
from tests.triton_bounds import require_triton_kernels  # noqa: E402

if __name__ != "__main__":  # (the sm_90 compile step below runs without the interpreter)
    triton = require_triton_kernels()
import triton.language as tl  # noqa: E402

from kimik3.ops.kda import (gluon_bwd_intra, gluon_bwd_scan, gluon_bwd_wy, gluon_local, gluon_phase_a,  # noqa: E402
                            gluon_scan, gluon_wy)
from kimik3.ops.kda import triton_forward as tf  # noqa: E402
from kimik3.ops.kda.triton_backward import _bwd_dh_kernel, _drv_kernel, _dvn_local_kernel  # noqa: E402
from kimik3.ops.kda.triton_scan import _fwd_h_kernel, part_grid  # noqa: E402

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if torch.cuda.is_available() and not ON_GPU and __name__ != "__main__":
    pytest.skip("the Gluon kernels run on sm_90; on another GPU the Triton kernels compile for it and the CPU "
                "emulation has no interpreter to compare with", allow_module_level=True)
if not torch.cuda.is_available():
    from kimik3.ops.kda.triton_autograd import interpreter_bf16_fix

    interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)
DEV = "cuda" if ON_GPU else "cpu"
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _packed_plan(lengths):
    """The chunk plan of one packed batch of sequences of these lengths (varlen: cu_seqlens from the lengths)."""
    return tf.make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV))


def _chunk_bounds(plan):
    """Each global chunk's (first token, valid rows)."""
    cu, cidx = plan.cu.tolist(), plan.chunk_idx.reshape(-1).tolist()
    out = []
    for i_t in range(plan.NT):
        n, c = cidx[2 * i_t], cidx[2 * i_t + 1]
        t0 = cu[n] + 64 * c
        out.append((t0, min(cu[n + 1] - t0, 64)))
    return out


def _chunk_inputs(lengths, H, K, seed=0, gate_scale=0.3):
    """Phases A and C's inputs for a packed batch of sequences: bf16 q, k, v, the within-chunk cumulative log-decay
    Gamma (fp32, each chunk from zero; per-token decays in [-gate_scale, 0]), sigmoid(beta) (fp32), and a
    lower-triangular T per chunk and head."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    plan = _packed_plan(lengths)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).div(K**0.5).bfloat16().to(DEV) for _ in range(3))
    g = -torch.rand(1, T, H, K, generator=gen) * gate_scale
    G = torch.empty_like(g)
    for t0, L in _chunk_bounds(plan):
        G[:, t0:t0 + L] = g[:, t0:t0 + L].cumsum(1)
    beta = torch.rand(1, T, H, generator=gen).to(DEV)
    tinv = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV)
    return plan, q, k, v, G.to(DEV), beta, tinv


def _outputs(q, plan, H, K):
    """W, U, qg, kg, exp(Gamma_C), NaN-filled so that an element left unwritten shows."""
    w, qg, kg = (torch.full_like(q, float("nan")) for _ in range(3))
    u = torch.full(q.shape, float("nan"), device=q.device)
    return w, u, qg, kg, torch.full((plan.NT, H, K), float("nan"), device=q.device)


def _dh_scan_inputs(lengths, H, gen):
    """The state-gradient scan's inputs for a packed batch of sequences (K = V = 128): the plan, bf16 qg, kg, W (x 0.1)
    and dO, and each chunk's decay eg in [0.5, 1)."""
    K = V = 128
    T = sum(lengths)
    plan = _packed_plan(lengths)
    qg, kg, w = ((torch.randn(1, T, H, K, generator=gen) * 0.1).bfloat16().to(DEV) for _ in range(3))
    do = torch.randn(1, T, H, V, generator=gen).bfloat16().to(DEV)
    eg = (torch.rand(plan.NT, H, K, generator=gen) * 0.5 + 0.5).to(DEV)
    return plan, qg, kg, w, do, eg


def _run_here() -> dict:
    """A Gluon ``launch``'s keywords on this machine: the GPU as it is, or on the CPU the emulator with three
    persistent programs (so the 2-slot rings wrap and the programs take unequal item counts)."""
    if ON_GPU:
        return {}
    from tests.gluon_emulator import emulate

    return dict(launcher=emulate, programs=3)


def _launcher_here() -> dict:
    """``_run_here`` for a kernel launched on a fixed grid: the launcher alone (no persistent programs)."""
    return {k: v for k, v in _run_here().items() if k == "launcher"}


@pytest.mark.parametrize("lengths,H,K", [([1, 63, 64, 65, 130, 7], 2, 128), ([200], 3, 64)])
def test_gluon_phase_c_equals_the_triton_kernel(lengths, H, K):
    """Varlen with partial chunks and one-token sequences (a chunk's tiles then run into the next sequence), two
    column blocks (K = 128) and one (K = 64): every output written; W, qg, kg within one bf16 rounding of the
    Triton kernel's (or fp32 summation order at the output's scale); U and exp(Gamma_C) to fp32 rounding. On the
    CPU the Gluon kernel runs on three persistent programs, so its 2-slot ring wraps."""
    plan, q, k, v, G, beta, tinv = _chunk_inputs(lengths, H, K)
    ref, out = _outputs(q, plan, H, K), _outputs(q, plan, H, K)
    tf._launch_intra_wy(q, k, v, G, beta, tinv, *ref, plan, H, K, K, 64, 64, tl.bfloat16, "tf32", 4)
    assert gluon_wy.supported(q, k, v, G, tinv, *out[:4], tl.bfloat16) in (None, "a Hopper GPU (sm_90)")
    gluon_wy.launch(q, k, v, G, beta, tinv, *out, plan, H, K, **_run_here())
    for name, r, o in zip(("w", "u", "qg", "kg", "eg"), ref, out):
        assert not o.isnan().any(), f"{name}: {int(o.isnan().sum())} elements unwritten"
        d = (r.float() - o.float()).abs()
        if o.dtype == torch.bfloat16:  # one bf16 ulp, or fp32 summation order at the output's scale
            assert (d <= r.float().abs() * 2.0**-7 + 1e-6 * r.float().abs().max()).all(), (name, d.max().item())
        else:
            assert d.max() <= 1e-5 * r.float().abs().max(), (name, d.max().item())


@pytest.mark.parametrize("lengths,H,K", [([1, 63, 64, 65, 130, 7], 2, 128), ([200], 3, 64)])
def test_gluon_phase_c_without_u_stores_t_beta(lengths, H, K):
    """Phase C for a forward alone (``launch(u=None, tbeta=)``): W, qg, kg and exp(Gamma_C) bit-identical to the
    kernel's with U, and in U's place -T diag(beta) in bf16, each chunk's columns past its valid rows zero (so that
    the next sequence's v rows, which the scan's tile reads there, add nothing); exactly the torch rounding of it.
    Varlen with partial chunks and one-token sequences; on the CPU three persistent programs (the ring wraps)."""
    plan, q, k, v, G, beta, tinv = _chunk_inputs(lengths, H, K)
    ref, out = _outputs(q, plan, H, K), _outputs(q, plan, H, K)
    gluon_wy.launch(q, k, v, G, beta, tinv, *ref, plan, H, K, **_run_here())
    tb = torch.full((plan.NT, H, 64, 64), float("nan"), device=DEV).bfloat16()
    w, u, qg, kg, eg = out
    gluon_wy.launch(q, k, v, G, beta, tinv, w, None, qg, kg, eg, plan, H, K, tbeta=tb, **_run_here())
    for name, r, o in zip(("w", "qg", "kg", "eg"), (ref[0],) + ref[2:], (w, qg, kg, eg)):
        assert torch.equal(r, o), name
    assert u.isnan().all()  # (not written)
    expect = torch.zeros(plan.NT, H, 64, 64, device=DEV)
    for i_t, (t0, L) in enumerate(_chunk_bounds(plan)):
        expect[i_t, :, :, :L] = tinv[i_t, :, :, :L] * beta[0, t0:t0 + L].T[:, None, :]
    assert torch.equal(tb, (-expect).bfloat16())
    with pytest.raises(ValueError, match="one of the two"):
        gluon_wy.launch(q, k, v, G, beta, tinv, *ref, plan, H, K, tbeta=tb, **_run_here())


@pytest.mark.parametrize("lengths,H,K", [([1, 63, 64, 65, 130, 7], 2, 128), ([200], 3, 64)])
def test_gluon_phase_a_equals_the_triton_kernel(lengths, H, K):
    """Phase A (Aqk and the solve's input A = diag(beta) Akk) over varlen batches with partial chunks, per-token
    decays up to the bound (-5), K = 128 and 64: every entry written, zeros above the diagonal exact, the rest equal
    to the Triton kernel's to fp32 rounding (a bf16 operand can round the other way where the two exps differ in
    their last bit: 1e-3 of the largest entry)."""
    plan, q, k, v, G, beta, _ = _chunk_inputs(lengths, H, K, gate_scale=5.0)
    ref = [torch.full((plan.NT, H, 64, 64), float("nan"), device=DEV) for _ in range(2)]
    out = [torch.full((plan.NT, H, 64, 64), float("nan"), device=DEV) for _ in range(2)]
    tf._intra_a_kernel[part_grid(plan.NT, H, 4)](q, k, G, beta, *ref, plan.cu, plan.chunk_idx, H, K=K, BK=64,
                                                 DTA=tl.bfloat16, PREC="tf32", num_warps=4)
    assert gluon_phase_a.supported(q, k, G, tl.bfloat16) in (None, "a Hopper GPU (sm_90)")
    gluon_phase_a.launch(q, k, G, beta, *out, plan, H, K, **_run_here())
    for name, r, o in zip(("Aqk", "A"), ref, out):
        assert not o.isnan().any(), f"{name}: {int(o.isnan().sum())} entries unwritten"
        assert torch.equal(o.triu(1 if name == "Aqk" else 0), torch.zeros_like(o).triu(1 if name == "Aqk" else 0)), name
        assert (r - o).abs().max() <= 1e-3 * r.abs().max(), (name, (r - o).abs().max().item())


@pytest.mark.parametrize("lengths,H,gate_scale", [([1, 63, 64, 65, 130, 7], 2, 5.0), ([200], 1, 0.3)])
def test_gluon_local_equals_the_split_kernels(lengths, H, gate_scale):
    """Phases A, B, C in one kernel (``gluon_local``) against the three split kernels (Triton phase A and solve,
    Triton phase C) on varlen batches with partial chunks and one-token sequences, per-token decays up to the bound:
    every output written; Aqk, T, W, U, qg, kg as close to the split kernels' as their bf16 operands allow (the
    column tiles are referenced at another token, T is solved by tf32 doubling instead of fp32 substitution), and
    exp(Gamma_C) to fp32 rounding. T is written only when asked for."""
    K = 128
    plan, q, k, v, G, beta, _ = _chunk_inputs(lengths, H, K, gate_scale=gate_scale)
    nan = lambda: torch.full((plan.NT, H, 64, 64), float("nan"), device=DEV)  # noqa: E731
    ref_aqk, ref_t, out_aqk, out_t = nan(), nan(), nan(), nan()
    ref, out = _outputs(q, plan, H, K), _outputs(q, plan, H, K)
    tf._launch_split_intra(q, k, v, G, beta, ref_aqk, ref_t, *ref, plan, H, K, K, K, 64, 64, tl.bfloat16, tl.bfloat16,
                           "tf32", "tf32")
    assert gluon_local.supported(q, k, v, G, *ref[:4], tl.bfloat16, tl.bfloat16) in (None, "a Hopper GPU (sm_90)")
    gluon_local.launch(q, k, v, G, beta, out_aqk, out_t, *out, plan, H, True, **_run_here())
    for name, r, o, tol in zip(("Aqk", "T", "w", "u", "qg", "kg", "eg"), (ref_aqk, ref_t, *ref), (out_aqk, out_t, *out),
                               (5e-3, 2e-3, 1e-2, 1e-2, 5e-3, 5e-3, 1e-6)):
        assert not o.isnan().any(), f"{name}: {int(o.isnan().sum())} elements unwritten"
        err = rel_rms(r.float(), o.float())
        assert err <= tol, (name, err)
    assert torch.equal(out_aqk.triu(1), torch.zeros_like(out_aqk).triu(1))
    assert torch.equal(out_t.triu(1), torch.zeros_like(out_t).triu(1))
    kept = nan()
    gluon_local.launch(q, k, v, G, beta, out_aqk, kept, *out, plan, H, False, **_run_here())
    assert kept.isnan().all()


def _scan_inputs(lengths, H, V, seed=0):
    """The state scan's inputs for a packed batch: bf16 W and kg, fp32 U, chunk decays exp(Gamma_C) in [0.5, 1), an
    fp32 initial state per sequence."""
    gen = torch.Generator().manual_seed(seed)
    K, T = 128, sum(lengths)
    plan = _packed_plan(lengths)
    w, kg = ((torch.randn(1, T, H, K, generator=gen) * 0.1).bfloat16().to(DEV) for _ in range(2))
    u = torch.randn(1, T, H, V, generator=gen).to(DEV)
    eg = (torch.rand(plan.NT, H, K, generator=gen) * 0.5 + 0.5).to(DEV)
    return plan, w, kg, u, eg, torch.randn(len(lengths), H, K, V, generator=gen).to(DEV)


def _output_operands(plan, H, T, gen):
    """The scan's output operands at random: bf16 qg (x 0.1) in token layout and a lower-triangular fp32 Aqk (x 0.2)."""
    qg = (torch.randn(1, T, H, 128, generator=gen) * 0.1).bfloat16().to(DEV)
    return qg, (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.2).to(DEV)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("lengths,H,V,with_states", [([1, 63, 64, 65, 130, 7], 2, 128, True), ([200], 1, 64, False)])
def test_gluon_scan_equals_the_triton_kernel(lengths, H, V, with_states, shared, monkeypatch):
    """The split forward's state scan over varlen batches with partial chunks and one-token sequences (a chunk's
    TMA tiles then run into the next sequence), with and without initial / final states, V = 128 (two programs per
    head) and 64: every stored state, v_new and final state written, and equal to the Triton kernel's to within one
    bf16 rounding of the state at the output's scale (the two sum the state update in another order, so a stored
    16-bit state can round the other way, and v_new after it). Both forms: a CTA per 64-column half of V, or both
    halves in one CTA sharing the loads (V = 128)."""
    monkeypatch.setattr(gluon_scan, "SHARED_HALVES", shared)
    plan, w, kg, u, eg, h0 = _scan_inputs(lengths, H, V)
    K, N, T = 128, len(lengths), sum(lengths)
    res = []
    for gluon in (False, True):
        h = torch.full((plan.NT, H, K, V), float("nan"), device=DEV).bfloat16()
        vn = torch.full((1, T, H, V), float("nan"), device=DEV)
        ht = torch.full((N, H, K, V), float("nan"), device=DEV) if with_states else None
        if gluon:
            gluon_scan.launch(kg, eg, w, u, h0 if with_states else None, h, vn, ht, plan, H, K, V,
                              **_launcher_here())
        else:
            _fwd_h_kernel[(V // 64, N * H)](kg, eg, w, u, h0, h, vn, ht if with_states else u, plan.cu, plan.chunk_off,
                                            H, K=K, V=V, BKF=K, BV=64, PREC="tf32", HAS_H0=with_states,
                                            STORE_HT=with_states, INTERP=not ON_GPU, DT=tl.bfloat16, HILO=True,
                                            num_warps=4)
        res.append((h, vn, ht))
    assert gluon_scan.supported(w, kg, u, res[1][0], True) in (None, "a Hopper GPU (sm_90)")
    for name, r, o in zip(("h", "v_new", "final state"), *res):
        if r is None:
            continue
        assert not o.float().isnan().any(), f"{name}: {int(o.float().isnan().sum())} elements unwritten"
        d = (r.float() - o.float()).abs().max()
        assert d <= 2.0**-8 * r.float().abs().max(), (name, d.item())


@pytest.mark.parametrize("store,o_dtype", [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("lengths,H,V,with_states", [([1, 63, 64, 65, 130, 7], 2, 128, True), ([200], 1, 64, False)])
def test_gluon_scan_with_the_output_equals_the_output_kernel(lengths, H, V, with_states, shared, store, o_dtype,
                                                             monkeypatch):
    """The scan computing the output itself (``launch(qg=, aqk=, o=)``) against ``_output_kernel`` run on the
    states-only scan's stored states and v_new (which the test above holds to the Triton scan): every output row
    written and equal to the output kernel's to fp32 summation order (an fp32 o, where the remainders' products, 2^-9
    of the output, show) or within one bf16 rounding (a bf16 o); store: the stored states, v_new and final state as
    well, bit-identical to the states-only scan's (the output's products leave the chain alone), else none stored.
    Varlen with partial chunks and one-token sequences (a chunk's qg tile then runs into the next sequence), V = 128
    and 64, both CTA forms."""
    from kimik3.ops.kda.triton_scan import _output_kernel

    monkeypatch.setattr(gluon_scan, "SHARED_HALVES", shared)
    plan, w, kg, u, eg, h0 = _scan_inputs(lengths, H, V, seed=1)
    gen = torch.Generator().manual_seed(2)
    K, N, T = 128, len(lengths), sum(lengths)
    qg, aqk = _output_operands(plan, H, T, gen)
    scale = K**-0.5
    launcher = _launcher_here()

    def states():
        return (torch.full((plan.NT, H, K, V), float("nan"), device=DEV).bfloat16(),
                torch.full((1, T, H, V), float("nan"), device=DEV),
                torch.full((N, H, K, V), float("nan"), device=DEV) if with_states else None)

    h, vn, ht = states()
    gluon_scan.launch(kg, eg, w, u, h0 if with_states else None, h, vn, ht, plan, H, K, V, **launcher)
    o_ref = torch.full((1, T, H, V), float("nan"), device=DEV, dtype=o_dtype)
    _output_kernel[(V // 64, plan.NT, H)](qg, aqk, h, vn, o_ref, plan.cu, plan.chunk_idx, H, scale, K=K, V=V, BKF=K,
                                          BV=64, PREC="tf32", DT=tl.bfloat16, HILO=True, num_warps=4)
    o = torch.full_like(o_ref, float("nan"))
    h1, vn1, ht1 = states()
    gluon_scan.launch(kg, eg, w, u, h0 if with_states else None, h1 if store else None, vn1 if store else None, ht1,
                      plan, H, K, V, qg=qg, aqk=aqk, o=o, scale=scale, **launcher)
    assert not o.float().isnan().any(), f"o: {int(o.float().isnan().sum())} elements unwritten"
    d = (o_ref.float() - o.float()).abs()
    if o_dtype == torch.float32:
        assert d.max() <= 1e-5 * o_ref.abs().max(), d.max().item()
    else:
        assert (d <= 2.0**-7 * o_ref.float().abs() + 1e-5 * o_ref.float().abs().max()).all(), d.max().item()
    if store:
        assert torch.equal(h1, h) and torch.equal(vn1, vn)
    else:
        assert h1.float().isnan().all() and vn1.isnan().all()  # nothing stored
    assert ht1 is None or torch.equal(ht1, ht)
    assert gluon_scan.supported(w, kg, u, None, True, qg) in (None, "a Hopper GPU (sm_90)")


@pytest.mark.parametrize("shared,store", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("lengths,H,V,with_states", [([1, 63, 64, 65, 130, 7], 2, 128, True), ([200], 1, 64, False)])
def test_gluon_scan_forming_u_equals_the_scan_reading_it(lengths, H, V, with_states, shared, store, monkeypatch):
    """The scan with the output forming U = T (beta v) itself from -T diag(beta) and v (``launch(u=None, tbeta=,
    v=)``), against the same scan reading the U that torch forms from the same bf16 operands: o (fp32) within fp32
    summation order, up to where a chunk's 16-bit state copy rounds the other way (one bf16 rounding of the state at
    the output's scale), the final state, and (store) the stored states and v_new likewise. -T diag(beta)'s columns
    past a chunk's valid rows are zero, as phase C stores them, so the next sequence's v rows under the scan's v tile
    add nothing; past the tensor's end the tile is TMA's zeros. Varlen with partial chunks and one-token sequences, V =
    128 and 64, both CTA forms."""
    monkeypatch.setattr(gluon_scan, "SHARED_HALVES", shared)
    plan, w, kg, _, eg, h0 = _scan_inputs(lengths, H, V, seed=3)
    gen = torch.Generator().manual_seed(4)
    K, N, T = 128, len(lengths), sum(lengths)
    qg, aqk = _output_operands(plan, H, T, gen)
    v = torch.randn(1, T, H, V, generator=gen).bfloat16().to(DEV)
    tb = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * -0.3).bfloat16().to(DEV)
    u = torch.zeros(1, T, H, V, device=DEV)
    v_pad = torch.cat([v.float(), torch.zeros(1, 64, H, V, device=DEV)], 1)
    for i_t, (t0, L) in enumerate(_chunk_bounds(plan)):
        tb[i_t, :, :, L:] = 0
        u[0, t0:t0 + L] = -torch.einsum("hij,jhv->ihv", tb[i_t, :, :L].float(), v_pad[0, t0:t0 + 64])
    res = []
    for form in ("read", "formed"):
        o = torch.full((1, T, H, V), float("nan"), device=DEV)
        h = torch.full((plan.NT, H, K, V), float("nan"), device=DEV).bfloat16() if store else None
        vn = torch.full((1, T, H, V), float("nan"), device=DEV) if store else None
        ht = torch.full((N, H, K, V), float("nan"), device=DEV) if with_states else None
        kw = dict(qg=qg, aqk=aqk, o=o, scale=K**-0.5, **_launcher_here())
        if form == "formed":
            kw.update(tbeta=tb, v=v)
        gluon_scan.launch(kg, eg, w, u if form == "read" else None, h0 if with_states else None, h, vn, ht, plan, H,
                          K, V, **kw)
        res.append((o, ht, h, vn))
    for name, r, x in zip(("o", "final state", "h", "v_new"), *res):
        if r is None:
            continue
        assert not x.float().isnan().any(), f"{name}: {int(x.float().isnan().sum())} elements unwritten"
        assert (r.float() - x.float()).abs().max() <= 2.0**-8 * r.float().abs().max(), name
    with pytest.raises(ValueError, match="both needed"):
        gluon_scan.launch(kg, eg, w, None, None, None, None, None, plan, H, K, V, qg=qg, aqk=aqk, o=res[0][0],
                          tbeta=tb)


@pytest.mark.skipif(not ON_GPU, reason="the whole forward on the Gluon kernels needs sm_90")
@pytest.mark.parametrize("switch", ["GLUON_SCAN_OUT", "GLUON_SCAN_U", "GLUON_LOCAL", "CHUNK16"])
@pytest.mark.parametrize("grad", [False, True])
def test_gpu_forward_with_and_without_a_gluon_form(grad, switch, monkeypatch):
    """``chunk_kda`` under K3's contract (bf16, B1 T2048 H8 D128, varlen) with the Gluon kernels forced on at this
    size, with a form switched on and off: the output computed in the scan (``GLUON_SCAN_OUT``) against the output
    kernel after it, phases A-C in one kernel (``GLUON_LOCAL``) against the split kernels (both with U from phase C,
    so that the two runs round alike: outputs within 2e-3 relative RMS, the final states identical for the output's
    form, within 2e-3 for the local form's tf32 solve), and U formed in the scan (``GLUON_SCAN_U``, a forward alone's)
    against U from phase C: it rounds T diag(beta) where phase C rounds T and beta v, which moves a bf16 o by about
    one rounding (3e-3 relative RMS), so both runs are held to the fp32 torch path instead, the new no less accurate
    (1.05x the other's error); so is the forward on 16-token tiles (``CHUNK16``, a forward alone's; with the
    backward both runs take the 64-token kernels). grad: with the backward (gradients within 2e-3 of the other run's),
    else a forward alone."""
    from kimik3.ops.kda import chunk_kda

    monkeypatch.setattr(tf, "GLUON_MIN_ITEMS", 0)
    monkeypatch.setattr(tf, "GLUON_SCAN_MIN_ITEMS", 0)
    monkeypatch.setattr(tf, "GLUON_SCAN_U", False)
    monkeypatch.setattr(tf, "CHUNK16", False)
    gen = torch.Generator(device=DEV).manual_seed(11)
    T, H, D = 2048, 8, 128
    xs = [torch.randn(1, T, H, D, generator=gen, device=DEV).bfloat16() for _ in range(4)]
    xs.append(torch.randn(1, T, H, generator=gen, device=DEV).bfloat16())
    a_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=gen))
    dtb = torch.randn(H, D, generator=gen, device=DEV) * 0.5
    cu = cu_seqlens([700, 1, 1347], DEV)
    do = torch.randn(1, T, H, D, generator=gen, device=DEV).bfloat16()
    kw = dict(A_log=a_log, dt_bias=dtb, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=cu, output_final_state=True)

    def run(backend, on):
        monkeypatch.setattr(tf, switch, on)
        leaves = [x.clone().requires_grad_(grad) for x in xs]
        o, s = chunk_kda(*(x.float() if backend == "torch" else x for x in leaves), backend=backend, **kw)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype)) if grad else ()
        return o, s, grads

    (o1, s1, g1), (o0, s0, g0), (o_ref, s_ref, _) = run("triton", True), run("triton", False), run("torch", False)
    assert not o1.isnan().any() and rel_rms(o_ref, o1) < 1e-2 and rel_rms(s_ref, s1) < 5e-3
    if switch in ("GLUON_SCAN_U", "CHUNK16"):
        assert rel_rms(o_ref, o1) <= 1.05 * rel_rms(o_ref, o0) and rel_rms(s_ref, s1) <= 1.05 * rel_rms(s_ref, s0)
        assert rel_rms(o0, o1) < 6e-3
    else:
        assert rel_rms(o0, o1) < 2e-3
        assert torch.equal(s1, s0) if switch == "GLUON_SCAN_OUT" else rel_rms(s0, s1) < 2e-3
    for a, b in zip(g1, g0):
        assert rel_rms(b, a) < 2e-3


@pytest.mark.parametrize("local,drv", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("lengths,H,with_states", [([1, 63, 64, 65, 130, 7], 2, True), ([200], 1, False)])
def test_gluon_state_gradient_scan_equals_the_triton_kernel(lengths, H, with_states, local, drv):
    """The backward's state-gradient scan (K = V = 128, the in-place form) over varlen batches with partial chunks
    and one-token sequences (the TMA tiles of a sequence's last chunk run into the next one), with and without the
    final state's gradient and dh0: every chunk's dS, dv_new and dh0 written, equal to the Triton kernel's to fp32
    summation order at the output's scale (the two carry the chain in units a power of two apart). local: the
    scan computes dv_new's part scale Aqk^T dO itself (from Aqk, into a dv_new buffer of NaN) where the Triton path
    has ``_dvn_local_kernel`` fill the buffer first. drv: the scan stores dRv = T^T dv_new in dv_new's place (16-bit
    high and low parts), against ``_drv_kernel`` (tf32) over the Triton scan's dv_new."""
    gen = torch.Generator().manual_seed(0)
    K = V = 128
    N, T = len(lengths), sum(lengths)
    plan, qg, kg, w, do, eg = _dh_scan_inputs(lengths, H, gen)
    scale = K**-0.5
    dscale = 2.0 ** (math.frexp(scale)[1] - 1)
    if local:  # Aqk lower triangular, its rows past a chunk's valid ones not zero (nothing may read them)
        aqk = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV)
        dv_local = torch.empty(1, T, H, V, device=DEV)
        _dvn_local_kernel[part_grid(plan.NT, H, 2)](aqk, do, dv_local, plan.cu, plan.chunk_idx, H, dscale, V=V, BV=64,
                                                    NV=2, PREC="tf32", DT=tl.bfloat16, num_warps=4)
    else:  # what _dvn_local_kernel leaves, at random
        aqk, dv_local = None, (torch.randn(1, T, H, V, generator=gen) * dscale).to(DEV)
    dht = torch.randn(N, H, K, V, generator=gen).to(DEV) if with_states else None
    tinv = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV) if drv else None
    res = []
    for gluon in (False, True):
        dh = torch.full((plan.NT, H, K, V), float("nan"), device=DEV)
        dvn = torch.full_like(dv_local, float("nan")) if gluon and local else dv_local.clone()
        dh0 = torch.full((N, H, K, V), float("nan"), device=DEV) if with_states else None
        if gluon:
            gluon_bwd_scan.launch(qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, scale, dscale, aqk=aqk, tinv=tinv,
                                  **_launcher_here())
        else:
            _bwd_dh_kernel[(V // 64, N * H)](qg, kg, eg, w, do, dht if with_states else dh, dh, dvn,
                                             dh0 if with_states else dh, plan.cu, plan.chunk_off, H, float(scale),
                                             dscale, K=K, V=V, BKF=K, BV=64, PREC="tf32", HAS_DHT=with_states,
                                             STORE_DH0=with_states, INTERP=not ON_GPU, DT=tl.bfloat16, ACC=True,
                                             num_warps=4)
            if drv:
                _drv_kernel[part_grid(plan.NT, H, 2)](tinv, dvn, plan.cu, plan.chunk_idx, H, V=V, BV=64, NV=2,
                                                      PREC="tf32", num_warps=4)
        res.append((dh, dvn, dh0))
    assert gluon_bwd_scan.supported(qg, kg, w, do, True) in (None, "a Hopper GPU (sm_90)")
    for name, r, o in zip(("dS", "dRv" if drv else "dv_new", "dh0"), *res):
        if r is None:
            continue
        assert not o.isnan().any(), f"{name}: {int(o.isnan().sum())} elements unwritten"
        d = (r - o).abs().max()
        assert d <= 2e-3 * r.abs().max(), (name, d.item())


@pytest.mark.parametrize("fused,dk_smem", [(True, True), (True, False), (False, True)],
                         ids=["fused", "fused-dk-global", "unfused"])
@pytest.mark.parametrize("lengths,H,npart", [([1, 63, 64, 65, 130, 7], 2, 3), ([200], 3, 1),
                                             ([1, 63, 64, 65, 130, 7], 2, 1)])
def test_gluon_intra_backward_equals_the_triton_kernel(monkeypatch, lengths, H, npart, fused, dk_smem):
    """The backward's intra-chunk gradients (kernel 4, then the suffix-sum pass, through ``bwd_intra``) with the
    Gluon kernel against the Triton "rows" kernel: varlen batches with partial chunks and one-token sequences (a
    chunk's TMA tiles run into the next sequence), per-token decays up to the bound, dA as three partials or one
    (dbeta then updated in place), with the fused L2 norm, sigmoid and gate chain rules and without, dk's row term
    through shared memory (``DK_SMEM``, one partial only) or global memory. Every gradient within
    2e-3 (relative RMS) of the Triton kernel's on the GPU, where its products are tf32 and the Gluon kernel's three
    16-bit ones (about 16 mantissa bits); on the CPU, where the interpreter's products are fp32, within 1e-4 (the
    emulated kernel: 4e-5 at most; every rescale between tiles off by 1e-3 moves dq by 1.8e-4)."""
    from kimik3.ops.kda import triton_bwd_intra as tbi
    from kimik3.ops.kda.triton_preact import PreactInputs

    K = 128
    plan, q, k, _, G, beta, _ = _chunk_inputs(lengths, H, K, gate_scale=5.0)
    gen = torch.Generator().manual_seed(1)
    T = sum(lengths)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEV)

    daqk = rand(plan.NT, H, 64, 64).tril()
    da = rand(npart, plan.NT, H, 64, 64).tril(-1) / npart
    grads = [rand(1, T, H, K) for _ in range(3)] + [rand(npart, 1, T, H)]  # the WY kernel's dq, dk, dGamma, dbeta
    preact = PreactInputs(q=rand(1, T, H, K, dtype=torch.bfloat16), k=rand(1, T, H, K, dtype=torch.bfloat16),
                          z=rand(1, T, H, K, dtype=torch.bfloat16), beta=rand(1, T, H, dtype=torch.bfloat16),
                          A_log=rand(H), dt_bias=rand(H * K), g_min=-5.0, use_gate=True, use_l2=True,
                          use_beta_sigmoid=True) if fused else None
    here = _run_here()
    monkeypatch.setattr(gluon_bwd_intra, "DK_SMEM", dk_smem)

    class Emulated:  # the Gluon module as ``bwd_intra`` finds it, launched here (on the CPU: the emulator)
        supported = staticmethod(gluon_bwd_intra.supported)

        @staticmethod
        def launch(*a, **kw):
            gluon_bwd_intra.launch(*a, **kw, **here)

    res = []
    for gluon in (False, True):
        monkeypatch.setattr(tbi, "GLUON_INTRA", gluon)
        monkeypatch.setattr(tbi, "_gluon_taking", lambda name, on, *a, **k: Emulated if on else None)
        dq, dk, dg, dbeta_parts = (x.clone() for x in grads)
        dbeta = dbeta_parts[0] if npart == 1 else torch.zeros(1, T, H, device=DEV)
        out = tbi.bwd_intra(q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta, plan, npart, "tf32",
                            preact=preact)
        res.append(out[:4] if fused else (dq, dk, dg, dbeta))
    assert gluon_bwd_intra.supported(q, k, G, npart) in (None, "a Hopper GPU (sm_90)")
    for name, r, o in zip(("dq", "dk", "dz" if fused else "dg", "dbeta"), *res):
        assert r.dtype == o.dtype, name
        err = ((r.float() - o.float()).norm() / r.float().norm()).item()
        assert err < (2e-3 if ON_GPU else 1e-4), (name, err)


def test_supported_names_what_it_needs():
    """Where the Gluon kernel does not apply, ``supported`` says why (the Triton kernel then runs)."""
    plan, q, k, v, G, beta, tinv = _chunk_inputs([64], 1, 64)
    w, u, qg, kg, _ = _outputs(q, plan, 1, 64)
    assert "K == V" in gluon_wy.supported(q, k, v[..., :32], G, tinv, w, u, qg, kg, tl.bfloat16)
    assert "bf16" in gluon_wy.supported(q.float(), k, v, G, tinv, w, u, qg, kg, tl.bfloat16)
    assert "bf16" in gluon_wy.supported(q, k.float(), v, G, tinv, w, u, qg, kg, tl.bfloat16)
    assert "16-bit WY" in gluon_wy.supported(q, k, v, G, tinv, w, u, qg, kg, tl.float32)
    assert "fp32" in gluon_wy.supported(q, k, v, G, tinv, w.float(), u, qg, kg, tl.bfloat16)
    assert "multiple of 64" in gluon_phase_a.supported(q[..., :32], k, G, tl.bfloat16)
    assert "16-bit A" in gluon_phase_a.supported(q, k, G, tl.float32)
    assert "K = V = 128" in gluon_local.supported(q, k, v, G, w, u, qg, kg, tl.bfloat16, tl.bfloat16)
    plan128, q128, k128, v128, G128, _, _ = _chunk_inputs([64], 1, 128)
    w128, u128, qg128, kg128, _ = _outputs(q128, plan128, 1, 128)
    local = (q128, k128, v128, G128, w128, u128, qg128, kg128)
    assert "16-bit A and WY" in gluon_local.supported(*local, tl.float32, tl.bfloat16)
    assert "bf16 inputs" in gluon_local.supported(q128.float(), *local[1:], tl.bfloat16, tl.bfloat16)
    assert "fp32" in gluon_local.supported(*local[:4], w128.float(), *local[5:], tl.bfloat16, tl.bfloat16)
    hs = torch.zeros(plan.NT, 1, 128, 64, device=DEV).bfloat16()
    wk, us = torch.zeros(1, 64, 1, 128, device=DEV).bfloat16(), torch.zeros(1, 64, 1, 64, device=DEV)
    assert "K = 128" in gluon_scan.supported(q, k, us, hs, True)
    assert "fp32 U" in gluon_scan.supported(wk, wk, us.bfloat16(), hs, True)
    assert "fp32 U" in gluon_scan.supported(wk, wk, us, hs.float(), True)
    assert "high and low" in gluon_scan.supported(wk, wk, us, hs, False)
    huge = hs.expand(2**24, 1, 128, 64)  # 2^31 state rows, as a view (no memory)
    assert "2^31" in gluon_scan.supported(wk, wk, us, huge, True)
    assert "qg" in gluon_scan.supported(wk, wk, us, None, True, wk.float())  # (the output's qg)
    many_chunks = torch.zeros(1, 1, 1, 64, 64, device=DEV).expand(2**25, 1, 1, 64, 64)  # 2^31 Aqk rows, a view
    assert "2^31 rows of Aqk" in gluon_scan.supported(wk, wk, us, None, True, wk, many_chunks)
    for kw, why in ((dict(vn=us), "together"), (dict(o=us), "needs qg and Aqk"), ({}, "must compute the output")):
        with pytest.raises(ValueError, match=why):  # (refused before anything is launched)
            gluon_scan.launch(wk, None, wk, us, None, None, kw.pop("vn", None), None, plan, 1, 128, 64, **kw)
    assert "K = V = 128" in gluon_bwd_scan.supported(wk, wk, wk, us.bfloat16(), True)
    assert "bf16" in gluon_bwd_scan.supported(wk, wk, wk.float(), wk, True)
    assert "in-place" in gluon_bwd_scan.supported(wk, wk, wk, wk, False)
    st16, st32 = torch.zeros(1, 1, 128, 128, device=DEV).bfloat16(), torch.zeros(1, 1, 128, 128, device=DEV)
    wy_args = [wk, wk, wk, wk, wk, st16, wk.float(), wk.float(), wk.float(), st32]  # q k v dO W h G U v_new dh
    assert "K = V = 128" in gluon_bwd_wy.supported(*wy_args[:2], us.bfloat16(), *wy_args[3:])
    assert "bf16" in gluon_bwd_wy.supported(*wy_args[:5], st32, *wy_args[6:])
    assert "fp32" in gluon_bwd_wy.supported(*wy_args[:9], st16)  # (a 16-bit dh, ``DH_16BIT``)
    many = st16.expand(2**19, 1, 128, 128)  # 2^19 (chunk, head) items: dAqk's 2^31 elements, as a view
    assert "dAqk" in gluon_bwd_wy.supported(*wy_args[:5], many, *wy_args[6:])
    if not ON_GPU:
        assert gluon_bwd_wy.supported(*wy_args) == "a Hopper GPU (sm_90)"
        assert gluon_bwd_scan.supported(wk, wk, wk, wk, True) == "a Hopper GPU (sm_90)"
        assert gluon_scan.supported(wk, wk, us, hs, True) == "a Hopper GPU (sm_90)"
        assert gluon_wy.supported(q, k, v, G, tinv, w, u, qg, kg, tl.bfloat16) == "a Hopper GPU (sm_90)"
        assert gluon_phase_a.supported(q, k, G, tl.bfloat16) == "a Hopper GPU (sm_90)"
        assert gluon_local.supported(*local, tl.bfloat16, tl.bfloat16) == "a Hopper GPU (sm_90)"


def test_gluon_dispatch_needs_cuda_the_switch_and_enough_work():
    """``triton_forward._gluon_for``: a Gluon kernel is considered only for CUDA tensors, with its switch on, and
    from ``GLUON_MIN_ITEMS`` work items up, or its own threshold (below, a host-bound call would lose more to the
    launch than it gains)."""
    class Cuda:
        is_cuda = True

    n = tf.GLUON_MIN_ITEMS
    assert tf._gluon_for("gluon_wy", True, Cuda(), n) is gluon_wy
    assert tf._gluon_for("gluon_wy", True, Cuda(), n - 1) is None
    assert tf._gluon_for("gluon_wy", False, Cuda(), n) is None
    assert tf._gluon_for("gluon_wy", True, torch.zeros(1), n) is None
    assert tf._gluon_for("gluon_scan", True, Cuda(), n, min_items=n + 1) is None  # a kernel's own threshold
    assert tf._gluon_for("gluon_scan", True, Cuda(), n + 1, min_items=n + 1) is gluon_scan


def test_gluon_taking_asks_the_kernel_too(monkeypatch):
    """``triton_forward._gluon_taking``: ``_gluon_for``'s conditions on its arguments' first tensor, then the
    kernel's own ``supported`` on all of them; a reason from it leaves the call to the Triton kernel."""
    class Cuda:
        is_cuda = True

    seen = []
    monkeypatch.setattr(gluon_scan, "supported", lambda *a: seen.append(a) or ("no" if a[1] == "bad" else None))
    n, x = tf.GLUON_MIN_ITEMS, Cuda()
    assert tf._gluon_taking("gluon_scan", True, n, (x, "good")) is gluon_scan
    assert tf._gluon_taking("gluon_scan", True, n, (x, "bad")) is None
    assert seen == [(x, "good"), (x, "bad")]
    assert tf._gluon_taking("gluon_scan", True, n - 1, (x, "good")) is None  # below the threshold: not asked
    assert tf._gluon_taking("gluon_scan", True, n, (torch.zeros(1), "good")) is None
    assert len(seen) == 2


@pytest.mark.parametrize("lengths,H", [([1, 63, 64, 65, 130, 7], 2), ([200], 1)])
def test_gluon_wy_backward_equals_the_triton_kernel(monkeypatch, lengths, H):
    """The Triton backward (``kda_bwd_triton``, bf16, K = V = 128, from the Triton forward's saved tensors) with the WY
    backward by the Gluon kernel (``triton_backward.GLUON_WY_BWD``: dA and dbeta whole, one partial for the intra
    backward) against the Triton WY kernel (three partials): varlen batches with partial chunks and one-token
    sequences (a chunk's TMA tiles run into the next sequence), with initial states and final-state gradients (so that
    every chunk's h and dh, and deg = rowsum(h dh), are nonzero). Every gradient within 1e-4 (relative RMS) of the
    Triton path's on the CPU, where the interpreter's products are fp32 and the emulator's are made exact too (its
    tf32 rounding off; the Gluon kernel's 16-bit splits hold ~16 mantissa bits); within 2e-3 on the GPU, where both
    take tf32 products."""
    from kimik3.ops.kda import gluon_bwd_wy
    from kimik3.ops.kda import triton_backward as tb
    from tests import gluon_emulator

    K = 128
    gen = torch.Generator().manual_seed(3)
    T = sum(lengths)
    plan = _packed_plan(lengths)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).div(K**0.5).bfloat16().to(DEV) for _ in range(3))
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    g = (-torch.rand(1, T, H, K, generator=gen) * 0.05).to(DEV)  # (a chunk's decay e^Gamma_C about 0.2: deg counts)
    beta = torch.rand(1, T, H, generator=gen).to(DEV)
    do = torch.randn(1, T, H, K, generator=gen).bfloat16().to(DEV)
    h0, dht = (torch.randn(len(lengths), H, K, K, generator=gen).to(DEV) for _ in range(2))
    scale = K**-0.5
    aux = tf.kda_fwd_triton(q, k, v, g, beta, scale, h0, True, plan, return_aux=True)[2]
    here = _run_here()
    if not ON_GPU:
        monkeypatch.setattr(gluon_emulator, "_tf32", lambda x: x.float())
    launched = []

    class Emulated:  # the Gluon module as ``kda_bwd_triton`` finds it, launched here (on the CPU: the emulator)
        supported = staticmethod(gluon_bwd_wy.supported)

        @staticmethod
        def launch(*a, **kw):
            launched.append(1)
            gluon_bwd_wy.launch(*a, **kw, **here)

    res = []
    for gluon in (False, True):
        monkeypatch.setattr(tb, "GLUON_WY_BWD", gluon)
        monkeypatch.setattr(tb, "_gluon_taking",
                            lambda name, on, *a, **kw: Emulated if (on and name == "gluon_bwd_wy") else None)
        res.append(tb.kda_bwd_triton(do, dht, aux, v, h0, scale, plan)[:6])
    assert launched == [1]
    for name, r, o in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), *res):
        assert r.dtype == o.dtype and not o.isnan().any(), name
        err = ((r.float() - o.float()).norm() / r.float().norm()).item()
        assert err < (2e-3 if ON_GPU else 1e-4), (name, err)


# The WY backward's spill allowance: 136 B stored and 156 loaded with the local ptxas (Triton 3.6's wheel; 564 before
# dAqk was stored early, 332 before the key side's stores were addressed from the item's first element)
WY_BWD_SPILL_LIMIT = 256
# The intra backward's: 4 B with the local ptxas since dk's row term waits in shared memory (``DK_SMEM``; none before)
INTRA_BWD_SPILL_LIMIT = 16
# Phases A-C in one kernel (``gluon_local``, off by default): 220 B with the local ptxas (188 storing T), launched at
# 128 registers for two CTAs per SM, its consumer raised to 232 (at the compiler's own 255, one CTA: 172 B)
LOCAL_SPILL_LIMIT = 256


def test_gluon_kernels_compile_for_sm90(tmp_path):
    """In a process of its own, without the interpreter and with an empty Triton cache: the kernels compile for
    sm_90, without spilling (the state-gradient scan storing dRv, ``FUSE_DRV``: at most 256 B, 208 when it was timed
    faster than the dRv pass it replaces; the WY and intra backwards: ``WY_BWD_SPILL_LIMIT``,
    ``INTRA_BWD_SPILL_LIMIT``; phases A-C in one kernel: ``LOCAL_SPILL_LIMIT``), and as many CTAs of each as its
    launch counts on (its warps as launched, the loader's
    padded to a warpgroup) fit an H200 SM -- two of the scan
    when each holds one 64-column half of V, so that the 192 chains at K3's shape run at once on 132 SMs."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows = last_json_line(run_without_interpreter(["-m", "tests.ops.test_kda_gluon"], tmp_path))
    scan_ctas = 1 if gluon_scan.SHARED_HALVES else 2
    ctas_per_sm = (gluon_wy.CTAS_PER_SM, gluon_wy.CTAS_PER_SM, gluon_phase_a.CTAS_PER_SM, scan_ctas, scan_ctas,
                   scan_ctas, scan_ctas, 1, gluon_bwd_intra.CTAS_PER_SM, gluon_bwd_wy.CTAS_PER_SM,
                   gluon_local.CTAS_PER_SM, gluon_local.CTAS_PER_SM)
    spill_limits = (0, 0, 0, 0, 0, 0, 0, 256 if gluon_bwd_scan.FUSE_DRV else 0, INTRA_BWD_SPILL_LIMIT,
                    WY_BWD_SPILL_LIMIT, LOCAL_SPILL_LIMIT, LOCAL_SPILL_LIMIT)
    names = ("phase C", "phase C without U", "phase A", "scan", "scan with the output, storing",
             "scan with the output alone", "scan with the output, forming U", "state-gradient scan", "intra backward",
             "WY backward", "phases A-C, storing T", "phases A-C")
    assert len(rows) == len(names)
    for name, row, ctas, spill in zip(names, rows, ctas_per_sm, spill_limits):
        assert row["spill_store_bytes"] <= spill and row["spill_load_bytes"] <= spill, (name, row)
        assert (row["shared_bytes"] + 1024) * ctas <= 233472, (name, row)
        assert row["registers"] * 32 * row["num_warps"] * ctas <= 65536, (name, row)


# --------------------------------------------------------------------------
# the state gradients dh stored 16-bit (triton_backward.DH_16BIT)
# --------------------------------------------------------------------------


def test_gluon_state_gradient_scan_stores_a_16bit_dh():
    """The Gluon state-gradient scan (launched as the backward launches it: ``FUSE_LOCAL``, ``FUSE_DRV``) with a bf16
    dh (``triton_backward.DH_16BIT``): each stored dS is the fp32-dh run's rounded once to bf16 (identical on the
    emulator, within one bf16 step on the GPU), and the chain it carries stays fp32: dv_new (or dRv) and dh0 equal
    the fp32-dh run's. Varlen with a one-token sequence and partial chunks, the final state's gradient in."""
    gen = torch.Generator().manual_seed(5)
    K = V = 128
    H, lengths = 1, [1, 63, 65, 7]
    N, T = len(lengths), sum(lengths)
    plan, qg, kg, w, do, eg = _dh_scan_inputs(lengths, H, gen)
    dht = torch.randn(N, H, K, V, generator=gen).to(DEV)
    scale = K**-0.5
    dscale = 2.0 ** (math.frexp(scale)[1] - 1)
    aqk, tinv, dv_local = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV), None, None
    if not gluon_bwd_scan.FUSE_LOCAL:  # what _dvn_local_kernel would leave, at random
        aqk, dv_local = None, (torch.randn(1, T, H, V, generator=gen) * dscale).to(DEV)
    if gluon_bwd_scan.FUSE_DRV:
        tinv = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        dh = torch.full((plan.NT, H, K, V), float("nan"), device=DEV, dtype=dt)
        dvn = dv_local.clone() if dv_local is not None else torch.full((1, T, H, V), float("nan"), device=DEV)
        dh0 = torch.full((N, H, K, V), float("nan"), device=DEV)
        gluon_bwd_scan.launch(qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, scale, dscale, aqk=aqk, tinv=tinv,
                              **_launcher_here())
        out[dt] = dh, dvn, dh0
    (dh32, dvn32, dh0_32), (dh16, dvn16, dh0_16) = out[torch.float32], out[torch.bfloat16]
    assert dh16.dtype == torch.bfloat16 and not dh32.isnan().any() and not dh16.float().isnan().any()
    if ON_GPU:
        assert ((dh16.float() - dh32).abs() <= dh32.abs() * 2.0**-7).all()  # one bf16 step (8 significant bits)
        same = lambda a, b: ((a - b).abs() <= 1e-6 * b.abs().max()).all()  # noqa: E731
    else:
        assert torch.equal(dh16, dh32.bfloat16())
        same = torch.equal
    assert not dvn32.isnan().any() and same(dvn16, dvn32) and same(dh0_16, dh0_32)
    assert not torch.equal(dh16.float(), dh32)  # (the rounding happened)


if __name__ == "__main__":  # the compile step of test_gluon_kernels_compile_for_sm90
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    compile_only = dict(launcher=lambda kern, grid, *a, **kw: compiler(kern, list(a), kw, grid), programs=132)
    plan, q, k, v, G, beta, tinv = _chunk_inputs([128, 70], 2, 128)
    gluon_wy.launch(q, k, v, G, beta, tinv, *_outputs(q, plan, 2, 128), plan, 2, 128, **compile_only)
    w_, _, qg_, kg_, eg_ = _outputs(q, plan, 2, 128)  # (without U, storing -T diag(beta))
    gluon_wy.launch(q, k, v, G, beta, tinv, w_, None, qg_, kg_, eg_, plan, 2, 128,
                    tbeta=torch.zeros(plan.NT, 2, 64, 64).bfloat16(), **compile_only)
    gluon_phase_a.launch(q, k, G, beta, tinv, tinv.clone(), plan, 2, 128, **compile_only)
    plan, w, kg, u, eg, h0 = _scan_inputs([128, 70], 2, 128)
    h = torch.zeros(plan.NT, 2, 128, 128).bfloat16()
    gluon_scan.launch(kg, eg, w, u, h0, h, u.clone(), h0.clone(), plan, 2, 128, 128, launcher=compile_only["launcher"])
    out = dict(qg=w.clone(), aqk=torch.zeros(plan.NT, 2, 64, 64), o=w.clone(), scale=0.088,
               launcher=compile_only["launcher"])  # (the training forward's form, then the forward alone's)
    gluon_scan.launch(kg, eg, w, u, h0, h, u.clone(), h0.clone(), plan, 2, 128, 128, **out)
    gluon_scan.launch(kg, eg, w, u, None, None, None, None, plan, 2, 128, 128, **out)
    gluon_scan.launch(kg, eg, w, None, None, None, None, None, plan, 2, 128, 128, **out,  # forming U
                      tbeta=torch.zeros(plan.NT, 2, 64, 64).bfloat16(), v=w.clone())
    dh = torch.zeros(plan.NT, 2, 128, 128)
    gluon_bwd_scan.launch(w, kg, eg, w, kg, h0, dh, u, h0.clone(), plan, 2, 0.088, 0.0625,
                          aqk=torch.zeros(plan.NT, 2, 64, 64) if gluon_bwd_scan.FUSE_LOCAL else None,
                          tinv=torch.zeros(plan.NT, 2, 64, 64) if gluon_bwd_scan.FUSE_DRV else None,
                          launcher=compile_only["launcher"])
    npart, T = 1, sum([128, 70])  # (one dA partial: the Gluon WY backward's, the default on sm_90)
    b = torch.zeros(1, T, 2)
    gluon_bwd_intra.launch(q, k, G, beta, torch.zeros(plan.NT, 2, 64, 64), torch.zeros(npart, plan.NT, 2, 64, 64), G,
                           G.clone(), G.clone(), torch.zeros(npart, 1, T, 2), b, plan, 2, npart,
                           raw=(q, k, b.bfloat16()), out=(q.clone(), k.clone()), l2=True, bsig=True, eps=1e-6,
                           **compile_only)
    plan, q, k, v, G, beta, _ = _chunk_inputs([128, 70], 2, 128)
    f32 = G.clone()
    st16, st32 = torch.zeros(plan.NT, 2, 128, 128).bfloat16(), torch.zeros(plan.NT, 2, 128, 128)
    m64 = torch.zeros(plan.NT, 2, 64, 64)
    gluon_bwd_wy.launch(q, k, v, G, b, q.clone(), f32, st16, st32, f32.clone(), f32.clone(), q.clone(), f32.clone(),
                        f32.clone(), f32.clone(), v.clone(), b.clone(), m64, m64.clone(), plan, 2, 0.088,
                        **compile_only)
    for store_t in (True, False):  # phases A, B, C in one kernel: the training forward's form, then the forward alone's
        gluon_local.launch(q, k, v, G, beta, m64, m64.clone(), *_outputs(q, plan, 2, 128), plan, 2, store_t,
                           **compile_only)
    print(json.dumps([{k: row[k] for k in ("registers", "num_warps", "shared_bytes", "spill_store_bytes",
                                           "spill_load_bytes")} for row in compiler.rows]))
