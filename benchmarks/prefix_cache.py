"""KDA prefix-cache policies replayed on one multi-turn agent workload (notes §9).

Claim checked: choosing where to put KDA checkpoints and which to keep ("ours") saves nearly as
much prefill as an unbounded checkpoint-everything oracle, and much more than vLLM 0.33's
prompt-tail LRU policy, at budgets of 32-128 checkpoints (one K3 checkpoint ~ 0.434 GB).

Workload (fixed before the policy was tuned; all of it from --seed): one shared system prompt;
``--sessions`` agent sessions, ``--live`` of them in flight at once, each step running one turn of a
uniformly random live session (a finished session is replaced by a new one while any remain).
A session has U[turns] turns; turn t's prompt = system + history + a new user/tool message of
U[msg] tokens, and it generates U[out] tokens, which join the history. From the third turn on,
with probability --branch a turn instead goes back to an earlier turn k (--fork-depth recent, the
default: the last turn half the time, the one before a quarter, ...; uniform: any earlier turn): half
the time it *edits* k (history cut to before k's message, a new message), half the time it
*regenerates* k (history cut to k's prompt, a new output); the session continues from there.
Token ids are uniform random, so distinct messages never share a hash block by accident.

Simulated engine, per cache, exactly the real engine's call order: ``lookup`` (acquire/release
around the restore) -> ``plan`` -> ``insert`` at each planned boundary -> during decode, at each
multiple of hash_block of the processed length (prompt + generated - 1, the last token is never
fed back), ``want_decode_checkpoint`` -> ``insert`` -> ``finish``. Payloads are integers; the
engine checks every payload is freed exactly once (on_evict, or a None/other return of insert).
All caches run in lockstep on the same token lists and share one BlockHasher, so each prompt is
hashed once, not once per policy.

Usage:
    python benchmarks/prefix_cache.py                 # full scale, ~10 s on one CPU core
    python benchmarks/prefix_cache.py --small         # the scaled-down case tests/serve runs
    python benchmarks/prefix_cache.py --seed 1 --live 48 --json out.json
    python benchmarks/prefix_cache.py --branch 0      # no forks: isolates the live-session budget
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kimik3.serve.prefix_cache import BlockHasher, Checkpoint, PrefixCache  # noqa: E402

GB_PER_CHECKPOINT = 0.434
VOCAB = 163_840


@dataclass
class Workload:
    seed: int = 0
    sessions: int = 64
    live: int = 32
    hash_block: int = 512
    physical_block: int = 6144
    system: int = 6000
    turns: tuple[int, int] = (10, 50)
    msg: tuple[int, int] = (100, 2500)
    out: tuple[int, int] = (300, 2000)
    branch: float = 0.10
    fork_depth: str = "recent"         # "recent": geometric over recency (p=1/2); "uniform": any earlier turn
    budgets: tuple[int, ...] = (32, 64, 128)


SMALL = dict(sessions=12, live=6, hash_block=16, physical_block=192, system=200, turns=(5, 12),
             msg=(10, 80), out=(10, 60), budgets=(6, 12))


class SimEngine:
    """The engine's side of the protocol, with payload bookkeeping and the counters we report."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        cache.on_evict = self._free
        self.live: set[int] = set()
        self._ids = itertools.count()
        self.prompt_tokens = self.computed = self.requests = 0
        self.by_kind: dict[str, int] = {"first": 0, "next": 0, "branch": 0}   # prefill tokens per turn kind

    def _free(self, cp: Checkpoint) -> None:
        self.live.remove(cp.payload)          # KeyError = double free

    def _snapshot(self, seq: list[int], b: int) -> None:
        payload = next(self._ids)
        self.live.add(payload)
        got = self.cache.insert(seq, b, payload)
        if got is None or got.payload != payload:
            self.live.remove(payload)

    def prefill(self, seq: list[int], hints: list[int], kind: str) -> None:
        cp = self.cache.lookup(seq)
        start = 0
        if cp is not None:
            self.cache.acquire(cp)            # copy-on-write restore of the KDA snapshot
            start = cp.boundary
            self.cache.release(cp)
        for b in self.cache.plan(seq, start, hints):
            self._snapshot(seq, b)
        self.requests += 1
        self.prompt_tokens += len(seq)
        self.computed += len(seq) - start
        self.by_kind[kind] += len(seq) - start

    def decode_boundary(self, seq: list[int]) -> None:
        if self.cache.want_decode_checkpoint(seq):
            self._snapshot(seq, len(seq))

    def check(self) -> None:
        held = {cp.payload for cp in self.cache.checkpoints()}
        assert held == self.live, f"payload leak: {len(self.live - held)} live but not held"


def run(w: Workload, progress: bool = False) -> dict:
    """Replay the workload through every (policy, budget) in lockstep; return params + rows."""
    B = w.hash_block
    hasher = BlockHasher(B)
    configs = [("none", None)] + [(p, c) for p in ("coarse", "vllm", "ours") for c in w.budgets] \
        + [("oracle", None)]
    engines = [SimEngine(PrefixCache(B, c, p, physical_block=w.physical_block, hasher=hasher))
               for p, c in configs]
    rng = np.random.default_rng(w.seed)
    toks = lambda n: rng.integers(0, VOCAB, n).tolist()  # noqa: E731
    system = toks(w.system)

    def new_session() -> dict:
        return dict(hist=system, ends=[w.system], turns_left=int(rng.integers(w.turns[0], w.turns[1] + 1)),
                    prompts=[])                # prompts[k] = (len of history before msg k, prompt len)

    started = min(w.live, w.sessions)
    live = [new_session() for _ in range(started)]
    total = sum(s["turns_left"] for s in live)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(desc="requests", unit="req", leave=False)
    n_branch = 0
    while live:
        i = int(rng.integers(len(live)))
        s = live[i]
        hist, ends = s["hist"], s["ends"]
        regen = False
        kind = "next" if s["prompts"] else "first"
        if len(s["prompts"]) >= 2 and rng.random() < w.branch:
            n_branch += 1
            kind = "branch"
            if w.fork_depth == "uniform":
                k = int(rng.integers(len(s["prompts"])))
            else:   # the last turn half the time, the one before a quarter, ...
                k = max(0, len(s["prompts"]) - int(rng.geometric(0.5)))
            before, plen = s["prompts"][k]
            regen = bool(rng.random() < 0.5)
            cut = plen if regen else before
            hist, ends = hist[:cut], [e for e in ends if e <= cut]
            s["prompts"] = s["prompts"][:k + (1 if regen else 0)]
        if regen:
            seq = list(hist)
        else:
            seq = hist + toks(int(rng.integers(w.msg[0], w.msg[1] + 1)))
            ends = ends + [len(seq)]
            s["prompts"].append((len(hist), len(seq)))
        for e in engines:
            e.prefill(seq, ends, kind)
        out = toks(int(rng.integers(w.out[0], w.out[1] + 1)))
        plen = len(seq)
        last = plen + len(out) - 1                    # processed length when decode ends
        for m in range((plen // B + 1) * B, last + 1, B):
            seq.extend(out[len(seq) - plen:m - plen])
            for e in engines:
                e.decode_boundary(seq)
        seq.extend(out[len(seq) - plen:])
        for e in engines:
            e.cache.finish(seq)
        hasher.forget(seq)                            # the shared hasher is ours to clean up
        s["hist"], s["ends"] = seq, ends + [len(seq)]
        s["turns_left"] -= 1
        if s["turns_left"] == 0:
            if started < w.sessions:
                live[i] = new_session()
                started += 1
                total += live[i]["turns_left"]
            else:
                live.pop(i)
        if bar is not None:
            bar.total = total
            bar.update(1)
    if bar is not None:
        bar.close()

    rows = []
    for (policy, cap), e in zip(configs, engines):
        e.check()
        st = e.cache.stats
        rows.append(dict(policy=policy, budget=cap, gb=None if cap is None else round(cap * GB_PER_CHECKPOINT, 1),
                         prefill_tokens=e.computed, token_hit=1 - e.computed / e.prompt_tokens,
                         request_hit=st.hits / max(st.queries, 1), inserts=st.inserts,
                         evictions=st.evictions, held=len(e.cache), prefill_by_kind=dict(e.by_kind)))
    params = asdict(w) | dict(requests=engines[0].requests, branches=n_branch,
                              prompt_tokens=engines[0].prompt_tokens)
    return dict(params=params, rows=rows, ratios=ratios(rows, w.budgets))


def ratios(rows: list[dict], budgets: tuple[int, ...]) -> dict:
    get = {(r["policy"], r["budget"]): r["prefill_tokens"] for r in rows}
    oracle = get[("oracle", None)]
    return {str(c): dict(ours_over_oracle=get[("ours", c)] / oracle,
                         ours_over_vllm=get[("ours", c)] / get[("vllm", c)]) for c in budgets}


def table(res: dict) -> str:
    lines = ["| policy | budget (ckpts / GB) | prefill tokens | token hit | request hit | inserted | evicted | held |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        budget = "unbounded" if r["budget"] is None else f"{r['budget']} / {r['gb']}"
        lines.append(f"| {r['policy']} | {budget} | {r['prefill_tokens']:,} | {r['token_hit']:.1%} | "
                     f"{r['request_hit']:.1%} | {r['inserts']:,} | {r['evictions']:,} | {r['held']} |")
    lines += ["", "| budget | ours / oracle prefill | ours / vllm prefill |", "|---|---|---|"]
    for c, r in res["ratios"].items():
        lines.append(f"| {c} | {r['ours_over_oracle']:.3f} | {r['ours_over_vllm']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int)
    ap.add_argument("--live", type=int)
    ap.add_argument("--budgets", type=lambda s: tuple(int(x) for x in s.split(",")), help="e.g. 32,64,128")
    ap.add_argument("--branch", type=float, help="share of turns that fork an earlier turn (default 0.10)")
    ap.add_argument("--fork-depth", choices=["recent", "uniform"],
                    help="which earlier turn a fork goes back to (default recent: geometric over recency)")
    ap.add_argument("--small", action="store_true", help="scaled-down workload (hash_block 16) for tests")
    ap.add_argument("--json", type=Path, help="write params, rows and ratios here")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    kw: dict = dict(SMALL) if a.small else {}
    kw["seed"] = a.seed
    for name in ("sessions", "live", "budgets", "branch", "fork_depth"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    w = Workload(**kw)
    if w.sessions < 1 or w.live < 1 or not w.budgets or min(w.budgets) < 1 or not 0 <= w.branch <= 1:
        ap.error("--sessions, --live and every budget must be >= 1, --branch in [0, 1]")
    res = run(w, progress=not (a.small or a.quiet))
    if not a.quiet:
        p = res["params"]
        print("workload: " + ", ".join(f"{k}={v}" for k, v in p.items()))
        print(table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
