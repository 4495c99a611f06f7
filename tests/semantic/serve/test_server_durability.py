"""What a reply says of its cache's save, through the official SDKs against a real server on a tiny model.

``X-Semantic-Cache-Save`` (responses that are not streamed) and
``usage.cache_save`` (every response, streamed ones in their last usage):
"saved" once the file is written and fsynced, "failed" when the disk refused
it, "pending" while it is written behind the reply (no ``--sync-saves``).
"""

from __future__ import annotations

import signal
import threading

import anthropic
import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.serve_helpers import Server
from tests.waits import wait_for

SYSTEM = "You are a careful coding agent. " * 20  # 640 one-token characters: two whole 256-token blocks
HEADER = "x-semantic-cache-save"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def synced(tiny_dir, tmp_path_factory):
    s = Server(tiny_dir, tmp_path_factory.mktemp("synced") / "agents", ["--pool-mb", "64", "--sync-saves"]).start()
    yield s
    assert s.stop_cleanly(), s.log()


def _saved(usage) -> str | None:
    """Our extension of the usage object, as an SDK keeps an unknown field."""
    return (usage.model_extra or {}).get("cache_save")


def _oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _an(server, **headers):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60,
                               default_headers=headers or None)


def _chat_raw(server, agent: str | None, text: str = "List the files.", **kw):
    headers = {"X-Agent-Id": agent} if agent else {}
    return _oa(server).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        max_tokens=6, temperature=0, extra_headers=headers, **kw)


def test_with_sync_saves_every_api_says_a_named_agents_cache_was_saved(synced):
    raw = _chat_raw(synced, "agent-a")
    assert raw.headers[HEADER] == "saved" and _saved(raw.parse().usage) == "saved"
    assert "agent-a" in [a["agent"] for a in synced.stats()["agents"]]

    chunks = list(_oa(synced).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello."}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Agent-Id": "agent-b"}))
    assert _saved(chunks[-1].usage) == "saved"

    client = _an(synced, **{"X-Agent-Id": "agent-c"})
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=6, system=SYSTEM,
                                                   messages=[{"role": "user", "content": "Hello."}])
    assert raw.headers[HEADER] == "saved" and _saved(raw.parse().usage) == "saved"
    with client.messages.stream(model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Hi."}]) as s:
        deltas = [e for e in s if e.type == "message_delta"]
    assert _saved(deltas[-1].usage) == "saved"

    anonymous = _chat_raw(synced, None)
    assert HEADER not in anonymous.headers and _saved(anonymous.parse().usage) is None


def test_with_sync_saves_a_reply_whose_save_failed_says_so_and_the_server_keeps_answering(tiny_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache directory's parent is a file: nothing can be saved under it")
    server = Server(tiny_dir, blocker / "agents", ["--pool-mb", "64", "--sync-saves", "--ram-mb", "1"],
                    log_dir=tmp_path).start()
    try:
        said = []
        for i in range(6):
            raw = _chat_raw(server, f"agent-{i}")
            assert raw.status_code == 200
            said.append((raw.headers[HEADER], _saved(raw.parse().usage)))
        stats = server.stats()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        assert server.stop_cleanly(), server.log()
    assert said == [("failed", "failed")] * 6
    assert stats["disk"]["state"] == "missing" and stats["saves"]["done"] == 0 and stats["saves"]["errors"] == 6
    # a 1 MiB RAM budget and nothing saved: caches are dropped, counted, instead of growing
    assert stats["saves"]["lost"] >= 1 and stats["ram"]["bytes"] <= stats["ram"]["budget_bytes"]
    assert 'semantic_disk_state{model="tiny",state="missing"} 1.0' in metrics
    assert 'semantic_turn_cache_saves_total{api="chat",model="tiny",result="failed"} 6.0' in metrics
    log = server.log()
    assert "Traceback" not in log and log.count("the cache directory is gone") == 1


def test_without_sync_saves_a_reply_says_pending_and_the_save_lands_behind_it(tiny_dir, tmp_path):
    server = Server(tiny_dir, tmp_path / "agents", ["--pool-mb", "64"]).start()
    try:
        raw = _chat_raw(server, "agent-a")
        said = raw.headers[HEADER], _saved(raw.parse().usage)
        server.wait_saved()
        stats = server.stats()
    finally:
        assert server.stop_cleanly(), server.log()
    assert said == ("pending", "pending")
    assert stats["saves"]["done"] == 1 and stats["disk"]["agents"] == 1 and stats["disk"]["state"] == "ok"


def test_the_x_cache_salt_header_keeps_anthropic_requests_from_sharing_blocks(synced):
    def cached(salt: str) -> int:
        reply = _an(synced, **{"X-Cache-Salt": salt}).messages.create(
            model="tiny", max_tokens=2, system=SYSTEM, messages=[{"role": "user", "content": "Salted."}])
        return reply.usage.cache_read_input_tokens

    assert cached("first") == 0
    assert cached("first") >= 512   # the same salt: its two whole blocks are shared
    assert cached("second") == 0    # another salt: nothing is


def _open(server) -> tuple[int, int]:
    """(turns running, turns queued) on the server now."""
    r = server.stats()["requests"]
    return r["in_flight"], r["queued"]


def test_turns_still_open_when_the_graceful_timeout_runs_out_are_answered_503_never_500(tiny_dir, tmp_path):
    server = Server(tiny_dir, tmp_path / "agents",
                    ["--pool-mb", "64", "--max-batch", "1", "--graceful-timeout", "1"]).start()
    statuses: list[int] = []

    def turn(i: int) -> None:
        body = {"model": "tiny", "max_tokens": 2000, "temperature": 0,
                "messages": [{"role": "user", "content": f"Write a long story, number {i}."}]}
        try:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60,
                           headers={"X-Agent-Id": f"agent-{i}"})
            statuses.append(r.status_code)
            assert "Traceback" not in r.text
        except httpx.HTTPError:
            statuses.append(0)  # the connection closed without an answer

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: _open(server) == (1, 3), lambda: server.stats()["requests"])  # one turn runs, three wait
    server.stop(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert set(statuses) <= {200, 503} and 503 in statuses, (statuses, server.log())
    assert "answered 503 and cancelled" in server.log()
