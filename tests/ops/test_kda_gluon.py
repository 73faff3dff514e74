"""The Hopper Gluon kernels of KDA (kimik3/ops/kda/gluon/) against the Triton stages they replace: wy.py (forward
stage 4), scan.py (stage 5, the state scan with the output), bwd_scan.py (backward stage 1, the state gradients and
dRv), bwd_wy.py (stage 2) and bwd_intra.py (stage 3). Gluon does not run under the Triton interpreter: on the CPU a
Gluon kernel runs through the Gluon emulator (tests/gluon_emulator.py), the Triton stage under the interpreter, and
the Gluon kernels are also compiled for sm_90; on a Hopper GPU both run. Then ``chunk_kda`` with every Gluon stage
it has, against every Triton stage (on the CPU through the emulator). (gluon/scan16.py, the 16-token forward's
scan: tests/ops/test_kda_chunk16.py.)

The batches are as small as covers every path: LENGTHS packs a sequence of three chunks (the scans' 2-slot rings
wrap; its last chunk, of 2 tokens, is partial and its tiles run into the next sequences), a one-token sequence and a
partial last one (its tiles run past the tensor's end, where TMA reads zeros). The persistent kernels run on two or
three programs, so each takes several items, unequal counts, and its rings wrap."""

from __future__ import annotations

import json
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

from kimik3.ops.kda import bwd_scan, bwd_wy, fwd_scan, wy  # noqa: E402
from kimik3.ops.kda.gluon import bwd_intra as gluon_bwd_intra  # noqa: E402
from kimik3.ops.kda.gluon import bwd_scan as gluon_bwd_scan  # noqa: E402
from kimik3.ops.kda.gluon import bwd_wy as gluon_bwd_wy  # noqa: E402
from kimik3.ops.kda.gluon import scan as gluon_scan  # noqa: E402
from kimik3.ops.kda.gluon import wy as gluon_wy  # noqa: E402
from kimik3.ops.kda.plan import make_plan  # noqa: E402

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if torch.cuda.is_available() and not ON_GPU and __name__ != "__main__":
    pytest.skip("the Gluon kernels run on sm_90; on another GPU the Triton kernels compile for it and the CPU "
                "emulation has no interpreter to compare with", allow_module_level=True)
if not torch.cuda.is_available():
    from kimik3.ops.kda.interpreter import interpreter_bf16_fix

    interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)
DEV = "cuda" if ON_GPU else "cpu"
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
LENGTHS = [130, 1, 63]  # chunks of 64, 64, 2 | 1 | 63 tokens (module docstring)
NAN = float("nan")


def _plan(lengths):
    """The chunk plan of one packed batch of sequences of these lengths."""
    return make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV))


def _chunk_bounds(plan):
    """Each global chunk's (first token, valid rows)."""
    cu, cidx = plan.cu.tolist(), plan.chunk_idx.reshape(-1).tolist()
    out = []
    for i_t in range(plan.NT):
        n, c = cidx[2 * i_t], cidx[2 * i_t + 1]
        t0 = cu[n] + 64 * c
        out.append((t0, min(cu[n + 1] - t0, 64)))
    return out


def _nan(*shape, dtype=torch.float32):
    """A buffer a kernel must write in full: NaN, so an element left unwritten shows."""
    return torch.full(shape, NAN, device=DEV, dtype=dtype)


def _rand(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def _chunk_inputs(lengths, H, K, seed=0, gate_scale=0.3):
    """The chunk-local stages' inputs for a packed batch: bf16 q, k, v, the within-chunk cumulative log-decay Gamma
    (fp32, each chunk from zero; per-token decays in [-gate_scale, 0]), beta (fp32), a lower-triangular T per chunk
    and head."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    plan = _plan(lengths)
    q, k, v = (_rand(gen, 1, T, H, K, scale=K**-0.5, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, T, H, K, generator=gen) * gate_scale
    G = torch.empty_like(g)
    for t0, L in _chunk_bounds(plan):
        G[:, t0:t0 + L] = g[:, t0:t0 + L].cumsum(1)
    beta = torch.rand(1, T, H, generator=gen).to(DEV)
    tinv = (torch.randn(plan.NT, H, 64, 64, generator=gen).tril() * 0.1).to(DEV)
    return plan, q, k, v, G.to(DEV), beta, tinv


def _run_here(programs=3) -> dict:
    """A persistent Gluon ``launch``'s keywords on this machine: the GPU as it is, or on the CPU the emulator with
    this many persistent programs."""
    if ON_GPU:
        return {}
    from tests.gluon_emulator import emulate

    return dict(launcher=emulate, programs=programs)


def _launcher_here() -> dict:
    """``_run_here`` for a kernel launched on a fixed grid (the scans): the launcher alone."""
    return {k: v for k, v in _run_here().items() if k == "launcher"}


def _within(ref, out, tol, name):
    """Every element of out written and within tol of ref's largest magnitude."""
    assert not out.float().isnan().any(), f"{name}: {int(out.float().isnan().sum())} elements unwritten"
    d = (ref.float() - out.float()).abs().max()
    assert d <= tol * ref.float().abs().max(), (name, d.item())


# --------------------------------------------------------------------------
# forward stage 4: W, U, qg, kg, exp(Gamma_C)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("lengths,H,K", [(LENGTHS, 1, 128), ([70], 2, 64)])
def test_gluon_wy_equals_the_triton_stage(lengths, H, K):
    """``gluon.wy`` against ``wy.launch`` (K == V; two 64-column blocks per chunk and one): every output written;
    W, qg, kg within one bf16 rounding of the Triton kernel's, or of one product operand at the output's scale (the
    operands are rounded to bf16 from e^Gamma, and the interpreter's exp and the emulator's differ in the last bit,
    so an operand can round the other way), U and exp(Gamma_C) to fp32 rounding. On the CPU at K = 128, ten items on
    three persistent programs (its 2-slot ring wraps)."""
    plan, q, k, v, G, beta, tinv = _chunk_inputs(lengths, H, K)
    T = sum(lengths)

    def outputs():
        return (_nan(1, T, H, K, dtype=torch.bfloat16), _nan(1, T, H, K), _nan(1, T, H, K, dtype=torch.bfloat16),
                _nan(1, T, H, K, dtype=torch.bfloat16), _nan(plan.NT, H, K))

    ref, out = outputs(), outputs()
    wy.launch(q, k, v, G, beta, tinv, *ref, plan, H, K, K, 64, 64, tl.bfloat16, "tf32")
    gluon_wy.launch(q, k, v, G, beta, tinv, *out, plan, H, K, **_run_here())
    for name, r, o in zip(("w", "u", "qg", "kg", "eg"), ref, out):
        assert not o.isnan().any(), f"{name}: {int(o.isnan().sum())} elements unwritten"
        d = (r.float() - o.float()).abs()
        if o.dtype == torch.bfloat16:  # one bf16 ulp, or one operand's bf16 rounding at the output's scale
            assert (d <= r.float().abs() * 2.0**-7 + 2.0**-9 * r.float().abs().max()).all(), (name, d.max().item())
        else:
            assert d.max() <= 1e-5 * r.float().abs().max(), (name, d.max().item())


# --------------------------------------------------------------------------
# forward stage 5: the state scan with the output
# --------------------------------------------------------------------------


def _scan_inputs(lengths, H, V, seed=0):
    """The state scan's inputs for a packed batch (K = 128): bf16 W, kg, qg (x 0.1), chunk decays exp(Gamma_C) in
    [0.5, 1), a lower-triangular fp32 Aqk (x 0.2), an fp32 initial state per sequence and fp32 U."""
    gen = torch.Generator().manual_seed(seed)
    K, T = 128, sum(lengths)
    plan = _plan(lengths)
    w, kg, qg = (_rand(gen, 1, T, H, K, scale=0.1, dtype=torch.bfloat16) for _ in range(3))
    eg = (torch.rand(plan.NT, H, K, generator=gen) * 0.5 + 0.5).to(DEV)
    aqk = _rand(gen, plan.NT, H, 64, 64, scale=0.2).tril()
    h0 = _rand(gen, len(lengths), H, K, V)
    u = _rand(gen, 1, T, H, V)
    return plan, w, kg, qg, eg, aqk, h0, u


@pytest.mark.parametrize("H,V,with_states,o_dtype", [(2, 128, True, torch.bfloat16), (1, 64, False, torch.float32)])
def test_gluon_scan_equals_the_triton_stage(H, V, with_states, o_dtype):
    """``gluon.scan`` as ``forward.py`` calls it (a training forward: the states and v_new stored), on LENGTHS
    (module docstring), with and without the initial and final states, V = 128 (both 64-column blocks in one CTA)
    and V = 64 (one per CTA), against ``fwd_scan.launch``: every stored state, v_new and final state within one bf16
    rounding of the state at the output's scale (the two sum the state update in another order, so a stored 16-bit
    state can round the other way, and v_new after it); o against ``_output_kernel`` run on the Gluon scan's own
    stored states and v_new, to fp32 summation order (an fp32 o, where the remainders' products, 2^-9 of the output,
    show) or within one bf16 rounding (a bf16 o)."""
    plan, w, kg, qg, eg, aqk, h0, u = _scan_inputs(LENGTHS, H, V)
    K, N, T, scale = 128, len(LENGTHS), sum(LENGTHS), 128**-0.5
    h0 = h0 if with_states else None

    def run(gluon):
        h = _nan(plan.NT, H, K, V, dtype=torch.bfloat16)
        vn = _nan(1, T, H, V)
        ht = _nan(N, H, K, V) if with_states else None
        o = _nan(1, T, H, V, dtype=o_dtype)
        if not gluon:
            fwd_scan.launch(kg, eg, w, u, h0, h, vn, ht, qg, aqk, o, plan, H, K, V, scale, "tf32", tl.bfloat16, True)
        else:
            gluon_scan.launch(kg, eg, w, u, h0, h, vn, ht, plan, H, K, V, qg=qg, aqk=aqk, o=o, scale=scale,
                              **_launcher_here())
        return h, vn, ht, o

    ref, got = run(False), run(True)
    for name, r, o in zip(("h", "v_new", "final state"), ref[:3], got[:3]):
        if r is not None:
            _within(r, o, 2.0**-8, name)
    h, vn, ht, o = got
    o_ref = _nan(1, T, H, V, dtype=o_dtype)
    fwd_scan._output_kernel[(V // 64, plan.NT, H)](qg, aqk, h, vn, o_ref, plan.cu, plan.chunk_idx, H, scale, K=K,
                                                   V=V, BKF=K, BV=64, PREC="tf32", DT=tl.bfloat16, HILO=True,
                                                   num_warps=4)
    assert not o.float().isnan().any(), f"o: {int(o.float().isnan().sum())} elements unwritten"
    d = (o_ref.float() - o.float()).abs()
    if o_dtype == torch.float32:
        assert d.max() <= 1e-5 * o_ref.abs().max(), d.max().item()
    else:
        assert (d <= 2.0**-7 * o_ref.float().abs() + 1e-5 * o_ref.float().abs().max()).all(), d.max().item()


# --------------------------------------------------------------------------
# backward stage 1: the state gradients and dRv
# --------------------------------------------------------------------------


@pytest.mark.parametrize("H,with_states", [(2, True), (1, False)])
def test_gluon_bwd_scan_equals_the_triton_stage(H, with_states):
    """``gluon.bwd_scan`` (K = V = 128) against ``bwd_scan.launch`` (``_dvn_local_kernel``, the in-place 16-bit
    ``_bwd_dh_kernel``, ``_drv_kernel``) on LENGTHS (module docstring: a sequence's last chunk's tiles run into the
    next one), with and without the final state's gradient and dh0: every chunk's dS, dRv (stored over dv_new, from a
    buffer of NaN) and dh0 written, equal to the Triton stage's to fp32 summation order at the output's scale (the two
    carry the chain in units a power of two apart; dRv here from 16-bit high and low parts, there a tf32 product).
    Aqk's rows past a chunk's valid ones are not zero: nothing may read them."""
    gen = torch.Generator().manual_seed(0)
    K = V = 128
    N, T = len(LENGTHS), sum(LENGTHS)
    plan = _plan(LENGTHS)
    qg, kg, w = (_rand(gen, 1, T, H, K, scale=0.1, dtype=torch.bfloat16) for _ in range(3))
    do = _rand(gen, 1, T, H, V, dtype=torch.bfloat16)
    eg = (torch.rand(plan.NT, H, K, generator=gen) * 0.5 + 0.5).to(DEV)
    aqk, tinv = (_rand(gen, plan.NT, H, 64, 64, scale=0.1).tril() for _ in range(2))
    dht = _rand(gen, N, H, K, V) if with_states else None
    scale = K**-0.5
    res = []
    for gluon in (False, True):
        dh, dvn = _nan(plan.NT, H, K, V), _nan(1, T, H, V)
        dh0 = _nan(N, H, K, V) if with_states else None
        if gluon:
            gluon_bwd_scan.launch(qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, scale, aqk=aqk, tinv=tinv,
                                  **_launcher_here())
        else:
            bwd_scan.launch(aqk, tinv, qg, kg, eg, w, do, dht, dh, dvn, dh0, plan, H, K, V, K, 64, scale, "tf32",
                            tl.bfloat16, True)
        res.append((dh, dvn, dh0))
    for name, r, o in zip(("dS", "dRv", "dh0"), *res):
        if r is not None:
            _within(r, o, 2e-3, name)


# --------------------------------------------------------------------------
# backward stage 2: the WY backward
# --------------------------------------------------------------------------


def test_gluon_bwd_wy_equals_the_triton_stage(monkeypatch):
    """``gluon.bwd_wy`` (one item per (chunk, head): dA and dbeta whole) against ``bwd_wy.launch`` (three parts per
    (chunk, head), each with its partial dA and dbeta, here summed) on LENGTHS with two heads: ten items on three
    persistent programs. The partial dq, dk, dGamma, dv, dbeta, dAqk and dA within 1e-4 (relative RMS) of the
    Triton stage's on the CPU, where the interpreter's products are fp32 and the emulator's are made exact too (its
    tf32 rounding off; the Gluon kernel's 16-bit splits hold ~16 mantissa bits); within 2e-3 on the GPU, where both
    take tf32 products."""
    from tests import gluon_emulator

    H, K = 2, 128
    plan, q, k, v, G, beta, _ = _chunk_inputs(LENGTHS, H, K, seed=3)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    gen = torch.Generator().manual_seed(4)
    T = sum(LENGTHS)
    w, do = (_rand(gen, 1, T, H, K, scale=s, dtype=torch.bfloat16) for s in (0.3, 1.0))
    u, vn, drv = (_rand(gen, 1, T, H, K) for _ in range(3))
    h = _rand(gen, plan.NT, H, K, K, scale=0.3, dtype=torch.bfloat16)
    dh = _rand(gen, plan.NT, H, K, K, scale=0.3)
    if not ON_GPU:
        monkeypatch.setattr(gluon_emulator, "_tf32", lambda x: x.float())
    res = []
    for gluon in (False, True):
        npart = 1 if gluon else bwd_wy.parts(K, 64)
        dq, dk, dG = (_nan(1, T, H, K) for _ in range(3))
        dv, dbeta = _nan(1, T, H, K, dtype=torch.bfloat16), _nan(npart, 1, T, H)
        daqk, da = _nan(plan.NT, H, 64, 64), _nan(npart, plan.NT, H, 64, 64)
        if gluon:
            gluon_bwd_wy.launch(q, k, v, G, beta, w, u, h, dh, vn, drv, do, dq, dk, dG, dv, dbeta[0], daqk, da, plan,
                                H, K**-0.5, **_run_here())
        else:
            bwd_wy.launch(q, k, v, G, beta, w, u, h, dh, vn, drv, do, dq, dk, dG, dv, dbeta, daqk, da, plan, H, K, K,
                          K, 64, 64, K**-0.5, "tf32")
        res.append((dq, dk, dG, dv, dbeta.sum(0), daqk, da.sum(0)))
    for name, r, o in zip(("dq", "dk", "dGamma", "dv", "dbeta", "dAqk", "dA"), *res):
        assert r.dtype == o.dtype and not o.isnan().any(), name
        assert rel_rms(r, o) < (2e-3 if ON_GPU else 1e-4), (name, rel_rms(r, o))


# --------------------------------------------------------------------------
# backward stage 3: the gradients through Aqk and A
# --------------------------------------------------------------------------


@pytest.mark.parametrize("H,npart,fused,programs", [(2, 1, True, 3), (1, 3, False, 2)], ids=["one-partial-fused",
                                                                                              "three-partials"])
def test_gluon_bwd_intra_equals_the_triton_stage(monkeypatch, H, npart, fused, programs):
    """``bwd_intra.bwd_intra`` (the rows kernel, then the suffix pass) with ``gluon=True`` (``gluon.bwd_intra``, as
    the backward calls it) against ``gluon=False`` (the Triton rows kernel) on LENGTHS, per-token decays up to the
    bound: dA as one partial (the Gluon WY backward's: dbeta updated in place, dk's row term through shared memory)
    with the fused L2 norm, sigmoid and gate chain rules, and as three partials (the Triton WY backward's: dk's row
    term through global memory) without them; the persistent kernel on three and two programs (its rings wrap).
    Every gradient within 2e-3 (relative RMS) of the Triton kernel's on the GPU, where its products are tf32 and the
    Gluon kernel's three 16-bit ones (about 16 mantissa bits); on the CPU, where the interpreter's products are fp32,
    within 1e-4."""
    from kimik3.ops.kda import bwd_intra
    from kimik3.ops.kda.preact_bwd import PreactInputs

    K = 128
    plan, q, k, _, G, beta, _ = _chunk_inputs(LENGTHS, H, K, gate_scale=5.0)
    gen = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    daqk = _rand(gen, plan.NT, H, 64, 64).tril()
    da = _rand(gen, npart, plan.NT, H, 64, 64, scale=1 / npart).tril(-1)
    grads = [_rand(gen, 1, T, H, K) for _ in range(3)] + [_rand(gen, npart, 1, T, H)]  # the WY stage's partials
    bf = lambda *s: _rand(gen, *s, dtype=torch.bfloat16)  # noqa: E731
    preact = PreactInputs(q=bf(1, T, H, K), k=bf(1, T, H, K), z=bf(1, T, H, K), beta=bf(1, T, H), A_log=_rand(gen, H),
                          dt_bias=_rand(gen, H * K), g_min=-5.0, use_gate=True, use_l2=True,
                          use_beta_sigmoid=True) if fused else None
    launch = gluon_bwd_intra.launch
    monkeypatch.setattr(gluon_bwd_intra, "launch", lambda *a, **kw: launch(*a, **kw, **_run_here(programs)))
    res = []
    for gluon in (False, True):
        dq, dk, dg, dbeta_parts = (x.clone() for x in grads)
        dbeta = dbeta_parts[0] if npart == 1 else torch.zeros(1, T, H, device=DEV)
        out = bwd_intra.bwd_intra(q, k, G, beta, daqk, da, dq, dk, dg, dbeta_parts, dbeta, plan, npart, "tf32", gluon,
                                  preact)
        res.append(out[:4] if fused else (dq, dk, dg, dbeta))
    for name, r, o in zip(("dq", "dk", "dz" if fused else "dg", "dbeta"), *res):
        assert r.dtype == o.dtype, name
        assert rel_rms(r, o) < (2e-3 if ON_GPU else 1e-4), (name, rel_rms(r, o))


# --------------------------------------------------------------------------
# the whole pipeline on a GPU
# --------------------------------------------------------------------------


def _pipeline_on_the_gluon_stages(grad, monkeypatch, T=2048, H=8, lengths=(700, 1, 1347)):
    """``test_gpu_chunk_kda_on_the_gluon_stages`` at B1 T H D128 (packed sequences of these lengths)."""
    from kimik3.ops.kda import backward, chunk_kda, dispatch, forward
    from kimik3.ops.kda.dispatch import Choice

    gen = torch.Generator(device=DEV).manual_seed(11)
    D = 128
    xs = [torch.randn(1, T, H, D, generator=gen, device=DEV).bfloat16() for _ in range(4)]
    xs.append(torch.randn(1, T, H, generator=gen, device=DEV).bfloat16())
    a_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=gen))
    dtb = torch.randn(H, D, generator=gen, device=DEV) * 0.5
    do = torch.randn(1, T, H, D, generator=gen, device=DEV).bfloat16()
    kw = dict(A_log=a_log, dt_bias=dtb, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens(list(lengths), DEV), output_final_state=True)

    def run(backend, forced=None):
        def select(call):
            got = dict(dispatch.select(call))
            for stage, impl in (forced or {}).items():
                got[stage] = Choice(impl, "forced by the test", ())
            return got

        monkeypatch.setattr(forward, "select", select)
        monkeypatch.setattr(backward, "select", select)
        leaves = [x.clone().requires_grad_(grad) for x in xs]
        o, s = chunk_kda(*(x.float() if backend == "torch" else x for x in leaves), backend=backend, **kw)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype)) if grad else ()
        return o, s, grads

    gluon = {"wy": "gluon/wy", "scan": "gluon/scan", "bwd_scan": "gluon/bwd_scan", "bwd_wy": "gluon/bwd_wy",
             "bwd_intra": "gluon/bwd_intra"}
    triton = {"forward": "64-token chunks", "wy": "wy", "scan": "fwd_scan", "bwd_scan": "bwd_scan", "bwd_wy": "bwd_wy",
              "bwd_intra": "bwd_intra"}
    (o0, s0, g0), (o_ref, s_ref, g_ref) = run("triton", triton), run("torch")
    forms = [dict(gluon, forward="64-token chunks")] + ([] if grad else [{"forward": "16-token tiles"}])
    for forced in forms:
        o1, s1, g1 = run("triton", forced)
        assert not o1.isnan().any() and rel_rms(o_ref, o1) < 1e-2 and rel_rms(s_ref, s1) < 5e-3, forced
        if grad:
            assert rel_rms(o0, o1) < 5e-3 and rel_rms(s0, s1) < 5e-3
            for r, a, b in zip(g_ref, g1, g0):  # five stages, each within 2e-3 of its Triton stage
                assert rel_rms(b, a) < 1e-2
                assert rel_rms(r, a) <= 1.25 * rel_rms(r, b) + 1e-3  # no less accurate than the Triton run
        else:
            assert rel_rms(o_ref, o1) <= 1.05 * rel_rms(o_ref, o0) and rel_rms(s_ref, s1) <= 1.05 * rel_rms(s_ref, s0)
            assert rel_rms(o0, o1) < 6e-3, forced


@pytest.mark.skipif(not ON_GPU, reason="the pipeline on the Gluon kernels needs sm_90")
@pytest.mark.parametrize("grad", [False, True])
def test_gpu_chunk_kda_on_the_gluon_stages(grad, monkeypatch):
    """``chunk_kda`` under K3's contract (bf16, B1 T2048 H8 D128, varlen with a one-token sequence) with every stage
    that has a Gluon form on it, though this call is below the table's thresholds (``forward.select`` and
    ``backward.select`` answer so), against every stage on the Triton kernels and against the fp32 torch path. Every
    run within 1e-2 (o) and 5e-3 (final state) of the torch path's (relative RMS). A forward alone, on 16-token tiles
    (where the table sends it) and forced onto the 64-token Gluon stages; each rounds differently from the Triton
    forward (about one bf16 rounding of o), so each is held to the torch path, no less accurate (1.05x the Triton
    run's error). A training call: the outputs,
    final states within 5e-3 of the Triton run's and its gradients within 1e-2 (each Gluon stage alone is within 2e-3
    of its Triton stage in the tests above; here five of them, and a gradient measured 6.2e-3 apart on the H200), each
    gradient no farther from the fp32 torch path's than 1.25x the Triton run's (+1e-3)."""
    _pipeline_on_the_gluon_stages(grad, monkeypatch)


@pytest.mark.skipif(ON_GPU, reason="the CPU's form of the test above")
@pytest.mark.parametrize("grad", [False, True])
def test_chunk_kda_on_the_gluon_stages_emulated(grad, monkeypatch):
    """``test_gpu_chunk_kda_on_the_gluon_stages`` on the CPU at B1 T130 H1 (sequences of 64, 1 and 65 tokens): every
    Gluon launch the pipelines make runs through the emulator, the Triton stages under the interpreter. The call
    sites in ``forward.py``, ``backward.py`` and ``bwd_intra.py`` against the Gluon modules' signatures (the only
    CPU test that reaches them: on the CPU the table picks no Gluon stage), and the whole pipeline's numerics."""
    import importlib

    from tests.gluon_emulator import emulate

    for name in ("wy", "scan", "scan16", "bwd_scan", "bwd_wy", "bwd_intra"):
        module = importlib.import_module(f"kimik3.ops.kda.gluon.{name}")
        persistent = dict(programs=3) if name in ("wy", "bwd_wy", "bwd_intra") else {}

        def launch(*a, _launch=module.launch, _more=persistent, **kw):
            _launch(*a, **kw, launcher=emulate, **_more)

        monkeypatch.setattr(module, "launch", launch)
    _pipeline_on_the_gluon_stages(grad, monkeypatch, T=130, H=1, lengths=(64, 1, 65))


# --------------------------------------------------------------------------
# the sm_90 compile
# --------------------------------------------------------------------------

# Spill allowances (bytes stored and loaded) with the local ptxas (Triton 3.6's wheel), where a kernel spills at all:
# the state-gradient scan storing dRv 208 B, the WY backward 136 B stored and 156 loaded, the intra backward with dA
# as one partial 4 B.
SPILL_LIMITS = {"bwd_scan": 256, "bwd_wy": 256, "bwd_intra": 16}


def _compile_configs(exhaustive: bool):
    """(name, CTAs per SM the launch counts on, launch thunk taking a launcher) of every Gluon kernel of the 64-token
    path in the configuration K3's training takes; exhaustive: in every configuration of the flags that shape a
    kernel (its partitions, shared memory or products) that a caller can take: one 64-column block of V per scan
    CTA (``NHALF``), three partials of dA in the intra backward (``NPART``, ``DK_SM``), the fused L2 norm and sigmoid
    each on or off. The
    state flags (``HAS_H0``, ``STORE_HT``, ``HAS_DHT``, ``STORE_DH0``: a load before a scan's loop, a store after it)
    are on throughout."""
    H, K, lengths = 2, 128, [128, 70]
    plan, q, k, v, G, beta, tinv = _chunk_inputs(lengths, H, K)
    NT, N, T = plan.NT, len(lengths), sum(lengths)
    z = lambda *s, dtype=torch.float32: torch.zeros(s, dtype=dtype)  # noqa: E731
    bf = lambda: z(1, T, H, K, dtype=torch.bfloat16)  # noqa: E731
    many = dict(programs=132)
    out = []
    out.append(("wy", gluon_wy.CTAS_PER_SM, lambda launcher: gluon_wy.launch(
        q, k, v, G, beta, tinv, bf(), z(1, T, H, K), bf(), bf(), z(NT, H, K), plan, H, K, launcher=launcher, **many)))
    for V in (128, 64) if exhaustive else (128,):
        ctas = 1  # (one block of V per CTA: registers would allow two, the rings' 160 KB of shared memory do not)
        h0, o = z(N, H, K, V), z(1, T, H, V, dtype=torch.bfloat16)

        def scan(launcher, V=V, h0=h0, o=o):
            gluon_scan.launch(bf(), z(NT, H, K), bf(), z(1, T, H, V), h0, z(NT, H, K, V).bfloat16(), z(1, T, H, V),
                              h0.clone(), plan, H, K, V, qg=bf(), aqk=z(NT, H, 64, 64), o=o, scale=0.088,
                              launcher=launcher)
        out.append(("scan" + ("" if V == 128 else ", one block of V"), ctas, scan))
    dh, h0 = z(NT, H, K, K), z(N, H, K, K)
    out.append(("bwd_scan", 1, lambda launcher: gluon_bwd_scan.launch(
        bf(), bf(), z(NT, H, K), bf(), bf(), h0, dh, z(1, T, H, K), h0.clone(), plan, H, 0.088,
        aqk=z(NT, H, 64, 64), tinv=z(NT, H, 64, 64), launcher=launcher)))
    f32 = lambda: z(1, T, H, K)  # noqa: E731
    out.append(("bwd_wy", gluon_bwd_wy.CTAS_PER_SM, lambda launcher: gluon_bwd_wy.launch(
        q, k, v, G, beta, bf(), f32(), z(NT, H, K, K).bfloat16(), dh, f32(), f32(), bf(), f32(), f32(), f32(), bf(),
        z(1, T, H), z(NT, H, 64, 64), z(1, NT, H, 64, 64), plan, H, 0.088, launcher=launcher, **many)))
    intra_forms = [(npart, l2, bsig) for npart in (1, 3) for l2 in (True, False) for bsig in (True, False)]
    for npart, l2, bsig in intra_forms if exhaustive else [(1, True, True)]:
        def intra(launcher, npart=npart, l2=l2, bsig=bsig):
            b = z(1, T, H)
            gluon_bwd_intra.launch(q, k, G, beta, z(NT, H, 64, 64), z(npart, NT, H, 64, 64), f32(), f32(), f32(),
                                   z(npart, 1, T, H), b, plan, H, npart, raw=(q, k, b.bfloat16()),
                                   out=(bf(), bf()) if l2 else None, l2=l2, bsig=bsig, eps=1e-6, launcher=launcher,
                                   **many)
        out.append((f"bwd_intra, {npart} partial{'s' if npart > 1 else ''}{', L2' if l2 else ''}"
                    f"{', sigmoid' if bsig else ''}", gluon_bwd_intra.CTAS_PER_SM, intra))
    return out


def _check_compiled(rows, configs):
    """Each compile without spilling (``SPILL_LIMITS``), and as many CTAs of it as its launch counts on (its warps as
    launched, the loader's padded to a warpgroup) fitting an H200 SM."""
    assert [r["kernel"] for r in rows] == [f"_gluon_{n.split(',')[0].replace('bwd_scan', 'dh_scan')}_kernel"
                                           for n, _, _ in configs]
    for (name, ctas, _), row in zip(configs, rows):
        spill = next((v for k, v in SPILL_LIMITS.items() if name.startswith(k)), 0)
        assert row["spill_store_bytes"] <= spill and row["spill_load_bytes"] <= spill, (name, row)
        assert (row["shared_bytes"] + 1024) * ctas <= 233472, (name, row)
        assert row["registers"] * 32 * row["num_warps"] * ctas <= 65536, (name, row)


def test_gluon_kernels_compile_for_sm90(tmp_path):
    """In a process of its own, without the interpreter and with an empty Triton cache: each Gluon kernel of the
    64-token path compiles for sm_90 in the configuration K3's training runs (``_check_compiled``)."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows = last_json_line(run_without_interpreter(["-m", "tests.ops.test_kda_gluon"], tmp_path))
    _check_compiled(rows, _compile_configs(False))


@pytest.mark.slow
def test_gluon_kernels_compile_for_sm90_in_every_configuration(tmp_path):
    """``test_gluon_kernels_compile_for_sm90`` for every constexpr configuration a caller can take
    (``_compile_configs``)."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows = last_json_line(run_without_interpreter(["-m", "tests.ops.test_kda_gluon", "--all"], tmp_path))
    _check_compiled(rows, _compile_configs(True))


if __name__ == "__main__":  # the compile step of the two tests above
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    for _, _, compile_it in _compile_configs("--all" in sys.argv):
        compile_it(lambda kern, grid, *a, **kw: compiler(kern, list(a), kw, grid))
    print(json.dumps([{k: row[k] for k in ("kernel", "registers", "num_warps", "shared_bytes", "spill_store_bytes",
                                           "spill_load_bytes")} for row in compiler.rows]))
