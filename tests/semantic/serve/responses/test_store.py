"""Stored responses: per tenant, bounded, and the bound kept without listing every file on every write."""

from __future__ import annotations

import os

from semantic.serve.responses.store import ResponseStore


def _id(i: int) -> str:
    return f"resp_{i:024x}"


def test_records_are_per_tenant_and_the_oldest_go_past_the_limit(tmp_path):
    store = ResponseStore(tmp_path, limit=3)
    for i in range(5):
        store.put("t1", _id(i), {"n": i})
        os.utime(store._path("t1", _id(i)), (1000 + i, 1000 + i))  # written in order, whatever the clock says
    assert [store.get("t1", _id(i)) for i in range(5)] == [None, None, {"n": 2}, {"n": 3}, {"n": 4}]
    assert store.get("t2", _id(4)) is None  # another tenant's id is not found
    assert store.get("t1", "../../etc/passwd") is None and not store.delete("t1", "resp_x")


def test_a_delete_and_a_rewrite_keep_the_count_so_nothing_is_evicted_early(tmp_path):
    store = ResponseStore(tmp_path, limit=2)
    store.put("t", _id(0), {"n": 0})
    store.put("t", _id(0), {"n": 0, "again": True})  # the same id again: still one record
    store.put("t", _id(1), {"n": 1})
    assert store.get("t", _id(0)) == {"n": 0, "again": True}
    assert store.delete("t", _id(1))
    store.put("t", _id(2), {"n": 2})
    assert store.get("t", _id(0)) is not None and store.get("t", _id(2)) == {"n": 2}
