"""Stand-ins for the models of a fleet (``semantic.serve.fleet.fleet``): what a Backend shows the fleet, without a model.

A stand-in has an id, a context length, a size (``service.weights_bytes`` and ``pool_bytes``, as a loaded
Backend measures itself), turns queued or running, and a close; the opener that makes them can fail a model's
load or hold it until the test opens a gate, on the worker thread the fleet loads on.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from semantic.serve.fleet.fleet import Fleet
from semantic.serve.fleet.registry import ModelEntry, ModelOptions, Registry

MB = 1 << 20


class StandIn:
    """What the fleet uses of a Backend: its id and context, its size (``service.weights_bytes`` and
    ``pool_bytes``), whether turns still run, and a close that writes pending saves."""

    def __init__(self, entry: ModelEntry, size: int):
        self.model_id, self.context_length = entry.id, 2048
        self.service, self.pool_bytes = _Service(size), 0
        self.closing = self.closed = False

    def begin_shutdown(self) -> None:
        self.closing = True

    async def aclose(self, timeout: float = 30.0) -> None:
        self.closed = True


class _Service:
    """The stand-in's service and scheduler: its weights, and its turns queued or running (no lease held)."""

    def __init__(self, size: int):
        self.weights_bytes, self.scheduler = size, self
        self.queued = self.in_flight = 0

    def agents(self) -> list:
        return []

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(queued=self.queued, in_flight=self.in_flight)


class Opener:
    """Opens stand-ins of ``sizes_mb``, keeping each model's; ``fail`` names models whose load raises; a model in
    ``gates`` opens only once its gate is set (the opener runs on a worker thread, as a real load does)."""

    def __init__(self, sizes_mb: dict[str, int], fail=(), gates=None):
        self.sizes_mb, self.fail, self.gates = sizes_mb, set(fail), gates or {}
        self.opened: dict[str, list[StandIn]] = {}

    def __call__(self, entry: ModelEntry) -> StandIn:
        if entry.id in self.gates:
            assert self.gates[entry.id].wait(30), f"{entry.id}'s gate never opened"
        if entry.id in self.fail:
            raise ValueError(f"{entry.source}: config.json is not JSON")
        backend = StandIn(entry, self.sizes_mb[entry.id] * MB)
        self.opened.setdefault(entry.id, []).append(backend)
        return backend


def stand_in_fleet(sizes_mb: dict[str, int], budget_mb: int | None = None, pinned=(), ttl: dict | None = None,
                   fail=(), gates=None, estimate_mb: dict | None = None, check=None, kept_mb: dict | None = None,
                   runtime_mb: int = 0) -> tuple[Fleet, Opener]:
    """A fleet of stand-ins; ``estimate_mb``: what the fleet expects before a load (default: their sizes);
    ``kept_mb``: what a model's load keeps after its unload (a tokenizer); ``runtime_mb``: the process's own."""
    opener = Opener(sizes_mb, fail, gates)
    estimate = estimate_mb or sizes_mb
    entries = [ModelEntry(i, f"/models/{i}", ModelOptions(pinned=i in pinned, idle_ttl_s=(ttl or {}).get(i)))
               for i in sizes_mb]
    fleet = Fleet(Registry(entries), opener, budget_bytes=budget_mb * MB if budget_mb else None,
                  estimate=lambda e: estimate[e.id] * MB,
                  check=check or (lambda e: None), kept=lambda e: (kept_mb or {}).get(e.id, 0) * MB,
                  runtime_bytes=runtime_mb * MB)
    return fleet, opener


async def until_async(cond, timeout_s: float = 10.0) -> None:
    """A bounded poll on the loop (what tests/waits.py does on a thread)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def use(fleet: Fleet, name: str) -> None:
    (await fleet.acquire(name)).release()
