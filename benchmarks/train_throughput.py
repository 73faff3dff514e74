"""Training throughput and loss: the tiny K3 vs a dense GPT of the same active parameter count.

    python benchmarks/train_throughput.py [--steps 60] [--seq-len 256] [--batch-size 16] [--device cpu]

Both models go through the same ``Trainer`` (same data, tokenizer, batches, optimizer grouping,
schedule); only the model differs. Prints the median training tokens/s, the ratio, and the
validation loss each reaches after the same number of steps.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from kimik3.config.params import param_counts
from kimik3.model.baseline import DenseGPT, dense_baseline_for
from kimik3.train.trainer import TrainArgs, Trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", default=None, help="corpus (default: the stdlib sources)")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("k3", "dense"):
            train_args = TrainArgs(preset=args.preset, data=args.data, steps=args.steps, seq_len=args.seq_len,
                                   batch_size=args.batch_size, device=args.device, out=str(Path(tmp) / arch),
                                   eval_every=args.steps, checkpoint_every=10**9, progress=False)
            factory = None
            if arch == "dense":
                def factory(config, device, seed):
                    return DenseGPT(dense_baseline_for(config), device=device, seed=seed)
            trainer = Trainer(train_args, model_factory=factory, log=lambda _: None)
            model = trainer.model
            if arch == "k3":
                active = param_counts(trainer.model_config)["active"]
                total = sum(p.numel() for p in model.parameters())
            else:
                active = model.config.active_params()
                total = sum(p.numel() for p in model.parameters())
            summary = trainer.run()
            rows.append((arch, total, active, summary.tokens_per_s, summary.final_loss, summary.final_val_loss))

    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__} steps={args.steps} "
          f"batch={args.batch_size}x{args.seq_len} tokens")
    print(f"{'model':<8}{'params':>12}{'active':>12}{'tokens/s':>12}{'train loss':>12}{'val loss':>10}")
    for arch, total, active, tps, loss, val in rows:
        print(f"{arch:<8}{total:>12,}{active:>12,}{tps:>12,.0f}{loss:>12.3f}{val:>10.3f}")
    print(f"K3 / dense tokens/s: {rows[0][3] / rows[1][3]:.2f}")


if __name__ == "__main__":
    main()
