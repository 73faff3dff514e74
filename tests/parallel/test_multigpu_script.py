"""benchmarks/multigpu.py end to end on two gloo ranks at toy sizes (the issue-7 script's CPU smoke).

Each test launches ``torchrun --nproc_per_node 2 benchmarks/multigpu.py <sub> ... --device cpu`` as a
subprocess and checks its exit status, its markdown table and the JSON it writes to $OUT. The training
subcommands train the 3-layer test model of tests/train/small_run.py on a small generated corpus: the
scripts' mechanics at a fraction of the tiny preset's cost on the stdlib.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "multigpu.py"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The model and data options of a training launch: the small test model on a generated corpus,
    its tokenizer cached for the module (every launch inherits KIMIK3_CACHE)."""
    from tests.corpus import write_code_corpus
    from tests.train.small_run import write_small_config

    root = tmp_path_factory.mktemp("small")
    (root / "corpus").mkdir()
    write_code_corpus(root / "corpus", 40)
    saved = os.environ.get("KIMIK3_CACHE")
    os.environ["KIMIK3_CACHE"] = str(root / "cache")
    yield ["--config", str(write_small_config(root)), "--data", str(root / "corpus"), "--vocab", "0"]
    if saved is None:
        os.environ.pop("KIMIK3_CACHE", None)
    else:
        os.environ["KIMIK3_CACHE"] = saved


def launch(tmp_path: Path, *argv: str, timeout: float = 300) -> tuple[str, dict]:
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           *argv, "--device", "cpu"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    name = argv[0] + ("-wide" if "--wide-moe" in argv else "")
    path = tmp_path / f"multigpu-{name}.json"
    assert path.is_file(), proc.stdout[-2000:]
    data = json.loads(path.read_text())
    assert data["world"] == 2 and data["backend"] == "gloo" and data["subcommand"] == argv[0]
    for flag in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        assert data["env"][flag] in ("0", "1")
    return proc.stdout, data


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_ep_train_moonep_vs_none_matches_one_process(small, tmp_path):
    steps = 3
    out, data = launch(tmp_path, "ep", *small, "--steps", str(steps), "--seq-len", "64", "--rows-per-rank", "2",
                       "--warmup", "1")
    assert "| balance |" in out and "| moonep |" in out and "| none |" in out
    runs = data["runs"]
    assert set(runs) == {"moonep", "none"}
    for mode, run in runs.items():
        assert run["steps_run"] == steps and len(run["losses"]) == steps
        assert finite_positive(run["tokens_per_s"]) and finite_positive(run["step_time_s_median"])
        assert run["tokens_per_step"] == 2 * 2 * 64
        assert len(run["step_times_s"]) == steps and all(len(t) == 2 for t in run["step_times_s"])
        assert run["step_time_spread_median"] >= 1.0
        assert len(run["peak_memory_bytes"]) == 2 and all(m > 0 for m in run["peak_memory_bytes"])
        assert len(run["expert_fwd_times_s"]) == steps
        assert data["loss_match"][mode]["steps_compared"] == steps
        assert data["loss_match"][mode]["max_abs_diff"] < 2e-3      # fp32: reduction order only
    assert runs["moonep"]["rank_tokens_max_over_mean_mean"] == 1.0    # MoonEP: every rank computes the mean
    assert runs["moonep"]["rank_tokens_max_over_mean_worst"] == 1.0
    assert runs["none"]["rank_tokens_max_over_mean_worst"] > 1.0      # plain EP is imbalanced
    assert data["reference"]["steps_run"] == steps
    assert data["loss_match"]["moonep_vs_none"]["max_abs_diff"] < 2e-3
    assert finite_positive(data["speedup_moonep_over_none"])


def test_ep_wide_moe_layer(tmp_path):
    out, data = launch(tmp_path, "ep", "--wide-moe", "--dim", "64", "--experts", "32", "--hidden", "48", "--latent",
                       "32", "--top-k", "4", "--tokens-per-rank", "256", "--iters", "2", "--warmup", "1",
                       "--skew", "0.3")
    assert "fwd+bwd ms" in out
    assert data["mode"] == "wide-moe" and data["shapes"]["experts"] == 32
    moonep, none = data["runs"]["moonep"], data["runs"]["none"]
    for run in (moonep, none):
        assert finite_positive(run["fwd_bwd_s_median"]) and finite_positive(run["tokens_per_s"])
        assert len(run["times_s"]) == 2 and all(len(t) == 2 for t in run["times_s"])
    assert moonep["rank_tokens_max_over_mean_mean"] == 1.0
    assert none["rank_tokens_max_over_mean_mean"] > 1.0
    assert none["foreign_experts_max_per_rank"] == 0 and moonep["foreign_experts_max_per_rank"] <= 16
    assert data["output_agreement"]["max_rel_err_between_modes"] < 1e-5
    assert finite_positive(data["speedup_moonep_over_none"])


def test_kcp_against_a_single_rank_timed_on_a_prefix(tmp_path):
    # 1,001 tokens over 2 ranks: segments of 501 and 500, neither a multiple of the 64-token chunk. T1 is timed on
    # 501 tokens and scaled to 1,001; the errors come from one more 2-rank run at 501 tokens (251 and 250).
    out, data = launch(tmp_path, "kcp", "--tokens", "1001", "--heads", "2", "--head-dim", "16", "--iters", "2",
                       "--single-tokens", "501")
    assert "| ranks P |" in out and "(from 501 tokens)" in out
    single = data["single"]
    assert single["status"] == "ok" and single["extrapolated_from_tokens"] == 501
    assert single["fwd_bwd_s"] == pytest.approx(single["measured_fwd_bwd_s"] * 1001 / 501)
    (run,) = data["runs"]
    assert run["ranks"] == 2 and run["tokens_per_rank"] == [501, 500]
    assert run["max_output_err"] is None and finite_positive(run["speedup"])
    assert run["efficiency"] == pytest.approx(run["speedup"] / 2)
    check = data["error_check"]
    assert check["tokens"] == 501 and check["tokens_per_rank"] == [251, 250]
    assert check["max_output_err"] < 1e-5 and check["max_grad_err"] < 1e-5


def test_fsdp_tokens_per_s_and_mfu(small, tmp_path):
    out, data = launch(tmp_path, "fsdp", *small, "--steps", "6", "--seq-len", "64", "--rows-per-rank", "2",
                       "--warmup", "1", "--peak-tflops", "1")
    assert "| ranks |" in out and "MFU" in out
    run = data["run"]
    assert run["steps_run"] == 6 and finite_positive(run["tokens_per_s"])
    flops = data["flops_per_token"]
    assert flops["total"] == pytest.approx(flops["matmul_6N"] + flops["mla_attention"] + flops["kda"])
    expected = run["tokens_per_s"] * flops["total"] / (2 * 1e12)
    assert data["mfu"] == pytest.approx(expected) and 0 < data["mfu"] < 1
    # It trains: each step's loss is on another batch, so compare halves, not the first and last step.
    losses = run["losses"]
    assert sum(losses[3:]) < sum(losses[:3]), losses


def test_model_flops_formula_by_hand():
    spec = importlib.util.spec_from_file_location("multigpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from kimik3.config import K3Config
    from kimik3.config.params import param_counts

    config = K3Config.preset("debug")
    flops = module.model_flops_per_token(config, 1024)
    counts = param_counts(config)
    idle = counts["routed_per_layer"] * (1 - 4 / 32)
    mtp_active = counts["mtp"] - idle + 1024 * 163_840           # MTP block + the head it re-uses
    assert flops["matmul_6N"] == pytest.approx(6 * (counts["active"] + mtp_active))
    # 6 MLA layers (3, 7, ..., 23) + the MTP block's: 16 heads x (96 + 64) x 1025 x 3
    assert flops["mla_attention"] == pytest.approx(7 * 3 * 16 * 160 * 1025)
    # 18 KDA layers: 16 heads x (6 x 64 x 64 + 64 x 128) x 3
    assert flops["kda"] == pytest.approx(18 * 3 * 16 * (6 * 64 * 64 + 64 * 128))


def test_step_phases_breaks_an_ep_step_down(small, tmp_path):
    """benchmarks/step_phases.py: the phases of an EP step and the collectives it makes, on 2 gloo ranks."""
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "step_phases.py"), "--parallel", "ep", "--device", "cpu", *small,
           "--seq-len", "64", "--rows-per-rank", "2", "--steps", "3", "--warmup", "1"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    data = json.loads((tmp_path / "multigpu-step-phases-ep.json").read_text())
    assert len(data["step_s"]) == 2 and all(finite_positive(t) for t in data["step_s"])
    for phase in ("forward", "backward", "clip grad norm", "optimizer muon", "optimizer adamw"):
        assert len(data["phases_s"][phase]) == 2 and all(finite_positive(t) for t in data["phases_s"][phase]), phase
    counts = data["counts_per_step"]
    assert counts["collective all_to_all_single (autograd)"] > 0  # the EP exchange of rows and weights
    # no other all-to-all in the EP layer (counts and expert ids follow from the plan); Muon's two (the
    # crossing matrices' rows to the ranks orthogonalising them, and the results' rows back) are the only ones
    assert counts["collective all_to_all_single"] == 2
    for phase in ("forward MoE router", "forward MoE dispatch", "forward MoE experts", "forward MoE combine",
                  "forward KDA (attention)", "communication (torch.distributed calls)"):
        assert all(finite_positive(t) for t in data["phases_s"][f"  in {phase}"]), phase
    assert counts["collective all_reduce"] <= 8  # clipping: one per group, not one per parameter
    assert "| optimizer muon |" in proc.stdout
