"""What a trial kind declares (its parameters, plots and ``run``), and the registry of kinds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(slots=True, frozen=True)
class Param:
    """A parameter a kind accepts: its type, default and meaning, and the values it takes (checked on load).

    ``choices``: the values it may take (a list: its items). ``min`` and ``max`` bound a number, or each item of a
    list (then integers); ``strict``: the bounds themselves are refused. ``pair``: a list ``[low, high]`` with
    ``low <= high``. ``nonempty``: a list with an item at least.
    """

    type: type
    default: Any
    help: str
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    strict: bool = False
    pair: bool = False
    nonempty: bool = False


@dataclass(slots=True, frozen=True)
class TrialKind:
    name: str
    run: Callable[[Any], None]
    params: dict[str, Param]
    plots: frozenset[str] = frozenset()
    needs_model: bool = True
    validate: Callable[[dict], None] = field(default=lambda params: None)
    trial_code: tuple = ()   # objects whose source identifies what is measured
    headline: Callable[[dict], list[str]] | None = None  # the kind's own table for the console, from the results


KINDS: dict[str, TrialKind] = {}


def register(kind: TrialKind) -> TrialKind:
    assert kind.name not in KINDS, f"kind {kind.name} registered twice"
    KINDS[kind.name] = kind
    return kind
