"""EXP-019's kind, short: a fleet server of Gemma 3 270M and SmolLM2 (f32) beside single-model servers,
no mlx_lm.server; about 1.5 minutes on 2 cores (5 beside other jobs).

What is judged here is that the run completes, that every switch really unloaded the other model, and that
the issue's correctness goals hold (each agent's cache survives its model's unload and reload, the reply
equals a fresh prefill, the fleet's own bytes stay within its budget); the time and RSS goals are
``make exp-019``'s to judge.
"""

from __future__ import annotations

import json

import pytest

from harness.config import load as load_config
from harness.runner import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma3_dir():
    from harness import models

    variant = models.default_variant(None)
    if not models.variant_prepared("gemma3-270m", variant):
        pytest.fail(f"gemma3-270m ({variant}) is not prepared: run `make models`")
    return models.prepared_dir("gemma3-270m", variant)


def test_two_models_switch_under_one_budget_and_every_cache_survives(gemma3_dir, smollm2_dir, tmp_path):
    overrides = [f"params.main_dir={gemma3_dir}", f"params.small_dir={smollm2_dir}", f"params.work_dir={tmp_path}",
                 "params.peers=[]", "params.system_tokens=200", "params.max_tokens=8", "params.switch_rounds=2",
                 "params.conc_agents=1", "params.conc_rounds=2", "params.idle_samples=5"]
    config = load_config("exp_019_models", quick=True, overrides=overrides)
    (path,) = run(config, tmp_path / "results")
    doc = json.loads(path.read_text())
    c, out = doc["checks"], doc["outputs"]
    assert c["parts_failed"] == 0 and c["errors"] == 0, (out["failed"], out["switching"].get("error"),
                                                         out["concurrent"].get("error"))
    assert c["switch_steps"] == 3 and c["switch_turns_unloaded"], out["switching"]["steps"]
    assert c["cache_survives"] and c["reply_equals_fresh"] and c["reply_model_ok"], out["switching"]["steps"]
    assert c["overhead_measured"] and c["fleet_within_budget"] and c["rss_samples"] > 20
    assert c["switch_back_over_single"] > 0 and c["switch_back_over_mlx_lm"] is None   # no peer ran
    assert set(c["concurrent_ratios"]) == {"main", "small"} and c["concurrent_over_single"] > 0
    readme = (tmp_path / "results" / "exp_019_models" / "README.md").read_text()
    assert "several models behind one server" in readme
