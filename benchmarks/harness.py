"""What the benchmark scripts share: printed lines, PASS / FAIL verdicts collected into one results dict,
sections that report their own failure and let the run go on, relative errors, do_bench medians, a call captured
as a CUDA graph to time it without its host overhead, and a profiler's CUDA kernels as a table.

A script makes one ``Report`` and binds its ``verdict`` and ``section`` at module level, so each script (and
each fresh copy a smoke test loads) keeps its own results.
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback

import torch


def log(msg: str) -> None:
    print(msg, flush=True)


def rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error of ``out`` against ``ref`` (in float64)."""
    a, b = ref.detach().double(), out.detach().double()
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


def bench(fn, warmup: int = 5, rep: int = 30) -> float:
    """``triton.testing.do_bench``'s median, in ms."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graphed(fn):
    """``fn`` captured once as a CUDA graph (after a run on a side stream, where its kernels compile and its
    workspaces are made): returns the graph's replay, which launches the same kernels with no Python or launch
    overhead between them, as the serving engine's decode graphs do. The graph's outputs stay in its pool."""
    from kimik3.cuda_graph import warm_up

    side = torch.cuda.Stream()
    warm_up(torch.device("cuda", torch.cuda.current_device()), side, fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def kernel_rows(prof, steps: int, top: int = 25) -> dict:
    """The CUDA kernels of ``steps`` profiled steps, per step: total launches and time, the ``top`` kernels by
    time and by launch count, and every kernel by time ("all"). A profile without CUDA activity (a CPU run) gives
    its aten operators by self time instead."""
    rows, cpu_rows = [], []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if cuda_us and event.device_type.name == "CUDA":
            rows.append((event.key[:90], cuda_us / steps, event.count // steps))
        elif event.key.startswith("aten::") and event.self_cpu_time_total:
            cpu_rows.append((event.key[:90], event.self_cpu_time_total / steps, event.count // steps))
    rows = rows or cpu_rows
    by_time = sorted(rows, key=lambda row: -row[1])
    return {"launches": sum(r[2] for r in rows), "us": sum(r[1] for r in rows), "by_time": by_time[:top],
            "by_count": sorted(rows, key=lambda row: -row[2])[:top], "all": by_time}


def idle_split(intervals: list[tuple[float, float]], long_gap_us: float = 5.0) -> dict:
    """Where a device timeline's time goes between its first start and last end, from the (start, end) intervals
    in us of its kernels and copies (one stream): busy time, the short gaps (below ``long_gap_us``: a graph's
    launches back to back) and the long ones (the device waiting for the host), with their counts."""
    spans = sorted(intervals)
    out = {"span_us": 0.0, "busy_us": 0.0, "short_gaps_us": 0.0, "short_gaps": 0, "long_gaps_us": 0.0,
           "long_gaps": 0}
    if not spans:
        return out
    out["span_us"] = max(end for _, end in spans) - spans[0][0]
    reach = spans[0][0]
    for start, end in spans:
        gap = start - reach
        if gap > 0:
            kind = "long" if gap >= long_gap_us else "short"
            out[f"{kind}_gaps_us"] += gap
            out[f"{kind}_gaps"] += 1
        out["busy_us"] += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return out


def device_timeline(prof, steps: int, wall_s: float) -> dict:
    """``idle_split`` of a profile's CUDA kernels and copies, per step, with the host's wall time a step: what a
    graphed step's wall time holds besides its kernels (their gaps in the graph, the device idle between replays)."""
    intervals = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    split = idle_split(intervals)
    per_step = {key: value / steps for key, value in split.items()}
    per_step["wall_us"] = wall_s * 1e6 / steps
    return per_step


def print_kernels(title: str, table: dict) -> None:
    print(f"{title}: {table['launches']} kernel launches, {table['us'] / 1e3:.2f} ms of kernel time")
    for sync in table.get("host_syncs", []):
        print(f"  host sync: {sync}")
    for key in ("by_time", "by_count"):
        print(f"| kernel ({key.replace('_', ' ')}) | us | launches |\n|---|---|---|")
        for name, us, count in table[key]:
            print(f"| {name} | {us:.1f} | {count} |")


class Report:
    """The verdicts and tables of one run: ``results`` holds "pass" and "fail" (verdict names), "errors"
    (section name -> traceback) and the tables named at construction."""

    def __init__(self, **tables):
        self.results: dict = {"pass": [], "fail": [], "errors": {}, **tables}

    def verdict(self, name: str, ok: bool, detail: str = "") -> None:
        (self.results["pass"] if ok else self.results["fail"]).append(name)
        log(f"{'PASS' if ok else 'FAIL'} {name} {detail}")

    def section(self, fn):
        """``fn`` as a named section: a header and its duration are printed, and an exception becomes a FAIL
        with its traceback kept, so one device call reports everything it can."""

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            name = fn.__name__
            log(f"\n===== {name} =====")
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                self.verdict(f"{name}:exception", False, repr(exc)[:300])
                self.results["errors"][name] = traceback.format_exc()
                traceback.print_exc()
            finally:
                log(f"----- {name}: {time.time() - t0:.1f} s")

        return wrapped

    def finish(self, t0: float, out_dir: str | None, filename: str) -> int:
        """Print the summary (every FAIL by name), write ``out_dir/filename`` when ``out_dir`` is set, and
        return the exit status: 1 if anything FAILed."""
        log(f"\nSUMMARY: {len(self.results['pass'])} PASS, {len(self.results['fail'])} FAIL in "
            f"{time.time() - t0:.0f} s")
        for name in self.results["fail"]:
            log(f"  FAILED: {name}")
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, filename)
            with open(path, "w") as fh:
                json.dump(self.results, fh, indent=1, default=str)
            log(f"wrote {path}")
        return 1 if self.results["fail"] else 0
