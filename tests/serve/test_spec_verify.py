"""Speculative verification (``kimik3.serve.spec_verify``): greedy keeps greedy decoding's tokens; sampling keeps the
target's distribution exactly (a chi-square test over whole sequences of a Markov chain decoded with and without a
draft), and accepts at the theoretical rate sum_x min(p, q) (``kimik3.train.lk_loss``)."""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.serve.spec_verify import verify_greedy, verify_sampled
from kimik3.train.lk_loss import acceptance_rate


def test_greedy_accepts_the_agreeing_prefix_then_the_targets_token():
    logits = torch.tensor([[[0., 5, 0], [9, 0, 0], [0, 0, 1], [0, 2, 0]],
                           [[4., 0, 0], [0, 1, 0], [0, 0, 3], [1, 0, 0]]])
    draft = torch.tensor([[1, 0, 1], [0, 1, 2]])
    tokens, counts = verify_greedy(draft, logits)
    assert counts.tolist() == [3, 4]
    assert tokens[0, :3].tolist() == [1, 0, 2]         # third draft (1) rejected: the target's 2 closes
    assert tokens[1].tolist() == [0, 1, 2, 0]          # all accepted, then the bonus token


def _chain(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1)   # row: p(next | previous)


def _decode(P, Q, length, batch, K, gen) -> torch.Tensor:
    """``batch`` sequences of ``length`` tokens from the chain P starting at token 0, with K drafts a step from
    the chain Q (K = 0: plain sampling). Every row keeps every token it emits and advances by its own count."""
    if K == 0:
        out, last = [], torch.zeros(batch, dtype=torch.long)
        for _ in range(length):
            last = torch.multinomial(P[last], 1, generator=gen)[:, 0]
            out.append(last)
        return torch.stack(out, 1)
    out = torch.zeros(batch, length + K + 1, dtype=torch.long)
    pos = torch.zeros(batch, dtype=torch.long)
    last = torch.zeros(batch, dtype=torch.long)
    rows = torch.arange(batch)
    while bool((pos < length).any()):
        drafts, qs, ps, prev = [], [], [], last
        for _ in range(K):
            q = Q[prev]
            x = torch.multinomial(q, 1, generator=gen)[:, 0]
            drafts.append(x), qs.append(q), ps.append(P[prev])
            prev = x
        ps.append(P[prev])
        tokens, counts = verify_sampled(torch.stack(drafts, 1), torch.stack(qs, 1), torch.stack(ps, 1), gen)
        for j in range(K + 1):   # row b writes its first counts[b] tokens at pos[b], pos[b] + 1, ...
            write = (j < counts) & (pos + j < out.shape[1])
            out[rows[write], (pos + j)[write]] = tokens[write, j]
        last = tokens[rows, counts - 1]
        pos = pos + counts
    return out[:, :length]


@pytest.mark.parametrize("K", [1, 3])
def test_sampled_sequences_have_the_targets_distribution(K):
    V, length, batch = 3, 3, 60_000
    P, Q = _chain(V, 1), _chain(V, 2)
    gen = torch.Generator().manual_seed(K)
    codes = lambda seqs: (seqs * torch.tensor([V * V, V, 1])).sum(1)   # noqa: E731
    plain = torch.bincount(codes(_decode(P, Q, length, batch, 0, gen)), minlength=V ** length).double()
    spec = torch.bincount(codes(_decode(P, Q, length, batch, K, gen)), minlength=V ** length).double()
    # Two-sample chi-square over the 27 sequences (26 degrees of freedom): the 0.1% critical value is 54.05.
    pooled = (plain + spec) / 2
    keep = pooled > 0
    chi2 = float((((plain - pooled) ** 2 + (spec - pooled) ** 2) / pooled)[keep].sum())
    assert chi2 < 54.05, chi2
    # And the draft really differs from the target: without the residual rule the test would see it.
    naive = torch.bincount(codes(_decode(Q, Q, length, batch, 0, gen)), minlength=V ** length).double()
    pooled = (plain + naive) / 2
    assert float((((plain - pooled) ** 2 + (naive - pooled) ** 2) / pooled)[pooled > 0].sum()) > 500


def test_acceptance_happens_at_the_theoretical_rate():
    V, B = 7, 200_000
    gen = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(V, generator=gen), torch.randn(V, generator=gen)
    p, q = torch.softmax(p_logits, 0), torch.softmax(q_logits, 0)
    drafts = torch.multinomial(q.expand(B, V), 1, replacement=True, generator=gen)
    _, counts = verify_sampled(drafts, q.expand(B, 1, V), p.expand(B, 2, V), gen)
    empirical = float((counts == 2).double().mean())
    theory = float(acceptance_rate(q_logits, p_logits))
    assert abs(empirical - theory) < 4 * math.sqrt(theory * (1 - theory) / B)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"\[B, K \+ 1, V\]"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="probability 0 under its draft distribution"):
        q = torch.tensor([[[1.0, 0.0]]])
        verify_sampled(torch.tensor([[1]]), q, torch.full((1, 2, 2), 0.5))
