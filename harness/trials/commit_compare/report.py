"""Paired ratios new ÷ old per turn type, their spread, and which move beyond the noise.

Each step of the workload is a pair (the two servers took it back to back), so a turn type's ratio is
the median of its pairs' ratios, never a ratio of two medians. Its spread is a bootstrap interval of that
median (``CONFIDENCE``, resampling the pairs); a turn type of at least ``MIN_PAIRS`` pairs is **slower**
when the whole interval lies above ``1 + tolerance`` and the Wilcoxon signed-rank test of the log ratios
(scipy) rejects no change (p <= ``SIGNIFICANCE``), **faster** likewise below ``1 - tolerance``, else within
noise: a factor and a test together, as asv's compare and ``harness compare`` flag. The interval alone
flagged a commit against itself (decode at batch 4, 1.067x over 5 pairs all one way, p 0.062). A run of one commit against itself measures the comparison's own
noise: every interval should straddle 1.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from harness.trials.commit_compare.workload import KINDS

CONFIDENCE = 0.90
RESAMPLES = 2000
MIN_PAIRS = 5          # fewer pairs give an interval, not a verdict
SIGNIFICANCE = 0.05    # with 5 pairs the smallest two-sided Wilcoxon p is 0.0625: 6 pairs at least to flag
METRICS = {"ttft": "ttft_s", "total": "total_s"}   # decode rows: "pace" (seconds per token after the first)


def pairs(rows: list[dict], new: str, old: str, kind: str, field: str) -> list[tuple[float, float]]:
    """``(new, old)`` values of ``field`` for every pair of ``kind`` both sides answered."""
    by_pair: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["kind"] == kind and r.get("error") is None and r.get(field):
            by_pair[r["pair"]][r["server"]] = r[field]
    return [(v[new], v[old]) for _, v in sorted(by_pair.items()) if new in v and old in v]


def summarize(ratios: list[float], tolerance: float, seed: int = 0) -> dict:
    """The median ratio, its bootstrap interval, the Wilcoxon p-value and the verdict."""
    from scipy.stats import wilcoxon

    x = np.log(np.asarray(ratios, dtype=float))
    rng = np.random.default_rng(seed)
    boot = np.median(rng.choice(x, size=(RESAMPLES, len(x)), replace=True), axis=1)
    lo, hi = np.quantile(boot, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    try:
        p = float(wilcoxon(x).pvalue) if len(x) >= 2 and np.any(x != 0) else 1.0
    except ValueError:
        p = 1.0
    lo, hi = math.exp(lo), math.exp(hi)
    verdict = ("few pairs" if len(x) < MIN_PAIRS else "noise" if p > SIGNIFICANCE
               else "slower" if lo > 1 + tolerance else "faster" if hi < 1 - tolerance else "noise")
    return {"ratio": float(math.exp(np.median(x))), "low": lo, "high": hi, "pairs": len(x), "p": p,
            "verdict": verdict}


def table(rows: list[dict], new: str, old: str, tolerance: float) -> dict[str, dict[str, dict]]:
    """``{kind: {metric: summary}}`` of one model's rows; a kind no pair answered is left out."""
    out: dict[str, dict[str, dict]] = {}
    for kind in KINDS:
        metrics = {"pace": "pace_s"} if kind.startswith("decode") else METRICS
        for name, field in metrics.items():
            got = pairs(rows, new, old, kind, field)
            if got:
                out.setdefault(kind, {})[name] = summarize([n / o for n, o in got], tolerance)
    return out


def checks(out: dict, tolerance: float) -> dict:
    """What the criteria read: failures, errors, and every (model, kind, metric) moved beyond the noise."""
    c = {"parts_failed": len(out.get("failed", [])), "errors": 0, "slower": [], "faster": [], "compared": 0}
    for model, d in out.get("models", {}).items():
        c["errors"] += sum(r.get("error") is not None for r in d["rows"])
        for kind, metrics in d["table"].items():
            for metric, s in metrics.items():
                c["compared"] += 1
                if s["verdict"] in ("slower", "faster"):
                    c[s["verdict"]].append(f"{model} {kind} {metric} {s['ratio']:.3f}x")
    c["slower_count"] = len(c["slower"])
    c["tolerance"] = tolerance
    return c


def text(out: dict) -> str:
    """The console's and the README's table: one line per model, turn type and metric."""
    lines = [f"new {out['new']['label']} ÷ old {out['old']['label']} (paired medians, "
             f"{CONFIDENCE:.0%} bootstrap interval, Wilcoxon p)"]
    for model, d in out["models"].items():
        lines.append(f"\n{model}")
        lines.append(f"  {'turn type':13} {'metric':6} {'ratio':>7}  {'interval':>15}  {'pairs':>5}  {'p':>6}  verdict")
        for kind, metrics in d["table"].items():
            for metric, s in metrics.items():
                lines.append(f"  {kind:13} {metric:6} {s['ratio']:7.3f}  [{s['low']:.3f}, {s['high']:.3f}]  "
                             f"{s['pairs']:5d}  {s['p']:6.3f}  {s['verdict']}")
    return "\n".join(lines)
