"""Declarative experiment configs: one TOML file per experiment in ``experiments/``.

A config names the trial implementation (``kind``), the models, the kind's
parameters, the timing protocol, the pass criteria (as data, each with its source) and
the plots to write::

    name = "exp_003_cache_injection"
    kind = "cache_injection"
    description = "EXP-003: ..."
    models = ["smollm2-135m", "gemma3-270m"]

    [params]                 # checked against the kind's declared parameters
    history_tokens = 256

    [protocol]
    warmup = 1
    trials = 5

    [quick]                  # dotted overrides applied by --quick
    "params.history_tokens" = 64

    [[criteria]]
    name = "outputs match"   # evaluated against the results document
    value = "checks.outputs_match"
    op = "=="
    threshold = true
    source = "EXP-003: with and without the cache, outputs match exactly"
    level = "P0"             # P0 must-have (the default), P1 should-have, P2 nice-to-have, stretch

    [outputs]
    plots = ["cdf", "bars"]

Every unknown key or bad value raises :class:`ConfigError` naming the file,
the key and what is allowed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.criteria import Criterion
from harness.timing import Protocol
from harness.trials import KINDS

TOP_KEYS = {"name", "kind", "description", "models", "model_variant", "params", "protocol", "quick", "criteria",
            "outputs"}
VARIANT_CHOICES = ("auto", "quantized", "f32")
PROTOCOL_KEYS = {"warmup", "trials"}
CRITERION_KEYS = {"name", "value", "op", "threshold", "source", "level", "models"}
OUTPUT_KEYS = {"plots"}


class ConfigError(ValueError):
    """A config file that cannot be run as written."""


@dataclass(slots=True)
class ExperimentConfig:
    path: Path
    name: str
    kind: str
    description: str
    models: list[str]
    params: dict[str, Any]
    protocol: Protocol
    criteria: list[Criterion]
    plots: list[str]
    quick: bool = False
    overrides: list[str] = field(default_factory=list)
    model_variant: str = "auto"   # compute variant of registered models; auto: by device (harness.models)

    def resolved(self) -> dict:
        """The config as run (defaults filled in, overrides applied), JSON-ready."""
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "models": list(self.models),
            "model_variant": self.model_variant,
            "params": dict(self.params),
            "protocol": {"warmup": self.protocol.warmup, "trials": self.protocol.trials},
            "criteria": [
                {"name": c.name, "value": c.value, "op": c.op, "threshold": c.threshold, "source": c.source, "level": c.level}
                for c in self.criteria
            ],
            "outputs": {"plots": list(self.plots)},
            "quick": self.quick,
            "overrides": list(self.overrides),
        }

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.resolved(), sort_keys=True).encode()).hexdigest()


def _fail(path: Path, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}: {message}")


def _parse_value(text: str) -> Any:
    """A --set value as TOML (numbers, booleans, arrays, quoted strings), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_dotted(doc: dict, dotted: str, value: Any, path: Path) -> None:
    parts = dotted.split(".")
    node = doc
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise _fail(path, dotted, f"{part!r} is not a table")
    node[parts[-1]] = value


PACKAGED = Path(__file__).parent / "experiments"  # the default configs, installed with the package


def find(name_or_path: str | Path) -> Path:
    """A config file: a path as given, else a packaged config by name (``exp_006_reconstruction``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = PACKAGED / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    return packaged if packaged.is_file() else path


def load(path: str | Path, overrides: list[str] | None = None, quick: bool = False) -> ExperimentConfig:
    """Read, override and validate an experiment config.

    Args:
        path: the TOML file, or the name of a packaged config (see :func:`find`).
        overrides: ``key=value`` strings with dotted keys (``params.trials=3``).
        quick: apply the file's ``[quick]`` overrides (a CPU-sized run).
    """
    path = find(path)
    doc = _apply_overrides(_read(path), path, overrides or [], quick)
    kind = _kind(doc, path)
    spec = KINDS[kind]
    models = _models(doc, path, spec.needs_model)
    variant = doc.get("model_variant", "auto")
    if variant not in VARIANT_CHOICES:
        raise _fail(path, "model_variant", f"must be one of {list(VARIANT_CHOICES)}, got {variant!r}")
    return ExperimentConfig(
        path=path,
        name=doc["name"],
        kind=kind,
        description=str(doc.get("description", "")),
        models=models,
        params=_params(doc, path, kind, spec),
        protocol=_protocol(doc, path),
        criteria=_criteria(doc, path),
        plots=_plots(doc, path, kind, spec),
        quick=quick,
        overrides=list(overrides or []),
        model_variant=variant,
    )


def _read(path: Path) -> dict:
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    _known_top_keys(doc, path)
    return doc


def _known_top_keys(doc: dict, path: Path) -> None:
    unknown = set(doc) - TOP_KEYS
    if unknown:
        raise _fail(path, sorted(unknown)[0], f"unknown key; allowed: {sorted(TOP_KEYS)}")


def _apply_overrides(doc: dict, path: Path, overrides: list[str], quick: bool) -> dict:
    """The document with the ``[quick]`` table (when ``quick``) and then each ``--set`` applied."""
    quick_table = doc.pop("quick", {})
    if not isinstance(quick_table, dict):
        raise _fail(path, "quick", "must be a table of dotted overrides")
    doc = copy.deepcopy(doc)
    if quick:
        for key, value in quick_table.items():
            _set_dotted(doc, key, value, path)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}: --set {item!r}: expected key=value, e.g. protocol.trials=3")
        _set_dotted(doc, key.strip(), _parse_value(text.strip()), path)
    _known_top_keys(doc, path)
    return doc


def _kind(doc: dict, path: Path) -> str:
    for key in ("name", "kind"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise _fail(path, key, "required, a non-empty string")
    if doc["kind"] not in KINDS:
        raise _fail(path, "kind", f"unknown kind {doc['kind']!r}; allowed: {sorted(KINDS)}")
    return doc["kind"]


def _models(doc: dict, path: Path, needs_model: bool) -> list[str]:
    models = doc.get("models", [])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) for m in models):
        raise _fail(path, "models", "required, a non-empty list of model names")
    if needs_model:
        from harness.models import REGISTRY, SYNTHETIC

        for m in models:
            if m not in REGISTRY and m not in SYNTHETIC:
                raise _fail(path, "models", f"unknown model {m!r}; allowed: {sorted(REGISTRY) + sorted(SYNTHETIC)}")
    return models


def _params(doc: dict, path: Path, kind: str, spec) -> dict[str, Any]:
    """The kind's parameters: defaults filled in, each checked against its declaration, then the kind's own check."""
    params = doc.get("params", {})
    if not isinstance(params, dict):
        raise _fail(path, "params", "must be a table")
    for key in params:
        if key not in spec.params:
            raise _fail(path, f"params.{key}", f"unknown parameter of kind {kind!r}; allowed: {sorted(spec.params)}")
    resolved = {key: _param_value(params.get(key, p.default), p, path, key) for key, p in spec.params.items()}
    try:
        spec.validate(resolved)
    except ValueError as exc:
        raise _fail(path, "params", str(exc)) from None
    return resolved


def _param_value(value: Any, p, path: Path, key: str) -> Any:
    if p.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, p.type) and not (p.type is int and isinstance(value, bool))
    if p.type is list:
        ok = isinstance(value, list)
    if not ok:
        raise _fail(path, f"params.{key}", f"must be {p.type.__name__} ({p.help}), got {value!r}")
    if p.choices is not None and any(v not in p.choices for v in (value if p.type is list else [value])):
        among = f"a list of items among {list(p.choices)}" if p.type is list else f"one of {list(p.choices)}"
        raise _fail(path, f"params.{key}", f"must be {among}, got {value!r}")
    if not _kept_bounds(value, p):
        raise _fail(path, f"params.{key}", f"must be {_bounds(p)}, got {value!r}")
    return value


def _kept_bounds(value: Any, p) -> bool:
    """Whether ``value`` keeps the bounds ``p`` declares (a list's items: each, and integers)."""
    if p.type is not list:
        return _in_range(value, p)
    if p.nonempty and not value or p.pair and len(value) != 2:
        return False
    if p.min is None and p.max is None and not p.pair:
        return True
    if not all(isinstance(x, int) and not isinstance(x, bool) and _in_range(x, p) for x in value):
        return False
    return not (p.pair and value[0] > value[1])


def _in_range(x: Any, p) -> bool:
    if p.strict:
        return (p.min is None or x > p.min) and (p.max is None or x < p.max)
    return (p.min is None or x >= p.min) and (p.max is None or x <= p.max)


def _bounds(p) -> str:
    """The bounds ``p`` declares, in words: ``>= 1``, ``a non-empty list of integers >= 1``, ``[low, high] ...``."""
    lo, hi = (">", "<") if p.strict else (">=", "<=")
    words = " and ".join([f"{lo} {p.min}"] * (p.min is not None) + [f"{hi} {p.max}"] * (p.max is not None))
    if p.type is not list:
        return words
    if p.pair:
        return f"[low, high], integers {words} with low <= high"
    items = f" of integers {words}" if words else ""
    return f"a {'non-empty ' if p.nonempty else ''}list{items}"


def _protocol(doc: dict, path: Path) -> Protocol:
    proto = doc.get("protocol", {})
    if not isinstance(proto, dict):
        raise _fail(path, "protocol", f"a table with keys {sorted(PROTOCOL_KEYS)}")
    for key in sorted(set(proto) - PROTOCOL_KEYS):
        raise _fail(path, f"protocol.{key}", f"unknown key; allowed: {sorted(PROTOCOL_KEYS)}")
    try:
        return Protocol(proto.get("warmup", 1), proto.get("trials", 5))
    except ValueError as exc:
        raise _fail(path, "protocol", str(exc)) from None


def _criteria(doc: dict, path: Path) -> list[Criterion]:
    criteria = []
    for i, raw in enumerate(doc.get("criteria", [])):
        where = f"criteria[{i}]"
        if not isinstance(raw, dict):
            raise _fail(path, where, "must be a table")
        if set(raw) - CRITERION_KEYS or not {"name", "value", "op", "threshold"} <= set(raw):
            raise _fail(path, where, f"needs name, value, op, threshold (and optional source, level, models); got {sorted(raw)}")
        try:
            criteria.append(Criterion(**raw))
        except (TypeError, ValueError) as exc:
            raise _fail(path, where, str(exc)) from None
    return criteria


def _plots(doc: dict, path: Path, kind: str, spec) -> list[str]:
    outputs = doc.get("outputs", {})
    if not isinstance(outputs, dict):
        raise _fail(path, "outputs", f"a table with keys {sorted(OUTPUT_KEYS)}")
    for key in sorted(set(outputs) - OUTPUT_KEYS):
        raise _fail(path, f"outputs.{key}", f"unknown key; allowed: {sorted(OUTPUT_KEYS)}")
    plots = outputs.get("plots", [])
    bad = [p for p in plots if p not in spec.plots]
    if bad:
        raise _fail(path, "outputs.plots", f"unknown plot {bad[0]!r}; kind {kind!r} draws {sorted(spec.plots)}")
    return list(plots)
