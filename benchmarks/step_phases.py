"""Where a training step's time goes: forward, backward, clipping, each optimizer, the router balancer,
with the collectives and host synchronisations each step makes. One torchrun call per layout::

    torchrun --standalone --nproc_per_node 2 benchmarks/step_phases.py --parallel ep     # dp = ep = N
    torchrun --standalone --nproc_per_node 2 benchmarks/step_phases.py --parallel fsdp   # dp = N
    torchrun --standalone --nproc_per_node 1 benchmarks/step_phases.py --parallel none --rows-per-rank 8
                                                          # one plain process (give it the global batch)
    torchrun --standalone --nproc_per_node 2 benchmarks/step_phases.py --parallel muon --layers 2
                                                          # the Muon step alone, matrices sharded as FSDP2 does
    (add --device cpu for gloo on CPU: OMP_NUM_THREADS=1 for one thread a rank)

Each phase is timed with a device synchronisation on both sides (so the phases add up to the step,
at the price of the overlap a real step would get); medians over the timed steps, rank 0's view.
Inside those, rows starting with "in" (not added into the step again): each token mixer's forward (KDA,
MLA), each MoE layer's router, dispatch, experts and combine (under EP: ``EPRoutedExperts.dispatch`` /
``compute`` / ``combine``; on one rank, the routed experts' forward), and the time spent in
``torch.distributed`` calls and functional all-to-alls (forward and optimizer; the backward's all-to-alls
run inside autograd and count in "backward").
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
import math
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
SUB = "  in "   # a phase inside another one (not added again into the step's sum)


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

    from kimik3.model.moe import LatentMoE

    model = trainer.model
    model.forward = rec.timed(model.forward, "forward")
    # Inside the forward (each also timed between device synchronisations): the token mixers by kind, and the
    # MoE layers' router, dispatch (the plan and the exchange to the computing ranks), experts and combine.
    for module in model.modules():
        mixer = getattr(module, "mixer", None)
        if mixer is not None:
            mixer.forward = rec.timed(mixer.forward, f"{SUB}forward {type(mixer).__name__} (attention)")
        if isinstance(module, LatentMoE):
            module.router.forward = rec.timed(module.router.forward, f"{SUB}forward MoE router")
            experts = module.experts
            if hasattr(experts, "dispatch"):   # expert parallel (kimik3.parallel.moonep.EPRoutedExperts)
                experts.dispatch = rec.timed(experts.dispatch, f"{SUB}forward MoE dispatch")
                experts.compute = rec.timed(experts.compute, f"{SUB}forward MoE experts")
                experts.combine = rec.timed(experts.combine, f"{SUB}forward MoE combine")
            else:                              # one rank holds every expert: sort, experts, unsort in one call
                experts.forward = rec.timed(experts.forward, f"{SUB}forward MoE experts (dispatch+combine local)")
    torch.Tensor.backward = rec.timed(torch.Tensor.backward, "backward")
    trainer.ctx.clip_grad_norm = rec.timed(trainer.ctx.clip_grad_norm, "clip grad norm")
    for name, member in trainer.optimizer.optimizers.items():
        member.step = rec.timed(member.step, f"optimizer {name}")
    if trainer.balancer is not None:   # binning each forward's routing statistics, then the bias update
        trainer.balancer.observe = rec.timed(trainer.balancer.observe, "router balancer")
        trainer.balancer.step = rec.timed(trainer.balancer.step, "router balancer")
    for name in COLLECTIVES:
        timed = rec.timed(getattr(dist, name), f"{SUB}communication (torch.distributed calls)")
        setattr(dist, name, rec.counted(timed, f"collective {name}"))
    # functional all-to-alls: the call and its wait (forward only; their backward runs inside "backward")
    funcol.all_to_all_single_autograd = rec.counted(
        rec.timed(funcol.all_to_all_single_autograd, f"{SUB}communication (torch.distributed calls)"),
        "collective all_to_all_single (autograd)")
    funcol.wait_tensor = rec.timed(funcol.wait_tensor, f"{SUB}communication (torch.distributed calls)")
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


def muon_matrices(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, shape, split) of every Muon parameter of the first ``--layers`` blocks of the model (all: 0)."""
    from kimik3.config import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.optim.muon import classify_parameters

    config = K3Config.from_json(args.config) if args.config else K3Config.preset(args.preset)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    keep = (lambda name: True) if not args.layers else (
        lambda name: name.startswith("layers.") and int(name.split(".")[1]) < args.layers)
    rules = classify_parameters(model)
    return [(name, tuple(p.shape), rules[name].split) for name, p in model.named_parameters()
            if rules[name].optimizer == "muon" and keep(name)]


def muon_only(args: argparse.Namespace, ctx: mg.Ctx) -> int:
    """The Muon step alone on the model's matrices, sharded on dim 0 over the ranks as FSDP2 shards them
    (one plain process: unsharded), from fixed gradients: seconds of Newton-Schulz and of the step, per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import kimik3.optim.muon as muon_module
    from kimik3.optim import Muon

    matrices = muon_matrices(args)
    mesh = init_device_mesh(ctx.device_type, (ctx.world,)) if ctx.world > 1 else None
    gen = torch.Generator().manual_seed(args.seed)
    groups: dict[tuple, list] = {}
    for name, shape, split in matrices:
        weight, grad = torch.randn(shape, generator=gen) * 0.02, torch.randn(shape, generator=gen)
        if mesh is not None:
            weight = distribute_tensor(weight.to(ctx.device), mesh, [Shard(0)], src_data_rank=None)
            grad = distribute_tensor(grad.to(ctx.device), mesh, [Shard(0)], src_data_rank=None)
        param = torch.nn.Parameter(weight.to(ctx.device))
        param.grad = grad.to(ctx.device)
        groups.setdefault(split, []).append((name, param))
    ns_dtype = torch.bfloat16 if ctx.device_type == "cuda" else torch.float32
    optimizer = Muon([{"params": members, "split": split} for split, members in groups.items()], lr=1e-3,
                     ns_dtype=ns_dtype)
    ns_seconds = [0.0]

    def timed_ns(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            ctx.sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            ctx.sync()
            ns_seconds[0] += time.perf_counter() - t0
            return out
        return wrapper

    # Newton-Schulz as every module of the optimizer calls it (by its module-level name)
    for module in [muon_module, *[sys.modules[n] for n in ("kimik3.optim.sharded",) if n in sys.modules]]:
        module.newton_schulz = timed_ns(module.newton_schulz)
    elements = sum(math.prod(shape) for _, shape, _ in matrices)
    ctx.log(f"[muon] {len(matrices)} matrices, {elements / 1e6:.1f}M elements, {ctx.world} rank(s), "
            f"ns_dtype {ns_dtype}")
    steps, ns = [], []
    for step in range(args.steps):
        ns_seconds[0] = 0.0
        dist.barrier()
        ctx.sync()
        t0 = time.perf_counter()
        optimizer.step()
        ctx.sync()
        seconds = time.perf_counter() - t0
        ctx.log(f"[muon] step {step + 1}/{args.steps} {seconds:.3f} s{'' if step >= args.warmup else ' (warm-up)'}")
        if step >= args.warmup:
            steps.append(seconds)
            ns.append(ns_seconds[0])
    per_rank = ctx.gather([mg.median(ns), mg.median(steps)])
    rows = [[str(r), mg.fmt(v[0]), mg.fmt(v[1])] for r, v in enumerate(per_rank)]
    rows.append(["max", mg.fmt(max(v[0] for v in per_rank)), mg.fmt(max(v[1] for v in per_rank))])
    ctx.log(f"\nMuon step, {args.label}, {ctx.world} x {ctx.device_type} ({torch.get_num_threads()} thread(s) each), "
            f"{args.config or args.preset}{f' first {args.layers} layers' if args.layers else ''}, "
            f"median of {len(steps)} steps after {args.warmup} warm-up")
    ctx.log(mg.table(["rank", "Newton-Schulz s", "step s"], rows))
    payload = {**mg.meta(ctx, "step-phases-muon", args), "label": args.label, "per_rank": per_rank,
               "matrices": len(matrices), "elements": elements}
    if ctx.rank == 0:
        mg.write_json(args, f"step-phases-muon-{args.label}", payload)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", required=True, choices=["ep", "fsdp", "none", "muon"],
                   help="muon: the Muon optimizer step alone (muon_only)")
    p.add_argument("--layers", type=int, default=0, help="muon: only the first N blocks' matrices (0: all)")
    p.add_argument("--label", default="", help="muon: a name for the run in the table and the JSON file")
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
    if args.parallel == "muon":
        return muon_only(args, ctx)
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
    top = {name: v for name, v in phases.items() if not name.startswith(SUB)}
    rows = [["step", mg.fmt(mg.median(steps))]]
    rows += [[name, mg.fmt(mg.median(v))] for name, v in sorted(top.items())]
    rows.append(["rest (step minus the phases above)",
                 mg.fmt(mg.median(steps) - sum(mg.median(v) for v in top.values()))])
    rows += [[name, mg.fmt(mg.median(v))] for name, v in sorted(phases.items()) if name.startswith(SUB)]
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
