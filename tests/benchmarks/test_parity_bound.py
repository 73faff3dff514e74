"""benchmarks/parity_torchtitan.py's bound rows (ours in fp32 against ours in bf16, the same rounded weights):
needs no torchtitan, so it runs everywhere. In-process for ``run_bound``, a subprocess for ``--bound-only`` (the
script sets ``KIMIK3_KDA_BACKEND``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import parity_torchtitan as pt  # noqa: E402
from kimik3 import K3Config, K3ForCausalLM  # noqa: E402


def test_run_bound_compares_fp32_with_bf16_and_restores_the_model():
    config = K3Config.from_dict(dict(pt.SMALL))
    ours = K3ForCausalLM(config, device="cpu", seed=0).eval()
    pt.perturb(ours, 0)
    ours.cast(torch.bfloat16)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, config.vocab_size, (24,), generator=gen) for _ in range(2)]
    r = pt.run_bound(ours, pt.RoutingProbe(ours), sequences)
    assert r["positions"] == 48 and r["kl"] == "KL(ours fp32 || ours bfloat16)"
    # bf16 rounding moves the logits (a comparison of bf16 with itself would give 0), but not far at this size
    assert 0 < r["kl_mean"] < 1e-3 and r["max_abs_logit_diff"] > 0
    assert 0 <= r["routing_choices_differ_frac"] <= 1 and r["pass"] is None
    # the model is back in bf16 with the same weights
    assert ours.dtype == torch.bfloat16
    after = ours.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_bound_only_runs_without_the_port(tmp_path):
    out = tmp_path / "bound.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parity_torchtitan.py"), "--bound-only",
                           "--config", "small", "--seqs", "1", "--seq-len", "32", "--device", "cpu",
                           "--dtypes", "float32,bfloat16", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [(r["dtype"], r["variant"]) for r in report["results"]] == [("bfloat16", "bound: ours fp32")]
    assert report["results"][0]["kl_mean"] > 0 and report["kda_backend"] == "torch"
    assert "torchtitan" not in proc.stdout.lower() and "bound: ours fp32" in proc.stdout
