"""CPU smoke test of benchmarks/kda_kernel.py's `chunk` and `profile` sections (the GPU benchmark) and of
benchmarks/kda_precision.py, run under the Triton interpreter at a tiny shape with a stand-in for fla, so a
broken section or `--try` switch shows up in CI rather than in a device call."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest
import torch

from tests.triton_bounds import require_triton_kernels

require_triton_kernels()

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_kernel.py")
PRECISION_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_precision.py")
CHUNK_FACTORS_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_chunk_factors.py")
TRAIN_CHECK_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_train_check.py")
NCU_SOURCE_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ncu_source.py")
NCU_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_ncu.py")
PLOT_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plot_kda_profile.py")



def _script(path: str, name: str, bf16_fix: bool = False):
    """A benchmark script imported as a module of its own (``name``); bf16_fix: the interpreter's bf16 patch first,
    for scripts that run our kernels on bf16 inputs off the GPU."""
    if bf16_fix and not torch.cuda.is_available():
        from kimik3.ops.kda.triton_autograd import interpreter_bf16_fix

        interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

@pytest.fixture()
def kk(monkeypatch):
    spec = importlib.util.spec_from_file_location("kda_kernel_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not torch.cuda.is_available():
        monkeypatch.setattr(mod.k3, "DEVICE", "cpu")
        from kimik3.ops.kda.triton_autograd import interpreter_bf16_fix

        interpreter_bf16_fix()  # the interpreter's bf16 dots and casts are not the GPU's (Triton 3.6)

    def wall_ms(fn, warmup=1, rep=1):  # one timed call: the sections' control flow, not a benchmark
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def fake_fla(*xs, **kw):  # fla's keyword contract, answered by our torch path
        for key in ("safe_gate", "use_gate_in_kernel", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel"):
            assert kw.pop(key) is True, key
        kw["dt_bias"] = kw["dt_bias"].view(xs[0].shape[2], xs[0].shape[3])
        from kimik3.ops.kda import chunk_kda

        return chunk_kda(*xs, backend="torch", use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, **kw)

    def fake_fla_decode(q, k, v, g, beta, A_log, dt_bias, initial_state, inplace_final_state, ssm_state_indices,
                        lower_bound, **flags):  # fla's one-token keyword contract, answered by our kernel
        assert inplace_final_state and all(flags.values()) and len(flags) == 3, flags
        from kimik3.ops.kda.triton_decode import kda_decode  # the kernel (the dispatcher would take torch on CPU)

        o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state, ssm_state_indices,
                       A_log=A_log, dt_bias=dt_bias, g_min=lower_bound, **flags)
        return o[:, None], initial_state

    monkeypatch.setattr(mod, "bench", wall_ms)
    monkeypatch.setattr(mod.k3, "load_fla", lambda: (fake_fla, "stand-in"))  # (kda_k3: shared with kda_precision)
    monkeypatch.setattr(mod.k3, "load_fla_decode", lambda: fake_fla_decode)
    return mod


def test_chunk_section_times_ours_the_peer_and_each_experiment(kk):
    tries = ("var=ach", "i16", "nowy+bscan=4", "wyc=32/16+abk=16+l2prep", "intra=fused")
    kk.EXPERIMENTS[:] = [kk.parse_experiment(t) for t in tries]
    kk.chunk([(1, 70, 2, 32)], ["acsw"], use_fla=True, quick=False, do_bwd=True, no_hybrid=True)
    assert kk.RESULTS["fail"] == [], kk.RESULTS["fail"]
    # each experiment's forward, and its gradients at the timed shape, agreed with the default's
    assert len(kk.RESULTS["pass"]) == 2 * len(tries)
    assert sum("gradients vs default" in p for p in kk.RESULTS["pass"]) == len(tries)
    row = kk.RESULTS["timings"]["chunk"][0]
    expected = ["ours_fwd[acsw]", "fla_fwd", "fla_fwdbwd", "ours_fwdbwd", "floor_fwd", "floor_fwdbwd"]
    expected += [f"ours_fwd[{n}]" for n in tries]
    expected += [f"ours_fwdbwd[{n}]" for n in tries]
    assert sorted(row) == sorted(expected + ["shape"])
    assert all(row[k] > 0 for k in expected)
    keys = list(row)
    assert keys.index("fla_fwdbwd") < keys.index("ours_fwd[var=ach]")  # the peer is timed first


def test_profile_section_runs_each_experiment_and_its_table_plots(kk, capsys, tmp_path):
    """Each profiled run is printed and kept in the JSON's profile table, which plot_kda_profile.py draws (a
    label it does not hold is refused, naming the ones it does)."""
    kk.EXPERIMENTS[:] = [kk.parse_experiment("var=ach")]
    kk.profile([(1, 40, 1, 16)], ["acsw"], True)
    out = capsys.readouterr().out
    assert kk.RESULTS["fail"] == [], kk.RESULTS["fail"]
    labels = ["ours fwd variant 'acsw'", "ours fwd [var=ach]", "ours fwd+bwd, default variant",
              "ours fwd+bwd [var=ach]", "fla fwd", "fla fwd+bwd"]
    for label in labels:
        assert label in out, label
    table = kk.RESULTS["timings"]["profile"]
    assert sorted(table) == sorted(labels)
    assert all(row["ms_per_call"] and min(row["ms_per_call"].values()) > 0 for row in table.values())
    path = tmp_path / "kda_kernel.json"
    path.write_text(json.dumps(kk.RESULTS, default=str))
    spec = importlib.util.spec_from_file_location("plot_kda_profile_under_test", PLOT_SCRIPT)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    png = tmp_path / "docs" / "profile.png"
    plot.main([str(path), "--out", str(png), "--run", "fla fwd+bwd", "--run", "ours fwd+bwd, default variant",
               "--run", "fla fwd"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="profiled runs there"):
        plot.main([str(path), "--out", str(png), "--run", "ours fwd variant 'h'"])


def test_host_section_reports_enqueue_and_eager_time_for_ours_and_the_peer(kk, capsys):
    kk.host([(1, 40, 1, 16)], True)
    rows = kk.RESULTS["timings"]["host"]
    assert sorted(rows) == ["fla", "ours"]
    for r in rows.values():
        assert r["enqueue_ms"] > 0 and r["eager_ms"] > 0
        # a CUDA graph needs a GPU: on the CPU the capture is refused and reported, not timed
        assert (r["graph_ms"] is None) == (not torch.cuda.is_available())
    assert "host B1 T40 H1 D16 ours fwd: enqueue" in capsys.readouterr().out


def test_decode_section_times_ours_the_peer_and_each_launch(kk, capsys):
    """Ours at the default launch, the peer, and (--sweep) every launch configuration, each checked against the
    one-token reference before it is timed, at batch sizes below the targets' (no target verdicts)."""
    kk.decode([2, 3], sweep=True, use_fla=True, H=2, D=16)
    assert kk.RESULTS["fail"] == [], kk.RESULTS["fail"]
    names = ["ours", "fla"] + [f"ours BV={bv} warps={nw}" for bv, nw in kk.DECODE_SWEEP]
    assert len(kk.RESULTS["pass"]) == 2 * len(names)
    for row in kk.RESULTS["timings"]["decode"]:
        assert sorted(row) == sorted(names + ["B"])
        assert all(row[n]["us"] > 0 and row[n]["TBps"] > 0 for n in names)
    out = capsys.readouterr().out
    assert "===== decode =====" in out and "| 3 |" in out


def test_unknown_try_switch_is_refused(kk):
    with pytest.raises(SystemExit, match="unknown switch 'colour'"):
        kk.parse_experiment("var=ach+colour")


def test_try_switch_field_counts(kk):
    """Slash-separated switches take their required fields and up to their optional (bracketed) ones."""
    import kimik3.ops.kda.triton_forward as tf

    assert kk.parse_experiment("scan=32/4/1")[1][(tf, "SPLIT_CONFIG")] == (32, 4, 1)
    assert kk.parse_experiment("i16=32/2/1/1")[1][(tf, "INTRA16_CONFIG")] == (32, 2, 1, 1)
    assert kk.parse_experiment("out=128/8")[1][(tf, "OUTPUT_CONFIG")] == (128, 8)
    for bad, usage in (("scan=32/4", "scan=BV/warps/stages"), ("scan=32/4/1/168", "scan=BV/warps/stages"),
                       ("i16=1/2/3/4/5", "i16=BK/warps"), ("bik=32", "bik=BK/warps"), ("out=128", "out=BV/warps")):
        with pytest.raises(SystemExit, match=usage):
            kk.parse_experiment(bad)


def test_forward_form_switches(kk):
    """The prepared forward forms are reachable from --try, alone and together."""
    import kimik3.ops.kda.triton_forward as tf
    import kimik3.ops.kda.triton_prologue as tp

    assert kk.parse_experiment("wyc=32/64+abk=16")[1] == {(tf, "WY_BLOCKS"): (32, 64), (tf, "A_BK"): 16}
    assert kk.parse_experiment("intra=fused+iwarps=4")[1] == {(tf, "INTRA_MODE"): "fused", (tf, "INTRA_WARPS"): 4}
    assert kk.parse_experiment("l2prep+l2r=32/2+gcw=8+iw=8/1/2")[1] == {
        (tp, "L2_ROWS"): False, (tp, "L2_ROWS_CONFIG"): (32, 2), (tp, "GATE_COLS_WARPS"): 8,
        (tf, "INTRA_SPLIT_WARPS"): (8, 1, 2)}
    with pytest.raises(SystemExit, match="iw=A/B/C"):
        kk.parse_experiment("iw=4/1")


def test_backward_form_switches(kk):
    """The backward's alternatives (the WY kernel's loops and stages, the fused pre-activations' backward, the
    suffix pass) are reachable from --try, each way round, so a default flipped can still be timed against."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi

    assert kk.parse_experiment("wyunroll+wys=1+nowyv+nofpb+sfx=32")[1] == {
        (tb, "WY_DYN_LOOP"): False, (tb, "WY_LOOP_STAGES"): 1, (tb, "WY_V_LOOP"): False,
        (tbi, "FUSE_PREACT_BWD"): False, (tbi, "SUFFIX_BK"): 32}
    assert kk.parse_experiment("wydyn+wys=3+wyv+fpb+bis=2")[1] == {
        (tb, "WY_DYN_LOOP"): True, (tb, "WY_LOOP_STAGES"): 3, (tb, "WY_V_LOOP"): True, (tbi, "FUSE_PREACT_BWD"): True,
        (tbi, "ROWS_STAGES"): 2}
    with pytest.raises(SystemExit, match="wys=S"):
        kk.parse_experiment("wys=three")


@pytest.fixture()
def prec():
    spec = importlib.util.spec_from_file_location("kda_precision_under_test", PRECISION_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_precision_script_measures_each_variant_and_the_peer_against_the_token_loop(kk, prec, capsys):
    assert prec.k3 is kk.k3  # one kda_k3 module: the fixture's CPU device and stand-in peer serve both scripts
    per_seed = [prec.measure((1, 40, 2, 16), ["ach", "acsw"], True, seed) for seed in range(2)]
    assert [sorted(s) for s in per_seed] == [sorted(["ours 'ach'", "ours 'acsw'", "fla"])] * 2
    summary = prec.report((1, 40, 2, 16), per_seed)
    out = capsys.readouterr().out
    assert "| ours 'acsw' |" in out and "fla's precision class" in out
    for name, errs in summary["mean"].items():
        assert sorted(errs) == sorted(prec.FIELDS)
        # bf16 inputs: every error is the kernels' own rounding, well under a percent, and not zero
        assert all(0 < e < 2e-2 for e in errs.values()), (name, errs)
    assert set(summary["in_fla_class"]) == {"ours 'ach'", "ours 'acsw'"}


def test_precision_script_measures_a_try_as_its_own_row(kk, prec, monkeypatch):
    """A --try (here dh16, the state gradients stored 16-bit) measured as our default variant under its overrides,
    the backward included, on the same inputs as the variants and the peer, and judged by the same class rule."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_forward as tf

    dh_dtypes, orig = [], tb.dh_dtype
    monkeypatch.setattr(tb, "dh_dtype", lambda *a: dh_dtypes.append(orig(*a)) or dh_dtypes[-1])
    default = f"ours '{tf.DEFAULT_VARIANT}'"
    per_seed = [prec.measure((1, 40, 2, 16), [tf.DEFAULT_VARIANT], True, 0, [prec.parse_experiment("dh16")])]
    assert sorted(per_seed[0]) == sorted([default, default + " +dh16", "fla"])
    assert dh_dtypes == [torch.float32, torch.bfloat16] and tb.DH_16BIT is False  # on for the try alone
    summary = prec.report((1, 40, 2, 16), per_seed)
    errs, base = summary["mean"][default + " +dh16"], summary["mean"][default]
    assert all(0 < e < 2e-2 for e in errs.values()), errs
    # dh reaches dk and the gate input's gradient dz only
    assert errs["dq"] == base["dq"] and errs["dk"] != base["dk"] and errs["dz"] != base["dz"], (errs, base)
    assert set(summary["in_fla_class"]) == {default, default + " +dh16"}


def test_precision_script_try_option(prec, monkeypatch, tmp_path):
    """kda_precision.py --try takes a comma list of kda_tries.py's tries and hands them to every seed's measurement;
    its rows get the class verdict in the summary; a bad name exits, naming it, before any measurement."""
    import kimik3.ops.kda.triton_backward as tb

    calls = []

    def fake_measure(shape, variants, use_fla, seed, tries=()):
        calls.append(tries)
        errs = dict.fromkeys(prec.FIELDS, 4e-3)
        return {"ours 'h'": errs, **{f"ours 'h' +{name}": {**errs, "dk": 6e-3} for name, _ in tries}, "fla": errs}

    monkeypatch.setattr(prec, "measure", fake_measure)
    monkeypatch.setattr(prec.k3, "DEVICE", prec.k3.DEVICE)  # (main points it at the CPU off the GPU)
    assert prec.main(["--shape", "1,40,2,16", "--variants", "h", "--try", "dh16,nodh16+wys=2", "--seeds", "2",
                      "--out", str(tmp_path)]) == 0
    assert calls == [[("dh16", {(tb, "DH_16BIT"): True}),
                      ("nodh16+wys=2", {(tb, "DH_16BIT"): False, (tb, "WY_LOOP_STAGES"): 2})]] * 2
    with open(tmp_path / "kda_precision.json") as fh:
        verdicts = json.load(fh)["in_fla_class"]
    assert verdicts == {"ours 'h'": True, "ours 'h' +dh16": False, "ours 'h' +nodh16+wys=2": False}
    calls.clear()
    with pytest.raises(SystemExit, match="--try: unknown switch 'dh8'"):
        prec.main(["--try", "dh16,dh8"])
    assert not calls


def test_precision_class_rule(prec):
    fla = dict.fromkeys(prec.FIELDS, 4e-3)
    assert prec.in_fla_class(dict.fromkeys(prec.FIELDS, 5e-3), fla)  # 1.25x
    assert not prec.in_fla_class({**fla, "dk": 5.1e-3}, fla)
    assert prec.in_fla_class({**fla, "dk": 9e-4}, {**fla, "dk": 1e-4})  # under the floor


def test_decode_time_judges_on_the_graph_and_retimes_a_disagreeing_pair(kk):
    """Graph time where there is one; a host-bound eager call never triggers a re-time; a GPU-bound pair that
    disagrees by more than 2% is timed again, and judged on the slower if it still disagrees."""
    def hs(eager, graph, enqueue=0.01):
        return {"eager_ms": eager, "graph_ms": graph, "enqueue_ms": enqueue}

    def never():
        raise AssertionError("re-timed a pair that needed no second look")

    assert kk.decode_time(hs(0.8, None), never, "x") == (0.8, "eager")
    assert kk.decode_time(hs(0.80, 0.81), never, "x") == (0.81, "graph")
    assert kk.decode_time(hs(0.050, 0.009, enqueue=0.07), never, "x") == (0.009, "graph")  # host-bound eager
    assert kk.decode_time(hs(0.80, 0.89), lambda: hs(0.80, 0.805), "x") == (0.805, "graph (timed again)")
    t, judged = kk.decode_time(hs(0.80, 0.89), lambda: hs(0.90, 0.80), "x")
    assert t == 0.90 and judged.startswith("slower")


def test_report_keeps_a_failing_section_and_writes_the_summary(kk, tmp_path, capsys):
    """The shared harness (benchmarks/harness.py): a section that raises becomes a FAIL with its traceback and the
    run goes on; finish() names every FAIL, writes the JSON and returns exit status 1 (0 when all passed)."""
    import harness  # on sys.path: the benchmark module put it there

    report = harness.Report(rows=[])

    @report.section
    def broken():
        raise RuntimeError("no such kernel")

    assert broken() is None
    report.verdict("after the broken section", True)
    assert report.results["fail"] == ["broken:exception"] and report.results["pass"] == ["after the broken section"]
    assert "RuntimeError: no such kernel" in report.results["errors"]["broken"]
    assert report.finish(0.0, str(tmp_path), "r.json") == 1
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["fail"] == ["broken:exception"] and saved["rows"] == []
    assert "FAILED: broken:exception" in capsys.readouterr().out
    assert harness.Report().finish(0.0, None, "unused.json") == 0
    assert harness.rel(torch.ones(4), torch.ones(4) * 1.5) == pytest.approx(0.5)


def test_gluon_dispatch_script_times_each_phase_both_ways(monkeypatch):
    """benchmarks/kda_gluon_dispatch.py's section with the forward stubbed out: each shape is run with the phase's
    Gluon switch off and then on, with the threshold that dispatches that phase (the scans have their own) at zero
    so the Gluon kernel is considered at every size, and every switch and threshold is restored after."""
    import kimik3.ops.kda.triton_forward as tf

    path = os.path.join(os.path.dirname(SCRIPT), "kda_gluon_dispatch.py")
    spec = importlib.util.spec_from_file_location("kda_gluon_dispatch_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before = {n: getattr(tf, n) for n in ("GLUON_SCAN", "GLUON_SCAN_MIN_ITEMS", "GLUON_MIN_ITEMS")}
    seen = []

    def forward(*_):
        seen.append((tf.GLUON_SCAN, tf.GLUON_SCAN_MIN_ITEMS, tf.GLUON_MIN_ITEMS))
        return (torch.ones(4),)

    monkeypatch.setattr(mod, "SHAPES", [(1, 128, 2), (1, 256, 2)])
    monkeypatch.setattr(mod.k3, "k3_inputs", lambda *a: (None, None, None))
    monkeypatch.setattr(mod.k3, "ours_k3", forward)
    monkeypatch.setattr(mod, "bench", lambda fn: fn() and 1.0)
    monkeypatch.setattr(mod, "enqueue_ms", lambda fn: fn() and 0.5)
    mod.dispatch(["scan"])
    assert [s[0] for s in seen] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3
    assert all(s[1:] == (0, 0) for s in seen)
    assert {n: getattr(tf, n) for n in before} == before
    rows = mod.REPORT.results["dispatch"]
    assert [r["items"] for r in rows] == [8, 16] and all(r["ratio"] == 1.0 for r in rows)
    assert not mod.REPORT.results["fail"]


def test_chunk_section_fails_a_try_whose_gradients_differ(kk):
    """A try whose backward is wrong (here dv doubled) is reported as a failure, not only timed."""
    import kimik3.ops.kda.triton_backward as tb

    orig = tb.kda_bwd_triton

    def doubled_dv(*a, **kw):
        grads = list(orig(*a, **kw))
        grads[2] = grads[2] * 2
        return tuple(grads)

    kk.EXPERIMENTS[:] = [("dv2", {(tb, "kda_bwd_triton"): doubled_dv})]
    kk.chunk([(1, 70, 2, 32)], ["acsw"], use_fla=False, quick=False, do_bwd=True, no_hybrid=True)
    assert len(kk.RESULTS["fail"]) == 1 and "gradients vs default" in kk.RESULTS["fail"][0], kk.RESULTS["fail"]


def test_ncu_driver_runs_a_step_and_applies_its_try(monkeypatch, capsys):
    """benchmarks/kda_ncu.py (the step Nsight Compute profiles on the GPU machine) runs end to end on the CPU at a
    small shape, with its --try applied to both the warm-up and the profiled step (seen by the intra backward's
    mode)."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi

    mod = _script(NCU_SCRIPT, "kda_ncu_under_test", bf16_fix=True)
    seen = []
    orig = tb.bwd_intra
    monkeypatch.setattr(tb, "bwd_intra", lambda *a, **k: seen.append(tbi.BWD_INTRA_MODE) or orig(*a, **k))
    assert mod.main(["--shape", "1,70,2,32", "--try", "btiles"]) == 0
    assert seen == ["tiles", "tiles"]
    assert tbi.BWD_INTRA_MODE == "rows"  # restored after the steps
    out = capsys.readouterr().out
    assert "one forward+backward at B1 T70 H2 D32 [btiles]" in out


def test_ncu_source_summary_reads_the_source_page(tmp_path, capsys):
    """benchmarks/ncu_source.py reads ncu's source-page CSV (gzipped): the source lines' totals, not their SASS rows,
    the stall reasons' shares, and the lines ranked by the chosen counter."""
    import gzip

    mod = _script(NCU_SOURCE_SCRIPT, "ncu_source_under_test")
    header = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
              "L2 Theoretical Sectors Global Excessive", "L2 Theoretical Sectors Global", "Instructions Executed",
              "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
    rows = [["File Path", "/x/kimik3/ops/kda/triton_backward.py"], header,
            ["10", "G = tl.load(G_ptr)", "-", "-", "30", "100", "200", "5", "20", "10", "99"],
            ["", "", "0x10", "LDG.E.128 R0", "30", "100", "200", "5", "20", "10", "99"],  # its SASS row: not counted
            ["11", "acc += tl.dot(a, b)", "-", "-", "10", "0", "0", "1,000", "0", "10", "0"],
            ["File Path", "/y/triton/language/standard.py"], header,
            ["263", "return a + b", "-", "-", "60", "0", "0", "7", "30", "30", "0"]]
    path = tmp_path / "sass_k.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        import csv

        csv.writer(f).writerows(rows)
    lines = mod.read_source_lines(str(path))
    assert [(s.file, s.line) for s in lines] == [("triton_backward.py", "10"), ("triton_backward.py", "11"),
                                                 ("standard.py", "263")]
    assert lines[1].metrics["Instructions Executed"] == 1000
    shares = mod.stall_reasons(lines)
    assert list(shares) == ["long_sb", "barrier"] and abs(shares["long_sb"] - 0.5) < 1e-9
    assert mod.main([str(path), "--by", "sectors", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "triton_backward.py:  10" in out[-1] and "excess sectors 100 / 200" in out[-1]
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu source page"):
        mod.read_source_lines(str(bad))


def test_ncu_driver_profiles_the_peer(monkeypatch, capsys):
    """kda_ncu.py --peer runs fla's entry (here a stand-in that checks K3's keyword contract) instead of ours, and
    refuses a --try, which would apply to ours only."""
    from kimik3.ops.kda import chunk_kda

    mod = _script(NCU_SCRIPT, "kda_ncu_peer_under_test", bf16_fix=True)
    calls = []

    def fake_fla(*xs, **kw):
        for key in ("safe_gate", "use_gate_in_kernel", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel"):
            assert kw.pop(key) is True, key
        calls.append(kw.pop("lower_bound"))
        kw["dt_bias"] = kw["dt_bias"].view(xs[0].shape[2], xs[0].shape[3])
        return chunk_kda(*xs, backend="torch", use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, lower_bound=calls[-1], **kw)

    monkeypatch.setattr(mod, "load_fla", lambda: (fake_fla, "stand-in"))
    assert mod.main(["--shape", "1,70,2,32", "--peer"]) == 0
    assert calls == [-5.0, -5.0]  # warm-up and profiled step, both through fla's entry
    assert "one fla's forward+backward at B1 T70 H2 D32" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--try applies to ours only"):
        mod.main(["--shape", "1,70,2,32", "--peer", "--try", "btiles"])


def test_chunk_factor_recurrence_matches_fp64(capsys):
    """benchmarks/kda_chunk_factors.py: the chunk form's factor recurrences give the intra-chunk sums as precisely as
    the rows form in fp32 (against fp64), with every gate at the bound too."""
    import re

    mod = _script(CHUNK_FACTORS_SCRIPT, "kda_chunk_factors_under_test")
    assert mod.main(["--seeds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line in lines:
        rows, chunk = (float(x) for x in re.findall(r"form ([0-9.e+-]+)", line))
        assert rows < 1e-5 and chunk < 1e-5, line


@pytest.mark.parametrize("self_diff,noise,passes", [(0.04, True, True), (0.04, False, False), (0.0, True, False)])
def test_train_check_judges_against_the_torch_paths_own_noise(monkeypatch, capsys, self_diff, noise, passes):
    """``kda_train_check.py --noise``: the torch path trains twice per seed and the Triton path's validation-loss
    distance (0.06 here, over the 0.05 tolerance) passes when within twice the torch path's distance from itself, and
    fails when the torch path reproduces itself exactly; without --noise the tolerance alone decides. The training
    runs are stand-ins (the real ones need the GPU machine)."""
    mod = _script(TRAIN_CHECK_SCRIPT, "kda_train_check_under_test")
    runs, dirs = [], set()

    def fake_train(backend, args, tmp, seed, run=""):
        runs.append(backend)
        dirs.add(f"{backend}-{seed}{run}")  # the trainer refuses a run directory that is not empty
        repeat = noise and len(runs) % 3 == 0  # --noise: each seed trains torch, triton, torch again
        val = {"torch": 6.0 + self_diff * repeat, "triton": 6.06}[backend]
        return [val] * args.steps, 1000.0, val, float("nan")

    monkeypatch.setattr(mod, "train", fake_train)
    monkeypatch.setattr(sys, "argv", ["kda_train_check.py", "--steps", "12", "--seeds", "2", "--device", "cpu"]
                        + (["--noise"] if noise else []))
    with pytest.raises(SystemExit) as exit_info:
        mod.main()
    out = capsys.readouterr().out
    assert (exit_info.value.code == 0) == passes, out
    assert runs.count("torch") == (4 if noise else 2) and runs.count("triton") == 2
    assert len(dirs) == len(runs)  # every run in a directory of its own
    assert ("torch path against itself" in out) == noise


def test_train_check_takes_a_head_dim_and_a_try_for_the_triton_runs(monkeypatch, capsys):
    """``kda_train_check.py --kda-head-dim 128 --try ...``: the experiment is parsed before any training (a bad name
    exits naming it) and handed to the runs (stand-ins here); ``counting_gluon_launches`` counts a Gluon module's
    launches inside its block and restores the module's own ``launch`` after it."""
    mod = _script(TRAIN_CHECK_SCRIPT, "kda_train_check_try_under_test")
    seen = []

    def fake_train(backend, args, tmp, seed, run=""):
        seen.append((backend, args.kda_head_dim, args.overrides))
        return [6.0] * args.steps, 1000.0, 6.0, float("nan")

    monkeypatch.setattr(mod, "train", fake_train)
    argv = ["kda_train_check.py", "--steps", "12", "--device", "cpu", "--kda-head-dim", "128"]
    monkeypatch.setattr(sys, "argv", argv + ["--try", "triton_forward.GLUON_MIN_ITEMS=0"])
    with pytest.raises(SystemExit) as exit_info:
        mod.main()
    assert exit_info.value.code == 0, capsys.readouterr().out
    from kimik3.ops.kda import gluon_bwd_intra, triton_forward

    assert [s[:2] for s in seen] == [("torch", 128), ("triton", 128)]
    assert seen[1][2] == {(triton_forward, "GLUON_MIN_ITEMS"): 0}
    monkeypatch.setattr(sys, "argv", argv + ["--try", "colour"])
    with pytest.raises(SystemExit, match="colour"):
        mod.main()
    assert len(seen) == 2  # refused before any training

    monkeypatch.setattr(gluon_bwd_intra, "launch", lambda *a, **k: "launched")
    stand_in = gluon_bwd_intra.launch
    with mod.counting_gluon_launches({}) as counts:
        assert gluon_bwd_intra.launch(1, x=2) == "launched"
        assert gluon_bwd_intra.launch() == "launched"
    assert counts == {"gluon_bwd_intra": 2} and gluon_bwd_intra.launch is stand_in
