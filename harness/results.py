"""Results documents: one JSON file per run under ``results/<experiment>/``.

The document layout is fixed by ``harness/schema/results.schema.json``
(``schema_version`` 1) and validated before it is written. A run records:
the resolved config and its sha256, a benchmark identity (config plus trial
code, as asv does: changed measurements never compare as a speed change),
the machine, package versions, git state, the model and its fingerprint, the
timing protocol, each metric's unit, direction, raw samples and statistics,
named checks (exact-output comparisons and the like), paired comparisons,
and each criterion's verdict and level with the measured value beside the
threshold; ``verdict`` is PASS when every criterion passed, ``must_haves_pass``
when every P0 one did.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from harness import criteria, environment, old_names, stats, timing
from harness.config import ExperimentConfig

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).parent / "schema" / "results.schema.json"


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def validate(doc: dict) -> None:
    """Raise ``jsonschema.ValidationError`` when ``doc`` breaks the schema."""
    import jsonschema

    jsonschema.validate(doc, schema())


def benchmark_id(config: ExperimentConfig, model: str, trial_code: list[Any], variant: str | None = None) -> str:
    """What is measured, not how often: kind, params, model (and its compute variant), and the trial code."""
    h = hashlib.sha256()
    what = {"kind": config.kind, "params": config.params, "model": model}
    if variant not in ("quantized", "synthetic", None):  # ids of earlier runs (exact conversion) stay as they were
        what["variant"] = variant
    h.update(json.dumps(what, sort_keys=True).encode())
    for obj in trial_code:
        h.update(old_names.trial_source(inspect.getsource(obj)).encode())
    return h.hexdigest()[:16]


class Results:
    """Collects one run's measurements and writes the results document."""

    def __init__(self, config: ExperimentConfig, model: str, model_info: dict | None, trial_code: list[Any]):
        self.config = config
        self.started = datetime.now(timezone.utc)
        self.doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "experiment": config.name,
            "kind": config.kind,
            "run_id": f"{self.started:%Y%m%dT%H%M%SZ}-{model}",
            "created_at": self.started.isoformat(),
            "config": config.resolved(),
            "config_sha256": config.sha256(),
            "benchmark_id": benchmark_id(config, model, trial_code, (model_info or {}).get("variant")),
            "machine_info": environment.machine_info(),
            "packages": environment.packages(),
            "git": environment.git_info(),
            "model": {"name": model, **(model_info or {})},
            "protocol": timing.describe(config.protocol),
            "metrics": {},
            "checks": {},
            "comparisons": {},
            "outputs": {},
            "criteria": [],
            "verdict": None,
            "must_haves_pass": None,
            "plots": [],
        }

    # ------------------------------------------------------------ recording

    def metric(self, name: str, samples, unit: str, direction: str = "lower", description: str = "", **extra) -> dict:
        values = [float(x) for x in samples]
        entry = {"unit": unit, "direction": direction, "description": description, "samples": values, "stats": stats.summarize(values)}
        entry.update(extra)
        self.doc["metrics"][name] = entry
        return entry

    def timing(self, name: str, s: timing.Samples, description: str = "", lazy_gap: bool = True) -> dict:
        """A timed operation: materialized ms as the metric, lazy ms and peak MB beside it."""
        extra = {"peak_mb": {"samples": s.peak_mb, "max": max(s.peak_mb)}}
        if lazy_gap:
            extra["lazy_ms"] = {"samples": s.lazy_ms, "stats": stats.summarize(s.lazy_ms)}
        return self.metric(name, s.ms, "ms", "lower", description, **extra)

    def check(self, name: str, value: Any) -> None:
        self.doc["checks"][name] = value

    def checks(self, values: dict[str, Any]) -> None:
        """:meth:`check` each of ``values``, in order."""
        self.doc["checks"].update(values)

    def output(self, name: str, value: Any) -> None:
        self.doc["outputs"][name] = value

    def compare(self, name: str, a: str, b: str) -> dict:
        """Paired comparison of two metrics of this run: ratio of medians a/b and a Mann-Whitney U p-value."""
        xa, xb = self.doc["metrics"][a]["samples"], self.doc["metrics"][b]["samples"]
        p = stats.mannwhitney_p(xa, xb)
        entry = {
            "a": a,
            "b": b,
            "ratio_p50": float(np.median(xa) / np.median(xb)),
            "ratio_p95": float(np.percentile(xa, 95) / np.percentile(xb, 95)),
            "mannwhitney_p": p,
        }
        self.doc["comparisons"][name] = entry
        return entry

    # ------------------------------------------------------------ finishing

    def evaluate(self) -> list[dict]:
        model = self.doc["model"]["name"]
        verdicts = [criteria.verdict(c, self.doc) for c in self.config.criteria if criteria.applies(c, model)]
        self.doc["criteria"] = verdicts
        skipped = any(v["verdict"] == "SKIP" for v in verdicts)
        self.doc["verdict"] = "SKIP" if skipped else "PASS" if all(v["pass"] for v in verdicts) else "FAIL"
        self.doc["must_haves_pass"] = criteria.must_haves_pass(verdicts)
        return verdicts

    def write(self, out_dir: Path) -> Path:
        """Validate and write atomically; returns the JSON path."""
        self.doc["finished_at"] = datetime.now(timezone.utc).isoformat()
        self.doc["duration_s"] = (datetime.now(timezone.utc) - self.started).total_seconds()
        validate(self.doc)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{self.doc['run_id']}.json"
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.doc, f, indent=1, default=_jsonable)
            f.write("\n")
        os.replace(tmp, path)
        return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
