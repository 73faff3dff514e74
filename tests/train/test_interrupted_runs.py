"""Runs stopped at awkward moments: after a step, in the middle of a metrics line, before the first
checkpoint; and continued with ``--resume``, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from kimik3 import K3ForCausalLM
from kimik3.train.checkpoint import CheckpointError
from kimik3.train.plot import plot_run, read_metrics
from kimik3.train.trainer import Trainer
from tests.train.small_run import losses, resume, small_args


def _stop_after(step):
    def on_step(record):
        if record["step"] == step:
            raise KeyboardInterrupt
    return on_step


def test_resume_after_an_interruption_reproduces_the_run_exactly_past_a_torn_metrics_line(
        straight, small_config_path, code_corpus, tmp_path):
    out = tmp_path / "torn"
    with pytest.raises(KeyboardInterrupt):
        Trainer(small_args(small_config_path, code_corpus, out), log=lambda _: None).run(on_step=_stop_after(4))
    assert json.loads((out / "train_state.json").read_text())["step"] == 4   # the last checkpoint before the stop
    with open(out / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "seq_len": 32, "batch_size": 2, "lr": 0.0')   # half a line, no newline
    assert plot_run(out / "metrics.jsonl", tmp_path / "torn.png") is not None
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    resume(out).run()
    assert losses(out) == losses(straight)
    a = K3ForCausalLM.from_pretrained(out).state_dict()
    b = K3ForCausalLM.from_pretrained(straight).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_stopped_before_its_first_checkpoint_restarts_from_run_json(straight, small_config_path,
                                                                          code_corpus, tmp_path):
    out = tmp_path / "early"
    with pytest.raises(KeyboardInterrupt):
        Trainer(small_args(small_config_path, code_corpus, out, checkpoint_every=100), log=lambda _: None).run(
            on_step=_stop_after(2))
    assert (out / "run.json").is_file() and not (out / "checkpoint").exists()
    assert json.loads((out / "run.json").read_text())["args"]["steps"] == 6
    with pytest.raises(ValueError, match=f"not empty.*--resume {out}"):
        Trainer(small_args(small_config_path, code_corpus, out), log=lambda _: None)

    log = []
    resume(out, log).run()
    assert any("restarting it from step 0" in line and "run.json" in line for line in log)
    assert losses(out) == losses(straight)   # metrics.jsonl truncated, then the whole run again


def test_resuming_a_directory_that_holds_no_run_names_what_is_missing(small_config_path, code_corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        resume(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(CheckpointError, match=r"neither a checkpoint \(checkpoints/step-\*\) nor run.json"):
        resume(tmp_path)
    with pytest.raises(ValueError, match="not empty and holds no run"):
        Trainer(small_args(small_config_path, code_corpus, tmp_path), log=lambda _: None)


def test_resume_extends_a_finished_run_and_removes_the_temporaries_of_small_writes(straight, run_copy):
    leftovers = [run_copy / ".run.json.31337.tmp", run_copy / ".metrics.jsonl.31337.tmp"]
    for path in leftovers:
        path.write_text("{")
    resume(run_copy, steps=7).run()
    assert not [p for p in leftovers if p.exists()]
    assert len(losses(run_copy)) == 7 and losses(run_copy)[:6] == losses(straight)
