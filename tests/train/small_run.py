"""A model small enough for many short training runs in one test session: the tiny preset cut to
3 layers of width 32 (still KDA + MLA + MoE + AttnRes + MTP), about 0.1 s a step on one core."""

from __future__ import annotations

import json
from pathlib import Path

from kimik3.config.schema import K3Config
from kimik3.train.trainer import TrainArgs


def small_config() -> K3Config:
    spec = K3Config.preset("tiny").to_dict()
    # A vocabulary of its own: test_data checks that a 512-token tokenizer is not cached yet.
    spec.update(name="small", vocab_size=640, dim=32, num_layers=3, dense_hidden=64)
    spec["kda"].update(num_heads=2)
    spec["mla"].update(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                       v_head_dim=8)
    spec["moe"].update(num_experts=4, top_k=2, latent_dim=16, expert_hidden=32, num_shared_experts=1,
                       shared_hidden=16)
    spec["attn_res"].update(block_size=2)
    config = K3Config.from_dict(spec)
    config.validate()
    return config


def write_small_config(directory: Path) -> Path:
    path = Path(directory) / "small.json"
    path.write_text(small_config().to_json())
    return path


def write_small_vision_run_inputs(directory: Path) -> tuple[Path, Path]:
    """(corpus, config) for a ``--vision`` run of the small model with the tiny tower: a 30-file code corpus in
    ``directory/corpus`` and ``directory/small-vl.json``."""
    from tests.corpus import write_code_corpus
    from tests.model.test_vision import TINY_VISION

    (directory / "corpus").mkdir()
    corpus = write_code_corpus(directory / "corpus", 30)
    spec = small_config().to_dict()
    spec["vision"] = TINY_VISION
    config = directory / "small-vl.json"
    config.write_text(K3Config.from_dict(spec).to_json())
    return corpus, config


def small_args(config: Path, corpus: Path, out: Path, **changes) -> TrainArgs:
    base = {"config_path": str(config), "data": str(corpus), "steps": 6, "out": str(out), "seq_len": 32,
            "batch_size": 2, "eval_every": 3, "eval_windows": 2, "checkpoint_every": 2, "progress": False,
            "lr": 3e-3}
    base.update(changes)
    return TrainArgs(**base)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def zero(path: Path) -> None:
    """Overwrite a file with zeros of the same size (what a failing disk can leave)."""
    path = Path(path).resolve()
    path.write_bytes(b"\0" * path.stat().st_size)


def resume(out: Path, log: list[str] | None = None, **overrides):
    """A Trainer resuming ``out`` with ``overrides`` as the command line's; its log lines into ``log``."""
    from kimik3.train.trainer import TrainArgs, Trainer

    return Trainer(TrainArgs(progress=False, **overrides), resume=out,
                   log=log.append if log is not None else (lambda _: None))
