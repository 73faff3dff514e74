"""Does MOPD distil? Each teacher's greedy test score in its own (domain, effort) cell against the student's, before
and after `kimik3 mopd` from those teachers.

    python benchmarks/mopd_learns.py --student runs/sft-easyall --teachers runs/rl-general runs/rl-agents \\
        runs/rl-coding --difficulty easy --iterations 20 --n 100 --out mopd.json

Every model is scored greedily on the same ``--n`` test tasks of each cell (test seed 0). Reported per cell: the
teacher's score, the student's before and after (Wilson 95% intervals), the student-to-teacher ratio after (the
issue's target is >= 0.9 in every cell), the paired gain of the student over the MOPD run, and the mean completion
tokens of teacher and student (how the effort levels change length). Writes ``--out`` (JSON) with every figure.
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

from rl_learns import accuracy_line, paired_difference  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", required=True, help="the run the student starts from")
    parser.add_argument("--teachers", nargs="+", required=True, help="teacher runs (kimik3 rl runs, or any run "
                        "with --teacher-cells)")
    parser.add_argument("--teacher-cells", help="each teacher's domain:effort, in the --teachers order")
    parser.add_argument("--difficulty", default="easy")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--r-max", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="MOPD's prompts and sampling")
    parser.add_argument("--n", type=int, default=100, help="test tasks per cell (the same for every model)")
    parser.add_argument("--work", help="where the student run goes (default: a temporary directory, removed)")
    parser.add_argument("--out", help="write the figures to this JSON file")
    args = parser.parse_args(argv)

    from kimik3.posttrain.evaluate import evaluate
    from kimik3.posttrain.mopd import parse_cells, resolve_teachers, run_mopd

    cells = resolve_teachers(args.teachers, parse_cells(args.teacher_cells))

    def score(run: Path, cell: str):
        domain, effort = cell.split(":")
        return evaluate(run, domain, effort, args.n, seed=0, difficulty=args.difficulty)

    def line(name: str, scores: list[float]) -> str:
        return accuracy_line(name, scores, width=18)

    results: dict = {"student": args.student, "teachers": dict(zip(cells, args.teachers)), "n": args.n,
                     "settings": {k: getattr(args, k) for k in ("difficulty", "iterations", "prompts", "group", "lr",
                                                                "r_max", "seed")}, "cells": {}}
    before = {}
    for cell, teacher in zip(cells, args.teachers):
        teacher_result, start = score(Path(teacher), cell), score(Path(args.student), cell)
        before[cell] = start
        results["cells"][cell] = {"teacher": teacher_result.scores, "teacher_tokens": teacher_result.mean_tokens,
                                  "student_before": start.scores, "student_before_tokens": start.mean_tokens}
        print(f"{cell} ({args.difficulty}), {args.n} test tasks, greedy", flush=True)
        print(line("  teacher", teacher_result.scores) + f"  {teacher_result.mean_tokens:.0f} tokens", flush=True)
        print(line("  student before", start.scores) + f"  {start.mean_tokens:.0f} tokens", flush=True)
    with (contextlib.nullcontext(args.work) if args.work else tempfile.TemporaryDirectory()) as work_dir:
        out = Path(work_dir) / f"mopd-seed{args.seed}"
        began = time.perf_counter()
        records = run_mopd(args.student, teachers=args.teachers, teacher_cells=cells, r_max=args.r_max,
                           iterations=args.iterations, prompts=args.prompts, group=args.group, lr=args.lr,
                           difficulty=args.difficulty, out=out, seed=args.seed, progress=False, log=lambda _: None)
        results["wall_s"] = time.perf_counter() - began
        results["kl_to_teacher"] = [r["kl_to_teacher"] for r in records]
        print(f"MOPD: {args.iterations} iterations in {results['wall_s']:.0f} s; KL to the teachers "
              f"{records[0]['kl_to_teacher']:.3f} -> {records[-1]['kl_to_teacher']:.3f}", flush=True)
        for cell in cells:
            after = score(out, cell)
            entry = results["cells"][cell]
            teacher_mean = sum(entry["teacher"]) / len(entry["teacher"])
            after_mean = sum(after.scores) / len(after.scores)
            gain = paired_difference(after.scores, before[cell].scores)
            ratio = after_mean / teacher_mean if teacher_mean else float("nan")
            entry.update(student_after=after.scores, student_after_tokens=after.mean_tokens, gain=gain,
                         ratio_to_teacher=ratio)
            print(line(f"{cell} student after", after.scores) + f"  {after.mean_tokens:.0f} tokens; "
                  f"{ratio:.2f} of the teacher; paired gain {gain[0]:+.3f} [{gain[1]:+.3f}, {gain[2]:+.3f}]",
                  flush=True)
        results["dir"] = str(out) if args.work else None
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
