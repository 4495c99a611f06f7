"""EXP-022's RAM budget: a return finds its agent's cache gone from RAM (``commit_compare.trial.ram_mb``)."""

from __future__ import annotations

import json

from harness.trials.commit_compare.trial import ram_mb


def test_the_ram_budget_counts_attention_layers_only_and_grows_with_agents(tmp_path):
    attn = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(attn))
    one = ram_mb(tmp_path, 1.0, 2048)
    assert one * (1 << 20) >= 2 * 4 * 2 * 64 * 4 * 2048  # K and V, 4 layers, 2 heads of 64, float32 (and slack)
    assert ram_mb(tmp_path, 2.0, 2048) == 2 * one
    hybrid = {**attn, "layer_types": ["conv", "full_attention", "conv", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(hybrid))
    assert ram_mb(tmp_path, 2.0, 2048) == one  # the convolution layers' states are not counted
