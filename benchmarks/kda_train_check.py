"""Train with the Triton KDA kernels vs the torch chunk path: same run, same data, same seed.

    python benchmarks/kda_train_check.py [--steps 60] [--preset debug] [--vocab 16384] [--seeds 1] [--noise]
                                         [--kda-head-dim 128] [--try EXPERIMENT]

Trains the preset (bf16 autocast on CUDA; the preset's vocabulary cut to --vocab, since the stdlib
corpus does not fill K3's 164K BPE) twice through the same ``Trainer``: KIMIK3_KDA_BACKEND=torch (the
peer) and =triton (forward and backward kernels). Prints both loss curves, the median tokens/s and
the peak GPU memory of each, and PASS when the final validation loss agrees within --tol and the mean
training loss over the last 10 steps within 2 x --tol (bf16 noise: the two paths round differently,
so the curves drift apart by a few hundredths; the validation loss, averaged over 16 windows, is the
steadier of the two). With --seeds N > 1 both paths train once per seed (0 .. N-1): the check then
uses the mean |difference| over the seeds, and the spread of the torch path's own validation loss
across seeds is printed next to it as the scale of the noise. With --noise the torch path also trains a second time
per seed, same seed and data: its distance from itself (on a GPU its kernels' reduction orders vary between runs,
and 30 steps of training amplify that) is the noise the Triton path's distance is measured against, and the check
passes when the mean validation |difference| is within --tol or within 2x the torch path's own mean |difference|
(the last-10-step mean likewise, against 2 x --tol).
--kda-head-dim sets the preset's KDA head dimension (the debug preset's is 64; K3's is 128, where the Gluon kernels
of sm_90 run), and --try applies one of kda_kernel.py's experiments (benchmarks/kda_tries.py) to the Triton runs,
e.g. ``triton_forward.GLUON_MIN_ITEMS=0+triton_forward.GLUON_SCAN_MIN_ITEMS=0`` so that the Gluon kernels run at
the check's small batch too (their dispatch thresholds are set for K3's shapes).
Exits non-zero on FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kimik3.config import K3Config  # noqa: E402
from kimik3.ops.kda import BACKEND_ENV  # noqa: E402
from kimik3.train.trainer import TrainArgs, Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kda_tries import overridden, parse_experiment  # noqa: E402  (--try: kda_kernel.py's experiment switches)


GLUON_MODULES = ("gluon_wy", "gluon_phase_a", "gluon_scan", "gluon_bwd_scan", "gluon_bwd_wy", "gluon_bwd_intra")


@contextlib.contextmanager
def counting_gluon_launches(counts: dict):
    """Count each Gluon kernel module's launches (``launch``) while the block runs, into counts: the evidence of which
    Gluon kernels a training run went through (their dispatch depends on the GPU, the shapes and the thresholds)."""
    import importlib

    saved = []
    for name in GLUON_MODULES:
        module = importlib.import_module(f"kimik3.ops.kda.{name}")
        launch = module.launch

        def counted(*a, _launch=launch, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _launch(*a, **k)

        saved.append((module, launch))
        module.launch = counted
    try:
        yield counts
    finally:
        for module, launch in saved:
            module.launch = launch


def train(backend: str, args: argparse.Namespace, tmp: Path, seed: int,
          run: str = "") -> tuple[list[float], float, float, float]:
    """One training run of ``backend`` under tmp/{backend}-{seed}{run} (each run needs a directory of its own: the
    trainer refuses a non-empty one)."""
    import torch

    os.environ[BACKEND_ENV] = backend
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = K3Config.preset(args.preset).to_dict()
    config["vocab_size"] = args.vocab
    if args.kda_head_dim is not None:
        config["kda"]["head_dim"] = args.kda_head_dim
    config_path = tmp / f"{args.preset}-v{args.vocab}.json"
    config_path.write_text(json.dumps(config))
    train_args = TrainArgs(config_path=str(config_path), steps=args.steps, seq_len=args.seq_len,
                           batch_size=args.batch_size, device=args.device, out=str(tmp / f"{backend}-{seed}{run}"),
                           seed=seed,
                           eval_every=args.steps, checkpoint_every=10**9, progress=False)
    losses: list[float] = []
    speeds: list[float] = []

    def on_step(record: dict) -> None:
        losses.append(record["loss"])
        speeds.append(record["tokens_per_s"])

    launches: dict = {}
    with overridden(args.overrides if backend == "triton" else {}), counting_gluon_launches(launches):
        summary = Trainer(train_args, log=lambda _: None).run(on_step=on_step)
    if backend == "triton":
        print(f"{backend} seed {seed}: Gluon kernel launches "
              + (", ".join(f"{k} {v}" for k, v in sorted(launches.items())) or "none"))
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return losses, statistics.median(speeds[2:] or speeds), summary.final_val_loss, peak_gib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debug")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tol", type=float, default=0.05,
                   help="allowed |difference| of the validation loss (2x for the last-10-step mean loss)")
    p.add_argument("--seeds", type=int, default=1, help="train both paths once per seed 0 .. N-1")
    p.add_argument("--noise", action="store_true",
                   help="train the torch path twice per seed and judge the Triton path against its own spread")
    p.add_argument("--kda-head-dim", type=int, default=None, help="the preset's KDA head dimension instead of its own")
    p.add_argument("--try", dest="experiment", default="",
                   help="one kda_tries.py experiment applied to the Triton runs (parts joined by '+')")
    args = p.parse_args()
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit(f"--seeds and --steps must be >= 1, got {args.seeds} and {args.steps}")
    args.overrides = parse_experiment(args.experiment)[1] if args.experiment else {}

    print(f"{args.preset} vocab {args.vocab}, {args.steps} steps of {args.batch_size} x {args.seq_len}, "
          f"device {args.device}, seeds {args.seeds}"
          + (f", KDA head dim {args.kda_head_dim}" if args.kda_head_dim is not None else "")
          + (f", Triton runs under --try {args.experiment}" if args.experiment else ""))
    val_diffs, tail_diffs, torch_vals, finite = [], [], [], True
    noise_val, noise_tail = [], []  # --noise: the torch path against its own second run
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            (lt, st, vt, mt), (lx, sx, vx, mx) = (train(b, args, Path(tmp), seed) for b in ("torch", "triton"))
            print(f"seed {seed}\n{'step':>5}{'torch':>10}{'triton':>10}")
            for i in range(0, args.steps, max(1, args.steps // 15)):
                print(f"{i + 1:>5}{lt[i]:>10.4f}{lx[i]:>10.4f}")
            print(f"{args.steps:>5}{lt[-1]:>10.4f}{lx[-1]:>10.4f}")
            tail_t, tail_x = statistics.mean(lt[-10:]), statistics.mean(lx[-10:])
            print(f"val loss: torch {vt:.4f}, triton {vx:.4f}, |diff| {abs(vt - vx):.4f}; last-10 mean loss torch "
                  f"{tail_t:.4f} triton {tail_x:.4f}")
            print(f"tokens/s (median step): torch {st:,.0f}, triton {sx:,.0f}, triton/torch {sx / st:.2f}x")
            print(f"peak GPU memory: torch {mt:.2f} GiB, triton {mx:.2f} GiB")
            finite = finite and all(x == x for x in lx) and vx == vx
            val_diffs.append(abs(vt - vx))
            tail_diffs.append(abs(tail_t - tail_x))
            torch_vals.append(vt)
            if args.noise:
                lt2, _, vt2, _ = train("torch", args, Path(tmp), seed, run="-again")
                noise_val.append(abs(vt - vt2))
                noise_tail.append(abs(tail_t - statistics.mean(lt2[-10:])))
                print(f"torch again: val loss {vt2:.4f}, |diff| from its first run {noise_val[-1]:.4f}; last-10 mean "
                      f"loss |diff| {noise_tail[-1]:.4f}")
    val_diff, tail_diff = statistics.mean(val_diffs), statistics.mean(tail_diffs)
    if args.seeds > 1:
        print(f"torch val loss across seeds: {' '.join(f'{v:.4f}' for v in torch_vals)} "
              f"(spread {max(torch_vals) - min(torch_vals):.4f})")
    val_tol, tail_tol = args.tol, 2 * args.tol
    if args.noise:  # within the tolerance, or within twice the torch path's own run-to-run distance
        val_tol = max(val_tol, 2 * statistics.mean(noise_val))
        tail_tol = max(tail_tol, 2 * statistics.mean(noise_tail))
        print(f"torch path against itself (same seeds): val loss |diff| {statistics.mean(noise_val):.4f}, last-10 "
              f"mean loss |diff| {statistics.mean(noise_tail):.4f} (mean over {args.seeds} seed(s))")
    ok = finite and val_diff <= val_tol and tail_diff <= tail_tol
    print(f"{'PASS' if ok else 'FAIL'} val loss |diff| {val_diff:.4f} (tol {val_tol:.4f}; mean over {args.seeds} "
          f"seed(s)); last-10 mean loss |diff| {tail_diff:.4f} (tol {tail_tol:.4f})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
