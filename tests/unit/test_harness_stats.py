"""Statistics, checked against values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from harness.stats import linear_fit, median_ci, summarize


def test_summary_of_one_to_ten_matches_hand_computed_percentiles():
    s = summarize(range(1, 11))
    # linear interpolation: q1 at rank 0.25*9 = 2.25 -> 3 + 0.25 = 3.25
    assert (s["n"], s["min"], s["max"], s["mean"], s["median"]) == (10, 1, 10, 5.5, 5.5)
    assert (s["q1"], s["q3"]) == (3.25, 7.75)
    assert s["p90"] == pytest.approx(9.1) and s["p95"] == pytest.approx(9.55) and s["p99"] == pytest.approx(9.91)
    assert s["std"] == pytest.approx(np.sqrt(sum((x - 5.5) ** 2 for x in range(1, 11)) / 9))
    # n = 10 < 8? no: l=0 gives P(1 <= B <= 9) = 1 - 2/1024 >= 0.99, l=1 gives
    # P(2 <= B <= 8) = 1 - 22/1024 = 0.9785 < 0.99, so the CI is [x(1), x(10)].
    assert (s["ci99_median_low"], s["ci99_median_high"]) == (1, 10)


def test_median_ci_of_a_hundred_samples_uses_ranks_37_and_64():
    # P(B <= 36) = 0.0033 for B ~ Bin(100, 1/2): ranks 37..64 cover 99.3%;
    # ranks 38..63 would cover only 98.8%.
    assert median_ci(range(1, 101)) == (37, 64)


def test_a_single_sample_has_zero_spread_and_bad_input_is_refused():
    s = summarize([4.0])
    assert (s["std"], s["median"], s["ci99_median_low"], s["ci99_median_high"]) == (0.0, 4.0, 4.0, 4.0)
    with pytest.raises(ValueError, match="no samples"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])


def test_linear_fit_recovers_an_exact_line_and_needs_two_distinct_x():
    fit = linear_fit([1, 2, 4, 8], [5, 7, 11, 19])
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(3) and fit["r2"] == pytest.approx(1)
    noisy = linear_fit([1, 2, 3, 4], [1, 3, 2, 4])
    assert 0 < noisy["r2"] < 1
    with pytest.raises(ValueError, match="2 distinct"):
        linear_fit([3, 3], [1, 2])
