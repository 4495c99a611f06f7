"""The remote tier on a real redis-server: versions, isolation by model, verification drops, faults."""

from __future__ import annotations

import logging

import pytest

from semantic.store.remote import RemoteTier
from tests.redis_helpers import RedisServer
from tests.waits import until


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def _tier(server, fingerprint="model-a", **kw) -> RemoteTier:
    return RemoteTier(server.url, fingerprint, timeout_s=0.5, **kw)


def _file(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_published_file_is_fetched_with_its_version_by_any_tier_of_the_same_model(redis_server, tmp_path):
    one, two = _tier(redis_server), _tier(redis_server)
    one.publish("public/a", _file(tmp_path, "a", b"cache bytes"), 5)
    assert one.flush(10)
    got = two.fetch("public/a")
    assert (got.version, got.data) == (5, b"cache bytes") and two.version("public/a") == 5
    assert two.fetch("public/b") is None
    assert one.stats()["published"] == 1 and two.stats()["hits"] == 1 and two.stats()["misses"] == 1
    one.close()
    two.close()


def test_an_older_version_loses_cleanly_and_the_newer_stays(redis_server, tmp_path):
    tier = _tier(redis_server)
    tier.publish("public/a", _file(tmp_path, "new", b"newer"), 20)
    tier.publish("public/a", _file(tmp_path, "old", b"older"), 10)
    assert tier.flush(10)
    assert tier.fetch("public/a").data == b"newer"
    assert (tier.stats()["published"], tier.stats()["publish_lost_race"]) == (1, 1)
    tier.close()


def test_another_models_tier_never_sees_a_value(redis_server, tmp_path):
    a, b = _tier(redis_server, "model-a"), _tier(redis_server, "model-b")
    a.publish("public/x", _file(tmp_path, "x", b"of model a"), 1)
    assert a.flush(10)
    assert b.fetch("public/x") is None and b.version("public/x") is None
    a.close()
    b.close()


def test_a_value_that_failed_verification_is_dropped_unless_a_newer_one_replaced_it(redis_server, tmp_path):
    tier = _tier(redis_server)
    tier.publish("public/a", _file(tmp_path, "a1", b"damaged"), 1)
    assert tier.flush(10)
    tier.drop("public/a", 1)
    assert tier.fetch("public/a") is None
    tier.publish("public/a", _file(tmp_path, "a2", b"good"), 3)
    assert tier.flush(10)
    tier.drop("public/a", 2)  # a reader that verified an older value: the newer one stays
    assert tier.fetch("public/a").data == b"good" and tier.stats()["verify_failures"] == 2
    tier.close()


def test_redis_down_is_a_miss_logged_once_then_skipped_until_a_probe_finds_it_again(redis_server, tmp_path, caplog):
    tier = _tier(redis_server)
    tier.publish("public/a", _file(tmp_path, "a", b"bytes"), 1)
    assert tier.flush(10)
    redis_server.stop()
    with caplog.at_level(logging.INFO, logger="semantic.store.remote"):
        assert tier.fetch("public/a") is None           # tried: fails fast
        for _ in range(5):
            assert tier.fetch("public/a") is None       # down: not tried
        tier.publish("public/b", _file(tmp_path, "b", b"more"), 1)
        assert tier.flush(10)                           # dropped quietly, nothing raised
        assert not tier.stats()["up"]
        redis_server.start()                            # the same port, empty (no persistence)
        skipped = tier.stats()["skipped"]
        assert until(lambda: tier.stats()["up"])       # the prober found it: no caller had to try
        assert tier.stats()["skipped"] == skipped
        tier.publish("public/a", _file(tmp_path, "a", b"bytes"), 2)
        assert tier.flush(10)
        assert tier.fetch("public/a").version == 2
    s = tier.stats()
    assert s["up"] and s["errors"] == 1 and s["skipped"] >= 6
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "serving from RAM and local disk" in messages[0] and "again" in messages[1]
    tier.close()


def test_a_paused_redis_is_found_again_once_it_resumes(redis_server, tmp_path):
    tier = _tier(redis_server)
    redis_server.pause()                                # SIGSTOP: every call times out
    try:
        assert tier.version("public/a") is None and not tier.stats()["up"]
        assert until(lambda: tier.stats()["probes_failed"] > 0)  # still paused: the probes time out
    finally:
        redis_server.resume()
    assert until(lambda: tier.stats()["up"])
    tier.publish("public/a", _file(tmp_path, "a", b"bytes"), 1)
    assert tier.flush(10) and tier.fetch("public/a").version == 1
    tier.close()


@pytest.mark.parametrize("policy", ["noeviction", "allkeys-lru"])
def test_a_full_redis_refuses_or_evicts_and_the_tier_never_raises(tmp_path, policy):
    server = RedisServer(tmp_path, ("--maxmemory", "4mb", "--maxmemory-policy", policy)).start()
    try:
        tier = _tier(server)
        for i in range(12):
            tier.publish(f"public/a{i}", _file(tmp_path, f"a{i}", bytes(512 * 1024)), 1)
        assert tier.flush(30)
        kept = [i for i in range(12) if tier.fetch(f"public/a{i}") is not None]
        s = tier.stats()
        tier.close()
    finally:
        server.stop()
    assert 0 < len(kept) < 12
    if policy == "noeviction":
        assert s["refused"] >= 1 and s["up"]  # OOM refusals: counted, logged once, never raised; reads go on
    else:
        assert s["errors"] == 0 and s["published"] == 12  # Redis evicted the least recently used itself


def test_past_the_budget_the_least_recently_published_or_fetched_values_go_never_the_newest(redis_server, tmp_path):
    tier = _tier(redis_server, budget_bytes=250)
    for i, agent in enumerate(("public/a", "public/b")):
        tier.publish(agent, _file(tmp_path, agent[-1], bytes(100)), 1 + i)
        assert tier.flush(10)
    assert tier.fetch("public/a") is not None  # a is now more recent than b
    tier.publish("public/c", _file(tmp_path, "c", bytes(100)), 3)
    assert tier.flush(10)
    assert tier.fetch("public/b") is None and tier.fetch("public/a") is not None
    assert tier.fetch("public/c") is not None and tier.stats()["evicted"] == 1
    tier.publish("public/d", _file(tmp_path, "d", bytes(400)), 4)  # alone past the budget: it still stays
    assert tier.flush(10)
    assert [tier.fetch(a) is not None for a in ("public/a", "public/c", "public/d")] == [False, False, True]
    assert tier.stats()["evicted"] == 3 and tier.stats()["budget_bytes"] == 250
    tier.close()


def test_without_a_budget_nothing_of_ours_is_deleted(redis_server, tmp_path):
    tier = _tier(redis_server)
    for i in range(5):
        tier.publish(f"public/{i}", _file(tmp_path, str(i), bytes(10_000)), 1)
    assert tier.flush(10)
    assert all(tier.fetch(f"public/{i}") is not None for i in range(5)) and tier.stats()["evicted"] == 0
    tier.close()
