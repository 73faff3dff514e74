"""``--checkpoint-every``: a step count or a wall-time duration (by default every 60 s), stretched to
10x the last write's duration so that a slow write never costs more than ~10% of the run."""

from __future__ import annotations

import time

import pytest

from kimik3.train.checkpoint_clock import CheckpointClock, CheckpointEvery, parse_checkpoint_every
from kimik3.train.trainer import TrainArgs, Trainer
from tests.train.small_run import resume, small_args


def test_checkpoint_every_takes_a_step_count_or_a_duration():
    assert parse_checkpoint_every("100") == CheckpointEvery(steps=100)
    assert parse_checkpoint_every(100) == CheckpointEvery(steps=100)  # how older checkpoints saved it
    assert parse_checkpoint_every("30s") == CheckpointEvery(seconds=30.0)
    assert parse_checkpoint_every("2m") == CheckpointEvery(seconds=120.0)
    assert parse_checkpoint_every("1.5h") == CheckpointEvery(seconds=5400.0)
    assert parse_checkpoint_every(None) == CheckpointEvery(seconds=60.0)  # the default: every minute
    for bad in ("0", 0, "-3", "0s", "soon", "5 parsecs", "", 2.5, True):
        with pytest.raises(ValueError, match="--checkpoint-every"):
            parse_checkpoint_every(bad)
    with pytest.raises(ValueError, match="--checkpoint-every"):
        TrainArgs(checkpoint_every="often").validate()


def test_a_slow_write_stretches_the_interval_to_ten_writes_and_says_so_once():
    now = [0.0]
    said = []
    clock = CheckpointClock(CheckpointEvery(seconds=60.0), said.append, now=lambda: now[0])
    now[0] = 59.0
    assert not clock.due(1)
    now[0] = 60.0
    assert clock.due(2)
    clock.written(2.0)                  # 10 x 2 s < 60 s: the interval stays 60 s
    assert clock.interval == 60.0 and not said
    clock.written(9.0)                  # 10 x 9 s = 90 s
    assert clock.interval == 90.0 and len(said) == 1 and "90 s" in said[0] and "10%" in said[0]
    now[0] += 89.0
    assert not clock.due(3)
    now[0] += 1.0
    assert clock.due(4)
    clock.written(12.0)
    assert clock.interval == 120.0 and len(said) == 1   # said once
    by_steps = CheckpointClock(CheckpointEvery(steps=3), said.append, now=lambda: now[0])
    assert [by_steps.due(s) for s in range(1, 7)] == [False, False, True, False, False, True]


def test_the_default_is_every_minute_and_a_run_checkpoints_by_time(small_config_path, code_corpus, tmp_path):
    args = small_args(small_config_path, code_corpus, tmp_path / "default", steps=1)
    args.checkpoint_every = None
    assert Trainer(args, log=lambda _: None).args.checkpoint_every == "60s"   # saved explicitly with the run
    out = tmp_path / "timed"
    seen = []

    def on_step(record):
        seen.append((out / "checkpoint").exists())
        time.sleep(0.25)   # each step after the first outlasts the interval, however fast the machine

    trainer = Trainer(small_args(small_config_path, code_corpus, out, steps=3, checkpoint_every="0.2s"),
                      log=lambda _: None)
    trainer.run(on_step=on_step)
    # Step 1 ended more than 0.25 s after step 0 did: a checkpoint was due, before the end of the run.
    assert seen[1], "no checkpoint before the end of a run checkpointed every 0.2 s"


def test_resume_keeps_the_runs_setting_unless_one_is_given(run_copy):
    assert resume(run_copy).args.checkpoint_every == 2   # saved as an int of steps
    assert resume(run_copy, checkpoint_every="5s").args.checkpoint_every == "5s"
