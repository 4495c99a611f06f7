"""The hop stamps' pure parts: the table of medians after the POST's arrival, and the wrapping that puts
every function back."""

from __future__ import annotations

import pytest

from harness.trials.serving import hops


def _turn(t0, arrived, **after_ms):
    stamps = {"arrived": arrived, **{h: arrived + ms / 1000 for h, ms in after_ms.items()}}
    return {"client_t0": t0, "client_first": arrived + after_ms.get("chunk", 0) / 1000 + 0.002, "stamps": stamps}


def test_the_table_is_each_hops_median_after_the_arrival_and_a_missing_hop_is_none():
    turns = [_turn(10.0, 10.030, handler=2, prepared=5, admitted=7, prefilled=300, token=301, chunk=310),
             _turn(20.0, 20.010, handler=4, prepared=7, admitted=9, prefilled=500, token=501, chunk=512),
             _turn(30.0, 30.020, handler=3, prepared=6, admitted=8, prefilled=400, token=402, chunk=408),
             {"client_t0": 40.0, "client_first": 40.5, "stamps": {}}]  # never arrived: left out
    t = hops.hop_table(turns)
    assert t["arrived"] == 0.0 and (t["handler"], t["prepared"], t["admitted"]) == (3.0, 6.0, 8.0)
    assert (t["prefilled"], t["token"], t["chunk"]) == (400.0, 402.0, 408.0)
    assert t["client_first"] == pytest.approx(410.0) and t["client_to_arrival"] == pytest.approx(20.0)
    assert hops.hop_table([_turn(1.0, 1.001, handler=1)])["chunk"] is None


def test_every_stamped_function_exists_and_is_put_back():
    got = []
    undo = hops.install(got.append)
    originals = [(owner, attr, orig) for owner, attr, orig in undo]
    try:
        assert len(undo) == len(hops.HOPS)  # one wrapper per hop
        assert all(getattr(owner, attr) is not orig for owner, attr, orig in originals)
    finally:
        hops.uninstall(undo)
    assert all(getattr(owner, attr) is orig for owner, attr, orig in originals) and undo == []
