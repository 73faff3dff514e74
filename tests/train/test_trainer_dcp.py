"""The Trainer on 2 gloo ranks writes sharded (DCP) checkpoints, and resumes exactly from them on 2 ranks and on 1.

One 2-rank group (starting ranks costs more than training the small model) runs, with dp=2: an uninterrupted 4-step
run, checkpointed every 2 steps, the same with its checkpoints written asynchronously, and the same run interrupted
after step 2 then resumed on the same 2 ranks. The single-process checks then resume a copy of the interrupted run
on 1 rank, and a copy of the finished run whose newest checkpoint is damaged. (One test, not a shared fixture:
pytest-xdist would give a module's tests to both workers, which would each start the group.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.parallel.gloo import run_ranks
from tests.train.small_run import losses, small_args, zero

RTOL = 1e-4   # 1 rank against 2: the same batches, summed in another order


def _fast(trainer_cls):
    """No end-of-run sample nor evaluation: training, checkpoints and metrics are untouched."""
    trainer_cls.sample = lambda self, prompt, max_new_tokens=80: ""
    trainer_cls.evaluate = lambda self: 0.0


def _train(trainer, crash_after: int | None = None) -> torch.Tensor:
    history = []

    def on_step(record):
        history.append(record["loss"])
        if record["step"] == crash_after:
            raise KeyboardInterrupt

    try:
        trainer.run(on_step=on_step)
    except KeyboardInterrupt:
        pass
    return torch.tensor(history, dtype=torch.float64)


def _worker(rank, world, config, corpus, runs):
    import torch.distributed as dist

    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import TrainArgs, Trainer

    _fast(Trainer)
    dims = ParallelDims(dp=world)
    quiet = lambda _: None   # noqa: E731
    straight = _train(Trainer(small_args(config, corpus, f"{runs}/straight", steps=4), log=quiet, parallel=dims))
    # The same run with its checkpoints written in the background while it trains.
    in_background = _train(Trainer(small_args(config, corpus, f"{runs}/async", steps=4, checkpoint_async=True),
                                   log=quiet, parallel=dims))
    interrupted = Path(runs) / "interrupted"
    first = _train(Trainer(small_args(config, corpus, interrupted, steps=4), log=quiet, parallel=dims), crash_after=2)
    dist.barrier()
    if rank == 0:   # as it was when interrupted: for the 1-rank resume
        shutil.copytree(interrupted, Path(runs) / "for-one-rank", symlinks=True)
    dist.barrier()
    resumed = _train(Trainer(TrainArgs(progress=False), resume=interrupted, log=quiet, parallel=dims))
    return {"straight": straight, "first": first, "resumed": resumed, "async": in_background}


def test_two_rank_runs_write_sharded_checkpoints_and_resume_exactly_on_two_ranks_and_one(
        small_config_path, code_corpus, tmp_path, monkeypatch):
    from kimik3.train.trainer import Trainer

    outs = run_ranks(_worker, 2, tmp_path, str(small_config_path), str(code_corpus), str(tmp_path))
    for key in ("straight", "first", "resumed"):
        assert torch.equal(outs[0][key], outs[1][key]), f"{key}: every rank logs the same global loss"
    straight = outs[0]["straight"].tolist()
    assert len(straight) == 4 and outs[0]["first"].tolist() == straight[:3]
    # Resumed on the same 2 ranks: bit for bit the uninterrupted run.
    assert outs[0]["resumed"].tolist() == straight[2:]
    assert losses(tmp_path / "interrupted") == straight

    _check_layout(tmp_path / "straight")
    # Asynchronous checkpoints: the same training, the same checkpoints (published, pointed to, pruned).
    assert outs[0]["async"].tolist() == straight
    _check_layout(tmp_path / "async")
    for name in ("shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"):
        assert _tensors(tmp_path / "async" / "checkpoints" / "step-0000004" / name) == \
            _tensors(tmp_path / "straight" / "checkpoints" / "step-0000004" / name)
    _fast_in_this_process(monkeypatch, Trainer)
    _check_resume_on_one_rank(tmp_path / "for-one-rank", straight)
    _check_damaged_newest_is_skipped(tmp_path / "straight", tmp_path / "damaged", straight)
    _check_incomplete_is_refused(tmp_path / "straight", tmp_path / "incomplete")


def _tensors(path: Path) -> dict[str, list]:
    from safetensors.torch import load_file

    return {key: value.flatten().tolist() for key, value in load_file(str(path)).items()}


def _fast_in_this_process(monkeypatch, trainer_cls):
    monkeypatch.setattr(trainer_cls, "sample", lambda self, prompt, max_new_tokens=80: "")
    monkeypatch.setattr(trainer_cls, "evaluate", lambda self: 0.0)


def _check_layout(run: Path):
    """Each rank's shard file, the DCP index and metadata, the run's own files and a manifest; no gathered
    model.safetensors. The top-level links lead to the current checkpoint's files."""
    from kimik3.train.checkpoint import verify_checkpoint

    ckpt = run / "checkpoints" / "step-0000004"
    assert (run / "checkpoint").resolve() == ckpt.resolve()
    names = {p.name for p in ckpt.iterdir()}
    assert {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors", "dcp_index.json",
            "kimik3_dcp.json", "config.json", "tokenizer.json", "train_state.json", "train_state.safetensors",
            "manifest.json"} <= names, names
    assert "model.safetensors" not in names and not (run / "model.safetensors").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000002", "step-0000004"]
    assert verify_checkpoint(ckpt) is True
    assert json.loads((run / "train_state.json").read_text())["step"] == 4
    state = json.loads((ckpt / "train_state.json").read_text())["state"]
    assert {key for key, _ in state["dict"]} == {"args", "torch_rng", "nonfinite_total", "corpus_fingerprint", "plan"}
    meta = json.loads((run / "kimik3_dcp.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 4 and meta["optimizer"] is not None
    index = json.loads((ckpt / "dcp_index.json").read_text())["tensors"]
    assert any(key.startswith("optim.") for key in index), "the optimizer state is in the shards"


def _check_resume_on_one_rank(run: Path, straight: list[float]):
    from tests.train.small_run import resume

    log: list[str] = []
    resume(run, log).run()
    found = losses(run)
    assert found[:3] == straight[:3]   # kept from the 2-rank run
    torch.testing.assert_close(torch.tensor(found[3:]), torch.tensor(straight[3:]), rtol=RTOL, atol=0)
    assert any("resumed" in line and "step 2" in line for line in log), log
    # One process writes the single-file format again: the top level now leads to its model.safetensors.
    assert (run / "checkpoint").resolve().name == "step-0000004"
    assert (run / "model.safetensors").is_file() and not (run / "kimik3_dcp.json").exists()


def _check_damaged_newest_is_skipped(source: Path, run: Path, straight: list[float]):
    from kimik3.train.checkpoint import CheckpointError, verify_checkpoint
    from tests.train.small_run import resume

    shutil.copytree(source, run, symlinks=True)
    shard = run / "checkpoints" / "step-0000004" / "shard-00001-of-00002.safetensors"
    zero(shard)
    with pytest.raises(CheckpointError, match="shard-00001-of-00002.safetensors"):
        verify_checkpoint(run / "checkpoints" / "step-0000004")
    log: list[str] = []
    resume(run, log).run()
    assert any("warning" in line and str(shard) in line for line in log), log
    found = losses(run)
    assert found[:2] == straight[:2]
    torch.testing.assert_close(torch.tensor(found[2:]), torch.tensor(straight[2:]), rtol=RTOL, atol=0)


def _check_incomplete_is_refused(source: Path, run: Path):
    """With no intact checkpoint left, resuming refuses, naming the file that is missing."""
    from kimik3.train.checkpoint import CheckpointError
    from tests.train.small_run import resume

    shutil.copytree(source, run, symlinks=True)
    shutil.rmtree(run / "checkpoints" / "step-0000002")
    meta = run / "checkpoints" / "step-0000004" / "kimik3_dcp.json"
    meta.unlink()
    with pytest.raises(CheckpointError, match=f"no intact checkpoint left.*{meta}: missing"):
        resume(run)


def test_a_sharded_save_publishes_all_or_nothing_and_its_temporaries_are_removed(tmp_path):
    """An error while rank 0 adds its files (``finalize``) publishes nothing and leaves the previous checkpoint;
    what the interrupted save left is a temporary the next start of the run removes."""
    from kimik3.train.checkpoint import DCP_FILES, remove_temporaries
    from kimik3.train.dcp_storage import INDEX_FILE
    from kimik3.train.distributed_checkpoint import META_FILE, read_distributed_meta, save_distributed
    from kimik3.train.run_dir import RUN_TEMPORARIES

    assert DCP_FILES == (META_FILE, INDEX_FILE)
    model = torch.nn.Linear(4, 3)
    final = tmp_path / "checkpoints" / "step-0000002"
    save_distributed(final, model, None, 2, finalize=lambda tmp: (tmp / "extra.json").write_text("{}"))
    assert (final / "extra.json").is_file() and read_distributed_meta(final)["step"] == 2

    def fail(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_distributed(final, model, None, 3, finalize=fail)
    assert read_distributed_meta(final)["step"] == 2   # the previous one, untouched
    partial = tmp_path / "checkpoints" / ".step-0000002.partial"
    aside = tmp_path / "checkpoints" / ".step-0000002.old.k2x_9"   # a kill between the two renames leaves this
    aside.mkdir()
    assert partial.is_dir()
    removed = remove_temporaries(tmp_path, RUN_TEMPORARIES)
    assert set(removed) == {partial, aside} and final.is_dir()


def test_asynchronous_checkpoints_need_several_ranks(small_config_path, code_corpus, tmp_path):
    from kimik3.train.trainer import Trainer
    from tests.train.small_run import small_args

    with pytest.raises(ValueError, match="--checkpoint-async writes sharded checkpoints"):
        Trainer(small_args(small_config_path, code_corpus, tmp_path / "one", checkpoint_async=True),
                log=lambda _: None)
