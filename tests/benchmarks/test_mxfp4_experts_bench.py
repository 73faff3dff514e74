"""Smoke test of benchmarks/mxfp4_experts.py (MXFP4 expert matmuls against bf16, run on an H200): the whole script on
the CPU at small shapes, the kernels under the Triton interpreter and one call per timing, checking the JSON it
writes: the registers and dequantize routes checked and timed at every size, the gemv route at decode sizes, and the
route ``mxfp4_route`` takes recorded as the row's, and the read floor (the weights read alone) per shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.kernel_testing import interpreter_setup, needs_kernels  # noqa: F401 (its kernels bounds-checked)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "mxfp4_experts.py"


@needs_kernels
def test_mxfp4_experts_bench_checks_and_times_the_routes(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mxfp4_experts_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import harness

    calls = []

    def once(fn, warmup=0, rep=0):
        calls.append(fn)
        fn()
        return 0.5

    monkeypatch.setattr(harness, "bench", once)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", {"gate_up": (64, 32), "down": (32, 64)})
    from kimik3.ops.moe.mxfp4_grouped_mm import DEQUANTIZE_ROWS, mxfp4_blocks

    assert bench.main(["--experts", "2", "--tokens", f"1,{DEQUANTIZE_ROWS}", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mxfp4_experts.json").read_text())
    assert data["fail"] == [] and len(data["pass"]) == 2 * (3 + 2)   # shapes x (gemv too at 1 row an expert)
    rows = {(r["shape"], r["tokens_per_expert"]): r for r in data["table"]}
    assert set(rows) == {(s, t) for s in ("gate_up", "down") for t in (1, DEQUANTIZE_ROWS)}
    for (shape, tokens), r in rows.items():
        assert r["route"] == ("dequantize" if tokens == DEQUANTIZE_ROWS else "gemv")
        assert r["registers_ms"] == r["dequantize_ms"] == r["bf16_ms"] == r["mxfp4_ms"] == 0.5
        assert r["gemv_ms"] == (0.5 if tokens == 1 else None)
        registers_m = mxfp4_blocks(2 * tokens, 2, r["O"], r["I"])[0]
        assert r["blocks"][0] == (1 if tokens == 1 else registers_m)      # the gemv route's one row, or BLOCK_M
        assert r["weight_bytes_bf16"] / r["weight_bytes_mxfp4"] == 16 / 4.25
    assert len(calls) == 2 * (1 + 2 + 4 + 3)   # per shape: the decode, the two reads, 3 routes + bf16, 2 routes + bf16
    assert set(data["read_floor"]) == {"gate_up", "down"}
    assert all(v == {"codes_ms": 0.5, "bf16_ms": 0.5} for v in data["read_floor"].values())


@needs_kernels
@pytest.mark.parametrize("routing", ["uniform", "random"])
def test_mxfp4_experts_bench_times_the_layer(tmp_path, monkeypatch, routing):
    """``--layer``: the packed expert FFN (fused producers) against bf16 and against its unfused form, whose values
    it must equal, at each tokens an expert up to 64; with ``--routing random`` the rows spread over the experts."""
    spec = importlib.util.spec_from_file_location("mxfp4_experts_layer_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import harness

    monkeypatch.setattr(harness, "bench", lambda fn, warmup=0, rep=0: (fn(), 0.5)[1])
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", {"gate_up": (64, 32), "down": (32, 64)})
    assert bench.main(["--experts", "2", "--tokens", "1,3,100", "--shapes", "down", "--layer", "--routing", routing,
                       "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "mxfp4_experts.json").read_text())
    assert [r["tokens_per_expert"] for r in data["layer"]] == [1, 3]          # (100 rows an expert: not decode)
    assert {f"layer:{t}:fused_matches_unfused" for t in (1, 3)} <= set(data["pass"]) and data["fail"] == []
    for r in data["layer"]:
        low, high = r["rows_an_expert_min_max"]       # (two experts: their counts add up to the rows)
        assert r["routing"] == routing and low + high == r["rows"] and 0 <= low <= high, r
        if routing == "uniform":
            assert low == high == r["tokens_per_expert"], r
        assert r["mma_order"] is False and r["bf16_ms"] == r["mxfp4_ms"] == r["mxfp4_unfused_ms"] == 0.5
        assert 0 < r["rel_err_vs_bf16"] < 0.1       # MXFP8 inputs against bf16 ones
