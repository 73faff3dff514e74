"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus), with an optional generator."""

from __future__ import annotations

import math

import torch

# Temperatures below this sample greedily: dividing logits by a tiny temperature overflows to inf
# (softmax then yields NaN) long before it differs from the argmax. vLLM uses the same cut.
GREEDY_BELOW = 1e-5


def sample_next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token id per row of ``logits_BV`` [B, vocab]; returns int64 [B].

    ``temperature < GREEDY_BELOW`` (0 included) is greedy (argmax); otherwise logits are divided by the temperature,
    restricted to the ``top_k`` largest (0 = all) and to the smallest set whose probability
    reaches ``top_p``, and sampled with ``generator``.
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if temperature < GREEDY_BELOW:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
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
