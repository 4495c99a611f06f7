"""Load a named model with the real ``mlx_lm.load``, or build a synthetic one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.models.prepare import resolve
from harness.models.registry import REGISTRY, SYNTHETIC, LoadedModel, default_variant
from harness.models.store import _hub_snapshot, fingerprint


def _load_synthetic(name: str) -> LoadedModel:
    from harness.models import tiny as tiny_models

    builder, kw = SYNTHETIC[name]
    model = getattr(tiny_models, builder)(**kw)
    ident = json.dumps({"name": name, "builder": builder, **kw}, sort_keys=True)
    return LoadedModel(name, model, tiny_models.byte_tokenizer(), f"synthetic:{name}",
                       hashlib.sha256(ident.encode()).hexdigest(), variant="synthetic")


def load(name_or_path: str, variant: str | None = None) -> LoadedModel:
    """Resolve and load a model with the real ``mlx_lm.load`` (or build a ``SYNTHETIC`` one).

    Args:
        name_or_path: a registered or synthetic name, a model directory, or a hub id.
        variant: for a registered name, ``quantized`` or ``f32``; ``None`` picks
            :func:`default_variant` (``$SEMANTIC_MODEL_VARIANT``, else by device).
    """
    import mlx_lm

    if name_or_path in SYNTHETIC:
        return _load_synthetic(name_or_path)

    chosen = default_variant(variant) if name_or_path in REGISTRY else "as-given"
    where = resolve(name_or_path, chosen if name_or_path in REGISTRY else "quantized")
    model, tokenizer = mlx_lm.load(where)
    local = Path(where) if Path(where).is_dir() else _hub_snapshot(where)
    return LoadedModel(
        name=name_or_path,
        model=model,
        tokenizer=tokenizer,
        path=where,
        fingerprint=fingerprint(local),
        variant=chosen,
    )
