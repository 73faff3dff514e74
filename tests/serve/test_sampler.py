"""The batched sampler (kimik3/serve/sampler.py): greedy rows, per-row min_p / top_k / top_p cuts, the exponential
race's distribution, seeded rows independent of their batch, the log-probabilities, and no host synchronisation."""

import ast
import inspect
import math
import re
import textwrap

import pytest
import torch

from kimik3.model.sampling import sample_next_token
from kimik3.serve import sampler
from kimik3.serve.sampler import SamplingBatch, logprob_logits, sample, token_logprobs
from kimik3.serve.types import SamplingParams


@pytest.fixture(autouse=True)
def fixed_default_rng():
    """Every test draws from a default generator seeded the same, and leaves the global state as it found it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def params(**options) -> SamplingParams:
    return SamplingParams(**options)


def batch_of(rows: list[SamplingParams], generators=None, device="cpu") -> SamplingBatch:
    return SamplingBatch.build(rows, generators or [None] * len(rows), device)


def reference_probs(logits_V: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """The distribution ``sample_next_token`` draws from, written out plainly in fp64."""
    logits = logits_V.double() / temperature
    vocab = logits.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    if min_p > 0:
        keep &= logits >= logits.max() + math.log(min_p)
    if 0 < top_k < vocab:
        keep &= logits >= torch.where(keep, logits, -math.inf).sort(descending=True).values[top_k - 1]
    if top_p < 1:
        probs = torch.softmax(torch.where(keep, logits, -math.inf), -1)
        order = probs.argsort(descending=True, stable=True)
        before = probs[order].cumsum(0) - probs[order]
        keep[order[before >= top_p]] = False
    return torch.softmax(torch.where(keep, logits, -math.inf), -1)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


# -- greedy --------------------------------------------------------------------------------------------------------

def test_all_greedy_batch_is_the_argmax_and_draws_nothing():
    logits = torch.randn(5, 37)
    rows = [params(temperature=t, top_k=3, top_p=0.5, seed=1) for t in (0.0, 1e-6, 0.0, 9e-6, 0.0)]
    gens = [torch.Generator().manual_seed(1) for _ in rows]
    batch = SamplingBatch.build(rows, gens, "cpu")
    assert batch.all_greedy and batch.any_greedy and not batch.seeded_rows
    state = torch.get_rng_state()
    gen_states = [g.get_state() for g in gens]
    assert torch.equal(sample(logits, batch), logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)          # nothing drawn from the default generator
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, gen_states))   # nor from the rows'


def test_greedy_rows_mix_with_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 41) * 3
    temps = [0.0, 1.0, 1e-6, 0.7, 0.0, 2.0]
    rows = [params(temperature=t, top_k=4 if i % 2 else 0, top_p=0.9) for i, t in enumerate(temps)]
    batch = batch_of(rows)
    assert not batch.all_greedy and batch.any_greedy
    greedy = torch.tensor([t < 1e-5 for t in temps])
    assert torch.equal(batch.greedy_B, greedy)
    for _ in range(50):
        tokens = sample(logits, batch)
        assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
        for b in (0, 2, 4):
            assert tokens[b] == sample_next_token(logits[b:b + 1], temps[b])[0]
        # the sampled rows (top_k 4 on rows 1, 3, 5) stay within their 4 largest
        for b in (1, 3, 5):
            assert tokens[b] in logits[b].topk(4).indices


# -- the cuts: only allowed tokens, every allowed token reachable ----------------------------------------------------

P4 = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
P4B = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
TIES = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0])

# (logits, options, allowed tokens)
CASES = [
    (TIES, dict(top_k=2), {0, 1, 2, 3}),                     # ties with the k-th logit all stay
    (TIES, dict(top_k=4), {0, 1, 2, 3}),
    (TIES, dict(top_k=5), {0, 1, 2, 3, 4}),
    (torch.tensor([2.0, 2.0, 1.0, 0.0, -3.0]), dict(top_k=1), {0, 1}),
    (TIES, dict(top_k=7), set(range(7))),                    # k = vocab: off
    (TIES, dict(top_k=100), set(range(7))),                  # k > vocab: off
    (P4B, dict(top_p=0.7), {0, 1}),                          # mass before token 2 is 0.8 >= 0.7: dropped
    (P4B, dict(top_p=0.85), {0, 1, 2}),
    (P4B, dict(top_p=0.01), {0}),                            # the first always stays
    (P4B, dict(min_p=0.25), {0, 1, 2}),                      # p >= 0.125
    (P4B, dict(min_p=0.7), {0}),
    (P4, dict(top_k=3, top_p=0.75), {0, 1}),                 # top-k first: 0.4/0.9 + 0.3/0.9 = 0.78 >= 0.75
    (P4, dict(top_p=0.75), {0, 1, 2}),                       # without it: 0.4 + 0.3 = 0.7 < 0.75
    (P4, dict(min_p=0.6), {0, 1}),                           # p >= 0.24 at temperature 1
    (P4, dict(min_p=0.6, temperature=2.0), {0, 1, 2}),       # min_p applies after the temperature: sqrt(p / 0.4)
    (P4, dict(min_p=0.3, top_k=2, top_p=0.6), {0, 1}),      # top-k: 0.4 / 0.7 = 0.57 < 0.6
    (P4, dict(temperature=0.5), {0, 1, 2, 3}),
    (P4, dict(temperature=1.7), {0, 1, 2, 3}),
    (P4, dict(), {0, 1, 2, 3}),
]


def padded_logits(cases) -> torch.Tensor:
    """The cases' logits as one [len(cases), V] tensor, -inf past each case's own vocabulary."""
    vocab = max(c[0].numel() for c in cases)
    out = torch.full((len(cases), vocab), -math.inf)
    for i, (logits, _, _) in enumerate(cases):
        out[i, :logits.numel()] = logits
    return out


def test_reference_agrees_with_the_allowed_sets():
    for logits, options, allowed in CASES:
        support = set(torch.nonzero(reference_probs(logits, **options)).flatten().tolist())
        assert support == allowed, (options, support)


def test_per_row_cuts_stay_in_their_allowed_sets_and_match_the_distribution():
    draws = 3000
    cases = [(logits, options, allowed) for logits, options, allowed in CASES for _ in range(draws)]
    rows = [params(**options) for _, options, _ in cases]
    batch = batch_of(rows)
    assert batch.any_top_k and batch.any_top_p and batch.any_min_p and not batch.any_greedy
    tokens = sample(padded_logits(cases), batch).view(len(CASES), draws)
    for (logits, options, allowed), got in zip(CASES, tokens):
        vocab = logits.numel()
        # Case by case: each vocabulary of the batch is its own; a case's rows never leave its allowed set ...
        assert set(got.tolist()) == allowed, options           # ... and reach every token in it
        error = (frequencies(got, vocab) - reference_probs(logits, **options)).abs().max().item()
        assert error < 0.035, (options, error)


def test_cuts_are_per_row_with_the_other_rows_off():
    """A batch where only one row cuts: the others must sample from their whole distribution."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4]]).repeat(2000, 1)
    for options in (dict(top_k=1), dict(top_p=0.1), dict(min_p=0.99)):
        rows = [params(**options) if b % 2 == 0 else params() for b in range(2000)]
        tokens = sample(logits, batch_of(rows))
        assert set(tokens[0::2].tolist()) == {4}
        assert set(tokens[1::2].tolist()) == set(range(5))


# -- the draw's distribution -----------------------------------------------------------------------------------------

def test_draws_follow_the_softmax():
    vocab, draws = 11, 20000                                   # not a power of two
    logits_V = torch.linspace(-2.0, 1.5, vocab)[torch.randperm(vocab)]
    tokens = sample(logits_V.repeat(draws, 1), batch_of([params()] * draws))
    expected = torch.softmax(logits_V.double(), -1)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert (counts / draws - expected).abs().max().item() < 0.01
    chi2 = ((counts - draws * expected) ** 2 / (draws * expected)).sum().item()
    assert chi2 < 29.6                                         # the 99.9% quantile of chi-square with 10 degrees


def test_temperature_sharpens_and_flattens():
    logits_V = P4
    draws = 20000
    top_share = {}
    for temperature in (0.5, 1.0, 2.0):
        tokens = sample(logits_V.repeat(draws, 1), batch_of([params(temperature=temperature)] * draws))
        freq = frequencies(tokens, 4)
        assert (freq - torch.softmax(logits_V.double() / temperature, -1)).abs().max().item() < 0.01
        top_share[temperature] = freq[0].item()
    assert top_share[0.5] > top_share[1.0] + 0.1 > top_share[2.0] + 0.15


# -- seeded rows -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(temperature=0.9), dict(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01)])
def test_a_seeded_row_ignores_its_batch(options):
    vocab, steps, seed = 1001, 12, 1234
    torch.manual_seed(5)
    target = [torch.randn(vocab) * 2 for _ in range(steps)]

    gen = torch.Generator().manual_seed(seed)
    alone_batch = SamplingBatch.build([params(seed=seed, **options)], [gen], "cpu")
    alone = [sample(target[t][None], alone_batch)[0].item() for t in range(steps)]
    assert len(set(alone)) > steps // 2                        # the row really samples

    others = [params(top_p=0.9), params(seed=7, top_k=5), params(temperature=0.0), params(min_p=0.1),
              params(seed=8, temperature=0.0)]
    for position in (0, 3, 5):
        torch.manual_seed(100 + position)                      # the default generator's state must not matter
        rows = others[:position] + [params(seed=seed, **options)] + others[position:]
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in rows]
        batch = SamplingBatch.build(rows, gens, "cpu")
        got = []
        for t in range(steps):
            logits = torch.randn(len(rows), vocab) * 2
            logits[position] = target[t]
            got.append(sample(logits, batch)[position].item())
        assert got == alone, position


def test_seeded_rows_draw_only_from_their_generator():
    rows = [params(seed=3), params(seed=3, temperature=0.0)]
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)]
    batch = SamplingBatch.build(rows, gens, "cpu")
    assert [b for b, _ in batch.seeded_rows] == [0] and not batch.any_unseeded
    logits = torch.randn(2, 13)
    state = torch.get_rng_state()
    sample(logits, batch)
    assert torch.equal(torch.get_rng_state(), state)           # the default generator is untouched
    assert not torch.equal(gens[0].get_state(), torch.Generator().manual_seed(3).get_state())
    assert torch.equal(gens[1].get_state(), torch.Generator().manual_seed(3).get_state())   # greedy: not advanced


# -- log-probabilities -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_log_softmax_and_topk(dtype):
    logits = (torch.randn(4, 53) * 4).to(dtype)
    tokens = torch.tensor([0, 52, 7, 7])
    chosen, top_ids, top_values = token_logprobs(logits, tokens, 5)
    reference = torch.log_softmax(logits.float(), -1)
    assert chosen.dtype == top_values.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert chosen.shape == (4,) and top_ids.shape == top_values.shape == (4, 5)
    torch.testing.assert_close(chosen, reference[torch.arange(4), tokens])
    ref_values, ref_ids = reference.topk(5, -1)
    torch.testing.assert_close(top_values, ref_values)
    assert torch.equal(top_ids, ref_ids)
    assert torch.all(top_values[:, :-1] >= top_values[:, 1:])  # best first

    chosen0, ids0, values0 = token_logprobs(logits, tokens, 0)
    assert ids0.shape == values0.shape == (4, 0)
    torch.testing.assert_close(chosen0, chosen)
    assert token_logprobs(logits, tokens, 100)[1].shape == (4, 53)   # capped at the vocabulary


def test_processed_logprobs_are_of_the_tempered_penalised_distribution():
    """Rows asking "processed" report log_softmax(penalised logits / temperature); "raw" rows and rows without
    log-probabilities report the model's logits, whatever their temperature."""
    raw = torch.randn(4, 29) * 3
    penalized = raw - torch.rand(4, 29)
    rows = [params(temperature=0.5, logprobs=0, logprobs_mode="processed"), params(temperature=0.5, logprobs=0),
            params(temperature=1.7, logprobs=2, logprobs_mode="processed"), params(temperature=0.5)]
    out = logprob_logits(raw, penalized, rows)
    torch.testing.assert_close(out[0], penalized[0] / 0.5)
    torch.testing.assert_close(out[1], raw[1])
    torch.testing.assert_close(out[2], penalized[2] / 1.7)
    torch.testing.assert_close(out[3], raw[3])
    assert logprob_logits(raw, penalized, rows[1:2] * 4) is raw      # nothing processed: the raw tensor itself
    with pytest.raises(ValueError, match="logprobs_mode"):
        params(logprobs=0, logprobs_mode="sampled")
    with pytest.raises(ValueError, match="temperature > 0"):
        params(temperature=0.0, logprobs=0, logprobs_mode="processed")


def test_max_logprobs_and_flags():
    rows = [params(logprobs=3), params(temperature=0.0, logprobs=0, top_k=9), params(top_p=0.5), params()]
    batch = batch_of(rows)
    assert batch.max_logprobs == 3 and len(batch) == 4
    assert batch.any_top_p and not batch.any_top_k and not batch.any_min_p       # the greedy row's top_k is moot
    assert batch.top_k_B.tolist() == [0, 0, 0, 0] and batch.temperature_B.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert batch_of([params()]).max_logprobs is None
    assert batch_of([params(temperature=0.0, logprobs=0)]).max_logprobs == 0
    with pytest.raises(ValueError):
        SamplingBatch.build([params()], [], "cpu")


# -- shapes, dtypes, small batches ---------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [1, 3, 7, 1000, 1023])
@pytest.mark.parametrize("options", [dict(), dict(temperature=0.0), dict(top_k=2, top_p=0.8, min_p=0.05)])
def test_shapes_and_dtypes(vocab, options):
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(1, vocab).to(dtype)
        tokens = sample(logits, batch_of([params(**options)]))
        assert tokens.dtype == torch.int64 and tokens.shape == (1,) and tokens.device == logits.device
        assert 0 <= tokens[0] < vocab
    tokens = sample(torch.randn(3, vocab), batch_of([params(**options), params(seed=1), params(temperature=0.0)],
                                                     [None, torch.Generator().manual_seed(1), None]))
    assert tokens.shape == (3,) and tokens.dtype == torch.int64


def test_an_empty_batch():
    assert sample(torch.randn(0, 9), batch_of([])).shape == (0,)


# -- no host synchronisation -----------------------------------------------------------------------------------------

# Calls that read a device tensor back on the host; int, bool and float as builtins (``.float()`` stays on device).
SYNCING = re.compile(r"\.item\(|\.tolist\(|multinomial|nonzero|\.cpu\(|\.numpy\(|(?<![.\w])(int|bool|float)\(")


def test_sample_source_has_no_host_sync():
    """Weak, but it documents the rule: ``sample`` and the helpers it calls hold no syncing call (docstrings aside).
    The CUDA test below checks it for real."""
    for function in (sampler.sample, sampler._cut, sampler._kth, sampler._exponential_noise, sampler.token_logprobs):
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        body = tree.body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        code = "\n".join(ast.unparse(node) for node in body)
        assert not SYNCING.search(code), (function.__name__, SYNCING.search(code))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_host_sync_on_cuda():
    torch.cuda.manual_seed(0)
    rows = [params(), params(temperature=0.0), params(seed=4, top_k=20), params(top_p=0.8, min_p=0.02),
            params(seed=5, temperature=0.5, top_p=0.9, logprobs=5)]
    gens = [torch.Generator("cuda").manual_seed(p.seed) if p.seed is not None else None for p in rows]
    batch = SamplingBatch.build(rows, gens, "cuda")
    logits = torch.randn(len(rows), 1531, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(logits, batch)
        token_logprobs(logits, tokens, batch.max_logprobs)
        only_top_k = batch_of([params(top_k=3), params(temperature=0.0)], device="cuda")
        sample(logits[:2], only_top_k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens[1].item() == logits[1].argmax().item()

    # A seeded row on CUDA: the same tokens alone and in the batch (at an odd offset, odd vocabulary).
    alone = sample(logits[2:3], SamplingBatch.build([rows[2]], [torch.Generator("cuda").manual_seed(4)], "cuda"))
    batch = SamplingBatch.build(rows, [torch.Generator("cuda").manual_seed(p.seed) if p.seed is not None else None
                                       for p in rows], "cuda")
    assert sample(logits, batch)[2].item() == alone[0].item()
