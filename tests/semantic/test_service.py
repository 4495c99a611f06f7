"""The engine's façade for the server (``semantic.service``) over a real tiny model directory.

What it adds to the scheduler: one tokenization per request, one fitting of
the output budget to the context and the pool, tenant-namespaced agents and
salts, and the stats the dashboard reads.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from harness.models.tiny import write_tiny_llama
from semantic import ContextLengthError, InvalidRequestError
from semantic.cache import room
from semantic.cache.blockclaim import salt_root_of
from semantic.service import ANON, Service, TurnRequest, fit_max_tokens

pytestmark = pytest.mark.compat


def _prepare(service, **kw):
    """The turn's Request (the tools' reading beside it, tested elsewhere)."""
    return service.prepare(TurnRequest(**kw)).request


@pytest.fixture
def service(tmp_path):
    s = Service.open(str(write_tiny_llama(tmp_path / "model")), cache_dir=str(tmp_path / "agents"),
                     pool_bytes=1 << 20, disk_budget_bytes=1 << 30, block_tokens=16, max_context=512)
    yield s
    s.close(30)


def test_a_budget_is_cut_to_what_the_context_leaves_and_a_prompt_with_no_room_is_refused():
    assert fit_max_tokens(10, None, context_length=512) == 256  # the server's default
    assert fit_max_tokens(400, None, context_length=512) == 112  # what the context leaves
    assert fit_max_tokens(400, 112, context_length=512) == 112
    assert fit_max_tokens(400, 32000, context_length=512) == 112  # Claude Code's 32000, cut
    assert fit_max_tokens(511, 32000, context_length=512) == 1
    with pytest.raises(ContextLengthError, match="512 in the prompt, 1 for the completion"):
        fit_max_tokens(512, 32000, context_length=512)  # not even one token fits
    with pytest.raises(ContextLengthError, match="512 in the prompt, 1 for the completion"):
        fit_max_tokens(512, None, context_length=512)
    assert fit_max_tokens(100, None, context_length=512, pool_tokens=150) == 50
    assert fit_max_tokens(100, 400, context_length=512, pool_tokens=150) == 50
    assert fit_max_tokens(100, None, context_length=4096, default=None) == 3996  # open-ended: all that is left


def test_a_strict_budget_past_the_context_or_the_pool_is_refused_as_the_hosted_apis_do():
    assert fit_max_tokens(400, 112, context_length=512, strict=True) == 112
    assert fit_max_tokens(400, None, context_length=512, strict=True) == 112  # none asked: still the default, cut
    with pytest.raises(ContextLengthError, match="maximum context length is 512 tokens.*513 tokens"):
        fit_max_tokens(400, 113, context_length=512, strict=True)
    with pytest.raises(ContextLengthError, match="--pool-mb"):
        fit_max_tokens(100, 51, context_length=512, pool_tokens=150, strict=True)


def test_prepare_tokenizes_once_and_fits_the_budget_to_context_and_pool(service, monkeypatch):
    from semantic import service as service_module

    calls = []
    real = service_module.render_text
    monkeypatch.setattr(service_module, "render_text", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    req = _prepare(service, messages=[{"role": "user", "content": "x" * 300}])
    assert len(calls) == 1  # one render, even though the default budget had to be cut
    assert len(req.ids) + req.max_tokens == service.context_length
    assert service.pool_tokens == room.longest_cache(service.store.spec, service.store.capacity, 16)
    assert room.cache_bytes(service.store.spec, service.pool_tokens, 16) <= service.store.capacity
    assert _prepare(service, prompt=list(range(1, 200)), max_tokens=400).max_tokens == 512 - 199
    service.strict_max_tokens = True
    with pytest.raises(ContextLengthError):
        _prepare(service, prompt=list(range(1, 200)), max_tokens=400)


def test_named_agents_live_under_their_tenant_and_anonymous_ones_are_never_kept(service):
    a = _prepare(service, prompt="hello", agent="bot", tenant="t1", max_tokens=2)
    b = _prepare(service, prompt="hello", agent="bot", tenant="t2", max_tokens=2)
    anon = _prepare(service, prompt="hello", max_tokens=2)
    public = _prepare(service, prompt="hello", agent="bot", max_tokens=2)
    assert (a.agent_id, a.persist, b.agent_id, public.agent_id) == ("t1/bot", True, "t2/bot", "public/bot")
    assert anon.agent_id.startswith(ANON) and not anon.persist
    assert a.salt_root == salt_root_of("t1\0None") != b.salt_root and public.salt_root is None
    assert _prepare(service, prompt="hi", cache_salt="s", max_tokens=1).salt_root == salt_root_of("\0s")


def test_bad_prompts_are_refused_before_anything_is_queued(service):
    for kw in ({"prompt": ""}, {"prompt": [1, True]}, {"messages": [{"role": "user"}]}, {"prompt": "x", "agent": "a\0b"}):
        with pytest.raises(InvalidRequestError):
            _prepare(service, **kw)
    assert service.stats().scheduler.submitted == 0


def test_a_turn_through_the_facade_is_listed_with_its_cached_tokens(service):
    first = service.submit(_prepare(service, prompt=list(range(1, 40)), agent="a", max_tokens=3)).result(60)
    assert service.wait_saved(first.agent_id, 60)
    again = service.submit(_prepare(service, prompt=list(range(1, 40)) + first.token_ids + [5], agent="a",
                                           max_tokens=2)).result(60)
    n = len(first.token_ids)
    # the prompt and the reply, all but the reply's last token (never fed) and the new token
    assert again.cached_tokens == 39 + n - 1 and again.reuse == "own"
    (info,) = service.agents("")
    assert (info.agent_id, info.cached_tokens, info.resident) == ("public/a", 39 + n + 1 + len(again.token_ids) - 1, True)
    assert service.agents("other") == []
    stats = service.stats()
    assert stats.scheduler.completed == 2 and stats.store.disk_agents == 1 and stats.pool.capacity_bytes == service.store.capacity


def test_tool_choice_none_keeps_the_generic_tools_note_so_the_prompt_and_its_cache_stay_the_same(service):
    from semantic.service import Tools

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": "Weather?"}]
    auto = service.prepare(TurnRequest(messages=ask, tools=Tools((weather,), "auto")))
    none = service.prepare(TurnRequest(messages=ask, tools=Tools((weather,), "none")))
    assert auto.request.ids == none.request.ids and "get_weather" in none.prompt_text
    assert none.request.grammar.source == "answer grammar" and not none.tools.reads_calls


def test_the_final_chunk_is_sent_before_the_cache_is_extracted_and_the_next_turn_still_reuses_it(service, monkeypatch):
    from semantic.cache import convert
    from semantic.serve.turn.backend import Backend
    from semantic.serve.stream.items import Final
    from semantic.serve.turn.apirequest import ApiRequest

    backend = Backend(service, model_id="tiny")
    gate, extracted = threading.Event(), threading.Event()
    extract = convert.extract

    def held_extract(*a, **k):
        assert gate.wait(30), "the test never let the extract go on"
        try:
            return extract(*a, **k)
        finally:
            extracted.set()

    monkeypatch.setattr(convert, "extract", held_extract)
    ids = list(range(1, 40))

    async def turns():
        first = await backend.prepare(ApiRequest(max_tokens=3, prompt=ids, agent="a"))
        items = [item async for item in backend.stream(first)]
        final = items[-1]
        assert isinstance(final, Final) and not extracted.is_set()  # the cache is kept after the answer
        n = final.completion_tokens
        follow = await backend.prepare(ApiRequest(max_tokens=2, prompt=ids + list(final.result.token_ids) + [5],
                                                       agent="a"))
        second = asyncio.ensure_future(_final_of(backend.stream(follow)))
        await asyncio.sleep(0.05)
        assert not second.done() and service.knows_agent("", "a")  # it waits for the cache it continues
        gate.set()
        return n, await asyncio.wait_for(second, 60)

    n, again = asyncio.run(turns())
    assert again.cached_tokens == len(ids) + n - 1 and again.result.reuse == "own"  # the reply's last token is never fed


async def _final_of(stream):
    items = [item async for item in stream]
    return items[-1]
