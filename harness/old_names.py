"""Names that older results documents used, and the names they go by now.

Results files are never rewritten. Whatever reads one (``harness report``,
``harness compare``, the versions comparison, the EXP-006 table, the analysis
notebook) passes it through :func:`upgrade`, so old and new runs read alike:

    EXP-006 (reconstruction)   older documents                  now
    outputs                    seed_table                       expected_p95_table
    a row of that table        verdict_seed_method              verdict_concat
    checks                     seed_bB_lN_reconstruct_p95_ms    cell_bB_lN_reconstruct_p95_ms
                               seed_bB_lN_concat_p95_ms         cell_bB_lN_concat_p95_ms
    criteria[].value           checks.seed_bB_lN_...            checks.cell_bB_lN_...

Benchmark ids hash a trial's source (``harness.results.benchmark_id``); a module that moved, or a class
renamed, would change the id of what measures the same. :func:`trial_source` reads the source with the
names it was written with (:data:`MOVED`: today's module path or name, the one the ids were made with).
"""

from __future__ import annotations

import re

OUTPUTS = {"seed_table": "expected_p95_table"}
TABLE_ROW = {"verdict_seed_method": "verdict_concat"}
MOVED = {"harness.trials.hybrid": "harness.hybrid", "harness.trials.multi_model": "harness.multimodel",
         "harness.trials.block_store": "harness.blockstore", "harness.trials.chaos": "harness.chaos",
         "harness.servers.ours": "harness.chaos.server", "harness.servers": "harness.serving",
         "OurServer": "ChaosServer"}
_MOVED = re.compile(r"\b(" + "|".join(re.escape(m) for m in sorted(MOVED, key=len, reverse=True)) + r")\b")
_OLD_CHECK = re.compile(r"seed_(b\d+_l\d+_(?:reconstruct|concat)_p95_ms)")


def check_name(name: str) -> str:
    """Today's name of a check (``name`` itself when it is not an old one)."""
    m = _OLD_CHECK.fullmatch(name)
    return f"cell_{m[1]}" if m else name


def trial_source(source: str) -> str:
    """``source`` with the names of :data:`MOVED` as they were when benchmark ids were first made."""
    return _MOVED.sub(lambda m: MOVED[m[1]], source)


def upgrade(doc: dict) -> dict:
    """``doc`` with today's names: a new dict (``doc`` is left as it was), equal to ``doc`` when it has them already.

    Anything but a dict (not a results document) comes back as it is.
    """
    if not isinstance(doc, dict):
        return doc
    out = dict(doc)
    if isinstance(doc.get("checks"), dict):
        out["checks"] = {check_name(k): v for k, v in doc["checks"].items()}
    if isinstance(doc.get("outputs"), dict):
        outputs = {OUTPUTS.get(k, k): v for k, v in doc["outputs"].items()}
        if isinstance(outputs.get("expected_p95_table"), list):
            outputs["expected_p95_table"] = [{TABLE_ROW.get(k, k): v for k, v in row.items()}
                                             for row in outputs["expected_p95_table"]]
        out["outputs"] = outputs
    if isinstance(doc.get("criteria"), list):
        out["criteria"] = [{**c, "value": _value(c["value"])} if isinstance(c.get("value"), str) else c
                           for c in doc["criteria"]]
    return out


def _value(path: str) -> str:
    head, _, name = path.partition(".")
    return f"checks.{check_name(name)}" if head == "checks" else path
