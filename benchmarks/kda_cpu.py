"""CPU timing of the KDA token loop vs the chunkwise torch path.

Usage:
    PYTHONPATH=. python benchmarks/kda_cpu.py [--B 1 --T 2048 --H 4 --K 64 --V 64 --dtype fp32]

Reports median (and best) wall time, after warmup, of forward passes of
``naive_recurrent_kda`` and ``chunk_kda``, their ratio, and forward+backward
time of ``chunk_kda``. Inputs follow the K3 layer: L2-normalised q/k, gates
g = -5 * sigmoid(.) in (-5, 0), beta = sigmoid(.). Threads: torch's default
unless --threads is given. On a shared machine the median is sensitive to
other load (an intra-op parallel region waits for every thread), so the best
run is printed too; --repeat R measures the three paths R times in turn
(warmup each time) and reports over all R * runs calls, which spreads slow
spells of other load over all paths.

Shape legend: B batch, T tokens, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import List

import torch
import torch.nn.functional as F

from kimik3.ops.kda import chunk_kda, naive_recurrent_kda

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k_BTHK = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v_BTHV = torch.randn(B, T, H, V, generator=gen)
    g_BTHK = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta_BTH = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [x.to(dtype) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH)]


def time_runs(fn, warmup: int, runs: int) -> List[float]:
    """Seconds of each of ``runs`` calls of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="measure all paths this many times, in turn")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="do not flush subnormal floats to zero (decayed states reach them, and x86 then "
                         "takes a microcode slow path up to ~100x slower on both paths)")
    args = ap.parse_args()
    if not args.keep_denormals:
        torch.set_flush_denormal(True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    inputs = make_inputs(args.B, args.T, args.H, args.K, args.V, DTYPES[args.dtype])
    h0 = torch.zeros(args.B, args.H, args.K, args.V)

    def loop_fwd():
        with torch.no_grad():
            naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True)

    def chunk_fwd():
        with torch.no_grad():
            chunk_kda(*inputs, initial_state=h0, output_final_state=True, chunk_size=args.chunk_size)

    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def chunk_fwd_bwd():
        o, s = chunk_kda(*leaves, initial_state=h0, output_final_state=True, chunk_size=args.chunk_size)
        (o.float().sum() + s.sum()).backward()

    paths = (loop_fwd, chunk_fwd, chunk_fwd_bwd)
    times: List[List[float]] = [[] for _ in paths]
    for _ in range(args.repeat):
        for fn, acc in zip(paths, times):
            acc.extend(time_runs(fn, args.warmup, args.runs))
    t_loop, t_chunk, t_chunk_fb = ((statistics.median(t), min(t)) for t in times)

    print(
        f"KDA CPU  B={args.B} T={args.T} H={args.H} K={args.K} V={args.V} dtype={args.dtype} "
        f"chunk_size={args.chunk_size} threads={torch.get_num_threads()} "
        f"flush_denormal={not args.keep_denormals} "
        f"({args.repeat} x {args.runs} runs, {args.warmup} warmup each)"
    )
    print(f"{'path':<28}{'median (ms)':>12}{'best (ms)':>12}")
    for name, (med, best) in (
        ("naive_recurrent_kda fwd", t_loop),
        ("chunk_kda fwd", t_chunk),
        ("chunk_kda fwd+bwd", t_chunk_fb),
    ):
        print(f"{name:<28}{med * 1e3:>12.2f}{best * 1e3:>12.2f}")
    print(
        f"speed-up chunk vs loop (fwd): {t_loop[0] / t_chunk[0]:.1f}x (medians), "
        f"{t_loop[1] / t_chunk[1]:.1f}x (best runs)"
    )


if __name__ == "__main__":
    main()
