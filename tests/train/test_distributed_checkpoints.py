"""Time-based checkpoints under data parallelism: a save is a collective (every rank gathers), so the
ranks must agree on when one is due although their clocks differ; rank 0's clock decides."""

from __future__ import annotations

import time

import torch

from tests.parallel.gloo import run_ranks
from tests.train.small_run import small_args


def _worker(rank, world, config, corpus, out):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    Trainer.sample = lambda self, prompt, max_new_tokens=80: ""
    trainer = Trainer(small_args(config, corpus, out, steps=4, checkpoint_every="0.2s"), log=lambda _: None,
                      parallel=ParallelDims(dp=world))
    if rank == 1:
        trainer.clock.now = lambda: 0.0   # a clock that never sees time pass: alone, it would never save
    saves = []
    real_save = trainer.save
    trainer.save = lambda: (saves.append(trainer.step), real_save())
    # Rank 0 pauses after each step, so the next one ends past the interval however fast the machine
    # (rank 1 waits for it in the collectives).
    trainer.run(on_step=lambda record: time.sleep(0.25) if rank == 0 else None)
    return {"saves": torch.tensor(saves)}


def test_ranks_checkpoint_together_on_rank_0s_clock(small_config_path, code_corpus, tmp_path):
    out = tmp_path / "dp2"
    outs = run_ranks(_worker, 2, tmp_path, str(small_config_path), str(code_corpus), str(out))
    assert torch.equal(outs[0]["saves"], outs[1]["saves"])
    saves = outs[0]["saves"].tolist()
    # The first interval (0.2 s, before any write could stretch it) ends by step 2 on rank 0's clock; the last save
    # is the end of the run.
    assert saves[0] in (1, 2) and saves[-1] == 4, saves
    assert (out / "checkpoint").resolve().name == "step-0000004"
