"""EXP-012's two-model session, the parts that need no Claude Code: counting a proxy log by model, the
alias rule as the client sees it, the checks, the readable log, and the reply's model recorded by the proxy."""

from __future__ import annotations

import anthropic
import pytest

from harness.servers.processes import free_port
from harness.trials.claude_code import two_models as K
from harness.trials.claude_code import session as cc
from harness.trials.claude_code.model_routes import count_by_model, expected_model, literal_chars
from harness.trials.claude_code.proxy import LoggingProxy, last_user_text
from tests.harness.trials.claude_code.test_trial import stub_server  # noqa: F401  (the fixture)

IDS = ["main", "small"]
ALIASES = {"claude-*haiku*": "small", "claude-*": "main", "gpt-*": "main"}


def _row(index, sent, served, session, status=200, tools=12, prompt=12000, cached=0):
    return {"index": index, "model": sent, "served_model": served if status < 400 else None, "status": status,
            "tools": tools, "prompt_tokens": prompt, "cached_tokens": cached, "session": session}


def test_the_most_literal_glob_wins_then_declaration_order_and_exact_names_first():
    assert literal_chars("claude-*haiku*") == 12 and literal_chars("claude-*") == 7
    assert expected_model("claude-haiku-5-5", IDS, ALIASES) == "small"
    assert expected_model("claude-3-5-haiku-20241022", IDS, ALIASES) == "small"
    assert expected_model("claude-opus-5-5", IDS, ALIASES) == "main"
    assert expected_model("gpt-4o", IDS, ALIASES) == "main"
    assert expected_model("small", IDS, ALIASES) == "small"          # an id is itself
    assert expected_model(None, IDS, ALIASES) == "main"              # no model: the first id
    assert expected_model("llama", IDS, ALIASES) is None             # nothing matches: a 404 is right
    assert expected_model("claude-haiku", IDS, {**ALIASES, "claude-haiku": "main"}) == "main"  # exact first
    assert expected_model("ab", ["m"], {"a*": "x", "*b": "y"}) == "x"  # equally specific: the first declared


def test_count_by_model_counts_sent_names_answering_models_refusals_and_cache_reads_per_model():
    rows = [_row(0, "claude-opus-5-5", "main", "probe-main"),
            _row(1, "claude-haiku-5-5", "small", "probe-small", tools=2, prompt=1300),
            _row(2, "claude-opus-5-5", "main", "main", cached=11000),
            _row(3, "claude-opus-5-5", "main", "main", prompt=12200, cached=12100),
            _row(4, "claude-haiku-5-5", "small", "small", tools=2, prompt=1300, cached=1200),
            _row(5, "claude-haiku-5-5", "small", "small", tools=2, prompt=1400, cached=1390),
            _row(6, "claude-haiku-5-5", "small", "small", tools=0, prompt=200, cached=0),   # a helper
            _row(7, "claude-opus-5-5", None, "main", status=400)]
    c = count_by_model(rows, IDS, ALIASES)
    assert c["sent"] == {"claude-opus-5-5": 4, "claude-haiku-5-5": 4}
    assert c["served"] == {"main": 3, "small": 4}
    assert c["routes"] == {"claude-opus-5-5 -> main": 3, "claude-haiku-5-5 -> small": 4}
    assert (c["refused"], c["refused_by_sent"], c["misrouted"]) == (1, {"claude-opus-5-5": 1}, 0)
    main, small = c["per_model"]["main"], c["per_model"]["small"]
    assert (main["requests"], main["turns"], main["helpers"]) == (3, 3, 0)
    assert main["sessions"] == {"probe-main": 1, "main": 2}
    assert (main["cached_tokens"], main["requests_with_cache_reads"]) == (23100, 2)
    assert main["cached_ratio_min_after_first"] == pytest.approx(round(12100 / 12200, 4))  # each session's first out
    assert (small["requests"], small["turns"], small["helpers"]) == (4, 3, 1)
    assert small["cached_ratio_min_after_first"] == 0.0  # the helper read nothing


def test_a_request_answered_by_another_model_than_its_alias_names_is_misrouted():
    rows = [_row(0, "claude-haiku-5-5", "main", "small"), _row(1, "claude-opus-5-5", "main", "main")]
    c = count_by_model(rows, IDS, ALIASES)
    assert (c["misrouted"], c["misrouted_rows"]) == (1, [0])
    assert K.checks_of(c, {"ANTHROPIC_BASE_URL": "x"})["misrouted"] == 1


def test_the_sessions_environment_holds_no_model_variable_unless_a_model_is_named(tmp_path):
    bare = cc.session_env("http://127.0.0.1:1", None, tmp_path, {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128"})
    assert not set(bare) & set(cc.MODEL_VARIABLES)
    assert bare["ANTHROPIC_AUTH_TOKEN"] and bare["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1"
    named = cc.session_env("http://127.0.0.1:1", "gemma3-270m", tmp_path)
    c = K.checks_of(count_by_model([], IDS, ALIASES), named)
    assert c["model_variables_set"] == 2 and c["requests_main"] == 0
    assert cc.command(cc.Install(tmp_path / "claude", "x", None, False), "hi", 3, False,
                      args=("--resume", "s1"))[-2:] == ["--resume", "s1"]


def test_interleave_takes_the_sessions_steps_in_turn_main_first():
    assert K.interleave(["m1", "m2", "m3"], ["s1", "s2"]) == [("main", "m1"), ("small", "s1"), ("main", "m2"),
                                                              ("small", "s2"), ("main", "m3")]


def test_the_readable_log_names_what_was_sent_what_answered_and_what_was_asked():
    rows = [{**_row(0, "claude-haiku-5-5", "small", "small", cached=5), "step": 1, "ttft_s": 0.5,
             "stop_reason": "end_turn", "asked": "What does greet.py print?", "reply": "It prints Hello, world.",
             "error": None}]
    text = K.proxy_log_text(rows, {"aliases": ALIASES})
    assert "claude-haiku-5-5 -> small" in text and "turn" in text
    assert "asked: What does greet.py print?" in text and "answer: It prints Hello, world." in text


def test_last_user_text_skips_claude_codes_reminders_and_tool_results():
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "<system-reminder>the date</system-reminder>"},
                                             {"type": "tool_result", "tool_use_id": "t", "content": "x"},
                                             {"type": "text", "text": "Run greet.py"}]}]
    assert last_user_text(messages) == "Run greet.py"
    assert last_user_text([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]) is None
    assert last_user_text([]) is None


def test_the_proxy_records_the_replys_model_and_text_streamed_or_not(stub_server):  # noqa: F811
    with LoggingProxy(stub_server, port=free_port()) as proxy:
        client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
        with client.messages.stream(model="stub-model", max_tokens=8,
                                    messages=[{"role": "user", "content": "hi there"}]) as stream:
            "".join(stream.text_stream)
        client.messages.create(model="stub-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    streamed, whole = proxy.exchanges
    assert (streamed.served_model, streamed.reply, streamed.asked) == ("stub-model", "Hello world", "hi there")
    assert (whole.served_model, whole.reply, whole.asked) == ("stub-model", "Hello world", "x")


def test_our_target_starts_several_models_with_their_aliases_when_given_them(tmp_path):
    from pathlib import Path

    from harness.servers import targets as t

    ours = t.TARGETS["semantic"]
    launch = t.Launch(python=Path("/v/bin/python"), model_dir=Path("/m/gemma"), model_id="main", port=8123,
                      workdir=tmp_path, settings=ours.settings(models={"main": "/m/gemma", "small": "/m/smol"},
                                                               aliases=ALIASES))
    cmd = ours.command(launch)
    assert cmd[3:15] == ["--model", "main=/m/gemma", "--model", "small=/m/smol", "--alias", "claude-*haiku*=small",
                         "--alias", "claude-*=main", "--alias", "gpt-*=main", "--host", "127.0.0.1"]
    assert "--model-id" not in cmd
