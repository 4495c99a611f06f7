"""The loaded models of one server: a request's model is loaded on demand, under one memory budget.

Each model has its own :class:`~semantic.serve.turn.backend.Backend` (service, scheduler, pool, cache
directory). A model's life, one change at a time::

    unloaded ──acquire──► loading ──► loaded ──(LRU for room, idle past its TTL)──► unloading ──► unloaded
         ▲                   │                                                                        │
         └── failed ◄────────┘ (bad path, foreign format: its requests get the reason)  ◄─────────────┘

Loads run one at a time, off the event loop; requests for loaded models go on meanwhile. What to unload
for room is decided first (:func:`~semantic.serve.fleet.unloads.choose_unloads`, plain data) and then run. A model is unloaded only with no
request holding it (a :class:`Lease`); unloading closes its service, which writes its pending saves, so
its agents' caches come back from disk when it loads again, and waits until its memory is given back
(``memory.release``).

The budget holds the process's RSS (``footprint``): the runtime, every tokenizer a load kept (they outlive
their models' unloads), and each loaded model's weights, pool and working memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from semantic.serve.fleet import memory, view
from semantic.serve.fleet.unloads import (FAILED, HOLDING, LOADED, LOADING, UNLOADED, UNLOADING, Resident,
                                      idle_past_ttl, choose_unloads)
from semantic.serve.fleet.registry import ModelEntry, ModelOptions, Registry
from semantic.service import SchedulerClosedError

log = logging.getLogger("semantic.serve")

RETRY_FAILED_S = 30.0   # a model that failed to load is tried again by a request this much later
ROOM_WAIT_S = 600.0     # a load waits this long at most for busy models to finish their turns
REAP_EVERY_S = (0.2, 5.0)  # the TTL check's period: a quarter of the shortest TTL, within these bounds


class ModelNotFoundError(LookupError):
    """No served model and no alias matches the name."""


class ModelLoadError(RuntimeError):
    """The model cannot load (bad path, foreign format, its own error); other models are unaffected."""


class ModelMemoryError(RuntimeError):
    """The model does not fit ``--models-mb``, even after unloading every model that may go."""


# ---------------------------------------------------------------- run


@dataclass(eq=False, slots=True)
class Slot:
    """One served model's state now."""

    entry: ModelEntry
    state: str = UNLOADED
    backend: object = None         # a Backend while loaded
    leases: int = 0
    last_used: float = 0.0         # monotonic
    bytes: int = 0                 # weights + pool + working memory: estimated before a load (weights and pool
                                   # measured after it, when they come to more)
    since: float = field(default_factory=time.monotonic)  # when the state began
    change: asyncio.Future | None = None  # the load or unload running now
    error: str | None = None
    loads: int = 0
    unloads: Counter = field(default_factory=Counter)  # by reason
    load_s: float | None = None    # the last load's time
    context_length: int | None = None
    key: str | None = None         # its cache directory (the ``check`` it was opened with), once asked

    @property
    def id(self) -> str:
        return self.entry.id


class Lease:
    """A request's hold on a loaded model: it is not unloaded until every lease is released."""

    def __init__(self, fleet: "Fleet", slot: Slot):
        self._fleet, self._slot, self.backend = fleet, slot, slot.backend
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._fleet._release(self._slot)
            # a keep-alive connection keeps its last request's scope, and this with it: never its model
            self.backend = self._slot = None


Opener = Callable[[ModelEntry], object]  # entry -> Backend, blocking (it loads the weights)


class Fleet:
    """Every served model and the loaded ones' backends.

    Args:
        registry: the served models and aliases.
        opener: loads one model into a Backend (blocking; called off the event loop).
        budget_bytes: ``--models-mb``: the runtime, the kept tokenizers and the loaded models together
            (None: no bound).
        estimate: a model's bytes before it loads, all of which its unload gives back (weights on disk, its
            pool, a turn's working memory).
        kept: what a model's first load leaves for good (its tokenizer, kept across unloads).
        runtime_bytes: what the process holds with no model loaded.
        context_of: a model's context length before it loads (its config's), for the listings.
        check: before room is made for a load: raises what would make it fail (so a model that cannot
            load unloads nobody), and returns its cache directory (two loaded models never share one).
        shutdown_s: how long an unload waits for its service's pending saves.
    """

    def __init__(self, registry: Registry, opener: Opener, *, budget_bytes: int | None = None,
                 estimate: Callable[[ModelEntry], int] = lambda e: 0,
                 context_of: Callable[[ModelEntry], int | None] = lambda e: None,
                 check: Callable[[ModelEntry], str | None] = lambda e: None, shutdown_s: float = 30.0,
                 responses_dir: Path | None = None, kept: Callable[[ModelEntry], int] = lambda e: 0,
                 runtime_bytes: int = 0):
        self.registry, self.opener, self.budget, self.estimate = registry, opener, budget_bytes, estimate
        self.kept, self.runtime_bytes = kept, runtime_bytes
        self._kept: dict[str, int] = {}  # a loaded source's kept bytes (its tokenizer), from its first load on
        self.context_of, self.check = context_of, check
        self.shutdown_s, self.responses_dir = shutdown_s, responses_dir
        self.slots: dict[str, Slot] = {i: Slot(e) for i, e in registry.entries.items()}
        self._closing = False
        self.load_failures = 0
        self._load_lock: asyncio.Lock | None = None  # made on the serving loop, not where the fleet is built
        self._released: asyncio.Event | None = None
        self._reaper: asyncio.Task | None = None
        self._trimming: asyncio.Future | None = None  # the heap trim after a load (a reference keeps it alive)
        if self.unloads:  # before any model loads: an unloaded model's buffers go back to the system
            memory.fix_heap_thresholds()

    @property
    def unloads(self) -> bool:
        """Whether a model of this fleet is ever unloaded: several models (or a folder of them), a memory
        budget or an idle TTL.
        Only then are glibc's heap thresholds fixed (``memory``): they return freed buffers to the system at
        once, so every large allocation after is fresh pages to fault in (a sub-agent's turn on SmolLM2
        faulted 50K pages instead of 3K-10K, 1.3-1.5x its CPU time): a server that never unloads keeps
        glibc's own."""
        entries = list(self.registry.entries.values())
        return (self.budget is not None or len(entries) > 1 or self.registry.models_dir is not None
                or any(e.options.idle_ttl_s and not e.options.pinned for e in entries))

    @classmethod
    def of(cls, backend) -> "Fleet":
        """A fleet of one loaded, pinned backend (one model, as a stand-in or ``create_app`` given a backend)."""
        registry = Registry([ModelEntry(backend.model_id, backend.model_id, ModelOptions(pinned=True))], single=True)
        fleet = cls(registry, opener=lambda e: backend, responses_dir=getattr(backend, "responses_dir", None))
        fleet._installed(fleet.slots[backend.model_id], backend, 0.0)
        return fleet

    @property
    def closing(self) -> bool:
        """Shutdown began (one model served alone: also when its backend began it)."""
        if self._closing:
            return True
        return self.registry.single and bool(getattr(self.backend_of(None), "closing", False))

    # ------------------------------------------------------------ names

    @property
    def default(self) -> str:
        return self.registry.default

    def slot(self, name: str | None) -> Slot:
        """The slot ``name`` reaches; raises ModelNotFoundError naming what is served."""
        model_id = self.registry.resolve(name)
        if model_id is None:
            raise ModelNotFoundError(f"the model {name!r} is not served here; this server serves "
                                     f"{self.registry.served_names()}")
        if model_id not in self.slots:  # a folder --models-dir found since the start
            self.slots[model_id] = Slot(self.registry.entries[model_id])
        return self.slots[model_id]

    def loaded(self) -> list[tuple[str, object]]:
        return [(s.id, s.backend) for s in self.slots.values() if s.state == LOADED]

    def backend_of(self, name: str | None):
        """The loaded backend ``name`` reaches, or None (not loaded); raises ModelNotFoundError."""
        s = self.slot(name)
        return s.backend if s.state == LOADED else None

    # ------------------------------------------------------------ loading

    @property
    def overhead_bytes(self) -> int:
        """What no unload gives back: the runtime and the tokenizers loads kept."""
        return self.runtime_bytes + sum(self._kept.values())

    def preload(self, ids: list[str]) -> None:
        """Load ``ids`` now, before serving (no event loop yet): the pinned models. Raises what the load raises."""
        entries = [self.slots[i].entry for i in ids]
        sizes = {i: self.estimate(e) for i, e in zip(ids, entries)}
        kept = {e.source: self.kept(e) for e in entries if e.source not in self._kept}
        need = sum(sizes.values()) + sum(kept.values()) + self.overhead_bytes
        if self.budget is not None and need > self.budget:
            raise ModelMemoryError(f"the pinned models {', '.join(ids)} need about {need / 2**20:.0f} MB, over "
                                   f"--models-mb {self.budget / 2**20:.0f} (the runtime and their tokenizers "
                                   "included): raise it or pin fewer")
        for model_id in ids:
            slot = self.slots[model_id]
            t0 = time.monotonic()
            log.info("loading %s from %s", model_id, slot.entry.source)
            slot.bytes = sizes[model_id]
            backend = self.opener(slot.entry)
            self._kept.setdefault(slot.entry.source, kept.get(slot.entry.source, 0))
            self._installed(slot, backend, time.monotonic() - t0)

    async def acquire(self, name: "str | None | Slot") -> Lease:
        """A lease on the loaded model ``name`` reaches (or the slot a request resolved), loading it first when
        it is not.

        Raises:
            ModelNotFoundError, ModelLoadError, ModelMemoryError; SchedulerClosedError once shutdown began.
        """
        slot = name if isinstance(name, Slot) else self.slot(name)
        while True:
            if self.closing:
                raise SchedulerClosedError("the server is shutting down")
            if slot.state == LOADED:
                slot.leases += 1
                slot.last_used = time.monotonic()
                return Lease(self, slot)
            if slot.state == FAILED and time.monotonic() - slot.since < RETRY_FAILED_S:
                raise ModelLoadError(f"the model {slot.id!r} failed to load: {slot.error}")
            if slot.change is None:
                slot.change = asyncio.ensure_future(self._load(slot))
                slot.change.add_done_callback(_retrieved)  # every waiter may have left: never "not retrieved"
            await asyncio.shield(slot.change)  # a client leaving does not stop the load others wait for

    def _release(self, slot: Slot) -> None:
        slot.leases -= 1
        slot.last_used = time.monotonic()
        assert slot.leases >= 0
        if self._released is not None:
            self._released.set()

    async def _load(self, slot: Slot) -> None:
        try:
            async with self._lock():
                if slot.state == LOADED or self.closing:
                    return
                need = await asyncio.to_thread(self.estimate, slot.entry)
                keeps = 0 if slot.entry.source in self._kept else await asyncio.to_thread(self.kept, slot.entry)
                await self._claim(slot)
                await self._make_room(slot, need, keeps)
                self._set(slot, LOADING)
                slot.bytes = need
                log.info("loading %s from %s (about %.0f MB)", slot.id, slot.entry.source, need / 2**20)
                t0 = time.monotonic()
                try:
                    backend = await asyncio.to_thread(self.opener, slot.entry)
                except Exception as exc:  # the model's own loader: any error is this model's alone
                    self._failed(slot, exc)
                    await asyncio.to_thread(_free_memory)
                    raise ModelLoadError(f"the model {slot.id!r} failed to load: {slot.error}") from None
                if self.closing:
                    await self._close(backend)
                    self._set(slot, UNLOADED)
                    return
                self._kept.setdefault(slot.entry.source, keeps)
                self._installed(slot, backend, time.monotonic() - t0)
                await self._shrink(keep=slot)
                # the loader's read buffers go back beside the model's first turn, not before it
                self._trimming = asyncio.ensure_future(asyncio.to_thread(_free_memory))
        finally:
            slot.change = None

    async def _claim(self, slot: Slot) -> None:
        """Refuse, before unloading anything for it, a model that would fail to load, or whose cache
        directory a model holding memory uses (the same weights under two ids)."""
        try:
            slot.key = await asyncio.to_thread(self.check, slot.entry)
        except Exception as exc:  # a missing path, a directory mlx-lm cannot load
            self._failed(slot, exc)
            raise ModelLoadError(f"the model {slot.id!r} failed to load: {slot.error}") from None
        other = next((s for s in self.slots.values() if s is not slot and slot.key is not None
                      and s.key == slot.key and s.state in HOLDING), None)
        if other is not None:
            self._failed(slot, ValueError(
                f"it has the same weights as {other.id!r}, whose caches are in {slot.key}: serve them once and "
                f"give {slot.id!r} as an alias ({slot.id}={other.id})"))
            raise ModelLoadError(f"the model {slot.id!r} failed to load: {slot.error}")

    async def _make_room(self, slot: Slot, need: int, keeps: int = 0) -> None:
        """Unload for room one model at a time, planning again after each: while one unloads, a request
        may take the next one planned. ``keeps``: what the load will keep beyond its unload (its tokenizer,
        when no earlier load kept it)."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            if self.closing:  # room freed in the drain is not for a load: unload nothing more, load nothing
                raise SchedulerClosedError("the server is shutting down")
            unloads = choose_unloads(self._resident(exclude=slot), need, self.budget, self.overhead_bytes + keeps)
            if unloads.refuse is not None:
                raise ModelMemoryError(f"the model {slot.id!r} does not fit this server's memory budget: "
                                       f"{unloads.refuse}; raise --models-mb or unpin a model")
            if unloads.unload:
                await self._unload(self.slots[unloads.unload[0]], "lru")
                continue
            if not unloads.wait:
                return
            if time.monotonic() >= deadline:
                raise ModelMemoryError(f"the model {slot.id!r} waited {ROOM_WAIT_S:.0f} s for room under "
                                       "--models-mb while other models' requests ran: retry later")
            log.info("loading %s waits for other models' requests to end (--models-mb)", slot.id)
            self._released = self._released or asyncio.Event()
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), timeout=max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    async def _shrink(self, keep: Slot) -> None:
        """After a load measured more than estimated: unload idle models until the budget holds again."""
        while (unloads := choose_unloads(self._resident(exclude=keep), keep.bytes, self.budget, self.overhead_bytes)).unload:
            await self._unload(self.slots[unloads.unload[0]], "lru")

    def _resident(self, exclude: Slot) -> list[Resident]:
        return [Resident(s.id, s.bytes, s.entry.options.pinned, s.leases > 0 or s.state != LOADED, s.last_used)
                for s in self.slots.values() if s is not exclude and s.state in (LOADED, LOADING, UNLOADING)]

    def _installed(self, slot: Slot, backend, seconds: float) -> None:
        slot.backend, slot.error = backend, None
        slot.context_length = getattr(backend, "context_length", None)
        slot.bytes = max(slot.bytes, _measured(backend))  # the estimate, or more when the weights measure more
        slot.loads += 1
        slot.load_s = round(seconds, 3)
        slot.last_used = time.monotonic()
        self._set(slot, LOADED)
        # the second figure bounds the process's RSS (``footprint``): what a user compares it with
        process = self.overhead_bytes + sum(s.bytes for s in self.slots.values() if s.state == LOADED)
        log.info("loaded %s in %.1f s (%.0f MB weights, pool and working memory; %.0f MB the process, its runtime "
                 "and tokenizers with every loaded model)", slot.id, seconds, slot.bytes / 2**20, process / 2**20)

    def _failed(self, slot: Slot, exc: BaseException) -> None:
        slot.error = f"{type(exc).__name__}: {exc}"[:500]
        self.load_failures += 1
        self._set(slot, FAILED)
        log.error("the model %s failed to load from %s: %s", slot.id, slot.entry.source, slot.error)

    def _set(self, slot: Slot, state: str) -> None:
        slot.state, slot.since = state, time.monotonic()

    # ------------------------------------------------------------ unloading

    async def _unload(self, slot: Slot, reason: str) -> None:
        """Close the model's service (its pending saves are written) and drop it."""
        assert slot.state == LOADED and slot.leases == 0
        self._set(slot, UNLOADING)
        log.info("unloading %s (%s): writing its pending saves", slot.id, reason)
        t0 = time.monotonic()
        held = memory.holders(slot.backend)
        await self._close(slot.backend)
        slot.backend = None  # the last reference: nothing here may keep the model for the collection below
        slot.unloads[reason] += 1
        self._set(slot, UNLOADED)
        await asyncio.to_thread(_free_memory, held)
        log.info("unloaded %s in %.1f s: its agents' caches are on disk for its next load", slot.id,
                 time.monotonic() - t0)

    async def _close(self, backend) -> None:
        backend.begin_shutdown()
        await backend.aclose(timeout=self.shutdown_s)

    async def reap(self) -> None:
        """Unload models idle past their TTL, until shutdown."""
        ttls = [e.options.idle_ttl_s for e in self.registry.entries.values() if e.options.idle_ttl_s]
        if not ttls:
            return
        period = min(max(min(ttls) / 4, REAP_EVERY_S[0]), REAP_EVERY_S[1])
        while not self.closing:
            await asyncio.sleep(period)
            for model_id in idle_past_ttl(list(self.slots.values()), time.monotonic()):
                slot = self.slots[model_id]
                if slot.change is None and not _busy(slot.backend):
                    slot.change = asyncio.ensure_future(self._unload_idle(slot))

    async def _unload_idle(self, slot: Slot) -> None:
        try:
            async with self._lock():
                if slot.state == LOADED and slot.leases == 0 and not self.closing:
                    await self._unload(slot, "idle")
        finally:
            slot.change = None

    def start(self) -> None:
        """On the serving loop: the TTL reaper."""
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self.reap())

    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        return self._load_lock

    # ------------------------------------------------------------ shutdown

    def begin_shutdown(self) -> None:
        self._closing = True
        if self._released is not None:  # a load waiting for room gives up now
            self._released.set()
        for _, backend in self.loaded():
            backend.begin_shutdown()

    async def aclose(self, timeout: float = 30.0) -> None:
        """Drain every loaded model together: queued and in-flight turns finish, pending saves are written."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        pending = [s.change for s in self.slots.values() if s.change is not None]
        if pending:  # a load finishing now closes what it loaded (it sees closing)
            await asyncio.wait(pending, timeout=timeout)
        loaded = [s for s in self.slots.values() if s.state == LOADED]
        await asyncio.gather(*(s.backend.aclose(timeout=timeout) for s in loaded))
        for s in loaded:
            s.unloads["shutdown"] += 1

    # ------------------------------------------------------------ state

    def rows(self) -> list[dict]:
        """Every served model as /v1/models and the stats list it (``view.rows``)."""
        return view.rows(self, RETRY_FAILED_S)

    def summary(self) -> dict:
        """The memory the models share and their loads (``view.summary``)."""
        return view.summary(self)


def _measured(backend) -> int:
    """A loaded backend's weights and pool (0 for a stand-in that says nothing)."""
    service = getattr(backend, "service", None)
    return int(getattr(service, "weights_bytes", 0) + getattr(backend, "pool_bytes", 0)) if service else 0


def _busy(backend) -> bool:
    """Whether a loaded backend still has turns queued or running (no lease, e.g. while a client left)."""
    service = getattr(backend, "service", None)
    if service is None:
        return False
    s = service.scheduler.stats()
    return bool(s.queued or s.in_flight)


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _free_memory(held=()) -> None:
    """Give freed arrays back to the system once the unloaded model's are collected (``memory.release``)."""
    memory.release(held)
