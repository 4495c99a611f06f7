"""Two real ``semantic serve`` processes, separate cache directories, one real redis-server: any server
resumes any agent (``--remote``)."""

from __future__ import annotations

import json
import signal
import threading
import uuid

import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.redis_helpers import RedisServer
from tests.serve_helpers import Server
from tests.waits import wait_for

SYSTEM = "You are a careful coding agent. " * 20  # 640 one-token characters: two whole 256-token blocks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("cluster")
    redis = RedisServer(base).start()
    model = write_tiny_llama(base / "model")
    servers = [Server(model, base / f"agents-{i}", ["--pool-mb", "64", "--sync-saves", "--remote", redis.url]).start()
               for i in range(2)]
    yield servers, redis
    for s in servers:
        assert s.stop_cleanly(), s.log()
    redis.stop()


def _published(server, count: int) -> None:
    wait_for(lambda: server.stats()["remote"]["published"] >= count, lambda: server.stats()["remote"])


def _sent(server) -> int:
    """Publishes that reached Redis, won or lost."""
    r = server.stats()["remote"]
    return r["published"] + r["publish_lost_race"]


def _chat(server, agent, messages, salt=None):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    headers = {**({"X-Agent-Id": agent} if agent else {}), **({"X-Cache-Salt": salt} if salt else {})}
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_headers=headers or None)


def _fresh(server, messages):
    """The reply to a fresh prefill: anonymous, under a salt no block was ever stored with."""
    return _chat(server, None, messages, salt=uuid.uuid4().hex)


def test_an_agent_alternating_between_two_servers_resumes_its_whole_history_on_each(cluster):
    servers, _ = cluster
    messages = [{"role": "system", "content": SYSTEM}]
    prompts, cached = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Step {turn}: list the files."})
        before = servers[turn % 2].stats()["remote"]["published"]
        reply = _chat(servers[turn % 2], "alternating", messages)
        _published(servers[turn % 2], before + 1)
        assert reply.choices[0].message.content == _fresh(servers[turn % 2], messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        prompts.append(reply.usage.prompt_tokens)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    # each turn after the first finds the whole previous turn (its prompt and reply) cached, wherever it ran
    assert all(c >= p for c, p in zip(cached[1:], prompts[:-1])), (prompts, cached)
    stats = [s.stats()["remote"] for s in servers]
    assert stats[0]["hits"] >= 1 and stats[1]["hits"] >= 2 and all(s["verify_failures"] == 0 for s in stats)
    assert "semantic_remote_hits_total" in httpx.get(servers[1].url + "/metrics", timeout=10).text


def test_a_system_prompt_first_prefilled_on_one_server_is_a_hit_for_a_new_agent_on_the_other(cluster):
    servers, _ = cluster
    system = [{"role": "system", "content": "You review pull requests for a payments team. " * 14}]
    before = servers[0].stats()["remote"]["published"]
    first = _chat(servers[0], "reviewer-1", system + [{"role": "user", "content": "Review PR 1."}])
    _published(servers[0], before + 1)  # publishing runs behind the save
    second = _chat(servers[1], "reviewer-2", system + [{"role": "user", "content": "Review PR 2."}])
    assert first.usage.prompt_tokens_details.cached_tokens < 256  # new here too (a template tail at most)
    # every full 256-token block of the shared system prompt came from the other server's file
    assert second.usage.prompt_tokens_details.cached_tokens >= 512


def test_two_servers_answering_one_agent_at_once_leave_one_whole_cache_and_the_next_turn_is_exact(cluster):
    servers, redis_server = cluster
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Both of you, answer."}]
    replies: dict[int, object] = {}
    errors = [s.stats()["remote"]["errors"] for s in servers]
    sent = [_sent(s) for s in servers]

    def ask(i):
        replies[i] = _chat(servers[i], "contested", messages)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content  # greedy, same history
    for s, n in zip(servers, sent):  # both publishes ran: the newer version stands, an older one lost cleanly
        wait_for(lambda: _sent(s) > n, lambda: s.stats()["remote"])
    assert [s.stats()["remote"]["errors"] for s in servers] == errors
    follow = messages + [{"role": "assistant", "content": replies[0].choices[0].message.content},
                         {"role": "user", "content": "Go on."}]
    again = [_chat(s, "contested", follow) for s in servers]
    fresh = _chat(servers[0], None, follow)  # anonymous: only pooled blocks, never the agent's cache
    assert {a.choices[0].message.content for a in again} == {fresh.choices[0].message.content}
    assert all(a.usage.prompt_tokens_details.cached_tokens >= replies[0].usage.prompt_tokens for a in again)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_remote_value_is_never_used_dropped_and_counted(cluster, damage):
    import redis

    servers, redis_server = cluster
    agent = f"victim-{damage}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Remember this."}]
    before = servers[0].stats()["remote"]["published"]
    first = _chat(servers[0], agent, messages)
    _published(servers[0], before + 1)
    client = redis.Redis.from_url(redis_server.url)
    key = next(k for k in client.scan_iter(match="semkv:*:manifest:*")
               if agent.encode() in client.hget(k, "data"))  # the manifest names its agent
    if damage == "truncate":  # the manifest: refused whole
        data = client.hget(key, "data")
        client.hset(key, mapping={"v": str(2**62), "data": data[: len(data) // 2]})
        damaged = key
    else:  # its last block, past the header: only the tensors' checksums can tell
        doc = json.loads(json.loads(client.hget(key, "data"))["semantic_kv_manifest"])
        last = doc["extents"]["global"][-1][0]
        damaged = next(client.scan_iter(match=f"semkv:*:kvb:{last}"))
        data = bytearray(client.get(damaged))
        for at in range(len(data) - 4096, len(data) - 8, 997):
            data[at] ^= 0xFF
        client.set(damaged, bytes(data))
    failures = servers[1].stats()["remote"]["verify_failures"]
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Now?"}]
    reply = _chat(servers[1], agent, follow)
    fresh = _chat(servers[1], None, follow)
    assert reply.choices[0].message.content == fresh.choices[0].message.content
    assert servers[1].stats()["remote"]["verify_failures"] == failures + 1
    if damage == "truncate":
        assert client.hget(key, "v") != str(2**62).encode()  # dropped (or already replaced by server two's turn)
    else:
        assert client.get(damaged) != bytes(data)  # dropped (or written again, whole, by server two's turn)
        assert servers[1].stats()["quarantined"] == 1  # and set aside on server two's disk


def test_agents_of_a_server_killed_mid_burst_continue_on_the_other_from_their_last_published_turn(tmp_path):
    redis_server = RedisServer(tmp_path).start()
    model = write_tiny_llama(tmp_path / "model")
    one, two = (Server(model, tmp_path / f"agents-{i}", ["--pool-mb", "64", "--sync-saves", "--remote",
                                                          redis_server.url]).start() for i in range(2))
    try:
        agents = [f"burst-{i}" for i in range(4)]
        histories = {a: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a}: first."}]
                     for a in agents}
        durable = {}
        before = one.stats()["remote"]["published"]
        for a in agents:
            r = _chat(one, a, histories[a])
            durable[a] = r.usage.prompt_tokens
            histories[a] += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "second."}]
        _published(one, before + len(agents))
        burst = [threading.Thread(target=lambda a=a: _try(one, a, histories[a])) for a in agents]
        served = one.stats()["requests"]
        for t in burst:
            t.start()
        # mid-burst: once one of the second turns is in, whether or not any has finished
        wait_for(lambda: one.stats()["requests"] != served, lambda: one.stats()["requests"])
        one.stop(signal.SIGKILL)
        for t in burst:
            t.join(60)
        for a in agents:
            r = _chat(two, a, histories[a])
            assert r.usage.prompt_tokens_details.cached_tokens >= durable[a], (a, r.usage)
    finally:
        one.stop(signal.SIGKILL)
        assert two.stop_cleanly(), two.log()
        redis_server.stop()


def _try(server, agent, messages) -> None:
    try:
        _chat(server, agent, messages)
    except openai.APIError:
        pass  # the server died under it


def test_another_tenants_salt_or_another_agents_value_is_never_used_and_is_counted(cluster):
    import redis

    servers, redis_server = cluster
    system = [{"role": "system", "content": "You triage incidents for a hospital's records team. " * 13}]
    before = servers[0].stats()["remote"]["published"]
    _chat(servers[0], "triage-1", system + [{"role": "user", "content": "Incident 1."}], salt="tenant-a")
    _published(servers[0], before + 1)
    # the same prompt under another salt (another tenant) finds none of the first one's blocks
    other = _chat(servers[1], "triage-2", system + [{"role": "user", "content": "Incident 2."}], salt="tenant-b")
    assert other.usage.prompt_tokens_details.cached_tokens < 256
    same = _chat(servers[1], "triage-3", system + [{"role": "user", "content": "Incident 3."}], salt="tenant-a")
    assert same.usage.prompt_tokens_details.cached_tokens >= 512
    # triage-1's manifest written under triage-4's key (a foreign or confused writer): refused, dropped, counted
    client = redis.Redis.from_url(redis_server.url)
    keys = {k: client.hget(k, "data") for k in client.scan_iter(match="semkv:*:manifest:*")}
    theirs = next(v for v in keys.values() if b"triage-1" in v)
    messages = system + [{"role": "user", "content": "Incident 4."}]
    _chat(servers[0], "triage-4", messages, salt="tenant-a")  # makes triage-4's key
    _published(servers[0], before + 2)
    mine = next(k for k, v in ((k, client.hget(k, "data")) for k in client.scan_iter(match="semkv:*:manifest:*"))
                if b"triage-4" in v)
    client.hset(mine, mapping={"v": str(2**62), "data": theirs})
    failures = servers[1].stats()["remote"]["verify_failures"]
    reply = _chat(servers[1], "triage-4", messages + [{"role": "assistant", "content": "Noted."},
                                                     {"role": "user", "content": "Next?"}], salt="tenant-a")
    fresh = _fresh(servers[1], messages + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Next?"}])
    assert reply.choices[0].message.content == fresh.choices[0].message.content
    assert servers[1].stats()["remote"]["verify_failures"] == failures + 1


def test_redis_killed_and_restarted_under_load_costs_no_request_and_no_wrong_reply(cluster):
    servers, redis_server = cluster
    stop, errors, wrong, turns = threading.Event(), [], [], [0, 0]

    def agent(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        for n in range(60):  # each turn on the other server
            if stop.is_set():
                return
            server = servers[(i + n) % 2]
            messages.append({"role": "user", "content": f"Agent {i}, step {n}."})
            try:
                reply = _chat(server, f"under-load-{i}", messages)
                if reply.choices[0].message.content != _fresh(server, messages).choices[0].message.content:
                    wrong.append((i, n))
            except Exception as exc:  # any failure is the test's
                errors.append(repr(exc))
                return
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            turns[i] += 1

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    remote = lambda: ([s.stats()["remote"] for s in servers], errors, turns)  # noqa: E731
    try:
        wait_for(lambda: min(turns) >= 1 or errors, remote)  # the load runs
        redis_server.stop()
        wait_for(lambda: not any(s.stats()["remote"]["up"] for s in servers) or errors, remote)  # both saw it
        redis_server.start()  # empty: nothing was persisted
        published = [s.stats()["remote"]["published"] for s in servers]
        wait_for(lambda: errors or (min(turns) >= 3 and all(
            s.stats()["remote"]["published"] > p for s, p in zip(servers, published))), remote)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert errors == [] and wrong == [] and min(turns) >= 3, (errors, wrong, turns)
    assert all(s.stats()["remote"]["up"] for s in servers)  # both saw the outage, and both publish again
