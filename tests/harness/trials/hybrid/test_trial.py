"""EXP-018's quick run, short: ours and mlx_lm.server on the LFM2-350M geometry (random f32 weights),
every turn type, a SIGKILL + restart, the snapshot sizes (about 7 minutes on 2 cores).

What is judged here is that the run completes, every request is answered, and what ours reuses within a
running server: every append its whole previous turn, a regenerate its whole prompt, an edit everything
before the edited message, a new agent the system prompt; and that the RAM budget holds. The speed goals
and the restart from disk are the experiment's verdicts, not this test's."""

from __future__ import annotations

import json

import pytest

from harness.config import load as load_config
from harness.runner import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_turn_type_is_measured_on_a_hybrid_and_ours_reuses_within_a_life(smollm2_dir, tmp_path):
    config = load_config("exp_018_hybrid", quick=True, overrides=[
        f"params.tokenizer_dir={smollm2_dir}", f"params.work_dir={tmp_path}", f"params.model_root={tmp_path}",
        'params.peers=["mlx_lm.server"]', "params.agents=4", "params.store_reps=1",
        "params.rounds=2", "params.restart_reps=1", "params.system_tokens=300"])  # fewer repetitions and a
    # shorter shared prompt (one whole block and a tail): each phase still measured
    (path,) = run(config, tmp_path / "results")
    doc = json.loads(path.read_text())
    c, out = doc["checks"], doc["outputs"]
    assert c["parts_failed"] == 0 and c["errors"] == 0, out["failed"]
    for k in ("reuse_append_ok", "reuse_regenerate_ok", "reuse_edit_ok", "reuse_shared_ok", "ram_budget_held"):
        assert c[k], (k, [r for r in out["geometries"]["lfm2-350m"]["rows"] if r["reuse_ok"] is False])
    for k in ("append_over_best_peer", "regenerate_over_best_peer", "edit_over_best_peer", "shared_over_best_peer",
              "agents_over_mlx_lm", "restart_over_cold"):
        assert c[k] is not None and c[k] > 0, k
    assert c["qwen3.5-35b-a3b.snapshot_over_block"] == pytest.approx(12.28, abs=0.01)
    readme = (tmp_path / "results" / "exp_018_hybrid" / "README.md").read_text()
    assert "EXP-018" in readme and "lfm2-350m" in readme
