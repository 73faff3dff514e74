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


def test_probe_passes_a_small_case_and_reports_each_switch():
    p = run("K=24,V=16,T=20,wy=1,scan_bv=16", "K=40,V=24,T=70,fwd=split,intra=fused",
            "K=24,V=16,T=70,intra=tiles16,wy=0", "K=16,V=16,H=2,lens=1/3/0/66")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "4 of 4 cases pass" in p.stdout
    assert p.stdout.count("PASS") == 4 and "dbeta" in p.stdout


def test_probe_rejects_a_bad_case_before_running():
    p = run("K=24,V=16", "K=24,colour=red")
    assert p.returncode != 0 and "bad case item 'colour=red'" in p.stderr
    assert "PASS" not in p.stdout  # nothing ran
    p = run("K=24,V=16", "K=24,lens=3/x")
    assert p.returncode != 0 and "lens takes segment lengths" in p.stderr
