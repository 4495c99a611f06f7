"""EXP-013's figures from its rows: the chain against the chat path per turn, the restart, the thinking model."""

from __future__ import annotations

import pytest

from harness.trials import responses_chain as K


def _row(c, t, side, ttft, prompt=100, cached=90):
    return {"conversation": c, "turn": t, "side": side, "ttft_s": ttft, "prompt_tokens": prompt,
            "cached_tokens": cached}


def test_the_worst_turns_median_ratio_of_chain_to_chat_and_the_restart_against_cold():
    rows = [_row(c, 1, s, 9.0) for c in (0, 1, 2) for s in ("chain", "chat")]
    rows += [_row(0, 2, "chain", 0.3), _row(0, 2, "chat", 0.3), _row(1, 2, "chain", 0.4), _row(1, 2, "chat", 0.2),
             _row(2, 2, "chain", 0.33), _row(2, 2, "chat", 0.3)]
    rows += [_row(-1, 3, "restart_chain", 0.5, 200, 198), _row(-1, 3, "restart_cold", 10.0, 200, 0)]
    c = K.chain_checks(rows)
    assert c["ttft_chain_over_chat_by_turn"] == [1.1]  # turn 1 is cold on both sides: not a follow-up
    assert c["ttft_chain_over_chat_max"] == pytest.approx(1.1)
    assert c["ttft_restart_over_cold"] == pytest.approx(0.05) and c["cached_ratio_restart"] == pytest.approx(0.99)


def test_the_thinking_models_smallest_cached_share_after_the_first_turn_per_side():
    rows = [{"side": s, "turn": t, "prompt_tokens": 100 * t, "cached_tokens": 0 if t == 1 else 96 * t - 10}
            for s in ("echo", "no_echo") for t in (1, 2, 3)]
    c = K.think_checks(rows)
    assert c["think_cached_ratio_min_echo"] == pytest.approx(182 / 200)
