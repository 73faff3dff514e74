"""Where the KDA chunk time goes, ours against fla: stacked per-kernel bars from kda_kernel.py's profile section.

Reads the JSON that ``kda_kernel.py --sections ...,profile --out DIR`` writes (``DIR/kda_kernel.json``, its
``timings.profile`` table: ms per call of each kernel, per profiled run) and draws one horizontal bar per run,
each kernel a segment, labelled where it is wide enough (the narrow ones summed as one), forward+backward and
forward in panels of their own::

    python benchmarks/plot_kda_profile.py h200-logs/shape0/kda_kernel.json --out docs/kda_profile.png

By default it draws our forward and forward+backward next to fla's (``--run``, once per run, picks profiled runs by
their labels, e.g. from an older kda_kernel.json whose labels differ).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

DEFAULT_RUNS = ["fla fwd+bwd", "ours fwd+bwd", "fla fwd", "ours fwd"]  # kda_kernel.py's profile labels
# kernel-name prefixes and suffixes that say nothing on a narrow segment
_DROP = re.compile(r"^(chunk_kda_|chunk_gated_delta_rule_|chunk_|_)|(_kernel.*|_blockdim\d+.*)$")


def short_name(kernel: str) -> str:
    """A segment label: 'chunk_kda_bwd_kernel_wy_dqkg_fused' -> 'bwd_wy_dqkg_fused', '_bwd_wy_kernel' -> 'bwd_wy'
    (a name the profiler's table cut short, '..._blockdi...', loses its cut tail); a long one is broken in two
    lines at the underscore nearest its middle."""
    name = re.sub(r"_blockdi.*$|\.\.\.$", "", kernel).replace("_kernel_", "_")
    while True:
        shorter = _DROP.sub("", name)
        if shorter == name or not shorter:
            break
        name = shorter
    if len(name) > 12 and "_" in name[1:-1]:
        cut = min((i for i, c in enumerate(name) if c == "_"), key=lambda i: abs(i - len(name) / 2))
        name = name[:cut] + "\n" + name[cut + 1:]
    return name


def load_runs(paths: list[str], labels: list[str]) -> dict[str, dict[str, float]]:
    """{run label: {kernel: ms per call}} for the labels found in the given kda_kernel.json files (later files
    win); a label found in none is an error that names the labels there are."""
    found: dict[str, dict[str, float]] = {}
    for path in paths:
        with open(path) as fh:
            table = json.load(fh).get("timings", {}).get("profile", {})
        for label, row in table.items():
            found[label] = row["ms_per_call"]
    missing = [lab for lab in labels if lab not in found]
    if missing:
        raise SystemExit(f"no profile for {missing} in {paths}; profiled runs there: {sorted(found)}")
    return {lab: found[lab] for lab in labels}


def draw(runs: dict[str, dict[str, float]], out: str, min_label: float, title: str) -> None:
    """One panel per pass (runs whose label says fwd+bwd, then the others), each with its own time axis; in each
    bar the kernels narrower than min_label of the panel's axis are summed as one grey 'other' segment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [[lab for lab in runs if "fwd+bwd" in lab], [lab for lab in runs if "fwd+bwd" not in lab]]
    panels = [p for p in panels if p]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 1.3 * len(runs) + 1.4), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, labels in zip(axes[:, 0], panels):
        xmax = max(sum(runs[lab].values()) for lab in labels) * 1.12
        for y, label in enumerate(reversed(labels)):
            items = sorted(runs[label].items(), key=lambda kv: -kv[1])
            wide = [(k, ms) for k, ms in items if ms >= min_label * xmax]
            rest = sum(ms for _, ms in items if ms < min_label * xmax)
            left = 0.0
            for i, (kernel, ms) in enumerate(wide):
                ax.barh(y, ms, left=left, color=cmap(i % 20), edgecolor="white")
                ax.text(left + ms / 2, y, f"{short_name(kernel)}\n{ms:.2f}", ha="center", va="center", fontsize=6.5)
                left += ms
            if rest > 0:
                ax.barh(y, rest, left=left, color="lightgrey", edgecolor="white")
                ax.text(left + rest / 2, y, f"{len(items) - len(wide)}\nmore", ha="center", va="center", fontsize=7)
                left += rest
            ax.text(left + 0.01 * xmax, y, f"{left:.2f} ms", va="center", fontsize=9, fontweight="bold")
        ax.set_yticks(range(len(labels)), list(reversed(labels)))
        ax.set_xlim(0, xmax)
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("ms per call (torch.profiler: CUDA time of each kernel)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=130)
    os.replace(tmp, out)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="kda_kernel.json files with a profile table")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--run", action="append", default=None,
                   help="a profiled run's label, once per run (default: ours and fla, forward and forward+backward)")
    p.add_argument("--min-label", type=float, default=0.03,
                   help="kernels narrower than this fraction of their panel's axis are summed as one segment")
    p.add_argument("--title", default="KDA chunk kernels, per-kernel time")
    a = p.parse_args(argv)
    labels = a.run or DEFAULT_RUNS
    draw(load_runs(a.json, labels), a.out, a.min_label, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
