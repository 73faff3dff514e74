"""KDA-aware prefix cache: chained hashes, lookup/pin/evict contract, per-policy plans, benchmark."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from kimik3.serve.prefix_cache import POLICIES, BlockHasher, Checkpoint, PrefixCache

B, P = 16, 192          # the seed's 512 / 6144 scaled down by 32


def toks(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1 << 20) for _ in range(n)]


class Owner:
    """The engine's side: counts payload frees so double frees and leaks are visible."""

    def __init__(self) -> None:
        self.freed: list[object] = []

    def __call__(self, cp: Checkpoint) -> None:
        self.freed.append(cp.payload)


# ---- hashing ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 200), pos=st.integers(0, 199), seed=st.integers(0, 1000))
def test_chained_hashes_change_from_the_edited_block_on(n: int, pos: int, seed: int) -> None:
    cache = PrefixCache(B, 4, "vllm")
    a = toks(n, seed)
    h = cache.block_hashes(a)
    assert len(h) == n // B                                         # incomplete block not hashed
    assert cache.block_hashes(list(a)) == h                         # same content, other list
    assert cache.block_hashes(a + toks(40, seed + 1))[:len(h)] == h  # same prefix, same hashes
    if pos < n:
        b = list(a)
        b[pos] += 1
        hb = cache.block_hashes(b)
        j = pos // B
        assert hb[:j] == h[:j]
        assert all(x != y for x, y in zip(hb[j:], h[j:]))          # that block and every later one


def test_memo_extends_appended_lists_and_catches_an_edited_tail() -> None:
    hasher = BlockHasher(B)
    seq = toks(50)
    first = list(hasher(seq))
    seq.extend(toks(70, 1))                       # decode appends to the same list object
    assert hasher(seq) == BlockHasher(B)(list(seq))
    assert hasher(seq)[:len(first)] == first
    seq[-(len(seq) % B) - 1] += 1                 # edit inside the last hashed block
    assert hasher(seq) == BlockHasher(B)(list(seq))


# ---- lookup, pins, eviction ------------------------------------------------------------------
def test_lookup_longest_boundary_and_leaves_one_token() -> None:
    cache = PrefixCache(B, 8, "ours")
    seq = toks(100)
    for b in (32, 64):
        assert cache.insert(seq, b, f"p{b}") is not None
    assert cache.lookup(seq[:64]).boundary == 32       # 64 would leave nothing to compute
    assert cache.lookup(seq[:65]).boundary == 64
    assert cache.lookup(seq).boundary == 64
    assert cache.lookup(seq[:40] + toks(60, 9)).boundary == 32
    assert cache.lookup(toks(100, 5)) is None
    assert cache.lookup([]) is None
    before = (cache.stats.queries, cache._clock)
    assert cache.match_length(seq[:65]) == 64 and cache.match_length(toks(100, 5)) == 0
    assert (cache.stats.queries, cache._clock) == before             # a pure query
    assert (cache.stats.queries, cache.stats.hits, cache.stats.hit_tokens) == (6, 4, 32 + 64 + 64 + 32)


def test_hit_lands_mid_physical_block() -> None:
    cache = PrefixCache(B, 8, "ours", physical_block=P)
    system = toks(80 + 7)                              # a shared prefix ending mid hash block
    first = system + toks(300, 1)
    planned = cache.plan(first, 0, hints=[len(system)])
    assert 80 in planned and 80 % P != 0               # the hint rounded down to a hash boundary
    for b in planned:
        cache.insert(first, b, b)
    cp = cache.lookup(system + toks(250, 2))
    assert cp is not None and cp.boundary == 80


def test_capacity_evicts_lru_and_on_evict_once_each() -> None:
    owner = Owner()
    cache = PrefixCache(B, 2, "vllm", on_evict=owner)
    seqs = [toks(64, s) for s in range(3)]
    cps = [cache.insert(s, 32, i) for i, s in enumerate(seqs)]
    assert owner.freed == [0] and len(cache) == 2
    cache.lookup(seqs[1])                              # refresh 1, so 2 is now least recent
    cache.insert(toks(64, 7), 32, 3)
    assert owner.freed == [0, 2]
    assert {c.payload for c in cache.checkpoints()} == {1, 3}
    assert cps[1] in list(cache.checkpoints())
    assert cache.evict_one() and owner.freed == [0, 2, 1]            # LRU victim, on_evict'd
    cache.clear()
    assert sorted(owner.freed) == [0, 1, 2, 3] and len(cache) == 0
    assert not cache.evict_one()


@settings(max_examples=25, deadline=None)
@given(policy=st.sampled_from(["coarse", "vllm", "ours"]), cap=st.integers(1, 6),
       ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.booleans()), max_size=60))
def test_every_payload_is_freed_exactly_once(policy: str, cap: int, ops: list) -> None:
    """Random inserts/lookups/pins: a payload is held, or handed back exactly once (insert
    returned None or another checkpoint, or on_evict), and pinned checkpoints stay."""
    owner = Owner()
    cache = PrefixCache(B, cap, policy, physical_block=P, on_evict=owner)
    seqs = [toks(16 * 9, s % 3) + toks(16 * 9, s) for s in range(6)]    # 3 shared stems
    handed_back, pinned = [], []
    for i, (s, blocks, pin) in enumerate(ops):
        got = cache.insert(seqs[s], blocks * B, i)
        if got is None or got.payload != i:
            handed_back.append(i)
        if pin and got is not None:
            cache.acquire(got)
            pinned.append(got)
        cache.lookup(seqs[s])
        held = [c.payload for c in cache.checkpoints()]
        assert len(held) <= cap
        assert all(c in list(cache.checkpoints()) for c in pinned)
    everything = sorted(handed_back + owner.freed + [c.payload for c in cache.checkpoints()])
    assert everything == list(range(len(ops)))


def test_pinned_is_never_evicted_and_full_of_pins_declines() -> None:
    owner = Owner()
    cache = PrefixCache(B, 2, "vllm", on_evict=owner)
    a, b = (cache.insert(toks(64, s), 32, s) for s in range(2))
    cache.acquire(a)
    cache.insert(toks(64, 2), 32, 2)
    assert owner.freed == [1]                          # b went, although a was older
    cache.acquire(next(c for c in cache.checkpoints() if c.payload == 2))
    assert cache.insert(toks(64, 3), 32, 3) is None    # everything pinned: declined
    assert not cache.evict_one()
    assert owner.freed == [1] and cache.stats.declined == 1
    cache.release(a)
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        cache.release(a)
    with pytest.raises(ValueError, match="not in the cache"):
        cache.acquire(b)


def test_insert_existing_boundary_returns_the_stored_one() -> None:
    cache = PrefixCache(B, 4, "ours")
    seq = toks(64)
    first = cache.insert(seq, 32, "old")
    again = cache.insert(list(seq), 32, "new")
    assert again is first and again.payload == "old" and len(cache) == 1
    assert cache.stats.refreshed == 1 and cache.stats.inserts == 1


# ---- plans -----------------------------------------------------------------------------------
def test_plans_per_policy() -> None:
    seq, hints = toks(16 * 30 + 5), [100, 300]
    n = len(seq)
    plans = {p: PrefixCache(B, None if p == "oracle" else 8, p, physical_block=P).plan(seq, 40, hints)
             for p in POLICIES}
    assert plans["none"] == []
    assert plans["coarse"] == [192, 384]
    assert plans["vllm"] == [464, 480]                  # prompt tail floor((n-1)/B)*B and one below
    assert plans["oracle"] == list(range(48, n + 1, B))
    assert plans["ours"] == [96, 288, 480]              # first-sight hints rounded down + tail
    for p, plan in plans.items():
        assert plan == sorted(plan) and all(40 < b <= n and b % B == 0 for b in plan), p


def test_ours_plans_branch_point_and_decode_tail() -> None:
    cache = PrefixCache(B, 8, "ours")
    system = toks(100)
    cache.plan(system + toks(200, 1), 0)                # first request: recorded in the trie
    plan = cache.plan(system + toks(200, 2), 0)         # second: diverges inside block 6
    assert 96 in plan                                   # branch point, no hint needed
    full = system + toks(200, 3)
    cache.plan(full, 0)
    cache.finish(full + toks(40, 4))                    # prompt + output recorded
    nxt = full + toks(40, 4) + toks(50, 5)
    assert 96 not in cache.plan(nxt, 288)               # an extension is not a branch
    assert all(PrefixCache(B, 8, p, physical_block=P).want_decode_checkpoint(toks(64)) == want
               for p, want in [("none", False), ("vllm", False), ("coarse", False), ("ours", True)])
    assert PrefixCache(B, 8, "coarse", physical_block=P).want_decode_checkpoint(toks(P))
    assert not cache.want_decode_checkpoint(toks(65))   # not a hash boundary


def test_ours_evicts_a_superseded_tail_before_another_sessions_tail() -> None:
    owner = Owner()
    cache = PrefixCache(B, 2, "ours", on_evict=owner)
    a, b = toks(200, 1), toks(200, 2)
    cache.insert(a, 64, "a64")
    cache.insert(b, 64, "b64")
    cache.insert(a, 128, "a128")                        # a's newer tail: a64 is dominated
    assert owner.freed == ["a64"]


def run_sessions(policy: str, cap: int, sessions: int, turns: int) -> tuple[int, int]:
    """Round-robin multi-turn sessions through the engine protocol; (hits, prefill tokens)."""
    cache = PrefixCache(B, cap, policy, on_evict=lambda cp: None)
    hist = [toks(40, 100 + s) for s in range(sessions)]
    computed = 0
    for t in range(turns):
        for s in range(sessions):
            seq = hist[s] + toks(30, 1000 * t + s)
            cp = cache.lookup(seq)
            start = cp.boundary if cp else 0
            for bd in cache.plan(seq, start):
                cache.insert(seq, bd, None)
            computed += len(seq) - start
            out = toks(40, 5000 * t + s)
            for i in range(len(out)):
                seq.append(out[i])
                if len(seq) % B == 0 and cache.want_decode_checkpoint(seq):
                    cache.insert(seq, len(seq), None)
            cache.finish(seq)
            hist[s] = seq
    return cache.stats.hits, computed


def test_ours_does_not_thrash_when_sessions_exceed_the_budget() -> None:
    lru_hits, lru_cost = run_sessions("vllm", 4, 6, 8)
    ours_hits, ours_cost = run_sessions("ours", 4, 6, 8)
    assert lru_hits == 0                                # LRU: always evicts the next session
    assert ours_hits >= 20 and ours_cost < 0.6 * lru_cost


# ---- benchmark and arguments -----------------------------------------------------------------
def test_benchmark_small_mode_ours_beats_vllm() -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_cache.py"
    spec = importlib.util.spec_from_file_location("bench_prefix_cache", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench                      # dataclasses look their module up
    try:
        spec.loader.exec_module(bench)
        res = bench.main(["--small", "--quiet"])
    finally:
        del sys.modules[spec.name]
    get = {(r["policy"], r["budget"]): r["prefill_tokens"] for r in res["rows"]}
    assert get[("none", None)] == res["params"]["prompt_tokens"]
    for c in res["params"]["budgets"]:
        assert get[("ours", c)] < 0.8 * get[("vllm", c)]
        assert get[("oracle", None)] <= get[("ours", c)] < get[("none", None)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="lru"), "unknown policy"),
    (dict(hash_block=0), "hash_block"),
    (dict(physical_block=100), "multiple of hash_block"),
    (dict(policy="coarse"), "needs physical_block"),
    (dict(policy="oracle"), "unbounded"),
    (dict(capacity=0), "capacity"),
    (dict(hasher=BlockHasher(32)), "hasher.hash_block"),
    (dict(grace_factor=0.0), "grace_factor"),
    (dict(prior_forks=0.0), "prior_forks"),
])
def test_bad_constructor_arguments(kwargs: dict, match: str) -> None:
    args = dict(hash_block=B, capacity=4) | kwargs
    with pytest.raises(ValueError, match=match):
        PrefixCache(**args)


def test_bad_call_arguments() -> None:
    cache = PrefixCache(B, 4, "ours")
    seq = toks(64)
    for bad in (0, 20, 80):
        with pytest.raises(ValueError, match="boundary must be a multiple"):
            cache.insert(seq, bad, None)
    with pytest.raises(ValueError, match="start must be"):
        cache.plan(seq, 65)


def engine_turn(cache: PrefixCache, prompt: list[int], out: list[int]) -> tuple[list[int], int]:
    """One request through the engine protocol; (prompt + output, prefill tokens computed)."""
    cp = cache.lookup(prompt)
    start = cp.boundary if cp else 0
    seq = list(prompt)
    for bd in cache.plan(seq, start):
        cache.insert(seq, bd, None)
    for tok in out:
        seq.append(tok)
        if len(seq) % B == 0 and cache.want_decode_checkpoint(seq):
            cache.insert(seq, len(seq), None)
    cache.finish(seq)
    return seq, len(prompt) - start


def test_ours_learns_fork_depth_in_turn_boundaries_and_supersedes_the_left_branch() -> None:
    cache = PrefixCache(B, 64, "ours", on_evict=lambda cp: None)
    hist, prompts = toks(40), []
    for t in range(4):
        prompts.append((len(hist), hist + toks(50, 10 + t)))
        hist, _ = engine_turn(cache, prompts[-1][1], toks(70, 20 + t))
    old_tip = max(cache.checkpoints(), key=lambda c: c.boundary)
    hist, cost = engine_turn(cache, prompts[-1][1], toks(70, 30))       # regenerate the last turn
    assert cache._fork_depths[1] == 1                   # one turn boundary (its end) lay beyond
    assert cost < B and old_tip.superseded              # hit its prompt tail; the old output is left
    before, prompt = prompts[-1]
    hist, cost = engine_turn(cache, prompt[:before] + toks(50, 40), toks(70, 41))   # edit it
    assert cache._fork_depths[2] == 1                   # the prompt tail and the turn end lay beyond
    assert cost < 50 + B                                # hit the previous turn's end


def test_ours_keeps_recent_turn_boundaries_for_recent_forks() -> None:
    """More sessions than the budget holds fallbacks for, with forks that go back to the last turn:
    learning the fork depth (vs. a prior that never yields to the data) cuts the forks' prefill."""
    def branch_cost(prior_forks: float) -> int:
        cache = PrefixCache(B, 12, "ours", on_evict=lambda cp: None, prior_forks=prior_forks)
        rng = random.Random(0)
        sessions = [(toks(40, 100 + s), []) for s in range(4)]
        total = 0
        for step in range(160):
            s = step % 4
            hist, prompts = sessions[s]
            if len(prompts) >= 2 and rng.random() < 0.3:           # regenerate / edit the last turn
                before, prompt = prompts.pop()
                seq = prompt if rng.random() < 0.5 else prompt[:before] + toks(50, 7000 + step)
                seq, cost = engine_turn(cache, seq, toks(60, 9000 + step))
                total += cost
            else:
                before = len(hist)
                seq, _ = engine_turn(cache, hist + toks(50, 5000 + step), toks(60, 8000 + step))
            prompts.append((before, seq[:len(seq) - 60]))
            sessions[s] = (seq, prompts)
        return total
    learned, uniform = branch_cost(4.0), branch_cost(1e12)
    assert learned < 0.7 * uniform, (learned, uniform)
