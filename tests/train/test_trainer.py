import json
import os
from pathlib import Path

import pytest
import torch

from kimik3 import K3ForCausalLM
from kimik3.train.checkpoint import CheckpointError, CheckpointWarning, load_checkpoint, save_checkpoint
from kimik3.train.trainer import TrainArgs, Trainer, TrainingError


def _args(code_corpus, out, **changes):
    base = dict(preset="tiny", data=str(code_corpus), steps=6, out=str(out), seq_len=32, batch_size=4,
                eval_every=3, eval_windows=2, checkpoint_every=3, progress=False, lr=3e-3)
    base.update(changes)
    return TrainArgs(**base)


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_run(code_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "straight"
    summary = Trainer(_args(code_corpus, out), log=lambda _: None).run()
    return out, summary


def test_run_directory_holds_everything(tiny_run):
    out, summary = tiny_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_state.safetensors",
                 "train_state.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    for key in ("step", "loss", "lr", "tokens_per_s", "expert_load_max_over_mean"):
        assert all(key in r for r in records), key
    assert "val_loss" in records[2] and "val_loss" in records[5]
    assert summary.final_val_loss is not None and summary.sample is not None
    model = K3ForCausalLM.from_pretrained(out)
    assert model.config.name == "tiny"


def test_resume_after_interruption_reproduces_the_losses_exactly(tiny_run, code_corpus, tmp_path):
    straight, _ = tiny_run
    out = tmp_path / "interrupted"

    def crash(record):
        if record["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(_args(code_corpus, out), log=lambda _: None).run(on_step=crash)
    assert json.loads((out / "train_state.json").read_text())["step"] == 3
    Trainer(TrainArgs(progress=False), resume=out, log=lambda _: None).run()
    assert _losses(out) == _losses(straight)
    a = K3ForCausalLM.from_pretrained(out).state_dict()
    b = K3ForCausalLM.from_pretrained(straight).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_can_extend_the_run(tiny_run, code_corpus, tmp_path):
    straight, _ = tiny_run
    out = tmp_path / "copy"
    Trainer(_args(code_corpus, out, steps=3), log=lambda _: None).run()
    Trainer(TrainArgs(steps=5, progress=False), resume=out, log=lambda _: None).run()
    assert len(_losses(out)) == 5


def test_output_directory_is_not_overwritten(tiny_run, code_corpus):
    out, _ = tiny_run
    with pytest.raises(ValueError, match="not empty"):
        Trainer(_args(code_corpus, out), log=lambda _: None)


class _NaNAt(K3ForCausalLM):
    """Returns a NaN loss on the training forwards whose 0-based index is in ``bad``."""

    bad: set[int] = set()

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.training and out.loss is not None:
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls - 1 in self.bad:
                out.loss = out.loss * float("nan")
        return out


def _nan_factory(bad):
    def factory(config, device, seed):
        model = _NaNAt(config, device=device, dtype=torch.float32, seed=seed)
        model.bad = bad
        return model
    return factory


def test_a_nonfinite_loss_skips_the_step(code_corpus, tmp_path):
    trainer = Trainer(_args(code_corpus, tmp_path / "nan", steps=4), model_factory=_nan_factory({1}),
                      log=lambda _: None)
    before = {}
    summary = trainer.run(on_step=lambda r: before.setdefault(r["step"], r))
    assert [r["skipped"] for r in summary.history] == [False, True, False, False]
    assert summary.history[-1]["nonfinite_total"] == 1


def test_repeated_nonfinite_losses_stop_with_the_last_checkpoint_intact(code_corpus, tmp_path):
    out = tmp_path / "nans"
    trainer = Trainer(_args(code_corpus, out, steps=20, max_nonfinite=3), model_factory=_nan_factory(set(range(4, 99))),
                      log=lambda _: None)
    with pytest.raises(TrainingError, match="3 non-finite losses in a row"):
        trainer.run()
    model = K3ForCausalLM.from_pretrained(out)
    step, _, _ = load_checkpoint(out, model)
    assert step == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_crash_while_checkpointing_leaves_the_previous_one_loadable(tiny_run, tmp_path, monkeypatch):
    out, _ = tiny_run
    model = K3ForCausalLM.from_pretrained(out)
    import kimik3.train.checkpoint as ckpt

    real = ckpt.save_file
    calls = {"n": 0}

    def dies_on_second_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk died")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_file", dies_on_second_file)
    with pytest.raises(OSError, match="disk died"):
        save_checkpoint(out, 99, model, "{}", {"x": torch.ones(2)})
    monkeypatch.setattr(ckpt, "save_file", real)
    step, state, _ = load_checkpoint(out, K3ForCausalLM.from_pretrained(out))
    assert step == 6 and not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_corrupt_checkpoints_name_the_file(tiny_run, tmp_path):
    import shutil

    out, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)
    weights = Path(os.path.realpath(copy / "model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.warns(CheckpointWarning, match=r"step-0000006/model.safetensors: 1000 bytes"):
        step, _, _ = load_checkpoint(copy, K3ForCausalLM.from_pretrained(out))
    assert step == 3  # the checkpoint before the truncated one
    older = Path(os.path.realpath(copy / "train_state.json"))
    older.write_text("{broken")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as caught:
        load_checkpoint(copy, K3ForCausalLM.from_pretrained(out))
    assert "step-0000006/model.safetensors" in str(caught.value)
    assert "step-0000003/train_state.json" in str(caught.value)
    # A checkpoint without a manifest (written before checksums) is read unverified; its errors
    # still name the file.
    (older.parent / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="train_state.json: malformed training state"):
        load_checkpoint(copy, K3ForCausalLM.from_pretrained(out))
