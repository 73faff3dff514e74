"""Does MOPD distil, and in fewer updates than RL on the mixture? Each teacher's greedy test score in its own
(domain, effort) cell against the student's, before and after `kimik3 mopd` from those teachers, stage by stage.

    python benchmarks/mopd_learns.py --student runs/sft9 --teachers runs/t-general-low ... runs/t-coding-max \\
        --difficulty easy --stages 25,50,100 --methods mopd rl_mixture --n 150 --out mopd.json

Every model is scored greedily on the same ``--n`` test tasks of each cell (test seed 0). ``--stages``: the
cumulative iteration counts after which the student is scored (the run continued between them; default one stage,
``--iterations``). ``--methods mopd rl_mixture``: also the same stages of ``kimik3 rl`` on the mixture of the
teachers' cells (``--domain``/``--effort`` each one name or all: the cells must be such a product) from the same
student, with the same prompts, group, learning rate and seed: the issue's "fewer student updates than RL from
scratch on the mixture". Reported per cell and stage: the student's score (Wilson 95% interval), its ratio to the
teacher (the target is >= 0.9 in every cell), the paired gain over the start, the mean completion tokens (how the
effort levels change length); per method, the first stage at which every cell reached 0.9 of its teacher (0: the
student already had). Writes ``--out`` (JSON) with every figure, after each stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # run from a checkout that is not installed

from rl_learns import accuracy_line, paired_difference  # noqa: E402

TARGET = 0.9   # the student's score over its teacher's, in every cell


def mixture_of(cells: list[str]) -> tuple[str, str]:
    """(--domain, --effort) of ``kimik3 rl`` whose cells are exactly ``cells``, each one name or "all"; ValueError
    when the cells are not such a product."""
    from kimik3.posttrain.rl import RLSpec

    def one_or_all(names: set[str]) -> str:
        return next(iter(names)) if len(names) == 1 else "all"

    domain = one_or_all({c.split(":")[0] for c in cells})
    effort = one_or_all({c.split(":")[1] for c in cells})
    if sorted(f"{d}:{e}" for d, e in RLSpec("", domain, effort).cells) != sorted(cells):
        raise ValueError(f"rl_mixture: the teachers' cells {sorted(cells)} are not one domain or all x one effort "
                         f"or all, which is what kimik3 rl trains on")
    return domain, effort


def ratio_to(scores: list[float], teacher: list[float]) -> float:
    """The student's mean score over the teacher's on the same tasks, as a ratio of the sums (27 of 150 against 30
    is 0.9 exactly, where 0.18 / 0.2 in floats falls just below); NaN when the teacher scored nothing."""
    return sum(scores) / sum(teacher) if sum(teacher) else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", required=True, help="the run the student starts from")
    parser.add_argument("--teachers", nargs="+", required=True, help="teacher runs (kimik3 rl runs, or any run "
                        "with --teacher-cells)")
    parser.add_argument("--teacher-cells", help="each teacher's domain:effort, in the --teachers order")
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--iterations", type=int, default=20, help="one stage of this many (without --stages)")
    parser.add_argument("--stages", help="cumulative iteration counts to score the student after, e.g. 25,50,100")
    parser.add_argument("--methods", nargs="+", choices=["mopd", "rl_mixture"], default=["mopd"],
                        help="mopd, and/or rl_mixture: RL on the mixture of the teachers' cells from the student")
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--r-max", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="the prompts and sampling of MOPD (and RL)")
    parser.add_argument("--n", type=int, default=100, help="test tasks per cell (the same for every model)")
    parser.add_argument("--work", help="where the student runs go (default: a temporary directory, removed)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")] if args.stages else [args.iterations]
    if not stages or stages != sorted(set(stages)) or stages[0] < 1:
        parser.error(f"--stages must be increasing positive iteration counts, got {args.stages}")

    from kimik3.posttrain.evaluate import evaluate
    from kimik3.posttrain.mopd import parse_cells, resolve_teachers, run_mopd
    from kimik3.posttrain.rl import run_rl

    cells = resolve_teachers(args.teachers, parse_cells(args.teacher_cells))
    mixture = mixture_of(cells) if "rl_mixture" in args.methods else None   # refused before any model is scored

    def score(run: Path, cell: str):
        domain, effort = cell.split(":")
        return evaluate(run, domain, effort, args.n, seed=0, difficulty=args.difficulty)

    results: dict = {"student": args.student, "teachers": dict(zip(cells, args.teachers)), "n": args.n,
                     "stages": stages, "target": TARGET,
                     "settings": {k: getattr(args, k) for k in ("difficulty", "prompts", "group", "lr", "r_max",
                                                                "seed")},
                     "cells": {}, "methods": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))

    for cell, teacher in zip(cells, args.teachers):
        teacher_result, start = score(Path(teacher), cell), score(Path(args.student), cell)
        results["cells"][cell] = {"teacher": teacher_result.scores, "teacher_tokens": teacher_result.mean_tokens,
                                  "student_before": start.scores, "student_before_tokens": start.mean_tokens}
        ratio = ratio_to(start.scores, teacher_result.scores)
        results["cells"][cell]["student_before_ratio"] = ratio
        print(f"{cell} ({args.difficulty}), {args.n} test tasks, greedy", flush=True)
        print(accuracy_line("  teacher", teacher_result.scores, 18) + f"  {teacher_result.mean_tokens:.0f} tokens",
              flush=True)
        print(accuracy_line("  student before", start.scores, 18) + f"  {start.mean_tokens:.0f} tokens; {ratio:.2f} "
              f"of the teacher", flush=True)
    results["start_at_target"] = all(results["cells"][c]["student_before_ratio"] >= TARGET for c in cells)
    save()

    def train(method: str, out: Path, iterations: int, first: bool) -> list[dict]:
        common = dict(iterations=iterations, prompts=args.prompts, group=args.group, lr=args.lr, seed=args.seed,
                      progress=False, log=lambda _: None)
        if not first:
            return (run_mopd if method == "mopd" else run_rl)(resume=out, **common)
        if method == "mopd":
            return run_mopd(args.student, teachers=args.teachers, teacher_cells=cells, r_max=args.r_max,
                            difficulty=args.difficulty, out=out, **common)
        return run_rl(args.student, domain=mixture[0], effort=mixture[1], difficulty=args.difficulty, out=out,
                      **common)

    with (contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory()) as work_dir:
        for method in args.methods:
            out = Path(work_dir) / f"{method}-seed{args.seed}"
            summary = results["methods"][method] = {"dir": str(out) if args.work else None, "stages": [],
                                                    "first_stage_at_target": 0 if results["start_at_target"]
                                                    else None}
            elapsed = 0.0
            for index, iterations in enumerate(stages):
                began = time.perf_counter()
                records = train(method, out, iterations, first=index == 0)
                elapsed += time.perf_counter() - began
                stage = {"iterations": iterations, "wall_s": elapsed}
                if method == "mopd":
                    stage["kl_to_teacher"] = [r["kl_to_teacher"] for r in records]
                print(f"{method}: {iterations} iterations ({elapsed:.0f} s of training)"
                      + (f"; KL to the teachers {records[0]['kl_to_teacher']:.3f} -> "
                         f"{records[-1]['kl_to_teacher']:.3f} this stage" if method == "mopd" else ""), flush=True)
                for cell in cells:
                    after = score(out, cell)
                    entry = results["cells"][cell]
                    gain = paired_difference(after.scores, entry["student_before"])
                    ratio = ratio_to(after.scores, entry["teacher"])
                    entry.setdefault(method, {})[str(iterations)] = {
                        "scores": after.scores, "tokens": after.mean_tokens, "gain": gain, "ratio_to_teacher": ratio}
                    print(accuracy_line(f"  {cell}", after.scores, 18) + f"  {after.mean_tokens:.0f} tokens; "
                          f"{ratio:.2f} of the teacher; paired gain {gain[0]:+.3f} [{gain[1]:+.3f}, {gain[2]:+.3f}]",
                          flush=True)
                at_target = all(results["cells"][c][method][str(iterations)]["ratio_to_teacher"] >= TARGET
                                for c in cells)
                stage["every_cell_at_target"] = at_target
                summary["stages"].append(stage)
                if at_target and summary["first_stage_at_target"] is None:
                    summary["first_stage_at_target"] = iterations
                save()
            first = summary["first_stage_at_target"]
            print(f"{method}: every cell at {TARGET} of its teacher "
                  + ("after none of the stages" if first is None else f"first after {first} iterations"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
