"""Nsight Compute's view of our KDA kernels at K3's shape: run under ncu, one profiled forward+backward.

    bash benchmarks/kda_ncu.sh [KERNEL_REGEX]          # on the GPU machine; reports under $OUT/ncu

This script does a warm-up forward+backward (compiles, autotunes), then opens the profiler range
(``cudaProfilerStart``) around one more, so that ``ncu --profile-from-start off`` (which kda_ncu.sh passes) measures
each kernel of that one step once. ``--peer`` profiles fla 0.6.0's ``chunk_kda`` on the same inputs instead (its
wheels on PYTHONPATH, as kda_ncu.sh installs them from .whl/); ``--forward-only`` a forward alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kda_k3 as k3  # noqa: E402
from kda_k3 import fla_k3, grad_step, k3_inputs, load_fla, ours_k3  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1,8192,96,128", help="B,T,H,D (default: K3's per-layer shape)")
    p.add_argument("--forward-only", action="store_true", help="a forward alone (no autograd) instead")
    p.add_argument("--peer", action="store_true",
                   help="profile fla 0.6.0's chunk_kda (carried as wheels, on PYTHONPATH) on the same inputs instead")
    args = p.parse_args(argv)
    try:
        B, T, H, D = (int(x) for x in args.shape.split(","))
    except ValueError:
        raise SystemExit(f"--shape takes four integers B,T,H,D, got {args.shape!r}") from None
    cuda = torch.cuda.is_available()
    if not cuda:  # a smoke test of the script: the kernels under the Triton interpreter, no profiler range
        k3.DEVICE = "cpu"
    xs, a_log, dtb = k3_inputs(B, T, H, D, requires_grad=not args.forward_only)
    do = torch.randn_like(xs[2])
    if args.peer:
        fla_fn, _ = load_fla()
        if fla_fn is None:
            raise SystemExit("--peer: fla is not importable (install its wheels, as h200_check.sh does)")
        run = lambda: fla_k3(fla_fn, xs, a_log, dtb)  # noqa: E731
    else:
        run = lambda: ours_k3(xs, a_log, dtb)  # noqa: E731

    def step():
        if args.forward_only:
            with torch.no_grad():
                run()
        else:
            grad_step(run, xs, do)

    step()  # compiles and warms up, outside the profiled range
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    what = ("fla's " if args.peer else "") + ("forward" if args.forward_only else "forward+backward")
    print(f"{'profiled' if cuda else 'ran (no GPU: nothing profiled)'} one {what} at B{B} T{T} H{H} D{D}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
