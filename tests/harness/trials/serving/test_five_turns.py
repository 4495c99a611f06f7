"""EXP-009's five turns past a sliding window: the messages each turn sends, and the checks judged on them."""

from __future__ import annotations

import pytest

from harness.servers.phases import FIVE_TURNS, five_turn_messages
from harness.trials.serving.report import five_turns_checks, five_turns_table

SYSTEM = {"role": "system", "content": "sys"}
QS = [{"role": "user", "content": f"q{i}"} for i in range(1, 5)]


def _said(text):
    return {"role": "assistant", "content": text}


def test_the_five_turns_are_cold_append_regenerate_edit_and_the_first_branch_continued():
    replies = {1: "a1", 2: "a2", 3: "a2 again", 4: "a2 edited"}
    turns = [five_turn_messages(k, SYSTEM, QS, replies) for k in range(1, 6)]
    t1 = [SYSTEM, QS[0]]
    t2 = t1 + [_said("a1"), QS[1]]
    assert turns == [t1, t2, t2, t1 + [_said("a1"), QS[2]], t2 + [_said("a2"), QS[3]]]
    assert FIVE_TURNS == ("first", "append", "regenerate", "edit", "branch")


def test_a_turn_needs_only_the_replies_it_builds_on():
    assert five_turn_messages(1, SYSTEM, QS, {}) == [SYSTEM, QS[0]]
    assert five_turn_messages(4, SYSTEM, QS, {1: "a1"})[-1] == QS[2]
    with pytest.raises(ValueError, match=r"turns \[2\]"):
        five_turn_messages(5, SYSTEM, QS, {1: "a1"})
    with pytest.raises(ValueError, match="1..5"):
        five_turn_messages(6, SYSTEM, QS, {1: "a1", 2: "a2"})
    with pytest.raises(ValueError, match="4 user messages"):
        five_turn_messages(1, SYSTEM, QS[:3], {})


def _row(turn, ours, theirs, equal=True, fresh_cached=0):
    cell = lambda cached, ttft: {"prompt_tokens": 600, "cached_tokens": cached, "ttft_s": ttft,  # noqa: E731
                                 "reply": "r", "error": None}
    return {"user": 0, "turn": turn, "kind": FIVE_TURNS[turn - 1],
            "servers": {"semantic": cell(*ours), "mlx_lm.server": cell(*theirs)},
            "fresh": {**cell(fresh_cached, 5.0), "equal": equal}}


def test_checks_take_the_smallest_cached_margin_and_the_worst_warm_turn_ratio():
    # two repeats; turn 1 (cold) is slower for us but reported apart; turn 3 is the worst warm ratio
    rows = [_row(1, (0, 4.0), (0, 2.0)), _row(2, (590, 0.5), (584, 1.0)), _row(3, (597, 0.6), (597, 0.4)),
            _row(1, (0, 4.0), (0, 2.0)), _row(2, (590, 0.5), (584, 1.0)), _row(3, (596, 0.6), (597, 0.4), False)]
    table = five_turns_table(rows)
    assert [(t["turn"], t["semantic"]["cached_tokens"], t["mlx_lm.server"]["ttft_s"]) for t in table] == [
        (1, 0, 2.0), (2, 590, 1.0), (3, 596.5, 0.4)]
    checks = five_turns_checks(rows, table)
    assert checks["five_turns_cached_ge_mlx_lm"] == -1
    assert checks["five_turns_ttft_vs_mlx_lm"] == pytest.approx(1.5)
    assert checks["five_turns_ttft_vs_mlx_lm_by_turn"] == pytest.approx({"1_first": 2.0, "2_append": 0.5,
                                                                         "3_regenerate": 1.5})
    assert checks["five_turns_replies_equal_fresh"] == 1 and checks["five_turns_fresh_cached_max"] == 0


def test_a_peer_that_reports_no_cached_tokens_gives_no_margin():
    rows = [_row(1, (0, 4.0), (None, 2.0)), _row(2, (590, 0.5), (None, 1.0))]
    checks = five_turns_checks(rows, five_turns_table(rows))
    assert checks["five_turns_cached_ge_mlx_lm"] is None and checks["five_turns_ttft_vs_mlx_lm"] == 0.5
