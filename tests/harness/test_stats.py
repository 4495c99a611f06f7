"""Statistics, checked against values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from harness.stats import linear_fit, median_ci, summarize


def test_summary_of_one_to_ten_matches_hand_computed_percentiles():
    s = summarize(range(1, 11))
    # linear interpolation: q1 at rank 0.25*9 = 2.25 -> 3 + 0.25 = 3.25; p90 at 8.1 -> 9.1
    assert (s["n"], s["min"], s["max"], s["mean"], s["median"]) == (10, 1, 10, 5.5, 5.5)
    assert (s["q1"], s["q3"]) == (3.25, 7.75)
    assert s["p90"] == pytest.approx(9.1) and s["p95"] == pytest.approx(9.55) and s["p99"] == pytest.approx(9.91)
    # sum of squared deviations = 82.5, over n-1 = 9
    assert s["std"] == pytest.approx(np.sqrt(82.5 / 9))
    # B ~ Bin(10, 1/2): l=0 gives P(1 <= B <= 9) = 1 - 2/1024 = 0.998 >= 0.99, l=1
    # gives P(2 <= B <= 8) = 1 - 22/1024 = 0.9785 < 0.99, so the CI is [x(1), x(10)].
    assert (s["ci99_median_low"], s["ci99_median_high"]) == (1, 10)


def test_median_ci_of_twenty_samples_uses_ranks_4_and_17():
    # B ~ Bin(20, 1/2): P(B <= 3) = (1+20+190+1140)/2**20 = 0.00129, so ranks 4..17
    # cover 1 - 2*0.00129 = 99.74%; P(B <= 4) = 6196/2**20 = 0.00591, so ranks
    # 5..16 would cover only 98.82%.
    assert median_ci(np.arange(20, 0, -1)) == (4, 17)


def test_median_ci_of_a_hundred_samples_uses_ranks_37_and_64():
    # P(B <= 36) = 0.0033 for B ~ Bin(100, 1/2): ranks 37..64 cover 99.3%;
    # ranks 38..63 would cover only 98.8%.
    assert median_ci(range(1, 101)) == (37, 64)


def test_below_eight_samples_the_median_ci_is_the_whole_range():
    # n = 8: [min, max] covers 1 - 2/256 = 99.2%, the next pair 1 - 18/256 = 93%.
    # n = 7: even [min, max] covers only 1 - 2/128 = 98.4%; we still return it.
    assert median_ci([5, 1, 2, 3, 4, 6, 7, 8]) == (1, 8)
    assert median_ci([5, 1, 2, 3, 4, 6, 7]) == (1, 7)
    assert median_ci([3.0]) == (3.0, 3.0)


def test_a_single_sample_has_zero_spread_and_bad_input_is_refused():
    s = summarize([4.0])
    assert (s["std"], s["median"], s["ci99_median_low"], s["ci99_median_high"]) == (0.0, 4.0, 4.0, 4.0)
    with pytest.raises(ValueError, match="no samples"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, float("inf")])


def test_linear_fit_recovers_an_exact_line_and_needs_two_distinct_x():
    fit = linear_fit([1, 2, 4, 8], [5, 7, 11, 19])
    assert fit["slope"] == pytest.approx(2) and fit["intercept"] == pytest.approx(3)
    assert fit["r2"] == pytest.approx(1) and fit["stderr"] == pytest.approx(0, abs=1e-12) and fit["n"] == 4
    # y = 1,3,2,4 on x = 1..4: slope = Sxy/Sxx = 4/5 = 0.8, intercept = 2.5 - 0.8*2.5 = 0.5,
    # r = 4 / sqrt(5 * 5) = 0.8, so R² = 0.64.
    noisy = linear_fit([1, 2, 3, 4], [1, 3, 2, 4])
    assert (noisy["slope"], noisy["intercept"], noisy["r2"]) == pytest.approx((0.8, 0.5, 0.64))
    with pytest.raises(ValueError, match="2 distinct"):
        linear_fit([3, 3], [1, 2])
    with pytest.raises(ValueError, match="paired"):
        linear_fit([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="finite"):
        linear_fit([1, 2, float("nan")], [1, 2, 3])


def test_a_flat_line_fits_exactly_instead_of_giving_nan():
    assert linear_fit([1, 2, 3], [7, 7, 7]) == {"slope": 0.0, "intercept": 7.0, "r2": 1.0, "stderr": 0.0, "n": 3}
