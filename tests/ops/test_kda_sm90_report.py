"""benchmarks/kda_sm90_report.py compiles the Triton KDA kernels of a training step and of a decode step for sm_90a
without a GPU (subprocess: the kernels must not be imported under TRITON_INTERPRET=1, which other test modules
set)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_sm90_report.py")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def report(tmp_path, *args):
    """The script in a process of its own, without the interpreter and with an empty Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, SCRIPT, "--heads", "4", "--head-dim", "32", "--tokens", "64", "--dtype",
                           "bfloat16", *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton wheel ships no ptxas")
def test_the_kernels_named_compile_for_sm90_and_are_tabled(tmp_path):
    """--kernels: the two kernels it names (the training forward's first, the decode kernel) compiled, their rows
    in the table and the JSON, with occupancy and waves; a pattern that is no pattern exits before any work."""
    out = tmp_path / "report.json"
    p = report(tmp_path, "--kernels", "^(_gate_cols|_decode)_kernel$", "--decode-batch", "2", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["kernels"]
    assert {r["kernel"] for r in rows} == {"_gate_cols_kernel", "_decode_kernel"}, rows
    assert rows[-1]["kernel"] == "_decode_kernel" and rows[-1]["grid"][0] >= 1
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["spill_store_bytes"] == 0, r
        assert r["ctas_per_sm"] >= 1 and r["waves"] == math.prod(r["grid"]) / (r["ctas_per_sm"] * 132), r
    table = [line for line in p.stdout.splitlines() if line.startswith("| _")]
    assert len(table) == len(rows) and table[-1].startswith("| _decode_kernel | (")
    p = report(tmp_path, "--kernels", "(")
    assert p.returncode != 0 and "not a regular expression" in p.stderr


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton wheel ships no ptxas")
def test_every_kernel_compiles_for_sm90(tmp_path):
    """Every Triton kernel of a training step and of a decode step compiles for sm_90 and fits an H200 SM (about a
    minute on 2 cores: -m slow)."""
    out = tmp_path / "report.json"
    p = report(tmp_path, "--decode-batch", "2", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(out.read_text())
    assert result["args"]["tokens"] == 64 and result["args"]["decode_batch"] == 2
    rows = result["kernels"]
    names = [r["kernel"] for r in rows]
    # the training forward's kernels, the backward's, then the decode kernel
    for kernel in ("_gate_cols_kernel", "_intra_a_kernel", "_fwd_h_kernel", "_bwd_dh_kernel", "_bwd_wy_kernel",
                   "_decode_kernel"):
        assert kernel in names, names
    assert names[-1] == "_decode_kernel" and len(set(names)) >= 10, names
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["spill_store_bytes"] is not None, r
        assert 0 <= r["shared_bytes"] <= 232448, r  # (the row L2 norm needs none)
        assert r["ctas_per_sm"] >= 1 and r["waves"] > 0, r
    table = [line for line in p.stdout.splitlines() if line.startswith("| _")]
    assert len(table) == len(rows) and table[-1].startswith("| _decode_kernel | (")


def test_occupancy_arithmetic():
    """CTAs per sm_90 SM from registers, shared memory and warp slots, and the waves of a grid."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kda_sm90_report_under_test", SCRIPT)
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    assert rep.ctas_per_sm(180, 4, 84 * 1024) == 2  # registers: 11 warps of 180 x 32 fit 65536
    assert rep.ctas_per_sm(168, 4, 40 * 1024) == 3  # 12 warps
    assert rep.ctas_per_sm(168, 4, 84 * 1024) == 2  # now shared memory: 228 KB / (84 + 1) KB
    assert rep.ctas_per_sm(255, 8, 84 * 1024) == 1  # 255 -> 256 registers: 8 warps
    assert rep.ctas_per_sm(32, 1, 0) == 32  # the CTA slots
    assert rep.ctas_per_sm(32, 4, 0) == 16  # the warp slots
    assert rep.waves((4, 96), 2) == 384 / 264 and rep.waves((2, 96), 2) < 1


def test_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unset TRITON_INTERPRET" in p.stderr
