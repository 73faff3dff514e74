"""MoonEP vs no balancing vs DeepSeek's EPLB: max/mean tokens per EP rank, replicas, planner latency.

Legend: E = experts, R = EP ranks, m = E/R, K = experts per token, S = tokens per rank,
C = S×K = token-expert rows every rank computes under perfect balance.

Policies, scored per step on that step's loads (max rank load / mean rank load):
  none         every expert on its owner (rank e // m).
  EPLB         DeepSeek's published global policy with the same redundancy as MoonEP (m redundant
               slots per rank, 2E physical slots in all): repeatedly give one more replica to the
               expert with the largest load per replica, then pack replicas heaviest first onto the
               least-loaded rank that still has a free slot (2m slots per rank). An expert's
               tokens split evenly over its replicas. "same-step" plans on the step's own loads
               (an oracle: real EPLB plans on past statistics); "stale" on the previous step's.
               EPLB places experts anywhere (it ignores owners), so its "foreign" count is every
               physical expert not on its owner.
  MoonEP       kimik3.parallel.moonep_plan.plan on the step's loads: max/mean is 1 by construction
               (checked). Reported also: most foreign experts on one rank (bound m) and total
               replicas, next to plan-independent lower bounds (``lower_bounds``).

Traces:
  synthetic    E=896, K=16, S=4096: per-step expert probabilities p ∝ exp(-a·log(rank) + w_t), with a
               random expert ranking, zipf exponent a, and w_t a Gaussian random walk (drift per step
               sigma); probabilities capped at 1/K (a token picks K distinct experts); loads drawn
               multinomially with R·S·K rows.
  tiny-tiled   real routing: kimik3's trainer trains the ``tiny`` preset (16 experts, top-2, 8 MoE
               routers: 8 MoE layers + the MTP module's) for --real-steps steps with
               --real-balance (default none: the router's own skew), reading every router's
               loads from each training forward's ``K3Output.routing``. E=896 is built by
               tiling: step t's vector concatenates 56 real 16-expert load vectors (56 of the 9
               routers x 7 consecutive steps, in a fixed shuffled order), each rescaled to the same
               share of R·S·K rows. Skew within a 16-expert tile is real; tiles are independent of
               each other (not a real 896-expert router), which is said in the table.

Usage:
    python benchmarks/moonep.py                          # synthetic + tiny-tiled, R in {16, 64}
    python benchmarks/moonep.py --no-real                # synthetic only (fast)
    python benchmarks/moonep.py --json out.json
    python benchmarks/moonep.py --latency                # plan() latency at E=896, R=64 (CUDA events on a GPU)
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kimik3.parallel.moonep_plan import lower_bounds, plan


# ---------------------------------------------------------------------- EPLB (from its published description)
def eplb_place(loads: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (replica_count[E], rank_of_slot list as [num_phy] expert ids and ranks)."""
    E = loads.size
    m = E // R
    num_phy = 2 * E
    cnt = np.ones(E, dtype=np.int64)
    heap = [(-float(loads[e]), e) for e in range(E)]
    heapq.heapify(heap)
    phy = list(range(E))
    for _ in range(num_phy - E):
        _, e = heapq.heappop(heap)
        phy.append(e)
        cnt[e] += 1
        heapq.heappush(heap, (-float(loads[e]) / cnt[e], e))
    phy = np.array(phy)
    w = loads[phy] / cnt[phy]
    order = np.argsort(-w, kind="stable")
    per_rank = num_phy // R  # 2m
    packs = [(0.0, r) for r in range(R)]
    heapq.heapify(packs)
    items = np.zeros(R, dtype=np.int64)
    rank_of = np.empty(num_phy, dtype=np.int64)
    for i in order:
        load, r = heapq.heappop(packs)
        rank_of[i] = r
        items[r] += 1
        if items[r] < per_rank:
            heapq.heappush(packs, (load + w[i], r))
    assert m * 2 == per_rank
    return phy, rank_of, cnt


def eplb_rank_loads(phy: np.ndarray, rank_of: np.ndarray, cnt: np.ndarray, loads: np.ndarray, R: int) -> np.ndarray:
    return np.bincount(rank_of, weights=loads[phy] / cnt[phy], minlength=R)


def eplb_foreign(phy: np.ndarray, rank_of: np.ndarray, E: int, R: int) -> tuple[int, int]:
    m = E // R
    foreign = phy // m != rank_of
    per_rank = np.bincount(rank_of[foreign], minlength=R)
    return int(per_rank.max()), int(foreign.sum())


# ---------------------------------------------------------------------- traces
def cap_probs(p: np.ndarray, cap: float) -> np.ndarray:
    for _ in range(50):
        over = p > cap
        if not over.any():
            break
        excess = (p[over] - cap).sum()
        p = np.where(over, cap, p)
        free = ~over & (p < cap)
        p[free] += excess * p[free] / p[free].sum()
    return p / p.sum()


def synthetic_trace(E: int, R: int, K: int, S: int, a: float, drift: float, steps: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    ranking = rng.permutation(E) + 1
    base = -a * np.log(ranking)
    walk = np.zeros(E)
    total = R * S * K
    out = []
    for _ in range(steps):
        walk = walk + drift * rng.standard_normal(E)
        logits = base + walk
        p = np.exp(logits - logits.max())
        p = cap_probs(p / p.sum(), 1.0 / K)
        out.append(rng.multinomial(total, p).astype(np.int64))
    return out


def record_tiny_loads(steps: int, balance: str, seed: int) -> list[list[np.ndarray]]:
    """[step][layer] -> loads [16] from kimik3's trainer on the tiny preset."""
    from kimik3.train.trainer import TrainArgs, Trainer

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainArgs(preset="tiny", steps=steps, out=str(Path(tmp) / "run"), balance=balance, progress=False,
                         eval_every=10 * steps, checkpoint_every=10 * steps, seed=seed)
        trainer = Trainer(args, log=lambda _: None)
        history: list[list[np.ndarray]] = []
        outputs = []
        forward = trainer.model.forward

        def keep_output(*a, **k):
            out = forward(*a, **k)
            if trainer.model.training:
                outputs.append(out)   # the call attaches its routing statistics to this very object
            return out

        trainer.model.forward = keep_output

        def on_step(_record):
            history.append([s.loads_E.cpu().numpy().copy() for s in outputs[-1].routing if s is not None])
            outputs.clear()

        trainer.run(on_step=on_step)
    return history


def tile_trace(history: list[list[np.ndarray]], E: int, R: int, K: int, S: int, seed: int) -> list[np.ndarray]:
    e_small = history[0][0].size
    tiles = E // e_small
    layers = len(history[0])
    span = math.ceil(tiles / layers)                     # consecutive steps per tiled vector
    rng = np.random.default_rng(seed)
    slots = [(dt, layer) for dt in range(span) for layer in range(layers)][:tiles]
    perm = rng.permutation(len(slots))
    slots = [slots[i] for i in perm]
    total = R * S * K
    share = total // tiles
    out = []
    for t in range(len(history) - span + 1):
        parts = []
        for dt, layer in slots:
            v = history[t + dt][layer].astype(np.float64)
            scaled = np.floor(v / v.sum() * share).astype(np.int64)
            scaled[np.argmax(v)] += share - scaled.sum()
            parts.append(scaled)
        vec = np.concatenate(parts)
        vec[0] += total - vec.sum()
        out.append(vec)
    return out


# ---------------------------------------------------------------------- scoring
def score(trace: list[np.ndarray], R: int) -> dict:
    E = trace[0].size
    m = E // R
    rows = {k: [] for k in ("none", "eplb_same", "eplb_stale", "moonep", "moon_maxf", "moon_rep", "lb_maxf", "lb_rep",
                            "eplb_maxf", "eplb_rep")}
    prev = None
    for loads in trace:
        C = loads.sum() / R
        rows["none"].append(loads.reshape(R, m).sum(1).max() / C)
        phy, rank_of, cnt = eplb_place(loads, R)
        rows["eplb_same"].append(eplb_rank_loads(phy, rank_of, cnt, loads, R).max() / C)
        mf, rep = eplb_foreign(phy, rank_of, E, R)
        rows["eplb_maxf"].append(mf)
        rows["eplb_rep"].append(rep)
        if prev is not None:
            rows["eplb_stale"].append(eplb_rank_loads(*prev, loads, R).max() / C)
        prev = (phy, rank_of, cnt)
        t = torch.from_numpy(loads)
        p = plan(t, R)
        rank_load = p.rank_load
        rows["moonep"].append(float(rank_load.max()) / float(rank_load.double().mean()))
        rows["moon_maxf"].append(int(p.max_foreign_per_rank))
        rows["moon_rep"].append(int(p.total_replicas))
        lb = lower_bounds(t, R)
        rows["lb_maxf"].append(lb["max_foreign"])
        rows["lb_rep"].append(lb["replicas"])
    return {k: (statistics.mean(v) if v else math.nan) for k, v in rows.items()} | {
        "moon_maxf_max": max(rows["moon_maxf"]), "steps": len(trace), "m": m}


def run_imbalance(args) -> list[dict]:
    E, K, S = 896, 16, args.tokens_per_rank
    results = []
    traces: list[tuple[str, list[np.ndarray] | None, dict]] = []
    for R in args.ranks:
        for a in args.zipf:
            traces.append((f"zipf a={a}, drift {args.drift}", None, {"R": R, "a": a}))
    for name, _, cfg in traces:
        trace = synthetic_trace(E, cfg["R"], K, S, cfg["a"], args.drift, args.steps, args.seed)
        results.append({"trace": name, "R": cfg["R"]} | score(trace, cfg["R"]))
        print(f"  done {name} R={cfg['R']}", file=sys.stderr)
    if args.real:
        started = time.perf_counter()
        history = record_tiny_loads(args.real_steps, args.real_balance, args.seed)
        small = np.stack([np.stack(h) for h in history]).astype(np.float64)   # [steps, layers, 16]
        tiny_imb = float(np.mean(small.max(-1) / small.mean(-1)))
        print(f"  recorded {len(history)} steps x {len(history[0])} routers in {time.perf_counter() - started:.0f}s "
              f"(tiny per-router max/mean expert load {tiny_imb:.2f})", file=sys.stderr)
        for R in args.ranks:
            trace = tile_trace(history, E, R, K, S, args.seed)
            results.append({"trace": f"tiny-tiled ({args.real_balance} balancing, {len(history)} steps)", "R": R}
                           | score(trace, R))
    return results


def print_table(results: list[dict]) -> None:
    print("| trace | R | steps | none | EPLB same-step | EPLB stale | MoonEP | MoonEP max foreign/rank (mean, worst; bound E/R) "
          "| LB max foreign | MoonEP replicas | LB replicas | EPLB off-owner experts (max/rank, total) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['trace']} | {r['R']} | {r['steps']} | {r['none']:.3f} | {r['eplb_same']:.3f} | {r['eplb_stale']:.3f} "
              f"| {r['moonep']:.3f} | {r['moon_maxf']:.1f}, {r['moon_maxf_max']} (≤ {r['m']}) | {r['lb_maxf']:.1f} "
              f"| {r['moon_rep']:.1f} | {r['lb_rep']:.1f} | {r['eplb_maxf']:.1f}, {r['eplb_rep']:.0f} |")


# ---------------------------------------------------------------------- latency
def run_latency(args) -> dict:
    E, R = 896, 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    trace = synthetic_trace(E, R, 16, args.tokens_per_rank, 1.0, args.drift, 8, args.seed)
    loads = [torch.from_numpy(t).to(device) for t in trace]
    for t in loads:
        plan(t, R).validate()  # correctness on this device first
    iters = args.latency_iters
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")      # any host sync inside plan() raises
        try:
            for _ in range(10):
                plan(loads[0], R, check=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            plan(loads[i % len(loads)], R, check=False)
        end.record()
        torch.cuda.synchronize()
        eager_ms = start.elapsed_time(end) / iters
        # CUDA graph of one plan (what a static-shape training step would capture)
        static = loads[0].clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                plan(static, R, check=False)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = plan(static, R, check=False)
        start.record()
        for i in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / iters
        static.copy_(loads[1])
        graph.replay()
        assert torch.equal(out.quota, plan(loads[1], R).quota)
        res = {"device": torch.cuda.get_device_name(), "eager_ms": eager_ms, "graph_ms": graph_ms,
               "host_sync_free": True}
    else:
        for _ in range(5):
            plan(loads[0], R, check=False)
        t0 = time.perf_counter()
        for i in range(iters):
            plan(loads[i % len(loads)], R, check=False)
        res = {"device": "cpu", "eager_ms": (time.perf_counter() - t0) * 1e3 / iters, "graph_ms": None,
               "threads": torch.get_num_threads()}
    print(f"\nplan() latency, E={E} R={R}, {iters} calls, device {res['device']}: eager {res['eager_ms']:.3f} ms"
          + (f", CUDA graph replay {res['graph_ms']:.3f} ms; no host sync (sync debug mode 'error')"
             if res["graph_ms"] is not None else ""))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.6, 1.0, 1.4])
    ap.add_argument("--drift", type=float, default=0.1, help="random-walk std of expert logits per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens-per-rank", type=int, default=4096, help="S")
    ap.add_argument("--no-real", dest="real", action="store_false", help="skip the tiny-training traces")
    ap.add_argument("--real-steps", type=int, default=30)
    ap.add_argument("--real-balance", default="none", choices=["none", "quantile", "sign"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency", action="store_true", help="time plan() at E=896, R=64 instead")
    ap.add_argument("--latency-iters", type=int, default=200)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: shared small CPUs oversubscribe badly)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.latency:
        out = {"latency": run_latency(args)}
    else:
        results = run_imbalance(args)
        print_table(results)
        out = {"imbalance": results, "args": vars(args)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float))


if __name__ == "__main__":
    main()
