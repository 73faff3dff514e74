"""Native vision: a contrastively pre-trained tower against from-scratch next-token prediction (the seed's claim).

The seed trains MoonViT-V2 from scratch by NTP because a contrastively pre-trained (SigLIP) encoder gave
frequent gradient spikes in joint training. At tiny scale, on the generated scenes:

1. pre-train the tiny-vl tower CLIP-style on the scenes' captions (``kimik3.train.vision_contrastive``:
   symmetric InfoNCE, learned temperature) and show its held-out retrieval accuracy;
2. train the multimodal model twice (``vision_qa.run``: the same model config, seed, batches and steps), the
   tower from scratch (``scratch``) and from the pre-trained tower (``contrastive``, ``--vision-init``); the
   text model and the projector start identical in both;
3. compare the per-step gradient norms (the Trainer's ``grad_norm``: all parameters, before clipping; and the
   tower's alone, read by gradient hooks) and the held-out question-answer accuracy (``evaluate_qa``).

Spike rules (``spikes``): a step is a spike when its norm exceeds ``--spike-factor`` (3) x the median of the
``--spike-window`` (50) steps before it (from step ``--spike-window // 5`` on, so the median has 10 steps), or,
as a fixed rule, when it exceeds ``--spike-threshold`` (1.0: the clip norm, so the clip acted).

    OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 nice python benchmarks/vision_init.py --lm mini --steps 400 \\
        --batch-size 8 --seq-len 96 --questions 600 --lr 6e-3 --out runs/vision_init

Writes ``vision_init.json`` and ``vision_init.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

LABELS = ("scratch", "contrastive")


# ---------------------------------------------------------------------------------------------- spikes
def spikes(norms: list[float], factor: float = 3.0, window: int = 50, min_history: int | None = None) -> list[int]:
    """Indices t whose ``norms[t]`` exceeds ``factor`` x the median of the (up to) ``window`` values before it;
    from the first t with ``min_history`` values before it (default ``window // 5``, at least 1)."""
    if factor <= 0 or window < 1:
        raise ValueError(f"spikes: factor must be > 0 and window >= 1, got {factor}, {window}")
    least = max(1, window // 5 if min_history is None else min_history)
    return [t for t in range(least, len(norms))
            if norms[t] > factor * statistics.median(norms[max(0, t - window):t])]


def over(norms: list[float], threshold: float) -> list[int]:
    """Indices of the values above ``threshold``."""
    return [t for t, g in enumerate(norms) if g > threshold]


def norm_stats(norms: list[float], args: argparse.Namespace) -> dict[str, Any]:
    if not norms:
        raise ValueError("no gradient norms were recorded")
    rel = spikes(norms, args.spike_factor, args.spike_window)
    fixed = over(norms, args.spike_threshold)
    median = statistics.median(norms)
    late = norms[len(norms) // 10:]   # past the warmup and the first transients
    return {"median": median, "max": max(norms), "max_over_median": max(norms) / median,
            "argmax": norms.index(max(norms)), "late_max_over_median": max(late) / statistics.median(late),
            "spikes_relative": len(rel), "spike_steps_relative": rel,
            "spikes_fixed": len(fixed), "spike_steps_fixed": fixed[:50]}


# ---------------------------------------------------------------------------------------------- the runs
def tower_grad_watch(norms: list[float]) -> Callable[[Any], Callable[[dict], None]]:
    """``vision_qa.run``'s ``watch``: appends each step's tower gradient norm (before clipping) to ``norms``."""
    def watch(trainer: Any) -> Callable[[dict], None]:
        squares: list[torch.Tensor] = []
        for p in trainer.model.vision_tower.parameters():
            p.register_post_accumulate_grad_hook(lambda q: squares.append(q.grad.detach().float().pow(2).sum()))

        def on_step(record: dict) -> None:
            norms.append(float(torch.stack(squares).sum().sqrt()) if squares else float("nan"))
            squares.clear()
        return on_step
    return watch


def qa_summary(result: dict) -> dict[str, Any]:
    from kimik3.train.vision_corpus import CHOICES
    from kimik3.train.vision_data import wilson_interval

    kinds = {k: {"correct": c, "n": n, "accuracy": c / n, "interval": wilson_interval(c, n),
                 "chance": 1 / len(CHOICES[k])} for k, (c, n) in result["per_kind"].items()}
    return {"accuracy": result["accuracy"], "interval": result["interval"], "n": result["n"],
            "chance": result["chance"], "per_kind": kinds}


def draw(path: Path, runs: dict[str, dict], args: argparse.Namespace) -> Path | None:
    from kimik3.train.plot import draw_figure
    from kimik3.train.vision_corpus import CHOICES

    def fill(axes) -> None:
        fig = axes[0].figure
        axes[1].remove()   # the bars get an axis of their own (the figure's axes share x)
        bars = fig.add_subplot(2, 1, 2)
        colours = {"scratch": "tab:blue", "contrastive": "tab:orange"}
        for label, r in runs.items():
            norms = r["grad_norms"]
            axes[0].plot(range(len(norms)), norms, lw=0.8, color=colours[label],
                         label=f"{label}: median {r['grad']['median']:.2f}, max/median "
                               f"{r['grad']['max_over_median']:.1f}, {r['grad']['spikes_relative']} spikes")
            axes[0].plot(range(len(r["tower_grad_norms"])), r["tower_grad_norms"], lw=0.6, ls=":",
                         color=colours[label], label=f"{label}: tower only, max/median "
                                                     f"{r['tower_grad']['max_over_median']:.0f}, "
                                                     f"{r['tower_grad']['spikes_relative']} spikes")
        axes[0].axhline(args.spike_threshold, color="grey", lw=0.6, ls="--")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("gradient norm (before clipping)")
        axes[0].set_title(f"tiny-vl tower, LM {args.lm}: from scratch vs contrastive init (seed {args.seed})")
        axes[0].legend(fontsize=7)
        kinds = list(next(iter(runs.values()))["qa"]["per_kind"]) + ["all"]
        width = 0.38
        for i, (label, r) in enumerate(runs.items()):
            qa = r["qa"]
            acc = [qa["per_kind"][k]["accuracy"] for k in kinds[:-1]] + [qa["accuracy"]]
            ivs = [qa["per_kind"][k]["interval"] for k in kinds[:-1]] + [qa["interval"]]
            xs = [x + (i - 0.5) * width for x in range(len(kinds))]
            err = [[a - lo for a, (lo, _) in zip(acc, ivs)], [hi - a for a, (_, hi) in zip(acc, ivs)]]
            bars.bar(xs, acc, width, yerr=err, capsize=2, color=colours[label], label=label)
        chance = [1 / len(CHOICES[k]) for k in kinds[:-1]] + [qa["chance"]]
        bars.hlines(chance, [x - width for x in range(len(kinds))], [x + width for x in range(len(kinds))],
                    colors="black", lw=1, ls="--", label="chance")
        bars.set_xticks(range(len(kinds)), kinds)
        bars.set_ylabel("held-out QA accuracy (Wilson 95%)")
        bars.set_ylim(0, 1)
        bars.legend(fontsize=7)
        axes[0].tick_params(labelbottom=True)

    return draw_figure(path, "the vision-init plot", 2, fill, figsize=(8, 6.5))


def main() -> None:
    from kimik3.config.schema import K3Config
    from kimik3.train.vision_contrastive import ContrastiveArgs, pretrain_tower
    from vision_qa import mini_config, run

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--text-fraction", type=float, default=0.25)
    parser.add_argument("--questions", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and the corpus (both runs)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lm", default="mini", choices=["tiny", "mini"], help="as vision_qa.py's --lm")
    parser.add_argument("--out", default="runs/vision_init")
    parser.add_argument("--contrastive-steps", type=int, default=2000)
    parser.add_argument("--contrastive-scenes", type=int, default=16384)
    parser.add_argument("--contrastive-lr", type=float, default=2e-3)
    parser.add_argument("--tower", help="an existing tower file: skip the pre-training")
    parser.add_argument("--spike-factor", type=float, default=3.0)
    parser.add_argument("--spike-window", type=int, default=50)
    parser.add_argument("--spike-threshold", type=float, default=1.0)
    parser.add_argument("--replot", metavar="JSON", help="redraw the PNG of a vision_init.json beside it; no runs")
    args = parser.parse_args()
    if args.replot:
        record = json.loads(Path(args.replot).read_text())
        saved = argparse.Namespace(**record["args"])
        print(f"wrote {draw(Path(args.replot).with_suffix('.png'), record['runs'], saved)}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    pre: dict[str, Any] | None = None
    tower = args.tower
    if tower is None:
        config = mini_config(out) if args.lm == "mini" else None
        model_config = K3Config.from_json(config) if config else K3Config.preset("tiny-vl")
        pre = pretrain_tower(model_config.vision, ContrastiveArgs(steps=args.contrastive_steps,
                                                                  scenes=args.contrastive_scenes,
                                                                  lr=args.contrastive_lr, seed=args.seed),
                             out / "tower.safetensors", log=lambda line: print(f"[pretrain] {line}", flush=True))
        tower = pre["path"]

    runs: dict[str, dict] = {}
    for label in LABELS:
        torch.manual_seed(args.seed)
        tower_norms: list[float] = []
        r = run(False, args, vision_init=tower if label == "contrastive" else None, label=label,
                watch=tower_grad_watch(tower_norms))
        r["tower_grad_norms"] = tower_norms
        r["grad"] = norm_stats(r["grad_norms"], args)
        r["tower_grad"] = norm_stats(tower_norms, args)
        r["qa"] = qa_summary(r)
        runs[label] = r

    print(f"\n{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, LM {args.lm}, seed {args.seed}, "
          f"torch threads {torch.get_num_threads()}; spikes: > {args.spike_factor:g} x the median of the "
          f"{args.spike_window} steps before, and > {args.spike_threshold:g}")
    if pre is not None:
        after = pre["retrieval_after"]
        before = pre["retrieval_before"]
        print(f"contrastive pre-training: {pre['args']['steps']} steps, {pre['wall_s']:.0f} s, held-out "
              f"image->caption top-1 {after['image_to_caption']:.3f} (before {before['image_to_caption']:.3f}, "
              f"chance {after['chance']:.3f}, batches of {after['batch']})")
    print(f"{'run':<12} {'what':<6} {'median':>7} {'max':>7} {'max/med':>7} {'late':>6} {'rel':>4} {'fixed':>5}")
    for label, r in runs.items():
        for what in ("grad", "tower_grad"):
            g = r[what]
            print(f"{label:<12} {what.split('_')[0]:<6} {g['median']:>7.3f} {g['max']:>7.3f} "
                  f"{g['max_over_median']:>7.1f} {g['late_max_over_median']:>6.1f} {g['spikes_relative']:>4} "
                  f"{g['spikes_fixed']:>5}")
    print(f"\n{'run':<12} {'kind':<8} {'n':>5} {'accuracy':>8}  Wilson 95%      chance")
    for r in runs.values():
        print(r["table"])
    for label, r in runs.items():
        print(f"{label}: train {r['train_s']:.0f} s, final next-token loss {r['final_loss']:.3f}, "
              f"text val loss {r['val_loss']:.3f}")
    if pre is not None:
        pre = {k: v for k, v in pre.items() if k != "losses"} | {"losses_every_50": pre["losses"][::50]}
    record = {"args": vars(args), "pretrain": pre, "tower": str(tower), "wall_s": time.time() - start,
              "runs": {label: {k: v for k, v in r.items() if k != "table"} for label, r in runs.items()}}
    (out / "vision_init.json").write_text(json.dumps(record, indent=1))
    plot = draw(out / "vision_init.png", runs, args)
    print(f"wrote {out / 'vision_init.json'}" + (f" and {plot}" if plot else "") + f"; {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
