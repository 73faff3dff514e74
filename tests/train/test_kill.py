"""End to end: ``kimik3 train`` killed with SIGKILL at a random moment, then ``--resume``d.

The resumed run must lose at most one checkpoint interval (plus one step) of work, and end exactly
where an uninterrupted run with the same arguments ends (resume is bitwise exact on CPU).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

from kimik3.train.plot import read_metrics
from tests.train.small_run import losses

STEPS = 36
INTERVAL_S = 1.0


def _train(args: list[str], log_path) -> subprocess.Popen:
    # One thread per run: every run reduces in the same order (bitwise-equal losses), and the
    # reference run shares the two cores with the run that gets killed.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "kimik3", "train", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def _wait_for_steps(metrics, count: int, process: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_metrics(metrics)) >= count:
            return
        assert process.poll() is None, "the run ended before it started stepping"
        time.sleep(0.02)
    raise AssertionError(f"no {count} steps in {metrics} after {timeout_s} s")


def _final_loss(log_text: str) -> str:
    return re.search(r"final train loss (\S+)", log_text).group(1)


def test_a_killed_run_resumes_within_one_interval_and_ends_as_an_uninterrupted_one(small_config_path,
                                                                                    code_corpus, tmp_path):
    rng = random.Random(36)
    common = ["--config", str(small_config_path), "--data", str(code_corpus), "--steps", str(STEPS),
              "--seq-len", "32", "--batch-size", "2", "--checkpoint-every", f"{INTERVAL_S:g}s", "--no-progress"]
    victim_dir, reference_dir = tmp_path / "victim", tmp_path / "reference"
    reference = _train([*common, "--out", str(reference_dir)], tmp_path / "reference.log")
    victim = _train([*common, "--out", str(victim_dir)], tmp_path / "victim.log")
    try:
        # The kill lands at a random step well before the end, whatever the machine's speed, and at
        # a random moment inside that step.
        _wait_for_steps(victim_dir / "metrics.jsonl", rng.randint(10, 20), victim)
        time.sleep(rng.uniform(0.0, 0.1))
        assert victim.poll() is None, "the run ended before the kill"
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
    before = read_metrics(victim_dir / "metrics.jsonl")

    resumed = _train(["--resume", str(victim_dir), "--no-progress"], tmp_path / "resumed.log")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()
    resumed_log = (tmp_path / "resumed.log").read_text()
    restart = re.search(r"resumed \S+ at step (\d+)", resumed_log)
    first = int(restart.group(1)) if restart else 0
    assert restart or "restarting it from step 0" in resumed_log, resumed_log

    # (a) At most the steps of one checkpoint interval (as the run chose it) + one step are lost.
    stretched = re.search(r"checkpointing every (\S+) s instead", (tmp_path / "victim.log").read_text())
    interval = float(stretched.group(1)) if stretched else INTERVAL_S
    elapsed = [r["elapsed_s"] for r in before]
    step_time = max(b - a for a, b in zip([0.0, *elapsed], elapsed))   # evaluations and writes included
    last = before[-1]
    within = [r for r in before if r["elapsed_s"] >= last["elapsed_s"] - (interval + step_time)]
    assert last["step"] < STEPS - 10, "killed too late to compare the final losses"
    assert first >= last["step"] - len(within), (first, last["step"], len(within))
    assert not [p for p in (victim_dir / "checkpoints").iterdir() if p.name.startswith(".")]

    # (b) The resumed run ends exactly where the uninterrupted one does.
    assert losses(victim_dir) == losses(reference_dir)
    assert _final_loss(resumed_log) == _final_loss((tmp_path / "reference.log").read_text())
