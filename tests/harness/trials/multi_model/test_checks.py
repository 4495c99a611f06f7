"""EXP-019's pure parts without a server: the step plan, the budgets, the switching / memory / concurrent
checks from recorded rows, the compacted samples, and that every criterion of the TOML names a check the
kind writes."""

from __future__ import annotations

import pytest

from harness.config import ConfigError, load
from harness.criteria import resolve
from harness.trials.multi_model.concurrent import round_order
from harness.trials.multi_model.report import checks, concurrent_ratios, memory_checks, overhead, readme, switch_checks
from harness.trials.multi_model.switching import step_plan
from harness.trials.multi_model.trial import budgets, compact

MB = 2**20


def test_models_alternate_so_every_step_after_the_first_is_a_switch():
    plan = step_plan(["main", "small"], 3)
    assert [(s["model"], s["round"], s["kind"]) for s in plan] == [
        ("main", 1, "first"), ("small", 1, "switch_first"), ("main", 2, "switch_back"),
        ("small", 2, "switch_back"), ("main", 3, "switch_back"), ("small", 3, "switch_back")]
    assert round_order(1) == ("fleet", "singles") and round_order(2) == ("singles", "fleet")


def test_the_switching_budget_holds_one_model_and_the_concurrent_one_both():
    p = {"pool_mb": 100, "switch_models_mb": 0, "switch_fit": 0.5, "conc_models_mb": 0, "conc_slack": 0.1}
    b = budgets(p, {"main": 1100.0, "small": 600.0}, fixed_mb=200.0)
    assert b == {"switch_models_mb": 200 + 1100 + 300, "conc_models_mb": int(1900 * 1.1)}
    assert 200 + 1100 <= b["switch_models_mb"] < 200 + 1100 + 600 <= b["conc_models_mb"]
    assert budgets({**p, "switch_models_mb": 7, "conc_models_mb": 9}, {"main": 1.0}) == {
        "switch_models_mb": 7, "conc_models_mb": 9}


def _turn(ttft, text="hi", cached=0, model="main", error=None):
    return {"ttft_s": ttft, "text": text, "cached_tokens": cached, "model": model, "error": error,
            "prompt_tokens": 100, "completion_tokens": 8}


def _step(kind, model, ours, single, peer, expected=None, fresh="hi", state="unloaded", load_s=2.0):
    return {"kind": kind, "model": model, "state_before": state, "ours": ours, "single": single, "mlx_lm": peer,
            "ours_expected_cached": expected, "mlx_lm_expected_cached": expected, "load_s": load_s,
            "fresh": _turn(9.0, fresh, model=model) if kind == "switch_back" else None,
            "rss_after_mb": 1500.0, "fleet_resident_mb": 1100.0}


def _switching():
    return {"models_mb": 1400, "steps": [
        _step("first", "main", _turn(9.0), _turn(8.0), _turn(7.0), state="unloaded"),
        _step("switch_first", "small", _turn(6.0, model="small"), _turn(4.0, model="small"), _turn(5.0, model="small")),
        _step("switch_back", "main", _turn(3.0, cached=107), _turn(1.0, cached=107), _turn(6.0, cached=107),
              expected=107),
        _step("switch_back", "small", _turn(2.0, cached=50, model="small"), _turn(1.0, model="small"),
              _turn(5.0, cached=0, model="small"), expected=107)]}


def test_switching_gives_costs_ratios_and_what_each_cache_kept():
    c = switch_checks(_switching())
    assert c["switch_steps"] == 3 and c["switch_back_steps"] == 2 and c["switch_errors"] == 0
    assert c["switch_turns_unloaded"] and c["reply_model_ok"]
    assert c["switch_first_over_single"] == 1.5 and c["switch_first_cost_s"] == 2.0
    assert c["switch_back_over_single"] == 2.5 and c["switch_back_over_mlx_lm"] == pytest.approx((0.5 + 0.4) / 2)
    assert c["switch_back_ttft_ours_s"] == 2.5 and c["switch_back_load_s"] == 2.0
    assert not c["cache_survives"] and c["cache_survives_n"] == "1/2"      # small's agent found 50 of 107
    assert c["mlx_lm_cache_survives_n"] == "1/2" and c["reply_equals_fresh"]
    assert c["rss_beyond_fleet_mb"] == [400] * 4


def test_a_turn_on_a_loaded_model_or_a_fresh_prefill_unlike_ours_fails_its_check():
    sw = _switching()
    sw["steps"][2]["state_before"] = "loaded"
    sw["steps"][3]["fresh"]["text"] = "something else"
    sw["steps"][1]["ours"]["model"] = "main"
    c = switch_checks(sw)
    assert not c["switch_turns_unloaded"] and not c["reply_equals_fresh"] and c["replies_differing_fresh"] == 1
    assert not c["reply_model_ok"]
    assert switch_checks({})["switch_turns_unloaded"] is False   # nothing measured judges nothing true


def _samples(phase, rss_mb, resident_mb, budget_mb):
    return ([{"t": i, "phase": phase, "rss_bytes": r * MB} for i, r in enumerate(rss_mb)],
            [{"t": i, "phase": phase, "resident_bytes": r * MB, "budget_bytes": budget_mb * MB}
             for i, r in enumerate(resident_mb)])


def test_memory_is_held_to_the_budget_plus_the_idle_overhead_at_every_sample():
    idle_rss, idle_fleet = _samples("idle", [100, 104], [0, 0], 1000)
    rss, fleet = _samples("switch", [900, 1100, 1104], [800, 900, 900], 1000)
    sw = {"models_mb": 1000, "rss": idle_rss + rss, "fleet": idle_fleet + fleet}
    over, empty = overhead(sw)
    assert over == 104 * MB and empty
    c = memory_checks({"switching": sw}, over)
    assert c["rss_within_budget"] and c["fleet_within_budget"] and c["rss_samples"] == 3
    assert c["switching_rss_limit_mb"] == 1104 and c["rss_peak_over_models_mb"] == 104
    sw["rss"].append({"t": 9, "phase": "switch", "rss_bytes": 1105 * MB})
    sw["fleet"].append({"t": 9, "phase": "switch", "resident_bytes": 1001 * MB, "budget_bytes": 1000 * MB})
    c = memory_checks({"switching": sw}, over)
    assert c["rss_over_limit_samples"] == 1 and not c["rss_within_budget"]
    assert c["fleet_over_budget_samples"] == 1 and not c["fleet_within_budget"]
    assert not memory_checks({"switching": sw}, None)["rss_within_budget"]   # no overhead measured: no pass


def _conc(config, model, rnd, ttft, error=None):
    return {"config": config, "model": model, "round": rnd, "ttft_s": ttft, "error": error}


def test_concurrent_ratios_are_per_round_medians_and_the_worse_model_is_judged():
    rows = [_conc("fleet", "main", 1, 4.0), _conc("singles", "main", 1, 2.0),
            _conc("fleet", "main", 2, 1.0), _conc("fleet", "main", 2, 3.0), _conc("singles", "main", 2, 2.0),
            _conc("fleet", "small", 2, 1.0), _conc("singles", "small", 2, 1.0),
            _conc("fleet", "small", 3, 1.0), _conc("singles", "small", 3, 0.5),
            _conc("singles", "small", 3, 0.1, error="boom")]   # a failed turn counts as an error, not a time
    assert concurrent_ratios(rows) == {"main": {1: 2.0, 2: 1.0}, "small": {2: 1.0, 3: 2.0}}
    c = checks({"concurrent": {"rows": rows}, "failed": []})
    assert c["concurrent_over_single_main"] == 1.0 and c["concurrent_first_round_over_single_main"] == 2.0
    assert c["concurrent_over_single_small"] == 1.5 and c["concurrent_over_single"] == 1.5
    assert c["concurrent_errors"] == 1 and c["errors"] == 1


def test_compacted_samples_keep_every_rss_and_only_the_fleets_changes():
    rss, fleet = _samples("switch", [900, 901], [800, 800], 1000)
    fleet.append({"t": 5, "phase": "switch", "resident_bytes": 0, "budget_bytes": 1000 * MB, "loading": "main"})
    out = compact({"models_mb": 1000, "rss": rss, "fleet": fleet})
    assert out["rss_mb"] == [[0, "switch", 900.0, 0.0], [1, "switch", 901.0, 0.0]] and out["models_mb"] == 1000
    assert [f[:4] for f in out["fleet_changes"]] == [[0, "switch", 800.0, None], [5, "switch", 0.0, "main"]]


def test_every_criterion_of_the_experiment_names_a_check_the_kind_writes():
    config = load("exp_019_models", quick=True)
    rss, fleet = _samples("switch", [900], [800], 1400)
    idle_rss, idle_fleet = _samples("idle", [100], [0], 1400)
    sw = {**_switching(), "rss": idle_rss + rss, "fleet": idle_fleet + fleet}
    conc = {"models_mb": 2000, "rows": [_conc("fleet", "main", 2, 1.0), _conc("singles", "main", 2, 1.0)]}
    doc = {"checks": checks({"switching": sw, "concurrent": conc, "failed": []})}
    for c in config.criteria:
        resolve(doc, c.value)   # KeyError: a criterion no run could ever judge
    assert doc["checks"]["parts_failed"] == 0 and doc["checks"]["overhead_measured"]
    verdicts = [{"name": "g", "level": "P1", "measured": 2.5, "op": "<=", "threshold": 0.5, "verdict": "FAIL"}]
    run = {"run_id": "20261126T000000Z-x", "created_at": "2026-11-26T00:00:00", "params": config.params,
           "models": {"main": "gemma3-270m-f32", "small": "smollm2-135m-f32"}}
    text = readme(run, doc["checks"], verdicts)
    assert "| an agent's next turn after its model was unloaded | 2.5 | 1 | 5.5 | 2 | **2.5** (1.5 s) | **0.45** |" in text
    assert "| g | P1 | 2.5 <= 0.5 | **FAIL** |" in text and "models main small main small main small" in text


def test_unknown_phases_peers_and_a_budget_that_fits_both_are_refused():
    for override, match in (('params.phases=["nope"]', "phases"), ('params.peers=["vllm-mlx"]', "peers"),
                            ("params.switch_fit=1.0", "switch_fit")):
        with pytest.raises(ConfigError, match=match):
            load("exp_019_models", overrides=[override])
