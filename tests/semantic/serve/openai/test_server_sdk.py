"""``semantic serve`` on a tiny random-weight llama, driven by the official openai and anthropic SDKs.

Every test talks to a real server process on 127.0.0.1 (``tests/serve_helpers``).
The tiny model's byte tokenizer makes one character one token, so a
600-character system prompt spans two 256-token blocks.
"""

from __future__ import annotations

import json
import signal
import threading

import anthropic
import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from tests.serve_helpers import Server
from tests.waits import wait_for

SYSTEM = "You are a careful coding agent. " * 20  # 640 characters: two whole blocks and a bit


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = Server(tiny_dir, tmp_path_factory.mktemp("serve") / "agents", ["--pool-mb", "64"]).start()
    yield s
    assert s.stop_cleanly(), s.log()


def _oa(server, key="none", **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def _an(server, key="none"):
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _chat(client, agent, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, prompt_cache_key=agent,
                                          temperature=0, **kw)


def test_openai_chat_reports_cached_tokens_on_an_agents_second_turn(server):
    client = _oa(server)
    models = client.models.list()
    model = models.data[0].id
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    first = client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0,
                                           prompt_cache_key="agent-one")
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 600 and first.usage.completion_tokens == 8
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now open the first one."}]
    second = client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0,
                                            prompt_cache_key="agent-one")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # everything of turn one that the template renders the same way came from the agent's cache
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


def test_openai_streaming_equals_the_non_streamed_reply_and_reports_usage(server):
    client = _oa(server)
    messages = [{"role": "user", "content": "Say something about caches."}]
    whole = _chat(client, None, messages, max_completion_tokens=12)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_openai_completions_take_text_or_token_ids_and_cut_at_a_stop_string(server):
    client = _oa(server)
    by_text = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=[97, 98, 99], max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.usage.prompt_tokens == 3
    reply = by_text.choices[0].text
    assert len(reply) >= 3
    stop = reply[2:4] if len(reply) >= 4 else reply[2]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, stop=[stop])
    assert cut.choices[0].text == reply[: reply.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_anthropic_messages_stream_the_real_event_sequence_and_report_cache_reads(server):
    client = _an(server)
    kw = dict(model="tiny", max_tokens=10, system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
              metadata={"user_id": "claude-agent"})
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello."}]}]
    first = client.messages.create(messages=msgs, **kw)
    assert first.type == "message" and first.content[0].type == "text"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens == 10
    msgs += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "More."}]
    events, started = [], None
    with client.messages.stream(messages=msgs, **kw) as stream:
        for event in stream:
            events.append(event.type)
            if event.type == "message_start":
                started = event.message.usage
        final = stream.get_final_message()
    assert started.cache_read_input_tokens == final.usage.cache_read_input_tokens > 0  # known from the start
    core = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop")]
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in core
    assert final.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert final.usage.input_tokens > 0  # Anthropic counts only the uncached part here


def test_two_agents_sharing_a_system_prompt_share_its_blocks(server):
    client = _oa(server)
    a = _chat(client, "share-a", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task A"}])
    b = _chat(client, "share-b", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task B"}])
    assert b.usage.prompt_tokens_details.cached_tokens >= 512  # the two whole blocks of the system prompt
    # and each keeps its own cache: a's next turn starts from a's history, not b's
    a2 = _chat(client, "share-a", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task A"},
                                   {"role": "assistant", "content": a.choices[0].message.content},
                                   {"role": "user", "content": "go on"}])
    assert a2.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens


def test_a_seed_reproduces_a_sampled_reply(server):
    client = _oa(server)
    messages = [{"role": "user", "content": "Pick a word."}]
    kw = dict(model="tiny", messages=messages, max_tokens=16, temperature=1.0, top_p=0.9)
    one = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    two = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    other = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert one == two and one != other


def test_a_cancelled_stream_frees_its_sequence_and_the_agent_goes_on(server):
    client = _oa(server)
    before = server.stats()["requests"]["cancelled"]
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Talk."}],
                                            max_tokens=3000, stream=True, prompt_cache_key="quitter")
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client hangs up mid-reply
    wait_for(lambda: (server.stats()["requests"]["cancelled"] > before
                      and server.stats()["requests"]["in_flight"] == 0), lambda: server.stats()["requests"])
    s = server.stats()
    assert s["requests"]["cancelled"] == before + 1 and s["requests"]["in_flight"] == 0
    after = _chat(client, "quitter", [{"role": "user", "content": "Talk."}])
    assert after.choices[0].finish_reason == "length"


def test_errors_come_back_in_each_apis_shape_never_as_a_500(server):
    client = _oa(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 5000}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    with pytest.raises(anthropic.BadRequestError) as e:
        _an(server).messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    raw = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "error" in raw.json()
    raw = httpx.post(server.url + "/v1/messages", content=b"[1, 2", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["type"] == "error"


def test_metrics_and_cache_stats_describe_the_traffic(server):
    _chat(_oa(server), "metrics-agent", [{"role": "user", "content": "hi"}])
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_total", "prompt_tokens_total", "cached_tokens_total", "ttft_seconds_bucket",
                 "inter_token_seconds_bucket", "queue_depth", "pool_used_bytes", "disk_bytes"):
        assert name in text, name
    stats = server.stats()
    assert any(a["agent"] == "metrics-agent" for a in stats["agents"])
    assert stats["tokens"]["cached"] > 0 and stats["pool"]["used_blocks"] > 0
    # a llama: agents decoding together keep their rows in their own buffers (kinds.rows)
    assert stats["batch"] == {"off_reason": None, "rows_apart": True, "merge_reason": None}


def test_the_ram_budget_holds_and_an_evicted_agent_continues_from_disk(tiny_dir, tmp_path):
    s = Server(tiny_dir, tmp_path / "agents", ["--pool-mb", "64", "--ram-mb", "1"]).start()
    try:  # 1536 bytes a token: one agent's 420 tokens fit in 1 MiB, two do not
        first = {}
        for agent in ("ram-a", "ram-b"):
            msgs = [{"role": "user", "content": f"{agent} has a long story to tell. " * 12}]
            first[agent] = (msgs, _chat(_oa(s), agent, msgs))
            s.wait_saved()
        ram = s.stats()["ram"]
        assert ram["budget_bytes"] == 1 << 20 and ram["budget_evictions"] >= 1
        assert ram["bytes"] <= ram["budget_bytes"] and ram["peak_bytes"] <= ram["budget_bytes"]
        msgs, r = first["ram-a"]
        again = _chat(_oa(s), "ram-a", msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                                               {"role": "user", "content": "go on"}])
        assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens  # from its file
        text = httpx.get(s.url + "/metrics").text
        assert 'semantic_ram_budget_bytes{model="tiny"} 1.048576e+06' in text and "semantic_ram_budget_evictions_total" in text
    finally:
        assert s.stop_cleanly(), s.log()


def test_overload_answers_429_with_retry_after(tiny_dir, tmp_path):
    s = Server(tiny_dir, tmp_path / "agents", ["--pool-mb", "64", "--max-queued", "1", "--max-batch", "1"]).start()
    try:
        codes, retry = [], []

        def hit(i):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": f"flood {i}"}], "max_tokens": 200})
            codes.append(r.status_code)
            retry.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=hit, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        assert all(r is not None for c, r in zip(codes, retry) if c == 429)
    finally:
        assert s.stop_cleanly(), s.log()


def test_tenants_never_hit_each_others_prefixes(tiny_dir, tmp_path):
    s = Server(tiny_dir, tmp_path / "agents", ["--pool-mb", "64", "--api-key", "key-a", "--api-key", "key-b"]).start()
    try:
        with pytest.raises(openai.AuthenticationError):
            _chat(_oa(s, "wrong"), None, [{"role": "user", "content": "x"}])
        with pytest.raises(anthropic.AuthenticationError):
            _an(s, "wrong").messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "same prefix"}]
        a1 = _chat(_oa(s, "key-a"), None, msgs)
        b1 = _chat(_oa(s, "key-b"), None, msgs)
        a2 = _chat(_oa(s, "key-a"), None, msgs)
        assert a1.usage.prompt_tokens_details.cached_tokens == 0
        assert b1.usage.prompt_tokens_details.cached_tokens == 0  # a's blocks are invisible to b
        assert a2.usage.prompt_tokens_details.cached_tokens >= 512
        # cache_salt splits a tenant further (vLLM's field)
        salted = _chat(_oa(s, "key-a"), None, msgs, extra_body={"cache_salt": "project-x"})
        assert salted.usage.prompt_tokens_details.cached_tokens == 0
        # agents are namespaced too: the same name under another key is another agent
        fresh = [{"role": "system", "content": "Another prompt entirely. " * 30}, {"role": "user", "content": "hi"}]
        _chat(_oa(s, "key-a"), "same-name", fresh)
        other = _chat(_oa(s, "key-b"), "same-name", fresh)
        # not key-a's "same-name" cache (it would cover the whole prompt): at most the chat template's
        # opening tokens, which key-b's own earlier request pooled (a prefix of any pooled block is reused)
        assert other.usage.prompt_tokens_details.cached_tokens < 16
        s.wait_saved("key-b")  # a busy machine may still be writing it behind the reply
        assert [a["agent"] for a in s.stats("key-b")["agents"]] == ["same-name"]
        assert httpx.get(s.url + "/v1/cache/stats").status_code == 401
    finally:
        assert s.stop_cleanly(), s.log()


@pytest.mark.parametrize("sig, sync", [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGKILL, True)],
                         ids=["sigterm", "sigkill-after-saves", "sigkill-sync-saves"])
def test_a_restarted_server_answers_every_agents_next_turn_from_disk(tiny_dir, tmp_path, sig, sync):
    cache = tmp_path / "agents"
    s = Server(tiny_dir, cache, ["--pool-mb", "64"] + (["--sync-saves"] if sync else [])).start()
    histories = {}
    for agent in ("r1", "r2", "r3"):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"I am {agent}."}]
        reply = _chat(_oa(s), agent, msgs)
        histories[agent] = (msgs + [{"role": "assistant", "content": reply.choices[0].message.content},
                                    {"role": "user", "content": "continue"}], reply.usage.prompt_tokens)
    if sig == signal.SIGKILL and not sync:
        s.wait_saved()  # write-behind: a turn's cache is on disk once its save is written, just after the reply
    code = s.stop(sig)
    assert code in ((0, -signal.SIGTERM) if sig == signal.SIGTERM else (-signal.SIGKILL,))
    s2 = Server(tiny_dir, cache, ["--pool-mb", "64"]).start()
    try:
        for agent, (msgs, before) in histories.items():
            nxt = _chat(_oa(s2), agent, msgs)
            assert nxt.usage.prompt_tokens_details.cached_tokens >= before, agent
    finally:
        assert s2.stop_cleanly(), s2.log()


def _health(server) -> int:
    """``GET /health``'s status, or 0 once nothing listens."""
    try:
        return httpx.get(server.url + "/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def test_sigterm_finishes_a_turn_in_flight_and_refuses_new_ones(tiny_dir, tmp_path):
    s = Server(tiny_dir, tmp_path / "agents", ["--pool-mb", "64"]).start()
    got = {}

    def long_turn():
        got["r"] = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
            "prompt_cache_key": "busy"})

    t = threading.Thread(target=long_turn)
    t.start()
    wait_for(lambda: s.stats()["requests"]["in_flight"] > 0, s.log)
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _health(s) != 200, s.log)  # shutdown began: /health says 503, or the listener closed
    try:
        late = httpx.post(s.url + "/v1/chat/completions", timeout=10, json={
            "model": "tiny", "messages": [{"role": "user", "content": "late"}], "max_tokens": 4})
        assert late.status_code == 503
    except httpx.ConnectError:
        pass  # the listener already closed: also a refusal
    t.join(120)
    assert s.proc.wait(60) in (0, -signal.SIGTERM) and "Application shutdown complete" in s.log()
    assert got["r"].status_code == 200 and json.loads(got["r"].text)["usage"]["completion_tokens"] == 400
