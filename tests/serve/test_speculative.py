"""Speculative decoding in the engine (``kimik3.serve.speculative``): lossless against plain decoding.

Greedy: the same tokens with and without speculation, over prompts of several lengths in one batch, with the prefix
cache on and requests that cannot speculate (penalties, log-probabilities) mixed in; once with the draft grown from
the tiny model's MTP module, once with a proposer that knows the plain continuation and corrupts some of it, so that
every accepted length 0..K occurs and the KDA states are kept at every step index. Sampled: the joint distribution of
the first tokens is the same with and without speculation (a two-sample chi-square test). The cache-level pieces
(the stepwise KDA forward with its commit, the multi-token paged MLA attention) against their plain counterparts.
"""

from __future__ import annotations

import math

import pytest
import torch

from kimik3.model.draft import EagleDraft
from kimik3.serve.memory import EngineConfig
from kimik3.serve.paged_cache import LatentPool, StatePool, StepStates, batch_cache
from kimik3.serve.sampler import SamplingBatch, probabilities
from kimik3.serve.scheduler import EngineCore
from kimik3.serve.speculative import Speculator
from kimik3.serve.types import GenerationRequest, SamplingParams


def _config(K: int, **kw) -> EngineConfig:
    options = dict(memory_bytes=48 * 2**20, max_running=8, checkpoints=0, prefill_chunk=32, max_context=512,
                   speculative_tokens=K)
    options.update(kw)
    return EngineConfig(**options)


def _run(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    errors = []

    def sink_for(key):
        def sink(event):
            if event.token_id is not None:
                outs[key].append(event.token_id)
            if event.error:
                errors.append(event.error)
        return sink

    for i, (prompt, params) in enumerate(requests):
        core.add(GenerationRequest(str(i), prompt, params), sink_for(str(i)))
    while core.has_work():
        core.step()
    assert not errors
    return outs


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def draft(serve_model):
    return EagleDraft.from_mtp(serve_model)


def _mixed_requests(max_tokens=8):
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = _prompts((5, 40, 70, 1, 33))
    requests = [(p, greedy) for p in prompts]
    requests.append((prompts[2][:50], greedy))   # shares a prefix with request 2: a prefix-cache hit
    requests.append((prompts[1], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                repetition_penalty=1.3)))   # decodes one token at a time
    requests.append((prompts[0], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)))
    return requests


def test_greedy_speculation_gives_the_plain_tokens(serve_model, serve_tokenizer, draft):
    requests = _mixed_requests()
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0, checkpoints=8)), requests)
    for K in (1, 3):
        core = EngineCore(serve_model, serve_tokenizer, _config(K, checkpoints=8), draft=draft)
        assert _run(core, requests) == plain
        stats = core.runner.speculator.stats
        assert stats.steps > 0 and stats.proposed == [stats.steps] * K


def _spy_proposals(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Record what ``Speculator._propose`` returns: (drafts [B, K], draft distributions [B, K, V] or None)."""
    seen = []
    propose = Speculator._propose

    def spy(self, seqs, inputs, sampling):
        drafts, probs = propose(self, seqs, inputs, sampling)
        seen.append((drafts.clone(), None if probs is None else probs.clone()))
        return drafts, probs
    monkeypatch.setattr(Speculator, "_propose", spy)
    return seen


def test_a_reduced_vocabulary_draft_proposes_only_its_ids_and_stays_lossless(serve_model, serve_tokenizer,
                                                                            monkeypatch):
    """A draft over every third id (EAGLE-3's reduced vocabulary): greedy output equals plain decoding; sampled rows
    draw their drafts from a distribution over the target's vocabulary that is zero outside the draft's ids."""
    ids = torch.arange(0, serve_model.config.vocab_size, 3)
    small = EagleDraft.from_mtp(serve_model, vocab_ids=ids)
    requests = _mixed_requests()
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0, checkpoints=8)), requests)
    seen = _spy_proposals(monkeypatch)
    core = EngineCore(serve_model, serve_tokenizer, _config(3, checkpoints=8), draft=small)
    assert _run(core, requests) == plain
    assert seen and all(bool(torch.isin(drafts, ids).all()) for drafts, _ in seen)

    seen.clear()
    sampled = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, top_k=5, seed=3)
    _run(EngineCore(serve_model, serve_tokenizer, _config(2), draft=small), [([7, 11, 13], sampled)])
    outside = torch.ones(serve_model.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    for drafts, probs in seen:
        assert probs is not None and probs.shape[-1] == serve_model.config.vocab_size
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
        assert bool((probs[..., outside] == 0).all()) and bool(torch.isin(drafts, ids).all())
        assert bool((probs.gather(-1, drafts[..., None]) > 0).all())   # each draft drawn where q has mass


class _Oracle(Speculator):
    """Proposes the plain greedy continuation with every draft wrong with probability ``wrong`` (seeded)."""

    def __init__(self, *args, continuations, wrong, **kw):
        super().__init__(*args, **kw)
        self.continuations = continuations
        self.wrong = wrong
        self.generator = torch.Generator().manual_seed(1)

    def _propose(self, seqs, inputs, sampling):
        drafts = []
        for seq in seqs:
            known = self.continuations[seq.request.request_id][seq.generated:]
            row = (known + [0] * self.tokens)[:self.tokens]
            flips = torch.rand(self.tokens, generator=self.generator) < self.wrong
            drafts.append([(t + 1) % 512 if f else t for t, f in zip(row, flips.tolist())])
        return torch.tensor(drafts, dtype=torch.long, device=self.runner.device), None


def test_every_accepted_length_keeps_the_cache_lossless(serve_model, serve_tokenizer, draft, monkeypatch):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    requests = [(p, greedy) for p in _prompts((3, 45, 20, 64), seed=3)]
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0)), requests)
    K = 3
    import kimik3.serve.model_runner as model_runner

    monkeypatch.setattr(model_runner, "Speculator",
                        lambda runner, d, k: _Oracle(runner, d, k, continuations=plain, wrong=0.25))
    core = EngineCore(serve_model, serve_tokenizer, _config(K), draft=draft)
    assert _run(core, requests) == plain
    stats = core.runner.speculator.stats
    # Every emitted count 1..K+1 occurred: accepted at position k is strictly between none and all proposed.
    assert 0 < stats.accepted[-1] < stats.accepted[0] < stats.proposed[0]
    assert stats.mean_emitted > 1.5


class _RecordingOracle(_Oracle):
    """Runs the real draft chain and records what it proposed (with the sequence as it stood), but hands the
    verification the oracle's drafts, so that every accepted length occurs and the next step's pending pairs vary."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.records = []

    def _propose(self, seqs, inputs, sampling):
        real, _ = Speculator._propose(self, seqs, inputs, sampling)
        for seq, row in zip(seqs, real.tolist()):
            self.records.append((list(seq.tokens), seq.computed, seq.spec_pending, row))
        return super()._propose(seqs, inputs, sampling)


def test_min_tokens_requests_speculate_from_their_first_token_and_hold_the_end_back(serve_model, serve_tokenizer,
                                                                                    draft, monkeypatch):
    """A request with ``min_tokens`` speculates from its first decode step: the verification holds its stop tokens
    back at the positions before the minimum, as plain decoding's sampler does, so the output is plain decoding's
    even when the drafts propose a held token that the target's argmax would accept."""
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts((30, 12, 50), seed=5)
    free = _run(EngineCore(serve_model, serve_tokenizer, _config(0)), [(p, SamplingParams(**greedy)) for p in prompts])
    # Each request's stop token is its free continuation's second token, held back until four tokens are out.
    requests = [(p, SamplingParams(**greedy, stop_token_ids=[free[str(i)][1]], min_tokens=4))
                for i, p in enumerate(prompts)]
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0)), requests)
    assert all(out[:2] != free[str(i)][:2] for i, out in plain.items())   # the stop token was held back at 1
    K = 3
    core = EngineCore(serve_model, serve_tokenizer, _config(K), draft=draft)
    assert _run(core, requests) == plain
    import kimik3.serve.model_runner as model_runner

    made = []

    def oracle(runner, d, k):   # proposes the free continuation: its stop token first, where it is held
        made.append(_RecordingOracle(runner, d, k, continuations=free, wrong=0.0))
        return made[-1]
    monkeypatch.setattr(model_runner, "Speculator", oracle)
    core = EngineCore(serve_model, serve_tokenizer, _config(K), draft=draft)
    assert _run(core, requests) == plain
    # The first request speculated from its first decode step (the prefill emits token 1), its drafts then the
    # free continuation's: the held stop token first.
    assert min(len(tokens) - 30 for tokens, *_ in made[0].records if tokens[:30] == prompts[0]) == 1

    # Sampled rows (top_k = 1: one outcome) through the rejection rule, drafts drawn near the target's unmasked
    # distribution, so that they often propose the held stop token.
    sampled = [(p, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True, min_tokens=4,
                                  stop_token_ids=params.stop_token_ids)) for p, params in requests]
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0)), sampled)
    monkeypatch.setattr(model_runner, "Speculator", _NearTarget)
    assert _run(EngineCore(serve_model, serve_tokenizer, _config(2), draft=draft), sampled) == plain


def _trained_chain(model, draft, tokens: list[int], computed: int, K: int) -> list[int]:
    """The K drafts the training-time test (``kimik3.train.draft_ttt``) computes for the chain that starts at the
    last cached position: the target over the whole sequence at once, the draft's steps over every position with
    ``ChainCache``, the chain's later steps fed its own drafts."""
    from kimik3.train.draft_ttt import ChainCache, shifted, target_pass

    ids = torch.tensor([tokens[:computed + 1]])
    t = computed - 1   # the pair (features of the last cached token, the token not yet fed)
    feature = draft.fuse_features(target_pass(model, draft, ids).features)
    cache, inputs, drafts = ChainCache(), shifted(ids, 1), []
    for k in range(1, K + 1):
        feature, normed = draft(feature, model.embed(inputs), cache)
        drafts.append(int(draft.target_ids(draft.logits(model, normed[:, t]).argmax(-1))))
        inputs = shifted(ids, k + 1)
        inputs[:, t] = drafts[-1]
    return drafts


def test_the_engine_drafts_what_the_draft_was_trained_to(serve_model, serve_tokenizer, monkeypatch):
    """The engine's draft chain (paged latents, pending pairs from the last verification, one step at a time)
    proposes what the training-time test's chain proposes for the same sequence. Every feature the draft fuses
    carries weight (``from_mtp`` starts the lower ones at zero), and an oracle picks what is verified so that the
    pending pairs number 1 to K + 1."""
    K = 3
    draft = EagleDraft.from_mtp(serve_model)
    with torch.no_grad():
        draft.fuse.weight.add_(0.05 * torch.randn(draft.fuse.weight.shape, generator=torch.Generator().manual_seed(4)))
    greedy = SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    requests = [(p, greedy) for p in _prompts((6, 29), seed=5)]
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0)), requests)
    made = []
    import kimik3.serve.model_runner as model_runner

    def speculator(runner, d, k):
        made.append(_RecordingOracle(runner, d, k, continuations=plain, wrong=0.3))
        return made[-1]
    monkeypatch.setattr(model_runner, "Speculator", speculator)
    core = EngineCore(serve_model, serve_tokenizer, _config(K), draft=draft)
    assert _run(core, requests) == plain
    records = made[0].records
    assert len(records) > 10 and all(len(tokens) == computed + 1 for tokens, computed, _, _ in records)
    assert {m for _, _, m, _ in records} == set(range(1, K + 2))   # every count of pending pairs occurred
    with torch.no_grad():
        mismatched = [(computed, row, _trained_chain(serve_model, draft, tokens, computed, K))
                      for tokens, computed, _, row in records]
    mismatched = [m for m in mismatched if m[1] != m[2]]
    assert not mismatched, mismatched[:3]


def test_speculating_sequences_leave_decode_checkpoints(serve_model, serve_tokenizer, draft, monkeypatch):
    """A step of several tokens that lands on a hash boundary offers the prefix cache a checkpoint there, as plain
    decoding does: a follow-up turn (prompt + reply) then restores past the first prompt."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = _prompts((20,), seed=7)[0]
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0, checkpoints=8)), [(prompt, greedy)])
    import kimik3.serve.model_runner as model_runner

    monkeypatch.setattr(model_runner, "Speculator",
                        lambda runner, d, k: _Oracle(runner, d, k, continuations=plain, wrong=0.0))
    core = EngineCore(serve_model, serve_tokenizer, _config(3, checkpoints=8), draft=draft)
    assert _run(core, [(prompt, greedy)]) == plain
    follow_up = prompt + plain["0"]
    assert core.prefix_cache.match_length(follow_up) >= 48   # decode checkpoints at 32 and 48 (hash block 16)


def _joint(outs, steps):
    counts: dict[tuple[int, ...], int] = {}
    for tokens in outs.values():
        key = tuple(tokens[:steps])
        counts[key] = counts.get(key, 0) + 1
    return counts


def _two_sample_chi_square(a: dict, b: dict) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of two samples' category counts (categories with < 5 expected
    pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    small = [k for k in keys if a.get(k, 0) + b.get(k, 0) < 10]
    cells = [(a.get(k, 0), b.get(k, 0)) for k in keys if k not in small]
    cells.append((sum(a.get(k, 0) for k in small), sum(b.get(k, 0) for k in small)))
    cells = [c for c in cells if sum(c) > 0]
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


class _NearTarget(Speculator):
    """Samples its drafts from a distribution near the target's: the target's own (run without a cache over the
    sequence so far, under the request's options) mixed with a uniform one over a few tokens, so that drafts are
    accepted often and rejected often."""

    def _propose(self, seqs, inputs, sampling):
        drafts, probs = [], []
        vocab = self.model.config.vocab_size
        noise = torch.zeros(vocab)
        noise[[1, 2, 3]] = 1 / 3
        for b, seq in enumerate(seqs):
            tokens, rows, qs = list(seq.tokens), [], []
            for _ in range(self.tokens):
                logits = self.model(torch.tensor([tokens])).logits[:, -1]
                one = SamplingBatch.build([seq.request.params], [None], "cpu")
                q = 0.6 * probabilities(logits, one)[0] + 0.4 * noise
                token = int(torch.multinomial(q, 1))
                rows.append(token)
                qs.append(q)
                tokens.append(token)
            drafts.append(rows)
            probs.append(torch.stack(qs))
        return torch.tensor(drafts), torch.stack(probs)


@pytest.mark.slow
# The tiny random model's distributions are nearly flat over 512 tokens: top_k keeps the joint of three tokens to
# few enough categories; the second case also runs the top_p and min_p cuts on the k kept.
@pytest.mark.parametrize("options", [dict(top_k=3), dict(top_k=4, top_p=0.6, min_p=0.05)])
def test_sampled_speculation_keeps_the_target_distribution(serve_model, serve_tokenizer, draft, options,
                                                            monkeypatch):
    """Two-sample chi-square over the joint distribution of the first three tokens (the first from the prefill,
    the next two through speculation), with and without it."""
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, **options)
    requests = [([7, 11], params)] * 200
    config = dict(max_running=64, max_waiting=1024, checkpoints=4)
    plain = _run(EngineCore(serve_model, serve_tokenizer, _config(0, **config)), requests)
    import kimik3.serve.model_runner as model_runner

    monkeypatch.setattr(model_runner, "Speculator", _NearTarget)
    core = EngineCore(serve_model, serve_tokenizer, _config(2, **config), draft=draft)
    spec = _run(core, requests)
    stats = core.runner.speculator.stats
    assert 0.1 * stats.proposed[0] < stats.accepted[0] < 0.9 * stats.proposed[0]   # both branches of the rule ran
    stat, dof = _two_sample_chi_square(_joint(plain, 3), _joint(spec, 3))
    # The 0.999 quantile of chi-square(dof), by the Wilson-Hilferty approximation.
    assert dof >= 3, f"too few categories for the test: {dof + 1}"
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, dof, limit)


def test_the_stepwise_kda_forward_and_its_commit_match_the_plain_forward(serve_model):
    """Verifying T tokens keeps each state; committing index n gives what a plain forward of n + 1 tokens gives."""
    config = serve_model.config
    pool_a = StatePool(config, 4, torch.float32, "cpu")
    pool_b = StatePool(config, 4, torch.float32, "cpu")
    latents_a = LatentPool(len(config.mla_layer_indices), 8, 16, config.mla.cache_width, torch.float32, "cpu")
    latents_b = LatentPool(len(config.mla_layer_indices), 8, 16, config.mla.cache_width, torch.float32, "cpu")
    slots = torch.tensor([2, 0, 1])
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for pool, latents in ((pool_a, latents_a), (pool_b, latents_b)):   # the same 5-token history in both
            serve_model(ids[:, :5], cache=batch_cache(config, latents, pool, slots, tables, torch.zeros(3).long(), 0))
        steps = StepStates(pool_a, 4, 3)
        lengths = torch.full((3,), 5)
        verified = serve_model(ids[:, 5:], cache=batch_cache(config, latents_a, pool_a, slots, tables, lengths,
                                                             steps=steps)).logits
        accepted = torch.tensor([0, 3, 1])
        pool_a.commit_steps(slots, accepted, steps)
        for b in range(3):
            one = slice(b, b + 1)
            plain = serve_model(ids[one, 5:6 + int(accepted[b])], cache=batch_cache(
                config, latents_b, pool_b, slots[one], tables[one], lengths[one], 5)).logits
            torch.testing.assert_close(verified[one, :plain.shape[1]], plain, atol=2e-4, rtol=2e-4)
    for rec_a, rec_b, conv_a, conv_b in zip(pool_a.recurrent, pool_b.recurrent, pool_a.conv, pool_b.conv):
        torch.testing.assert_close(rec_a[slots], rec_b[slots], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_a[slots], conv_b[slots], atol=1e-6, rtol=1e-6)


def test_sampled_requests_speculate_within_their_cuts(serve_model, serve_tokenizer, draft, monkeypatch):
    """A quick check of the sampled path (the distribution itself: the slow chi-square test above): every emitted
    token lies in the target's top-k at its position, and drafts were both accepted and rejected."""
    import kimik3.serve.model_runner as model_runner

    monkeypatch.setattr(model_runner, "Speculator", _NearTarget)
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, top_k=2, seed=5)
    requests = [([7, 11, 13], params), ([3], SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True,
                                                             top_k=2))]
    core = EngineCore(serve_model, serve_tokenizer, _config(2), draft=draft)
    outs = _run(core, requests)
    for (prompt, _), tokens in zip(requests, outs.values()):
        assert len(tokens) == 6
        for t in range(len(tokens)):
            logits = serve_model(torch.tensor([prompt + tokens[:t]])).logits[0, -1]
            assert tokens[t] in logits.topk(2).indices.tolist()
    stats = core.runner.speculator.stats
    assert 0 < sum(stats.accepted) < sum(stats.proposed)


def test_speculation_needs_a_draft_and_a_sane_token_count(serve_model, serve_tokenizer):
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=99)
    with pytest.raises(ValueError, match="draft"):
        EngineCore(serve_model, serve_tokenizer, _config(2))


def test_speculation_statistics_reach_metrics_and_sum_over_replicas():
    """/metrics exposes acceptance per position, tokens per verification and the draft's share; a router sums the
    per-position counts position by position."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kimik3.serve.metrics import EngineCollector
    from kimik3.serve.router import ReplicaRouter
    from kimik3.serve.types import EngineStats

    class Stub:
        def __init__(self, stats):
            self._stats = stats

        def stats(self):
            return self._stats

    one = EngineStats(spec_proposed=(10, 10), spec_accepted=(6, 3), spec_steps=10, spec_emitted=19,
                      spec_draft_seconds=1.0, spec_verify_seconds=3.0)
    two = EngineStats(spec_proposed=(10, 10), spec_accepted=(8, 5), spec_steps=10, spec_emitted=23)
    router = ReplicaRouter.__new__(ReplicaRouter)
    router.replicas = [Stub(one), Stub(two)]
    total = router.stats()
    assert total.spec_proposed == (20, 20) and total.spec_accepted == (14, 8) and total.spec_emitted == 42
    registry = CollectorRegistry()
    registry.register(EngineCollector(Stub(one)))
    text = generate_latest(registry).decode()
    assert 'kimik3_engine_spec_acceptance_ratio{position="1"} 0.6' in text
    assert 'kimik3_engine_spec_acceptance_ratio{position="2"} 0.3' in text
    assert "kimik3_engine_spec_mean_emitted 1.9" in text
    assert "kimik3_engine_spec_draft_time_ratio 0.25" in text
    plain = CollectorRegistry()
    plain.register(EngineCollector(Stub(EngineStats())))
    assert "spec_" not in generate_latest(plain).decode()   # no speculation: no speculative metrics
