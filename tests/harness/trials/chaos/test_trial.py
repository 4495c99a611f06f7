"""EXP-015's chaos soak, short: SmolLM2 behind ``semantic serve`` under every kind of fault, a few minutes.

The same kind as ``make exp-015`` with its ``[quick]`` sizes: 16 agents through the SDKs, four
crashes and restarts (two damaging a file of the block layout: a block file, shared by several
agents where one is, and a manifest), a full disk then a SIGKILL, a read-only disk, cut
streams and a flood, then a short crash-free life and a clean shutdown. Without root (no tmpfs) the
filesystem faults are skipped, and the results say so; everything else still runs. The turn and
crash counts of the full run (1000, 20) and its RSS goal are not judged here: too few turns.
"""

from __future__ import annotations

import json
import os

import pytest

from harness.config import load as load_config
from harness.runner import run

# alone: its servers' lives last a set time, so a test beside it leaves some life without a saved turn to resume
# (run beside the others once, no resumption was checked)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.alone]


def test_nothing_is_lost_and_nothing_fails_under_a_short_chaos_run(smollm2_dir, tmp_path):
    # a shorter calm last life than [quick]'s (its RSS goal is not judged here); every fault as in [quick]
    config = load_config("exp_015_chaos", quick=True, overrides=[f"params.model_dir={smollm2_dir}", "params.calm_turns=20",
                                                                  "params.rss_baseline_turns=10"])
    (path,) = run(config, tmp_path / "results")
    doc = json.loads(path.read_text())
    c, out = doc["checks"], doc["outputs"]
    failures = out["failures"][:5]
    assert (c["http_5xx"], c["hang"], c["failures"]) == (0, 0, 0), failures
    assert c["lost_durable_turns"] == 0, [r for r in out["resumptions"] if r["verdict"] == "lost"]
    assert c["resumptions_checked"] > 0 and c["corrupt_served"] == 0
    assert c["wrong_replies"] == 0 and c["correctness_checked"] > 0, out["correctness_checks"]
    assert c["crashes"] >= 5 and c["faults_corrupt"] == 2 and c["faults_flood"] == 1 and c["faults_hangup"] == 1
    damaged = [e for e in out["events"] if e["kind"] == "corrupt"]
    assert c["corrupted_manifests"] >= 1 and c["corrupted_block_files"] >= 1, damaged
    assert c["temp_files_left"] == 0 and c["clean_shutdown"]
    assert c["cache_save_missing"] == 0 and c["salt_reused_cache"] == 0
    assert c["corruptions_not_quarantined"] == 0
    if os.geteuid() == 0:
        assert c["skipped_faults"] == {}
        assert c["disk_full_all_answered"] and c["disk_full_ram_within_budget"]
        assert c["disk_full_resumptions_lost"] == 0 and c["faults_read_only_start"] == 1
    else:
        assert set(c["skipped_faults"]) == {"disk_full", "read_only"}
    assert (tmp_path / "results" / "exp_015_chaos" / "README.md").exists()
    assert not any(line.split()[1].startswith("/tmp/exp015-") for line in open("/proc/mounts"))
