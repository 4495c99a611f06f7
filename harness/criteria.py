"""Pass criteria: a measured value of the results document against a threshold, at a level.

Levels follow the design doc: ``P0`` must-have, ``P1`` should-have, ``P2``
nice-to-have, and ``stretch``. A run fails (non-zero exit) only on a failed
must-have, unless ``--strict`` asks for every verdict.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

LEVELS = ("P0", "P1", "P2", "stretch")
MUST = "P0"
OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}


@dataclass(slots=True, frozen=True)
class Criterion:
    """A pass criterion: ``value`` is a dotted path into the results document."""

    name: str
    value: str
    op: str
    threshold: Any
    source: str = ""
    level: str = MUST
    models: tuple[str, ...] = ()   # the models it judges (empty: every model of the config)

    def __post_init__(self):
        object.__setattr__(self, "models", tuple(self.models))
        if self.op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, got {self.op!r}")
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {list(LEVELS)}, got {self.level!r}")
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
    """One criterion's verdict entry, the measured value beside the threshold (SKIP: the run measured
    nothing, and ``outputs.skipped`` says why, e.g. a client this machine lacks)."""
    skipped = doc.get("outputs", {}).get("skipped")
    if skipped:
        return {"name": c.name, "value": c.value, "measured": None, "op": c.op, "threshold": c.threshold,
                "pass": False, "verdict": "SKIP", "level": c.level, "source": c.source, "note": str(skipped)}
    try:
        measured = resolve(doc, c.value)
        ok = bool(OPS[c.op](measured, c.threshold))
        note = ""
    except KeyError:
        measured, ok, note = None, False, f"{c.value} is not in the results"
    except TypeError as exc:
        measured, ok, note = resolve(doc, c.value), False, f"cannot compare: {exc}"
    return {"name": c.name, "value": c.value, "measured": measured, "op": c.op, "threshold": c.threshold,
            "pass": ok, "verdict": "PASS" if ok else "FAIL", "level": c.level, "source": c.source, "note": note}


def applies(c: Criterion, model: str) -> bool:
    """Whether ``c`` judges a results document of ``model`` (a phase run on some models only)."""
    return not c.models or model in c.models


def must_haves_pass(verdicts: list[dict]) -> bool:
    """Every must-have (P0) verdict passed; entries without a level (older documents) count as must-haves."""
    return all(v["pass"] for v in verdicts if v.get("level", MUST) == MUST)
