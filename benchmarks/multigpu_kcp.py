"""``multigpu.py kcp``: KDA context parallelism on one long sequence against one device. What it
measures: ``multigpu.py``'s docstring."""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from multigpu_common import (
    Ctx,
    GiB,
    fmt,
    median,
    meta,
    table,
    write_json,
)

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
