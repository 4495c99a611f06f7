"""Run an experiment config: for each model, run its kind and write one results document."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness import console
from harness.config import ExperimentConfig
from harness.results import Results
from harness.trials import KINDS


@dataclass(slots=True)
class Context:
    """What a kind's ``run`` gets: the config, the loaded model, where to record."""

    config: ExperimentConfig
    model_name: str
    loaded: Any                 # harness.models.LoadedModel, or None for synthetic kinds
    results: Results
    out_dir: Path
    progress: tqdm
    plots: list[Path] = field(default_factory=list)

    @property
    def params(self) -> dict:
        return self.config.params

    def plot_path(self, name: str) -> Path:
        return self.out_dir / f"{self.results.doc['run_id']}-{name}.png"


def run(config: ExperimentConfig, out_root: Path = Path("results"), verbose: bool = False) -> list[Path]:
    """Run every model of ``config``; return the JSON paths written. ``verbose`` prints every metric too."""
    from harness import device, models

    device.ensure_working_device()  # every kind computes on the default device: a wrong GPU leaves it first
    kind = KINDS[config.kind]
    out_dir = out_root / config.name
    variant = models.default_variant(config.model_variant)
    return [_run_model(config, kind, name, variant, out_dir, verbose) for name in config.models]


def _run_model(config: ExperimentConfig, kind, name: str, variant: str, out_dir: Path, verbose: bool) -> Path:
    from harness import models

    loaded = models.load(name, variant) if kind.needs_model else None
    info = ({"path": str(loaded.path), "fingerprint": loaded.fingerprint, "variant": loaded.variant}
            if loaded else None)
    results = Results(config, name, info, [kind.run, *kind.trial_code])
    with tqdm(desc=f"{config.name} [{name}]", unit="step", leave=False) as bar:
        ctx = Context(config, name, loaded, results, out_dir, bar)
        out_dir.mkdir(parents=True, exist_ok=True)
        kind.run(ctx)
    results.doc["plots"] = [p.name for p in ctx.plots]
    results.evaluate()
    path = results.write(out_dir)
    print(console.summary(results.doc, path, verbose, kind.headline))
    return path
