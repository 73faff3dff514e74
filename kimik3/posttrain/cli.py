"""``kimik3 sft | eval-tasks | rl | mopd``: the post-training commands (docs/posttraining.md), added to the
``kimik3`` parser by ``add_posttrain_parsers``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kimik3.cli import check_device, resolve_run
from kimik3.posttrain.driver import POSTTRAIN_BALANCE


def cmd_sft(args: argparse.Namespace) -> int:
    from kimik3.posttrain.sft import run_sft

    check_device(args.device)
    if args.resume is not None and (args.run is not None or args.data is not None or args.out is not None):
        raise ValueError("--resume continues an SFT run with its own base run and data: drop --run, --data, --out")
    run = None if args.resume is not None else resolve_run(args.run)
    run_sft(run, data=args.data, out=args.out, resume=args.resume, steps=args.steps, time_budget_s=args.time_budget,
            seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
            checkpoint_every=args.checkpoint_every, tasks_per_cell=args.tasks_per_cell, difficulty=args.difficulty,
            domain=args.domain, effort=args.effort, progress=not args.no_progress)
    return 0


def cmd_rl(args: argparse.Namespace) -> int:
    from kimik3.posttrain.rl import run_rl

    check_device(args.device)
    if args.resume is not None and (args.run is not None or args.out is not None):
        raise ValueError("--resume continues an RL run with its own base run and settings: drop --run and --out")
    run = None if args.resume is not None else resolve_run(args.run)
    run_rl(run, domain=args.domain, effort=args.effort, difficulty=args.difficulty, iterations=args.iterations,
           group=args.group, prompts=args.prompts, lr=args.lr, kl_coef=args.kl_coef, clip=args.clip,
           minibatches=args.minibatches, micro_batch=args.micro_batch, max_tokens=args.max_tokens,
           temperature=args.temperature, epochs=args.epochs, prompt_pool=args.prompt_pool,
           partial_lambda=args.partial_lambda,
           stale_coef=args.stale_coef, stale_ratio_cap=args.stale_ratio_cap, stale_limit=args.stale_limit,
           out=args.out, resume=args.resume, seed=args.seed, device=args.device, balance=args.balance,
           checkpoint_every=args.checkpoint_every, eval_n=args.eval_n, progress=not args.no_progress)
    return 0


def cmd_mopd(args: argparse.Namespace) -> int:
    from kimik3.posttrain.mopd import parse_cells, run_mopd

    check_device(args.device)
    if args.resume is not None and (args.run is not None or args.out is not None or args.teachers
                                    or args.teacher_cells is not None):
        raise ValueError("--resume continues an MOPD run with its own student, teachers and settings: drop --run, "
                         "--teachers, --teacher-cells and --out")
    if args.resume is None and not args.teachers:
        raise ValueError("--teachers DIR [DIR ...] is required: the runs to distil from")
    run = None if args.resume is not None else resolve_run(args.run)
    run_mopd(run, teachers=args.teachers or (), teacher_cells=parse_cells(args.teacher_cells), r_max=args.r_max,
             iterations=args.iterations, prompts=args.prompts, group=args.group, lr=args.lr, clip=args.clip,
             minibatches=args.minibatches, micro_batch=args.micro_batch, max_tokens=args.max_tokens,
             difficulty=args.difficulty, task_reward_coef=args.task_reward_coef, out=args.out, resume=args.resume,
             seed=args.seed, device=args.device, checkpoint_every=args.checkpoint_every, balance=args.balance,
             progress=not args.no_progress)
    return 0


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    import json

    from kimik3.files import write_text_atomic
    from kimik3.posttrain.evaluate import DOMAINS, EFFORTS, check_samples, evaluate, expand, load_engine
    from kimik3.posttrain.tasks import make_tasks

    check_device(args.device)
    domains, efforts = expand(args.domain, DOMAINS, "domain"), expand(args.effort, EFFORTS, "effort")
    make_tasks(domains[0], "test", 0, args.seed, efforts[0], args.difficulty)   # an unknown difficulty: refused now
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    check_samples(args.samples, args.temperature)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    run = resolve_run(args.run)
    engine, encoder = load_engine(run, args.device)
    records = []
    try:
        for domain in domains:
            for effort in efforts:
                result = evaluate(run, domain, effort, args.n, args.seed, args.temperature, args.max_tokens,
                                  engine=engine, encoder=encoder, progress=not args.no_progress,
                                  difficulty=args.difficulty, samples=args.samples)
                print(result.describe(), flush=True)
                records += [{"domain": domain, "effort": effort, "key": r.task.key, "score": score,
                             "tokens": r.tokens, "turns": r.turns}
                            for r, score in zip(result.rollouts, result.rollout_scores)]
    finally:
        engine.close()
    if args.out:
        write_text_atomic(Path(args.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        print(f"completions and scores written to {args.out}")
    return 0


def _update_options(p: argparse.ArgumentParser) -> None:
    """The options ``kimik3 rl`` and ``kimik3 mopd`` share: the policy update and the rollouts' length."""
    p.add_argument("--lr", type=float, default=2e-4, help="constant learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip of the importance ratio")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per iteration")
    p.add_argument("--micro-batch", type=int, default=16, help="rows per forward (gradients accumulate)")
    p.add_argument("--max-tokens", type=int, help="tokens per turn (default: the effort's reasoning budget + 192)")
    p.add_argument("--balance", default=POSTTRAIN_BALANCE, choices=["quantile", "sign", "none"],
                   help="router-bias balancing during the updates (default none: the biases stay as the base run "
                   "left them; see docs/posttraining.md)")


def add_posttrain_parsers(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("sft", help="supervised fine-tuning of a run on chat data, loss on the assistant's tokens "
                       "(docs/posttraining.md)")
    f.add_argument("--run", help="the run to fine-tune (default: the newest under ./runs)")
    f.add_argument("--data", help="JSONL of {\"messages\": [...]} conversations (default: reference solutions of "
                   "the verifiable tasks, every domain and effort)")
    f.add_argument("--out", help="the new run directory (default: <run>-sft; never overwritten: use --resume)")
    f.add_argument("--resume", help="continue this SFT run (its base run and data are in its sft.json) up to --steps")
    f.add_argument("--steps", type=int, help="total steps (default: as many as fit --time-budget)")
    f.add_argument("--time-budget", type=float, default=180.0, help="seconds, when --steps is not given")
    f.add_argument("--seq-len", type=int, default=512, help="tokens per packed row")
    f.add_argument("--batch-size", type=int, default=8, help="rows per step")
    f.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the cosine schedule")
    f.add_argument("--seed", type=int, default=0, help="seeds the packing order, the sample and the task dataset")
    f.add_argument("--tasks-per-cell", type=int, default=150,
                   help="default dataset: train tasks per (domain, effort)")
    f.add_argument("--difficulty", default="standard",
                   help="default dataset: the tasks' level, standard or easy (docs/posttraining.md)")
    f.add_argument("--domain", default="all", help="default dataset: general, agents, coding or all")
    f.add_argument("--effort", default="all", help="default dataset: low, high, max or all")
    f.add_argument("--checkpoint-every", metavar="N|DURATION", help="as for kimik3 train (default 60s)")
    f.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.set_defaults(func=cmd_sft)

    e = sub.add_parser("eval-tasks", help="score a run on test tasks of the verifiable domains, with 95%% CIs")
    e.add_argument("--run", help="run directory (default: the newest under ./runs)")
    e.add_argument("--domain", default="all", help="general, agents, coding or all")
    e.add_argument("--effort", default="all", help="low, high, max or all")
    e.add_argument("--n", type=int, default=50, help="test tasks per (domain, effort)")
    e.add_argument("--difficulty", default="standard",
                   help="standard, or easy: a level sized for a tiny model (docs/posttraining.md)")
    e.add_argument("--seed", type=int, default=0, help="which test tasks (and the sampling seed)")
    e.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    e.add_argument("--samples", type=int, default=1,
                   help="completions per task at --temperature > 0; a task scores their mean")
    e.add_argument("--max-tokens", type=int, help="tokens per turn (default: the effort's reasoning budget + 192)")
    e.add_argument("--device", default="cpu", help="cpu or cuda")
    e.add_argument("--out", help="write every completion and its score to this JSONL file")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.set_defaults(func=cmd_eval_tasks)

    r = sub.add_parser("rl", help="on-policy RL with verifiable rewards on one (domain, effort) or a mixture, "
                       "rollouts on the serving engine (docs/posttraining.md)")
    r.add_argument("--run", help="the run to improve, e.g. an SFT run (default: the newest under ./runs)")
    r.add_argument("--domain", default="general",
                   help="general, agents, coding, or all (the prompts from every domain's cell in turn)")
    r.add_argument("--effort", default="low", help="low, high, max, or all (every effort level's cell in turn)")
    r.add_argument("--difficulty", default="standard",
                   help="standard, or easy: a level sized for a tiny model (docs/posttraining.md)")
    r.add_argument("--iterations", type=int, default=20, help="total iterations (rollouts + update)")
    r.add_argument("--group", type=int, default=8, help="completions per prompt (the advantage's group)")
    r.add_argument("--prompts", type=int, default=8, help="train prompts per iteration")
    r.add_argument("--prompt-pool", type=int, metavar="N",
                   help="draw the prompts from a fixed set of N train tasks (per cell), pass after pass (default: "
                   "fresh ones every iteration)")
    _update_options(r)
    r.add_argument("--temperature", type=float, default=1.0,
                   help="rollout temperature in (0, 2]; the update's log-probabilities are taken at the same one")
    r.add_argument("--epochs", type=int, default=1,
                   help="passes over an iteration's rows (PPO epochs; the clip bounds the later passes)")
    r.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL to the starting model (0: off)")
    r.add_argument("--eval-n", type=int, default=0,
                   help="greedy test accuracy on this many test tasks before the first iteration and after the last")
    r.add_argument("--partial-lambda", type=float, default=1.0, metavar="λ",
                   help="partial rollouts: stop an iteration's generation once this fraction of its trajectories "
                   "finished; the rest resume first next iteration (default 1: wait for all)")
    r.add_argument("--stale-coef", type=float, default=0.1,
                   help="partial rollouts: weight of the staleness-weighted squared log-ratio on stale tokens")
    r.add_argument("--stale-ratio-cap", type=float, default=3.0,
                   help="partial rollouts: truncation of stale tokens' importance ratio (> 1 + --clip)")
    r.add_argument("--stale-limit", type=int, metavar="K",
                   help="partial rollouts: tokens sampled more than K policy versions before the updated one are "
                   "context only, out of the loss (default: every token trained; 0 keeps λ = 0.7's reward curve level "
                   "with λ = 1's at the default lr, docs/posttraining.md)")
    r.add_argument("--out", help="the new run directory (default: <run>-rl-<domain>-<effort>; use --resume)")
    r.add_argument("--resume", help="continue this RL run (its base run and settings are in its rl.json) up to "
                   "--iterations")
    r.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    r.add_argument("--checkpoint-every", metavar="N|DURATION", help="as for kimik3 train (default 60s)")
    r.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast in updates)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

    r.set_defaults(func=cmd_rl)

    m = sub.add_parser("mopd", help="multi-teacher on-policy distillation: teachers of (domain, effort) cells into "
                       "one student, clipped log-ratio dense reward (docs/posttraining.md)")
    m.add_argument("--teachers", nargs="+", metavar="DIR", help="the teacher runs (e.g. kimik3 rl runs)")
    m.add_argument("--teacher-cells", metavar="D:E,...",
                   help="each teacher's domain:effort, in the --teachers order (default: what its rl.json records)")
    m.add_argument("--run", help="the student's starting run, e.g. an SFT run (default: the newest under ./runs)")
    m.add_argument("--r-max", type=float, default=2.0, help="clip of the per-token log-ratio reward")
    m.add_argument("--iterations", type=int, default=20, help="total iterations (rollouts + update)")
    m.add_argument("--prompts", type=int, default=9, help="train prompts per iteration, over the cells in turn")
    m.add_argument("--group", type=int, default=2, help="completions per prompt")
    _update_options(m)
    m.add_argument("--difficulty", default="standard",
                   help="standard, or easy: a level sized for a tiny model (docs/posttraining.md)")
    m.add_argument("--task-reward-coef", type=float, default=0.0,
                   help="add this times the group-normalised verifiable task advantage to every token's (0: off)")
    m.add_argument("--out", help="the new run directory (default: <run>-mopd; use --resume)")
    m.add_argument("--resume", help="continue this MOPD run (its mopd.json) up to --iterations")
    m.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    m.add_argument("--checkpoint-every", metavar="N|DURATION", help="as for kimik3 train (default 60s)")
    m.add_argument("--device", default="cpu", help="cpu or cuda")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.set_defaults(func=cmd_mopd)
