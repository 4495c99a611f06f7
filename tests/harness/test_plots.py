"""Each plot writes a PNG and closes its figure."""

from __future__ import annotations

import matplotlib.pyplot as plt

from harness import plots
from harness.stats import linear_fit

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_plot_kind_writes_a_png_and_leaves_no_figure_open(tmp_path):
    x, y = [1, 2, 4, 8], [1.1, 2.0, 4.2, 7.9]
    paths = [
        plots.scaling_plot({"ours": (x, y, linear_fit(x, y)), "concat": (x, [2, 4, 8, 16], linear_fit(x, [2, 4, 8, 16])),
                            "memcpy": (x, [0.5, 1, 2, 4], None)},
                           tmp_path / "s.png", "blocks x layers", "ms", "scaling"),
        plots.scaling_plot({"ours": (x, y, None)}, tmp_path / "log" / "s.png", "blocks", "ms", "log", logy=True),
        plots.cdf_plot({"a": [1, 2, 3], "b": [2, 3, 4]}, tmp_path / "c.png", "ms", "cdf"),
        plots.bars_plot({"before": 2.0, "after": 1.0}, tmp_path / "b.png", "ms", "bars",
                        errors={"before": (1.8, 2.2), "after": (0.9, 1.1)}),
        plots.bars_plot({"only": 3.0}, tmp_path / "b1.png", "ms", "one bar"),
        plots.bandwidth_plot([16e6, 1e6, 4e6], {"memcpy": [6, 5, 6], "ours": [3, 2, 3]}, tmp_path / "w.png", "bw"),
        plots.turns_plot(["1 first", "2 append"], {"ours": [3.0, 0.4], "peer": [3.1, 0.5]},
                         {"ours": [0, 590], "peer": [float("nan"), 584]}, [581, 598], tmp_path / "t.png", "turns"),
        plots.turn_lines_plot({"openai": {"echo": [0.1, 0.97, 0.98], "off": [0.1, 0.9, None]}, "anthropic": {"echo": [0.1, 0.97]}},
                              tmp_path / "r.png", "cached / prompt", "ratios", goal=0.95),
    ]
    for p in paths:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 1000
    assert plt.get_fignums() == []
