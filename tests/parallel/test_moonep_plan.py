"""MoonEP planner: property tests over adversarial loads, checked by an independent checker.

The checker below re-derives every invariant from ``quota`` alone in plain Python (it does not
trust ``Plan.validate`` or any derived field); ``Plan.validate`` and the fixed-size tables are
checked on top. The brute-force test confirms the bound is tight on small instances.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimik3.parallel.moonep_plan import lower_bounds, plan, tight_instance

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def independent_check(loads: list[int], R: int, quota: torch.Tensor) -> dict[str, int]:
    """Every MoonEP invariant, from scratch. Returns max foreign experts per rank and replicas."""
    E = len(loads)
    m = E // R
    q = quota.tolist()
    assert quota.dtype == torch.int64 and list(quota.shape) == [E, R]
    C = sum(loads) // R
    foreign = [0] * R
    for e in range(E):
        assert all(x >= 0 for x in q[e]), f"negative quota for expert {e}"
        assert sum(q[e]) == loads[e], f"expert {e}: {sum(q[e])} != load {loads[e]}"
        for r in range(R):
            if q[e][r] > 0 and e // m != r:
                foreign[r] += 1
    for r in range(R):
        assert sum(q[e][r] for e in range(E)) == C, f"rank {r} computes {sum(q[e][r] for e in range(E))} != {C}"
        assert foreign[r] <= m, f"rank {r} hosts {foreign[r]} > E/R = {m} foreign experts"
    return {"max_foreign": max(foreign), "replicas": sum(foreign)}


def check_plan(loads: list[int], R: int) -> dict[str, int]:
    p = plan(torch.tensor(loads, dtype=torch.int64), R)
    got = independent_check(loads, R, p.quota)
    p.validate()
    assert int(p.max_foreign_per_rank) == got["max_foreign"] and int(p.total_replicas) == got["replicas"]
    assert int(p.capacity) * R == sum(loads)
    m = len(loads) // R
    q, fe, fq = p.quota.tolist(), p.foreign_experts.tolist(), p.foreign_quota.tolist()
    for r in range(R):
        want = [e for e in range(len(loads)) if e // m != r and q[e][r] > 0]
        assert fe[r] == want + [-1] * (m - len(want))
        assert fq[r] == [q[e][r] for e in want] + [0] * (m - len(want))
    lb = lower_bounds(torch.tensor(loads), R)
    assert lb["max_foreign"] <= got["max_foreign"] and lb["replicas"] <= got["replicas"]
    return got


def make_divisible(loads: list[int], R: int, fix: int) -> list[int]:
    loads = list(loads)
    loads[fix % len(loads)] += (-sum(loads)) % R
    return loads


# ---------------------------------------------------------------------- strategies
@st.composite
def shapes(draw, max_ranks: int = 12, max_per_rank: int = 8):
    R = draw(st.integers(1, max_ranks))
    m = draw(st.integers(1, max_per_rank))
    return R, m


@st.composite
def adversarial(draw):
    R, m = draw(shapes())
    E = R * m
    kind = draw(st.sampled_from(["uniform", "one_expert", "half_empty", "hot_rank", "zipf", "tiny", "spikes"]))
    big = draw(st.integers(0, 10_000))
    if kind == "uniform":
        loads = draw(st.lists(st.integers(0, big), min_size=E, max_size=E))
    elif kind == "one_expert":
        loads = [0] * E
        loads[draw(st.integers(0, E - 1))] = big * R
    elif kind == "half_empty":
        loads = draw(st.lists(st.integers(0, big), min_size=E, max_size=E))
        empty = draw(st.permutations(range(E)))[: E // 2]
        for e in empty:
            loads[e] = 0
    elif kind == "hot_rank":
        hot = draw(st.integers(0, R - 1))
        loads = draw(st.lists(st.integers(0, 3), min_size=E, max_size=E))
        for e in range(hot * m, hot * m + m):
            loads[e] = draw(st.integers(big // 2, big + 1))
    elif kind == "zipf":
        a = draw(st.floats(0.5, 3.0))
        perm = draw(st.permutations(range(E)))
        loads = [int(big / (1 + perm[e]) ** a) for e in range(E)]
    elif kind == "tiny":
        loads = draw(st.lists(st.integers(0, 2), min_size=E, max_size=E))
    else:  # a few huge spikes over noise
        loads = draw(st.lists(st.integers(0, 5), min_size=E, max_size=E))
        for _ in range(draw(st.integers(1, 3))):
            loads[draw(st.integers(0, E - 1))] += draw(st.integers(0, 100 * big + 1))
    return make_divisible(loads, R, draw(st.integers(0, E - 1))), R


@given(adversarial())
@SETTINGS
def test_invariants_adversarial(case):
    loads, R = case
    check_plan(loads, R)


@given(st.integers(1, 6), st.data())
@SETTINGS
def test_e_equals_r_and_single_rank(R, data):
    # m = 1: each rank owns one expert and has one redundant slot.
    loads = make_divisible(data.draw(st.lists(st.integers(0, 50), min_size=R, max_size=R)), R, 0)
    got = check_plan(loads, R)
    assert got["max_foreign"] <= 1
    # R = 1: everything is native, nothing moves.
    m = data.draw(st.integers(1, 6))
    loads1 = data.draw(st.lists(st.integers(0, 50), min_size=m, max_size=m))
    assert check_plan(loads1, 1) == {"max_foreign": 0, "replicas": 0}


def test_k3_shape_examples():
    gen = torch.Generator().manual_seed(0)
    R, E = 64, 896
    for a in (0.0, 1.0, 2.0):
        p = torch.randperm(E, generator=gen).double().add(1).pow(-a)
        loads = (p / p.sum() * R * 4096 * 16 * torch.rand(E, generator=gen)).long()
        loads[0] += (-int(loads.sum())) % R
        got = check_plan(loads.tolist(), R)
        assert got["max_foreign"] <= 14
    loads = [0] * E
    loads[500] = R * 1000
    assert check_plan(loads, R)["max_foreign"] == 1


def test_balanced_input_moves_nothing():
    loads = [3, 1, 2, 2, 0, 4, 1, 3]
    assert check_plan(loads, 4) == {"max_foreign": 0, "replicas": 0}


# ---------------------------------------------------------------------- tightness
@pytest.mark.parametrize("E,R", [(896, 64), (12, 4), (6, 3), (20, 5), (8, 2)])
def test_tight_instance_needs_the_bound(E, R):
    m = E // R
    loads = tight_instance(E, R)
    need = -(-(R - 1) * m // R)                 # ceil(m (R-1) / R): = m when R > m
    lb = lower_bounds(loads, R)
    assert lb["max_foreign"] == need            # no plan can do better ...
    got = check_plan(loads.tolist(), R)
    assert got["max_foreign"] == need           # ... and the planner meets it
    if R > m:
        assert need == m                        # the E/R bound is exactly tight here


def _best_possible_max_foreign(loads: list[int], R: int) -> int:
    """Brute force over all integer plans (tiny instances only)."""
    E, m, C = len(loads), len(loads) // R, sum(loads) // R
    best = [m + 1]

    def rows(e):  # all splits of loads[e] over R ranks
        for cut in itertools.combinations_with_replacement(range(loads[e] + 1), R - 1):
            bounds = (0, *cut, loads[e])
            yield [bounds[i + 1] - bounds[i] for i in range(R)]

    def go(e, col, foreign):
        if max(foreign) >= best[0] or any(c > C for c in col):
            return
        if e == E:
            best[0] = max(foreign)
            return
        for row in rows(e):
            go(e + 1, [c + x for c, x in zip(col, row)],
               [f + (1 if x > 0 and e // m != r else 0) for r, (f, x) in enumerate(zip(foreign, row))])

    go(0, [0] * R, [0] * R)
    return best[0]


def test_brute_force_small_instances_agree_with_bound():
    # R=3, m=2: the tight instance needs ceil(2*2/3) = 2 = m; brute force confirms 1 slot is not enough.
    loads = tight_instance(6, 3).tolist()
    assert _best_possible_max_foreign(loads, 3) == 2 == check_plan(loads, 3)["max_foreign"]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        loads = torch.randint(0, 4, (4,), generator=gen).tolist()
        loads = make_divisible(loads, 2, 0)
        best = _best_possible_max_foreign(loads, 2)
        assert check_plan(loads, 2)["max_foreign"] <= 2 and best <= 2


# ---------------------------------------------------------------------- split by source
@given(adversarial(), st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_split_by_source(case, data):
    loads, R = case
    E = len(loads)
    # random split of every expert's load over source ranks
    counts = torch.zeros(R, E, dtype=torch.int64)
    for e in range(E):
        cuts = sorted(data.draw(st.lists(st.integers(0, loads[e]), min_size=R - 1, max_size=R - 1)))
        b = [0, *cuts, loads[e]]
        counts[:, e] = torch.tensor([b[i + 1] - b[i] for i in range(R)])
    p = plan(torch.tensor(loads), R)
    s = p.split_by_source(counts)
    assert torch.equal(s.sum(2), counts) and torch.equal(s.sum(0), p.quota)
    assert bool((p.send_counts(counts).sum(0) == p.capacity).all())


def test_owner_to_host():
    loads = [10, 0, 0, 0, 0, 0, 0, 2]
    p = plan(torch.tensor(loads), 4)
    o2h = p.owner_to_host
    assert int(o2h.sum()) == 12 and o2h[0].sum() == 10 and bool((o2h.sum(0) == 3).all())


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "loads,R,match",
    [
        (torch.tensor([1, 2, 3]), 2, "do not split evenly"),
        (torch.tensor([1, 2, 3, 1]), 2, "not divisible"),
        (torch.tensor([1, -1, 3, 1]), 2, "non-negative"),
        (torch.tensor([1.0, 1.0]), 2, "integer"),
        (torch.tensor([True, False]), 2, "integer"),
        (torch.tensor([[1, 1], [1, 1]]), 2, "1-D"),
        (torch.tensor([], dtype=torch.int64), 1, "1-D"),
        (torch.tensor([1, 1]), 0, "positive int"),
        (torch.tensor([1, 1]), 2.0, "positive int"),
    ],
)
def test_errors(loads, R, match):
    with pytest.raises(ValueError, match=match):
        plan(loads, R)


def test_not_a_tensor():
    with pytest.raises(TypeError):
        plan([1, 1], 2)


def test_int32_and_check_false():
    loads = torch.tensor([5, 0, 0, 3], dtype=torch.int32)
    p = plan(loads, 2, check=False)
    independent_check(loads.tolist(), 2, p.quota)
