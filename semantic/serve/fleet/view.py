"""What the listings, the stats and the metrics say of a fleet: a row per served model, and the memory they share."""

from __future__ import annotations

import logging
import time

from semantic.serve.fleet.unloads import FAILED, HOLDING, LOADED, LOADING

log = logging.getLogger("semantic.serve")


def rows(fleet, retry_s: float) -> list[dict]:
    """Every served model as /v1/models and the stats list it (read from the stats' worker thread too)."""
    now = time.monotonic()
    out = []
    for s in list(fleet.slots.values()):
        o = s.entry.options
        row = {"id": s.id, "state": s.state, "aliases": fleet.registry.aliases_of(s.id),
               "context_length": s.context_length or _context(fleet, s),
               "memory_bytes": s.bytes if s.state in HOLDING else 0,
               "pinned": o.pinned, "idle_ttl_s": o.idle_ttl_s or None, "loads": s.loads,
               "unloads": dict(s.unloads), "load_s": s.load_s, "state_s": round(now - s.since, 1),
               "idle_s": round(now - s.last_used, 1) if s.state == LOADED and not s.leases else None,
               "in_use": s.leases}
        if s.state == FAILED:
            row["error"] = s.error
            row["retry_in_s"] = round(max(0.0, retry_s - (now - s.since)), 1)
        out.append(row)
    return out


def _context(fleet, slot) -> int | None:
    """A model's context before it loads (its config's), asked once."""
    if slot.context_length is None:
        try:
            slot.context_length = fleet.context_of(slot.entry)
        except Exception:  # a listing never fails on one model's files
            log.exception("reading %s's context length", slot.id)
    return slot.context_length


def summary(fleet) -> dict:
    """The budget, the bytes the loaded models hold and what no unload gives back (the runtime and the kept
    tokenizers: ``overhead_bytes``), loads and unloads, and the load running now."""
    slots = list(fleet.slots.values())
    loading = next((s for s in slots if s.state == LOADING), None)
    return {"budget_bytes": fleet.budget,
            "resident_bytes": sum(s.bytes for s in slots if s.state in HOLDING),
            "overhead_bytes": fleet.overhead_bytes,
            "loads": sum(s.loads for s in slots),
            "unloads": sum(sum(s.unloads.values()) for s in slots),
            "load_failures": fleet.load_failures,
            "loading": loading.id if loading else None,
            "loading_s": round(time.monotonic() - loading.since, 1) if loading else None}
