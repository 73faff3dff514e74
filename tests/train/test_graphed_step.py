"""The training step ``kimik3 train --device cuda`` replays as a CUDA graph (kimik3/train/graphed_step.py), run
eagerly on the CPU (``capture=False``: the same function, what the graph records): its runs match the Trainer's
eager step, a non-finite step moves neither the parameters nor the router biases, a whole run with it writes the
same kind of run directory and resumes. The capture itself is checked on a GPU (the last test)."""

from __future__ import annotations

import json

import pytest
import torch

from kimik3.train.graphed_step import GraphedTrainStep
from kimik3.train.trainer import Trainer
from tests.train.small_run import small_args
from tests.train.test_trainer import _nan_factory


def graphed(trainer: Trainer) -> Trainer:
    trainer.graphed = GraphedTrainStep(trainer, capture=False)
    return trainer


def test_the_graphed_step_matches_the_eager_step(small_config_path, code_corpus, tmp_path):
    """Six steps of the small run (Quantile Balancing on) both ways from the same seed: the
    same losses and parameters to fp32 rounding (the tensor learning rates scale Muon's update before adding
    it), and the same record keys."""
    eager = Trainer(small_args(small_config_path, code_corpus, tmp_path / "eager"), log=lambda _: None)
    graph = graphed(Trainer(small_args(small_config_path, code_corpus, tmp_path / "graph"), log=lambda _: None))
    for trainer in (eager, graph):
        trainer.started = 0.0
    for step in range(6):
        a, b = eager.train_step(step, 6), graph.train_step(step, 6)
        assert set(a) == set(b), step
        for key in ("loss", "main_loss", "mtp_loss", "grad_norm", "expert_load_max_over_mean", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
        assert not a["skipped"] and not b["skipped"]
    for (name, p), q in zip(eager.model.named_parameters(), graph.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    biases = [(r.expert_bias, s.expert_bias) for r, s in zip(eager.model.routers(), graph.model.routers())]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in biases) and any(bool(x.abs().sum() > 0) for x, _ in biases)


def test_a_nonfinite_step_moves_nothing(small_config_path, code_corpus, tmp_path):
    trainer = graphed(Trainer(small_args(small_config_path, code_corpus, tmp_path / "nan", steps=4),
                              model_factory=_nan_factory({1}), log=lambda _: None))
    trainer.started = 0.0
    first = trainer.train_step(0, 4)
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    biases = [r.expert_bias.clone() for r in trainer.model.routers()]
    bad = trainer.train_step(1, 4)
    assert not first["skipped"] and bad["skipped"] and bad["nonfinite_total"] == 1 and "grad_norm" not in bad
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, params[name]), name
    assert all(torch.equal(r.expert_bias, b) for r, b in zip(trainer.model.routers(), biases))
    assert all(float(g["lr"]) == 0.0 for g in trainer.optimizer.param_groups)   # zeroed for that step only
    after = trainer.train_step(2, 4)
    assert not after["skipped"] and all(float(g["lr"]) > 0 for g in trainer.optimizer.param_groups)
    assert any(not torch.equal(p, params[name]) for name, p in trainer.model.named_parameters())


def test_a_run_through_the_graphed_step_writes_and_resumes(small_config_path, code_corpus, tmp_path):
    """``Trainer.run`` with the graphed step end to end (its checkpoints load into the eager step's optimizer),
    interrupted after a checkpoint and resumed: bit for bit the uninterrupted run's losses."""
    def run(out, resume=None, on_step=None):
        trainer = graphed(Trainer(small_args(small_config_path, code_corpus, out), resume=resume, log=lambda _: None))
        return trainer.run(on_step=on_step)

    full = [r["loss"] for r in run(tmp_path / "straight").history]

    def stop(record):
        if record["step"] == 4:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", on_step=stop)
    assert json.loads((tmp_path / "cut" / "train_state.json").read_text())["step"] == 4
    run(tmp_path / "cut", resume=tmp_path / "cut")
    resumed = [json.loads(line)["loss"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert resumed == full
    eager = Trainer(small_args(small_config_path, code_corpus, tmp_path / "cut", steps=7), resume=tmp_path / "cut",
                    log=lambda _: None)
    assert eager.graphed is None and not eager.run().history[-1]["skipped"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kimik3_train_on_cuda_replays_a_graph_with_the_eager_losses(small_config_path, code_corpus, tmp_path):
    """On a GPU: the Trainer takes the graphed step with compiled blocks by default, captures it (three warm-up
    steps, then replays), and its losses follow the eager step's (--no-cuda-graph --no-compile), and the graphed
    step's without compiling, within bf16 autocast's run-to-run spread."""
    runs = {}
    for cuda_graph, compile in ((True, None), (True, False), (False, False)):
        trainer = Trainer(small_args(small_config_path, code_corpus, tmp_path / f"graph-{cuda_graph}-{compile}",
                                     steps=8, device="cuda", cuda_graph=cuda_graph, compile=compile, seq_len=64),
                          log=lambda _: None)
        assert (trainer.graphed is not None) == cuda_graph and trainer.compiled == (compile is None)
        runs[cuda_graph, compile] = [r["loss"] for r in trainer.run().history]
        if cuda_graph:
            assert trainer.graphed.captured is not None and trainer.graphed.captured.captured
    assert runs[True, None] == pytest.approx(runs[False, False], rel=2e-2)
    assert runs[True, False] == pytest.approx(runs[False, False], rel=2e-2)
