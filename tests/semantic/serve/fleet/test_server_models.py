"""Several models behind one ``semantic serve``, driven by the official openai and anthropic SDKs.

Real server processes (``tests/serve_helpers``) on tiny random-weight llamas: different seeds and depths give
models that answer the same prompt differently, so a reply shows which model wrote it. One server is shared by
the tests that do not stop it: models ``a`` and ``b`` load on demand, ``p`` is pinned, ``bad`` (a broken
config.json) and ``gone`` (no such path) cannot load, and ``--models-mb`` leaves room for ``p`` and one more.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from harness.models.tiny import write_tiny_llama
from semantic.serve.fleet import footprint
from tests.serve_helpers import Server
from tests.waits import wait_for

SYSTEM = "You are a careful coding agent. " * 20  # 640 one-byte tokens: two whole 256-token blocks and a tail
POOL_MB = 8
MB = 1 << 20
LONG = 500  # tokens: a turn still running while the test does something else


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = SimpleNamespace(gone=root / "gone")
    for name, seed, layers in (("a", 1, 2), ("b", 2, 3), ("p", 3, 1), ("bad", 4, 1), ("broken", 5, 1)):
        setattr(out, name, write_tiny_llama(root / name, seed=seed, layers=layers))
    for broken in (out.bad, out.broken):
        (broken / "config.json").write_text("{not json")
    return out


def _footprint(model_dir: Path) -> footprint.Footprint:
    """A model's bytes as the server estimates them before a load (weights, pool, working memory, tokenizer)."""
    return footprint.footprint(model_dir, POOL_MB * MB)


def _models_args(d, budget_mb: int | None = None) -> list[str]:
    """``a`` and ``b``; no prompt-lookup drafts, so a long turn takes its length in steps (a tiny random model
    repeats itself, and drafts would end it in a few)."""
    args = ["--model", f"a={d.a}", "--model", f"b={d.b}", "--pool-mb", str(POOL_MB), "--no-speculation"]
    return args + (["--models-mb", str(budget_mb)] if budget_mb else [])


@pytest.fixture(scope="module")
def fleet(dirs, tmp_path_factory):
    """The shared server: room for the pinned ``p`` and one of ``a`` and ``b``, never both."""
    sizes = [_footprint(m) for m in (dirs.a, dirs.b, dirs.p)]
    a, b, p = (s.loaded for s in sizes)
    fixed = footprint.RUNTIME_BYTES + sum(s.tokenizer for s in sizes)  # the runtime, every tokenizer a load keeps
    budget_mb = math.ceil((fixed + p + max(a, b)) / MB) + 1
    assert fixed + a + b + p > budget_mb * MB, "the budget must hold only one of a and b beside p"
    args = _models_args(dirs, budget_mb) + [
        "--model", f"p={dirs.p}", "--model", f"bad={dirs.bad}", "--model", f"gone={dirs.gone}",
        "--model", f"broken={dirs.broken}", "--pin", "p",
        "--alias", "claude-*haiku*=b", "--alias", "claude-*=a"]
    s = Server(None, tmp_path_factory.mktemp("fleet") / "agents", args).start()
    s.budget_bytes = budget_mb * MB
    yield s
    assert s.stop_cleanly(), s.log()


def _oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _an(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)


def _chat(server, model: str, messages, agent: str | None = None, **kw):
    return _oa(server).chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                               prompt_cache_key=agent, **kw)


def _ask(server, model: str, text: str = "List the files."):
    """A greedy reply to one fixed prompt: what ``model`` says to it."""
    return _chat(server, model, [{"role": "user", "content": text}])


def _stats(server, model: str | None = None) -> dict:
    return httpx.get(server.url + "/v1/cache/stats", params={"model": model} if model else None, timeout=10).json()


def _rows(server) -> dict[str, dict]:
    return {r["id"]: r for r in _stats(server)["models"]}


def _metric(server, name: str, **labels: str) -> float | None:
    """The value of the ``/metrics`` sample ``name`` whose labels include ``labels`` (None: no such sample)."""
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = re.fullmatch(rf'{name}(?:\{{(.*)\}})? (\S+)', line)
        if m and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).items():
            return float(m.group(2))
    return None


def _loaded(server) -> set[str]:
    return {i for i, r in _rows(server).items() if r["state"] == "loaded"}


# ---------------------------------------------------------------- names


def test_a_claude_name_is_answered_by_its_aliased_model_and_the_reply_names_the_served_id(fleet):
    by_id = {m: _ask(fleet, m) for m in ("a", "b")}
    assert by_id["a"].model == "a" and by_id["b"].model == "b"
    assert by_id["a"].choices[0].message.content != by_id["b"].choices[0].message.content  # two different models
    for name, served in (("claude-3-5-haiku-20241022", "b"), ("claude-haiku-4-5-20251001", "b"),
                         ("claude-sonnet-4-5-20250929", "a"), ("claude-opus-4-1", "a")):
        reply = _ask(fleet, name)
        assert reply.model == served and reply.choices[0].message.content == by_id[served].choices[0].message.content
    message = _an(fleet).messages.create(model="claude-3-5-haiku-20241022", max_tokens=8,
                                         messages=[{"role": "user", "content": "List the files."}])
    assert message.model == "b"
    assert _oa(fleet).models.retrieve("claude-opus-4-1").id == "a"
    unnamed = httpx.post(fleet.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "List the files."}], "max_tokens": 8, "temperature": 0})
    assert unnamed.json()["model"] == "a"  # no model: the first declared
    listed = {m.id: m for m in _oa(fleet).models.list().data}
    assert list(listed) == ["a", "b", "p", "bad", "gone", "broken"]
    assert [listed[m].model_extra["aliases"] for m in ("a", "b", "p")] == [["claude-*"], ["claude-*haiku*"], []]


def test_an_unknown_model_is_404_model_not_found_listing_the_served_ids(fleet):
    with pytest.raises(openai.NotFoundError) as e:
        _ask(fleet, "gpt-4o")
    assert e.value.code == "model_not_found" and "'a', 'b', 'p', 'bad', 'gone'" in e.value.message
    assert "claude-*haiku*→b" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        _an(fleet).messages.create(model="Claude-3-Opus", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "'a', 'b', 'p'" in e.value.body["error"]["message"]
    assert httpx.get(fleet.url + "/v1/cache/stats", params={"model": "gpt-4o"}).status_code == 404


# ---------------------------------------------------------------- loading and unloading


def test_a_model_loads_on_demand_while_another_models_stream_is_in_flight(fleet):
    _ask(fleet, "a")  # b is not loaded: a and b never fit together
    assert "b" not in _loaded(fleet)
    loads = _rows(fleet)["b"]["loads"]
    stream = _oa(fleet).chat.completions.create(model="p", messages=[{"role": "user", "content": "Talk."}],
                                                max_tokens=4 * LONG, temperature=0, stream=True)
    try:
        next(iter(stream))  # p's turn is running
        reply = _ask(fleet, "b")
        p_running = _stats(fleet, "p")["requests"]["in_flight"]
    finally:
        stream.close()
    assert reply.model == "b" and _rows(fleet)["b"]["loads"] == loads + 1
    assert p_running == 1, "p's stream ended before b loaded and answered"


def test_lru_unloads_the_least_recently_used_model_and_never_the_pinned_one(fleet):
    before = {m: _metric(fleet, "semantic_model_unloads_total", model=m, reason="lru") for m in ("a", "b", "p")}
    for model, unloaded in (("a", "b"), ("b", "a"), ("a", "b")):
        _ask(fleet, model)
        stats = _stats(fleet, unloaded)
        assert {"state": stats["state"], "model": stats["model"]} == {"state": "unloaded", "model": unloaded}
        assert "requests" not in stats  # an unloaded model has its name and state only
        assert _loaded(fleet) == {"p", model}
        assert stats["fleet"]["resident_bytes"] <= stats["fleet"]["budget_bytes"] == fleet.budget_bytes
    after = {m: _metric(fleet, "semantic_model_unloads_total", model=m, reason="lru") for m in ("a", "b", "p")}
    assert after["a"] >= before["a"] + 1 and after["b"] >= before["b"] + 1 and after["p"] == 0
    rows = _rows(fleet)
    assert rows["p"]["unloads"] == {} and rows["p"]["loads"] == 1 and rows["p"]["pinned"]
    assert rows["b"]["memory_bytes"] == 0 and rows["a"]["memory_bytes"] > POOL_MB * MB
    assert _metric(fleet, "semantic_models_budget_bytes") == fleet.budget_bytes


def test_an_agents_cache_comes_back_from_disk_when_its_model_reloads(fleet):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    first = _chat(fleet, "a", history, agent="roamer")
    _ask(fleet, "b")  # a is unloaded for room: its service closes, writing the agent's cache
    assert _rows(fleet)["a"]["state"] == "unloaded"
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now open the first one."}]
    second = _chat(fleet, "a", history, agent="roamer")
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the whole first turn, its reply included (the echoed reply is the ids it generated)
    assert first.usage.prompt_tokens + first.usage.completion_tokens - 1 <= cached < second.usage.prompt_tokens
    fresh = _chat(fleet, "a", history, extra_body={"cache_salt": uuid.uuid4().hex})  # no block under this salt
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == fresh.choices[0].message.content


def test_a_model_that_cannot_load_answers_503_and_the_others_still_serve(fleet):
    for name, why in (("bad", "config.json is not JSON"), ("gone", "no model directory at")):
        with pytest.raises(openai.APIStatusError) as e:
            _ask(fleet, name)
        assert e.value.status_code == 503 and e.value.code == "model_load_failed" and why in e.value.message
        assert _ask(fleet, "a").model == "a" and _ask(fleet, "p").model == "p"
    with pytest.raises(anthropic.APIStatusError) as e:
        _an(fleet).messages.create(model="bad", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503 and "'bad' failed to load" in e.value.body["error"]["message"]
    rows = _rows(fleet)
    assert rows["bad"]["state"] == rows["gone"]["state"] == "failed" and "is not JSON" in rows["bad"]["error"]
    assert rows["bad"]["memory_bytes"] == 0 and _stats(fleet)["fleet"]["load_failures"] >= 2


def test_a_model_that_cannot_load_unloads_no_healthy_model_for_its_room(fleet):
    _ask(fleet, "a")
    unloads = _rows(fleet)["a"]["unloads"]
    with pytest.raises(openai.APIStatusError):
        _ask(fleet, "broken")  # its first try: "bad" failed already, and is answered so for RETRY_FAILED_S
    assert _rows(fleet)["a"]["unloads"] == unloads and "a" in _loaded(fleet)


def test_metrics_carry_a_series_per_model(fleet):
    for model in ("a", "b"):
        _ask(fleet, model)
    for model in ("a", "b"):
        assert _metric(fleet, "semantic_prompt_tokens_total", api="chat", model=model) > 0
        assert _metric(fleet, "semantic_model_loads_total", model=model) >= 1
    assert _metric(fleet, "semantic_model_loaded", model="p") == 1.0
    assert _metric(fleet, "semantic_model_loaded", model="a") == 0.0  # b took its room
    assert _metric(fleet, "semantic_model_loaded", model="bad") == 0.0
    assert _metric(fleet, "semantic_pool_capacity_bytes", model="b") > 0  # a loaded model's own gauges
    assert _metric(fleet, "semantic_pool_capacity_bytes", model="a") is None
    assert _metric(fleet, "semantic_model_memory_bytes", model="p") == _rows(fleet)["p"]["memory_bytes"]


# ---------------------------------------------------------------- idle models, shutdown


def test_an_idle_model_is_unloaded_after_its_ttl_and_a_pinned_one_stays(dirs, tmp_path):
    s = Server(None, tmp_path / "agents", _models_args(dirs) + ["--pin", "b", "--idle-ttl", "1"]).start()
    try:
        assert _ask(s, "a").model == "a"
        wait_for(lambda: _rows(s)["a"]["state"] == "unloaded", lambda: _rows(s), timeout_s=60)
        rows = _rows(s)
        assert rows["a"]["unloads"] == {"idle": 1} and rows["b"]["state"] == "loaded" and rows["b"]["unloads"] == {}
        assert _metric(s, "semantic_model_unloads_total", model="a", reason="idle") == 1.0
        assert _ask(s, "a").model == "a" and _rows(s)["a"]["loads"] == 2  # and it loads again when asked
    finally:
        assert s.stop_cleanly(), s.log()


def _stream(server, model: str, agent: str, messages, started: threading.Event, out: dict) -> None:
    """One agent's long streamed turn, read to its end into ``out[agent]``; ``started`` once its first chunk came."""
    chunks = out[agent] = []
    try:
        for chunk in _oa(server).chat.completions.create(
                model=model, messages=messages, max_tokens=LONG, temperature=0, stream=True,
                prompt_cache_key=agent, stream_options={"include_usage": True}):
            chunks.append(chunk)
            started.set()
    finally:
        started.set()


def _turns_in_flight(server, agents: dict[str, str], history: dict) -> tuple[dict, list[threading.Thread]]:
    """Each agent's long streamed turn on its model, running once this returns."""
    out, started = {}, {agent: threading.Event() for agent in agents}
    threads = [threading.Thread(target=_stream, args=(server, model, agent, history[agent], started[agent], out))
               for agent, model in agents.items()]
    for t in threads:
        t.start()
    for agent in agents:
        assert started[agent].wait(60), server.log()
    return out, threads


def test_sigterm_drains_every_model_and_both_models_saves_are_on_disk(dirs, tmp_path):
    agents = {"agent-on-a": "a", "agent-on-b": "b"}
    cache, args = tmp_path / "agents", _models_args(dirs) + ["--graceful-timeout", "60"]
    s = Server(None, cache, args).start()
    for model in agents.values():
        _ask(s, model)  # both loaded before the turns start
    history = {agent: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"I am {agent}."}]
               for agent in agents}
    out, threads = _turns_in_flight(s, agents, history)
    s.proc.send_signal(signal.SIGTERM)
    read = {agent: len(out[agent]) for agent in agents}  # their answers were still being sent
    for t in threads:
        t.join(120)
    assert all(n < LONG for n in read.values()), read
    assert s.proc.wait(60) in (0, -signal.SIGTERM) and "Application shutdown complete" in s.log(), s.log()
    before = {}
    for agent in agents:
        usage = out[agent][-1].usage
        assert usage.completion_tokens == LONG, (agent, usage)
        before[agent] = usage.prompt_tokens + usage.completion_tokens
        text = "".join(c.choices[0].delta.content or "" for c in out[agent] if c.choices)
        history[agent] += [{"role": "assistant", "content": text}, {"role": "user", "content": "continue"}]
    assert len([d for d in cache.iterdir() if d.is_dir() and d.name != "responses"]) == 2  # a folder per model
    again = Server(None, cache, args).start()
    try:
        for agent, model in agents.items():
            reply = _chat(again, model, history[agent], agent=agent)
            assert reply.usage.prompt_tokens_details.cached_tokens >= before[agent] - 1, agent
    finally:
        assert again.stop_cleanly(), again.log()
