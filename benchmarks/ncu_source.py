"""Summarise one kernel's Nsight Compute source page (``kda_ncu.sh`` with SOURCE=1 writes sass_KERNEL.csv.gz):
what its warps stall on, and which source lines hold the stalls, the excess memory sectors or the instructions.

    python benchmarks/ncu_source.py sass__bwd_wy_kernel.csv.gz [--by stall|sectors|shared|instructions] [--top 15]

The CSV is ncu's ``--page source --csv --print-source cuda,sass``: per source file a "File Path" row, a header row,
then each source line's totals followed by its SASS instructions; only the source lines' totals are read.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys
from typing import Dict, List, NamedTuple

COLUMNS = {"stall": "Warp Stall Sampling (All Samples)", "sectors": "L2 Theoretical Sectors Global Excessive",
           "shared": "L1 Wavefronts Shared Excessive", "instructions": "Instructions Executed"}


class SourceLine(NamedTuple):
    file: str
    line: str
    text: str
    metrics: Dict[str, float]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:  # "-" and blanks
        return 0.0


def read_source_lines(path: str) -> List[SourceLine]:
    """The source lines of an ncu source-page CSV (gzipped or not) with their metric totals."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header, file, lines = None, "?", []
    for row in rows:
        if row and row[0] == "File Path":
            file = row[1].rsplit("/", 1)[-1]
        elif row and row[0] == "Line No":
            header = row
        elif header is not None and len(row) >= len(header) and row[0] not in ("", "-"):
            metrics = {name: _number(value) for name, value in zip(header[4:], row[4:])}
            lines.append(SourceLine(file, row[0], row[1], metrics))
    if header is None:
        raise ValueError(f"{path}: no 'Line No' header row -- not an ncu source page exported with --csv")
    return lines


def stall_reasons(lines: List[SourceLine]) -> Dict[str, float]:
    """Share of the warp stall samples per reason (ncu's stall_* columns, the issued samples' set), largest first."""
    totals = collections.Counter()
    for line in lines:
        for name, value in line.metrics.items():
            if name.startswith("stall_") and "Not Issued" not in name:
                totals[name[6:]] += value
    whole = sum(totals.values()) or 1.0
    return {name: value / whole for name, value in totals.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--by", choices=sorted(COLUMNS), default="stall")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    lines = read_source_lines(args.csv)
    total = {key: sum(line.metrics.get(col, 0.0) for line in lines) or 1.0 for key, col in COLUMNS.items()}
    sectors = sum(line.metrics.get("L2 Theoretical Sectors Global", 0.0) for line in lines)
    print(f"stall samples {total['stall']:.0f}; global sectors {sectors:.3g}, of which excessive "
          f"{total['sectors']:.3g}; excessive shared wavefronts {total['shared']:.3g}; instructions "
          f"{total['instructions']:.3g}")
    print("stalls: " + "  ".join(f"{name} {share:.1%}" for name, share in list(stall_reasons(lines).items())[:10]))
    key = COLUMNS[args.by]
    for line in sorted(lines, key=lambda s: -s.metrics.get(key, 0.0))[:args.top]:
        m = line.metrics
        print(f"{line.file}:{line.line:>4}  stall {m.get(COLUMNS['stall'], 0) / total['stall']:6.1%}  "
              f"inst {m.get(COLUMNS['instructions'], 0) / total['instructions']:6.1%}  "
              f"excess sectors {m.get(COLUMNS['sectors'], 0):.3g} / {m.get('L2 Theoretical Sectors Global', 0):.3g}"
              f"  excess shared {m.get(COLUMNS['shared'], 0):.3g} | {line.text.strip()[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
