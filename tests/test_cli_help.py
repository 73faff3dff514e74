"""`kimik3 --version` and the help of every option: what a new user reads first."""

import argparse

import pytest

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
