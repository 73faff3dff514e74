"""The 16-token forward (kimik3/ops/kda/triton_prep16.py, the chunk-parallel prep in Triton, and gluon_scan16.py,
the state scan in Gluon) against the fp32 torch path. On the CPU the prep runs under the Triton interpreter and the
scan through the Gluon emulator (tests/gluon_emulator.py), and the scan is also compiled for sm_90; on a Hopper GPU
both run, and the whole forward is also timed against the 64-token one's error."""

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

from kimik3.ops.kda import L2_EPS, chunk_kda, gluon_scan16, triton_prep16  # noqa: E402
from kimik3.ops.kda import triton_forward as tf  # noqa: E402

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if torch.cuda.is_available() and not ON_GPU and __name__ != "__main__":
    pytest.skip("the Gluon scan runs on sm_90", allow_module_level=True)
if not torch.cuda.is_available():
    from kimik3.ops.kda.triton_autograd import interpreter_bf16_fix

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
    tplan = tf.make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV)).tiles(16)
    prep = triton_prep16.prep16_outputs(tplan, H, K, DEV, torch.bfloat16)
    triton_prep16.launch(q, k, z, beta, a_log, dtb, prep, tplan, H, K, K**-0.5, -5.0, True, True, True, L2_EPS)
    o = torch.full_like(v, float("nan"))
    ht = torch.full((len(lengths), H, K, V), float("nan"), device=DEV) if with_states else None
    gluon_scan16.launch(prep, v, h0 if with_states else None, ht, o, tplan, H, K, V,
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
    ([1, 15, 16, 17, 40], 2, 128, True, 0.0),  # one-token, partial and whole tiles; two V halves per CTA
    ([33], 1, 64, False, 0.0),  # one V half per CTA, no states
    ([20, 12], 1, 128, True, 8.0),  # every gate at its bound: a tile's log-decay reaches -80
    ([63, 64, 65, 1000], 1, 128, True, 0.0),  # the lengths
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
    """The prep kernel's outputs of one full tile against the formulas in fp64 (module docstring of triton_prep16):
    -T diag(beta) inverts I + diag(beta) strict_lower(A), W = T diag(beta) k e^Gamma, the scan operands, Aqk's two
    parts summing to scale lower(A_qk); rows of a partial tile past its sequence are zero."""
    lengths, H, V = [16, 5], 1, 64
    q, k, z, v, beta, a_log, dtb, _ = _layer_inputs(lengths, H, V, seed=3)
    tplan = tf.make_plan(1, sum(lengths), cu_seqlens(lengths, DEV), torch.device(DEV)).tiles(16)
    prep = triton_prep16.prep16_outputs(tplan, H, 128, DEV, torch.bfloat16)
    scale = 128**-0.5
    triton_prep16.launch(q, k, z, beta, a_log, dtb, prep, tplan, H, 128, scale, -5.0, True, True, True, L2_EPS)
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


def test_supported_and_launch_refuse_what_they_cannot_run():
    """``gluon_scan16.supported`` names what it needs (the forward's dispatch asks it), and ``launch`` refuses a plan
    whose tile rows its 32-bit TMA coordinates cannot address, before anything runs."""
    from types import SimpleNamespace

    x = torch.zeros(1, 16, 1, 128, device=DEV).bfloat16()
    assert "K = 128" in gluon_scan16.supported(x[..., :64], x)
    assert "multiple of 64" in gluon_scan16.supported(x, x[..., :96])
    assert "bf16" in gluon_scan16.supported(x.float(), x)
    if not ON_GPU:
        assert gluon_scan16.supported(x, x) == "a Hopper GPU (sm_90)"
    huge = SimpleNamespace(NT=2**27)  # 2^27 tiles x 1 head x 16 rows = 2^31
    with pytest.raises(ValueError, match="2\\^31"):
        gluon_scan16.launch((x,) * 7, x, None, None, x, huge, 1, 128, 128)


def test_scan16_compiles_for_sm90(tmp_path):
    """In a process of its own, without the interpreter: the scan compiles for sm_90 without spilling, one CTA (12
    warps) fits an SM, and so do two CTAs of the prep kernel."""
    from tests.gluon_emulator import last_json_line, run_without_interpreter

    rows = last_json_line(run_without_interpreter(["-m", "tests.ops.test_kda_chunk16"], tmp_path))
    assert [r["kernel"] for r in rows] == ["_gluon_scan16_kernel", "_gluon_scan16_kernel", "_prep16_kernel"]
    for row, ctas in zip(rows, (1, 1, 2)):
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row
        assert (row["shared_bytes"] + 1024) * ctas <= 233472, row
        assert row["registers"] * 32 * row["num_warps"] * ctas <= 65536, row


if __name__ == "__main__":  # the compile step of test_scan16_compiles_for_sm90
    import triton.language as tl

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from kda_sm90_report import Sm90Compiler

    compiler = Sm90Compiler()
    launcher = lambda kern, grid, *a, **kw: compiler(kern, list(a), kw, grid)  # noqa: E731
    lengths, H, K = [128, 70], 2, 128
    tplan = tf.make_plan(1, sum(lengths), cu_seqlens(lengths), torch.device("cpu")).tiles(16)
    prep = triton_prep16.prep16_outputs(tplan, H, K, "cpu", torch.bfloat16)
    v = torch.zeros(1, sum(lengths), H, 128).bfloat16()
    h0 = torch.zeros(len(lengths), H, K, 128)
    gluon_scan16.launch(prep, v, h0, h0.clone(), v.clone(), tplan, H, K, 128, launcher=launcher)
    gluon_scan16.launch(prep, v, None, None, v.clone(), tplan, H, K, 128, launcher=launcher)
    b = torch.zeros(1, sum(lengths), H).bfloat16()
    q = torch.zeros(1, sum(lengths), H, K).bfloat16()
    w, kr, qd, eg, tb, a_hi, a_lo = prep
    compiler(triton_prep16._prep16_kernel, [q, q, q, b, eg, eg, *prep, tplan.cu, tplan.chunk_idx, H, -5.0, 0.088],
             dict(K=K, BKF=128, USE_GATE=True, USE_L2=True, USE_BETA_SIG=True, EPS=L2_EPS, DTA=tl.bfloat16,
                  num_warps=triton_prep16.PREP_WARPS), (tplan.NT, H))
    print(json.dumps([{k: row[k] for k in ("kernel", "registers", "num_warps", "shared_bytes", "spill_store_bytes",
                                           "spill_load_bytes")} for row in compiler.rows]))
