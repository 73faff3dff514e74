"""The penalties and min-p of model/sampling.py against their definitions (vLLM's and the OpenAI API's)."""

import math

import pytest
import torch

from kimik3.model.sampling import SamplingOptionError, apply_penalties, check_penalties, sample_next_token


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, output = torch.tensor([0, 1]), torch.tensor([3, 3, 4])
    got = apply_penalties(logits, prompt, output, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # repetition: seen tokens 0, 1, 3, 4 (prompt or output): positive / 2, negative * 2; token 2 untouched
    rep = torch.tensor([1.0, -2.0, 0.5, 1.5, -4.0])
    # frequency 0.25 per output occurrence (3: twice, 4: once), presence 0.5 once per output token
    want = rep - 0.25 * torch.tensor([0, 0, 0, 2, 1.0]) - 0.5 * torch.tensor([0, 0, 0, 1, 1.0])
    assert torch.allclose(got, want)
    assert torch.equal(apply_penalties(logits, prompt, output), logits)  # all off: unchanged


def test_min_p_keeps_the_tokens_within_its_ratio_of_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    drawn = sample_next_token(logits, temperature=1.0, min_p=0.2, generator=g)   # cut at 0.1: token 3 never
    assert set(drawn.tolist()) == {0, 1, 2}
    assert set(sample_next_token(logits, temperature=1.0, min_p=0.0, generator=g).tolist()) == {0, 1, 2, 3}
    assert math.isclose((drawn == 0).float().mean().item(), 0.5 / 0.95, abs_tol=0.05)


@pytest.mark.parametrize("kw,option", [(dict(presence_penalty=2.5), "presence_penalty"),
                                       (dict(frequency_penalty=-2.1), "frequency_penalty"),
                                       (dict(repetition_penalty=0.0), "repetition_penalty"),
                                       (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                                       (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p")])
def test_penalties_out_of_range_are_named(kw, option):
    with pytest.raises(SamplingOptionError) as err:
        check_penalties(**kw)
    assert err.value.option == option
