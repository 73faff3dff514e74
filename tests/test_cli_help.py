"""`kimik3 --version` and the help of every option: what a new user reads first."""

import argparse

import pytest
import torch

from kimik3.cli import build_parser, main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("kimik3 ")


def test_every_option_has_help_and_shows_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"kimik3 {name} {action.option_strings or action.dest}: no help text"
            if action.option_strings and action.default not in (None, False):
                assert "default" in (sub._get_formatter()._get_help_string(action) or ""), (name, action.dest)
        assert text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
@pytest.mark.parametrize("command", [["train", "--steps", "1"], ["generate", "--prompt", "x"], ["serve"]])
def test_cuda_without_a_gpu_is_one_clear_error(command, tmp_path, capsys):
    """--device cuda where torch sees no GPU: exit 2 and one line naming the problem, before anything is loaded (a
    run directory that does not exist is not even looked at)."""
    args = [*command, "--device", "cuda"] + (["--run", str(tmp_path / "none")] if command[0] != "train" else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--device cuda was asked for but torch sees no CUDA GPU" in err and "Traceback" not in err
