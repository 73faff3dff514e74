"""``multigpu.py fsdp``: FSDP2 with dp = world, tokens/s and MFU. What it measures: ``multigpu.py``'s
docstring."""

from __future__ import annotations

import argparse
import shutil
import time

import torch.distributed as dist
from multigpu_common import (
    Ctx,
    GiB,
    broadcast_tmpdir,
    meta,
    model_config_file,
    model_flops_per_token,
    summarise_times,
    table,
    train_args,
    train_loop,
    write_json,
)


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
