"""The fleet of one server's models (``semantic.serve.fleet.fleet``): loads on demand, room under a budget, leases,
failures, the idle reaper, shutdown (the decisions it runs, as plain data: test_unloads.py).

The fleet is driven on its own event loop (``asyncio.run``) with stand-ins for the models' Backends
(``tests/fleet_helpers``): the fleet only opens, leases, measures and closes backends, so what it must get right
is its bookkeeping, and real models would only make these tests slow.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from semantic.serve.fleet import fleet as fleet_mod
from semantic.serve.fleet.fleet import (FAILED, LOADED, LOADING, UNLOADED, Fleet, ModelLoadError, ModelMemoryError,
                                  ModelNotFoundError)
from semantic.serve.fleet.registry import Registry
from semantic.service import SchedulerClosedError
from tests.fleet_helpers import MB, Opener, stand_in_fleet as _fleet, until_async as _until, use as _use


@pytest.fixture(autouse=True)
def _no_collection(monkeypatch):
    """An unload's gc.collect and mx.clear_cache give back a real model's arrays; stand-ins hold none."""
    monkeypatch.setattr(fleet_mod, "_free_memory", lambda *held: None)


def test_only_a_fleet_that_unloads_models_fixes_the_heap_thresholds(monkeypatch):
    """Fixed thresholds return an unloaded model's memory, and make every large allocation fresh pages:
    a server of one model that never unloads it keeps glibc's own."""
    fixed = []
    monkeypatch.setattr(fleet_mod.memory, "fix_heap_thresholds", lambda: fixed.append(True) or True)
    assert not _fleet({"a": 10})[0].unloads and fixed == []
    assert not _fleet({"a": 10}, ttl={"a": 60}, pinned=("a",))[0].unloads and fixed == []
    for fleet, _ in (_fleet({"a": 10, "b": 10}), _fleet({"a": 10}, budget_mb=100), _fleet({"a": 10}, ttl={"a": 60})):
        assert fleet.unloads
    assert len(fixed) == 3


# ---------------------------------------------------------------- acquire


def test_concurrent_requests_for_an_unloaded_model_load_it_once():
    gate = threading.Event()
    fleet, opener = _fleet({"a": 1, "b": 1}, gates={"a": gate})

    async def run():
        waiters = [asyncio.ensure_future(fleet.acquire("a")) for _ in range(5)]
        await _until(lambda: fleet.slots["a"].state == LOADING)
        gate.set()
        leases = await asyncio.gather(*waiters)
        assert {id(lease.backend) for lease in leases} == {id(opener.opened["a"][0])}
        assert fleet.slots["a"].leases == 5
        for lease in leases:
            lease.release()
            lease.release()  # a second release is a no-op
        assert fleet.slots["a"].leases == 0

    asyncio.run(run())
    assert len(opener.opened["a"]) == 1 and fleet.slots["a"].loads == 1 and fleet.summary()["loads"] == 1


def test_a_loaded_model_serves_while_another_one_loads():
    gate = threading.Event()
    fleet, opener = _fleet({"a": 1, "b": 1}, gates={"b": gate})

    async def run():
        await _use(fleet, "a")
        loading = asyncio.ensure_future(fleet.acquire("b"))
        await _until(lambda: fleet.slots["b"].state == LOADING)
        assert fleet.summary()["loading"] == "b"
        lease = await asyncio.wait_for(fleet.acquire("a"), 5)  # not behind b's load
        lease.release()
        gate.set()
        (await loading).release()

    asyncio.run(run())
    assert fleet.slots["b"].state == LOADED


def test_an_unknown_name_is_not_found_naming_what_is_served_and_none_is_the_default():
    fleet, _ = _fleet({"a": 1, "b": 1})
    with pytest.raises(ModelNotFoundError, match="'gpt-4o' is not served here; this server serves models 'a', 'b'"):
        fleet.slot("gpt-4o")
    assert fleet.slot(None).id == "a" and fleet.backend_of("b") is None


def test_a_model_dir_folder_added_after_the_start_gets_a_slot_when_named(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    fleet = Fleet(Registry([], models_dir=str(tmp_path)), Opener({"a": 1, "b": 1}))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text("{}")
    assert fleet.slot("b").state == UNLOADED and list(fleet.slots) == ["a", "b"]
    asyncio.run(_use(fleet, "b"))
    assert fleet.slots["b"].state == LOADED


# ---------------------------------------------------------------- room under the budget


def test_a_load_over_the_budget_unloads_the_least_recently_used_idle_model():
    fleet, opener = _fleet({"a": 10, "b": 10, "c": 10}, budget_mb=15)

    async def run():
        await _use(fleet, "a")
        await _use(fleet, "b")   # a and b do not both fit: a goes
        await _use(fleet, "c")   # b goes
        await _use(fleet, "b")   # c goes

    asyncio.run(run())
    assert [s.state for s in fleet.slots.values()] == [UNLOADED, LOADED, UNLOADED]
    assert {i: dict(s.unloads) for i, s in fleet.slots.items()} == {"a": {"lru": 1}, "b": {"lru": 1}, "c": {"lru": 1}}
    assert opener.opened["a"][0].closed and opener.opened["b"][0].closed and not opener.opened["b"][1].closed
    assert fleet.summary() == {"budget_bytes": 15 * MB, "resident_bytes": 10 * MB, "overhead_bytes": 0, "loads": 4,
                               "unloads": 3, "load_failures": 0, "loading": None, "loading_s": None}


def test_a_pinned_model_is_never_unloaded_for_room():
    fleet, _ = _fleet({"p": 10, "a": 10, "b": 10}, budget_mb=25, pinned=("p",))
    fleet.preload(["p"])

    async def run():
        for name in ("a", "b", "a", "b"):
            await _use(fleet, name)

    asyncio.run(run())
    assert fleet.slots["p"].state == LOADED and not fleet.slots["p"].unloads
    assert fleet.slots["a"].unloads["lru"] == 2 and fleet.slots["b"].state == LOADED


def test_a_model_that_does_not_fit_beside_the_pinned_ones_is_refused_and_others_still_serve():
    fleet, _ = _fleet({"p": 20, "big": 15, "a": 5}, budget_mb=30, pinned=("p",))
    fleet.preload(["p"])

    async def run():
        with pytest.raises(ModelMemoryError, match="'big' does not fit .* it needs 15 MB and pinned models hold 20"):
            await fleet.acquire("big")
        await _use(fleet, "a")

    asyncio.run(run())
    assert fleet.slots["big"].state == UNLOADED and fleet.slots["a"].state == LOADED
    with pytest.raises(ModelMemoryError, match="pinned models p, big need about 35 MB, over --models-mb 30"):
        _fleet({"p": 20, "big": 15}, budget_mb=30, pinned=("p", "big"))[0].preload(["p", "big"])


def test_the_runtime_and_the_tokenizers_loads_kept_take_their_room_from_the_budget_after_every_unload():
    # runtime 10 + a's tokenizer 4 + a 20 fit 40, and b (20) does not fit beside a; after a's unload its
    # tokenizer stays: b's 20 and its own tokenizer 5 fit beside 14, and a comes back beside 19
    fleet, opener = _fleet({"a": 20, "b": 20}, budget_mb=40, kept_mb={"a": 4, "b": 5}, runtime_mb=10)

    async def run():
        await _use(fleet, "a")
        assert fleet.summary()["overhead_bytes"] == 14 * MB
        await _use(fleet, "b")
        assert fleet.slots["a"].state == UNLOADED and fleet.summary()["overhead_bytes"] == 19 * MB
        await _use(fleet, "a")

    asyncio.run(run())
    assert fleet.slots["b"].unloads == {"lru": 1} and fleet.summary()["resident_bytes"] == 20 * MB
    big, _ = _fleet({"a": 20, "b": 10}, budget_mb=40, kept_mb={"a": 4, "b": 17}, runtime_mb=10)

    async def too_big():  # b's 10 alone fits 40, but not beside its own tokenizer's 17 and the 14 a's load left
        await _use(big, "a")
        with pytest.raises(ModelMemoryError, match="it needs 10 MB and pinned models hold 0 MB and the runtime "
                                                   "and kept tokenizers 31 MB of --models-mb 40"):
            await big.acquire("b")

    asyncio.run(too_big())
    assert big.slots["a"].state == LOADED  # nothing was unloaded for a load that could not fit


def test_a_lease_blocks_an_unload_until_it_is_released():
    fleet, opener = _fleet({"a": 10, "b": 10}, budget_mb=15)

    async def run():
        held = await fleet.acquire("a")
        loading_b = asyncio.ensure_future(fleet.acquire("b"))
        await _until(lambda: fleet.slots["b"].change is not None)
        for _ in range(20):  # b's load runs its plan and waits: a's request is not over
            await asyncio.sleep(0)
        assert fleet.slots["a"].state == LOADED and not opener.opened["a"][0].closed
        assert fleet.slots["b"].state == UNLOADED and not loading_b.done()
        held.release()
        (await asyncio.wait_for(loading_b, 5)).release()

    asyncio.run(run())
    assert fleet.slots["a"].state == UNLOADED and fleet.slots["a"].unloads["lru"] == 1 and opener.opened["a"][0].closed
    assert fleet.slots["b"].state == LOADED


def test_a_model_that_measures_more_than_estimated_unloads_idle_ones_until_the_budget_holds():
    fleet, opener = _fleet({"a": 10, "b": 10, "c": 10}, budget_mb=25, estimate_mb={"a": 10, "b": 10, "c": 2})

    async def run():
        await _use(fleet, "a")
        await _use(fleet, "b")
        await _use(fleet, "c")  # expected 2 MB beside a and b: it takes 10, so a (the oldest) goes

    asyncio.run(run())
    assert [s.state for s in fleet.slots.values()] == [UNLOADED, LOADED, LOADED]
    assert fleet.slots["a"].unloads == {"lru": 1} and fleet.summary()["resident_bytes"] == 20 * MB


def test_a_load_waiting_for_room_gives_up_when_shutdown_begins():
    fleet, opener = _fleet({"a": 10, "b": 10}, budget_mb=15)

    async def run():
        held = await fleet.acquire("a")
        loading_b = asyncio.ensure_future(fleet.acquire("b"))
        await _until(lambda: fleet.slots["b"].change is not None)
        fleet.begin_shutdown()  # b's request is answered now, not when a's turn ends or the drain times out
        with pytest.raises(SchedulerClosedError):
            await asyncio.wait_for(loading_b, 10)
        closing = asyncio.ensure_future(fleet.aclose(timeout=10))
        held.release()  # a's turn ends in the drain
        await asyncio.wait_for(closing, 10)

    asyncio.run(run())
    assert "b" not in opener.opened and fleet.slots["b"].state == UNLOADED
    assert fleet.slots["a"].unloads == {"shutdown": 1} and opener.opened["a"][0].closed


# ---------------------------------------------------------------- failures


def test_a_load_failure_is_failed_with_its_message_and_other_models_still_serve():
    fleet, opener = _fleet({"a": 1, "bad": 1}, fail={"bad"})

    async def run():
        with pytest.raises(ModelLoadError, match="'bad' failed to load: ValueError: /models/bad: config.json is not"):
            await fleet.acquire("bad")
        await _use(fleet, "a")
        opener.fail.clear()  # fixed on disk, but within RETRY_FAILED_S the failure is answered as it was
        with pytest.raises(ModelLoadError, match="config.json is not JSON"):
            await fleet.acquire("bad")

    asyncio.run(run())
    row = {r["id"]: r for r in fleet.rows()}["bad"]
    assert row["state"] == FAILED and row["error"] == "ValueError: /models/bad: config.json is not JSON"
    assert "bad" not in opener.opened and fleet.summary()["load_failures"] == 1 and fleet.slots["a"].state == LOADED


def test_a_model_on_the_same_weights_as_a_loaded_one_is_refused_naming_the_alias_to_give():
    keys = {"a": "/cache/k1", "twin": "/cache/k1", "b": "/cache/k2"}  # twin: a's weights under another path
    fleet, opener = _fleet({"a": 1, "twin": 1, "b": 1}, check=lambda e: keys[e.id])

    async def run():
        await _use(fleet, "a")
        with pytest.raises(ModelLoadError, match=r"same weights as 'a', whose caches are in /cache/k1: .*\(twin=a\)"):
            await fleet.acquire("twin")
        await _use(fleet, "b")

    asyncio.run(run())
    assert "twin" not in opener.opened and fleet.slots["twin"].state == FAILED and fleet.slots["b"].state == LOADED


def test_a_model_whose_files_cannot_be_read_fails_before_any_model_is_unloaded_for_it():
    def check(entry):
        if entry.id == "bad":
            raise OSError(f"{entry.source}/config.json: unreadable")
        return f"/cache/{entry.id}"

    fleet, opener = _fleet({"a": 10, "bad": 10}, budget_mb=15, check=check)

    async def run():
        await _use(fleet, "a")
        with pytest.raises(ModelLoadError, match="OSError: /models/bad/config.json: unreadable"):
            await fleet.acquire("bad")

    asyncio.run(run())
    assert fleet.slots["a"].state == LOADED and not fleet.slots["a"].unloads and "bad" not in opener.opened


def test_a_failed_model_is_tried_again_after_retry_failed_s(monkeypatch):
    fleet, opener = _fleet({"bad": 1}, fail={"bad"})

    async def run():
        with pytest.raises(ModelLoadError):
            await fleet.acquire("bad")
        monkeypatch.setattr(fleet_mod, "RETRY_FAILED_S", 0.0)
        with pytest.raises(ModelLoadError):  # tried again, and fails again
            await fleet.acquire("bad")
        opener.fail.clear()
        await _use(fleet, "bad")

    asyncio.run(run())
    assert fleet.slots["bad"].state == LOADED and fleet.load_failures == 2 and "error" not in fleet.rows()[0]


def test_a_failed_or_unloaded_model_holds_no_memory_in_its_row():
    fleet, _ = _fleet({"a": 3, "bad": 7}, fail={"bad"})

    async def run():
        await _use(fleet, "a")
        with pytest.raises(ModelLoadError):
            await fleet.acquire("bad")

    asyncio.run(run())
    rows = {r["id"]: r for r in fleet.rows()}
    assert rows["a"]["memory_bytes"] == 3 * MB and fleet.summary()["resident_bytes"] == 3 * MB
    assert rows["bad"]["memory_bytes"] == 0  # what it would have taken is not held


# ---------------------------------------------------------------- the idle reaper


def test_the_reaper_unloads_an_idle_model_and_never_a_pinned_or_leased_one(monkeypatch):
    monkeypatch.setattr(fleet_mod, "REAP_EVERY_S", (0.01, 0.05))
    fleet, opener = _fleet({"p": 1, "held": 1, "idle": 1}, pinned=("p",), ttl={"p": 0.05, "held": 0.05, "idle": 0.05})
    fleet.preload(["p"])

    async def run():
        fleet.start()
        held = await fleet.acquire("held")  # used before "idle": past its TTL first, but leased
        await _use(fleet, "idle")
        await _until(lambda: fleet.slots["idle"].state == UNLOADED)
        assert fleet.slots["held"].state == LOADED and fleet.slots["p"].state == LOADED
        held.release()
        await _until(lambda: fleet.slots["held"].state == UNLOADED)
        await fleet.aclose()

    asyncio.run(run())
    assert fleet.slots["idle"].unloads == {"idle": 1} and opener.opened["idle"][0].closed
    assert fleet.slots["p"].unloads == {"shutdown": 1}  # pinned: unloaded only by the shutdown


def test_the_reaper_leaves_a_model_whose_turns_still_run_without_a_lease(monkeypatch):
    monkeypatch.setattr(fleet_mod, "REAP_EVERY_S", (0.01, 0.05))
    fleet, opener = _fleet({"busy": 1, "idle": 1}, ttl={"busy": 0.05, "idle": 0.05})

    async def run():
        fleet.start()
        await _use(fleet, "busy")
        opener.opened["busy"][0].service.in_flight = 1  # its client left; the engine still ends the turn
        await _use(fleet, "idle")
        await _until(lambda: fleet.slots["idle"].state == UNLOADED)
        assert fleet.slots["busy"].state == LOADED
        opener.opened["busy"][0].service.in_flight = 0
        await _until(lambda: fleet.slots["busy"].state == UNLOADED)
        await fleet.aclose()

    asyncio.run(run())
    assert fleet.slots["busy"].unloads == {"idle": 1}


def test_an_unloaded_model_loads_again_on_its_next_request(monkeypatch):
    monkeypatch.setattr(fleet_mod, "REAP_EVERY_S", (0.01, 0.05))
    fleet, opener = _fleet({"a": 1}, ttl={"a": 0.05})

    async def run():
        fleet.start()
        await _use(fleet, "a")
        await _until(lambda: fleet.slots["a"].state == UNLOADED)
        lease = await fleet.acquire("a")
        assert lease.backend is opener.opened["a"][1] and not lease.backend.closed
        lease.release()
        await fleet.aclose()

    asyncio.run(run())
    assert fleet.slots["a"].loads == 2


# ---------------------------------------------------------------- shutdown


def test_aclose_closes_every_loaded_model_and_refuses_new_requests():
    fleet, opener = _fleet({"a": 1, "b": 1, "c": 1})

    async def run():
        await _use(fleet, "a")
        await _use(fleet, "b")
        fleet.begin_shutdown()
        assert fleet.closing and opener.opened["a"][0].closing and opener.opened["b"][0].closing
        await fleet.aclose()
        with pytest.raises(SchedulerClosedError):
            await fleet.acquire("a")

    asyncio.run(run())
    assert all(b[0].closed for b in opener.opened.values()) and "c" not in opener.opened
    assert {i: dict(s.unloads) for i, s in fleet.slots.items()} == {"a": {"shutdown": 1}, "b": {"shutdown": 1}, "c": {}}


def test_a_load_that_finishes_during_shutdown_closes_what_it_loaded():
    gate = threading.Event()
    fleet, opener = _fleet({"a": 1}, gates={"a": gate})

    async def run():
        loading = asyncio.ensure_future(fleet.acquire("a"))
        await _until(lambda: fleet.slots["a"].state == LOADING)
        closing = asyncio.ensure_future(fleet.aclose())
        gate.set()
        await asyncio.wait_for(closing, 10)
        with pytest.raises(SchedulerClosedError):
            await loading

    asyncio.run(run())
    assert opener.opened["a"][0].closed and fleet.slots["a"].state == UNLOADED
