"""CPU smoke test of benchmarks/kda_serve_decode.py (the GPU benchmark of the engine's KDA decode step): both
sections at tiny sizes under the Triton interpreter, so a broken comparison shows up in CI."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from tests.triton_bounds import require_triton_kernels

require_triton_kernels()

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kda_serve_decode.py")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture()
def sd(monkeypatch):
    spec = importlib.util.spec_from_file_location("kda_serve_decode_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def wall_ms(fn):  # one timed call: the sections' control flow, not a benchmark
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    monkeypatch.setattr(mod, "bench", wall_ms)
    return mod


def test_state_section_checks_the_kernel_against_the_torch_path(sd):
    row = sd.state_step(3, H=2, D=16, device=DEVICE)
    assert sd.RESULTS["fail"] == [] and sd.RESULTS["pass"] == ["state B3 kernel vs torch path"]
    assert row["B"] == 3 and row["torch_ms"] > 0 and row["triton_ms"] > 0 and row["TBps"] > 0


def test_layer_section_checks_the_kernel_against_the_torch_path(sd):
    from kimik3 import K3Config
    from kimik3.model.kda import KDA

    config = K3Config.preset("tiny")
    torch.manual_seed(0)
    layer = KDA(config).to(device=DEVICE, dtype=torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    row = sd.layer_step(2, layer, config, device=DEVICE)
    assert sd.RESULTS["fail"] == [] and sd.RESULTS["pass"] == ["layer B2 kernel vs torch path"]
    assert row["torch_ms"] > 0 and row["triton_ms"] > 0
    assert "KIMIK3_KDA_BACKEND" not in os.environ
