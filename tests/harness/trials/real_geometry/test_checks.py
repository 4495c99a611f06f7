"""EXP-020's pure parts: the geometries' bytes per token, a cache's bytes and the pool that holds it, the prompts
that grow at each restart, the checks from recorded rows, and that every criterion names a check the kind writes."""

from __future__ import annotations

import pytest

from harness.config import load
from harness.criteria import resolve
from harness.trials.hybrid.sizes import BIG, spec_of
from harness.trials.real_geometry.models import GEOMETRIES, config_of, context_of
from harness.trials.real_geometry.report import checks
from harness.trials.real_geometry.serving import Growing
from harness.trials.real_geometry.trial import cache_bytes, label, pool_mb_for


def test_the_geometries_keep_the_real_models_cache_numbers():
    assert GEOMETRIES["qwen3-coder-30b-a3b"]["kv_bytes_per_token"] == 96 * 1024
    assert GEOMETRIES["llama-3.1-8b"]["kv_bytes_per_token"] == 128 * 1024
    assert GEOMETRIES["gemma-3-12b"]["kv_bytes_per_token"] == 64 * 1024
    g = config_of("gemma-3-12b")
    assert (g["num_hidden_layers"], g["num_key_value_heads"], g["head_dim"], g["sliding_window"],
            g["sliding_window_pattern"]) == (48, 8, 256, 1024, 6)
    q = config_of("qwen3.5-35b-a3b")["text_config"]
    assert {k: q[k] for k in ("num_hidden_layers", "full_attention_interval", "num_key_value_heads", "head_dim")} == \
        {"num_hidden_layers": 40, "full_attention_interval": 4, "num_key_value_heads": 2, "head_dim": 256}
    assert context_of("llama-3.1-8b") == 131072 and context_of("qwen3.5-35b-a3b") == 262144
    assert all(config_of(n).get("hidden_size", 64) == 64 for n in GEOMETRIES)   # the body is tiny


def test_a_cache_s_bytes_and_the_pool_that_holds_it():
    spec = spec_of(BIG["qwen3.5-35b-a3b"])   # the same layers as the served model's (from the config)
    snap = spec.state_bytes()
    assert cache_bytes(spec, 32768) == 32768 * 20 * 1024 + snap
    assert pool_mb_for(spec, 32768) * (1 << 20) >= cache_bytes(spec, 32768)
    assert label(130816) == "128K" and label(8192) == "8K"


def test_each_prompt_is_the_last_plus_fresh_tokens():
    g = Growing([1, 2, 3], 4, seed=0)
    a = g.next()
    b = g.next()
    assert a[:3] == [1, 2, 3] and len(a) == 7 and b[:7] == a and len(b) == 11 and b[7:] != a[3:]


def _turn(s, cached=32768, status=200):
    return {"status": status, "s": s, "cached_tokens": cached, "completion_tokens": 1, "cache_save": "pending"}


def _length():
    restore = [{"cold": True, "bytes": 1e9, "turn": _turn(4.0), "floor_read": {"s": 1.0},
                "rss": {"before": 300e6, "peak": 1.35e9}},
               {"cold": False, "bytes": 1e9, "turn": _turn(2.0), "memcpy": {"s": 0.5}, "floor_read": {"s": 0.6},
                "rss": {"before": 300e6, "peak": 1.25e9}}]
    cached = [{"one": _turn(1.0), "more": {**_turn(2.0), "completion_tokens": 3}, "decode_step_s": 0.5},
              {"one": _turn(1.2), "more": {**_turn(2.2), "completion_tokens": 3}, "decode_step_s": 0.5}]
    beside = [{"quiet": {"other": _turn(1.0, 0), "turn": _turn(1.0)},
               "beside": {"other": _turn(1.0, 0), "turn": _turn(1.1)}}]
    srv = {"args": ["--pool-mb", "1000"], "first": _turn(3.0), "restore": restore, "cached": cached, "beside": beside,
           "lives": [{"start_s": 1.0, "budget_bytes": 1000 << 20}], "rss": {"max_bytes": 1100 << 20,
                                                                          "max_by_phase": {"start": 300 << 20}}}
    saves = {"rows": [{"ours": {"s": 2.0, "bytes": 1e9}, "mlx_lm": {"s": 1.0, "s_fsync": 1.5, "bytes": 1e9},
                       "floor_write": {"s": 1.0}}]}
    loads = {"rows": [{"mode": "cold", "ours": {"s": 3.0, "load_s": 1.5, "whole": True}, "mlx_lm": {"s": 1.5},
                       "floor_read": {"s": 1.0}}]}
    return {"tokens": 32768, "cache_bytes": 1e9, "saves": saves, "loads": loads, "server": srv,
            "default": {"status": 400, "error": "32777 tokens do not fit this server's block pool", "budget_bytes": 1}}


def test_the_checks_pair_each_rep_and_take_the_worst():
    out = {"geometries": {"g": {"lengths": {"32K": _length(), "128K": {"tokens": 130816, "cache_bytes": 1,
                                                                       "skipped": "memory"}}}},
           "failed": [], "skipped": [{"part": "g 128K", "why": "memory"}]}
    c = checks(out)
    assert c["lengths_run"] == 1 and c["lengths_skipped"] == 1 and c["parts_failed"] == 0
    assert c["restore_cold_over_floor_min"] == pytest.approx(0.25)
    # an overlapped restore lasts at least the forward: the cached turn (1.1 s median) outlasts the 1.0 s read
    assert c["restore_cold_bound_min"] == pytest.approx(1.0 / 1.1)
    assert c["restore_warm_over_memcpy_min"] == pytest.approx(0.25)
    assert c["restore_peak_over_cache_max"] == pytest.approx(1.05)   # the cold restore's, the worse of the two
    assert c["cached_over_decode_max"] == pytest.approx(2.2)     # pairs 2.0 and 2.4
    assert c["cached_over_goal_max"] == pytest.approx(2.2 / 1.5)  # "g" is no hybrid: an attention model's goal
    assert c["beside_over_quiet_max"] == pytest.approx(1.1)
    assert c["rss_over_budget_max"] == pytest.approx(1.1)
    assert c["load_cold_ours_over_mlx_max"] == pytest.approx(2.0)
    assert c["save_speed_over_floor_min"] == pytest.approx(0.5)
    assert c["g@32K.default_status"] == 400 and c["default_refused"] == 1
    assert c["measured_turn_errors"] == 0 and c["measured_turns_missing_cache"] == 0
    out["geometries"]["qwen3.5-35b-a3b"] = out["geometries"].pop("g")
    h = checks(out)
    assert h["cached_over_goal_max"] == pytest.approx(2.2 / 2.0)  # a hybrid's goal
    # the restore goals are an attention model's: a hybrid's restore figures are its own
    assert h["restore_peak_over_cache_max"] is None and h["restore_cold_over_floor_min"] is None
    assert h["hybrid_restore_peak_over_cache_max"] == pytest.approx(1.05)
    assert h["hybrid_restore_cold_over_floor_min"] == pytest.approx(0.25)
    out["geometries"]["qwen3.5-35b-a3b"]["lengths"]["32K"]["server"]["cached"][0]["one"]["cached_tokens"] = 10
    assert checks(out)["measured_turns_missing_cache"] == 1


def test_a_fleet_counts_every_turn_refused_or_missing_its_cache_and_its_worst_rss_sample():
    turn = lambda phase, a, cached, status=200: {"phase": phase, "agent": f"agent-{a}", "status": status,
                                                 "cached_tokens": cached, "s": 1.0}
    fleet = {"tokens": 100, "agents": 2, "cache_bytes": 1, "rss_over_budget_max": 0.9,
             "turns": [turn("restore", 0, 100), turn("restore", 1, 100), turn("append", 0, 102), turn("append", 1, 102)]}
    out = {"geometries": {"g": {"lengths": {}, "fleets": {"2x0K": fleet, "1x1K": {"skipped": "disk"}}}},
           "failed": [], "skipped": []}
    c = checks(out)
    assert (c["fleets_run"], c["fleet_turns_bad"], c["fleet_rss_over_budget_max"]) == (1, 0, 0.9)
    fleet["turns"][1] = turn("restore", 1, 0)          # the agent's cache missed: a prefill, not a restore
    fleet["turns"][3] = turn("append", 1, None, 400)  # refused
    assert checks(out)["fleet_turns_bad"] == 2
    fleet["turns"] = fleet["turns"][:2]                # the appends never sent
    assert checks(out)["fleet_turns_bad"] == 2


def test_every_criterion_names_a_check_the_kind_writes():
    config = load("exp_020_real_geometry")
    out = {"geometries": {"g": {"lengths": {"32K": _length()}}}, "failed": [], "skipped": []}
    doc = {"checks": checks(out)}
    for crit in config.criteria:
        resolve(doc, crit.value)


def test_a_restore_s_peak_is_read_against_the_server_just_before_the_turn():
    import os

    from harness.trials.multi_model.sampler import MemorySampler
    from harness.trials.real_geometry.serving import rss_around

    def turn():  # a turn's working memory, resident for a few samples, then freed
        held = bytearray(192 << 20)
        sampler.wait_samples(3)
        del held
        return "answered"

    with MemorySampler(os.getpid, None, interval_s=0.01, phase="restore-cold") as sampler:
        result, rss = rss_around(sampler, "restore-cold", turn)
    assert result == "answered" and rss["peak"] - rss["before"] > 150 << 20
    assert sampler.phase == "restore-cold"   # the phase the part goes on in
