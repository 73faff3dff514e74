"""The training loop on the small test model (tests/train/small_run.py): what a run writes, non-finite
losses, checkpoint writes that fail. Interruption and resume are in test_interrupted_runs.py."""

import json
import os
from pathlib import Path

import pytest
import torch

from kimik3 import K3ForCausalLM
from kimik3.train.checkpoint import CheckpointError, CheckpointWarning, load_checkpoint, save_checkpoint
from kimik3.train.trainer import Trainer, TrainingError
from tests.train.small_run import small_args


def test_run_directory_holds_everything(straight):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_state.safetensors",
                 "train_state.json", "metrics.jsonl", "loss.png", "run.json"):
        assert (straight / name).is_file(), name
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    for key in ("step", "loss", "main_loss", "mtp_loss", "grad_norm", "lr", "tokens_per_s",
                "expert_load_max_over_mean"):
        assert all(key in r for r in records), key
    assert [i for i, r in enumerate(records) if "val_loss" in r] == [2, 5]
    printed = (straight.parent / "straight.log").read_text()
    assert f"val loss {records[-1]['val_loss']:.3f}" in printed and "sample (temperature 0.8" in printed
    assert str(straight) in printed.splitlines()[-1]
    assert K3ForCausalLM.from_pretrained(straight).config.name == "small"


def test_output_directory_is_not_overwritten(straight, small_config_path, code_corpus):
    with pytest.raises(ValueError, match="not empty"):
        Trainer(small_args(small_config_path, code_corpus, straight), log=lambda _: None)


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


def test_a_nonfinite_loss_skips_the_step(small_config_path, code_corpus, tmp_path):
    trainer = Trainer(small_args(small_config_path, code_corpus, tmp_path / "nan", steps=4),
                      model_factory=_nan_factory({1}), log=lambda _: None)
    summary = trainer.run()
    assert [r["skipped"] for r in summary.history] == [False, True, False, False]
    assert summary.history[-1]["nonfinite_total"] == 1
    assert "grad_norm" not in summary.history[1]


def test_repeated_nonfinite_losses_stop_with_the_last_checkpoint_intact(small_config_path, code_corpus, tmp_path):
    out = tmp_path / "nans"
    trainer = Trainer(small_args(small_config_path, code_corpus, out, steps=20, max_nonfinite=3, checkpoint_every=3),
                      model_factory=_nan_factory(set(range(4, 99))), log=lambda _: None)
    with pytest.raises(TrainingError, match="3 non-finite losses in a row"):
        trainer.run()
    model = K3ForCausalLM.from_pretrained(out)
    step, _, _ = load_checkpoint(out, model)
    assert step == 3 and all(torch.isfinite(p).all() for p in model.parameters())


def test_a_crash_while_checkpointing_leaves_the_previous_one_loadable(run_copy, monkeypatch):
    model = K3ForCausalLM.from_pretrained(run_copy)
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
        save_checkpoint(run_copy, 99, model, (run_copy / "tokenizer.json").read_text(), {"x": torch.ones(2)})
    monkeypatch.setattr(ckpt, "save_file", real)
    step, state, _ = load_checkpoint(run_copy, K3ForCausalLM.from_pretrained(run_copy))
    assert step == 6 and not [p for p in (run_copy / "checkpoints").iterdir() if p.name.startswith(".")]


def test_corrupt_checkpoints_name_the_file(straight, run_copy):
    weights = Path(os.path.realpath(run_copy / "model.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.warns(CheckpointWarning, match=r"step-0000006/model.safetensors: 1000 bytes"):
        step, _, _ = load_checkpoint(run_copy, K3ForCausalLM.from_pretrained(straight))
    assert step == 4  # the checkpoint before the truncated one
    older = Path(os.path.realpath(run_copy / "train_state.json"))
    older.write_text("{broken")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as caught:
        load_checkpoint(run_copy, K3ForCausalLM.from_pretrained(straight))
    assert "step-0000006/model.safetensors" in str(caught.value)
    assert "step-0000004/train_state.json" in str(caught.value)
    # A checkpoint without a manifest (written before checksums) is read unverified; its errors
    # still name the file.
    (older.parent / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="train_state.json: malformed training state"):
        load_checkpoint(run_copy, K3ForCausalLM.from_pretrained(straight))
