"""Issue 7's multi-GPU measurements: MoonEP expert parallelism, KDA context parallelism, FSDP2.

One measurement per call, every rank launched by torchrun (NCCL on GPUs, gloo with --device cpu)::

    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py ep            # debug preset, MoonEP vs none
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py ep --wide-moe # one K3-shaped MoE layer
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py kcp           # one 64K-token sequence
    torchrun --standalone --nproc_per_node N benchmarks/multigpu.py fsdp          # debug preset, dp = N

Each prints progress lines (flushed), then a markdown table, and rank 0 writes the JSON to
``$OUT/multigpu-<sub>.json`` (``multigpu-ep-wide.json`` for ``ep --wide-moe``; ``--json PATH``
overrides; nothing is written when neither is set). NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are forced at import, before torch
touches a GPU (issue 7 and the device README: no NVLink multicast).

What each subcommand measures
-----------------------------
``ep``: the trainer itself (``Trainer(TrainArgs(...), parallel=ParallelDims(dp=N, ep=N))``,
driven step by step through ``Trainer.train_step``, no checkpoints or evaluation), once per
``--balance`` mode: ``moonep`` (MoonEP's perfectly balanced plan) and ``none`` (every expert on its
owner: ``kimik3.parallel.moonep.PLANNERS["none"]``, set on every ``EPRoutedExperts`` after the
trainer built it). Same seed, same batches, same initial weights in both. Per run: global tokens/s
(median step), the per-step spread of step times over ranks (max/min, each rank's own
synchronised wall time of ``train_step``), the tokens each rank computed per MoE layer-step from
``EPRoutedExperts.last_quota`` (max/mean over ranks: 1.000 is perfect balance), peak memory per
rank, and the loss curve. Afterwards the process group is destroyed and rank 0 alone trains the
same steps as a plain single-process ``Trainer`` (the global batch on one device) for the loss
comparison, up to ``--ref-steps`` / ``--ref-budget-s`` (or ``--reference JSON`` reads an earlier
one, ``--no-reference`` skips it). Router-bias balancing (Quantile Balancing) stays on
(``--router-balance``), as in K3 training. The vocabulary is cut to 16K by default (``--vocab``:
the 164K BPE is not worth training on the stdlib corpus; 0 keeps the preset's).

``ep --wide-moe``: one ``LatentMoE`` at K3's shapes (D=7168, 896 experts of hidden 3072 in a 3584
latent, top-16, 2 shared experts; all flags), built on the meta device, expert-sharded with
``apply_expert_parallel`` and materialised in bf16 (only this rank's experts ever exist). The router
gets a Zipf-shaped selection bias (``--skew``: bias_e = -skew * log(1 + popularity rank of e), the
popularity order a random permutation) so that plain EP is imbalanced, as trained routers are.
Timed: forward + backward of ``--tokens-per-rank`` tokens per rank, MoonEP vs none on the same
weights and inputs (their outputs are compared too: the same math, placed differently).

``kcp``: one sequence of ``--tokens`` tokens (B=1, H=--heads, K=V=--head-dim, fp32 by default)
split into contiguous segments over the first P ranks, for P = 2, 4, 8, ... up to the world (and
the world itself): ``kimik3.parallel.kcp.kcp_kda`` forward + backward (loss sum(o * dO) with a
fixed random dO). The single-GPU reference is ``chunk_kda`` on the whole sequence, run by every
rank at once (each on its own GPU: the same time as rank 0 alone) and timed on rank 0; its outputs
and gradients are the truth the KCP runs are compared with (max abs error / max abs value).
Memory: a 4K-token probe measures chunk_kda's bytes per token (V = D, and V = 2D as a KCP rank
carries the transition columns); runs predicted to exceed ``--mem-fraction`` of a GPU are skipped
on every rank alike. The torch KDA path keeps ~2.4 MB per token at H=96, D=128 (CPU measurement;
the Triton kernels, the CUDA default, keep their own amount, which the probe measures), so one H200
may hold only tens of thousands of tokens: when the whole sequence does not fit, T1
is measured on the longest prefix T/2^j that does (or ``--single-tokens``) and scaled linearly,
and one extra KCP run over all ranks at that length checks the errors. speed-up = T1 / TP,
scaling efficiency = T1 / (P x TP).

``fsdp``: the trainer with ``ParallelDims(dp=N)`` (FSDP2, bf16 compute, fp32 reduction) on the
``debug`` preset: tokens/s (median step after ``--warmup``) and MFU.

MFU, model FLOPs per token (``model_flops_per_token``; training = 3 x forward, forward = 2 FLOPs per
multiply-add):
    6 x (active params + MTP active params)
        active (``kimik3.config.params.param_counts``): everything a token computes with, routed
        experts at top_k / E, the input embedding (a lookup) excluded, the output head included;
        MTP: its block (routed experts at top_k / E) and projection, plus the head it re-uses.
  + MLA layers (the model's and MTP's): 3 x H x (d_qk + d_v) x (T + 1)   [causal QK^T and AV,
        (T + 1) / 2 keys on average]
  + KDA layers: 3 x H x (6 K V + C (K + V))   [per token and head: three K x V products (readout
        q^T S, k^T S of the delta rule, the rank-1 state update) and the intra-chunk causal scores
        and values over C/2 tokens on average, C = chunk size 64]
MFU = tokens/s x FLOPs/token / (N x peak); peak = the H200's dense bf16 989 TFLOP/s (``--peak-tflops``).

Expected wall time on 8 H200s, defaults (estimates from the one-GPU figures in BENCHMARKS.md; not
yet measured): ``ep`` ~6-7 min (startup and 16K tokenizer ~1 min, each mode capped at
``--budget-s`` 120 s, the single-GPU reference at ``--ref-budget-s`` 75 s); ``ep --wide-moe`` ~2 min;
``kcp`` ~2 min; ``fsdp`` ~2-3 min. Every timed loop also stops at its budget, so the calls stay
inside the device tool's 10-minute limit; raise ``--steps``/budgets for longer runs.

CPU smoke (gloo, toy sizes; ``tests/parallel/test_multigpu_script.py`` runs these)::

    torchrun --standalone --nproc_per_node 2 benchmarks/multigpu.py ep --device cpu --preset tiny \\
        --vocab 0 --steps 4 --seq-len 64 --rows-per-rank 2
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
import shutil
import statistics
import sys
import tempfile
import time
import types
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
    config = K3Config.preset(args.preset)
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


# ============================================================================ ep
def cmd_ep(args: argparse.Namespace) -> None:
    if args.wide_moe:
        return cmd_ep_wide(args)
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.parallel.moonep import PLANNERS
    from kimik3.train.trainer import Trainer

    ctx = Ctx(args.device)
    tmp = broadcast_tmpdir(ctx)
    config, config_path = model_config_file(args, tmp)
    modes = [m.strip() for m in args.balance.split(",") if m.strip()]
    for mode in modes:
        if mode not in PLANNERS:
            raise SystemExit(f"--balance: unknown mode {mode!r}; choose from {sorted(PLANNERS)}")
    ctx.log(f"ep: {ctx.world} ranks ({dist.get_backend()}), preset {config.name}, {config.moe.num_experts} experts "
            f"top-{config.moe.top_k}, {args.rows_per_rank} x {args.seq_len} tokens per rank, up to {args.steps} "
            f"steps per mode, modes {modes}")
    runs: dict[str, Any] = {}
    try:
        for mode in modes:
            ctx.reset_peak()
            t0 = time.perf_counter()
            trainer = Trainer(train_args(args, ctx.world, config_path, str(tmp / f"ep-{mode}"), args.steps),
                              log=lambda _: None, parallel=ParallelDims(dp=ctx.world, ep=ctx.world))
            for module in ep_modules(trainer.model):
                module.planner = PLANNERS[mode]
            ctx.log(f"[ep {mode}] trainer built in {time.perf_counter() - t0:.1f} s "
                    f"({len(ep_modules(trainer.model))} expert-parallel MoE layers)")
            run = train_loop(ctx, trainer, args.steps, args.budget_s, f"ep {mode}", args.log_every, quotas=True)
            run.update(summarise_times(run, args.warmup))
            run["peak_memory_bytes"] = [int(row[0]) for row in ctx.gather([float(ctx.peak_memory())])]
            runs[mode] = run
            del trainer
            ctx.free()
    finally:
        dist.barrier()
    dist.destroy_process_group()
    if ctx.rank != 0:
        return
    reference, reference_error = None, None
    if args.reference:
        reference = json.loads(Path(args.reference).read_text())["reference"]
    elif not args.no_reference:
        print(f"single-process reference on rank 0's device: up to {args.ref_steps} steps of the global batch",
              flush=True)
        try:
            reference = single_process_reference(args, config_path, tmp, ctx.world)
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as err:   # keep the EP results
            print(f"single-process reference failed: {type(err).__name__}: {err}", flush=True)
            reference = None
            reference_error = f"{type(err).__name__}: {err}"
    shutil.rmtree(tmp, ignore_errors=True)

    payload = meta(ctx, "ep", args)
    payload.update(mode="train", preset=config.name, model_config=config.to_dict(), runs=runs,
                   reference=reference, reference_error=reference_error, loss_match={})
    rows = []
    for mode, run in runs.items():
        match = loss_match(run["losses"], reference["losses"]) if reference else {}
        payload["loss_match"][mode] = match
        rows.append([mode, run["steps_run"], f"{run['tokens_per_s']:,.0f}", f"{run['step_time_s_median']:.3f}",
                     f"{run['step_time_spread_median']:.3f} / {run['step_time_spread_max']:.3f}",
                     f"{fmt(run.get('rank_tokens_max_over_mean_mean'))} / {fmt(run.get('rank_tokens_max_over_mean_worst'))}",
                     f"{fmt(run.get('expert_fwd_time_max_over_mean_median'))}",
                     f"{max(run['peak_memory_bytes']) / GiB:.2f}",
                     f"{fmt(match.get('max_abs_diff'), '.2e')} ({match.get('steps_compared', 0)} steps)"])
    if len(runs) == 2 and all(m in runs for m in ("moonep", "none")):
        a, b = runs["moonep"]["losses"], runs["none"]["losses"]
        payload["loss_match"]["moonep_vs_none"] = loss_match(a, b)
        payload["speedup_moonep_over_none"] = runs["moonep"]["tokens_per_s"] / runs["none"]["tokens_per_s"]
    print()
    print(f"Expert parallel, {ctx.world} x {payload['device']}, {config.name}, {args.rows_per_rank} x {args.seq_len} "
          f"tokens per rank per step ({args.warmup} warm-up steps not timed)")
    print(table(["balance", "steps", "tokens/s", "step s (median)", "rank time max/min (median / worst)",
                 "rank tokens max/mean (mean / worst layer)", "expert fwd time max/mean", "peak mem GiB (max rank)", "max abs Δloss vs 1 process"],
                rows))
    if reference:
        print(f"single-process reference: {reference['steps_run']} steps, {reference['tokens_per_s']:,.0f} tokens/s, "
              f"losses {', '.join(f'{x:.4f}' for x in reference['losses'][:5])} ...")
    if "speedup_moonep_over_none" in payload:
        print(f"MoonEP / none tokens/s: {payload['speedup_moonep_over_none']:.3f}; "
              f"max |Δloss| moonep vs none: {fmt(payload['loss_match']['moonep_vs_none'].get('max_abs_diff'), '.2e')}")
    write_json(args, "ep", payload)


def build_wide_moe(args: argparse.Namespace, ctx: Ctx, group) -> torch.nn.Module:
    """A LatentMoE at the flagged shapes with only this rank's experts materialised (bf16 on GPU)."""
    from kimik3.config.schema import MoEConfig
    from kimik3.model.moe import LatentMoE
    from kimik3.parallel.moonep import apply_expert_parallel

    moe_cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, latent_dim=args.latent,
                        expert_hidden=args.hidden, num_shared_experts=args.shared, shared_hidden=args.hidden)
    config = types.SimpleNamespace(dim=args.dim, moe=moe_cfg, norm_eps=1e-5)   # all LatentMoE reads
    with torch.device("meta"):
        moe = LatentMoE(config)
    apply_expert_parallel(moe, group, planner="moonep")          # expert weights: this rank's E/R, still meta
    dtype = torch.bfloat16 if ctx.device_type == "cuda" else torch.float32
    moe.to_empty(device=ctx.device)
    moe.to(dtype)                                                 # no fp32 copy of the experts ever exists
    shared_gen = torch.Generator(device=ctx.device).manual_seed(args.seed)          # replicated parts
    local_gen = torch.Generator(device=ctx.device).manual_seed(args.seed + 1 + ctx.rank)  # this rank's experts
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if p.ndim == 1:                                        # norm weights
                p.fill_(1.0)
                continue
            fan_in = p.shape[-2] if p.ndim == 3 else p.shape[-1]
            gen = local_gen if name.startswith("experts.") else shared_gen
            p.copy_(torch.randn(p.shape, generator=gen, device=ctx.device, dtype=dtype).mul_(fan_in ** -0.5))
        popularity = torch.randperm(args.experts, generator=shared_gen, device=ctx.device)
        bias = -args.skew * torch.log1p(popularity.float())
        moe.router.expert_bias = bias.float()                     # fp32 buffer, as the model keeps it
    return moe


def cmd_ep_wide(args: argparse.Namespace) -> None:
    from kimik3.parallel.moonep import PLANNERS

    ctx = Ctx(args.device)
    if args.experts % ctx.world:
        raise SystemExit(f"--experts {args.experts} must divide over {ctx.world} ranks")
    group = dist.group.WORLD
    ctx.log(f"ep --wide-moe: {ctx.world} ranks, D={args.dim}, {args.experts} experts of hidden {args.hidden} in a "
            f"{args.latent} latent, top-{args.top_k}, {args.shared} shared; {args.tokens_per_rank} tokens per rank")
    ctx.reset_peak()
    t0 = time.perf_counter()
    moe = build_wide_moe(args, ctx, group)
    ctx.sync()
    ctx.log(f"layer built in {time.perf_counter() - t0:.1f} s: {args.experts // ctx.world} experts per rank "
            f"({sum(p.numel() for p in moe.experts.parameters()) * moe.experts.w_gate_ELF.element_size() / GiB:.2f} "
            "GiB of expert weights)")
    dtype = moe.routed_down.weight.dtype
    gen = torch.Generator(device=ctx.device).manual_seed(args.seed + 1000 + ctx.rank)
    x = torch.randn(args.tokens_per_rank, args.dim, generator=gen, device=ctx.device).to(dtype)
    upstream = torch.randn(args.tokens_per_rank, args.dim, generator=gen, device=ctx.device).to(dtype)
    modes = [m.strip() for m in args.balance.split(",") if m.strip()]
    runs: dict[str, Any] = {}
    outputs = {}
    timer = ExpertTimer(ctx)
    for mode in modes:
        moe.experts.planner = PLANNERS[mode]
        with torch.no_grad():
            outputs[mode] = moe(x).float()
        ctx.free()
        ctx.reset_peak()
        times, imbalance, expert_times = [], [], []
        ctx.sync()
        timer.take()
        for it in range(args.warmup + args.iters):
            ctx.sync()
            t_start = time.perf_counter()
            out = moe(x)
            (out.float() * upstream.float()).sum().backward()
            ctx.sync()
            dt = time.perf_counter() - t_start
            moe.zero_grad(set_to_none=True)
            del out
            per_rank = moe.experts.last_quota.sum(0).double()
            imbalance.append(float(per_rank.max() / per_rank.mean().clamp_min(1e-9)))
            gathered = ctx.gather([dt, timer.take()])
            if it >= args.warmup:
                times.append([row[0] for row in gathered])
                expert_times.append([row[1] for row in gathered])
            ctx.log(f"[wide-moe {mode}] iter {it + 1}/{args.warmup + args.iters} fwd+bwd {max(r[0] for r in gathered):.4f} s "
                    f"rank tokens max/mean {imbalance[-1]:.3f}{' (warm-up)' if it < args.warmup else ''}")
        step_max = [max(t) for t in times]
        spread = [max(t) / max(min(t), 1e-12) for t in times]
        quota = moe.experts.last_quota
        owner = torch.arange(args.experts, device=quota.device) // (args.experts // ctx.world)
        foreign = ((quota > 0) & (owner[:, None] != torch.arange(ctx.world, device=quota.device)[None])).sum(0)
        loads = quota.sum(1).double()
        runs[mode] = {
            "fwd_bwd_s_median": median(step_max),
            "tokens_per_s": args.tokens_per_rank * ctx.world / median(step_max),
            "step_time_spread_median": median(spread), "step_time_spread_max": max(spread),
            "expert_fwd_time_max_over_mean_median": median([max(t) / max(sum(t) / len(t), 1e-12) for t in expert_times]),
            "expert_fwd_times_s": expert_times,
            "rank_tokens_max_over_mean_mean": float(sum(imbalance[args.warmup:]) / max(1, len(imbalance[args.warmup:]))),
            "expert_load_max_over_mean": float(loads.max() / loads.mean().clamp_min(1e-9)),
            "foreign_experts_max_per_rank": int(foreign.max()), "replicas_total": int(foreign.sum()),
            "peak_memory_bytes": [int(row[0]) for row in ctx.gather([float(ctx.peak_memory())])],
            "times_s": times,
        }
    timer.close()
    errors = {}
    if len(outputs) == 2:
        a, b = outputs.values()
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        errors["max_rel_err_between_modes"] = max(row[0] for row in ctx.gather([err]))
    dist.barrier()
    dist.destroy_process_group()
    if ctx.rank != 0:
        return
    payload = meta(ctx, "ep", args)
    payload.update(mode="wide-moe", runs=runs, output_agreement=errors,
                   shapes={"dim": args.dim, "experts": args.experts, "hidden": args.hidden, "latent": args.latent,
                           "top_k": args.top_k, "shared": args.shared, "tokens_per_rank": args.tokens_per_rank,
                           "skew": args.skew})
    if "moonep" in runs and "none" in runs:
        payload["speedup_moonep_over_none"] = runs["none"]["fwd_bwd_s_median"] / runs["moonep"]["fwd_bwd_s_median"]
    print()
    print(f"One MoE layer, {ctx.world} x {payload['device']}: D={args.dim}, E={args.experts}, F={args.hidden}, "
          f"L={args.latent}, top-{args.top_k}, {args.tokens_per_rank} tokens per rank, skew {args.skew} "
          f"(median of {args.iters} fwd+bwd after {args.warmup} warm-up)")
    rows = [[mode, f"{r['fwd_bwd_s_median'] * 1e3:.2f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['step_time_spread_median']:.3f}", f"{r['rank_tokens_max_over_mean_mean']:.3f}",
             f"{r['expert_fwd_time_max_over_mean_median']:.3f}",
             f"{r['expert_load_max_over_mean']:.2f}", f"{r['foreign_experts_max_per_rank']} / {r['replicas_total']}",
             f"{max(r['peak_memory_bytes']) / GiB:.2f}"] for mode, r in runs.items()]
    print(table(["balance", "fwd+bwd ms", "tokens/s", "rank time max/min", "rank tokens max/mean", "expert fwd time max/mean",
                 "expert load max/mean", "foreign experts max per rank / total", "peak mem GiB"], rows))
    if "speedup_moonep_over_none" in payload:
        print(f"MoonEP speed-up over none: {payload['speedup_moonep_over_none']:.3f}x; outputs agree to "
              f"{errors.get('max_rel_err_between_modes', float('nan')):.2e} (max abs err / max abs)")
    write_json(args, "ep-wide", payload)


# ============================================================================ kcp
KCP_BLOCK = 4096   # inputs are generated in blocks of this many tokens, each from its own seed


def kcp_inputs(args: argparse.Namespace, ctx: Ctx, lo: int, hi: int):
    """Tokens [lo, hi) of the sequence's inputs (q, k, v, g, beta) and output gradient dO.

    Generated block by block on the device, block b from seed (seed, b), so any slice is the same
    on every rank and no rank ever holds more of the sequence than it asks for."""
    H, D = args.heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    parts: list[list[torch.Tensor]] = []
    first, last = lo // KCP_BLOCK, (hi - 1) // KCP_BLOCK if hi > lo else lo // KCP_BLOCK - 1
    for block in range(first, last + 1):
        n = min(KCP_BLOCK, args.tokens - block * KCP_BLOCK)
        gen = torch.Generator(device=ctx.device).manual_seed(args.seed * 1_000_003 + block)

        def randn(*shape, gen=gen):
            return torch.randn(*shape, generator=gen, device=ctx.device)

        q = torch.nn.functional.normalize(randn(1, n, H, D), dim=-1)
        k = torch.nn.functional.normalize(randn(1, n, H, D), dim=-1)
        v = randn(1, n, H, D)
        # log-decays in (-5, 0], most close to 0: long memories, so the state carried across segments matters
        g = -5.0 * torch.rand(1, n, H, D, generator=gen, device=ctx.device) ** 8
        beta = torch.rand(1, n, H, generator=gen, device=ctx.device)
        d_o = randn(1, n, H, D)
        cut = slice(max(lo - block * KCP_BLOCK, 0), min(hi - block * KCP_BLOCK, n))
        parts.append([t[:, cut] for t in (q, k, v, g, beta, d_o)])
    tensors = [torch.cat(ts, dim=1).to(dtype) for ts in zip(*parts)]
    return tensors[:5], tensors[5]


def fwd_bwd_times(ctx: Ctx, fn, inputs: list[torch.Tensor], d_o: torch.Tensor, warmup: int, iters: int, label: str):
    """Median seconds of forward + backward of ``fn(*leaves)``; returns (median, last output, last leaves)."""
    times = []
    for it in range(warmup + iters):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        ctx.sync()
        t0 = time.perf_counter()
        o, _ = fn(*leaves)
        (o.float() * d_o.float()).sum().backward()
        ctx.sync()
        dt = time.perf_counter() - t0
        if it >= warmup:
            times.append(dt)
        ctx.log(f"[{label}] iter {it + 1} fwd+bwd {dt:.4f} s{' (warm-up)' if it < warmup else ''}")
    return median(times), o.detach(), leaves


def cmd_kcp(args: argparse.Namespace) -> None:
    from kimik3.ops.kda import chunk_kda
    from kimik3.parallel.kcp import kcp_kda

    if args.kda_backend:
        os.environ["KIMIK3_KDA_BACKEND"] = args.kda_backend
    ctx = Ctx(args.device)
    T = args.tokens
    if args.ranks:
        sizes = [int(p) for p in args.ranks.split(",")]
    else:   # 2, 4, 8, ... up to the world, and the world itself
        sizes = sorted({2 ** i for i in range(1, 20) if 2 ** i <= ctx.world} | ({ctx.world} if ctx.world > 1 else set()))
    for p in sizes:
        if not 1 < p <= ctx.world:
            raise SystemExit(f"--ranks: {p} is not in 2..{ctx.world}")
    ctx.log(f"kcp: {T:,} tokens, H={args.heads}, K=V={args.head_dim}, {args.dtype}; rank counts {sizes}")

    # ---- memory: bytes per token of chunk_kda fwd+bwd (V = D: the single device; V = 2D: a KCP rank,
    # whose values carry the K transition columns), measured on a short probe; runs predicted not to
    # fit are skipped on every rank alike (an OOM inside a collective would hang the others)
    per_token = {"single": 0.0, "kcp": 0.0}
    limit = float("inf")
    if ctx.device_type == "cuda":
        probe = min(KCP_BLOCK, T)
        for name, width in (("single", args.head_dim), ("kcp", 2 * args.head_dim)):
            inputs, d_o = kcp_inputs(args, ctx, 0, probe)
            if width != args.head_dim:
                inputs[2] = torch.cat([inputs[2], torch.zeros_like(inputs[2])], dim=-1)
                d_o = torch.cat([d_o, torch.zeros_like(d_o)], dim=-1)
            ctx.free()
            ctx.reset_peak()
            base = torch.cuda.memory_allocated(ctx.device)
            fwd_bwd_times(ctx, chunk_kda, inputs, d_o, 0, 1, f"kcp memory probe, V={width}")
            per_token[name] = (torch.cuda.max_memory_allocated(ctx.device) - base) / probe
            del inputs, d_o
        per_token = dict(zip(per_token, (max(r) for r in zip(*ctx.gather(list(per_token.values()))))))
        limit = args.mem_fraction * torch.cuda.get_device_properties(ctx.device).total_memory
        ctx.log(f"memory: {per_token['single'] / 2**20:.2f} MiB/token single, {per_token['kcp'] / 2**20:.2f} MiB/token "
                f"per KCP rank; limit {limit / GiB:.0f} GiB per device")

    def fits(kind: str, tokens: int, keep: float = 0.0) -> bool:
        return per_token[kind] * tokens * 1.1 + keep <= limit

    # ---- P = 1: the sequence on one device (every rank at once, each on its own device; rank 0's time).
    # n1 = the whole sequence, or (if it does not fit, or --single-tokens) a shorter prefix: T1 is then
    # scaled linearly (KDA's cost is linear in the length) and the errors are checked at n1 tokens.
    reference = None
    t1 = float("nan")
    single: dict[str, Any] = {"status": "skipped"}
    n1 = min(args.single_tokens or T, T)
    while n1 > KCP_BLOCK and not fits("single", n1, keep=8 * n1 * args.heads * args.head_dim * 4):
        n1 //= 2
    if not args.no_single:
        inputs, d_o = kcp_inputs(args, ctx, 0, n1)
        t, o, leaves = fwd_bwd_times(ctx, chunk_kda, inputs, d_o, args.warmup, args.iters, "kcp P=1")
        reference = (o, [leaf.grad for leaf in leaves])
        single = {"status": "ok", "peak_memory_bytes": ctx.peak_memory(), "tokens": n1, "measured_fwd_bwd_s": t}
        del o, leaves, inputs, d_o
        ctx.free()
        t1 = ctx.gather([t * T / n1])[0][0]          # rank 0's time
        single["fwd_bwd_s"] = t1
        if n1 < T:
            single["extrapolated_from_tokens"] = n1
            ctx.log(f"[kcp P=1] T1 = {t1:.4f} s, extrapolated from {n1:,} tokens; errors checked on {n1:,} tokens")

    def kcp_run(p: int, tokens: int, label: str, timed: bool) -> dict[str, Any]:
        group = groups[p]
        active = ctx.rank < p
        base, extra = divmod(tokens, p)
        lengths = [base + (1 if r < extra else 0) for r in range(p)]
        held = sum(t.numel() * t.element_size() for t in [reference[0], *reference[1]]) if reference else 0
        if not fits("kcp", max(lengths), keep=held):
            ctx.log(f"[{label}] skipped: {max(lengths):,} tokens per rank need about "
                    f"{per_token['kcp'] * max(lengths) * 1.1 / GiB:.0f} GiB")
            return {"ranks": p, "tokens_per_rank": lengths, "status": "skipped (memory)"}
        check = reference is not None and tokens == n1
        times, o_err, g_err, peak = [], 0.0, 0.0, 0
        ctx.reset_peak()
        if active:
            lo = sum(lengths[:ctx.rank])
            seg = slice(lo, lo + lengths[ctx.rank])
            inputs, d_o = kcp_inputs(args, ctx, seg.start, seg.stop)
        warmup, iters = (args.warmup, args.iters) if timed else (0, 1)
        for it in range(warmup + iters):
            dt = 0.0
            if active:
                leaves = [t.detach().clone().requires_grad_() for t in inputs]
                ctx.sync()
                t0 = time.perf_counter()
                o, _ = kcp_kda(*leaves, group=group)
                (o.float() * d_o.float()).sum().backward()
                ctx.sync()
                dt = time.perf_counter() - t0
                if check and it == warmup + iters - 1:
                    ref_o, ref_g = reference
                    o_err = float((o.detach().float() - ref_o[:, seg].float()).abs().max()
                                  / ref_o.float().abs().max().clamp_min(1e-30))
                    g_err = max(float((leaf.grad.float() - rg[:, seg].float()).abs().max()
                                      / rg.float().abs().max().clamp_min(1e-30)) for leaf, rg in zip(leaves, ref_g))
                del o, leaves
                peak = ctx.peak_memory()
            gathered = ctx.gather([dt, o_err, g_err, float(peak)])
            step = max(row[0] for row in gathered[:p])
            if it >= warmup:
                times.append(step)
            ctx.log(f"[{label}] iter {it + 1} fwd+bwd {step:.4f} s{' (warm-up)' if it < warmup else ''}")
        if active:
            del inputs, d_o
        ctx.free()
        tp = median(times)
        return {"ranks": p, "tokens": tokens, "tokens_per_rank": lengths, "status": "ok", "fwd_bwd_s": tp,
                "max_output_err": max(r[1] for r in gathered[:p]) if check else None,
                "max_grad_err": max(r[2] for r in gathered[:p]) if check else None,
                "peak_memory_bytes": [int(r[3]) for r in gathered[:p]]}

    groups = {p: dist.new_group(list(range(p))) for p in sorted(set(sizes) | {ctx.world})}   # all ranks create each
    results = []
    for p in sizes:
        row = kcp_run(p, T, f"kcp P={p}", timed=True)
        if row["status"] == "ok":
            tp = row["fwd_bwd_s"]
            row["speedup"] = t1 / tp if not math.isnan(t1) else None
            row["efficiency"] = t1 / (p * tp) if not math.isnan(t1) else None
            ctx.log(f"[kcp P={p}] median {tp:.4f} s, speed-up {fmt(row['speedup'])}, efficiency "
                    f"{fmt(row['efficiency'])}, output err {fmt(row['max_output_err'], '.2e')}, grad err "
                    f"{fmt(row['max_grad_err'], '.2e')}")
        results.append(row)
    check_row = None
    if reference is not None and n1 < T and ctx.world > 1:     # the error check at the reference's length
        check_row = kcp_run(ctx.world, n1, f"kcp check P={ctx.world} on {n1:,} tokens", timed=False)
        ctx.log(f"[kcp check] output err {fmt(check_row.get('max_output_err'), '.2e')}, grad err "
                f"{fmt(check_row.get('max_grad_err'), '.2e')}")
    dist.barrier()
    dist.destroy_process_group()
    if ctx.rank != 0:
        return
    payload = meta(ctx, "kcp", args)
    payload.update(shape={"tokens": T, "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype},
                   single=single, runs=results, error_check=check_row,
                   memory_bytes_per_token={k: v for k, v in per_token.items()})
    print()
    print(f"KDA context parallelism, {ctx.world} x {payload['device']}: one sequence of {T:,} tokens, H={args.heads}, "
          f"K=V={args.head_dim}, {args.dtype}; forward+backward, median of {args.iters} after {args.warmup} warm-up")
    ok = single["status"] == "ok"
    t1_cell = (f"{single['fwd_bwd_s']:.4f}" + (f" (from {single['extrapolated_from_tokens']:,} tokens)"
                                              if "extrapolated_from_tokens" in single else "")) if ok else single["status"]
    rows = [[1, f"{T:,}", t1_cell, "1.00" if ok else "-", "1.00" if ok else "-", "(reference)", "(reference)",
             f"{single['peak_memory_bytes'] / GiB:.2f}" if ok else "-"]]
    rows += [[r["ranks"], f"{max(r['tokens_per_rank']):,}", f"{r['fwd_bwd_s']:.4f}", fmt(r["speedup"], ".2f"),
              fmt(r["efficiency"], ".2f"), fmt(r["max_output_err"], ".2e"), fmt(r["max_grad_err"], ".2e"),
              f"{max(r['peak_memory_bytes']) / GiB:.2f}"] if r["status"] == "ok"
             else [r["ranks"], f"{max(r['tokens_per_rank']):,}", r["status"], "-", "-", "-", "-", "-"] for r in results]
    print(table(["ranks P", "tokens per rank", "fwd+bwd s", "speed-up T1/TP", "efficiency T1/(P TP)",
                 "max output err", "max grad err", "peak mem GiB"], rows))
    print("errors: max |KCP - single| / max |single| over each rank's segment, worst rank and input")
    if check_row is not None:
        print(f"error check at the reference's {n1:,} tokens over {ctx.world} ranks: output "
              f"{fmt(check_row.get('max_output_err'), '.2e')}, grads {fmt(check_row.get('max_grad_err'), '.2e')}")
    write_json(args, "kcp", payload)


# ============================================================================ fsdp
def cmd_fsdp(args: argparse.Namespace) -> None:
    from kimik3.parallel.mesh import ParallelDims
    from kimik3.train.trainer import Trainer

    ctx = Ctx(args.device)
    tmp = broadcast_tmpdir(ctx)
    config, config_path = model_config_file(args, tmp)
    flops = model_flops_per_token(config, args.seq_len)
    ctx.log(f"fsdp: dp = {ctx.world} ({dist.get_backend()}), preset {config.name}, {args.rows_per_rank} x {args.seq_len} "
            f"tokens per rank, up to {args.steps} steps; {flops['total'] / 1e9:.3f} GFLOP per token "
            f"(6N {flops['matmul_6N'] / 1e9:.3f}, MLA {flops['mla_attention'] / 1e9:.3f}, KDA {flops['kda'] / 1e9:.3f})")
    ctx.reset_peak()
    t0 = time.perf_counter()
    trainer = Trainer(train_args(args, ctx.world, config_path, str(tmp / "fsdp"), args.steps), log=lambda _: None,
                      parallel=ParallelDims(dp=ctx.world), activation_checkpointing=args.activation_checkpointing)
    ctx.log(f"[fsdp] trainer built in {time.perf_counter() - t0:.1f} s")
    run = train_loop(ctx, trainer, args.steps, args.budget_s, "fsdp", args.log_every, quotas=False)
    run.update(summarise_times(run, args.warmup))
    run["peak_memory_bytes"] = [int(row[0]) for row in ctx.gather([float(ctx.peak_memory())])]
    del trainer
    dist.barrier()
    dist.destroy_process_group()
    if ctx.rank != 0:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    peak = args.peak_tflops * 1e12
    mfu = run["tokens_per_s"] * flops["total"] / (ctx.world * peak)
    payload = meta(ctx, "fsdp", args)
    payload.update(preset=config.name, model_config=config.to_dict(), flops_per_token=flops,
                   peak_tflops_per_device=args.peak_tflops, mfu=mfu,
                   tokens_per_s_per_device=run["tokens_per_s"] / ctx.world, run=run)
    print()
    print(f"FSDP2, dp = {ctx.world}, {payload['device']}, {config.name}, {args.rows_per_rank} x {args.seq_len} tokens "
          f"per rank ({run['steps_timed']} timed steps after {args.warmup} warm-up)")
    print(table(["ranks", "tokens/s", "tokens/s per device", "step s (median)", "rank time max/min (median)",
                 "GFLOP/token", "MFU", "peak mem GiB", "loss first → last"],
                [[ctx.world, f"{run['tokens_per_s']:,.0f}", f"{run['tokens_per_s'] / ctx.world:,.0f}",
                  f"{run['step_time_s_median']:.3f}", f"{run['step_time_spread_median']:.3f}",
                  f"{flops['total'] / 1e9:.3f}", f"{100 * mfu:.2f}%", f"{max(run['peak_memory_bytes']) / GiB:.2f}",
                  f"{run['losses'][0]:.3f} → {run['losses'][-1]:.3f}"]]))
    print(f"MFU = tokens/s x {flops['total'] / 1e9:.3f} GFLOP/token / ({ctx.world} x {args.peak_tflops:g} TFLOP/s)")
    write_json(args, "fsdp", payload)


# ============================================================================ arguments
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    top = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    subs = top.add_subparsers(dest="sub", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--device", choices=["cuda", "cpu"], default=default_device,
                       help="cuda: NCCL, one GPU per rank; cpu: gloo (the smoke test)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="JSON path (default $OUT/multigpu-<sub>.json)")
        p.add_argument("--log-every", type=int, default=10)

    def training(p: argparse.ArgumentParser, steps: int, warmup: int, seq: int, rows: int, budget: float) -> None:
        p.add_argument("--preset", default="debug")
        p.add_argument("--vocab", type=int, default=16384, help="vocabulary override (0: the preset's own)")
        p.add_argument("--data", help="corpus path (default: the stdlib sources)")
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--warmup", type=int, default=warmup, help="first steps left out of the timings")
        p.add_argument("--seq-len", type=int, default=seq)
        p.add_argument("--rows-per-rank", type=int, default=rows, help="sequences per rank per step")
        p.add_argument("--lr", type=float, default=4e-3)
        p.add_argument("--router-balance", default="quantile", choices=["quantile", "sign", "none"],
                       help="router-bias balancing (TrainArgs.balance), independent of MoonEP")
        p.add_argument("--budget-s", type=float, default=budget, help="stop a timed run after this many seconds")

    ep = subs.add_parser("ep", help="expert parallel: MoonEP vs no balancing")
    common(ep)
    training(ep, steps=200, warmup=5, seq=512, rows=4, budget=120.0)
    ep.add_argument("--balance", default="moonep,none", help="comma list of planners: moonep, none")
    ep.add_argument("--ref-steps", type=int, default=200, help="steps of the single-process reference (at most --steps)")
    ep.add_argument("--ref-budget-s", type=float, default=75.0)
    ep.add_argument("--reference", help="read the reference losses from an earlier multigpu-ep.json instead")
    ep.add_argument("--no-reference", action="store_true")
    ep.add_argument("--wide-moe", action="store_true", help="time one K3-shaped MoE layer instead of training")
    ep.add_argument("--dim", type=int, default=7168)
    ep.add_argument("--experts", type=int, default=896)
    ep.add_argument("--hidden", type=int, default=3072)
    ep.add_argument("--latent", type=int, default=3584)
    ep.add_argument("--top-k", type=int, default=16)
    ep.add_argument("--shared", type=int, default=2)
    ep.add_argument("--tokens-per-rank", type=int, default=4096)
    ep.add_argument("--skew", type=float, default=0.1, help="Zipf-shaped router selection bias (0: none)")
    ep.add_argument("--iters", type=int, default=10, help="--wide-moe: timed iterations")
    ep.set_defaults(func=cmd_ep)

    kcp = subs.add_parser("kcp", help="KDA context parallelism on one long sequence")
    common(kcp)
    kcp.add_argument("--tokens", type=int, default=65536)
    kcp.add_argument("--heads", type=int, default=96)
    kcp.add_argument("--head-dim", type=int, default=128)
    kcp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    kcp.add_argument("--ranks", help="comma list of rank counts (default 2, 4, 8, ... up to the world, and the world)")
    kcp.add_argument("--warmup", type=int, default=1)
    kcp.add_argument("--iters", type=int, default=3)
    kcp.add_argument("--no-single", action="store_true", help="skip the single-device reference")
    kcp.add_argument("--single-tokens", type=int, default=0,
                     help="time the single device on this many tokens and scale T1 linearly to --tokens (default: "
                          "the whole sequence, halved until it fits the device); errors are then checked by one "
                          "more KCP run at that length")
    kcp.add_argument("--mem-fraction", type=float, default=0.85,
                     help="skip runs predicted (from a 4K-token probe) to need more than this share of a GPU")
    kcp.add_argument("--kda-backend", choices=["auto", "torch", "triton"], help="sets KIMIK3_KDA_BACKEND")
    kcp.set_defaults(func=cmd_kcp)

    fsdp = subs.add_parser("fsdp", help="FSDP2 with dp = world: tokens/s and MFU")
    common(fsdp)
    training(fsdp, steps=40, warmup=5, seq=1024, rows=8, budget=240.0)
    fsdp.add_argument("--peak-tflops", type=float, default=989.0, help="per-device dense bf16 peak (H200: 989)")
    fsdp.add_argument("--activation-checkpointing", action="store_true")
    fsdp.set_defaults(func=cmd_fsdp)
    return top.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.func(args)


if __name__ == "__main__":
    main()
    # Every process group is destroyed and rank 0's JSON is written by now. Skip the interpreter's
    # finalisation: with gloo (torch 2.13) a rank sometimes aborts there ("terminate called without an
    # active exception", a worker thread still holding work objects), failing a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
