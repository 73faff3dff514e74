"""Quality of quantisation-aware training at tiny scale (issue 41): the same run with and without MXFP4 experts.

    python benchmarks/qat_quality.py [--steps 120] [--preset tiny] [--device cpu] [--json out.json]

Three numbers from one seed, one corpus (the stdlib sources unless --data), the same steps and schedule:
- the unquantised run's final training loss and validation loss (fp32 on a CPU, bf16 autocast on a GPU);
- the QAT run's (``--qat mxfp4``: routed experts on MXFP4 weights and MXFP8 inputs, straight-through gradients);
- post-training quantisation: the unquantised run's final model evaluated with its experts quantised the same way.
The target is the QAT run's training loss within 1% of the unquantised run's. Training loss is the mean
next-token loss of the last 10 steps (one step's batch is noisy).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kimik3.train.trainer import TrainArgs, Trainer


def run(args, qat: str | None, out: Path) -> tuple[Trainer, dict]:
    train_args = TrainArgs(preset=args.preset, data=args.data, steps=args.steps, device=args.device, seed=args.seed,
                           out=str(out), qat=qat, eval_every=args.steps, checkpoint_every=10**9, progress=False)
    trainer = Trainer(train_args, log=lambda _: None)
    trainer.sample = lambda prompt, max_new_tokens=80: ""
    losses: list[float] = []
    start = time.perf_counter()
    summary = trainer.run(on_step=lambda record: losses.append(record.get("main_loss", record["loss"])))
    tail = losses[-10:]
    return trainer, {"qat": qat, "steps": summary.steps, "train_loss_last10": sum(tail) / len(tail),
                     "val_loss": summary.final_val_loss, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", default=None, help="corpus (default: the stdlib sources)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        base_trainer, base = run(args, None, Path(tmp) / "base")
        print(f"unquantised: {base}", flush=True)
        for module in base_trainer.model.modules():     # post-training quantisation of the unquantised run
            if hasattr(module, "quant") and hasattr(module, "w_gate_ELF"):
                module.quant = "mxfp4"
        ptq_val = base_trainer.evaluate()
        print(f"post-training quantised: val loss {ptq_val:.4f}", flush=True)
        del base_trainer
        _, qat = run(args, "mxfp4", Path(tmp) / "qat")
        print(f"QAT: {qat}", flush=True)

    out = {"preset": args.preset, "device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "steps": args.steps, "seed": args.seed, "unquantised": base, "qat_mxfp4": qat, "ptq_mxfp4_val_loss": ptq_val,
           "qat_over_unquantised_train_loss": qat["train_loss_last10"] / base["train_loss_last10"]}
    print(f"{args.preset}, {args.steps} steps, seed {args.seed}, {args.device} ({torch.get_num_threads()} threads)")
    print(f"{'run':<28}{'train loss (last 10)':>22}{'val loss':>10}{'seconds':>9}")
    print(f"{'unquantised':<28}{base['train_loss_last10']:>22.4f}{base['val_loss']:>10.4f}{base['seconds']:>9.0f}")
    print(f"{'QAT (MXFP4 experts)':<28}{qat['train_loss_last10']:>22.4f}{qat['val_loss']:>10.4f}{qat['seconds']:>9.0f}")
    print(f"{'PTQ of the unquantised run':<28}{'':>22}{ptq_val:>10.4f}")
    ratio = out["qat_over_unquantised_train_loss"]
    print(f"QAT / unquantised training loss: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%; target within 1%)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
