"""``multigpu.py ep``: MoonEP expert parallelism -- training, MoonEP vs none, and one K3-shaped MoE
layer (``--wide-moe``). What each measures: ``multigpu.py``'s docstring."""

from __future__ import annotations

import argparse
import json
import shutil
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multigpu_common import (
    Ctx,
    ExpertTimer,
    GiB,
    broadcast_tmpdir,
    ep_modules,
    fmt,
    loss_match,
    median,
    meta,
    model_config_file,
    single_process_reference,
    summarise_times,
    table,
    train_args,
    train_loop,
    write_json,
)


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
