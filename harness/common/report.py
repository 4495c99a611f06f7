"""What the results READMEs of the trials share: numbers as the tables print them, the verdict table, medians
and ratios."""

from __future__ import annotations

import statistics
from typing import Iterable

VERDICT_HEAD = "| goal | level | measured | verdict |\n|---|---|---|---|"


def fmt(v, none: str = "-") -> str:
    """A float to three significant digits, None as ``none``, anything else as ``str``."""
    if isinstance(v, float):
        return f"{v:.3g}"
    return none if v is None else str(v)


def verdict_rows(verdicts: Iterable[dict], none: str = "-") -> str:
    """One table row per criterion of ``Results.evaluate()``: its name, level, measured against its
    threshold, and the verdict in bold."""
    return "\n".join(f"| {v['name']} | {v['level']} | {fmt(v['measured'], none)} {v['op']} "
                     f"{fmt(v['threshold'], none)} | **{v['verdict']}** |" for v in verdicts)


def verdict_table(verdicts: Iterable[dict], none: str = "-") -> str:
    """The README's last table: every goal, its level, what was measured, the verdict."""
    return f"{VERDICT_HEAD}\n{verdict_rows(verdicts, none)}"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None where ``a`` is None or ``b`` is None or zero."""
    return a / b if a is not None and b else None


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
