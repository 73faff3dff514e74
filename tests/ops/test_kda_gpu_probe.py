"""CPU smoke test of benchmarks/kda_gpu_probe.py (the per-process GPU probe), under the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_gpu_probe.py")


def run(*cases):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("OUT", None)
    return subprocess.run([sys.executable, SCRIPT, *cases], env=env, capture_output=True, text=True, timeout=300)


def test_probe_runs_a_case_in_a_process_of_its_own():
    """Varlen segments (one empty, one over a chunk) over two heads: the forward and every gradient against the torch
    chunk path, in a child process."""
    p = run("K=16,V=16,H=2,lens=1/3/0/66")
    assert p.returncode == 0, p.stdout + p.stderr
    (line,) = [x for x in p.stdout.splitlines() if x.startswith("[")]
    assert line.startswith("[1/1] PASS  K=16,V=16,H=2,lens=1/3/0/66"), line
    for name in ("o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"):
        assert f" {name} " in line, (name, line)
    assert "1 of 1 cases pass" in p.stdout


def test_probe_reports_a_crashed_case_and_goes_on(monkeypatch, capsys):
    """A child that dies (here a stand-in for the child process) is a CRASH naming its last line and the last kimik3
    frame of its traceback, and the cases after it still run; the exit status says a case did not pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kda_gpu_probe_under_test", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    crash = ('Traceback (most recent call last):\n  File "/r/kimik3/ops/kda/intra.py", line 7, in launch\n'
             '    kernel[grid](x)\n  File "/site/triton/runtime/jit.py", line 9, in run\n'
             'RuntimeError: CUDA error: an illegal memory access was encountered\n')
    passed = 'RESULT {"case": "K=32", "status": "PASS", "rel_rms": {"o": 1e-7}}\n'
    children = []

    def fake_run(argv, env, capture_output, text):
        children.append((argv[-1], env["CUDA_LAUNCH_BLOCKING"]))
        failed = argv[-1] == "K=24"
        return subprocess.CompletedProcess(argv, 1 if failed else 0, "" if failed else passed, crash if failed else "")

    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    monkeypatch.delenv("OUT", raising=False)
    assert probe.main(["K=24", "K=32"]) == 1
    assert children == [("K=24", "1"), ("K=32", "1")]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2] CRASH K=24") and "RuntimeError: CUDA error: an illegal memory access" in out[0]
    assert "surfaced at ['File \"/r/kimik3/ops/kda/intra.py\", line 7, in launch']" in out[0], out[0]
    assert out[1].startswith("[2/2] PASS  K=32") and out[-1] == "1 of 2 cases pass"


def test_probe_rejects_a_bad_case_before_running():
    for cases, message in ((["K=24,V=16", "K=24,colour=red"], "bad case item 'colour=red'"),
                           (["K=24,V=16", "K=24,lens=3/x"], "lens takes segment lengths"),
                           (["K=24,dtype=float16"], "dtype takes float32 or bfloat16"),
                           (["K=24,V=16,fwd=split"], "bad case item 'fwd=split'")):  # (a kernel switch: none left)
        p = run(*cases)
        assert p.returncode != 0 and message in p.stderr, p.stderr
        assert "PASS" not in p.stdout  # nothing ran
