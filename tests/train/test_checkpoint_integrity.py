"""Checksummed checkpoints: a damaged one (zeroed, truncated, missing a file) is detected on resume
and skipped for the newest intact one; the temporaries of a write killed half-way are removed."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from kimik3 import K3ForCausalLM
from kimik3.train.checkpoint import CHECKPOINT_FILES, OPTIONAL_FILES, CheckpointError, load_checkpoint, prune
from kimik3.train.integrity import MANIFEST_FILE
from kimik3.train.trainer import Trainer
from tests.train.small_run import losses, resume, small_args, zero

STEP3, STEP4, STEP5, STEP6 = "step-0000003", "step-0000004", "step-0000005", "step-0000006"


def _names(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_checkpoint_records_the_sha256_of_every_file(straight):
    ckpt = straight / "checkpoints" / STEP6
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    assert manifest["algorithm"] == "sha256" and set(manifest["files"]) == set(CHECKPOINT_FILES + OPTIONAL_FILES)
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_zeroed_checkpoint_falls_back_to_the_newest_intact_one(straight, run_copy):
    zero(run_copy / "checkpoints" / STEP6 / "model.safetensors")
    warnings = []
    model = K3ForCausalLM.from_pretrained(straight)
    step, _, _ = load_checkpoint(run_copy, model, warn=warnings.append)
    assert step == 4 and len(warnings) == 1
    assert STEP6 in warnings[0] and "model.safetensors" in warnings[0] and STEP4 in warnings[0]
    assert os.readlink(run_copy / "checkpoint") == f"checkpoints/{STEP4}"
    expected = load_file(str(straight / "checkpoints" / STEP4 / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


def test_resuming_past_a_damaged_checkpoint_is_exact_and_never_prunes_its_source(straight, small_config_path,
                                                                                  code_corpus, tmp_path):
    out = tmp_path / "every-step"

    def stop(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(small_args(small_config_path, code_corpus, out, checkpoint_every=1), log=lambda _: None).run(
            on_step=stop)
    assert _names(out) == [STEP3, STEP4]
    zero(out / "checkpoints" / STEP4 / "train_state.safetensors")
    log, present = [], []
    resume(out, log).run(on_step=lambda record: present.append(_names(out)))
    assert any(line.startswith("warning: ") and STEP4 in line and "train_state.safetensors" in line for line in log)
    assert all(STEP3 in names for names in present)
    assert _names(out) == [STEP3, STEP5, STEP6]   # keep=2, plus the one resumed from
    assert losses(out) == losses(straight)


def test_a_checkpoint_missing_a_file_falls_back(straight, run_copy):
    os.remove(run_copy / "checkpoints" / STEP6 / "tokenizer.json")
    with pytest.warns(UserWarning, match=f"{STEP6}/tokenizer.json: missing"):
        step, _, _ = load_checkpoint(run_copy, K3ForCausalLM.from_pretrained(straight))
    assert step == 4


def test_no_intact_checkpoint_left_names_each_bad_one(run_copy):
    zero(run_copy / "checkpoints" / STEP6 / "model.safetensors")
    with open(run_copy / "checkpoints" / STEP4 / "train_state.json", "a") as handle:
        handle.write(" ")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as caught:
        resume(run_copy)
    message = str(caught.value)
    assert f"{STEP6}/model.safetensors" in message and f"{STEP4}/train_state.json" in message


def test_checkpoints_written_without_a_manifest_still_resume(straight, run_copy):
    """Checkpoints from before checksums: no manifest, ``checkpoint_every`` saved as an int of steps."""
    for ckpt in (run_copy / "checkpoints").iterdir():
        os.remove(ckpt / MANIFEST_FILE)
    entries = dict(json.loads((run_copy / "train_state.json").read_text())["state"]["dict"])
    assert dict(entries["args"]["dict"])["checkpoint_every"] == {"value": 2}
    log = []
    resume(run_copy, log, steps=8).run()
    assert not [line for line in log if line.startswith("warning")]
    assert len(losses(run_copy)) == 8 and losses(run_copy)[:6] == losses(straight)


def test_pruning_keeps_the_newest_good_checkpoints_and_the_protected_ones(tmp_path):
    for step in range(1, 6):
        (tmp_path / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)
    prune(tmp_path, keep=2, protect={"step-0000005", "step-0000001"}, corrupt={"step-0000004"})
    assert _names(tmp_path) == ["step-0000001", "step-0000003", "step-0000005"]


def test_temporaries_of_an_interrupted_write_are_removed_on_resume(run_copy):
    """A kill during a checkpoint write leaves its temporary directory and symlink behind."""
    leftovers = [run_copy / "checkpoints" / ".step-0000007.k2x_9q0a", run_copy / ".checkpoint.4242.tmp",
                 run_copy / ".loss.png.tmp.png", run_copy / ".loss.png.k2x9q0a.tmp"]
    leftovers[0].mkdir()
    (leftovers[0] / "model.safetensors").write_bytes(b"half")
    leftovers[1].symlink_to("checkpoints/.step-0000007.k2x_9q0a")
    leftovers[2].write_bytes(b"")
    leftovers[3].write_bytes(b"half a png")
    bystanders = [run_copy / "notes.txt", run_copy / "checkpoints" / ".keep", run_copy / "checkpoints" / "step-draft",
                  run_copy / ".checkpoint.old"]
    for path in bystanders:
        path.write_text("mine")
    log = []
    resume(run_copy, log, steps=7).run()
    assert not [p for p in leftovers if os.path.lexists(p)]
    assert all(p.read_text() == "mine" for p in bystanders)
    assert any(f"removed {len(leftovers)} temporaries" in line for line in log)
