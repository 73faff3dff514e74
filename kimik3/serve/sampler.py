"""The serving engine's batched sampler: one token per running sequence, for the whole batch at once, on the device.

``kimik3.model.sampling.sample_next_token`` samples one set of options at a time, and the engine used to call it
once per sequence and read each token back (``int(...)``): one argmax or multinomial and one host synchronisation
per row per step. Here the engine describes the batch once (``SamplingBatch.build``: each row's temperature, top_k,
top_p, min_p and generator, packed into device tensors, plus host-side flags saying which cuts any row needs) and
``sample`` picks every row's token with a fixed sequence of device ops that never waits for the device. The one
host synchronisation of a step is the engine's own, when it copies the [B] tokens (and the log-probabilities, from
``token_logprobs``) back to the host to stream them.

Semantics are ``sample_next_token``'s, row by row: a row whose temperature is below ``GREEDY_BELOW`` takes the
argmax of its logits; any other row divides its logits by its temperature, keeps the tokens whose probability is at
least ``min_p`` times the likeliest's, then those whose logit is at least the ``top_k``-th largest (ties with the
k-th stay), then the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (a token goes when the
mass before it already reaches top_p; the first always stays). The draw is the exponential race (Gumbel-max):
``argmax(probs / E)`` with ``E ~ Exp(1)`` per vocabulary entry, which picks token i with probability ``probs[i]``
and needs no multinomial. A row whose request has a generator (a seeded request) draws its noise from that generator
alone, one ``V``-long draw per step, so its tokens do not depend on the other rows of its batch; the other rows
share one draw from torch's default generator. A greedy row draws nothing (its generator is not advanced), as with
``sample_next_token``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kimik3.model.sampling import GREEDY_BELOW
from kimik3.ops.sampling import row_argmax
from kimik3.serve.types import SamplingParams

__all__ = ["SamplingBatch", "draw", "probabilities", "sample", "token_logprobs"]


@dataclass(slots=True)
class SamplingBatch:
    """The sampling options of a batch's B rows, on the device, and host flags that decide which ops ``sample`` runs.

    A greedy row (temperature < ``GREEDY_BELOW``) holds neutral values (temperature 1, top_k 0, top_p 1, min_p 0)
    and is picked out by ``greedy_B``. Off values: top_k 0, top_p 1, min_p 0. The flags only look at sampled rows.
    """

    temperature_B: torch.Tensor          # fp32 [B]
    top_k_B: torch.Tensor                # int64 [B]; 0: off (and k >= vocab is off too)
    top_p_B: torch.Tensor                # fp32 [B]; 1: off
    min_p_B: torch.Tensor                # fp32 [B]; 0: off
    greedy_B: torch.Tensor               # bool [B]
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int                       # the largest top_k of a sampled row (0: none)
    max_logprobs: int | None             # the largest SamplingParams.logprobs of the batch; None: no row asks
    seeded_rows: list[tuple[int, torch.Generator]]   # the sampled rows with a generator, and that generator
    any_unseeded: bool                   # some sampled row draws from the default generator

    def __len__(self) -> int:
        return len(self.generators)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              device: torch.device | str) -> SamplingBatch:
        """Describe a batch: ``params[b]`` and ``generators[b]`` (None: the default generator) are row b's. A
        generator must live on ``device``. One host-to-device copy, asynchronous where the device is CUDA."""
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} rows of params but {len(generators)} generators")
        device = torch.device(device)
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        sampled = [(b, p) for b, p in enumerate(params) if not greedy[b]]
        temps = [1.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        top_k = [0 if g else int(p.top_k) for g, p in zip(greedy, params)]
        top_p = [1.0 if g else float(p.top_p) for g, p in zip(greedy, params)]
        min_p = [0.0 if g else float(p.min_p) for g, p in zip(greedy, params)]
        # One packed host tensor (pinned for CUDA, so that the copy need not wait), one copy. fp64 keeps each value
        # exact (top_k included) until it is cast on the device.
        host = torch.tensor([temps, top_k, top_p, min_p, [float(g) for g in greedy]], dtype=torch.float64,
                            pin_memory=device.type == "cuda" and torch.cuda.is_available())
        packed = host.to(device, non_blocking=True)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        seeded = [(b, generators[b]) for b, _ in sampled if generators[b] is not None]
        return cls(
            temperature_B=packed[0].float(), top_k_B=packed[1].long(), top_p_B=packed[2].float(),
            min_p_B=packed[3].float(), greedy_B=packed[4] > 0.5, generators=list(generators),
            all_greedy=not sampled, any_greedy=len(sampled) < len(params),
            any_top_k=any(p.top_k > 0 for _, p in sampled), any_top_p=any(p.top_p < 1.0 for _, p in sampled),
            any_min_p=any(p.min_p > 0.0 for _, p in sampled), max_top_k=max((p.top_k for _, p in sampled), default=0),
            max_logprobs=max(wanted) if wanted else None, seeded_rows=seeded,
            any_unseeded=len(seeded) < len(sampled))


def held_end_tokens(seq: Any, eos_token_id: int | None) -> list[int]:
    """The token ids ``seq`` may not draw next: the end-of-sequence and stop tokens while it has generated fewer
    than its request's ``min_tokens`` (empty otherwise)."""
    params = seq.request.params
    if seq.generated >= params.min_tokens:
        return []
    ends = [] if eos_token_id is None or params.ignore_eos else [eos_token_id]
    return ends + [t for t in params.stop_token_ids if t not in ends]


def sample(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token id per row of ``logits_BV`` [B, V] (after penalties), int64 [B] on the logits' device.

    Only ``batch``'s host flags choose which ops run; nothing here waits for the device.
    """
    if batch.all_greedy:
        return row_argmax(logits_BV)
    return draw(probabilities(logits_BV, batch), logits_BV, batch)


def probabilities(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each sampled row draws from: softmax of its logits over its temperature after its min_p,
    top_k and top_p cuts (fp32 [B, V]). Greedy rows get a distribution too, which ``draw`` ignores. Speculative
    decoding verifies drafts against these (``kimik3.serve.spec_verify``)."""
    return torch.softmax(_cut(logits_BV.float() / batch.temperature_B[:, None], batch), dim=-1)


def draw(probs_BV: torch.Tensor, logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row from ``probs_BV`` (``probabilities``; overwritten), the argmax of ``logits_BV`` for the
    greedy rows: int64 [B]."""
    tokens = row_argmax(probs_BV.div_(_exponential_noise(probs_BV, batch)))
    if batch.any_greedy:
        tokens = torch.where(batch.greedy_B, row_argmax(logits_BV), tokens)
    return tokens


def _cut(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits`` [B, V] (fp32, temperature applied) with the tokens that each row's min_p, top_k and top_p leave
    out set to -inf, in that order, as ``sample_next_token`` does. Rows whose cut is off pass unchanged."""
    ninf = -math.inf
    vocab = logits.shape[-1]
    if batch.any_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); min_p 0 gives a cut at -inf (none).
        cut = logits.amax(dim=-1, keepdim=True) + batch.min_p_B[:, None].log()
        logits = logits.masked_fill(logits < cut, ninf)
    top_k = batch.any_top_k and batch.max_top_k > 0
    if not (top_k or batch.any_top_p):
        return logits
    if batch.any_top_p:
        # One sort serves both cuts: the top-k cut only sends a tail of the sorted row to -inf, so the row stays
        # sorted for the top-p cut. Stable, so that ties keep the vocabulary's order.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        if top_k:
            sorted_logits = sorted_logits.masked_fill(sorted_logits < _kth(sorted_logits, batch, vocab), ninf)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays). Rows at top_p 1 drop
        # nothing, not even where rounding takes the running sum to 1.
        drop = ((probs.cumsum(dim=-1) - probs) >= batch.top_p_B[:, None]) & (batch.top_p_B < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, ninf)
        return torch.full_like(logits, ninf).scatter_(-1, order, sorted_logits)
    # Top-k alone: the max_top_k largest are enough to find each row's k-th.
    largest = torch.topk(logits, min(batch.max_top_k, vocab), dim=-1).values
    return logits.masked_fill(logits < _kth(largest, batch, vocab), ninf)


def _kth(largest: torch.Tensor, batch: SamplingBatch, vocab: int) -> torch.Tensor:
    """Each row's k-th largest logit [B, 1], from ``largest`` [B, n] (its n largest, descending); -inf where the
    row's top_k is off (0, or at least the vocabulary), so that a ``logits < kth`` cut keeps everything."""
    k = batch.top_k_B[:, None]
    off = (k <= 0) | (k >= vocab)
    kth = largest.gather(-1, (k.clamp(1, largest.shape[-1]) - 1))
    return kth.masked_fill(off, -math.inf)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Exp(1) noise [B, V] for the exponential race: a seeded row's from its own generator (one V-long draw, so the
    same whatever its neighbours), the other sampled rows' from one draw of the default generator; greedy rows get
    noise too (from the default draw, or ones), which ``sample`` ignores. Floored at the smallest normal float so
    that a zero draw cannot make 0 / 0."""
    vocab = probs.shape[-1]
    noise = torch.empty_like(probs).exponential_() if batch.any_unseeded else torch.ones_like(probs)
    for b, generator in batch.seeded_rows:
        noise[b] = torch.empty(vocab, dtype=probs.dtype, device=probs.device).exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(probs.dtype).tiny)


def logprob_logits(raw_BV: torch.Tensor, penalized_BV: torch.Tensor, params: Sequence[Any]) -> torch.Tensor:
    """The logits whose log-softmax each row's log-probabilities report: ``raw_BV`` (the model's) for
    ``logprobs_mode="raw"``, ``penalized_BV / temperature`` (the distribution sampled from) for "processed"."""
    processed = [p.logprobs is not None and p.logprobs_mode == "processed" for p in params]
    if not any(processed):
        return raw_BV
    device = raw_BV.device
    rows = torch.tensor(processed, device=device)[:, None]
    temperature = torch.tensor([p.temperature if on else 1.0 for p, on in zip(params, processed)],
                               dtype=torch.float32, device=device)[:, None]
    return torch.where(rows, penalized_BV.float() / temperature, raw_BV.float())


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's log-probabilities, from ``log_softmax`` of ``logits_BV`` [B, V] in fp32 (pass the logits before
    penalties and temperature: that is what vLLM and the OpenAI API report).

    Returns the log-probability of each row's chosen token ``tokens_B`` [B] (fp32 [B]), and the ``top_n`` likeliest
    tokens' ids (int64 [B, top_n], best first) and log-probabilities (fp32 [B, top_n]); top_n is capped at V and may
    be 0 (empty [B, 0] tensors). No host synchronisation.
    """
    logprobs = torch.log_softmax(logits_BV.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens_B.long()[:, None]).squeeze(-1)
    top_values, top_ids = torch.topk(logprobs, min(max(top_n, 0), logprobs.shape[-1]), dim=-1)
    return chosen, top_ids, top_values
