"""Pass criteria: a measured value of the results document against a threshold."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@dataclass(slots=True, frozen=True)
class Criterion:
    """A pass criterion: ``value`` is a dotted path into the results document."""

    name: str
    value: str
    op: str
    threshold: Any
    source: str = ""

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {self.op!r}")
        if not self.value or not all(self.value.split(".")):
            raise ValueError(f"value must be a dotted path such as 'metrics.ttft_ms.stats.p50', got {self.value!r}")


def resolve(doc: dict, dotted: str) -> Any:
    """The value at a dotted path of ``doc``; KeyError when a part is missing."""
    node: Any = doc
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(dotted)
    return node


def verdict(c: Criterion, doc: dict) -> dict:
    """One criterion's verdict entry, the measured value beside the threshold."""
    try:
        measured = resolve(doc, c.value)
        ok = bool(OPS[c.op](measured, c.threshold))
        note = ""
    except KeyError:
        measured, ok, note = None, False, f"{c.value} is not in the results"
    except TypeError as exc:
        measured, ok, note = resolve(doc, c.value), False, f"cannot compare: {exc}"
    return {"name": c.name, "value": c.value, "measured": measured, "op": c.op, "threshold": c.threshold,
            "pass": ok, "verdict": "PASS" if ok else "FAIL", "source": c.source, "note": note}
