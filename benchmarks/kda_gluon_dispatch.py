"""Where the Gluon KDA kernels pay: the Triton forward with a phase on its Gluon kernel against the same forward
with the phase on its Triton kernel, over shapes from a few hundred work items to K3's, on one GPU.

``triton_forward.GLUON_MIN_ITEMS`` keeps a Gluon kernel off below a work-item count, because a Gluon launch costs
more host time than a Triton one (descriptors built per call) and a small, host-bound call would lose it. This
script measures that: for each shape, the K3-contract forward (``kda_k3.ours_k3``) with the threshold at zero and
the phase's Gluon kernel on, against the same with it off (do_bench medians, the same inputs, outputs checked
equal), and the host's enqueue time of one forward each way (wall time of the launches, the GPU idle). It prints
the ratio per shape and the smallest item count from which the Gluon kernel is never slower.

    python3 benchmarks/kda_gluon_dispatch.py [--phases wy,a,scan] [--out DIR]

Needs an sm_90 GPU; writes DIR/kda_gluon_dispatch.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kda_k3 as k3  # noqa: E402
from harness import Report, bench, log, rel  # noqa: E402

# (B, T, H): phase C's items are NT * H * K / 64 (K = 128), phase A's NT * H
SHAPES = [(1, 256, 8), (1, 1024, 8), (1, 2048, 16), (1, 2048, 32), (1, 4096, 32), (1, 2048, 96), (1, 4096, 96),
          (1, 8192, 96)]
# phase -> (triton_forward switch, items per chunk and head, the threshold it is dispatched by)
PHASES = {"wy": ("GLUON_WY", 2, "GLUON_MIN_ITEMS"), "a": ("GLUON_A", 1, "GLUON_MIN_ITEMS"),
          "scan": ("GLUON_SCAN", 2, "GLUON_SCAN_MIN_ITEMS")}
REPORT = Report(dispatch=[])
verdict, section = REPORT.verdict, REPORT.section


def enqueue_ms(fn, reps: int = 20) -> float:
    """Median host time of one call of fn with the GPU idle before it (ms)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


@section
def dispatch(phases: list) -> None:
    import kimik3.ops.kda.triton_forward as tf

    names = {name for phase in PHASES.values() for name in (phase[0], phase[2])}
    saved = {name: getattr(tf, name) for name in names}
    for phase in PHASES.values():  # every Gluon kernel considered at any size; the switches decide
        setattr(tf, phase[2], 0)
    try:
        for phase in phases:
            switch, per_chunk, threshold = PHASES[phase]
            wins = []
            for B, T, H in SHAPES:
                xs, a_log, dtb = k3.k3_inputs(B, T, H, 128)
                items = B * (T // 64) * H * per_chunk
                row, outs = {"phase": phase, "B": B, "T": T, "H": H, "items": items}, {}
                for kind, on in (("triton", False), ("gluon", True)):
                    setattr(tf, switch, on)
                    fn = lambda: k3.ours_k3(xs, a_log, dtb)  # noqa: E731
                    outs[kind] = fn()[0]
                    row[kind] = bench(fn)
                    row["enqueue_" + kind] = enqueue_ms(fn)
                setattr(tf, switch, saved[switch])
                e = rel(outs["triton"], outs["gluon"])
                verdict(f"dispatch {phase} B{B} T{T} H{H} outputs agree", e < 1e-2, f"rel {e:.1e}")
                row["ratio"] = row["triton"] / row["gluon"]
                wins.append((items, row["ratio"] >= 1.0))
                REPORT.results["dispatch"].append(row)
                log(f"{phase} B{B} T{T} H{H} items {items:6d}: Triton {row['triton']:.3f} ms, Gluon "
                    f"{row['gluon']:.3f} ms (x{row['ratio']:.2f}); host enqueue {row['enqueue_triton']:.3f} / "
                    f"{row['enqueue_gluon']:.3f} ms")
            never_slower = [n for n, _ in wins if all(ok for m, ok in wins if m >= n)]
            log(f"{phase}: the Gluon kernel is never slower from {min(never_slower) if never_slower else 'no'} "
                f"items up (today's threshold, {threshold}: {saved[threshold]})")
    finally:
        for name, value in saved.items():
            setattr(tf, name, value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="wy", help="comma list of wy (phase C), a (phase A), scan (the state scan)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args()
    phases = args.phases.split(",")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("kda_gluon_dispatch.py needs an sm_90 GPU (the Gluon kernels are Hopper-only)")
    if unknown := [p_ for p_ in phases if p_ not in PHASES]:
        raise SystemExit(f"--phases: unknown {unknown}; known: {sorted(PHASES)}")
    t0 = time.time()
    dispatch(phases)
    return REPORT.finish(t0, args.out, "kda_gluon_dispatch.json")


if __name__ == "__main__":
    sys.exit(main())
