import json

import pytest

from kimik3.cli import main


def test_train_then_generate_from_the_command_line(small_config_path, code_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(small_config_path), "--data", str(code_corpus), "--steps", "2",
                 "--seq-len", "16", "--batch-size", "2", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "unigram val loss" in printed and "sample (temperature" in printed and str(out) in printed
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2

    assert main(["generate", "--run", str(out), "--prompt", "def alpha", "--max-tokens", "8", "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("def alpha")
    assert main(["generate", "--run", str(out), "--prompt", "def alpha", "--max-tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out == first  # seeded sampling is reproducible

    # --resume continues to a larger --steps
    assert main(["train", "--resume", str(out), "--steps", "3", "--no-progress"]) == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_command_line_errors_are_clear(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "missing"), "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--run", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--data", str(empty), "--steps", "1"]) == 2
    assert "no readable documents" in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [
    ("--max-tokens", "0"), ("--temperature", "-0.5"), ("--temperature", "nan"), ("--top-p", "0"),
    ("--top-p", "1.5"), ("--top-k", "-1"), ("--prompt", ""), ("--device", "cuda"), ("--device", "warp-drive")])
def test_generate_checks_every_option_before_loading_anything(straight, option, value, capsys, monkeypatch):
    import torch

    from kimik3.model.k3 import K3ForCausalLM

    if option == "--device" and value == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    loaded = []
    real = K3ForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(K3ForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loaded.append(a) or real(cls, *a, **k)))
    argv = {"--run": str(straight), "--prompt": "def alpha", "--max-tokens": "4", option: value}
    assert main(["generate", *[item for pair in argv.items() for item in pair]]) == 2
    captured = capsys.readouterr()
    assert option in captured.err and captured.out == "" and not loaded


def test_train_checks_checkpoint_every_before_anything(code_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(code_corpus), "--steps", "1", "--out", str(out),
                 "--checkpoint-every", "soon"]) == 2
    assert "--checkpoint-every" in capsys.readouterr().err and not out.exists()


def test_train_with_qat_saves_quantised_experts_in_the_config(small_config_path, code_corpus, tmp_path):
    from kimik3 import K3ForCausalLM

    spec = json.loads(small_config_path.read_text())
    spec["moe"].update(latent_dim=32)   # the MX block is 32 elements along each expert matmul's input
    config_path = tmp_path / "small-mx.json"
    config_path.write_text(json.dumps(spec))
    out = tmp_path / "qat"
    assert main(["train", "--config", str(config_path), "--data", str(code_corpus), "--steps", "1", "--seq-len",
                 "16", "--batch-size", "2", "--qat", "mxfp4", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["moe"]["expert_quant"] == "mxfp4"
    model = K3ForCausalLM.from_pretrained(out)
    assert {m.experts.quant for m in model.modules() if hasattr(m, "experts")} == {"mxfp4"}
