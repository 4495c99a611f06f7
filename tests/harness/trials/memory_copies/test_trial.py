"""EXP-023's arithmetic: KV bytes a token from a geometry's config, prompts a token a character, copies."""

from __future__ import annotations

import json

from harness.trials.memory_copies.trial import kv_bytes_per_token, summary, text


def test_kv_bytes_a_token_are_every_layer_s_k_and_v_in_the_model_s_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 48, "num_key_value_heads": 4,
                                                     "head_dim": 128, "hidden_size": 64,
                                                     "num_attention_heads": 4, "torch_dtype": "bfloat16"}))
    assert kv_bytes_per_token(tmp_path) == 96 * 1024   # Qwen3-Coder-30B-A3B's 96 KiB


def test_a_prompt_has_the_characters_asked_and_the_same_seed_gives_the_same_text():
    assert len(text(1000, 3)) == 1000 and text(1000, 3) == text(1000, 3) != text(1000, 4)


def test_the_summary_reads_the_first_turn_apart_from_the_appends():
    turns = [{"turn": 0, "peak_x_kv": 1.5, "after_x_kv": 1.0, "seconds": 9.0},
             {"turn": 1, "peak_x_kv": 2.2, "after_x_kv": 1.9, "seconds": 2.0},
             {"turn": 2, "peak_x_kv": 2.0, "after_x_kv": 2.1, "seconds": 3.0}]
    s = summary({"sides": {"ours": {"idle_rss_bytes": 1 << 20, "turns": turns}}})["ours"]
    assert (s["first_peak_x_kv"], s["append_peak_x_kv"], s["append_after_x_kv_max"], s["last_after_x_kv"]) == \
        (1.5, 2.2, 2.1, 2.1)
    assert s["append_seconds_median"] == 3.0 and s["idle_rss_mb"] == 1.0


def test_the_idle_baseline_is_taken_after_the_warm_up_not_from_the_samples_during_it():
    import os

    from harness.trials.memory_copies.trial import settled_rss
    from harness.trials.multi_model.sampler import MemorySampler

    with MemorySampler(os.getpid, None, interval_s=0.01, phase="idle") as sampler:
        warm_up = bytearray(256 << 20)  # a warm-up turn's working memory, written so that it is resident
        sampler.wait_samples(15)
        del warm_up
        idle = settled_rss(sampler, 5)
        during = max(r["rss_bytes"] for r in sampler.rss if r["phase"] == "idle")
    assert during - idle > 200 << 20
    assert sum(r["phase"] == "settled" for r in sampler.rss) >= 5
