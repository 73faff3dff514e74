"""benchmarks/harness.py's ``idle_split``: a device timeline's busy time and its short and long gaps, from kernel
intervals that may come unsorted and overlap (a copy beside a kernel)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import idle_split  # noqa: E402


def test_busy_time_and_gaps_by_length():
    # 0-10, a 1 us gap, 11-20 overlapped by 15-25, a 30 us gap, 55-60, a 4.9 us gap, 64.9-70.
    spans = [(55.0, 60.0), (0.0, 10.0), (15.0, 25.0), (11.0, 20.0), (64.9, 70.0)]
    split = idle_split(spans)
    assert split["span_us"] == pytest.approx(70.0)
    assert split["busy_us"] == pytest.approx(10 + 14 + 5 + 5.1)
    assert (split["short_gaps"], split["long_gaps"]) == (2, 1)
    assert split["short_gaps_us"] == pytest.approx(1.0 + 4.9)
    assert split["long_gaps_us"] == pytest.approx(30.0)
    assert split["busy_us"] + split["short_gaps_us"] + split["long_gaps_us"] == pytest.approx(split["span_us"])


def test_a_span_inside_another_adds_nothing_and_no_spans_give_zeros():
    assert idle_split([(0.0, 10.0), (2.0, 3.0)])["busy_us"] == pytest.approx(10.0)
    assert idle_split([]) == {"span_us": 0.0, "busy_us": 0.0, "short_gaps_us": 0.0, "short_gaps": 0,
                              "long_gaps_us": 0.0, "long_gaps": 0}
