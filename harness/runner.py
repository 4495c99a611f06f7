"""Run an experiment config: for each model, run its kind and write one results document."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness import results as R
from harness.config import ExperimentConfig
from harness.kinds import KINDS


@dataclass(slots=True)
class Context:
    """What a kind's ``run`` gets: the config, the loaded model, where to record."""

    config: ExperimentConfig
    model_name: str
    loaded: Any                 # harness.models.LoadedModel, or None for synthetic kinds
    results: R.Results
    out_dir: Path
    progress: tqdm
    plots: list[Path] = field(default_factory=list)

    @property
    def params(self) -> dict:
        return self.config.params

    def plot_path(self, name: str) -> Path:
        return self.out_dir / f"{self.results.doc['run_id']}-{name}.png"


def run(config: ExperimentConfig, out_root: Path = Path("results")) -> list[Path]:
    """Run every model of ``config``; return the JSON paths written."""
    from harness import models

    kind = KINDS[config.kind]
    out_dir = out_root / config.name
    written = []
    for name in config.models:
        loaded = models.load(name) if kind.needs_model else None
        info = {"path": str(loaded.path), "fingerprint": loaded.fingerprint} if loaded else None
        results = R.Results(config, name, info, [kind.run, *kind.trial_code])
        with tqdm(desc=f"{config.name} [{name}]", unit="step", leave=False) as bar:
            ctx = Context(config, name, loaded, results, out_dir, bar)
            out_dir.mkdir(parents=True, exist_ok=True)
            kind.run(ctx)
        results.doc["plots"] = [p.name for p in ctx.plots]
        results.evaluate()
        path = results.write(out_dir)
        written.append(path)
        print(summary(results.doc, path))
    return written


def summary(doc: dict, path: Path | None = None) -> str:
    """A few lines for the terminal: verdicts and the headline medians."""
    lines = [f"{doc['experiment']} on {doc['model']['name']}: {doc['verdict']}" + (f"  ({path})" if path else "")]
    for c in doc["criteria"]:
        measured = c["measured"]
        if isinstance(measured, float):
            measured = f"{measured:.4g}"
        lines.append(f"  [{c['verdict']}] {c['name']}: {measured} {c['op']} {c['threshold']}" + (f"  ({c['note']})" if c.get("note") else ""))
    for name, m in doc["metrics"].items():
        s = m["stats"]
        lines.append(f"  {name}: p50 {s['median']:.4g} {m['unit']}, p95 {s['p95']:.4g} (n={s['n']})")
    return "\n".join(lines)
