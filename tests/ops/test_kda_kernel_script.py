"""CPU smoke tests of the KDA benchmark scripts that run on the GPU machine (benchmarks/kda_kernel.py's sections,
kda_precision.py, kda_ncu.py, ncu_source.py, plot_kda_profile.py, kda_train_check.py): each section at the smallest
shape under the Triton interpreter, with a stand-in for fla that answers fla's keyword contract, so a broken
section, table or argument check shows up in CI rather than in a device call."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import os
import sys
import time

import pytest
import torch

from tests.triton_bounds import require_triton_kernels

require_triton_kernels()

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
SHAPE = (1, 40, 1, 16)  # B, T, H, D: one partial chunk


def _script(name: str, bf16_fix: bool = False):
    """benchmarks/<name>.py imported as a module of its own; bf16_fix: the interpreter patched for our kernels on
    bf16 inputs off the GPU (kda_k3.interpreter_bf16_fix), for scripts that run them."""
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", os.path.join(BENCHMARKS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if bf16_fix and not torch.cuda.is_available():
        sys.modules["kda_k3"].interpreter_bf16_fix()  # (the script put benchmarks/ on sys.path and imported it)
    return mod


def one_call_ms(fn, warmup=0, rep=0):
    """A stand-in for do_bench: one timed call (the sections' control flow, not a benchmark)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3 + 1e-6


def fake_fla(*xs, **kw):
    """fla's chunk_kda keyword contract (K3's: every pre-activation fused, the safe gate), answered by our torch
    path."""
    from kimik3.ops.kda import chunk_kda

    for key in ("safe_gate", "use_gate_in_kernel", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel"):
        assert kw.pop(key) is True, key
    kw["dt_bias"] = kw["dt_bias"].view(xs[0].shape[2], xs[0].shape[3])
    return chunk_kda(*xs, backend="torch", use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, **kw)


def fake_fla_decode(q, k, v, g, beta, A_log, dt_bias, initial_state, inplace_final_state, ssm_state_indices,
                    lower_bound, **flags):
    """fla's one-token keyword contract, answered by our kernel (the torch path rounds q / k to bf16, which the
    decode section's 1e-5 state bound would not pass)."""
    from kimik3.ops.kda import kda_decode

    assert inplace_final_state and all(flags.values()) and len(flags) == 3, flags
    o = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state, ssm_state_indices, A_log=A_log,
                   dt_bias=dt_bias, g_min=lower_bound, backend="triton", **flags)
    return o[:, None], initial_state


@pytest.fixture()
def kk(monkeypatch):
    mod = _script("kda_kernel", bf16_fix=True)
    if not torch.cuda.is_available():
        monkeypatch.setattr(mod.k3, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "bench", one_call_ms)
    monkeypatch.setattr(mod.k3, "load_fla", lambda: (fake_fla, "stand-in"))  # (kda_k3: shared with kda_precision)
    monkeypatch.setattr(mod.k3, "load_fla_decode", lambda: fake_fla_decode)
    return mod


def test_chunk_section_times_ours_and_the_peer_and_computes_the_ratios(kk, capsys):
    kk.chunk([SHAPE], use_fla=True, quick=False, do_bwd=True)
    assert kk.RESULTS["fail"] == [], kk.RESULTS["fail"]
    row = kk.RESULTS["timings"]["chunk"][0]
    timed = ["ours_fwd", "fla_fwd", "fla_fwdbwd", "ours_fwdbwd", "floor_fwd", "floor_fwdbwd"]
    assert sorted(row) == sorted(timed + ["shape", "ratio_fwd", "ratio_fwdbwd"])
    assert row["shape"] == "B1 T40 H1 D16" and all(row[k] > 0 for k in timed)
    assert row["ratio_fwd"] == row["fla_fwd"] / row["ours_fwd"]
    assert row["ratio_fwdbwd"] == row["fla_fwdbwd"] / row["ours_fwdbwd"]
    out = capsys.readouterr().out
    assert f"ratio fla/ours fwd B1 T40 H1 D16: {row['ratio_fwd']:.2f}x (target >= 2: " in out
    assert f"ratio fla/ours fwd+bwd B1 T40 H1 D16: {row['ratio_fwdbwd']:.2f}x (target >= 1.5: " in out
    assert "| shape | ours_fwd | fla_fwd | fla_fwdbwd | ours_fwdbwd | floor_fwd | floor_fwdbwd |" in out


def test_profile_section_keeps_a_table_that_plots(kk, monkeypatch, capsys, tmp_path):
    """Each profiled run is printed and kept in the JSON's profile table, which plot_kda_profile.py draws by default
    (a label it does not hold is refused, naming the ones it does). Ours and the peer are one cheap differentiable
    call here: the section's bookkeeping, not the kernels, is under test."""
    def stand_in(*xs):
        return xs[2] * sum(x.float().sum() for x in xs[:5]), None

    monkeypatch.setattr(kk, "ours_k3", lambda xs, a_log, dtb: stand_in(*xs))
    monkeypatch.setattr(kk.k3, "load_fla", lambda: (lambda *xs, **kw: stand_in(*xs), "stand-in"))
    kk.profile([SHAPE], True)
    out = capsys.readouterr().out
    assert kk.RESULTS["fail"] == [], kk.RESULTS["fail"]
    labels = ["ours fwd", "ours fwd+bwd", "fla fwd", "fla fwd+bwd"]
    for label in labels:
        assert f"profile B1 T40 H1 D16 {label} (" in out, label
    table = kk.RESULTS["timings"]["profile"]
    assert sorted(table) == sorted(labels)
    assert all(row["ms_per_call"] and min(row["ms_per_call"].values()) > 0 for row in table.values())
    path = tmp_path / "kda_kernel.json"
    path.write_text(json.dumps(kk.RESULTS, default=str))
    plot = _script("plot_kda_profile")
    png = tmp_path / "docs" / "profile.png"
    assert plot.main([str(path), "--out", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="profiled runs there"):
        plot.main([str(path), "--out", str(png), "--run", "ours fwd variant 'h'"])


def test_host_section_reports_enqueue_and_eager_time_for_ours_and_the_peer(kk, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(kk, "ours_k3", lambda *a: calls.append("ours"))  # (the host's share of a call: any will do)
    monkeypatch.setattr(kk.k3, "load_fla", lambda: (lambda *a, **kw: calls.append("fla"), "stand-in"))
    kk.host([SHAPE], True)
    assert calls.count("ours") == calls.count("fla") >= 20  # a warm-up, the enqueue samples, the eager median
    rows = kk.RESULTS["timings"]["host"]
    assert sorted(rows) == ["fla", "ours"]
    for r in rows.values():
        assert r["enqueue_ms"] > 0 and r["eager_ms"] > 0
        # a CUDA graph needs a GPU: on the CPU the capture is refused and reported, not timed
        assert (r["graph_ms"] is None) == (not torch.cuda.is_available())
    assert "host B1 T40 H1 D16 ours fwd: enqueue" in capsys.readouterr().out


def test_decode_section_checks_and_times_ours_and_the_peer_and_judges_the_target(kk, capsys):
    """Ours (the kernel through kda_decode) and the peer, each checked against the one-token reference before it is
    timed; the B1 latency target is judged (and on the interpreter, missed)."""
    kk.decode([1], use_fla=True, H=2, D=16)
    assert kk.RESULTS["pass"] == ["decode B1 ours vs recurrent_kda_step", "decode B1 fla vs recurrent_kda_step"]
    judged = "graph" if torch.cuda.is_available() else "eager"
    assert kk.RESULTS["fail"] == [f"decode B1 < 30 us (target; {judged})"]
    (row,) = kk.RESULTS["timings"]["decode"]
    assert sorted(row) == ["B", "fla", "ours"]
    assert all(row[n]["us"] > 0 and row[n]["TBps"] > 0 and row[n]["judged"] == judged for n in ("ours", "fla"))
    out = capsys.readouterr().out
    assert "===== decode =====" in out
    assert f"| 1 | {row['ours']['us']:.1f} |" in out and f"| {row['fla']['us'] / row['ours']['us']:.2f}x |" in out


def test_main_refuses_bad_arguments_before_any_work(kk, capsys):
    for argv, message in ((["--sections", "chunk,colour"], "unknown \\['colour'\\]"),
                          (["--shapes", "0,2"], "indices 0 .. 1"), (["--shapes", "x"], "comma list of integers"),
                          (["--decode-batches", "1,b"], "--decode-batches")):
        with pytest.raises(SystemExit, match=message):
            kk.main(argv)
    for removed in (["--variants", "h"], ["--try", "wy"], ["--no-hybrid"], ["--sweep"]):
        with pytest.raises(SystemExit) as exit_info:
            kk.main(removed)
        assert exit_info.value.code == 2  # argparse: no such option
    assert kk.RESULTS["pass"] == [] and kk.RESULTS["fail"] == []


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


def test_chunk_counts_and_the_roofline_floor(kk):
    """The counted work: the backward triples the forward's FLOPs, and the floor is the larger of the two
    ceilings' times."""
    f_fwd, b_fwd = kk.chunk_counts(1, 128, 2, 64, False)
    f_bwd, b_bwd = kk.chunk_counts(1, 128, 2, 64, True)
    assert f_bwd == 3 * f_fwd and b_bwd > 2 * b_fwd
    assert f_fwd == 2 * 2 * (2 * 64 * 64 * 64 + 2 * 64 * 64 * 128 + 6 * 64 * 64 * 64 + 64 * 64 * 64)


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


@pytest.fixture()
def prec(kk):
    mod = _script("kda_precision")
    assert mod.k3 is kk.k3  # one kda_k3 module: the fixture's CPU device and stand-in peer serve both scripts
    return mod


def test_precision_script_measures_ours_and_the_peer_against_the_token_loop(prec, capsys):
    per_seed = [prec.measure(SHAPE, True, 0)]
    assert sorted(per_seed[0]) == ["fla", "ours"]
    summary = prec.report(SHAPE, per_seed)
    for name, errs in summary["mean"].items():
        assert sorted(errs) == sorted(prec.FIELDS)
        # bf16 inputs: every error is the kernels' own rounding, well under a percent, and not zero
        assert all(0 < e < 2e-2 for e in errs.values()), (name, errs)
    out = capsys.readouterr().out
    ours, fla = summary["mean"]["ours"], summary["mean"]["fla"]
    assert f"| ours | {ours['o']:.2e} ({ours['o'] / fla['o']:.2f}x) |" in out
    assert f"| fla | {fla['o']:.2e} |" in out
    verdict = summary["in_fla_class"]["ours"]
    assert verdict == prec.in_fla_class(ours, fla) and sorted(summary["in_fla_class"]) == ["ours"]
    assert f"ours: {'in' if verdict else 'NOT in'} fla's precision class" in out


def test_precision_script_main_writes_the_summary_and_refuses_bad_arguments(prec, monkeypatch, tmp_path):
    calls = []

    def fake_measure(shape, use_fla, seed):
        calls.append((shape, use_fla, seed))
        return {"ours": dict.fromkeys(prec.FIELDS, 4e-3 + seed * 1e-3), "fla": dict.fromkeys(prec.FIELDS, 4e-3)}

    monkeypatch.setattr(prec, "measure", fake_measure)
    monkeypatch.setattr(prec.k3, "DEVICE", prec.k3.DEVICE)  # (main points it at the CPU off the GPU)
    assert prec.main(["--shape", "1,40,2,16", "--seeds", "2", "--out", str(tmp_path)]) == 0
    assert calls == [((1, 40, 2, 16), True, 0), ((1, 40, 2, 16), True, 1)]
    summary = json.loads((tmp_path / "kda_precision.json").read_text())
    assert summary["seeds"] == 2 and summary["mean"]["ours"]["dk"] == pytest.approx(4.5e-3)  # the seeds' mean
    assert summary["in_fla_class"] == {"ours": True}  # under 1.25x fla's
    calls.clear()
    for argv, message in ((["--shape", "1,40,2"], "four positive integers"), (["--shape", "1,x,2,16"], "B,T,H,D"),
                          (["--seeds", "0"], "--seeds")):
        with pytest.raises(SystemExit, match=message):
            prec.main(argv)
    for removed in (["--variants", "h"], ["--try", "dh16"]):
        with pytest.raises(SystemExit) as exit_info:
            prec.main(removed)
        assert exit_info.value.code == 2
    assert not calls


def test_precision_class_rule(prec):
    fla = dict.fromkeys(prec.FIELDS, 4e-3)
    assert prec.in_fla_class(dict.fromkeys(prec.FIELDS, 5e-3), fla)  # 1.25x
    assert not prec.in_fla_class({**fla, "dk": 5.1e-3}, fla)
    assert prec.in_fla_class({**fla, "dk": 9e-4}, {**fla, "dk": 1e-4})  # under the floor


def test_ncu_driver_runs_ours_and_the_peer(monkeypatch, capsys):
    """benchmarks/kda_ncu.py (the step Nsight Compute profiles on the GPU machine) end to end on the CPU: our
    forward, warm-up and profiled step, and with --peer fla's entry (a stand-in that checks K3's keyword contract)
    on the same inputs; a malformed shape is refused."""
    mod = _script("kda_ncu", bf16_fix=True)
    from kimik3.ops import kda

    ours, bounds = [], []
    orig = kda.chunk_kda
    monkeypatch.setattr(kda, "chunk_kda", lambda *a, **kw: ours.append(kw["backend"]) or orig(*a, **kw))
    assert mod.main(["--shape", "1,40,1,16", "--forward-only"]) == 0
    assert ours == ["triton", "triton"]  # warm-up and profiled step, both through our kernels
    assert "one forward at B1 T40 H1 D16" in capsys.readouterr().out

    def peer(*xs, **kw):
        bounds.append(kw["lower_bound"])
        return fake_fla(*xs, **kw)

    monkeypatch.setattr(mod, "load_fla", lambda: (peer, "stand-in"))
    ours.clear()
    assert mod.main(["--shape", "1,40,1,16", "--peer"]) == 0
    assert bounds == [-5.0, -5.0] and ours == ["torch", "torch"]  # (the stand-in answers through the torch path)
    assert "one fla's forward+backward at B1 T40 H1 D16" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="four integers"):
        mod.main(["--shape", "1,40,1"])
    with pytest.raises(SystemExit) as exit_info:
        mod.main(["--try", "btiles"])
    assert exit_info.value.code == 2


def test_ncu_source_summary_reads_the_source_page(tmp_path, capsys):
    """benchmarks/ncu_source.py reads ncu's source-page CSV (gzipped): the source lines' totals, not their SASS rows,
    the stall reasons' shares, and the lines ranked by the chosen counter."""
    mod = _script("ncu_source")
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


@pytest.mark.parametrize("self_diff,noise,passes", [(0.04, True, True), (0.04, False, False), (0.0, True, False)])
def test_train_check_judges_against_the_torch_paths_own_noise(monkeypatch, capsys, self_diff, noise, passes):
    """``kda_train_check.py --noise``: the torch path trains twice per seed and the Triton path's validation-loss
    distance (0.06 here, over the 0.05 tolerance) passes when within twice the torch path's distance from itself, and
    fails when the torch path reproduces itself exactly; without --noise the tolerance alone decides. The training
    runs are stand-ins (the real ones need the GPU machine)."""
    mod = _script("kda_train_check")
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


def _kernel_body(x):
    pass


def test_train_check_counts_kernel_launches_by_name_and_refuses_bad_arguments(monkeypatch):
    """``counting_kernel_launches`` counts every compiled launch (``JITFunction.run``) by kernel name, Gluon kernels
    marked, and restores ``run`` after its block; ``--seeds 0`` and the removed ``--try`` exit before any training."""
    from triton.runtime.jit import JITFunction

    mod = _script("kda_train_check")
    launched = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: launched.append(grid))
    stand_in = JITFunction.run
    kernel = JITFunction(_kernel_body)
    with mod.counting_kernel_launches({}) as counts:
        kernel[(1,)](0)
        kernel[(2,)](0)
        try:
            from triton.experimental.gluon._runtime import GluonJITFunction
        except ImportError:  # a Triton without Gluon
            GluonJITFunction = None
        if GluonJITFunction is not None:
            GluonJITFunction(_kernel_body)[(1,)](0)
    expected = {"_kernel_body": 2, **({"_kernel_body (Gluon)": 1} if GluonJITFunction is not None else {})}
    assert counts == expected and launched[:2] == [(1,), (2,)]
    assert JITFunction.run is stand_in

    monkeypatch.setattr(mod, "train", lambda *a, **k: pytest.fail("trained"))
    for argv in (["--seeds", "0"], ["--try", "triton_forward.GLUON_MIN_ITEMS=0"]):
        monkeypatch.setattr(sys, "argv", ["kda_train_check.py", "--device", "cpu", *argv])
        with pytest.raises(SystemExit) as exit_info:
            mod.main()
        assert exit_info.value.code not in (0, None)
