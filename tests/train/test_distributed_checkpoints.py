"""Time-based checkpoints under data parallelism: a save is a collective (every rank gathers), so the
ranks must agree on when one is due although their clocks differ; rank 0's clock decides."""

from __future__ import annotations

import torch

from tests.parallel.gloo import run_ranks
from tests.train.small_run import small_args


def _worker(rank, world, config, corpus, out):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    Trainer.sample = lambda self, prompt, max_new_tokens=80: ""
    trainer = Trainer(small_args(config, corpus, out, steps=10, checkpoint_every="0.2s"), log=lambda _: None,
                      parallel=ParallelDims(dp=world))
    if rank == 1:
        trainer.clock.now = lambda: 0.0   # a clock that never sees time pass: alone, it would never save
    saves = []
    real_save = trainer.save
    trainer.save = lambda: (saves.append(trainer.step), real_save())
    trainer.run()
    return {"saves": torch.tensor(saves)}


def test_ranks_checkpoint_together_on_rank_0s_clock(small_config_path, code_corpus, tmp_path):
    out = tmp_path / "dp2"
    outs = run_ranks(_worker, 2, tmp_path, str(small_config_path), str(code_corpus), str(out))
    assert torch.equal(outs[0]["saves"], outs[1]["saves"])
    assert len(outs[0]["saves"]) >= 2 and int(outs[0]["saves"][-1]) == 10   # one mid-run at least, and the last
    assert (out / "checkpoint").resolve().name == "step-0000010"
