"""EXP-011's pure parts: sides taking turns, the loops' checks and table, the decode checks and schema."""

from __future__ import annotations

import asyncio

import pytest

from harness.trials.tool_loop.loops import BILLING_HEADER, Baton, Loop, billing_header, tool_result
from harness.trials.tool_loop.trial import decode_checks, decode_schema, headline, loop_checks, loop_table, reused_of_previous


def test_sides_take_turns_request_by_request_in_a_rotating_order():
    baton = Baton(["a", "b", "c"])

    async def side(name, requests):
        try:
            for _ in range(requests):
                async with baton.turn(name):
                    await asyncio.sleep(0)  # a request in flight: nobody else may start
        finally:
            await baton.leave(name)

    async def main():
        # started in reverse, and "c" stops after one request: the order is the baton's, not the tasks'
        await asyncio.gather(side("c", 1), side("b", 3), side("a", 3))

    asyncio.run(main())
    assert baton.log == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]


def test_the_tool_loop_inputs_are_fixed_and_the_billing_header_is_not():
    assert tool_result(3) == tool_result(3) != tool_result(4)
    first, second = billing_header(), billing_header()
    assert first.startswith(BILLING_HEADER) and first != second
    loop = Loop(0, "sys", 8, 96, 32, "agent")
    assert [loop.max_tokens(t) for t in (1, 7, 8)] == [96, 96, 32]


def _row(api, side, turn, prompt, cached, completion=20, calls=1, ttft=1.0, conversation=0, error=None):
    return {"side": side, "api": api, "conversation": conversation, "turn": turn, "choice": "required",
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion, "ttft_s": ttft,
            "e2e_s": ttft, "calls": calls, "text": "", "error": error}


def _loop(api, side, cached_after, turns=3, ttft=1.0, conversation=0):
    """A conversation whose prompt grows by 100 tokens a turn (20 of them the reply) and whose turn k
    finds ``cached_after(k, previous prompt + reply)`` tokens cached."""
    rows, prompt = [], 1000
    for t in range(1, turns + 1):
        cached = 0 if t == 1 else cached_after(t, prompt - 100 + 20)
        rows.append(_row(api, side, t, prompt, cached, calls=int(t < turns), ttft=ttft, conversation=conversation))
        prompt += 100
    return rows


def test_checks_take_the_worst_turn_after_the_first_and_count_our_misses():
    whole = lambda t, seen: seen  # noqa: E731  everything the server saw last turn
    cut = lambda t, seen: seen - 50  # noqa: E731  a re-rendered reply cut the cache short
    rows = (_loop("openai", "echo", whole) + _loop("openai", "no_echo", cut, ttft=2.0)
            + _loop("anthropic", "echo", whole) + _loop("openai", "mlx_lm", whole))
    checks = loop_checks(rows, turns=3)
    # turn 2: 1020 of 1100 cached; turn 3: 1120 of 1200
    assert checks["cached_ratio_min_openai_echo"] == pytest.approx(1020 / 1100)
    assert checks["cached_ratio_min_openai_no_echo"] == pytest.approx(970 / 1100)
    assert checks["reused_of_previous_min_openai_echo"] == 1.0
    assert checks["reused_of_previous_min_openai_no_echo"] == pytest.approx(970 / 1020)
    assert checks["turns_done_openai_mlx_lm"] == "3/3"
    assert checks["our_errors"] == 0 and checks["our_choice_misses"] == 0
    assert checks["ttft_echo_over_no_echo_openai"] == 0.5
    # the cold first turn is in the table, not in the checks
    table = loop_table(rows, turns=3)
    assert table["openai"]["echo"] == pytest.approx([0.0, 1020 / 1100, 1120 / 1200])
    assert list(table) == ["openai", "anthropic"] and list(table["openai"]) == ["echo", "no_echo", "mlx_lm"]


def test_an_error_ends_a_loop_and_counts_every_turn_it_left_unsent():
    rows = _loop("openai", "echo", lambda t, seen: seen, turns=4)[:2]
    rows.append(_row("openai", "echo", 3, None, None, error="APIConnectionError: refused"))
    rows += _loop("openai", "no_echo", lambda t, seen: seen, turns=4)
    rows[-1]["calls"] = 1  # the answer turn called a tool anyway
    rows.append(_row("openai", "mlx_lm", 1, 1000, 0, error="peer down"))  # a peer's error is not ours
    checks = loop_checks(rows, turns=4)
    assert checks["our_errors"] == 2 and checks["our_choice_misses"] == 1
    assert checks["turns_done_openai_echo"] == "2/4" and checks["turns_done_openai_mlx_lm"] == "0/4"
    assert checks["cached_ratio_min_openai_mlx_lm"] is None


def test_a_side_that_reports_no_cached_tokens_has_no_ratio_and_reuse_skips_a_missing_turn():
    rows = [_row("openai", "echo", 1, 1000, 0), _row("openai", "echo", 2, 1100, None),
            _row("openai", "echo", 4, 1300, 1290)]
    assert loop_checks(rows, turns=4)["cached_ratio_min_openai_echo"] is None
    assert reused_of_previous(rows) == {("openai", "echo", 0, 2): None}


def test_decode_checks_are_ratios_of_medians_and_the_token_budget_is_checked():
    got = {("free", 1): [{"decode_tps": 10.0, "tokens": [64]}, {"decode_tps": 12.0, "tokens": [64]}],
           ("json", 1): [{"decode_tps": 9.0, "tokens": [64]}, {"decode_tps": 10.0, "tokens": [64]}],
           ("free", 8): [{"decode_tps": 40.0, "tokens": [64] * 8}],
           ("json", 8): [{"decode_tps": 30.0, "tokens": [64] * 7 + [63]}]}
    checks = decode_checks(got, [1, 8], 64)
    assert checks["decode_json_over_free_b1"] == pytest.approx(9.5 / 11)
    assert checks["decode_json_over_free_b8"] == pytest.approx(0.75)
    assert checks["decode_tokens_equal"] is False


def test_the_decode_schema_cannot_end_before_its_item_count():
    from semantic.decode.constraint import Constraint, Grammar
    from tests.tiny_models import byte_tokenizer

    c = Constraint(Grammar.json_schema(decode_schema(3)), byte_tokenizer(), 256)
    for ch in '{"items": ["a", "b"':
        assert c.allowed()[ord(ch)], ch
        c.advance(ord(ch))
    assert not c.allowed()[ord("]")] and c.allowed()[ord(",")]  # two items of at least three: no closing yet


def test_headline_prints_the_table_and_the_decode_ratios():
    doc = {"outputs": {"by_turn": {"openai": {"echo": [0.0, 0.961, None]}}, "decode_batches": [1, 8]},
           "checks": {"decode_json_over_free_b1": 0.97, "decode_json_over_free_b8": None}}
    lines = headline(doc)
    assert lines[1].split() == ["openai", "echo", "0.000", "0.961", "-"]
    assert lines[2].endswith("batch 1: 0.970") and len(lines) == 3
