"""Where a training step's time goes: forward, backward, clipping, each optimizer, the router balancer,
with the collectives and host synchronisations each step makes. One torchrun call per layout::

    torchrun --standalone --nproc_per_node 2 benchmarks/step_phases.py --parallel ep     # dp = ep = N
    torchrun --standalone --nproc_per_node 2 benchmarks/step_phases.py --parallel fsdp   # dp = N
    torchrun --standalone --nproc_per_node 1 benchmarks/step_phases.py --parallel none --rows-per-rank 8
                                                          # one plain process (give it the global batch)

Each phase is timed with a device synchronisation on both sides (so the phases add up to the step,
at the price of the overlap a real step would get); medians over the timed steps, rank 0's view.
Counted per step: collectives called through ``torch.distributed``'s functions by name (functional
all-to-alls included; FSDP2's own all-gathers and reduce-scatters bypass them and are not counted), and,
on CUDA, host synchronisations (``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, ``int()``,
``float()`` of CUDA tensors). Rank 0 writes ``$OUT/multigpu-step-phases-<parallel>.json`` (or ``--json``).
Model and data options are ``benchmarks/multigpu.py``'s (``--preset debug --vocab 16384`` etc.).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import multigpu_common as mg  # sets the NCCL multicast switches before torch touches a GPU
import torch
import torch.distributed as dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast", "barrier")
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


class Recorder:
    """Phase timers and per-step counters, active only inside timed steps."""

    def __init__(self, ctx: mg.Ctx):
        self.ctx, self.on = ctx, False
        self.time: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.count: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.on:
            yield
            return
        self.ctx.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.ctx.sync()
            self.time[name] += time.perf_counter() - t0

    def timed(self, fn, name: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return wrapper

    def counted(self, fn, name: str, cuda_only: bool = False):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.on and (not cuda_only or (args and getattr(args[0], "is_cuda", False))):
                self.count[name] += 1
            return fn(*args, **kwargs)
        return wrapper


def instrument(rec: Recorder, trainer) -> None:
    import torch.distributed._functional_collectives as funcol

    model = trainer.model
    model.forward = rec.timed(model.forward, "forward")
    torch.Tensor.backward = rec.timed(torch.Tensor.backward, "backward")
    trainer.ctx.clip_grad_norm = rec.timed(trainer.ctx.clip_grad_norm, "clip grad norm")
    for name, member in trainer.optimizer.optimizers.items():
        member.step = rec.timed(member.step, f"optimizer {name}")
    if trainer.balancer is not None:   # binning each forward's routing statistics, then the bias update
        trainer.balancer.observe = rec.timed(trainer.balancer.observe, "router balancer")
        trainer.balancer.step = rec.timed(trainer.balancer.step, "router balancer")
    for name in COLLECTIVES:
        setattr(dist, name, rec.counted(getattr(dist, name), f"collective {name}"))
    funcol.all_to_all_single_autograd = rec.counted(funcol.all_to_all_single_autograd,
                                                    "collective all_to_all_single (autograd)")
    if rec.ctx.device_type == "cuda":
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, rec.counted(getattr(torch.Tensor, name), f"host sync {name}", cuda_only=True))


def build_trainer(args: argparse.Namespace, ctx: mg.Ctx):
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    tmp = mg.broadcast_tmpdir(ctx)
    _, config_path = mg.model_config_file(args, tmp)
    world = ctx.world if args.parallel != "none" else 1
    targs = mg.train_args(args, world, config_path, str(tmp / f"run-{args.parallel}"), args.steps)
    dims = {"ep": ParallelDims(dp=ctx.world, ep=ctx.world), "fsdp": ParallelDims(dp=ctx.world), "none": None}
    if args.parallel == "none" and ctx.world != 1:
        raise SystemExit("--parallel none is one plain process: launch it with --nproc_per_node 1")
    kwargs = {"parallel": dims[args.parallel]} if dims[args.parallel] is not None else {}
    trainer = Trainer(targs, log=lambda _: None, **kwargs)
    trainer.started = time.perf_counter()
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", required=True, choices=["ep", "fsdp", "none"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="debug")
    p.add_argument("--config", help="a K3Config JSON file (overrides --preset)")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary override (0: the model's own)")
    p.add_argument("--data")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--router-balance", default="quantile", choices=["quantile", "sign", "none"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    ctx = mg.Ctx(args.device)
    trainer = build_trainer(args, ctx)
    rec = Recorder(ctx)
    instrument(rec, trainer)
    steps, phases = [], collections.defaultdict(list)
    for step in range(args.steps):
        rec.on, rec.time = step >= args.warmup, collections.defaultdict(float)
        ctx.sync()
        t0 = time.perf_counter()
        record = trainer.train_step(step, args.steps)
        ctx.sync()
        if rec.on:
            steps.append(time.perf_counter() - t0)
            for name, seconds in rec.time.items():
                phases[name].append(seconds)
        ctx.log(f"[{args.parallel}] step {step + 1}/{args.steps} loss {record['loss']:.4f} "
                f"{time.perf_counter() - t0:.3f} s{'' if rec.on else ' (warm-up)'}")
    rec.on = False
    timed = len(steps)
    rows = [["step", mg.fmt(mg.median(steps))]]
    rows += [[name, mg.fmt(mg.median(v))] for name, v in sorted(phases.items())]
    rows.append(["rest (step minus the phases above)",
                 mg.fmt(mg.median(steps) - sum(mg.median(v) for v in phases.values()))])
    counts = {name: n / timed for name, n in sorted(rec.count.items())}
    ctx.log(f"\nStep phases, {args.parallel}, {ctx.world} x {ctx.device_type}, {args.config or args.preset} "
            f"(vocab {args.vocab or 'preset'}), {args.rows_per_rank} x {args.seq_len} tokens per rank, "
            f"median of {timed} steps after {args.warmup} warm-up")
    ctx.log(mg.table(["phase", "seconds"], rows))
    ctx.log(mg.table(["per step", "count"], [[k, f"{v:g}"] for k, v in counts.items()]))
    payload = {**mg.meta(ctx, "step-phases", args), "parallel": args.parallel, "step_s": steps,
               "phases_s": dict(phases), "counts_per_step": counts}
    payload["command"] = f"torchrun --nproc_per_node {ctx.world} benchmarks/step_phases.py {' '.join(sys.argv[1:])}"
    if ctx.rank == 0:
        mg.write_json(args, f"step-phases-{args.parallel}", payload)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as multigpu.py: skip interpreter finalisation (a gloo rank can abort there)
