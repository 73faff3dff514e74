"""``save_pretrained`` / ``from_pretrained`` in both layouts (kimik3/model/pretrained.py): a tiny model written in
the released (HF) layout, sharded, loads back with identical logits; the kimik3 layout sharded likewise; the
index and config are what HF tools expect; damaged or mismatched directories raise errors that name the file."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kimik3 import K3Config, K3ForCausalLM
from kimik3.model.pretrained import INDEX_FILE, read_config, shard_plan
from tests.numerics import away_from_init


@pytest.fixture(scope="module")
def tiny():
    return away_from_init(K3ForCausalLM(K3Config.preset("tiny"), seed=0).eval())   # every carried tensor matters


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("layout,shard", [("hf", 2_000_000), ("hf", None), ("kimik3", 1_500_000)])
def test_round_trip_gives_identical_logits(tiny, tmp_path, layout, shard):
    tiny.save_pretrained(tmp_path, layout=layout, max_shard_bytes=shard)
    config, found = read_config(tmp_path)
    assert found == layout and config == tiny.config
    loaded = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, tiny.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(loaded, ids), _logits(tiny, ids), rtol=0, atol=0)
    if layout == "hf" or shard:
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
        assert all((tmp_path / f).is_file() for f in files)
        assert files[-1].endswith(f"-of-{len(files):05d}.safetensors")
        if shard:
            assert len(files) > 1
    if layout == "hf":
        hf = json.loads((tmp_path / "config.json").read_text())
        assert hf["model_type"] and hf["hidden_size"] == tiny.config.dim and "torch_dtype" in hf
        assert any(k.startswith("language_model.model.layers.0.") for k in
                   json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"])


def test_shard_plan_keeps_order_and_limits():
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5])}
    assert shard_plan(tensors, 80) == [["t0", "t1"], ["t2"], ["t3", "t4"]]   # 4 bytes a float: 40, 40, 120, 20, 20
    assert shard_plan(tensors, 10**6) == [list(tensors)]


def test_bad_directories_name_the_file(tiny, tmp_path):
    with pytest.raises(ValueError, match="layout must be one of"):
        tiny.save_pretrained(tmp_path, layout="safetensors")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        tiny.save_pretrained(tmp_path, layout="hf", max_shard_bytes=0)
    tiny.save_pretrained(tmp_path, layout="hf", max_shard_bytes=2_000_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    name, file = next(iter(index["weight_map"].items()))
    index["weight_map"][name + ".extra"] = file
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=file):
        K3ForCausalLM.from_pretrained(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a safetensors index"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_convert_writes_the_other_layout_and_back(tiny, tmp_path, capsys):
    from kimik3.cli import main

    src, hf, back = tmp_path / "run", tmp_path / "hf", tmp_path / "back"
    copy.deepcopy(tiny).to(torch.bfloat16).save_pretrained(src)
    (src / "tokenizer.json").write_text("{}")
    assert main(["convert", str(src), str(hf), "--layout", "hf", "--max-shard-mb", "1"]) == 0
    assert "hf layout, bfloat16" in capsys.readouterr().out
    assert (hf / "tokenizer.json").read_text() == "{}" and read_config(hf)[1] == "hf"
    assert len(set(json.loads((hf / INDEX_FILE).read_text())["weight_map"].values())) > 1
    assert main(["convert", str(hf), str(back), "--layout", "kimik3"]) == 0
    a = K3ForCausalLM.from_pretrained(src, dtype=torch.float32)
    b = K3ForCausalLM.from_pretrained(back, dtype=torch.float32)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert main(["convert", str(hf), str(back)]) == 2                  # not empty: refused
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["hf", "kimik3"])
def test_loading_reads_each_tensor_once_and_never_the_whole_file(tiny, tmp_path, monkeypatch, layout):
    # The loader streams: names and shapes come from the headers, each tensor is read alone when its parameter is
    # filled (host memory: one tensor, not the checkpoint). A whole-file read would fail here.
    import safetensors.torch

    from kimik3.model.pretrained import WeightFiles

    tiny.save_pretrained(tmp_path, layout=layout, max_shard_bytes=2_000_000)
    reads = []
    real_read = WeightFiles.read
    monkeypatch.setattr(WeightFiles, "read", lambda self, name: reads.append(name) or real_read(self, name))
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("read a whole file"))
    loaded = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert len(reads) == len(set(reads))
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in loaded.named_parameters() if n.endswith(("A_log", "dt_bias")))
    assert all(r.expert_bias.dtype == torch.float32 for r in loaded.routers())
    for name, p in loaded.state_dict().items():
        torch.testing.assert_close(p, tiny.state_dict()[name].to(p.dtype), rtol=0, atol=0)
