"""How the matrix judges a turn against mlx-lm's reference: within the noise measured beside it, or, where
mlx-lm's own variants disagree beyond float noise, within the tightest tolerance against its one-token decode
(and the table says which types were judged so). No model is served here."""

from __future__ import annotations

import pytest

from harness import noise
from harness.matrix.check import ModelResult, TurnResult, judge
from harness.matrix.run import table


def _ref(noise_: float) -> noise.Reference:
    return noise.Reference(tokens=[5, 9], logprobs=[-1.0, -2.0], margins=[1.0, 1.0], noise=noise_)


def test_a_turn_is_held_to_the_noise_measured_beside_its_reference():
    assert judge(_ref(1e-3), [5, 9], [-1.002, -2.0], "t") == (2, True, pytest.approx(4e-3))
    assert judge(_ref(1e-3), [5, 9], [-1.01, -2.0], "t")[1] is False


def test_where_mlx_lms_own_variants_disagree_the_turn_is_held_to_its_one_token_decode_within_the_floor():
    compared, exact, tol = judge(_ref(0.3), [5, 9], [-1.0 - 5e-7, -2.0], "t")
    assert (compared, exact, tol) == (2, True, noise.FLOOR)
    assert judge(_ref(0.3), [5, 9], [-1.0002, -2.0], "t")[1] is False   # 2e-4: inside 0.3's noise, not the floor
    assert judge(_ref(0.3), [5, 7], [-1.0, -2.5], "t")[1] is False      # another token, no near-tie


def test_the_table_marks_a_type_judged_without_measured_noise():
    def result(t, n):
        return ModelResult(t, True, ["global"], [TurnResult("append", "a", 10, 9, 9, True, 0.0, n, noise.FLOOR)])

    text = table([result("gemma3n", 0.35), result("llama", 1e-6)])
    assert "| gemma3n | global | yes† |" in text and "| llama | global | yes |" in text
    assert "† gemma3n:" in text and text.startswith("2 of 2 model types pass every check")
