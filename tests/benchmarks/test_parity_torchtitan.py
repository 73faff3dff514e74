"""CPU check of benchmarks/parity_torchtitan.py against torchtitan's Kimi K3 port at the script's smallest config
(``small``, 32 tokens, fp32, the port's experts in fp32, torch KDA on both sides). The port's tree is optional
(``benchmarks/setup_torchtitan.sh`` makes ``third_party/torchtitan``; its imports come from ``.whl/``): without
either the tests are skipped, saying which. Each runs in a subprocess: importing the port stubs a torchtitan
module in ``sys.modules`` and the script sets ``KIMIK3_KDA_BACKEND``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "parity_torchtitan.py"
PORT_MODEL = ROOT / "third_party" / "torchtitan" / "torchtitan" / "models" / "kimi_k3" / "model.py"
PORT_IMPORTS = ("fla", "einops", "spmd_types", "tyro", "docstring_parser", "typeguard")
KL_BOUND = 1e-6   # fp32 on both sides with the same expert choices: only rounding remains (~1e-8 here)


def _skip_reason() -> str | None:
    if not PORT_MODEL.is_file():
        return (f"torchtitan's Kimi K3 port is not at {PORT_MODEL.parents[3]} "
                "(optional: bash benchmarks/setup_torchtitan.sh)")
    missing = [name for name in PORT_IMPORTS if importlib.util.find_spec(name) is None]
    if missing:
        return (f"the port's imports {missing} are not installed "
                "(pip install --no-index --no-deps .whl/*.whl after benchmarks/setup_torchtitan.sh)")
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_both_directions_agree_in_fp32_with_fp32_experts(tmp_path):
    out = tmp_path / "parity.json"
    proc = _run([str(SCRIPT), "--config", "small", "--seqs", "1", "--seq-len", "32", "--device", "cpu",
                 "--dtypes", "float32", "--fp32-experts", "--direction", "both", "--json", str(out)])
    report = json.loads(out.read_text())
    assert list(report["directions"]) == ["port-to-ours", "ours-to-port"]
    assert report["skipped"] == []
    # the port's init left these at constants; the script moved every one of them
    perturbed = report["directions"]["port-to-ours"]["perturbed"]
    assert any(k.endswith("norm.weight") for k in perturbed) and any(k.endswith("dt_bias") for k in perturbed)
    assert any(k.endswith("expert_bias_E") for k in perturbed)
    for direction, entry in report["directions"].items():
        by_variant = {r["variant"]: r for r in entry["results"]}
        assert set(by_variant) == {"port", "fp32-experts"}, direction
        r = by_variant["fp32-experts"]
        assert r["direction"] == direction and r["dtype"] == "float32" and r["positions"] == 32
        assert r["kl_mean"] < KL_BOUND, (direction, r)
        assert r["top1"] == 1.0 and r["routing_choices_differ_frac"] == 0.0, (direction, r)
    assert "port-to-ours" in proc.stdout and "ours-to-port" in proc.stdout   # the table names the direction
    assert any(t["phase"].startswith("build the port") for t in report["timings"])


NEGATIVE = r"""
import sys, torch
sys.path.insert(0, "benchmarks")
import parity_torchtitan as pt, torchtitan_port as tp
from kimik3 import K3Config, K3ForCausalLM
import os; os.environ["KIMIK3_KDA_BACKEND"] = "torch"
tp.import_port(compile_mode="eager")
config = K3Config.from_dict(dict(pt.SMALL))
ours = K3ForCausalLM(config, device="cpu", seed=0).eval()
port = tp.build_port("cpu", torch.float32, 0, our_config=config).eval()
pt.perturb_port(port, 0)
tp.use_reference_kda(port)
tp.use_fp32_experts(port)
tp.load_port_into_ours(ours, port)
probe = pt.RoutingProbe(ours, port)
tokens = [torch.randint(0, config.vocab_size, (32,), generator=torch.Generator().manual_seed(2))]
good = pt.run_variant(ours, port, probe, tokens, False, "port")["kl_mean"]
with torch.no_grad():   # a head-order slip in dt_bias [H, K], as a wrong adapter rule would make
    for layer in ours.layers:
        if hasattr(layer.mixer, "dt_bias"):
            layer.mixer.dt_bias.copy_(layer.mixer.dt_bias.roll(1, 0))
bad = pt.run_variant(ours, port, probe, tokens, False, "port")["kl_mean"]
print(good, bad)
"""


def test_the_bound_fails_for_a_misplaced_tensor():
    """The KL bound of the test above is not vacuous: the same comparison with one tensor's heads in the wrong
    order (every KDA layer's dt_bias rolled by one head) lands far above it."""
    good, bad = map(float, _run(["-c", NEGATIVE]).stdout.split()[-2:])
    assert good < KL_BOUND < bad, (good, bad)
