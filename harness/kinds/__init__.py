"""Trial implementations, one module per experiment kind.

A kind declares its parameters (checked by ``harness.config``), the plots it
can draw, and a ``run(ctx)`` function that measures and records into
``ctx.results``. ``KINDS`` maps each kind's name to its declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from harness.config import Param


@dataclass(slots=True, frozen=True)
class Kind:
    name: str
    run: Callable[[Any], None]
    params: dict[str, Param]
    plots: frozenset[str] = frozenset()
    needs_model: bool = True
    validate: Callable[[dict], None] = field(default=lambda params: None)
    trial_code: tuple = ()   # objects whose source identifies what is measured


KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    assert kind.name not in KINDS, f"kind {kind.name} registered twice"
    KINDS[kind.name] = kind
    return kind


# Importing a kind module registers it.
from harness.kinds import (  # noqa: E402,F401
    cache_injection,
    multiturn,
    per_sequence_extraction,
    persistence_roundtrip,
    reconstruction,
    stress,
    throughput,
)
