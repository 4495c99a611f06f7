"""What the fleet unloads, decided as plain data (``semantic.serve.fleet.unloads``): room for a load under
``--models-mb`` (least recently used first, never pinned or busy ones) and the models idle past their TTL."""

from __future__ import annotations

from semantic.serve.fleet.fleet import LOADED, UNLOADED, Slot
from semantic.serve.fleet.unloads import Resident, Unloads, idle_past_ttl, choose_unloads
from semantic.serve.fleet.registry import ModelEntry, ModelOptions

MB = 1 << 20


def _r(i, mb, last, pinned=False, busy=False):
    return Resident(i, mb * MB, pinned, busy, last)


def test_choose_unloads_unloads_nothing_when_the_new_model_fits_or_there_is_no_budget():
    resident = [_r("a", 10, 1), _r("b", 10, 2)]
    assert choose_unloads(resident, 10 * MB, 30 * MB) == Unloads()
    assert choose_unloads(resident, 1000 * MB, None) == Unloads()


def test_choose_unloads_unloads_the_least_recently_used_first_and_only_as_many_as_needed():
    resident = [_r("c", 10, 3), _r("a", 10, 1), _r("b", 10, 2)]
    assert choose_unloads(resident, 5 * MB, 30 * MB) == Unloads(unload=("a",))
    assert choose_unloads(resident, 15 * MB, 30 * MB) == Unloads(unload=("a", "b"))
    assert choose_unloads(resident, 30 * MB, 30 * MB) == Unloads(unload=("a", "b", "c"))


def test_choose_unloads_never_chooses_a_pinned_model():
    resident = [_r("p", 10, 0, pinned=True), _r("a", 10, 1), _r("b", 10, 2)]
    assert choose_unloads(resident, 15 * MB, 30 * MB) == Unloads(unload=("a", "b"))


def test_choose_unloads_counts_what_no_unload_gives_back_and_refuses_a_model_that_cannot_fit_beside_it():
    resident = [_r("a", 10, 1), _r("b", 10, 2)]
    assert choose_unloads(resident, 10 * MB, 30 * MB, fixed=5 * MB) == Unloads(unload=("a",))
    assert choose_unloads(resident, 10 * MB, 40 * MB, fixed=10 * MB) == Unloads()
    refused = choose_unloads(resident, 26 * MB, 30 * MB, fixed=5 * MB).refuse
    assert refused == "it needs 26 MB and pinned models hold 0 MB and the runtime and kept tokenizers 5 MB of --models-mb 30"


def test_choose_unloads_waits_when_busy_models_hold_the_room():
    resident = [_r("a", 10, 1, busy=True), _r("b", 10, 2)]
    assert choose_unloads(resident, 5 * MB, 20 * MB) == Unloads(unload=("b",))  # the idle one is enough
    assert choose_unloads(resident, 15 * MB, 20 * MB) == Unloads(wait=True)    # only the busy one's room would do


def test_choose_unloads_refuses_what_pinned_models_leave_no_room_for():
    unloads = choose_unloads([_r("p", 20, 0, pinned=True), _r("a", 5, 1)], 15 * MB, 30 * MB)
    assert unloads.refuse == "it needs 15 MB and pinned models hold 20 MB of --models-mb 30" and not unloads.unload
    assert choose_unloads([], 40 * MB, 30 * MB).refuse.startswith("it needs 40 MB")


def test_idle_past_ttl_names_loaded_unpinned_unleased_models_past_their_ttl():
    def slot(i, ttl=5.0, pinned=False, state=LOADED, leases=0):
        return Slot(ModelEntry(i, f"/models/{i}", ModelOptions(pinned=pinned, idle_ttl_s=ttl)), state=state,
                    leases=leases, last_used=100.0)

    slots = [slot("a"), slot("b", leases=1), slot("p", pinned=True), slot("n", ttl=None), slot("z", ttl=0.0),
             slot("u", state=UNLOADED)]
    assert idle_past_ttl(slots, 105.0) == ["a"]  # b: leased; p: pinned; n, z: no TTL; u: not loaded
    assert idle_past_ttl(slots, 104.9) == []
