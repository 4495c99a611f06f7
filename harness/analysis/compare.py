"""Compare result files: flag a metric only when it moved by more than a factor AND significantly.

As asv does: a metric is flagged when the ratio of medians (after/before)
passes ``factor`` in the worse direction (or better, for an improvement) and
a two-sided Mann-Whitney U test rejects equal distributions at ``alpha``.
Anything else prints as ``~ratio``. Two results with different benchmark
identities measured different things and are reported "not comparable".
The first document is the baseline; every later one is compared with it.

The result is one tidy pandas DataFrame (a row per later document and
metric), so a table per metric is ``c.table.groupby("metric")``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from harness import old_names
from harness.stats import mannwhitney_p

REGRESSION, IMPROVEMENT, SAME = "regression", "improvement", "~"
# Fixed so that a comparison with no comparable metric is still a table with these columns.
COLUMNS = ["after", "metric", "unit", "direction", "before_p50", "after_p50", "ratio", "p_value",
           "n_before", "n_after", "flag", "shown", "control"]


def _label(doc: dict, path: str | None = None) -> str:
    pk = doc.get("packages", {})
    return f"{doc.get('run_id', path)} (mlx {pk.get('mlx', '?')}, mlx-lm {pk.get('mlx-lm', '?')})"


def _ratio(before: float, after: float) -> float:
    # A zero baseline (e.g. no bytes copied) has no finite ratio: equal is 1, anything else inf.
    if before == 0:
        return 1.0 if after == 0 else float("inf")
    return after / before


def flag(before: Sequence[float], after: Sequence[float], direction: str, factor: float = 1.10,
         alpha: float = 0.01) -> tuple[str, float, float | None]:
    """Flag one metric's change between two sample sets.

    Args:
        before, after: the raw samples of the baseline and of the later run.
        direction: "lower" or "higher", which way is better.
        factor: how far the ratio of medians must move to be flagged.
        alpha: the Mann-Whitney U (two-sided) significance level.

    Returns:
        (flag, ratio of medians after/before, p-value or None with a single sample).
    """
    ratio = _ratio(float(np.median(before)), float(np.median(after)))
    p = mannwhitney_p(before, after)
    worse = ratio > factor if direction == "lower" else ratio < 1 / factor
    better = ratio < 1 / factor if direction == "lower" else ratio > factor
    significant = p is not None and p < alpha
    if significant and worse:
        return REGRESSION, ratio, p
    if significant and better:
        return IMPROVEMENT, ratio, p
    return SAME, ratio, p


@dataclass
class Comparison:
    """One tidy table: a row per (later document, metric); ``not_comparable`` lists pairs skipped."""

    baseline: str
    table: pd.DataFrame
    not_comparable: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    machines: list[str] = field(default_factory=list)  # how a later run's machine differs from the baseline's

    @property
    def regressions(self) -> pd.DataFrame:
        """The rows flagged "regression"."""
        return self.table[self.table["flag"] == REGRESSION]


def compare(docs: list[dict], factor: float = 1.10, alpha: float = 0.01, names: list[str] | None = None) -> Comparison:
    """Compare every later results document with the first.

    Args:
        docs: results documents (loaded JSON); the first is the baseline.
        factor, alpha: see ``flag``.
        names: labels for the documents (their paths) where a run_id is missing.

    Returns:
        A Comparison whose table has the ``COLUMNS``, a row per later document and shared metric.
    """
    if len(docs) < 2:
        raise ValueError("compare needs at least two results documents")
    names = names or [None] * len(docs)
    base, rows, nc, missing = docs[0], [], [], []
    machines = []
    for doc, name in zip(docs[1:], names[1:]):
        label = _label(doc, name)
        machines += [f"{label}: {d}" for d in machine_differences(base.get("machine_info", {}),
                                                                  doc.get("machine_info", {}))]
        if doc["benchmark_id"] != base["benchmark_id"] or doc["experiment"] != base["experiment"]:
            nc.append(f"{label}: benchmark id {doc['benchmark_id']} != baseline {base['benchmark_id']} "
                      "(config, model or trial code differ): NOT COMPARABLE")
            continue
        bm, am = base["metrics"], doc["metrics"]
        missing += [f"{label}: {m} only in the baseline" for m in bm if m not in am]
        missing += [f"{label}: {m} not in the baseline" for m in am if m not in bm]
        for metric in (m for m in bm if m in am):
            before, after = bm[metric], am[metric]
            if (before["unit"], before["direction"]) != (after["unit"], after["direction"]):
                nc.append(f"{label}: {metric} is {after['unit']}, {after['direction']} is better, but "
                          f"{before['unit']}, {before['direction']} in the baseline: NOT COMPARABLE")
                continue
            f, ratio, p = flag(before["samples"], after["samples"], before["direction"], factor, alpha)
            rows.append({
                "after": label, "metric": metric, "unit": before["unit"], "direction": before["direction"],
                "before_p50": float(np.median(before["samples"])), "after_p50": float(np.median(after["samples"])),
                "ratio": ratio, "p_value": p, "n_before": len(before["samples"]), "n_after": len(after["samples"]),
                "flag": f, "shown": f"{f} {ratio:.2f}x" if f != SAME else f"~{ratio:.2f}",
                "control": bool(before.get("control")),
            })
    return Comparison(_label(base, names[0]), pd.DataFrame(rows, columns=COLUMNS), nc, missing, machines)


# What makes two machines compute at different speeds: device, BLAS, core count, CPU.
MACHINE_KEYS = ("mlx_device", "processor", "cpu_count", "system")


def machine_differences(before: dict, after: dict) -> list[str]:
    """Lines naming what differs between two runs' machine info (empty when nothing that matters does).

    The matmul rate is a measurement: it counts as a difference only past a factor of 2.
    """
    out = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in MACHINE_KEYS if before.get(k) != after.get(k)]
    b_blas, a_blas = (before.get("blas") or {}).get("blas"), (after.get("blas") or {}).get("blas")
    if b_blas != a_blas:
        out.append(f"BLAS {b_blas or 'unrecorded'} -> {a_blas or 'unrecorded'}")
    g0, g1 = before.get("matmul_gflops_f32"), after.get("matmul_gflops_f32")
    if g0 and g1 and max(g0, g1) / min(g0, g1) > 2:
        out.append(f"f32 matmul {g0} -> {g1} GFLOP/s")
    return out


def format_table(c: Comparison) -> str:
    """The comparison as text: the table (pandas ``to_string``; tabulate, which
    ``to_markdown`` needs, is not a dependency), then not-comparable pairs,
    missing metrics, control-metric warnings and the regression count."""
    lines = [f"baseline: {c.baseline}"]
    if not c.table.empty:
        t = c.table[["after", "metric", "unit", "before_p50", "after_p50", "ratio", "p_value", "shown"]]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    lines += [f"MACHINE: {m} (timings compare machines as well as code)" for m in c.machines]
    lines += c.not_comparable + c.missing
    if not c.table.empty:
        moved = c.table[c.table["control"] & (c.table["flag"] != SAME)]
        for _, r in moved.iterrows():
            lines.append(f"WARNING: control metric {r['metric']} moved ({r['shown']}) in {r['after']}: "
                         "the machine changed between runs; flags beside it reflect the machine, not the code")
    n = len(c.regressions)
    if c.table.empty:
        lines.append("no metric was compared")
    else:
        lines.append(f"{n} regression(s) flagged" if n else "no regression flagged")
    return "\n".join(lines)


def load(path: str | Path) -> dict:
    """Read one results document, checking the fields compare uses.

    Raises:
        ValueError: naming the file (and metric) when it is unreadable or a field is missing or wrong.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a results document: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a results document (a JSON {type(doc).__name__}, not an object)")
    for key in ("benchmark_id", "experiment", "metrics"):
        if key not in doc:
            raise ValueError(f"{path}: not a results document (no {key!r})")
    for name, m in doc["metrics"].items():
        # Checked here so that a hand-edited or truncated file fails with its name, not a KeyError.
        if not isinstance(m, dict) or "unit" not in m:
            raise ValueError(f"{path}: metric {name!r} has no unit")
        if m.get("direction") not in ("lower", "higher"):
            raise ValueError(f"{path}: metric {name!r} direction is {m.get('direction')!r}, not 'lower' or 'higher'")
        samples = m.get("samples")
        if (not isinstance(samples, list) or not samples
                or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in samples)):
            raise ValueError(f"{path}: metric {name!r} needs a non-empty list of finite numeric samples")
    return old_names.upgrade(doc)


def main(paths: list[str], factor: float = 1.10, alpha: float = 0.01) -> int:
    """Print the comparison; 1 when a regression is flagged, 2 on unreadable input, else 0."""
    try:
        docs = [load(p) for p in paths]
        c = compare(docs, factor, alpha, names=[str(p) for p in paths])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(c))
    return 1 if len(c.regressions) else 0
