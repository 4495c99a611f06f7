"""The append profile's pure parts: a traced turn's spans around its last token, the tracer's wrapping,
and the summary's medians and ratios."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from harness.trials.serving.append_profile import tracing
from harness.trials.serving.append_profile.report import summarize
from harness.trials.serving.append_profile.tracing import Tracer, account


def test_a_span_is_split_at_the_last_token_and_spans_before_submit_or_on_the_caller_are_left_out():
    stamps = {"submit": 10.0, "admitted": 10.002, "first_token": 10.1, "last_token": 10.5, "completion": 10.6}
    spans = [("prefill", 1, 10.01, 10.09), ("decode", 1, 10.1, 10.2), ("decode", 1, 10.45, 10.55),
             ("extract", 2, 10.52, 10.58), ("early", 1, 9.0, 10.2), ("mine", 7, 10.1, 10.2)]
    c = SimpleNamespace(cached_tokens=2000, history_tokens=2300, token_ids=[1, 2, 3])
    row = account(stamps, spans, c, caller=7)
    assert (row["cached_tokens"], row["prompt_tokens"], row["generated"]) == (2000, 2300, 3)
    assert (row["admitted_ms"], row["ttft_ms"], row["last_token_ms"], row["completion_ms"]) == (2.0, 100.0, 500.0, 600.0)
    assert row["tokens_final_ms"] is None
    assert row["before_last_token"] == {"prefill": 80.0, "decode": 150.0, "extract": 0.0}  # begun after it: 0 before
    assert row["after_last_token"] == {"decode": 50.0, "extract": 60.0}


def test_the_tracer_records_a_span_per_call_and_puts_the_function_back(monkeypatch):
    mod = types.ModuleType("append_profile_dummy")

    class Thing:
        def work(self, x):
            return x + 1

    mod.Thing, mod.helper = Thing, lambda: "ok"
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(tracing, "TRACED", [(mod.__name__ + ".Thing", "work", "work"), (mod.__name__, "helper", "helper")])
    original = Thing.work
    tracer = Tracer()
    tracer.install()
    try:
        assert Thing().work(1) == 2 and mod.helper() == "ok"
    finally:
        tracer.uninstall()
    assert [s[0] for s in tracer.spans] == ["work", "helper"] and all(s[2] <= s[3] for s in tracer.spans)
    assert Thing.work is original and tracer._undo == []


def _row(ttft, before, after=None, final=None):
    return {"ttft_ms": ttft, "last_token_ms": ttft + 100, "tokens_final_ms": final, "completion_ms": ttft + 120,
            "admitted_ms": 1.0, "before_last_token": before, "after_last_token": after or {}}


def test_the_engine_summary_takes_medians_and_counts_a_label_a_turn_did_not_hit_as_zero():
    eng = {"ours": [_row(10.0, {"a": 1.0}), _row(30.0, {"a": 3.0, "b": 2.0}, {"c": 4.0}), _row(20.0, {"a": 2.0})],
           "mlx_lm": [{"ttft_ms": 12.0, "last_token_ms": 50.0}, {"ttft_ms": 14.0, "last_token_ms": 70.0}],
           "micro": {"x": 1.5}}
    s = summarize({"engine": eng})["engine"]
    assert (s["ours_ttft_ms"], s["ours_last_token_ms"], s["ours_completion_ms"]) == (20.0, 120.0, 140.0)
    assert s["ours_tokens_final_ms"] is None            # no turn stamped it
    assert (s["mlx_lm_ttft_ms"], s["mlx_lm_last_token_ms"]) == (13.0, 60.0)
    assert s["spans_ms"] == {"a": {"before_last_token": 2.0, "after_last_token": 0.0},
                             "b": {"before_last_token": 0.0, "after_last_token": 0.0},
                             "c": {"before_last_token": 0.0, "after_last_token": 0.0}}
    assert s["micro_ms"] == {"x": 1.5}


def test_the_http_summary_is_each_servers_medians_and_the_median_of_each_trials_ratio():
    def got(t, cached, load):
        return {"ttft_s": t, "last_token_s": 2 * t, "turn_s": 3 * t, "cached_tokens": cached, "load": load}

    samples = {"semantic": [got(1.0, 2000, 0.5), got(2.0, 2001, 0.6)],
               "mlx_lm.server": [got(4.0, 1990, 0.7), got(2.0, 1991, 0.8)]}
    s = summarize({"http": {"samples": samples}})
    assert "engine" not in s
    h = s["http"]
    assert h["semantic"] == {"ttft_s": 1.5, "last_token_s": 3.0, "turn_s": 4.5, "n": 2, "cached_tokens": [2000, 2001]}
    assert h["ratio_semantic_over_mlx_lm"] == pytest.approx({"ttft_s": 0.625, "last_token_s": 0.625, "turn_s": 0.625})
    assert "ratio_mlx_lm.server_over_mlx_lm" not in h and h["load"] == [0.5, 0.6, 0.7, 0.8]


def test_the_profiled_turns_material_and_every_traced_function_exist():
    from harness.trials.serving.append_profile import __main__, over_http, turns  # noqa: F401 (the flags' imports)

    assert turns.READ_FILE.is_file() and turns.TOOL_OUTPUT.is_file()
    assert (over_http.CHECKOUT / "semantic" / "__init__.py").is_file()
    tracer = Tracer()
    tracer.install()   # raises on a module or function that is gone
    try:
        assert len(tracer._undo) == len(tracing.TRACED)
    finally:
        tracer.uninstall()
