"""EXP-012's parts that need no Claude Code: the logging proxy on a real loopback server, the checks, the repo."""

from __future__ import annotations

import subprocess
import threading
import time

import anthropic
import pytest

from harness.servers.processes import free_port
from harness.trials.claude_code import trial as K
from harness.trials.claude_code import session as cc
from harness.trials.claude_code.proxy import LoggingProxy
from semantic.serve.app import create_app
from semantic.serve.config import ServeConfig
from tests.serve_stub import StubBackend


@pytest.fixture
def stub_server():
    """The HTTP layer over the scripted backend, served by uvicorn on 127.0.0.1 (the proxy's upstream)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(StubBackend(context_length=64), ServeConfig(model="stub")),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_the_proxy_relays_streams_unchanged_and_records_usage_ttft_stop_reason_and_the_clamp(stub_server, tmp_path):
    with LoggingProxy(stub_server, port=free_port(), bodies_dir=tmp_path / "bodies") as proxy:
        client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
        with client.messages.stream(model="stub-model", max_tokens=32000, metadata={"user_id": "a1"},
                                    messages=[{"role": "user", "content": "hi there"}]) as stream:
            text = "".join(stream.text_stream)
        assert text == "Hello world"  # the SDK parsed the relayed events
        whole = client.messages.create(model="stub-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        assert whole.stop_reason == "end_turn"
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="stub-model", max_tokens=8, messages=[], extra_body={"bogus": 1})
    first, second, third = proxy.exchanges
    assert (first.status, first.stream, first.max_tokens, first.stop_reason) == (200, True, 32000, "end_turn")
    assert first.clamped_max_tokens == 60  # the stub's 64-token context, 4 prompt tokens
    assert first.cache_read_input_tokens == 3 and first.prompt_tokens == first.input_tokens + 3
    assert 0 < first.ttft_s <= first.wall_s
    assert second.ttft_s == second.wall_s and second.output_tokens == 3 and second.clamped_max_tokens is None
    assert third.status == 400 and "bogus" in third.error
    assert sorted(p.name for p in (tmp_path / "bodies").iterdir()) == ["request-000.json", "request-001.json",
                                                                       "request-002.json"]


def _row(server, step, prompt, cached, status=200, after=False, phase="session", wall=10.0, ttft=1.0,
         stop="max_tokens"):
    return {"server": server, "phase": phase, "step": step, "after_restart": after, "status": status,
            "prompt_tokens": prompt, "cached_tokens": cached, "step_wall_s": wall, "clamped_max_tokens": None,
            "ttft_s": ttft, "stop_reason": stop, "output_tokens": 128, "max_tokens": 128}


def test_session_checks_count_refusals_and_take_the_cached_share_after_each_sessions_first_request():
    rows = [_row("semantic", 1, 12000, 0, phase="probe"),
            _row("semantic", 1, 12000, 11000), _row("semantic", 2, 12300, 12100), _row("semantic", 3, 12400, 12300),
            _row("semantic", 4, 12500, 12450, after=True, wall=2.0),
            _row("vllm-mlx", 1, 12000, 0, status=400, phase="probe"),
            _row("vllm-mlx", 1, 12000, 0, wall=30.0, stop="end_turn"),
            _row("vllm-mlx", 2, 12300, 6000, wall=30.0, ttft=2.0),
            _row("vllm-mlx", 4, 12500, 0, after=True, wall=20.0, ttft=10.0)]
    c = K.session_checks(rows, ["semantic", "vllm-mlx"])
    assert c["probe_refused_semantic"] == 0 and c["probe_refused_vllm-mlx"] == 1 and c["refused_vllm-mlx"] == 1
    assert c["cached_ratio_min_semantic"] == pytest.approx(12100 / 12300)  # the session's very first excluded
    assert c["cached_ratio_min_after_restart_semantic"] == pytest.approx(12450 / 12500)
    assert c["cached_ratio_min_after_restart_vllm-mlx"] == 0.0
    assert c["session_wall_s_semantic"] == 30.0 and c["restart_wall_s_semantic"] == 2.0
    assert c["wall_ratio"] == pytest.approx(0.5) and c["wall_ratio_after_restart"] == pytest.approx(0.1)
    assert c["ttft_later_median_ratio"] == pytest.approx(0.5) and c["ttft_after_restart_ratio"] == pytest.approx(0.1)
    assert c["end_turn_at_budget_vllm-mlx"] == 1 and c["end_turn_at_budget_semantic"] == 0
    assert c["prompt_tokens_first_semantic"] == 12000


def test_vllm_mlxs_own_log_gives_each_accepted_requests_prompt_and_cached_tokens(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO:vllm_mlx.scheduler:[cache_fetch] request=37b312b6-b74 MISS prompt_tokens=4111 time=0.000s\n"
                   "noise\nINFO:vllm_mlx.scheduler:[cache_fetch] request=47c117af-f0f HIT prompt_tokens=4261 "
                   "cached=4112 remaining=149 time=0.000s\n")
    rows = [{"status": 200, "prompt_tokens": 0, "cached_tokens": None}, {"status": 400},
            {"status": 200, "prompt_tokens": 0, "cached_tokens": None}]
    out = K.with_logged_usage(rows, "vllm-mlx", log)
    assert [(r.get("prompt_tokens"), r.get("cached_tokens")) for r in out] == [(4111, 0), (None, None), (4261, 4112)]
    assert K.with_logged_usage([{"status": 200}], "vllm-mlx", log) == [{"status": 200}]  # counts differ: untouched


def test_the_scratch_repository_is_one_commit_made_once(tmp_path):
    repo = K.scratch_repo(tmp_path / "repo")
    assert (repo / "greet.py").read_text().startswith("def greeting")
    (repo / "greet.py").write_text("edited by the agent\n")
    assert K.scratch_repo(tmp_path / "repo") == repo and (repo / "greet.py").read_text() == "edited by the agent\n"
    log = subprocess.run(["git", "log", "--oneline"], cwd=repo, capture_output=True, text=True).stdout
    assert len(log.splitlines()) == 1


def test_without_node_the_client_is_missing_with_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(cc.shutil, "which", lambda tool: None if tool == "node" else "/usr/bin/" + tool)
    with pytest.raises(cc.ClientMissing, match="node is not installed"):
        cc.ensure(root=tmp_path)


def test_a_session_gets_only_the_variables_a_user_sets_for_a_local_server(tmp_path):
    env = cc.session_env("http://127.0.0.1:1", "gemma3-270m", tmp_path)
    assert {k for k in env if k.startswith(("ANTHROPIC", "CLAUDE"))} == {
        "ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"}
    assert env["HOME"] == str(tmp_path)  # never the user's own settings and history


def test_long_transcript_strings_are_cut_and_short_ones_kept():
    event = {"type": "user", "message": {"content": [{"type": "tool_result", "content": "x" * 5000}]}, "n": 3}
    cut = K._trim(event)
    assert cut["n"] == 3 and cut["message"]["content"][0]["content"].endswith("(5000 characters)")


def test_a_run_skipped_for_a_missing_client_is_a_skip_that_fails_nothing():
    from harness.cli import exit_code
    from harness.criteria import Criterion, verdict

    c = Criterion(name="no refusals", level="P0", value="checks.refused_semantic", op="==", threshold=0,
                  source="goals")
    got = verdict(c, {"outputs": {"skipped": "node is not installed"}, "checks": {}})
    assert got["verdict"] == "SKIP" and got["note"] == "node is not installed" and got["measured"] is None
    assert exit_code([{"verdict": "SKIP", "criteria": [got]}]) == 0
    assert exit_code([{"verdict": "FAIL", "criteria": [{**got, "verdict": "FAIL", "pass": False}]}]) == 1


def test_the_transcript_shows_each_step_and_what_the_model_and_the_tools_said():
    events = [{"type": "system", "subtype": "init", "tools": ["Bash"]},
              {"type": "assistant", "message": {"content": [{"type": "tool_use", "name": "Read",
                                                             "input": {"file_path": "/r/greet.py"}}]}},
              {"type": "user", "message": {"content": [{"type": "tool_result", "content": "def greeting(name):"}]}},
              {"type": "assistant", "message": {"content": [{"type": "text", "text": "It prints Hello, world."}]}},
              {"type": "result", "subtype": "success", "num_turns": 2, "stop_reason": "end_turn", "result": "done"}]
    text = K.transcript_text({"semantic": [{"step": 2, "prompt": "Read it.", "returncode": 0, "wall_s": 3.25,
                                            "events": events}]})
    assert "$ claude -p 'Read it.' --continue   # step 2: exit 0, 3.2 s" in text
    assert "tool call: Read {'file_path': '/r/greet.py'}" in text and "tool result: def greeting(name):" in text
    assert "assistant: It prints Hello, world." in text and "result: success, 2 turns, stop end_turn: done" in text
