"""Next-token sampling: greedy, temperature, min-p, top-k and top-p (nucleus), with an optional generator; and the
repetition, presence and frequency penalties on the logits before it (``apply_penalties``).

``check_sampling`` holds the rules of the sampling options; the sampler, the server's
``SamplingParams`` (``serve/types.py``) and ``kimik3 generate`` (``cli.py``) all check through it,
so the three accept and refuse the same values.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import torch

from kimik3.ops.sampling import row_argmax

# Temperatures below this sample greedily: dividing logits by a tiny temperature overflows to inf
# (softmax then yields NaN) long before it differs from the argmax. vLLM uses the same cut.
GREEDY_BELOW = 1e-5


class SamplingOptionError(ValueError):
    """A sampling option out of its range. ``option`` is its name (``temperature``, ``top_p``,
    ``top_k``), ``rule`` what it must be and ``value`` what it was, so that a caller can say it
    in its own terms (``kimik3 generate`` names the ``--top-p`` flag)."""

    def __init__(self, option: str, rule: str, value: object) -> None:
        super().__init__(f"{option} must be {rule}, got {value!r}")
        self.option, self.rule, self.value = option, rule, value


def check_sampling(temperature: float, top_p: float, top_k: int, max_temperature: float = math.inf) -> None:
    """Raise ``SamplingOptionError`` for the first sampling option out of range.

    temperature: a finite number >= 0 (and <= ``max_temperature``: the server passes the OpenAI API's 2);
    top_p: in (0, 1]; top_k: an integer >= 0, 0 meaning no cut. NaN is refused everywhere.
    """
    bounded = math.isfinite(max_temperature)
    if not (isinstance(temperature, Real) and math.isfinite(temperature) and 0 <= temperature <= max_temperature):
        rule = f"a number in [0, {max_temperature:g}]" if bounded else "a finite number >= 0"
        raise SamplingOptionError("temperature", rule, temperature)
    if not (isinstance(top_p, Real) and 0.0 < top_p <= 1.0):
        raise SamplingOptionError("top_p", "in (0, 1]", top_p)
    if not (isinstance(top_k, Integral) and top_k >= 0):
        raise SamplingOptionError("top_k", "an integer >= 0 (0: no cut)", top_k)


def check_penalties(presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                    min_p: float = 0.0) -> None:
    """Raise ``SamplingOptionError`` for the first penalty out of range: presence and frequency in [-2, 2] (the
    OpenAI API's range), repetition > 0 and finite (1: off), min_p in [0, 1] (0: off)."""
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (isinstance(value, Real) and -2.0 <= value <= 2.0):
            raise SamplingOptionError(name, "in [-2, 2]", value)
    if not (isinstance(repetition_penalty, Real) and math.isfinite(repetition_penalty) and repetition_penalty > 0):
        raise SamplingOptionError("repetition_penalty", "a finite number > 0 (1: off)", repetition_penalty)
    if not (isinstance(min_p, Real) and 0.0 <= min_p <= 1.0):
        raise SamplingOptionError("min_p", "in [0, 1] (0: off)", min_p)


def apply_penalties(logits_V: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float = 1.0) -> torch.Tensor:
    """The logits [vocab] of one sequence with the penalties applied (fp32), as vLLM and the OpenAI API define them:
    every token seen in the prompt or the output has its logit divided by ``repetition_penalty`` where positive and
    multiplied by it where negative; every token of the output loses ``frequency_penalty`` times its count and
    ``presence_penalty`` once. prompt_ids, output_ids: int64 token ids on the logits' device."""
    logits = logits_V.float()
    vocab = logits.shape[-1]
    if repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        seen[prompt_ids] = True
        seen[output_ids] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty),
                             logits)
    if presence_penalty != 0.0 or frequency_penalty != 0.0:
        # A scatter-add, not torch.bincount (whose CUDA version reads the largest id back to size its output).
        counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).index_add_(
            0, output_ids, torch.ones(output_ids.shape, dtype=logits.dtype, device=logits.device))
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample_next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      generator: torch.Generator | None = None, min_p: float = 0.0) -> torch.Tensor:
    """Pick one token id per row of ``logits_BV`` [B, vocab]; returns int64 [B].

    ``temperature < GREEDY_BELOW`` (0 included) is greedy (argmax); otherwise logits are divided by the temperature,
    restricted to the tokens whose probability is at least ``min_p`` times the likeliest's (0 = all), to the
    ``top_k`` largest (0 = all) and to the smallest set whose probability reaches ``top_p``, and sampled with
    ``generator``.
    """
    check_sampling(temperature, top_p, top_k)
    check_penalties(min_p=min_p)
    if temperature < GREEDY_BELOW:
        return row_argmax(logits_BV)
    logits = logits_BV.float() / temperature
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        cut = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < cut, float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
