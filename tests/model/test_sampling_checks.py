"""One set of sampling rules (``model/sampling.check_sampling``) behind the three places that take
sampling options: the sampler, the server's ``SamplingParams`` and ``kimik3 generate``."""

import math

import pytest
import torch

from kimik3.cli import main
from kimik3.model.sampling import SamplingOptionError, check_sampling, sample_next_token
from kimik3.serve.types import MAX_TEMPERATURE, SamplingParams

DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 0}
BAD = [("temperature", -0.5), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
       ("temperature", -math.inf), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", math.nan),
       ("top_p", math.inf), ("top_k", -1)]
GOOD = [("temperature", 0.0), ("temperature", 1e-300), ("temperature", 1.0), ("temperature", MAX_TEMPERATURE),
        ("top_p", 1e-9), ("top_p", 1.0), ("top_k", 1), ("top_k", 50)]


def _sampler(option, value):
    options = DEFAULTS | {option: value}
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    sample_next_token(logits, options["temperature"], options["top_k"], options["top_p"],
                      generator=torch.Generator().manual_seed(0))


def _server(option, value):
    SamplingParams(**(DEFAULTS | {option: value}))


def _command_line(option, value, tmp_path, capsys):
    """``kimik3 generate`` with ``option`` set: its error line, or None when the options passed
    (it then stops on the missing run, after its checks)."""
    flag = "--" + option.replace("_", "-")
    code = main(["generate", "--run", str(tmp_path / "no-run"), "--prompt", "x", f"{flag}={value}"])
    err = capsys.readouterr().err
    assert code == 2
    return None if "does not exist" in err else err


@pytest.mark.parametrize("option, value", BAD)
def test_the_three_entry_points_refuse_the_same_values(option, value, tmp_path, capsys):
    with pytest.raises(SamplingOptionError, match=rf"^{option} must be "):
        _sampler(option, value)
    with pytest.raises(ValueError, match=rf"^{option} must be "):
        _server(option, value)
    err = _command_line(option, value, tmp_path, capsys)
    assert err is not None and err.startswith(f"kimik3 generate: error: --{option.replace('_', '-')} must be "), err


@pytest.mark.parametrize("option, value", GOOD)
def test_the_three_entry_points_accept_the_same_values(option, value, tmp_path, capsys):
    _sampler(option, value)
    _server(option, value)
    assert _command_line(option, value, tmp_path, capsys) is None


def test_the_server_alone_bounds_the_temperature_as_the_openai_api_does():
    check_sampling(MAX_TEMPERATURE * 5, 1.0, 0)
    with pytest.raises(SamplingOptionError, match=r"temperature must be a number in \[0, 2\], got 2.5"):
        SamplingParams(temperature=2.5)


def test_an_error_says_the_rule_and_the_value():
    with pytest.raises(SamplingOptionError) as caught:
        check_sampling(0.7, 1.5, 0)
    err = caught.value
    assert (err.option, err.rule, err.value) == ("top_p", "in (0, 1]", 1.5)
    assert str(err) == "top_p must be in (0, 1], got 1.5"
    with pytest.raises(SamplingOptionError, match=r"top_k must be an integer >= 0 \(0: no cut\), got 2.5"):
        check_sampling(0.7, 1.0, 2.5)
    with pytest.raises(SamplingOptionError, match="temperature must be a finite number >= 0, got 'hot'"):
        check_sampling("hot", 1.0, 0)
