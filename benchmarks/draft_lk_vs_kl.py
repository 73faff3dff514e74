"""The speculative draft trained with the LK loss against the same draft trained with KL (issue 42).

    python benchmarks/draft_lk_vs_kl.py --run runs/<a kimik3 train run> [--steps 200] [--seeds 0 1]
        [--ttt 3] [--batch 8] [--seq-len 128] [--held-out 32] [--lr 1e-3] [--device cpu] [--json out.json]

For each seed, both drafts start from the run's MTP module and train on the very same windows for the same steps
(``kimik3 train-draft``'s recipe, ``kimik3.train.draft``); neither is saved into the run. Reported on the run's
held-out split, along teacher-forced chains, per chain position k: the acceptance rate alpha_k (mean of
sum_x min(p, q), temperature 1), the greedy match rate, and tau = sum_k prod_{j<=k} alpha_j (drafted tokens
accepted per verification, the target's bonus token not counted) with its greedy analogue. The seed's claim:
LK >= KL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from kimik3.files import write_text_atomic
from kimik3.train.draft import DraftArgs, load_draft_data, load_target, train_draft
from kimik3.train.draft_ttt import ChainMetrics

LOSSES = ("lk", "kl")


def _mean(rows: list[list[float]]) -> list[float]:
    return [sum(column) / len(column) for column in zip(*rows)]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None   # None: KL's figure is 0 (JSON has no infinity)


def _show(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a run directory written by kimik3 train")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", help="corpus (default: the run's own, from its run.json)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)

    started = time.time()
    model, tokenizer = load_target(args.run, args.device)
    results: dict = {"run": str(args.run), "steps": args.steps, "seeds": args.seeds, "ttt": args.ttt,
                     "batch": args.batch, "seq_len": args.seq_len, "held_out": args.held_out, "lr": args.lr,
                     "device": args.device, "machine": f"{platform.processor() or platform.machine()}, "
                     f"{torch.get_num_threads()} threads", "runs": []}
    for seed in args.seeds:
        base = DraftArgs(run=args.run, steps=args.steps, ttt=args.ttt, lr=args.lr, batch=args.batch,
                         seq_len=args.seq_len, device=args.device, seed=seed, held_out=args.held_out, data=args.data,
                         progress=False)
        data = load_draft_data(Path(args.run), tokenizer, base)
        for loss in LOSSES:
            draft_args = dataclasses.replace(base, loss=loss)
            print(f"--- seed {seed}, loss {loss}", flush=True)
            result = train_draft(draft_args, target=(model, tokenizer), data=data, save=False,
                                 log=lambda line: print(line, flush=True))
            results["runs"].append({"seed": seed, "loss": loss, "held_out": result.held_out.as_dict(),
                                    "held_out_init": result.held_out_init.as_dict(),
                                    "final_train_loss": result.meta["final_train_loss"],
                                    "train_time_s": result.meta["train_time_s"]})

    summary = {}
    print(f"\nheld-out, teacher-forced chains, mean over seeds {args.seeds} ({args.steps} steps, K = {args.ttt}):")
    print(f"{'loss':<6} {'acceptance per position':<28} {'tau':>6} {'greedy match per position':<28} {'tau_g':>6}")
    init = [r["held_out_init"] for r in results["runs"]]
    rows = [("init", init)] + [(loss, [r["held_out"] for r in results["runs"] if r["loss"] == loss])
                               for loss in LOSSES]
    for name, metrics in rows:
        acceptance = _mean([m["acceptance"] for m in metrics])
        greedy = _mean([m["greedy"] for m in metrics])
        tau = sum(m["tau"] for m in metrics) / len(metrics)
        tau_greedy = sum(m["tau_greedy"] for m in metrics) / len(metrics)
        summary[name] = {"acceptance": acceptance, "greedy": greedy, "tau": tau, "tau_greedy": tau_greedy,
                         "tau_of_mean": ChainMetrics.expected_accepted(acceptance)}
        print(f"{name:<6} {' '.join(f'{x:.3f}' for x in acceptance):<28} {tau:>6.3f} "
              f"{' '.join(f'{x:.3f}' for x in greedy):<28} {tau_greedy:>6.3f}")
    lk, kl = summary["lk"], summary["kl"]
    ratio = {"tau": _ratio(lk["tau"], kl["tau"]), "tau_greedy": _ratio(lk["tau_greedy"], kl["tau_greedy"]),
             "acceptance": [_ratio(a, b) for a, b in zip(lk["acceptance"], kl["acceptance"])]}
    summary["ratio_lk_over_kl"] = ratio
    print(f"LK / KL: tau {_show(ratio['tau'])}, greedy tau {_show(ratio['tau_greedy'])}; wall time "
          f"{time.time() - started:.0f} s")
    results["summary"] = summary
    results["wall_s"] = round(time.time() - started, 1)
    if args.json:
        write_text_atomic(Path(args.json), json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
