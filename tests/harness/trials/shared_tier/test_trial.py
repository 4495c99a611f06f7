"""EXP-016's shared tier, short: two real servers on SmolLM2 and one real redis-server, a few minutes.

The same kind as ``make exp-016`` with its ``[quick]`` sizes (1K-token histories, one trial, short
Redis faults). What is judged here is what holds at any size: resumed turns fully cached and equal to
a cold prefill, the shared prompt hit, no failed or wrong turn under the faults. The TTFT ratios are
the full run's goals, not this test's.
"""

from __future__ import annotations

import json

import pytest

from harness.config import load as load_config
from harness.runner import run
from harness.trials.shared_tier.redis_server import REDIS

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(REDIS is None, reason="no redis-server: `make system-redis`")]


def test_any_server_resumes_any_agent_exactly_and_redis_faults_cost_no_turn(smollm2_dir, tmp_path):
    config = load_config("exp_016_shared_tier", quick=True, overrides=[f"params.model_dir={smollm2_dir}"])
    (path,) = run(config, tmp_path / "results")
    doc = json.loads(path.read_text())
    c, out = doc["checks"], doc["outputs"]
    assert c["remote_resumes_fully_cached"] and c["local_resumes_fully_cached"], out["resume"]
    assert c["resume_replies_differing"] == 0, out["resume"]
    assert c["shared_prompt_hit"], out["shared_prompt"]
    assert c["fault_failed_requests"] == 0, out["faults"]["failures"]
    assert c["fault_wrong_replies"] == 0 and c["fault_turns"] > 0, out["faults"]["wrong"]
    assert c["fault_remote_errors"] > 0 and c["fault_remote_up_at_end"], out["faults"]["remote"]
    assert (tmp_path / "results" / "exp_016_shared_tier" / "README.md").exists()
