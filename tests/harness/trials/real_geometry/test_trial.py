"""EXP-020's quick run: Qwen3.5-35B-A3B's cache geometry (tiny random bf16 body) at 8K and 32K tokens, agents written
synthetically through the store, a server with no pool flags, a sized server restarted cold and warm, and
Qwen3-Coder-30B-A3B's (an attention model) at 32K by its restores alone; about 6.5 min
on 2 cores (the model directory and the server's batch probe are kept under ~/.cache/semantic-kv/models).

What is judged here is that the run completes, every measured turn found the agent's whole cache, our restore
loads the agent whole, and every goal's ratio was measured (a number, not None); the goals themselves are the
experiment's verdicts, not this test's. A server with no pool flags answers the 32K agent or refuses it: either
is recorded (its default pool is being sized from the machine's memory)."""

from __future__ import annotations

import json

import pytest

from harness.config import load as load_config
from harness.runner import run

pytestmark = [pytest.mark.slow]

GOALS = ("restore_cold_over_floor_min", "restore_warm_over_memcpy_min", "cached_over_goal_max",
         "beside_over_quiet_max", "rss_over_budget_max", "load_cold_ours_over_mlx_max", "restore_peak_over_cache_max",
         "hybrid_restore_peak_over_cache_max", "hybrid_restore_cold_over_floor_min")


def test_real_geometry_at_8k_and_32k_is_measured_and_every_turn_finds_the_agent(tmp_path):
    config = load_config("exp_020_real_geometry", quick=True, overrides=[f"params.work_dir={tmp_path}"])
    (path,) = run(config, tmp_path / "results")
    doc = json.loads(path.read_text())
    c, out = doc["checks"], doc["outputs"]
    assert c["parts_failed"] == 0, out["failed"]
    assert c["lengths_run"] == 3, out["skipped"]  # the hybrid at 8K and 32K, the attention model's restores
    assert c["measured_turn_errors"] == 0 and c["measured_turns_missing_cache"] == 0
    assert c["loads_whole"]
    for k in GOALS:
        assert isinstance(c[k], float) and c[k] > 0, (k, c[k])
    assert c["qwen3.5-35b-a3b@8K.default_status"] == 200            # 8K fits today's 1024 MB default pool
    assert c["qwen3.5-35b-a3b@32K.default_status"] in (200, 400)
    # the other agent's turns were saved behind, one per pair
    assert c["qwen3.5-35b-a3b@32K.beside_saved"] == config.params["beside_reps"]
    # two agents of 32K on a server with no pool flags: each restored from disk and resumed, whole
    assert c["fleets_run"] == 1 and c["fleet_turns_bad"] == 0, out["geometries"]["qwen3.5-35b-a3b"]["fleets"]
    assert isinstance(c["fleet_rss_over_budget_max"], float) and c["fleet_rss_over_budget_max"] > 0
    readme = (tmp_path / "results" / "exp_020_real_geometry" / "README.md").read_text()
    assert "EXP-020" in readme and "qwen3.5-35b-a3b" in readme
