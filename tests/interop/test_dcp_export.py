"""``kimik3 convert`` of a run trained on 2 gloo ranks (a sharded DCP checkpoint), streamed to the HF layout.

One 2-rank run (FSDP2, dp=2: nearly every weight in two chunks, one per rank's shard file) trains the small test
model for 2 steps and computes its logits on a fixed input. The exports (hf, kimik3, torchtitan) must
hold exactly the weights ``load_distributed`` puts into a single-process model, so ``from_pretrained`` of
the export gives its logits bit for bit; no output shard is larger than asked (bar one tensor larger
than that), and each of our tensors is read once; a missing shard file is named. ``--layout torchtitan``
also converts a single-file model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.parallel.gloo import run_ranks

MAX_SHARD_BYTES = 40_000   # the small model's fp32 weights are ~0.3 MB: several shards


def _input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))


def _worker(rank, world, config, corpus, out):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer
    from tests.train.small_run import small_args

    Trainer.sample = lambda self, prompt, max_new_tokens=80: ""
    Trainer.evaluate = lambda self: 0.0
    trainer = Trainer(small_args(config, corpus, out, steps=2, checkpoint_every=100), log=lambda _: None,
                      parallel=ParallelDims(dp=world))
    trainer.run()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(_input_ids(trainer.model_config.vocab_size)).logits
    return {"logits": logits}



@pytest.fixture
def trained(tmp_path, monkeypatch):
    """The 2-rank run's directory and the logits its (FSDP2) model gave."""
    from tests.corpus import write_code_corpus
    from tests.train.small_run import write_small_config

    monkeypatch.setenv("KIMIK3_CACHE", str(tmp_path / "cache"))   # the ranks inherit it
    (tmp_path / "corpus").mkdir()
    corpus = write_code_corpus(tmp_path / "corpus", 40)
    config = write_small_config(tmp_path)
    run = tmp_path / "run"
    outs = run_ranks(_worker, 2, tmp_path, str(config), str(corpus), str(run))
    return run, outs[0]["logits"]


def _reference(run: Path):
    """A single-process model with the run's checkpoint loaded by ``load_distributed`` (resharded from 2 ranks)."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.model.pretrained import read_config
    from kimik3.train.distributed_checkpoint import load_distributed

    config, _ = read_config(run)
    model = K3ForCausalLM(config, dtype=torch.float32, seed=123)
    step, _ = load_distributed((run / "checkpoint").resolve(), model, None)
    assert step == 2
    return model.eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_input_ids(model.config.vocab_size)).logits


def test_a_two_rank_checkpoint_exports_streaming_to_every_layout(trained, tmp_path, monkeypatch):
    import safetensors.torch as st
    from safetensors.torch import load_file

    from kimik3.cli import main
    from kimik3.interop import from_torchtitan
    from kimik3.interop.dcp_export import export_dcp
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.train.checkpoint import CheckpointError
    from kimik3.train.dcp_tensors import DcpTensors

    run, rank_logits = trained
    ckpt = (run / "checkpoint").resolve()
    assert (ckpt / "shard-00001-of-00002.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    index = json.loads((ckpt / "dcp_index.json").read_text())["tensors"]
    chunks = [len(entry["chunks"]) for key, entry in index.items() if key.startswith("model.")]
    assert sum(count == 2 for count in chunks) > len(chunks) // 2   # assembling tensors from both ranks' files
    reference = _reference(run)
    expected = _logits(reference)
    # The trained FSDP2 model and the resharded single-process one agree (to reduction order).
    torch.testing.assert_close(expected, rank_logits)
    # from_pretrained reads the run directly, assembling each tensor from its chunks.
    assert torch.equal(_logits(K3ForCausalLM.from_pretrained(run, dtype=torch.float32)), expected)

    # The command line, from the run directory: default shard size (one file), tokenizer copied along.
    for layout in ("hf", "kimik3"):
        dst = tmp_path / f"cli-{layout}"
        assert main(["convert", str(run), str(dst), "--layout", layout]) == 0
        assert (dst / "tokenizer.json").is_file() and (dst / "model-00001-of-00001.safetensors").is_file()
        assert torch.equal(_logits(K3ForCausalLM.from_pretrained(dst, dtype=torch.float32)), expected), layout

    # The API with small shards: memory bounded by one shard (a larger tensor alone) plus one tensor.
    reads: list[str] = []
    real_read = DcpTensors.read
    monkeypatch.setattr(DcpTensors, "read", lambda self, name: (reads.append(name), real_read(self, name))[1])
    written: list[int] = []
    real_save = st.save_file

    def save_file(tensors, path, metadata=None):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        assert written[-1] <= MAX_SHARD_BYTES or len(tensors) == 1, (len(tensors), written[-1])
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr("kimik3.interop.dcp_export.save_file", save_file)
    names = set(reference.state_dict())
    for layout in ("hf", "kimik3", "torchtitan"):
        reads.clear()
        written.clear()
        dst = tmp_path / f"api-{layout}"
        weight_map = export_dcp(ckpt, dst, layout, max_shard_bytes=MAX_SHARD_BYTES)
        assert len(written) == len(set(weight_map.values())) > 1
        # Each of our tensors read once (the placeholders' one tensor and a tied head's embedding again at most).
        assert set(reads) == names and len(reads) <= len(names) + 2, layout
        if layout == "torchtitan":
            tensors = {}
            for file in set(weight_map.values()):
                tensors.update(load_file(str(dst / file)))
            ours = from_torchtitan(tensors, reference.config)
            assert all(torch.equal(ours[k], v) for k, v in reference.state_dict().items())
        else:
            loaded = K3ForCausalLM.from_pretrained(dst, dtype=torch.float32)
            assert torch.equal(_logits(loaded), expected), layout

    # A shard file gone: the error names it.
    shard = ckpt / "shard-00001-of-00002.safetensors"
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard-00001-of-00002.safetensors: missing"):
        export_dcp(run, tmp_path / "out", "hf")


def test_convert_writes_the_torchtitan_layout_from_a_single_file_model_too(tmp_path):
    from safetensors.torch import load_file

    from kimik3.cli import main
    from kimik3.config.schema import K3Config
    from kimik3.interop import from_torchtitan
    from kimik3.interop.dcp_export import TORCHTITAN_CONFIG_FILE
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.model.pretrained import INDEX_FILE
    from tests.train.small_run import small_config

    model = K3ForCausalLM(small_config(), dtype=torch.float32, seed=5)
    model.save_pretrained(tmp_path / "src")
    dst = tmp_path / "titan"
    assert main(["convert", str(tmp_path / "src"), str(dst), "--layout", "torchtitan"]) == 0
    weight_map = json.loads((dst / INDEX_FILE).read_text())["weight_map"]
    tensors = {}
    for file in set(weight_map.values()):
        tensors.update(load_file(str(dst / file)))
    assert set(tensors) == set(weight_map)
    ours = from_torchtitan(tensors, model.config)
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())
    assert K3Config.from_json(dst / TORCHTITAN_CONFIG_FILE) == model.config
