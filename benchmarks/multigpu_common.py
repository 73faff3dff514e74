"""Shared plumbing of the multi-GPU benchmarks (``multigpu.py`` and its subcommand modules,
``step_phases.py``): the process context, timers, tables and JSON, the model-FLOPs formula, and
the trainer-driven training loop. Importing it forces NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before torch touches a GPU (issue 7
and the device README: no NVLink multicast).
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import argparse
import dataclasses
import datetime
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimik3.config import K3Config
from kimik3.config.params import param_counts

GiB = 1024 ** 3


# ============================================================================ process plumbing
class Ctx:
    """This process's place in the run."""

    def __init__(self, device_type: str):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # one host: loopback (as `kimik3 train --nproc`)
        from kimik3.parallel.mesh import init_distributed

        if not init_distributed(device_type):
            raise SystemExit("multigpu.py: launch it with torchrun (torchrun --nproc_per_node N benchmarks/"
                             "multigpu.py ...); --nproc_per_node 1 works too")
        self.device_type = device_type
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        if device_type == "cpu":
            torch.set_flush_denormal(True)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's ``values`` (same length everywhere), on every rank: [world][n]."""
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return torch.stack(out).tolist()

    def reset_peak(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int:
        """Peak bytes since ``reset_peak``: CUDA allocator on GPUs; on CPU the process's peak RSS
        (lifetime: it cannot be reset)."""
        if self.device_type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def free(self) -> None:
        gc.collect()
        if self.device_type == "cuda":
            torch.cuda.empty_cache()


class ExpertTimer:
    """Per-rank time in the expert grouped matmuls of the EP layers' forward.

    Wraps the ``grouped_mm`` that ``kimik3.parallel.moonep`` calls (a script-side patch, library
    untouched): CUDA events around each call on GPUs, wall time on CPU. Forward only (the backward's
    matmuls scale with the same rows). ``take()`` after a synchronised step returns the seconds
    spent since the last ``take()``."""

    def __init__(self, ctx: Ctx):
        from kimik3.parallel import moonep

        self.ctx, self.module, self.original = ctx, moonep, moonep.grouped_mm
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.seconds = 0.0
        moonep.grouped_mm = self._timed

    def _timed(self, *args, **kwargs):
        if self.ctx.device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.original(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = self.original(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out

    def take(self) -> float:
        total = self.seconds + sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        self.seconds, self.events = 0.0, []
        return total

    def close(self) -> None:
        self.module.grouped_mm = self.original


def meta(ctx: Ctx, sub: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "subcommand": sub,
        "command": "torchrun --nproc_per_node {} benchmarks/multigpu.py {}".format(ctx.world, " ".join(sys.argv[1:])),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "world": ctx.world,
        "backend": ctx.backend,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device_type == "cuda" else "cpu",
        "torch": torch.__version__,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS", "KIMIK3_KDA_BACKEND")},
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }


def write_json(args: argparse.Namespace, name: str, payload: dict[str, Any]) -> Path | None:
    path = Path(args.json) if args.json else (Path(os.environ["OUT"]) / f"multigpu-{name}.json"
                                              if os.environ.get("OUT") else None)
    if path is None:
        print("(no $OUT and no --json: JSON not written)", flush=True)
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


# ============================================================================ model FLOPs
def model_flops_per_token(config: K3Config, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (module docstring has the formula)."""
    counts = param_counts(config)
    m = config.moe
    idle_routed = counts["routed_per_layer"] * (1 - m.top_k / m.num_experts)
    head = config.dim * config.vocab_size
    mtp_active = 0.0
    if config.mtp.num_modules:
        mtp_active = counts["mtp"] - config.mtp.num_modules * idle_routed + config.mtp.num_modules * head
    dense = 6.0 * (counts["active"] + mtp_active)
    mla = config.mla
    mla_layers = len(config.mla_layer_indices) + config.mtp.num_modules     # the MTP block is MLA
    attn = mla_layers * 3.0 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * (seq_len + 1)
    kda_layers = config.num_layers - len(config.mla_layer_indices)
    K = V = config.kda_head_dim
    C = config.kda.chunk_size
    kda = kda_layers * 3.0 * config.kda.num_heads * (6 * K * V + C * (K + V))
    return {"total": dense + attn + kda, "matmul_6N": dense, "mla_attention": attn, "kda": kda,
            "active_params": float(counts["active"]), "mtp_active_params": float(mtp_active)}


# ============================================================================ trainer-driven runs
def model_config_file(args: argparse.Namespace, tmp: Path) -> tuple[K3Config, str]:
    """The model of ``--config`` (a K3Config JSON) or ``--preset``, with ``--vocab``'s vocabulary when
    given, written where every rank reads it."""
    config = K3Config.from_json(args.config) if args.config else K3Config.preset(args.preset)
    if args.vocab:
        config = dataclasses.replace(config, vocab_size=args.vocab, name=f"{config.name}-v{args.vocab}")
    path = tmp / f"config-{os.getpid()}.json"      # every rank writes its own copy (same content)
    path.write_text(config.to_json())
    return config, str(path)


def train_args(args: argparse.Namespace, ctx_world: int, config_path: str, out: str, steps: int):
    from kimik3.train.trainer import TrainArgs

    return TrainArgs(config_path=config_path, data=args.data, steps=steps, out=out, seed=args.seed,
                     seq_len=args.seq_len, batch_size=args.rows_per_rank * ctx_world, lr=args.lr,
                     device=args.device, eval_every=10 ** 9, checkpoint_every=10 ** 9,
                     balance=args.router_balance, progress=False)


def ep_modules(model: torch.nn.Module) -> list:
    from kimik3.parallel.moonep import EPRoutedExperts

    return [m for m in model.modules() if isinstance(m, EPRoutedExperts)]


def train_loop(ctx: Ctx, trainer, steps: int, budget_s: float, label: str, log_every: int,
               quotas: bool) -> dict[str, Any]:
    """Run ``trainer.train_step`` for up to ``steps`` steps (stopping when rank 0 passes ``budget_s``);
    every rank's synchronised step time and, under EP, the tokens each rank computed per layer."""
    modules = ep_modules(trainer.model) if quotas else []
    timer = ExpertTimer(ctx) if modules else None
    expert_times: list[list[float]] = []     # [step][rank]: expert forward matmul seconds
    trainer.started = time.perf_counter()
    losses: list[float] = []
    times: list[list[float]] = []            # [step][rank]
    imbalance: list[float] = []              # per step: mean over MoE layers of max/mean rank tokens
    imbalance_worst: list[float] = []        # per step: worst layer
    tokens = 0
    start = time.perf_counter()
    for step in range(steps):
        ctx.sync()
        t0 = time.perf_counter()
        record = trainer.train_step(step, steps)
        ctx.sync()
        dt = time.perf_counter() - t0
        tokens = record["batch_size"] * record["seq_len"]
        losses.append(float(record["loss"]))
        if modules:
            per_rank = torch.stack([m.last_quota.sum(0) for m in modules if m.last_quota is not None]).double()
            ratios = (per_rank.max(1).values / per_rank.mean(1).clamp_min(1e-9)).tolist()
            imbalance.append(float(sum(ratios) / len(ratios)))
            imbalance_worst.append(float(max(ratios)))
        elapsed = time.perf_counter() - start
        gathered = ctx.gather([dt, elapsed, timer.take() if timer else 0.0])
        times.append([row[0] for row in gathered])
        if timer:
            expert_times.append([row[2] for row in gathered])
        if step == 0 or (step + 1) % log_every == 0 or step + 1 == steps:
            spread = max(times[-1]) / max(min(times[-1]), 1e-12)
            extra = (f" rank tokens max/mean {imbalance[-1]:.3f}, expert fwd max/min "
                     f"{max(expert_times[-1]) / max(min(expert_times[-1]), 1e-12):.3f}") if imbalance else ""
            ctx.log(f"[{label}] step {step + 1}/{steps} loss {losses[-1]:.4f} step {max(times[-1]):.3f} s "
                    f"(rank spread {spread:.3f}){extra}")
        if gathered[0][1] > budget_s and step + 1 < steps:    # rank 0's clock decides for everyone
            ctx.log(f"[{label}] stopping after {step + 1} steps: budget {budget_s:.0f} s spent")
            break
    if timer:
        timer.close()
    return {"losses": losses, "step_times_s": times, "tokens_per_step": tokens, "expert_fwd_times_s": expert_times,
            "rank_tokens_max_over_mean": imbalance, "rank_tokens_max_over_mean_worst_layer": imbalance_worst}


def summarise_times(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    times = run["step_times_s"]
    timed = times[warmup:] if len(times) > warmup else times[-1:]
    step_max = [max(t) for t in timed]                 # a step ends when its slowest rank does
    spread = [max(t) / max(min(t), 1e-12) for t in timed]
    out = {
        "steps_run": len(times),
        "steps_timed": len(timed),
        "step_time_s_median": median(step_max),
        "tokens_per_s": run["tokens_per_step"] / median(step_max) if step_max else float("nan"),
        "step_time_spread_median": median(spread),
        "step_time_spread_mean": float(sum(spread) / len(spread)),
        "step_time_spread_max": float(max(spread)),
    }
    expert = run.get("expert_fwd_times_s") or []
    expert = expert[warmup:] if len(expert) > warmup else expert[-1:]
    if expert:
        out["expert_fwd_s_max_rank_median"] = median([max(t) for t in expert])
        out["expert_fwd_time_max_over_min_median"] = median([max(t) / max(min(t), 1e-12) for t in expert])
        out["expert_fwd_time_max_over_mean_median"] = median([max(t) / max(sum(t) / len(t), 1e-12) for t in expert])
    imb = run["rank_tokens_max_over_mean"]
    if imb:
        out["rank_tokens_max_over_mean_mean"] = float(sum(imb) / len(imb))
        out["rank_tokens_max_over_mean_worst"] = float(max(run["rank_tokens_max_over_mean_worst_layer"]))
    return out


def broadcast_tmpdir(ctx: Ctx) -> Path:
    """One scratch folder for the run, named by rank 0 (bytes through a tensor), created by every rank."""
    raw = str(Path(tempfile.gettempdir()) / f"kimik3-multigpu-{uuid.uuid4().hex[:12]}").encode()
    data = torch.zeros(512, dtype=torch.uint8, device=ctx.device)
    data[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=ctx.device)
    dist.broadcast(data, src=0)
    path = Path(bytes(b for b in data.tolist() if b).decode())
    path.mkdir(parents=True, exist_ok=True)
    return path


def single_process_reference(args: argparse.Namespace, config_path: str, tmp: Path, world: int) -> dict[str, Any]:
    """Rank 0 alone, after the process group is gone: the plain single-process trainer on the same
    global batches (``batch_size = rows_per_rank x world``)."""
    from kimik3.train.trainer import Trainer

    for name in ("WORLD_SIZE", "MASTER_ADDR"):   # init_distributed: no torchrun environment -> one process
        os.environ.pop(name, None)
    trainer = Trainer(train_args(args, world, config_path, str(tmp / "reference"), args.steps), log=lambda _: None)
    trainer.started = time.perf_counter()
    losses, times = [], []
    device = trainer.device
    start = time.perf_counter()
    for step in range(min(args.ref_steps, args.steps)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        record = trainer.train_step(step, args.steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(record["loss"]))
        if step == 0 or (step + 1) % args.log_every == 0:
            print(f"[single-process reference] step {step + 1} loss {losses[-1]:.4f} step {times[-1]:.3f} s",
                  flush=True)
        if time.perf_counter() - start > args.ref_budget_s:
            print(f"[single-process reference] stopping after {step + 1} steps: budget spent", flush=True)
            break
    tokens = args.rows_per_rank * world * args.seq_len
    timed = times[args.warmup:] or times[-1:]
    return {"losses": losses, "steps_run": len(losses), "tokens_per_s": tokens / median(timed),
            "step_time_s_median": median(timed)}


def loss_match(losses: list[float], reference: list[float]) -> dict[str, Any]:
    n = min(len(losses), len(reference))
    if n == 0:
        return {"steps_compared": 0}
    diffs = [abs(a - b) for a, b in zip(losses[:n], reference[:n])]
    return {"steps_compared": n, "max_abs_diff": max(diffs),
            "max_rel_diff": max(d / max(abs(b), 1e-12) for d, b in zip(diffs, reference[:n])),
            "final_abs_diff": diffs[-1], "loss_first": losses[0], "loss_last_compared": losses[n - 1],
            "reference_first": reference[0], "reference_last_compared": reference[n - 1]}


