"""Row chunks that keep a CPU core's cache: a CPU path of elementwise glue that makes several passes over its rows
(SiTU-GLU's) walks them a chunk at a time, so that the passes over a chunk, and the temporaries between them, stay
in a core's L2 cache instead of going to memory once a pass.

About 1 MB of fp32 a chunk: room in a core's L2 for a chunk and the few temporaries its passes make (the sizes
tried: benchmarks/NOTES-train.md).
"""

from __future__ import annotations

from collections.abc import Iterator

CHUNK_ELEMENTS = 1 << 18


def row_chunks(rows: int, width: int) -> Iterator[slice]:
    """Consecutive slices covering ``rows`` rows, each of about ``CHUNK_ELEMENTS`` elements of ``width`` (at least one
    row)."""
    step = max(1, CHUNK_ELEMENTS // max(1, width))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))
