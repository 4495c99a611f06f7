"""The reduced EXP-008 stress run, in `make test-slow`: the same kind and criteria as `make exp-008`.

Tiny random-weight models (the engine's bookkeeping is what is stressed):
150 requests from 16 agents, with edits and evictions made frequent so a
short run exercises them, every criterion of the config must pass.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import config
from harness import runner
from harness.trials.stress import _choose_parity


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_a_reduced_stress_run_has_no_errors_stale_reuses_or_leaks(model, tmp_path):
    cfg = config.load(
        "experiments/exp_008_stress.toml",
        overrides=[f'models=["{model}"]', "params.requests=150", "params.edit_prob=0.15",
                   "params.evict_prob=0.15", "params.parity_samples=12"],
    )
    (path,) = runner.run(cfg, out_root=tmp_path)
    doc = json.loads(path.read_text())
    failed = [c for c in doc["criteria"] if not c["pass"]]
    assert not failed, (failed, doc["outputs"]["errors"])
    counts = doc["outputs"]["counts"]
    assert counts["edits"] > 0 and counts["evictions"] > 0 and counts["parity_checked"] == 12
    assert any(p["edited"] for p in doc["outputs"]["parity"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_with_speculation_every_turn_of_a_reduced_stress_run_equals_a_fresh_prefill_without_it(model, tmp_path):
    cfg = config.load("experiments/exp_008_stress_spec.toml",
                      overrides=[f'models=["{model}"]', "params.requests=150", "params.evict_prob=0.15",
                                 "params.spec_position_cost=0.0"])
    (path,) = runner.run(cfg, out_root=tmp_path)
    doc = json.loads(path.read_text())
    failed = [c for c in doc["criteria"] if not c["pass"]]
    assert not failed, (failed, doc["outputs"]["errors"])
    counts, spec = doc["outputs"]["counts"], doc["outputs"]["speculation"]
    assert counts["parity_checked"] == 150 and counts["parity_failed"] == 0
    assert spec["drafted"] > spec["accepted"] > 0


def test_the_parity_sample_is_full_for_any_schedule():
    """Chosen from submission indices after the run: whichever turns were eligible, in any
    finishing order, ``n`` are checked, half on edited turns, topped up when a group is short."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        requests, n = int(rng.integers(1, 200)), int(rng.integers(0, 25))
        turns = [(i, "a", None, None, bool(rng.random() < rng.random())) for i in range(requests)
                 if rng.random() < 0.9]  # some turns reused nothing, or failed
        order = list(rng.permutation(len(turns)))  # the order they finished in
        chosen = _choose_parity([turns[i] for i in order], n)
        assert chosen == _choose_parity(turns, n)  # the finishing order does not matter
        assert len(chosen) == min(n, len(turns)) and len({t[0] for t in chosen}) == len(chosen)
        assert sum(t[4] for t in chosen) >= min(n // 2, sum(t[4] for t in turns))


def test_the_agent_experiment_configs_load_with_and_without_quick():
    for name in ("exp_007_multiturn", "exp_008_stress"):
        for quick in (False, True):
            cfg = config.load(f"experiments/{name}.toml", quick=quick)
            assert cfg.criteria and cfg.plots
    with pytest.raises(config.ConfigError, match="reference_turns"):
        config.load("experiments/exp_007_multiturn.toml", overrides=["params.reference_turns=[9]"])


def test_leaks_are_read_from_the_manifests_of_the_block_layout(tmp_path):
    from harness.trials.stress import _file_leaks
    from semantic.store import manifest_name

    def manifest(name, agent, tokens):
        doc = {"agent_id": agent, "token_ids": tokens, "extents": {"global": [["00000000000000aa", 0, len(tokens)]]}}
        (tmp_path / name).write_text(json.dumps({"semantic_kv_manifest": json.dumps(doc), "semantic_kv_xxh3_128": "0"}))

    canaries = {"a": (7, 8, 9, 10), "b": (11, 12, 13, 14)}
    manifest(manifest_name("a"), "a", [1, 2, 7, 8, 9, 10, 3])
    manifest(manifest_name("b"), "b", [1, 2, 11, 12, 13, 14])
    assert _file_leaks(tmp_path, canaries) == 0
    manifest(manifest_name("b"), "b", [1, 2, 11, 12, 13, 14, 7, 8, 9, 10])   # a's canary in b's cache
    assert _file_leaks(tmp_path, canaries) == 1
    manifest(manifest_name("c"), "a", [1, 2, 7, 8, 9, 10])                    # a's cache under c's name
    assert _file_leaks(tmp_path, canaries) == 2
