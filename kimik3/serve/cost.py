"""K3's prices and what a request or a whole session costs with and without the prefix cache.

USD per million tokens (the map's SERVING box): cached prompt tokens $0.30, uncached prompt
tokens $3.00, output tokens $15.00. The map's example: a 50-turn agent session whose prompt is a
400K-token prefix plus 4K new tokens each turn costs 50 x 404K x $3/M = $60.60 uncached, and
50 x (400K x $0.30/M + 4K x $3/M) = $6.60 when the prefix is served from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

PRICE_CACHED_INPUT = 0.30
PRICE_UNCACHED_INPUT = 3.00
PRICE_OUTPUT = 15.00


def request_cost(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """USD at K3's prices: cached prompt tokens, uncached prompt tokens, output tokens."""
    if not 0 <= cached_tokens <= prompt_tokens or completion_tokens < 0:
        raise ValueError(f"need 0 <= cached ({cached_tokens}) <= prompt ({prompt_tokens}) and "
                         f"completion ({completion_tokens}) >= 0")
    uncached = prompt_tokens - cached_tokens
    return (cached_tokens * PRICE_CACHED_INPUT + uncached * PRICE_UNCACHED_INPUT
            + completion_tokens * PRICE_OUTPUT) / 1e6


@dataclass(frozen=True, slots=True)
class SessionCost:
    turns: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    uncached_usd: float     # every prompt token recomputed
    cached_usd: float       # the prefix served from the cache each turn

    @property
    def saving(self) -> float:
        return self.uncached_usd / self.cached_usd if self.cached_usd else float("inf")


def session_cost(turns: int, prefix_tokens: int, new_tokens: int, output_tokens: int = 0,
                 growing: bool = False) -> SessionCost:
    """Cost of a session whose every turn sends ``prefix_tokens`` seen before plus ``new_tokens``.

    With ``growing`` the prefix grows by the previous turn's new and output tokens (a real chat);
    without it the prefix stays fixed (the map's example)."""
    if turns < 1 or min(prefix_tokens, new_tokens, output_tokens) < 0:
        raise ValueError("turns must be >= 1 and token counts >= 0")
    prompt = cached = uncached_usd = cached_usd = 0.0
    prefix = prefix_tokens
    for _ in range(turns):
        turn_prompt = prefix + new_tokens
        prompt += turn_prompt
        cached += prefix
        uncached_usd += request_cost(turn_prompt, 0, output_tokens)
        cached_usd += request_cost(turn_prompt, prefix, output_tokens)
        if growing:
            prefix = turn_prompt + output_tokens
    return SessionCost(turns, int(prompt), int(cached), turns * output_tokens, uncached_usd, cached_usd)
