"""What a run prints: the kind's headline table, the verdicts by level, and where the files went.

The full metric list is in the JSON; ``-v`` (and ``report``) print it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def _number(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def verdict_lines(doc: dict) -> list[str]:
    """One line per criterion: level, verdict, the measured value beside the threshold."""
    lines = []
    for c in doc["criteria"]:
        note = f"  ({c['note']})" if c.get("note") else ""
        lines.append(f"  {c.get('level', 'P0'):7} [{c['verdict']}] {c['name']}: "
                     f"{_number(c['measured'])} {c['op']} {c['threshold']}{note}")
    return lines


def metric_lines(doc: dict) -> list[str]:
    lines = []
    for name, m in doc["metrics"].items():
        s = m["stats"]
        lines.append(f"  {name}: p50 {s['median']:.4g} {m['unit']}, p95 {s['p95']:.4g} (n={s['n']})")
    return lines


def headline_verdict(doc: dict) -> str:
    """PASS, or which levels failed (a stretch miss is not a broken run)."""
    if doc["verdict"] == "PASS":
        return "PASS"
    if doc["verdict"] == "SKIP":
        return f"SKIP: {doc['outputs'].get('skipped')}"
    failed = sorted({c.get("level", "P0") for c in doc["criteria"] if not c["pass"]})
    must = "must-haves pass" if doc.get("must_haves_pass", not failed) else "a MUST-HAVE FAILED"
    return f"FAIL at {', '.join(failed)} ({must})"


def summary(doc: dict, path: Path | None = None, verbose: bool = False,
            headline: Callable[[dict], list[str]] | None = None) -> str:
    """The run's lines for the terminal; ``verbose`` adds every metric's p50 and p95."""
    lines = [f"{doc['experiment']} on {doc['model']['name']}: {headline_verdict(doc)}"]
    if headline is not None:
        lines += headline(doc)
    lines += verdict_lines(doc)
    if verbose:
        lines += metric_lines(doc)
    if path is not None:
        lines.append(f"  results: {path}")
        if doc.get("plots"):
            lines.append(f"  plots: {', '.join(str(path.parent / p) for p in doc['plots'])}")
    return "\n".join(lines)
