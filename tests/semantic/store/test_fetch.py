"""Two stores (two servers' pools and directories) sharing one real redis-server: an agent resumes on either."""

from __future__ import annotations

import pytest

from semantic import AgentCacheStore
from semantic.cache import blockclaim
from semantic.store.remote import RemoteTier
from tests.cache_helpers import assert_identical, make_executor, generate, history
from tests.redis_helpers import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def _store(executor, path, server, fingerprint="tiny-model", disk_budget=10**9):
    return AgentCacheStore(path, executor.spec, fingerprint, disk_budget, pool=executor.pool, durable=False,
                           remote=RemoteTier(server.url, fingerprint, timeout_s=0.5))


def test_an_agent_saved_on_one_server_loads_on_another_and_back_newest_first(llama_tiny, tmp_path, redis_server):
    e1, e2 = make_executor(llama_tiny, blocks=256), make_executor(llama_tiny, blocks=256)
    s1, s2 = _store(e1, tmp_path / "one", redis_server), _store(e2, tmp_path / "two", redis_server)
    # 24 tokens (the last generated one is never fed): whole blocks, so no file of turn 1 is a prefix of
    # one of turn 2's (a partial block's prefix would be server one's own bits, computed otherwise)
    turn1 = generate(e1, "public/a", history(20), 5).blocks
    s1.save("public/a", turn1)
    assert s1.remote.flush(10)
    assert_identical(s2.load("public/a"), turn1)                 # server two had never seen it
    turn2 = generate(e2, "public/a", list(turn1.token_ids) + [5, 6, 7], 4).blocks
    s2.save("public/a", turn2)
    assert s2.remote.flush(10)
    assert s1.newer_elsewhere("public/a")
    assert_identical(s1.load("public/a"), turn2)                 # its own older file is replaced
    assert not s1.newer_elsewhere("public/a") and s1.remote.stats()["hits"] == 1


def test_a_damaged_or_foreign_remote_value_is_refused_dropped_and_the_local_file_still_loads(
        llama_tiny, tmp_path, redis_server):
    e1 = make_executor(llama_tiny, blocks=256)
    s1 = _store(e1, tmp_path / "one", redis_server)
    mine = generate(e1, "public/a", history(20), 4).blocks
    s1.save("public/a", mine)
    assert s1.remote.flush(10)
    client = s1.remote._client
    key = s1.remote.key("public/a")
    client.hset(key, mapping={"v": str(2**62), "data": b"not a cache file"})
    assert_identical(s1.load("public/a"), mine)
    assert client.exists(key) == 0 and s1.remote.stats()["verify_failures"] == 1
    other = _store(make_executor(llama_tiny, blocks=256), tmp_path / "other", redis_server, fingerprint="another-model")
    other.remote.publish("public/b", next((tmp_path / "one").glob("*.kvm")), 1)
    assert other.remote.flush(10)
    assert s1.load("public/b") is None  # another model's key space: never even fetched


def test_a_prefix_saved_on_one_server_is_prefetched_into_another_servers_pool(llama_tiny, tmp_path, redis_server):
    e1, e2 = make_executor(llama_tiny, blocks=256), make_executor(llama_tiny, blocks=256)
    s1, s2 = _store(e1, tmp_path / "one", redis_server), _store(e2, tmp_path / "two", redis_server)
    shared = history(40)  # ten full 4-token blocks
    s1.save("public/first", generate(e1, "public/first", shared, 4).blocks)
    assert s1.remote.flush(10)
    newcomer = shared + [9, 9, 9]
    assert s2.prefetch(newcomer) == 10 and s2.prefetch(newcomer) == 0  # the second time: all pooled already
    plan = blockclaim.claim_blocks(s2.pool, s2.spec, newcomer)
    assert sum(p.hit is not None for p in plan.blocks) == 10  # the newcomer's turn will start from them
    assert s2.prefetch(newcomer, salt_root=12345) == 0  # another tenant's root: no pointer matches


def test_a_file_fetched_from_elsewhere_keeps_the_local_disk_within_its_budget(llama_tiny, tmp_path, redis_server):
    e1, e2 = make_executor(llama_tiny, blocks=256), make_executor(llama_tiny, blocks=256)
    s1 = _store(e1, tmp_path / "one", redis_server)
    caches = {a: generate(e1, a, history(40, seed=i), 4).blocks for i, a in enumerate(("public/a", "public/b"))}
    for agent, blocks in caches.items():
        s1.save(agent, blocks)
    assert s1.remote.flush(10)
    size = s1.stats().disk_bytes // 2  # the two agents share no block: half each
    s2 = _store(e2, tmp_path / "two", redis_server, disk_budget=size + size // 2)  # room for one agent
    assert_identical(s2.load("public/a"), caches["public/a"])
    assert_identical(s2.load("public/b"), caches["public/b"])
    assert s2.agents() == ["public/b"] and s2.stats().disk_bytes <= s2.disk_budget
    assert s2.remote.stats()["block_hits"] == s2.stats().disk_block_files + len(caches["public/a"].unique_blocks())


def test_another_server_fetches_only_the_blocks_its_disk_lacks_and_no_value_exceeds_a_block(
        llama_tiny, tmp_path, redis_server):
    e1, e2 = make_executor(llama_tiny, blocks=256), make_executor(llama_tiny, blocks=256)
    s1, s2 = _store(e1, tmp_path / "one", redis_server), _store(e2, tmp_path / "two", redis_server)
    shared = history(24)  # six full 4-token blocks every agent below starts with
    a = generate(e1, "public/a", shared + [5, 6], 4).blocks
    s1.save("public/a", a)
    assert s1.remote.flush(10)
    assert_identical(s2.load("public/a"), a)
    fetched = s2.remote.stats()["block_hits"]
    assert fetched == s1.stats().disk_block_files  # every block, once
    b = generate(e1, "public/b", shared + [7, 8, 9], 4).blocks
    s1.save("public/b", b)
    assert s1.remote.flush(10)
    assert s1.remote.stats()["blocks_sent"] == s1.stats().disk_block_files  # each block sent once, shared or not
    assert_identical(s2.load("public/b"), b)
    new = s2.remote.stats()["block_hits"] - fetched
    assert 0 < new < fetched  # only b's own blocks: the shared ones were on s2's disk already
    client = s1.remote._client
    biggest = max(client.strlen(k) for k in client.scan_iter(f"{s1.remote.prefix}:*:kvb:*"))
    block = 4 * int(e1.spec.token_bytes())
    assert biggest < block + 64 * 1024  # a block's K/V and its header, never a whole cache
