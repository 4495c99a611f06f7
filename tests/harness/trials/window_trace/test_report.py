"""EXP-021's pure parts without a server: the trace's messages, the paired ratios and checks from recorded
rows, and that every criterion of the TOML names a check the kind writes."""

from __future__ import annotations

from harness.config import load
from harness.criteria import resolve
from harness.trials.window_trace.report import checks, paired_ratios
from harness.trials.window_trace.trace import system_prompt, tool_output
from semantic.cache.reuse import common_prefix
from tests.tiny_models import byte_tokenizer

OURS, PEER = "semantic", "mlx_lm.server"


def _row(server, kind, ttft, user=0, rnd=2, cached=10, expected=10, error=None):
    return {"server": server, "kind": kind, "user": user, "agent": user, "round": rnd, "ttft_s": ttft,
            "cached_tokens": cached, "expected_cached": expected, "error": error,
            "reuse_ok": None if expected is None else cached >= expected}


def test_agents_share_no_prefix_and_a_tool_output_is_about_the_tokens_asked():
    tok = byte_tokenizer()  # a token a byte
    a, b = (tok.encode(system_prompt(tok, i, 300)["content"]) for i in (0, 1))
    assert common_prefix(a, b) < 20 and abs(len(a) - 300) < 60
    out = tool_output(tok, 2, 5, 250)["content"]
    assert out.startswith("Tool result: read_file('semantic/") and 250 <= len(tok.encode(out)) < 400
    assert out == tool_output(tok, 2, 5, 250)["content"] != tool_output(tok, 2, 6, 250)["content"]


def test_ratios_pair_each_step_and_leave_out_unanswered_ones():
    rows = [_row(OURS, "append", 1.0), _row(PEER, "append", 2.0),
            _row(OURS, "append", 3.0, rnd=3), _row(PEER, "append", 1.5, rnd=3),
            _row(OURS, "append", 9.0, rnd=4), _row(PEER, "append", None, rnd=4, error="boom"),
            _row(OURS, "first", 4.0, rnd=1), _row(PEER, "first", 5.0, rnd=1)]
    assert paired_ratios(rows, "append") == [0.5, 2.0] and paired_ratios(rows, "first") == [0.8]


def test_every_criterion_of_the_experiment_names_a_check_the_kind_writes():
    config = load("exp_021_window_trace", quick=True)
    rows = [_row(s, k, t, rnd=r) for s, t in ((OURS, 1.0), (PEER, 1.2)) for k, r in (("first", 1), ("append", 2))]
    rows += [_row(s, "subagent", 0.5, user=100, rnd=1, cached=5, expected=6) for s in (OURS, PEER)]
    out = {"models": {m: {"rows": rows, "system_tokens": 600} for m in config.params["models"]}, "failed": []}
    doc = {"checks": checks(out)}
    for c in config.criteria:
        resolve(doc, c.value)   # KeyError: a criterion no run could ever judge
    c = doc["checks"]
    assert c["gemma_append_over_mlx_lm"] == 1.0 / 1.2 and c["gemma_append_ratio_min"] == c["gemma_append_ratio_max"]
    assert c["gemma_reuse_append_ok"] and not c["gemma_reuse_subagent_ok"] and c["gemma_reuse_subagent_mlx_lm"] == "0/1"
