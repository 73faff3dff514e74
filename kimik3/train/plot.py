"""``loss.png``: train and validation loss, and expert-load imbalance, over steps."""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Callable
from typing import Any

from kimik3.extras import MissingExtra, require
from kimik3.files import atomic_write


def parse_record(line: str) -> dict[str, Any] | None:
    """One ``metrics.jsonl`` line as a record, or None when it is not one: blank, or cut short by a
    kill in the middle of its write."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if (not isinstance(record, dict) or type(record.get("step")) is not int
            or not isinstance(record.get("loss"), (int, float))):
        return None
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, skipping any line that is not one (see ``parse_record``)."""
    lines = Path(path).read_text(errors="replace").splitlines()
    return [record for record in map(parse_record, lines) if record is not None]


def smooth(values: list[float], window: int = 10) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def draw_figure(out_path: str | Path, what: str, rows: int, draw: Callable[[Any], None],
                figsize: tuple[float, float] = (8, 7), height_ratios: list[float] | None = None) -> Path | None:
    """``rows`` stacked axes sharing their x axis, filled by ``draw(axes)``, written as the PNG ``out_path``
    atomically (``files.atomic_write``: a failure leaves the previous plot, or none, and no temporary). Returns
    ``out_path``, or None when matplotlib (the [plot] extra) is missing: the plot is then skipped with a one-line
    notice naming ``what``."""
    out_path = Path(out_path)
    try:
        require("plot", what, ("matplotlib",))
    except MissingExtra as missing:
        print(f"skipping {out_path.name}: {missing}")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, 1, figsize=figsize, sharex=True,
                             gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)
    try:
        draw(axes)
        fig.tight_layout()
        # The temporary's name ends in .tmp: the format is given, not guessed from the suffix.
        atomic_write(out_path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)   # also when drawing or writing failed: pyplot keeps every open figure
    return out_path


def plot_run(metrics_path: str | Path, out_path: str | Path, unigram: float | None = None) -> Path | None:
    """Draw the run's curves from ``metrics.jsonl`` into the PNG ``out_path``, written atomically
    (``files.atomic_write``: a failure leaves the previous plot, or none, and no temporary).

    Returns ``out_path``, or None when there is nothing to draw, or when matplotlib (the [plot]
    extra) is missing: the plot is then skipped with a one-line notice.
    """
    records = read_metrics(metrics_path)
    kept = [r for r in records if not r.get("skipped")]
    if not kept:
        return None
    steps = [r["step"] for r in kept]

    def draw(axes) -> None:
        ax_loss, ax_load = axes
        # The next-token loss, comparable with validation (the optimised loss adds the weighted MTP term).
        train = [r.get("main_loss", r["loss"]) for r in kept]
        ax_loss.plot(steps, train, color="tab:blue", alpha=0.25, lw=0.8)
        ax_loss.plot(steps, smooth(train), color="tab:blue", label="train next-token loss (smoothed)")
        val = [(r["step"], r["val_loss"]) for r in kept if "val_loss" in r]
        if val:
            ax_loss.plot(*zip(*val), "o-", color="tab:orange", label="validation")
        if unigram is not None:
            ax_loss.axhline(unigram, color="gray", ls="--", lw=1, label=f"unigram baseline ({unigram:.2f})")
        ax_loss.set_ylabel("loss (nats/token)")
        ax_loss.legend()
        ax_loss.grid(alpha=0.3)
        loads = [(r["step"], r["expert_load_max_over_mean"]) for r in kept if r.get("expert_load_max_over_mean")]
        if loads:
            ax_load.plot(*zip(*loads), color="tab:green")
            ax_load.axhline(1.0, color="gray", ls=":", lw=1)
        ax_load.set_ylabel("expert load max/mean")
        ax_load.set_xlabel("step")
        ax_load.grid(alpha=0.3)

    return draw_figure(out_path, "the loss plot", 2, draw, height_ratios=[2, 1])
