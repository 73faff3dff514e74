"""Does RL learn? Greedy test accuracy of an SFT run against the same run after `kimik3 rl`, over RL seeds.

    python benchmarks/rl_learns.py --run runs/sft-easy --domain general --effort low --difficulty easy \\
        --seeds 0 1 2 --iterations 20 --n 40

Every model (the SFT start and each RL seed's result) is scored on the same ``--n`` test tasks (test seed 0),
greedily, so the comparison is paired: a task the start gets wrong and RL gets right counts for RL, one the
start gets right and RL wrong against. Reported per model: accuracy with Wilson's 95% interval; per RL seed:
the paired difference with a 95% interval (normal approximation on the per-task differences), and the same
pooled over the seeds. With ``--samples K`` each model is also scored by K completions per test task at the
rollout temperature (each task's mean, paired the same way): the expected reward RL optimises, which can move
where the greedy answer does not. Writes ``--out`` (JSON) with every figure and the RL runs' directories.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path


def paired_difference(after: list[float], before: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean of after - before over the same tasks, with a normal-approximation interval on the differences."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(1, n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def accuracy_line(name: str, scores: list[float], width: int = 14) -> str:
    """``name``, the mean score and its Wilson 95% interval, in one aligned line."""
    from kimik3.posttrain.evaluate import confidence_interval

    low, high = confidence_interval(scores)
    return f"{name:<{width}} {sum(scores) / len(scores):6.3f}  [{low:.3f}, {high:.3f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="the SFT run RL starts from")
    parser.add_argument("--domain", default="general")
    parser.add_argument("--effort", default="low")
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (prompts and sampling)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    parser.add_argument("--balance", default="none", choices=["quantile", "sign", "none"],
                        help="router-bias balancing during the updates")
    parser.add_argument("--minibatches", type=int, default=2, help="optimizer steps per pass over the rows")
    parser.add_argument("--epochs", type=int, default=1, help="passes over an iteration's rows")
    parser.add_argument("--prompt-pool", type=int, help="train on a fixed set of this many train prompts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (rollouts, updates and evaluation)")
    parser.add_argument("--n", type=int, default=40, help="test tasks (the same for every model)")
    parser.add_argument("--samples", type=int, default=0,
                        help="also score each model by this many completions per test task at --temperature")
    parser.add_argument("--work", help="where the RL runs go (default: a temporary directory, removed)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args(argv)

    from kimik3.posttrain.evaluate import evaluate
    from kimik3.posttrain.rl import run_rl

    def score(run: Path) -> list[float]:
        return evaluate(run, args.domain, args.effort, args.n, seed=0, difficulty=args.difficulty,
                        device=args.device).scores

    def sampled(run: Path) -> list[float]:
        return evaluate(run, args.domain, args.effort, args.n, seed=0, temperature=args.temperature,
                        difficulty=args.difficulty, device=args.device, samples=args.samples).scores

    line = accuracy_line
    cell = f"{args.domain}/{args.effort} ({args.difficulty})"
    start = score(Path(args.run))
    print(f"{cell}, {args.n} test tasks, greedy", flush=True)
    print(line("SFT start", start), flush=True)
    start_sampled = sampled(Path(args.run)) if args.samples else None
    if start_sampled is not None:
        print(line(f"  sampled x{args.samples}", start_sampled) + f"  at T {args.temperature}", flush=True)
    results: dict = {"cell": cell, "run": args.run, "n": args.n, "start": start, "start_sampled": start_sampled,
                     "rl": {},
                     "settings": {k: getattr(args, k) for k in ("iterations", "prompts", "group", "lr", "temperature",
                                                                "balance", "minibatches", "epochs", "prompt_pool")}}
    with (contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory()) as work_dir:
        work = Path(work_dir)
        pooled_after: list[float] = []
        for seed in args.seeds:
            out = work / f"rl-{args.domain}-{args.difficulty}-seed{seed}"
            began = time.perf_counter()
            records = run_rl(args.run, domain=args.domain, effort=args.effort, difficulty=args.difficulty,
                             iterations=args.iterations, group=args.group, prompts=args.prompts, lr=args.lr,
                             temperature=args.temperature, balance=args.balance, minibatches=args.minibatches,
                             epochs=args.epochs, prompt_pool=args.prompt_pool, device=args.device,
                             out=out, seed=seed, progress=False, log=lambda _: None)
            wall = time.perf_counter() - began
            after = score(out)
            pooled_after += after
            diff = paired_difference(after, start)
            rewards = [r["reward_mean"] for r in records]
            rate = sorted(r["rollout_tokens_per_s"] for r in records)[len(records) // 2]
            first5, last5 = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
            print(line(f"RL seed {seed}", after) + f"  paired gain {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]"
                  f"  train reward (mean of 5 iterations) {first5:.2f} first -> {last5:.2f} last, {wall:.0f} s, "
                  f"rollouts {rate:.0f} tok/s",
                  flush=True)
            results["rl"][seed] = {"scores": after, "gain": diff, "rewards": rewards, "wall_s": wall,
                                   "rollout_tokens_per_s_median": rate, "dir": str(out) if args.work else None}
            if start_sampled is not None:
                after_sampled = sampled(out)
                gain = paired_difference(after_sampled, start_sampled)
                print(line(f"  sampled x{args.samples}", after_sampled) + f"  paired gain {gain[0]:+.3f} "
                      f"[{gain[1]:+.3f}, {gain[2]:+.3f}]", flush=True)
                results["rl"][seed].update(sampled=after_sampled, sampled_gain=gain)
        pooled = paired_difference(pooled_after, start * len(args.seeds))
        print(line("RL pooled", pooled_after) + f"  paired gain {pooled[0]:+.3f} [{pooled[1]:+.3f}, {pooled[2]:+.3f}]"
              f" over {len(args.seeds)} seeds", flush=True)
        results["pooled_gain"] = pooled
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
