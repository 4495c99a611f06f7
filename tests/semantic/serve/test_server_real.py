"""``semantic serve`` on the real SmolLM2-135M-Instruct: one test per API, through the official SDKs.

A cached turn must answer exactly as a fresh prefill of the same history:
the same greedy text from a server that holds the agent's cache and from the
same server asked with a salt that no cached block carries.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from semantic.service import Service, TurnRequest
from tests.cache_helpers import reference
from tests.serve_helpers import Server

pytestmark = pytest.mark.integration

SYSTEM = ("You are a coding agent working in a Python repository. You read files, run tests and "
          "propose small patches. Answer briefly. ") * 6


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    s = Server(smollm2_dir, tmp_path_factory.mktemp("serve-real") / "agents", model_id="smollm2").start(timeout=300)
    yield s
    assert s.stop_cleanly(), s.log()


def test_openai_agent_turn_two_is_cached_and_equals_a_fresh_prefill(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does `git status` show?"}]
    first = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0,
                                           prompt_cache_key="real-agent")
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And `git diff`?"}]
    cached = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0,
                                            prompt_cache_key="real-agent", stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(cached)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 8
    fresh = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24, temperature=0,
                                           extra_body={"cache_salt": "nothing-cached-under-this"})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert text == fresh.choices[0].message.content


def test_anthropic_agent_turn_two_reads_the_cache(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    kw = dict(model="smollm2", max_tokens=24, system=SYSTEM, metadata={"user_id": "claude-code-session"})
    msgs = [{"role": "user", "content": "Which file holds the tests?"}]
    first = client.messages.create(messages=msgs, **kw)
    msgs += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Run them."}]
    with client.messages.stream(messages=msgs, **kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens >= first.usage.input_tokens - 8
    assert text == final.content[0].text and text


CODE = '''def load(path):
    with open(path) as f:
        rows = [line.strip().split(",") for line in f]
    return [row for row in rows if row and row[0]]


def save(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(",".join(row) + "\\n")
'''
EDIT = [{"role": "system", "content": "Reply with the complete edited code and nothing else."},
        {"role": "user", "content": f"```python\n{CODE}```\n\nRename `rows` to `records` and reply with the whole code."}]


@pytest.fixture(scope="module")
def plain_server(smollm2_dir, tmp_path_factory):
    s = Server(smollm2_dir, tmp_path_factory.mktemp("serve-plain") / "agents", model_id="smollm2",
               args=["--no-speculation"]).start(timeout=300)
    yield s
    assert s.stop_cleanly(), s.log()


def _reference(model_dir, tmp_path, messages, n):
    """mlx-lm's generate_step on the ids a server renders ``messages`` to (an in-process Service over the same
    model renders them), with its noise measured here; and each reference token's text, as a reply lists it."""
    service = Service.open(str(model_dir), cache_dir=str(tmp_path / "ref"), pool_bytes=64 << 20,
                           disk_budget_bytes=1 << 30)
    try:
        ids = service.prepare(TurnRequest(messages=messages, max_tokens=n)).request.ids
        executor = service.scheduler.executor
        ref = reference(executor.model, ids, n, spec=executor.spec, real=True)
        return ref, [service.tokenizer.decode([t]) for t in ref.tokens]
    finally:
        service.close(60)


def _check(ref, want, pieces, logprobs, what):
    """A reply's tokens (by their text) and logprobs against the reference (its noise measured here)."""
    assert len(pieces) == len(want), what
    ref.check([t if p == w else -1 for t, p, w in zip(ref.tokens, pieces, want)], logprobs, what)


def test_a_reply_that_copies_its_context_is_the_same_with_speculation_streamed_and_not(server, plain_server,
                                                                                       smollm2_dir, tmp_path):
    def ask(s, stream):
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model="smollm2", messages=EDIT, max_tokens=64, temperature=0, logprobs=True)
        if not stream:
            r = client.chat.completions.create(**kw)
            content = r.choices[0].logprobs.content
            return r.choices[0].message.content, [t.logprob for t in content], [t.token for t in content]
        text, content = "", []
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                content += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
        return text, [t.logprob for t in content], [t.token for t in content]

    plain_text, plain_lps, plain_pieces = ask(plain_server, stream=False)
    ref, pieces = _reference(smollm2_dir, tmp_path, EDIT, len(plain_lps))
    _check(ref, pieces, plain_pieces, plain_lps, "without speculation")
    before = httpx.get(server.url + "/v1/cache/stats").json()["speculation"]["accepted"]
    for stream in (False, True):
        text, lps, got = ask(server, stream)
        assert text == plain_text
        _check(ref, pieces, got, lps, f"speculating, {'streamed' if stream else 'whole'}")
    spec = httpx.get(server.url + "/v1/cache/stats").json()["speculation"]
    assert spec["accepted"] - before > 20  # the reply copies the code: most of it came in drafted runs
    assert httpx.get(plain_server.url + "/v1/cache/stats").json()["speculation"]["drafted"] == 0
