"""Partial rollouts: RL iteration wall time at --partial-lambda λ against waiting for every trajectory (λ = 1),
with a long-tailed output-length distribution, and the reward against iterations (same seeds).

    python benchmarks/partial_rollouts.py --run RUN [--seed S] [--device cuda]

(RUN: an SFT run, e.g. ``kimik3 train`` then ``kimik3 sft --steps 30``; the defaults are BENCHMARKS.md's settings:
24 iterations of 8 prompts x 4, lengths Pareto with shape 0.6 capped at 1,024, λ = 1 against 0.7.)

Both settings run in one process, their iterations interleaved (one at a time: a baton passes between the two
``run_rl`` loops after every iteration), so the load of a shared machine weighs on both alike. The means leave out
each setting's first iteration (kernel compilation and the engine's graph captures).

**The long tail** is imposed, because the tiny model's own lengths are not long-tailed (it ends most turns within
a few dozen tokens): each trajectory's turn is exactly ``min(cap, ceil(min_tokens * U^(-1/alpha)))`` tokens long,
a Pareto law with U a hash of (iteration, index) (the same lengths in both settings). The turn's budget is that
length and the engine's ``min_tokens`` holds its end tokens back until then, so every trajectory runs its whole
budget. The end tokens' probability is masked out of the distribution sampled from (as vLLM's ``min_tokens``
does), so the rollouts record each token's log-probability under the unmasked policy (``logprobs_mode="raw"``,
at RL's default temperature 1): the update's importance ratios then measure only how far the policy moved since
the token was sampled, which is what the staleness correction is for, not the imposed mask.

**The reward is a proxy**: the share of digits among the completion's characters, a signal the learner can move
at tiny scale, where the tasks' verifiers score every completion 0 (docs/posttraining.md), and that does not
depend on the imposed lengths. It is not a task score. An iteration's ``reward_mean`` is over the groups it
trained, which under partial rollouts were sampled over several earlier iterations, so it lags the policy; every
``--eval-every`` iterations (outside the timed iteration) each setting's current policy also samples the same
held-out prompts afresh, at their own lengths: ``fresh_reward``, the policies compared at equal steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch


HELD_OUT_ITERATION = 1_000_000   # the fresh-sample reward's prompts: an iteration no run reaches


def budget_of(step: int, index: int, min_tokens: int, alpha: float, cap: int) -> int:
    """A Pareto-distributed per-turn budget, a pure function of (iteration, index)."""
    digest = hashlib.sha256(f"{step}:{index}".encode()).digest()
    u = (int.from_bytes(digest[:8], "little") + 0.5) / 2 ** 64
    return int(min(cap, math.ceil(min_tokens * u ** (-1.0 / alpha))))


def digit_share(text: str) -> float:
    """The proxy reward: the fraction of ``text``'s characters that are decimal digits (0 for an empty text)."""
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="an SFT (or base) run")
    p.add_argument("--iterations", type=int, default=24)
    p.add_argument("--lambdas", type=float, nargs=2, default=[1.0, 0.7], metavar=("BASE", "PARTIAL"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=8, help="the Pareto budget's scale")
    p.add_argument("--alpha", type=float, default=0.6, help="the Pareto budget's shape (smaller: longer tail)")
    p.add_argument("--cap", type=int, default=1024, help="the largest budget (the max effort's reasoning budget)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--stale-coef", type=float, default=0.1, help="kimik3 rl --stale-coef (the stale regulariser)")
    p.add_argument("--stale-limit", type=int, help="kimik3 rl --stale-limit (versions; default none)")
    p.add_argument("--eval-every", type=int, default=4, help="iterations between fresh-sample rewards (0: none)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts of a fresh-sample reward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where both settings' engines and updates run (cpu or cuda)")
    p.add_argument("--out", help="write the records and the summary here (JSON)")
    args = p.parse_args(argv)
    if args.iterations < 2:
        p.error("--iterations must be >= 2")
    torch.set_num_threads(args.threads)

    import kimik3.posttrain.partial as partial
    import kimik3.posttrain.rl as rl

    held_out = dataclasses.replace(rl.RLSpec(args.run, "general", "low"), prompts=args.eval_prompts, group=1)
    runs: dict[float, rl.RLRun] = {}

    class BenchRun(rl.RLRun):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.budget = lambda step, index: budget_of(step, index, args.min_tokens, args.alpha, args.cap)
            self.rewards = lambda rollouts: [digit_share(r.completion) for r in rollouts]
            runs[self.spec.partial_lambda] = self

        def fresh_reward(self) -> float:
            """The current policy's mean proxy reward on the held-out prompts, sampled now (same seed each time)."""
            self.engine.sync(self.policy)
            tasks = rl.iteration_tasks(held_out, args.seed, HELD_OUT_ITERATION)
            rollouts, _ = self.engine.rollouts(tasks, seed=args.seed)
            return float(np.mean([digit_share(r.completion) for r in rollouts]))

    def exact_length(*a, **k):   # a turn runs its whole remaining budget
        params = plain_sampling(*a, **k)
        return dataclasses.replace(params, min_tokens=params.max_tokens, logprobs_mode="raw")

    plain_sampling = partial.sampling_for
    partial.sampling_for = exact_length
    rl.RLRun = BenchRun
    records: dict[float, list[dict]] = {lam: [] for lam in args.lambdas}
    turns = {lam: threading.Event() for lam in args.lambdas}
    done = {lam: threading.Event() for lam in args.lambdas}
    errors: list[BaseException] = []

    def worker(lam: float, out_dir: Path) -> None:
        def on_iteration(record: dict) -> None:
            if args.eval_every and (len(records[lam]) + 1) % args.eval_every == 0:
                record["fresh_reward"] = runs[lam].fresh_reward()
            records[lam].append(record)
            done[lam].set()
            if len(records[lam]) < args.iterations:
                turns[lam].wait()
                turns[lam].clear()

        try:
            rl.run_rl(args.run, domain="general", effort="low", iterations=args.iterations, group=args.group,
                      prompts=args.prompts, lr=args.lr, partial_lambda=lam, stale_coef=args.stale_coef,
                      stale_limit=args.stale_limit, out=out_dir,
                      seed=args.seed, device=args.device, checkpoint_every="100000s", progress=False,
                      log=lambda s: None, on_iteration=on_iteration)
        except BaseException as error:   # reported by the main thread
            errors.append(error)
            done[lam].set()

    with tempfile.TemporaryDirectory() as tmp:
        threads = {lam: threading.Thread(target=worker, args=(lam, Path(tmp) / f"lambda-{lam}"), daemon=True)
                   for lam in args.lambdas}
        for step in range(args.iterations):
            for lam in args.lambdas:       # one iteration of each setting in turn
                done[lam].clear()
                if step == 0:
                    threads[lam].start()
                else:
                    turns[lam].set()
                done[lam].wait()
                if errors:
                    raise errors[0]
                r = records[lam][-1]
                print(f"λ={lam} iteration {step}: {r['iteration_s']:.2f} s (rollouts {r['rollout_s']:.2f} s, "
                      f"{r['rollout_tokens']} tokens), reward {r['reward_mean']:.3f}"
                      + (f", finished {r['finished']}/{r['trajectories']}, trained {r['trained']}, "
                         f"stale tokens {r['stale_token_fraction']:.2f}" if "finished" in r else ""), flush=True)
        for thread in threads.values():
            thread.join(timeout=60)

    summary = {}
    for lam, recs in records.items():
        # The first iteration of each setting compiles kernels and captures the engine's graphs (on a GPU: seconds,
        # and more for whichever setting goes first): the means are over the later ones.
        timed = recs[1:]
        times = [r["iteration_s"] for r in timed]
        summary[lam] = dict(mean_iteration_s=float(np.mean(times)), median_iteration_s=float(np.median(times)),
                            mean_rollout_s=float(np.mean([r["rollout_s"] for r in timed])),
                            mean_update_s=float(np.mean([r["update_s"] for r in timed])),
                            first_iteration_s=recs[0]["iteration_s"], total_s=float(np.sum(times)),
                            tokens=int(sum(r["rollout_tokens"] for r in timed)),
                            rewards=[r["reward_mean"] for r in recs],
                            fresh_rewards={r["step"]: r["fresh_reward"] for r in recs if "fresh_reward" in r},
                            stale_token_fraction=[r.get("stale_token_fraction", 0.0) for r in recs])
    base, partial = args.lambdas
    ratio = summary[partial]["mean_iteration_s"] / summary[base]["mean_iteration_s"]
    print(json.dumps({str(k): v for k, v in summary.items()}, indent=1))
    print(f"mean iteration wall time after the first: λ={base} {summary[base]['mean_iteration_s']:.2f} s, "
          f"λ={partial} {summary[partial]['mean_iteration_s']:.2f} s: {100 * (1 - ratio):.0f}% lower (ratio "
          f"{ratio:.2f}); rollouts {summary[base]['mean_rollout_s']:.2f} / {summary[partial]['mean_rollout_s']:.2f} s, "
          f"updates {summary[base]['mean_update_s']:.2f} / {summary[partial]['mean_update_s']:.2f} s")
    for lam in args.lambdas:
        if summary[lam]["fresh_rewards"]:
            print(f"fresh-sample reward, λ={lam}: " + ", ".join(f"iteration {k}: {v:.3f}" for k, v in
                                                                 summary[lam]["fresh_rewards"].items()))
    if args.out:
        from kimik3.files import write_text_atomic

        write_text_atomic(Path(args.out), json.dumps({"args": vars(args), "summary": {str(k): v for k, v in
                                                     summary.items()}, "records": {str(k): v for k, v in
                                                                                   records.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
