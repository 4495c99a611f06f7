"""Compare result files: flag a metric only when it moved by more than a factor AND significantly.

As asv does: a metric is flagged when the ratio of medians (after/before)
passes ``factor`` in the worse direction (or better, for an improvement) and
a two-sided Mann-Whitney U test rejects equal distributions at ``alpha``.
Anything else prints as ``~ratio``. Two results with different benchmark
identities measured different things and are reported "not comparable".
The first document is the baseline; every later one is compared with it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats as sps

REGRESSION, IMPROVEMENT, SAME = "regression", "improvement", "~"


def _label(doc: dict, path: str | None = None) -> str:
    pk = doc.get("packages", {})
    return f"{doc.get('run_id', path)} (mlx {pk.get('mlx', '?')}, mlx-lm {pk.get('mlx-lm', '?')})"


def flag(before, after, direction: str, factor: float = 1.10, alpha: float = 0.01) -> tuple[str, float, float | None]:
    """(flag, ratio of medians after/before, Mann-Whitney p) for two sample sets."""
    ratio = float(np.median(after) / np.median(before))
    p = float(sps.mannwhitneyu(before, after, alternative="two-sided").pvalue) if min(len(before), len(after)) > 1 else None
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

    @property
    def regressions(self) -> pd.DataFrame:
        return self.table[self.table["flag"] == REGRESSION]


def compare(docs: list[dict], factor: float = 1.10, alpha: float = 0.01, names: list[str] | None = None) -> Comparison:
    if len(docs) < 2:
        raise ValueError("compare needs at least two results documents")
    names = names or [None] * len(docs)
    base, rows, nc, missing = docs[0], [], [], []
    for doc, name in zip(docs[1:], names[1:]):
        label = _label(doc, name)
        if doc["benchmark_id"] != base["benchmark_id"] or doc["experiment"] != base["experiment"]:
            nc.append(f"{label}: benchmark id {doc['benchmark_id']} != baseline {base['benchmark_id']} "
                      "(config, model or trial code differ): NOT COMPARABLE")
            continue
        bm, am = base["metrics"], doc["metrics"]
        missing += [f"{label}: {m} only in the baseline" for m in bm if m not in am]
        missing += [f"{label}: {m} not in the baseline" for m in am if m not in bm]
        for metric in (m for m in bm if m in am):
            before, after = bm[metric], am[metric]
            f, ratio, p = flag(before["samples"], after["samples"], before["direction"], factor, alpha)
            rows.append({
                "after": label, "metric": metric, "unit": before["unit"], "direction": before["direction"],
                "before_p50": float(np.median(before["samples"])), "after_p50": float(np.median(after["samples"])),
                "ratio": ratio, "p_value": p, "n_before": len(before["samples"]), "n_after": len(after["samples"]),
                "flag": f, "shown": f"{f} {ratio:.2f}x" if f != SAME else f"~{ratio:.2f}",
                "control": bool(before.get("control")),
            })
    return Comparison(_label(base, names[0]), pd.DataFrame(rows), nc, missing)


def format_table(c: Comparison) -> str:
    lines = [f"baseline: {c.baseline}"]
    if not c.table.empty:
        t = c.table[["after", "metric", "unit", "before_p50", "after_p50", "ratio", "p_value", "shown"]]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    lines += c.not_comparable + c.missing
    if not c.table.empty:
        moved = c.table[c.table["control"] & (c.table["flag"] != SAME)]
        for _, r in moved.iterrows():
            lines.append(f"WARNING: control metric {r['metric']} moved ({r['shown']}) in {r['after']}: "
                         "the machine changed between runs; flags beside it reflect the machine, not the code")
    n = len(c.regressions)
    lines.append(f"{n} regression(s) flagged" if n else "no regression flagged")
    return "\n".join(lines)


def load(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read a results document: {exc}") from None
    for key in ("benchmark_id", "experiment", "metrics"):
        if key not in doc:
            raise ValueError(f"{path}: not a results document (no {key!r})")
    return doc


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
