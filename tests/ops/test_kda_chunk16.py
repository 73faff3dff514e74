"""The 16-token forward (kimik3/ops/kda/prep16.py, the chunk-parallel prep in Triton, and gluon/scan16.py, the state
scan in Gluon) against the fp32 torch path. On the CPU the prep runs under the Triton interpreter and the scan
through the Gluon emulator (tests/gluon_emulator.py), and both are also compiled for sm_90; on a Hopper GPU both run
(and tests/ops/test_kda_gluon.py holds ``chunk_kda``'s forward on 16-token tiles to the 64-token one's error)."""

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

from kimik3.ops.kda import L2_EPS, chunk_kda, prep16  # noqa: E402
from kimik3.ops.kda.gluon import scan16  # noqa: E402
from kimik3.ops.kda.plan import make_plan  # noqa: E402

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if torch.cuda.is_available() and not ON_GPU and __name__ != "__main__":
    pytest.skip("the Gluon scan runs on sm_90", allow_module_level=True)
if not torch.cuda.is_available():
    from kimik3.ops.kda.interpreter import interpreter_bf16_fix

    interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)
DEV = "cuda" if ON_GPU else "cpu"
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _layer_inputs(lengths, H, V, seed, gate_shift=0.0):
    """K3's layer inputs for a packed batch (bf16 q, k, the gate's input z, v and beta's logits; A_log, dt_bias) and an
    fp32 initial state per sequence. gate_shift moves z: +8 puts every gate at its bound g_min."""
    gen = torch.Generator().manual_seed(seed)
    K, T = 128, sum(lengths)
    q, k = (torch.randn(1, T, H, K, generator=gen).bfloat16().to(DEV) for _ in range(2))
    z = (torch.randn(1, T, H, K, generator=gen) + gate_shift).bfloat16().to(DEV)
    v = torch.randn(1, T, H, V, generator=gen).bfloat16().to(DEV)
    beta = torch.randn(1, T, H, generator=gen).bfloat16().to(DEV)
    a_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen)).to(DEV)
    dtb = (torch.randn(H, K, generator=gen) * 0.5).to(DEV)
    h0 = (torch.randn(len(lengths), H, K, V, generator=gen) * 0.1).to(DEV)
    return q, k, z, v, beta, a_log, dtb, h0


def _forward16(lengths, xs, with_states, launcher=None):
    """The 16-token forward by its two launches: (o, final state or None); outputs NaN-filled, so a hole shows."""
    q, k, z, v, beta, a_log, dtb, h0 = xs
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    tplan = make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV)).tiles(16)
    prep = prep16.prep16_outputs(tplan, H, K, DEV, torch.bfloat16)
    prep16.launch(q, k, z, beta, a_log, dtb, prep, tplan, H, K, K**-0.5, -5.0, True, True, True, L2_EPS)
    o = torch.full_like(v, float("nan"))
    ht = torch.full((len(lengths), H, K, V), float("nan"), device=DEV) if with_states else None
    scan16.launch(prep, v, h0 if with_states else None, ht, o, tplan, H, K, V,
                  **({} if launcher is None else dict(launcher=launcher)))
    return o, ht


def _reference(lengths, xs, with_states):
    """The fp32 torch path on the same inputs, K3's contract."""
    q, k, z, v, beta, a_log, dtb, h0 = xs
    return chunk_kda(q.float(), k.float(), v.float(), z.float(), beta.float(), backend="torch", A_log=a_log,
                     dt_bias=dtb, lower_bound=-5.0, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_seqlens(lengths, DEV), output_final_state=True,
                     initial_state=h0 if with_states else None)


@pytest.mark.parametrize("lengths,H,V,with_states,gate_shift", [
    # one-token, partial and whole tiles; 8 tiles in one sequence (the scan's 6-slot ring wraps); two V halves per CTA
    ([1, 15, 16, 17, 113], 2, 128, True, 0.0),
    ([33], 1, 64, False, 0.0),  # one V half per CTA, no states
    ([20, 12], 1, 128, True, 8.0),  # every gate at its bound: a tile's log-decay reaches -80
])
def test_forward16_equals_the_token_loop(lengths, H, V, with_states, gate_shift):
    """Prep and scan against the fp32 torch path in fp32: o within bf16's output rounding (6e-3 relative RMS), the
    final state within 5e-3, every output element written (the o rows of the next sequence's tokens under a partial
    tile's padding are not overwritten: the NaN fill would show)."""
    xs = _layer_inputs(lengths, H, V, seed=len(lengths), gate_shift=gate_shift)
    launcher = None
    if not ON_GPU:
        from tests.gluon_emulator import emulate

        launcher = emulate
    o, ht = _forward16(lengths, xs, with_states, launcher)
    o_ref, s_ref = _reference(lengths, xs, with_states)
    assert not o.float().isnan().any()
    assert rel_rms(o_ref, o.float()) < 6e-3
    if with_states:
        assert not ht.isnan().any() and rel_rms(s_ref, ht) < 5e-3


def test_prep16_tiles_are_the_wy_form():
    """The prep kernel's outputs of one full tile against the formulas in fp64 (``prep16``'s module docstring):
    -T diag(beta) inverts I + diag(beta) strict_lower(A), W = T diag(beta) k e^Gamma, the scan operands, Aqk's two
    parts summing to scale lower(A_qk); rows of a partial tile past its sequence are zero."""
    lengths, H, V = [16, 5], 1, 64
    q, k, z, v, beta, a_log, dtb, _ = _layer_inputs(lengths, H, V, seed=3)
    tplan = make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV)).tiles(16)
    prep = prep16.prep16_outputs(tplan, H, 128, DEV, torch.bfloat16)
    scale = 128**-0.5
    prep16.launch(q, k, z, beta, a_log, dtb, prep, tplan, H, 128, scale, -5.0, True, True, True, L2_EPS)
    w, kr, qd, eg, tb, a_hi, a_lo = (x.double().cpu() for x in prep)
    qn, kn = (torch.nn.functional.normalize(x[0, :16, 0].double().cpu(), dim=-1, eps=0) for x in (q, k))
    g = -5.0 * torch.sigmoid(a_log[0].double().exp().cpu() * (z[0, :16, 0].double().cpu() + dtb[0].double().cpu()))
    gamma = g.cumsum(0)
    b = torch.sigmoid(beta[0, :16, 0].double().cpu())
    a = (kn * gamma.exp()) @ (kn * (-gamma).exp()).T
    t = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + (b[:, None] * a).tril(-1))
    close = lambda x, ref, tol: float((x - ref).norm() / ref.norm()) < tol  # noqa: E731
    assert close(-tb[0, 0], t * b[None, :], 1e-2)
    assert close(w[0, 0], (t * b[None, :]) @ (kn * gamma.exp()), 1e-2)
    assert close(kr[0, 0], kn * (gamma[-1] - gamma).exp(), 1e-2)
    assert close(qd[0, 0], scale * qn * gamma.exp(), 1e-2)
    assert close(eg[0, 0], gamma[-1].exp(), 1e-5)
    aqk = scale * ((qn * gamma.exp()) @ (kn * (-gamma).exp()).T).tril()
    assert close(a_hi[0, 0] + a_lo[0, 0], aqk, 1e-2) and float((a_lo[0, 0]).abs().max()) > 0
    for x in (w, kr, qd, tb, a_hi, a_lo):  # the second sequence's tile: 5 valid rows
        assert (x[1, 0, 5:] == 0).all()


def test_scan16_refuses_more_tile_rows_than_it_can_address():
    """``scan16.launch`` refuses a plan whose tile rows its 32-bit TMA coordinates cannot address, before anything
    runs."""
    from types import SimpleNamespace

    x = torch.zeros(1, 16, 1, 128, device=DEV).bfloat16()
    huge = SimpleNamespace(NT=2**27)  # 2^27 tiles x 1 head x 16 rows = 2^31
    with pytest.raises(ValueError, match="2\\^31"):
        scan16.launch((x,) * 7, x, None, None, x, huge, 1, 128, 128)


def _compile_configs():
    """(name, CTAs per SM the launch counts on, launch thunk taking a launcher) of the 16-token forward's two kernels:
    the scan with two 64-column blocks of V per CTA (V a multiple of 128: 12 warps, one CTA per SM) and with one (8
    warps, two CTAs per SM), each with the initial and final states (what its HAS_H0 / STORE_HT flags add: a load
    before its loop, a store after it), and the prep kernel (two CTAs per SM)."""
    import triton.language as tl

    lengths, H, K = [128, 70], 2, 128
    tplan = make_plan(1, sum(lengths), cu_seqlens(lengths), torch.device("cpu")).tiles(16)
    prep = prep16.prep16_outputs(tplan, H, K, "cpu", torch.bfloat16)
    out = []
    for V in (128, 64):
        v, h0 = torch.zeros(1, sum(lengths), H, V).bfloat16(), torch.zeros(len(lengths), H, K, V)
        out.append((f"scan16, V = {V}", 1 if V == 128 else 2, lambda launcher, v=v, h0=h0, V=V: scan16.launch(
            prep, v, h0, h0.clone(), v.clone(), tplan, H, K, V, launcher=launcher)))
    b = torch.zeros(1, sum(lengths), H).bfloat16()
    q = torch.zeros(1, sum(lengths), H, K).bfloat16()
    eg = prep[3]
    out.append(("prep16", 2, lambda launcher: launcher(
        prep16._prep16_kernel, (tplan.NT, H), q, q, q, b, eg, eg, *prep, tplan.cu, tplan.chunk_idx, H, -5.0, 0.088,
        K=K, BKF=128, USE_GATE=True, USE_L2=True, USE_BETA_SIG=True, EPS=L2_EPS, DTA=tl.bfloat16,
        num_warps=prep16.PREP_WARPS)))
    return out


def _check_compiled(rows, configs):
    """Each compile without spilling, and as many CTAs of it as its launch counts on (its warps as launched, the
    Gluon loader's padded to a warpgroup) fitting an H200 SM."""
    assert [r["kernel"] for r in rows] == ["_gluon_scan16_kernel" if n.startswith("scan16") else "_prep16_kernel"
                                           for n, _, _ in configs]
    for (name, ctas, _), row in zip(configs, rows):
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, (name, row)
        assert (row["shared_bytes"] + 1024) * ctas <= 233472, (name, row)
        assert row["registers"] * 32 * row["num_warps"] * ctas <= 65536, (name, row)


def test_scan16_compiles_for_sm90(tmp_path):
    """In a process of its own, without the interpreter: the scan in both its forms and the prep kernel compile for
    sm_90 without spilling, as many CTAs of each as its launch counts on fitting an SM (``_compile_configs``)."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows = last_json_line(run_without_interpreter(["-m", "tests.ops.test_kda_chunk16"], tmp_path))
    _check_compiled(rows, _compile_configs())


if __name__ == "__main__":  # the compile step of test_scan16_compiles_for_sm90
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    for _, _, compile_it in _compile_configs():
        compile_it(lambda kern, grid, *a, **kw: compiler(kern, list(a), kw, grid))
    print(json.dumps([{k: row[k] for k in ("kernel", "registers", "num_warps", "shared_bytes", "spill_store_bytes",
                                           "spill_load_bytes")} for row in compiler.rows]))
