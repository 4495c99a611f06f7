"""What to unload, decided as plain data before anything runs (``semantic.serve.fleet.fleet`` runs it).

A load that needs room unloads the least recently used models that are neither pinned nor busy; what no
unload gives back (the runtime, the tokenizers kept across unloads: ``fixed``) comes off the budget first::

    budget ────────────────────────────────────────────────────────┐
    [ fixed ][ pinned A ][ busy B ][ idle C (oldest) ][ idle D ]   │ + need
                                    └ unload C first, then D, until need fits; if only B's room would do: wait
"""

from __future__ import annotations

from dataclasses import dataclass

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"
HOLDING = (LOADED, LOADING, UNLOADING)  # the states that hold a model's memory (not failed: it never loaded)


@dataclass(frozen=True, slots=True)
class Resident:
    """A model holding memory, as :func:`choose_unloads` sees it."""

    id: str
    bytes: int
    pinned: bool
    busy: bool        # a request holds it, or it is loading / unloading
    last_used: float


@dataclass(frozen=True, slots=True)
class Unloads:
    unload: tuple[str, ...] = ()  # least recently used first
    wait: bool = False            # busy models hold the room: plan again once a request ends
    refuse: str | None = None     # it can never fit: why


def choose_unloads(resident: list[Resident], need: int, budget: int | None, fixed: int = 0) -> Unloads:
    """Which idle, unpinned models to unload, least recently used first, so ``need`` more bytes fit beside
    ``fixed`` (bytes no unload gives back)."""
    used = fixed + sum(r.bytes for r in resident)
    if budget is None or used + need <= budget:
        return Unloads()
    pinned = sum(r.bytes for r in resident if r.pinned)
    if fixed + pinned + need > budget:
        held = f"pinned models hold {pinned / 2**20:.0f} MB" + (
            f" and the runtime and kept tokenizers {fixed / 2**20:.0f} MB" if fixed else "")
        return Unloads(refuse=f"it needs {need / 2**20:.0f} MB and {held} of --models-mb {budget / 2**20:.0f}")
    unload, freed = [], 0
    for r in sorted((r for r in resident if not r.pinned and not r.busy), key=lambda r: r.last_used):
        if used - freed + need <= budget:
            break
        unload.append(r.id)
        freed += r.bytes
    if used - freed + need <= budget:
        return Unloads(unload=tuple(unload))
    return Unloads(wait=True)


def idle_past_ttl(slots: list, now: float) -> list[str]:
    """Loaded, unpinned models nobody used for their TTL (0 or None: never)."""
    return [s.id for s in slots if s.state == LOADED and not s.entry.options.pinned and s.leases == 0
            and s.entry.options.idle_ttl_s and now - s.last_used >= s.entry.options.idle_ttl_s]
