"""Headless plots written next to a results document (matplotlib, Agg backend).

Every function writes one PNG (creating its folder), closes its figure so that
long sweeps do not pile figures up, and returns the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def save(fig, path: Path, dpi: int = 120) -> Path:
    """Lay ``fig`` out, write it to ``path`` (creating its folder), close it; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def scaling_plot(series: Mapping[str, tuple[Sequence[float], Sequence[float], dict | None]], path: Path,
                 xlabel: str, ylabel: str, title: str, logy: bool = False) -> Path:
    """Points per named series (e.g. reconstruct, concat, memcpy), each with its own fit line.

    Args:
        series: label -> (x, y, fit); fit is a ``stats.linear_fit`` dict, shown as
            its line with slope, intercept and R² in the legend, or None for points only.
        path: the PNG to write.
        xlabel, ylabel, title: axis labels and title.
        logy: a log y axis, for series that differ by orders of magnitude.

    Returns:
        ``path``.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (x, y, fit) in series.items():
        pts = ax.scatter(x, y, s=18, label=label if fit is None else None)
        if fit is not None:
            xs = np.linspace(min(x), max(x), 50)
            ax.plot(xs, fit["slope"] * xs + fit["intercept"], color=pts.get_facecolor()[0],
                    label=f"{label}: {fit['slope']:.3g}·x + {fit['intercept']:.3g}, R²={fit['r2']:.3f}")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def cdf_plot(samples_by_label: Mapping[str, Sequence[float]], path: Path, xlabel: str, title: str) -> Path:
    """Empirical CDFs, one step line per label, so tails (p95, p99) are visible.

    Args:
        samples_by_label: label -> raw samples.
        path: the PNG to write.
        xlabel, title: x axis label (the metric and unit) and title.

    Returns:
        ``path``.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, samples in samples_by_label.items():
        x = np.sort(np.asarray(samples, dtype=float))
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=f"{label} (n={x.size})")
    ax.set(xlabel=xlabel, ylabel="fraction of trials", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def bars_plot(values_by_label: Mapping[str, float], path: Path, ylabel: str, title: str,
              errors: Mapping[str, tuple[float, float]] | None = None) -> Path:
    """Bars, e.g. before/after medians, each annotated with its value.

    Args:
        values_by_label: label -> bar height.
        path: the PNG to write.
        ylabel, title: y axis label and title.
        errors: label -> absolute (low, high), e.g. the median's 99% CI; drawn as error bars.

    Returns:
        ``path``.
    """
    labels = list(values_by_label)
    values = [values_by_label[k] for k in labels]
    fig, ax = plt.subplots(figsize=(max(4, 1.4 * len(labels)), 4))
    yerr = None
    if errors:
        yerr = np.array([[values_by_label[k] - errors[k][0], errors[k][1] - values_by_label[k]] for k in labels]).T
    ax.bar(labels, values, yerr=yerr, capsize=4, color=plt.cm.tab10.colors[: len(labels)])
    for i, v in enumerate(values):
        ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def bandwidth_plot(nbytes: Sequence[float], gbps_by_label: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """Throughput (GB/s) against cache size, one line per method.

    Args:
        nbytes: cache size of each point, in bytes (any order; sorted here).
        gbps_by_label: label -> GB/s per point; a label containing "memcpy" is
            drawn dashed, as the copy floor the others are read against.
        path: the PNG to write.
        title: the title.

    Returns:
        ``path``.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    order = np.argsort(nbytes)
    x = np.asarray(nbytes, dtype=float)[order] / 1e6
    for label, gbps in gbps_by_label.items():
        ax.plot(x, np.asarray(gbps, dtype=float)[order], marker="o", ms=3,
                ls="--" if "memcpy" in label else "-", label=label)
    ax.set(xlabel="cache bytes (MB)", ylabel="GB/s (bytes moved / time)", title=title, xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def throughput_plot(groups: Mapping[str, Mapping[str, float]], path: Path, ylabel: str, title: str) -> Path:
    """Grouped bars on a log axis: one group per measurement, one bar per side, each bar
    annotated with its value and each group with the last side's ratio over the first.

    Args:
        groups: group label (e.g. "prefill 512") -> side label -> value.
        path: the PNG to write.
        ylabel, title: y axis label and title.

    Returns:
        ``path``.
    """
    labels = list(groups)
    sides = list(next(iter(groups.values())))
    width = 0.8 / len(sides)
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4.5))
    for i, side in enumerate(sides):
        xs = np.arange(len(labels)) + (i - (len(sides) - 1) / 2) * width
        values = [groups[g][side] for g in labels]
        ax.bar(xs, values, width, label=side, color=plt.cm.tab10.colors[i])
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
    for j, g in enumerate(labels):
        ratio = groups[g][sides[-1]] / groups[g][sides[0]]
        ax.annotate(f"{ratio:.1f}x", (j, max(groups[g].values()) * 2.2), ha="center", fontsize=9, weight="bold")
    ax.set_yscale("log")
    ax.set_ylim(top=max(max(v.values()) for v in groups.values()) * 6)
    ax.set_xticks(np.arange(len(labels)), labels)
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return save(fig, path)


def turns_plot(turns: Sequence[str], ttft_s: Mapping[str, Sequence[float]], cached: Mapping[str, Sequence[float]],
               prompt: Sequence[float], path: Path, title: str) -> Path:
    """Per turn, each side's TTFT (top, log axis) and cached prompt tokens against the prompt (bottom).

    Args:
        turns: the turn labels, in order.
        ttft_s: side -> seconds per turn.
        cached: side -> cached tokens per turn (NaN where a side reports none).
        prompt: the prompt's tokens per turn, drawn as a line over the cached bars.
        path: the PNG to write.
        title: the title.

    Returns:
        ``path``.
    """
    sides = list(ttft_s)
    width = 0.8 / len(sides)
    x = np.arange(len(turns))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.4 * len(turns)), 7), sharex=True)
    for i, side in enumerate(sides):
        xs = x + (i - (len(sides) - 1) / 2) * width
        for ax, values, fmt in ((top, ttft_s[side], "{:.2f}"), (bottom, cached[side], "{:.0f}")):
            ax.bar(xs, values, width, label=side, color=plt.cm.tab10.colors[i])
            for xi, v in zip(xs, values):
                if np.isfinite(v):  # tall cached bars hold their count inside, below the prompt's line
                    inside = ax is bottom and v > 0.2 * max(prompt)
                    ax.annotate(fmt.format(v), (xi, v), ha="center", va="top" if inside else "bottom",
                                fontsize=7, color="white" if inside else "black")
    bottom.hlines(prompt, x - 0.45, x + 0.45, colors="k", linestyles="--", label="prompt tokens")
    for xi, n in zip(x, prompt):
        bottom.annotate(f"/ {n:.0f}", (xi + 0.45, n), ha="right", va="bottom", fontsize=7)
    top.set_yscale("log")
    top.set_ylim(top=np.nanmax([v for vs in ttft_s.values() for v in vs]) * 5)  # room for the legend
    top.set(ylabel="TTFT (s, client)", title=title)
    bottom.set_ylim(0, max(prompt) * 1.3)
    bottom.set(ylabel="cached prompt tokens")
    bottom.set_xticks(x, turns)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", ncol=3)
    return save(fig, path)


def turn_lines_plot(panels: Mapping[str, Mapping[str, Sequence[float | None]]], path: Path, ylabel: str, title: str,
                    goal: float | None = None, first_turn: int = 1) -> Path:
    """Per turn, one line per side (each its own marker and dash, so equal lines stay visible), one panel
    per group (e.g. per API), with an optional dashed goal; the y axis spans the values and the goal.

    Args:
        panels: panel title -> side label -> one value per turn (None where there is none).
        path: the PNG to write.
        ylabel, title: y axis label and the figure's title.
        goal: drawn as a dashed horizontal line in every panel.
        first_turn: the turn of each series' first value.

    Returns:
        ``path``.
    """
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), sharey=True, squeeze=False)
    values = [y for series in panels.values() for ys in series.values() for y in ys if y is not None]
    for ax, (name, series) in zip(axes[0], panels.items()):
        turns = max((len(ys) for ys in series.values()), default=0)
        for i, (label, ys) in enumerate(series.items()):
            ax.plot(np.arange(first_turn, first_turn + len(ys)), [np.nan if y is None else y for y in ys],
                    marker="oxs^"[i % 4], ls=("-", "--", ":", "-.")[i % 4], ms=5, label=label)
        if goal is not None:
            ax.axhline(goal, ls="--", lw=1, color="k", label=f"goal {goal:g}")
        ax.set(title=name, xlabel="turn")
        ax.set_xticks(np.arange(first_turn, first_turn + turns))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    if values:
        lo, hi = min(values + ([goal] if goal is not None else [])), max(values)
        pad = max(0.005, 0.1 * (hi - lo))
        axes[0][0].set_ylim(lo - 3 * pad, hi + pad)  # room below for the legend
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    return save(fig, path)


def request_bars_plot(panels: Mapping[str, Sequence[tuple[str, float, float]]], path: Path, title: str) -> Path:
    """Per request, its prompt tokens as an outlined bar and the cached part filled in, one panel per
    server (each panel's requests as ``(label, prompt, cached)`` in order)."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.5 * max((len(v) for v in panels.values()), default=1)
                                                          + 2), 2.8 * len(panels)), sharey=True, squeeze=False)
    for ax, (name, reqs) in zip(axes[:, 0], panels.items()):
        x = np.arange(len(reqs))
        ax.bar(x, [r[1] for r in reqs], color="none", edgecolor="0.3", label="prompt tokens")
        ax.bar(x, [r[2] for r in reqs], color="tab:blue", alpha=0.7, label="cached tokens")
        for xi, (_, prompt, cached) in zip(x, reqs):
            if prompt:
                ax.text(xi, prompt, f"{cached / prompt:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels([r[0] for r in reqs], fontsize=7)
        ax.set(title=name, ylabel="tokens")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("request (step.request)")
    fig.suptitle(title, fontsize=9)
    return save(fig, path, dpi=110)
