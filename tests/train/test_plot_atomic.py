"""``loss.png`` is written through ``files.atomic_write``: whole, or not at all."""

import json

import pytest

from kimik3.train.plot import plot_run


@pytest.fixture
def metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "expert_load_max_over_mean": 1.2})
                            + "\n" for s in range(5)))
    return path


def test_the_plot_is_a_png_and_leaves_no_temporary(metrics, tmp_path):
    out = tmp_path / "loss.png"
    assert plot_run(metrics, out, unigram=4.0) == out
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]


def test_a_failed_plot_keeps_the_previous_one_and_leaves_no_temporary(metrics, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    out = tmp_path / "loss.png"
    out.write_bytes(b"the previous plot")
    figures = len(plt.get_fignums())

    def half_then_fail(self, fname, **kwargs):
        with open(fname, "wb") as handle:
            handle.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        plot_run(metrics, out)
    assert out.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]
    assert len(plt.get_fignums()) == figures   # the figure was closed all the same
