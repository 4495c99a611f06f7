"""EXP-018's pure parts without a server: what each turn type must find cached, the ratios from recorded
rows, the checks, snapshot sizes of the big geometries, the served geometries' configs, and that every
criterion of the TOML names a check the kind writes."""

from __future__ import annotations

import pytest

from harness.config import ConfigError, load
from harness.criteria import resolve
from harness.trials.hybrid import model as hm
from harness.trials.hybrid.report import best_peer_ratios, checks, geometry_checks
from harness.trials.hybrid.sizes import BIG, size_row, spec_of
from harness.trials.hybrid.turns import REPLY_SLACK, expected_cached, reuse_ok

OURS, PEER = "semantic", "mlx_lm.server"


def test_each_turn_type_must_find_what_the_issue_says():
    assert expected_cached("append", prompt=600, prev_prompt=530, prev_reply=12) == 542 - REPLY_SLACK
    assert expected_cached("append", prompt=600) is None                     # a first turn has no goal
    assert expected_cached("regenerate", prompt=557) == 556
    assert expected_cached("edit", prompt=560, message_start=545) == 545
    assert expected_cached("shared", prompt=528, system_end=515) == 515
    assert expected_cached("restart", prompt=600, prev_prompt=557, prev_reply=8) == 564
    assert expected_cached("cold", prompt=600) is None
    assert reuse_ok(556, 556) and not reuse_ok(529, 556) and reuse_ok(None, 5) is None and reuse_ok(3, None) is None


def _row(server, phase, kind, ttft, user=0, rnd=2, cached=10, exp=10, rep=None, error=None):
    return {"server": server, "phase": phase, "kind": kind, "user": user, "round": rnd, "ttft_s": ttft,
            "cached_tokens": cached, "expected_cached": exp, "reuse_ok": reuse_ok(cached, exp), "error": error,
            "rep": rep}


def test_ratios_pair_steps_and_take_the_fastest_peer():
    rows = [_row(OURS, "warm", "append", 1.0), _row(PEER, "warm", "append", 2.0), _row("vllm-mlx", "warm", "append", 4.0),
            _row(OURS, "warm", "append", 3.0, rnd=3), _row(PEER, "warm", "append", 1.0, rnd=3),
            _row(OURS, "warm", "append", 9.0, rnd=4)]   # no peer answered round 4: no pair
    assert best_peer_ratios(rows, "warm", "append", [PEER, "vllm-mlx"]) == [0.5, 3.0]
    assert best_peer_ratios(rows, "warm", "append", ["vllm-mlx"]) == [0.25]


def _geometry():
    rows = []
    for kind, ours, peer in (("append", 1.0, 2.0), ("regenerate", 0.5, 1.0), ("edit", 0.6, 0.5)):
        rows += [_row(OURS, "warm", kind, ours), _row(PEER, "warm", kind, peer)]
    rows += [_row(OURS, "shared", "first", 0.7, user=100, rnd=1), _row(PEER, "shared", "first", 1.4, user=100, rnd=1),
             _row(OURS, "agents", "append", 1.0, user=200), _row(PEER, "agents", "append", 4.0, user=200),
             _row(OURS, "restart", "restart", 0.5, rep=0, cached=0, exp=100), _row(PEER, "restart", "restart", 5.0, rep=0, cached=0, exp=100)]
    stats = [{"ram_bytes": 10, "ram_budget_bytes": 100, "ram_peak_bytes": 50, "over_budget_steps": 0, "pool_used_bytes": 40}]
    restart = [{"rep": 0, "resumed": {OURS: {"ttft_s": 0.5}, PEER: {"ttft_s": 5.0}}, "cold": {"ttft_s": 10.0}}]
    return {"servers": [OURS, PEER], "rows": rows, "stats": stats, "restart": restart}


def test_a_geometry_gives_its_ratios_reuse_shares_and_budget():
    c = geometry_checks(_geometry())
    assert c["append_over_best_peer"] == 0.5 and c["edit_over_best_peer"] == pytest.approx(1.2)
    assert c["shared_over_best_peer"] == 0.5 and c["agents_over_mlx_lm"] == 0.25
    assert c["restart_over_cold"] == 0.05 and c["restart_ttft_s"] == 0.5 and c["cold_ttft_s"] == 10.0
    assert c["reuse_append_ok"] and c["reuse_edit_ok"] and not c["reuse_restart_ok"]
    assert c["reuse_restart_ours"] == "0/1" and c["reuse_append_mlx_lm.server"] == "2/2"
    assert c["ram_budget_held"] and c["ram_peak_bytes"] == 50 and c["errors"] == 0


def test_the_budget_fails_on_one_step_over_it():
    d = _geometry()
    d["stats"].append({"ram_bytes": 101, "ram_budget_bytes": 100, "ram_peak_bytes": 101, "over_budget_steps": 1,
                       "pool_used_bytes": 0})
    assert not geometry_checks(d)["ram_budget_held"]


def test_snapshot_bytes_of_the_big_geometries_from_their_configs():
    qwen35 = spec_of(BIG["qwen3.5-35b-a3b"])
    assert sum(l.kind == "recurrent" for l in qwen35.layers) == 30 and qwen35.n_layers == 40
    assert qwen35.layers[3].kind == "global" and qwen35.layers[0].kind == "recurrent"
    # per GDN layer: conv (3, 2*16*128 + 32*128) bf16 + SSM (32, 128, 128) f32
    assert qwen35.state_bytes() == 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    row = size_row("qwen3.5-35b-a3b", qwen35)
    assert row["kv_bytes_per_token"] == 10 * 2 * 256 * 2 * 2 and row["snapshot_over_block"] == pytest.approx(12.28, abs=0.01)
    assert row["snapshot_over_kv_32768"] < 0.1 < row["snapshot_over_kv_4096"]
    coder = spec_of(BIG["qwen3-coder-next"])
    assert coder.n_layers == 48 and sum(l.kind == "recurrent" for l in coder.layers) == 36
    assert spec_of(BIG["qwen3-coder-next"], attention_only=True).n_layers == 12


def test_the_served_geometries_are_the_real_ones():
    from mlx_lm.utils import _get_classes

    lfm2 = hm.GEOMETRIES["lfm2-350m"]
    assert hm.layer_counts(lfm2) == {"conv": 10, "full_attention": 6}
    assert [i for i, t in enumerate(lfm2["layer_types"]) if t != "conv"] == [2, 5, 8, 10, 12, 14]
    _, args_cls = _get_classes(lfm2)
    args = args_cls.from_dict(lfm2)
    assert (args.hidden_size, args.num_key_value_heads, args.conv_L_cache) == (1024, 8, 3)
    assert hm.GEOMETRIES["gpt-oss-small"]["sliding_window"] == 128 < 256


def test_replies_render_back_with_their_space(tmp_path):
    import json

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "{{ message['content'] }}"}))
    hm._space_led_replies(cfg)
    assert "' ' + message['content'] if message['role'] == 'assistant'" in json.loads(cfg.read_text())["chat_template"]
    cfg.write_text(json.dumps({"chat_template": "{{ m.content }}"}))
    with pytest.raises(ValueError, match="chat template"):
        hm._space_led_replies(cfg)


def test_every_criterion_of_the_experiment_names_a_check_the_kind_writes():
    config = load("exp_018_hybrid", quick=True)
    store = {"with_snapshot": {"save_s": 1.0, "load_s": 1.0, "written_bytes": 1, "restored_whole": True},
             "kv_only": {"save_s": 0.1, "load_s": 0.1}}
    out = {"geometries": {"lfm2-350m": _geometry()}, "failed": [],
           "sizes": {"rows": [size_row(n, spec_of(c)) for n, c in BIG.items()], "store": {n: store for n in BIG}}}
    doc = {"checks": checks(out)}
    for c in config.criteria:
        resolve(doc, c.value)   # KeyError: a criterion no run could ever judge
    assert doc["checks"]["snapshot_store_ok"] and doc["checks"]["parts_failed"] == 0


def test_unknown_geometries_and_phases_are_refused():
    with pytest.raises(ConfigError, match="geometries"):
        load("exp_018_hybrid", overrides=['params.geometries=["nope"]'])
    with pytest.raises(ConfigError, match="phases"):
        load("exp_018_hybrid", overrides=['params.phases=["nope"]'])
