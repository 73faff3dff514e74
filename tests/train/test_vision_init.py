"""``kimik3 train --vision --vision-init FILE``: the tower starts from the file's exact weights, the run records
it, a wrong file is refused clearly; and the vision-init benchmark's spike counting."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kimik3.cli import build_parser
from kimik3.model.vision.config import VisionConfig
from kimik3.model.vision.contrastive import save_tower
from kimik3.model.vision.encoder import MoonViT
from kimik3.train.args import TrainArgs, read_run_args
from kimik3.train.run_dir import resume_point
from kimik3.train.trainer import Trainer

from tests.model.test_vision import TINY_VISION
from tests.train.small_run import small_args, write_small_vision_run_inputs

ROOT = Path(__file__).resolve().parents[2]


def _random_tower(**changes) -> MoonViT:
    tower = MoonViT(VisionConfig(**{**TINY_VISION, **changes}))
    torch.manual_seed(7)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_()
    return tower


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_init")
    corpus, config = write_small_vision_run_inputs(root)
    return root, corpus, config


def _args(setup, name: str, **changes) -> TrainArgs:
    root, corpus, config = setup
    return small_args(config, corpus, root / name, steps=2, seq_len=64, batch_size=2, vision=True, eval_every=100,
                      checkpoint_every=100, **changes)


def test_the_tower_starts_from_the_file_and_the_run_records_it(setup):
    root = setup[0]
    saved = _random_tower()
    path = save_tower(root / "tower.safetensors", saved)
    plain = Trainer(_args(setup, "plain"), log=lambda _: None)
    lines: list[str] = []
    trainer = Trainer(_args(setup, "init", vision_init=str(path)), log=lines.append)
    for (name, want), got in zip(saved.state_dict().items(), trainer.model.vision_tower.state_dict().values()):
        assert torch.equal(want, got), name
    # Everything else starts as the run without the file does: the same seed, the same text model and projector.
    tower_free = {k: v for k, v in plain.model.state_dict().items() if not k.startswith("vision_tower.")}
    for name, value in tower_free.items():
        assert torch.equal(value, trainer.model.state_dict()[name]), name
    assert any("vision tower initialised from" in line for line in lines)
    trainer.run()
    assert read_run_args(trainer.run_dir)["vision_init"] == str(path)
    assert resume_point(trainer.run_dir, TrainArgs()).args.vision_init == str(path)   # what --resume continues with


def test_a_wrong_tower_file_is_refused(setup):
    root = setup[0]
    with pytest.raises(FileNotFoundError, match="--vision-init .*absent.safetensors: no such file"):
        Trainer(_args(setup, "absent", vision_init=str(root / "absent.safetensors")), log=lambda _: None)
    other = save_tower(root / "other.safetensors", _random_tower(num_layers=1))
    with pytest.raises(ValueError, match="differs from the model's.*num_layers"):
        Trainer(_args(setup, "other", vision_init=str(other)), log=lambda _: None)
    with pytest.raises(ValueError, match="--vision-init starts the vision tower of a --vision run"):
        TrainArgs(vision_init=str(other)).validate()


def test_cli_flag_reaches_the_train_args():
    ns = build_parser().parse_args(["train", "--vision", "--vision-init", "t.safetensors"])
    assert ns.vision_init == "t.safetensors"
    assert build_parser().parse_args(["train"]).vision_init is None


def _benchmark():
    spec = importlib.util.spec_from_file_location("bench_vision_init", ROOT / "benchmarks" / "vision_init.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spike_counting_on_a_synthetic_series():
    bench = _benchmark()
    norms = [1.0] * 30
    norms[5] = 10.0    # too early: fewer than window // 5 = 10 steps before it
    norms[12] = 3.5    # > 3 x the median (1.0)
    norms[20] = 2.9    # not above 3 x
    norms[25] = 3.1
    assert bench.spikes(norms, factor=3.0, window=50) == [12, 25]
    assert bench.spikes(norms, factor=3.0, window=50, min_history=1) == [5, 12, 25]
    # The median is of the window before the step: a level shift is one spike, then the new normal.
    shift = [1.0] * 20 + [5.0] * 40
    assert bench.spikes(shift, factor=3.0, window=10) == [20, 21, 22, 23, 24]
    assert bench.over(norms, 3.0) == [5, 12, 25]
    with pytest.raises(ValueError):
        bench.spikes(norms, factor=0)
    args = type("A", (), {"spike_factor": 3.0, "spike_window": 50, "spike_threshold": 3.0})()
    stats = bench.norm_stats(norms, args)
    assert stats["max"] == 10.0 and stats["median"] == 1.0 and stats["spikes_relative"] == 2
    assert stats["spikes_fixed"] == 3 and stats["argmax"] == 5
    json.dumps(stats)
