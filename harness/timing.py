"""The timing protocol: warm up, then N trials, each ending in materialization.

MLX is lazy: a region that returns before ``mx.eval`` has only built a graph.
Every timed call here returns the arrays it produced; the clock stops after
``mx.eval`` of them and ``mx.synchronize()``. The time at which the call
returned, before evaluation, is kept as the *lazy* time, so a prediction
made from graph-building times (microseconds per concatenate, with nothing
computed yet) can be shown for what it is. Peak memory is reset before and read after each trial.

Several operations timed together are interleaved per trial (A B C, A B C,
...), so that drift in the machine's state hits every side alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx


@dataclass(slots=True, frozen=True)
class Protocol:
    """Warm-up runs (discarded) and measured trials per timed operation."""

    warmup: int
    trials: int

    def __post_init__(self):
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"trials must be an integer >= 1, got {self.trials!r}")


@dataclass(slots=True)
class Samples:
    """Raw per-trial measurements of one operation (milliseconds, megabytes)."""

    ms: list[float] = field(default_factory=list)
    lazy_ms: list[float] = field(default_factory=list)
    peak_mb: list[float] = field(default_factory=list)


def _materialize(out: Any) -> None:
    arrays = out if isinstance(out, (list, tuple)) else [out]
    arrays = [a for a in arrays if a is not None]
    if arrays:
        mx.eval(arrays)
    mx.synchronize()


def time_once(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """(materialized ms, lazy ms, peak MB) of one call of ``fn``.

    ``fn`` returns the arrays (or nested lists of arrays) it computed, or
    None when it materializes by itself (for instance by reading tokens).
    """
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter_ns()
    out = fn()
    t1 = time.perf_counter_ns()
    _materialize(out)
    t2 = time.perf_counter_ns()
    return (t2 - t0) / 1e6, (t1 - t0) / 1e6, mx.get_peak_memory() / 1e6


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    protocol: Protocol,
    setup: Callable[[], None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Samples]:
    """Warm up each operation, then run ``protocol.trials`` interleaved rounds.

    ``setup`` (untimed) runs before every call, e.g. to release the blocks
    the previous call took. ``progress(1)`` is called after each round.
    """
    for _ in range(protocol.warmup):
        for fn in fns.values():
            if setup:
                setup()
            time_once(fn)
    out = {name: Samples() for name in fns}
    for _ in range(protocol.trials):
        for name, fn in fns.items():
            if setup:
                setup()
            ms, lazy, peak = time_once(fn)
            out[name].ms.append(ms)
            out[name].lazy_ms.append(lazy)
            out[name].peak_mb.append(peak)
        if progress:
            progress(1)
    return out


def describe(protocol: Protocol) -> dict:
    """The protocol as recorded in a results document."""
    return {
        "warmup": protocol.warmup,
        "trials": protocol.trials,
        "clock": "time.perf_counter_ns",
        "materialization": "mx.eval of the returned arrays, then mx.synchronize()",
        "interleaved": True,
        "peak_memory": "mx.reset_peak_memory() before, mx.get_peak_memory() after each trial",
    }
