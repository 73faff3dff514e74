"""Native vision at tiny scale: held-out question answering, with the image vs a text-only baseline.

Two runs of `kimik3 train --vision` (the tiny-vl preset, the stdlib text corpus + generated scenes), the same
model, seed, batches and steps; the baseline sees every image blanked (``--vision-blank``: the same tokens,
nothing to see). Both are then scored on the same held-out questions (``evaluate_qa``: the likeliest of the
kind's answers), with Wilson 95% intervals. The questions' answers are balanced, so the baseline can only guess.

    PYTHONUNBUFFERED=1 nice python benchmarks/vision_qa.py --steps 300 --questions 1000 --out runs/vision_qa
    (--lm mini: the same vision tower under a smaller language model, for a busy machine)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch


def mini_config(out: Path) -> Path:
    """tiny-vl's vision tower under a smaller language model (width 64, 5 layers, 4 experts, no MTP): the same
    mechanisms at about a fifth of tiny's step time, for a machine too busy for tiny in minutes."""
    from kimik3.config.schema import K3Config

    spec = K3Config.preset("tiny-vl").to_dict()
    spec.update(name="mini-vl", dim=64, num_layers=5, dense_hidden=128)
    spec["mtp"]["num_modules"] = 0
    spec["kda"].update(num_heads=2)
    spec["mla"].update(num_heads=2)
    spec["moe"].update(num_experts=4, top_k=2, latent_dim=32, expert_hidden=64, num_shared_experts=1,
                       shared_hidden=32)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mini-vl.json"
    path.write_text(K3Config.from_dict(spec).to_json())
    return path


def run(blank: bool, args: argparse.Namespace, vision_init: str | None = None, label: str | None = None,
        watch: Callable[[Any], Callable[[dict], None]] | None = None) -> dict:
    """One training run and its held-out QA. ``vision_init``: a tower file to start the tower from
    (``--vision-init``); ``watch(trainer)``: called before training, returns the per-step callback."""
    from kimik3.train.trainer import TrainArgs, Trainer
    from kimik3.train.vision_data import evaluate_qa

    label = label or ("blank" if blank else "vision")
    config = str(mini_config(Path(args.out))) if args.lm == "mini" else None
    train_args = TrainArgs(preset="tiny", config_path=config, vision=True, vision_blank=blank, steps=args.steps,
                           seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                           device=args.device, out=str(Path(args.out) / label), eval_every=max(args.steps, 1),
                           checkpoint_every=10**6, progress=False, vision_text_fraction=args.text_fraction,
                           vision_init=vision_init)
    start = time.time()
    trainer = Trainer(train_args, log=lambda line: print(f"[{label}] {line}", flush=True))
    summary = trainer.run(watch(trainer) if watch is not None else None)
    train_s = time.time() - start
    result = evaluate_qa(trainer.model, trainer.data, count=args.questions)
    grad_norms = [r["grad_norm"] for r in summary.history if "grad_norm" in r]
    return {"label": label, "train_s": train_s, "steps": summary.steps, "final_loss": summary.final_loss,
            "val_loss": summary.final_val_loss, "accuracy": result.accuracy, "interval": result.interval(),
            "chance": result.chance_overall, "n": result.n, "table": result.table(label),
            "per_kind": {k: (result.correct[k], result.total[k]) for k in result.total}, "grad_norms": grad_norms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--text-fraction", type=float, default=0.25)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and the corpus (train and test splits)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lm", default="tiny", choices=["tiny", "mini"],
                        help="the language model: the tiny preset's, or a smaller one (mini_config)")
    parser.add_argument("--out", default="runs/vision_qa")
    parser.add_argument("--runs", default="vision,blank",
                        help="which runs, in order (one each in two processes: --runs vision / --runs blank)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    results = [run(label == "blank", args) for label in args.runs.split(",")]
    print(f"\nheld-out QA, LM {args.lm}, {args.questions} questions (corpus seed {args.seed}), {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens, device {args.device}, torch threads {torch.get_num_threads()}")
    print(f"{'run':<12} {'kind':<8} {'n':>5} {'accuracy':>8}  Wilson 95%      chance")
    for r in results:
        print(r["table"])
    for r in results:
        print(f"{r['label']}: train {r['train_s']:.0f} s, final next-token loss {r['final_loss']:.3f}, "
              f"text val loss {r['val_loss']:.3f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = json.dumps({"args": vars(args), "results": results}, indent=1)
    (Path(args.out) / f"vision_qa-{args.runs.replace(',', '-')}.json").write_text(record)


if __name__ == "__main__":
    main()
