"""Each plot writes a PNG."""

from __future__ import annotations

from harness import plots
from harness.stats import linear_fit

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_plot_kind_writes_a_png(tmp_path):
    x, y = [1, 2, 4, 8], [1.1, 2.0, 4.2, 7.9]
    paths = [
        plots.scaling_plot({"ours": (x, y, linear_fit(x, y)), "memcpy": (x, [0.5, 1, 2, 4], None)},
                           tmp_path / "s.png", "blocks x layers", "ms", "scaling"),
        plots.cdf_plot({"a": [1, 2, 3], "b": [2, 3, 4]}, tmp_path / "c.png", "ms", "cdf"),
        plots.bars_plot({"before": 2.0, "after": 1.0}, tmp_path / "b.png", "ms", "bars",
                        errors={"before": (1.8, 2.2), "after": (0.9, 1.1)}),
        plots.bandwidth_plot([1e6, 4e6, 16e6], {"memcpy": [5, 6, 6], "ours": [2, 3, 3]}, tmp_path / "w.png", "bw"),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 1000
