"""Train with the Triton KDA kernels vs the torch chunk path: same run, same data, same seed.

    python benchmarks/kda_train_check.py [--steps 60] [--preset debug] [--vocab 16384] [--seeds 1] [--noise]
                                         [--kda-head-dim 128] [--seq-len 512] [--batch-size 8]

Trains the preset (bf16 autocast on CUDA; the preset's vocabulary cut to --vocab, since the stdlib
corpus does not fill K3's 164K BPE) twice through the same ``Trainer``: KIMIK3_KDA_BACKEND=torch (the
peer) and =triton (forward and backward kernels). Prints both loss curves, the median tokens/s and
the peak GPU memory of each, the Triton run's kernel launches by kernel (which kernels the dispatch chose at these
shapes), and PASS when the final validation loss agrees within --tol and the mean
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
of sm_90 run). Which kernels run also depends on the batch: the Gluon ones take over from a count of chunks x heads
up, so --batch-size and --seq-len decide whether the check goes through them (the launch counts say).
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
from kimik3.train.trainer import TrainArgs, Trainer  # noqa: E402

BACKEND_ENV = "KIMIK3_KDA_BACKEND"  # the KDA operators' backend override: "torch" or "triton" for the whole run


@contextlib.contextmanager
def counting_kernel_launches(counts: dict):
    """Count each Triton / Gluon kernel's launches by kernel name into counts while the block runs, whatever module
    holds the kernel: every compiled launch goes through ``JITFunction.run`` (launches under TRITON_INTERPRET=1 take
    another path and are not counted). Gluon kernels are named with " (Gluon)"."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing can launch
        yield counts
        return
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        name = self.__name__ + (" (Gluon)" if self.is_gluon() else "")
        counts[name] = counts.get(name, 0) + 1
        return original(self, *args, **kwargs)

    JITFunction.run = counted
    try:
        yield counts
    finally:
        JITFunction.run = original


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
    with counting_kernel_launches(launches):
        summary = Trainer(train_args, log=lambda _: None).run(on_step=on_step)
    if backend == "triton":
        print(f"{backend} seed {seed}: kernel launches "
              + (", ".join(f"{k} {v}" for k, v in sorted(launches.items())) or "none counted"))
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return losses, statistics.median(speeds[2:] or speeds), summary.final_val_loss, peak_gib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debug", help="the model preset trained")
    p.add_argument("--vocab", type=int, default=16384, help="the preset's vocabulary cut to this size")
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row")
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--device", default="cuda", help="the trainer's device")
    p.add_argument("--tol", type=float, default=0.05,
                   help="allowed |difference| of the validation loss (2x for the last-10-step mean loss)")
    p.add_argument("--seeds", type=int, default=1, help="train both paths once per seed 0 .. N-1")
    p.add_argument("--noise", action="store_true",
                   help="train the torch path twice per seed and judge the Triton path against its own spread")
    p.add_argument("--kda-head-dim", type=int, default=None, help="the preset's KDA head dimension instead of its own")
    p.add_argument("--gluon-any-size", action="store_true",
                   help="the Gluon stages at any size (dispatch.thresholds(0, 0)): a small run through every Hopper "
                        "kernel that can take its shapes")
    args = p.parse_args()
    if args.seeds < 1 or args.steps < 1:
        raise SystemExit(f"--seeds and --steps must be >= 1, got {args.seeds} and {args.steps}")

    print(f"{args.preset} vocab {args.vocab}, {args.steps} steps of {args.batch_size} x {args.seq_len}, "
          f"device {args.device}, seeds {args.seeds}"
          + (f", KDA head dim {args.kda_head_dim}" if args.kda_head_dim is not None else ""))
    from kimik3.ops.kda import dispatch

    # --gluon-any-size: the Gluon stages at any size for the whole check
    with dispatch.thresholds(0, 0) if args.gluon_any_size else contextlib.nullcontext():
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
                    print(f"torch again: val loss {vt2:.4f}, |diff| from its first run {noise_val[-1]:.4f}; "
                          f"last-10 mean loss |diff| {noise_tail[-1]:.4f}")
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
