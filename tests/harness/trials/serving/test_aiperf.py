"""harness.trials.serving.aiperf: the command line it hands AIPerf, AIPerf's environment, and its export summarized.

No server and no AIPerf run here: the export is one AIPerf 0.13.0 wrote (tests/data).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.servers import venvs
from harness.trials.serving import aiperf as ap

DATA = Path(__file__).resolve().parents[3] / "data"
MODEL = Path("/models/smollm2-f32")


def _cmd(profile: ap.Profile) -> list[str]:
    return ap.command(profile, aiperf="/p/bin/aiperf", url="http://127.0.0.1:8123", model="default_model",
                      tokenizer=MODEL, out_dir="/tmp/out")


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_command_streams_a_fixed_greedy_workload_counted_with_the_servers_tokenizer():
    cmd = _cmd(ap.Profile("random", 600, 64, concurrency=4, requests=8, warmup=1))
    assert cmd[:2] == ["/p/bin/aiperf", "profile"]
    assert _arg(cmd, "--tokenizer") == str(MODEL) and _arg(cmd, "--model") == "default_model"
    assert _arg(cmd, "--url") == "http://127.0.0.1:8123" and _arg(cmd, "--endpoint-type") == "chat"
    assert "--streaming" in cmd                         # without it AIPerf measures no TTFT or ITL
    assert "--use-legacy-max-tokens" in cmd             # vllm-mlx ignores max_completion_tokens
    assert (_arg(cmd, "--synthetic-input-tokens-mean"), _arg(cmd, "--synthetic-input-tokens-stddev")) == ("600", "0")
    assert (_arg(cmd, "--output-tokens-mean"), _arg(cmd, "--output-tokens-stddev")) == ("64", "0")
    assert (_arg(cmd, "--concurrency"), _arg(cmd, "--request-count")) == ("4", "8")
    assert _arg(cmd, "--num-dataset-entries") == "9"    # warmup + requests: no prompt is sent twice
    extra = json.loads(_arg(cmd, "--extra-inputs"))
    assert extra == {"temperature": 0, "stream_options": {"include_usage": True}}
    assert "--shared-system-prompt-length" not in cmd


def test_the_shared_profile_adds_one_system_prompt_to_every_request():
    shared = ap.PROFILES["shared"][0]
    assert shared.shared_system_tokens == 600
    assert _arg(_cmd(shared), "--shared-system-prompt-length") == "600"
    assert [p.label for p in ap.PROFILES["random"]] == ["random-c1", "random-c4"]


def test_every_profile_draws_its_own_prompts_so_none_finds_an_earlier_ones_cached():
    every = [p for group in ap.PROFILES.values() for p in group]
    assert len({p.seed for p in every}) == len(every)
    assert len({_arg(_cmd(p), "--random-seed") for p in every}) == len(every)


def test_a_profile_refuses_an_empty_workload():
    with pytest.raises(ValueError, match="requests must be >= 1"):
        ap.Profile("x", 600, 64, concurrency=1, requests=0)
    with pytest.raises(ValueError, match="concurrency"):
        ap.Profile("x", 600, 64, concurrency=0, requests=4)


def test_aiperf_loads_the_local_tokenizer_with_the_hub_out_of_reach():
    env = ap.aiperf_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/bin", "VIRTUAL_ENV": "/v"})
    # its offline mode rejects a directory as a repo id, so offline is off and the hub points nowhere
    assert "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env and "VIRTUAL_ENV" not in env
    assert env["HF_ENDPOINT"] == "http://127.0.0.1:9" and env["HF_DATASETS_OFFLINE"] == "1"
    assert env["PATH"] == "/bin"


def test_summary_of_a_captured_export_is_in_seconds_and_tokens():
    export = json.loads((DATA / "aiperf-0.13.0-profile-export.json").read_text())
    s = ap.summarize(export)
    assert (s.requests, s.errors) == (2, 0)
    assert s.ttft_p50_s == pytest.approx(0.963768008) and s.ttft_p99_s == pytest.approx(0.96527797142)
    assert s.itl_p50_s == pytest.approx(0.10319045643) and s.latency_p50_s == pytest.approx(7.464766763)
    assert s.chunk_gap_p99_s == pytest.approx(150.931567 * 1e-3)
    assert s.output_tok_s == pytest.approx(17.13007456727)
    assert (s.input_tokens_mean, s.output_tokens_mean, s.prompt_tokens_mean) == (633.0, 64.0, 646.0)
    assert s.cached_pct == pytest.approx(94.117647, rel=1e-6) and s.cached_max == 608.0


def test_errors_are_counted_and_missing_metrics_stay_none():
    s = ap.summarize({"request_count": {"avg": 3.0}, "error_summary": [
        {"error_details": {"code": 500, "type": "Internal Server Error"}, "count": 2},
        {"error_details": {"code": 408}, "count": 1}]})
    assert (s.requests, s.errors) == (3, 3)
    assert s.ttft_p50_s is None and s.cached_pct is None


def test_the_table_row_carries_the_figures_and_the_load_they_were_taken_at():
    export = json.loads((DATA / "aiperf-0.13.0-profile-export.json").read_text())
    run = ap.Run("mlx_lm.server", ap.PROFILES["shared"][0], ap.summarize(export), (2.54, 1.97, 1.52),
                 (3.18, 2.17, 1.6), aiperf_cpu_s=8.2, wall_s=18.0, export_dir="mlx_lm.server/shared-c4")
    head, rule, row = ap.markdown_table([run]).splitlines()
    assert head.count("|") == rule.count("|") == row.count("|")
    assert row == ("| shared-c4 | mlx_lm.server | 0.96 / 0.97 | 0.103 / 0.103 | 7.46 / 7.47 | 17.13 | 64.0 | 646 "
                   "| 94 | 8.2 | 2.54 → 3.18 |")


def test_aiperf_installs_once_into_its_own_venv_under_peers(tmp_path):
    calls = tmp_path / "pip-calls.txt"
    pip = [sys.executable, "-c", f"import sys; open({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')"]
    first = venvs.ensure_venv(ap.AIPERF, tmp_path, pip=pip)
    assert first.python == tmp_path / ".peers" / f"aiperf-{ap.VERSION}" / "bin" / "python"
    assert calls.read_text().splitlines() == [f"install aiperf=={ap.VERSION}"]
    assert not venvs.ensure_venv(ap.AIPERF, tmp_path, pip=pip).installed_now
    assert len(calls.read_text().splitlines()) == 1


def test_vllm_mlx_hits_come_from_its_log_with_aiperfs_warmup_left_out():
    log = ("INFO:vllm_mlx.scheduler:[cache_fetch] request=2b76a57c-bbf MISS prompt_tokens=646 time=0.000s entries=0\n"
           "INFO:vllm_mlx.scheduler:[cache_fetch] request=603d595b-0de HIT prompt_tokens=646 cached=608 remaining=38\n"
           "INFO:vllm_mlx.scheduler:[cache_fetch] request=c82b8212-6f2 HIT prompt_tokens=646 cached=512 remaining=134\n")
    parse = ap.TARGETS["vllm-mlx"].log_usage
    assert ap.log_cached_pct(log, parse, warmup=1) == pytest.approx(100 * (608 + 512) / (2 * 646))
    assert ap.log_cached_pct(log, parse, warmup=0) == pytest.approx(100 * (608 + 512) / (3 * 646))
    assert ap.log_cached_pct("", parse, warmup=1) is None


def test_the_messages_profile_drives_the_anthropic_api_without_openai_only_fields():
    cmd = _cmd(ap.PROFILES["messages"][0])
    assert _arg(cmd, "--endpoint-type") == "messages" and "--streaming" in cmd
    assert "--use-legacy-max-tokens" not in cmd
    assert json.loads(_arg(cmd, "--extra-inputs")) == {"temperature": 0}
    with pytest.raises(ValueError, match="endpoint"):
        ap.Profile("x", 600, 64, concurrency=1, requests=1, endpoint="completions")
